"""Secure aggregation inside buffers of clients: the threshold protocol (Bonawitz et al. 2017, per buffer).

One implementation serves every strategy that learns only buffer sums: the :class:`fedpdm_flower.strategies.wrappers.SecureBuffers`
wrapper (any Flower strategy) and FedREP's buffers (:class:`fedpdm_flower.strategies.fedrep.FedREP`, Yang, Wang, Li, arXiv
2303.05206, Sec. 3.3). This module is its Flower-free math; the message plumbing is in
:mod:`fedpdm_flower.strategies.secure` (server) and :mod:`fedpdm_flower.clients.secure` (device).

Per round and buffer (members sorted by client id, size s, threshold t with 2t > s and t >= 2):

1. **keys**: each member makes a fresh key pair (:func:`new_keypair`) and signs (run label, round, its id, its
   public key) with its long-term Ed25519 identity (:class:`NodeIdentity`, :func:`signing_statement`); the server
   forwards the signed keys of the buffer-mates, and a member accepts only mates whose signature verifies against
   its own :class:`TrustStore` (whoever writes the trust store decides who the peers are);
2. **masked input** (:func:`mask_input`): y_i = q(x_i) + PRG(b_i) + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij)
   (mod 2^32), with b_i a fresh self-mask seed and s_ij the pairwise seed (ECDH + HKDF); b_i is Shamir-shared
   t-of-s among the members (its own share kept), each share encrypted for its holder (AES-GCM under the pairwise
   channel key), and the upload carries a SHA-256 commitment to b_i;
3. **unmask** (:func:`reveal`): told which members survived, each survivor reveals, for every peer, EITHER its share
   of b_j (j survived) OR its pairwise seed s_ij (j dropped) -- never both, and only once per round. The server
   rebuilds b_i of every survivor from t shares, checks it against the commitment and removes the masks of the
   dropped (:func:`rebuild_sum`): it learns the survivors' sum, nothing else.

Why a survivor is never unmasked alone: its y_i still carries the pairwise masks with the other survivors, which
nobody reveals; with fewer than t (>= 2) survivors no self-mask can be rebuilt, and the buffer is discarded. A member
told "j dropped" reveals s_ij but never b_j's share, so a late upload of j stays behind PRG(b_j). With s = 2 (FedREP's
default) t = 2: a dropout discards its buffer, which no protocol can avoid (the lone survivor's sum is its vector).

Cryptography (nothing home-made):

* key agreement: Flower's EC key pairs (SECP384R1, PEM) and ``generate_shared_key`` (ECDH + HKDF-SHA256, 32 bytes);
* signatures: Ed25519 (``cryptography``); share encryption: AES-256-GCM; secret sharing: pycryptodome's Shamir
  over GF(2^128);
* mask expansion (:func:`expand_mask`): HKDF-SHA256 of the full 32-byte seed with a label naming run, round and
  buffer (:func:`round_label`), then the ChaCha20 key stream. Flower's ``pseudo_rand_gen`` is *not* used: it
  XOR-folds the key to a 32-bit seed of numpy's Mersenne Twister, so a curious server could recover a mask by
  trying 2^32 seeds.

Encoding: clip to ``[-c, c]`` (``c = 8``), stochastic rounding of ``(x + c)(Q - 1)/(2c)`` with ``Q = 2^22``
levels, modulus ``M = 2^32``; ``s * Q < M`` is required so a buffer sum never wraps. The decoded mean is within
``2c/(Q - 1)`` (about 3.8e-6) of the mean of the clipped inputs, and unbiased. Clipping is never silent: with
:data:`S_COUNT` each member appends the number of its coordinates beyond ``c`` (:func:`encode_counted`), and the
server reports the buffer totals each round.

Caller obligations: a member masks at most one vector per (key pair, label) -- a fresh key pair per round and one
masked upload per round guarantee it (two uploads under the same masks would reveal the difference of the two
vectors); and it answers at most one unmask request per round.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast, overload

import numpy as np
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "DEFAULT_CLIP",
    "DEFAULT_LEVELS",
    "MODULUS",
    "MaskedInput",
    "NodeIdentity",
    "TrustStore",
    "buffer_partition",
    "check_buffer",
    "check_public_key",
    "check_threshold",
    "combine_secret",
    "decode_exact",
    "decrypt_share",
    "default_threshold",
    "dequantize",
    "derive",
    "encode_counted",
    "encode_exact",
    "encrypt_share",
    "expand_mask",
    "mask_input",
    "metric_tail",
    "new_keypair",
    "pair_seed",
    "pairwise_key",
    "quantize",
    "read_tail",
    "rebuild_sum",
    "reveal",
    "round_label",
    "self_mask",
    "signing_statement",
    "split_counted",
    "split_secret",
    "tail_size",
    "threshold_masked_upload",
    "unmask_sum",
]

DEFAULT_CLIP = 8.0
"""Clipping range ``c``: values are clipped to ``[-c, c]`` before quantization (spec 11.19)."""
DEFAULT_LEVELS = 2**22
"""Quantization levels ``Q``: a value maps to an integer in ``[0, Q - 1]`` (spec 11.19)."""
MODULUS = 2**32
"""Modulus ``M`` of the masked arithmetic: uint32 wraparound."""

KEY_BYTES = 32

# --- the wire vocabulary of the protocol (config keys and record names), shared by both ends -----------------------
#: config keys of the protocol's messages: phase ("keys" / "mask" / "unmask"), run label, round, buffer id, members
#: (JSON list of client ids), threshold t, the fixed-point code, and the unmask request's survivors / dropped
S_PHASE, S_RUN, S_ROUND, S_BUFFER, S_MEMBERS, S_THRESHOLD, S_CLIP, S_LEVELS, S_SURVIVORS, S_DROPPED = (
    "secure.phase", "secure.run", "secure.round", "secure.buffer", "secure.members", "secure.threshold",
    "secure.clip", "secure.levels", "secure.survivors", "secure.dropped",
)
#: config key of a mask request: true when each member appends to its quantized vector the number of its
#: coordinates the fixed-point code clipped (:func:`encode_counted`), so the buffer sum reports them
S_COUNT = "secure.count-clipped"
#: the names of the protocol's ArrayRecord and (in key replies) ConfigRecord
S_RECORD, S_INFO = "secure", "secure-info"
#: config keys of a mask request that asks the device to carry its train metrics in the masked vector (SecureBuffers,
#: DistributedDP): the weighting key ("num-examples") and, for a weighted model mean, the largest weight W (the
#: device scales its update by its weight / W, as Flower's SecAgg+ does)
S_WEIGHT_KEY, S_MAX_WEIGHT = "secure.weight-key", "secure.max-weight"
#: the ConfigRecord of a masked upload naming the metrics carried in its tail: {"metrics": JSON [[name, length], ...]}
#: (length -1: a scalar); the tail is encode_exact([weight, weight * metrics..., clipped coordinates])
S_TAIL = "secure-tail"

# --- key agreement (Flower's primitives) -------------------------------------------------------------------------

_PrivateKey = ec.EllipticCurvePrivateKey
_PublicKey = ec.EllipticCurvePublicKey
_KEYPAIR_NAMES = (
    "generate_key_pairs",
    "private_key_to_bytes",
    "bytes_to_private_key",
    "public_key_to_bytes",
    "bytes_to_public_key",
)
# Where Flower keeps its EC key-pair helpers: flwr 1.41/1.42 in supercore, older releases beside the shared-key
# function. (flwr.supercore.primitives.asymmetric_ed25519 has Ed25519 signing keys, which cannot do ECDH.)
_KEYPAIR_MODULES = (
    "flwr.supercore.primitives.asymmetric",
    "flwr.common.secure_aggregation.crypto.asymmetric",
    "flwr.common.secure_aggregation.crypto.symmetric_encryption",
)
_SHARED_KEY_MODULE = "flwr.common.secure_aggregation.crypto.symmetric_encryption"


def _find(modules: Sequence[str], names: Sequence[str]) -> dict[str, Any] | None:
    """The functions ``names`` from the first of ``modules`` that has all of them, or None."""
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if all(callable(getattr(module, name, None)) for name in names):
            return {name: getattr(module, name) for name in names}
    return None


def _cryptography_keypair_helpers() -> dict[str, Any]:
    """The same helpers as Flower's (SECP384R1, PEM/PKCS8/SubjectPublicKeyInfo), for a flwr without them."""

    def generate_key_pairs() -> tuple[_PrivateKey, _PublicKey]:
        private_key = ec.generate_private_key(ec.SECP384R1())
        return private_key, private_key.public_key()

    def private_key_to_bytes(private_key: _PrivateKey) -> bytes:
        return private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def bytes_to_private_key(data: bytes) -> _PrivateKey:
        return cast(_PrivateKey, serialization.load_pem_private_key(data, password=None))

    def public_key_to_bytes(public_key: _PublicKey) -> bytes:
        return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def bytes_to_public_key(data: bytes) -> _PublicKey:
        return cast(_PublicKey, serialization.load_pem_public_key(data))

    return {
        "generate_key_pairs": generate_key_pairs,
        "private_key_to_bytes": private_key_to_bytes,
        "bytes_to_private_key": bytes_to_private_key,
        "public_key_to_bytes": public_key_to_bytes,
        "bytes_to_public_key": bytes_to_public_key,
    }


def _cryptography_shared_key(private_key: _PrivateKey, public_key: _PublicKey) -> bytes:
    """Flower's ``generate_shared_key`` (ECDH, HKDF-SHA256 without salt or info, urlsafe base64), for a flwr
    without it."""
    secret = private_key.exchange(ec.ECDH(), public_key)
    return base64.urlsafe_b64encode(HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=None).derive(secret))


_KEYPAIR = _find(_KEYPAIR_MODULES, _KEYPAIR_NAMES) or _cryptography_keypair_helpers()
_SHARED = _find((_SHARED_KEY_MODULE,), ("generate_shared_key",))
_generate_key_pairs = cast(Callable[[], tuple[_PrivateKey, _PublicKey]], _KEYPAIR["generate_key_pairs"])
_private_key_to_bytes = cast(Callable[[_PrivateKey], bytes], _KEYPAIR["private_key_to_bytes"])
_bytes_to_private_key = cast(Callable[[bytes], _PrivateKey], _KEYPAIR["bytes_to_private_key"])
_public_key_to_bytes = cast(Callable[[_PublicKey], bytes], _KEYPAIR["public_key_to_bytes"])
_bytes_to_public_key = cast(Callable[[bytes], _PublicKey], _KEYPAIR["bytes_to_public_key"])
_generate_shared_key = cast(
    Callable[[_PrivateKey, _PublicKey], bytes],
    _SHARED["generate_shared_key"] if _SHARED is not None else _cryptography_shared_key,
)


def new_keypair() -> tuple[bytes, bytes]:
    """A fresh EC key pair (SECP384R1) as ``(private PEM bytes, public PEM bytes)``.

    Make one per member and round; send the public bytes (signed, :func:`signing_statement`) with the key reply,
    keep the private bytes (in the device's ``Context.state``) until the round's unmask step and then forget them.
    """
    private_key, public_key = _generate_key_pairs()
    return _private_key_to_bytes(private_key), _public_key_to_bytes(public_key)


def _load_public_key(public_key: bytes) -> _PublicKey:
    try:
        key = _bytes_to_public_key(bytes(public_key))
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise ValueError(f"not a PEM public key: {err}") from err
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP384R1):
        raise ValueError("public key must be an EC key on SECP384R1, as made by new_keypair")
    return key


def check_public_key(public_key: bytes) -> None:
    """Raise ``ValueError`` unless ``public_key`` is a PEM SECP384R1 public key (what :func:`new_keypair` makes).

    The server checks every key before forwarding it, so a client cannot make its buffer-mates fail; a device checks
    each mate's key again (the server is not trusted).
    """
    _load_public_key(public_key)


def pairwise_key(private_key: bytes, peer_public: bytes) -> bytes:
    """The 32-byte key a client shares with one buffer-mate: Flower's ``generate_shared_key`` (ECDH + HKDF-SHA256),
    base64-decoded. Symmetric: ``pairwise_key(sk_i, pk_j) == pairwise_key(sk_j, pk_i)``. A malformed peer key
    raises ``ValueError``."""
    shared = _generate_shared_key(_bytes_to_private_key(private_key), _load_public_key(peer_public))
    key = base64.urlsafe_b64decode(shared)
    if len(key) != KEY_BYTES:  # pragma: no cover - guards against a changed Flower primitive
        raise RuntimeError(f"generate_shared_key returned {len(key)} bytes, expected {KEY_BYTES}")
    return key


# --- masks -------------------------------------------------------------------------------------------------------


def expand_mask(key32: bytes, label: bytes, n: int) -> NDArray[np.uint32]:
    """``n`` pseudo-random uint32 words from a 32-byte pairwise key and a label.

    HKDF-SHA256 (no salt, ``info = label``) derives a single-use ChaCha20 key from all 256 bits of ``key32``; its
    key stream (``4 n`` bytes) is read as little-endian uint32.
    """
    if len(key32) != KEY_BYTES:
        raise ValueError(f"pairwise key must be {KEY_BYTES} bytes, got {len(key32)}")
    if n < 0:
        raise ValueError(f"mask length must be >= 0, got {n}")
    stream_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=label).derive(key32)
    # A zero nonce (ChaCha20's 16-byte counter||nonce block) is safe: stream_key is used for exactly one key
    # stream, since it is derived from one (pair key, label) and a client masks one vector per label.
    encryptor = Cipher(algorithms.ChaCha20(stream_key, bytes(16)), mode=None).encryptor()
    stream = encryptor.update(bytes(4 * n)) + encryptor.finalize()
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32)


# --- encoding ----------------------------------------------------------------------------------------------------


def _check_capacity(count: int, levels: int) -> None:
    """A sum of ``count`` values in ``[0, levels - 1]`` must not wrap mod ``M``: ``count * levels < M``."""
    if levels < 2:
        raise ValueError(f"levels must be >= 2, got {levels}")
    if count * levels >= MODULUS:
        raise ValueError(f"buffer size {count} times levels {levels} must be < 2^32, or the buffer sum wraps")


def quantize(
    x: ArrayLike, rng: np.random.Generator, clip: float = DEFAULT_CLIP, levels: int = DEFAULT_LEVELS
) -> NDArray[np.uint32]:
    """Clip ``x`` to ``[-clip, clip]`` and stochastically round ``(x + clip)(levels - 1)/(2 clip)`` to an integer in
    ``[0, levels - 1]``: up with probability equal to the fractional part, so ``E[dequantize(quantize(x))] ==
    clip(x)``. Draws exactly ``x.size`` uniforms from ``rng``. NaN raises ``ValueError``; +-inf clip."""
    _check_capacity(1, levels)
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    values = np.asarray(x, dtype=np.float64)
    if np.isnan(values).any():
        raise ValueError("cannot quantize NaN")
    scaled = (np.clip(values, -clip, clip) + clip) * ((levels - 1) / (2 * clip))
    floor = np.floor(scaled)
    up = rng.random(values.shape) < (scaled - floor)
    rounded: NDArray[np.float64] = np.minimum(floor + up, levels - 1)
    return rounded.astype(np.uint32)


def encode_counted(
    x: ArrayLike, members: int, rng: np.random.Generator, clip: float = DEFAULT_CLIP, levels: int = DEFAULT_LEVELS
) -> NDArray[np.uint32]:
    """:func:`quantize` of ``x`` with one more entry: how many coordinates had ``|x_j| > clip`` and were clipped.

    The count travels on the ring like any entry, so a buffer's unmasked sum holds the buffer's total in its last
    entry (:func:`split_counted`): the server learns how many coordinates of the buffer did not fit, never whose.
    ``members`` is the buffer size (a sum of ``members`` quantized entries and counts must not wrap).
    """
    values = np.asarray(x, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"x must be 1-D, got shape {values.shape}")
    _check_capacity(members, levels)
    if members * (values.size + 1) >= MODULUS:
        raise ValueError(f"a buffer of {members} cannot count clipped entries of {values.size} coordinates mod 2^32")
    q = quantize(values, rng, clip, levels)  # NaN raises here
    clipped = int(np.count_nonzero(np.abs(values) > clip))
    return np.append(q, np.uint32(clipped)).astype(np.uint32)


def split_counted(total: ArrayLike) -> tuple[NDArray[np.uint32], int]:
    """(the quantized sum, the number of clipped coordinates) of a buffer sum of :func:`encode_counted` vectors."""
    t = np.asarray(total, dtype=np.uint32)
    if t.ndim != 1 or t.size < 1:
        raise ValueError("a counted sum has at least its count entry")
    return t[:-1], int(t[-1])


def dequantize(
    q: ArrayLike, count: int = 1, clip: float = DEFAULT_CLIP, levels: int = DEFAULT_LEVELS
) -> NDArray[np.float64]:
    """The mean of ``count`` vectors whose quantized values sum to ``q``: ``(q 2c/(levels - 1) - count c)/count``.

    With ``count = 1`` this inverts :func:`quantize` up to the rounding step ``2c/(levels - 1)``.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    total = np.asarray(q, dtype=np.float64) * (2 * clip / (levels - 1)) - count * clip
    return total / count


# --- exact sums beside a masked vector -----------------------------------------------------------------------------
#: fraction bits of the fixed-point code of :func:`encode_exact` (resolution 2^-24, about 6e-8)
EXACT_FRACTION_BITS = 24
#: bits per limb: a limb position of up to 2^16 summed vectors stays below 2^32, so the ring never wraps it
EXACT_LIMB_BITS = 16
#: limbs per value: the 64-bit two's-complement code in four 16-bit pieces
EXACT_LIMBS = 4
#: the largest magnitude :func:`encode_exact` takes: 2^(63 - 24), about 5.5e11
EXACT_MAX = 2.0 ** (63 - EXACT_FRACTION_BITS)


def encode_exact(values: ArrayLike) -> NDArray[np.uint32]:
    """Values on the ring so that a masked sum of them decodes exactly (:func:`decode_exact`), whatever their size.

    Each value becomes ``round(v 2^24)`` as a 64-bit two's-complement integer, split into four 16-bit limbs (low
    first), each limb one ring element. Adding such vectors adds the limbs position by position without carries:
    with at most 2^16 addends no limb sum reaches 2^32, and :func:`decode_exact` recombines them into the exact
    fixed-point sum. Used for what must add up exactly beside a quantized vector: a client's weight and its weighted
    metrics (:class:`fedpdm_flower.strategies.wrappers.SecureBuffers`), its count of clipped coordinates.

    The sums must stay below :data:`EXACT_MAX` in magnitude as well (a weight times a metric below 5.5e11, summed
    over a buffer). Raises ValueError for a non-finite value or one beyond :data:`EXACT_MAX`.
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(v)):
        raise ValueError("encode_exact needs finite values")
    if np.any(np.abs(v) >= EXACT_MAX):
        raise ValueError(f"encode_exact takes values below {EXACT_MAX:.3g} in magnitude, got {np.max(np.abs(v)):.3g}")
    code = np.round(v * 2.0**EXACT_FRACTION_BITS).astype(np.int64).view(np.uint64)
    mask = np.uint64((1 << EXACT_LIMB_BITS) - 1)
    limbs = [(code >> np.uint64(EXACT_LIMB_BITS * j)) & mask for j in range(EXACT_LIMBS)]
    return np.stack(limbs, axis=1).reshape(-1).astype(np.uint32)


def decode_exact(total: ArrayLike, count: int) -> NDArray[np.float64]:
    """The exact sum of ``count`` vectors of :func:`encode_exact` from the ring sum of their codes (``total``,
    mod 2^32, 4 limbs per value). Raises ValueError for more than 2^16 addends (their limbs could wrap)."""
    if not 1 <= count <= 1 << EXACT_LIMB_BITS:
        raise ValueError(f"decode_exact sums 1..{1 << EXACT_LIMB_BITS} vectors, got {count}")
    t = np.asarray(total, dtype=np.uint32).reshape(-1)
    if t.size % EXACT_LIMBS:
        raise ValueError(f"an exact code has {EXACT_LIMBS} limbs per value, got {t.size} limbs")
    out = []
    for limbs in t.reshape(-1, EXACT_LIMBS):
        whole = sum(int(limb) << (EXACT_LIMB_BITS * j) for j, limb in enumerate(limbs)) % (1 << 64)
        signed = whole - (1 << 64) if whole >= 1 << 63 else whole
        out.append(signed / 2.0**EXACT_FRACTION_BITS)
    return np.asarray(out, dtype=np.float64)


def metric_tail(metrics: Mapping[str, Any], weight_key: str) -> tuple[list[tuple[str, int]], NDArray[np.float64]]:
    """A device's train metrics as what its masked upload carries: ``(declaration, values)``.

    ``declaration`` names the metrics other than the weight, sorted, with their list lengths (-1: a scalar);
    ``values`` is ``[w, w m_1, w m_2, ...]`` (lists flattened in order), w = ``metrics[weight_key]``: the buffer's sum
    of them gives the buffer's weight and the numerators of Flower's weighted mean (``aggregate_metricrecords``).
    Raises ValueError for a missing or non-positive weight or a value that is not a finite number (or list of them).
    """
    w = metrics.get(weight_key)
    if isinstance(w, bool) or not isinstance(w, int | float) or not np.isfinite(w) or w <= 0:
        raise ValueError(f"the train metrics must carry the weight {weight_key!r} as a finite number > 0, got {w!r}")
    declaration: list[tuple[str, int]] = []
    values: list[float] = [float(w)]
    for name in sorted(k for k in metrics if k != weight_key):
        v = metrics[name]
        items = v if isinstance(v, list) else [v]
        if any(isinstance(x, bool) or not isinstance(x, int | float) or not np.isfinite(x) for x in items):
            raise ValueError(f"train metric {name!r} = {v!r} is not a finite number or a list of them")
        declaration.append((str(name), len(items) if isinstance(v, list) else -1))
        values.extend(float(w) * float(x) for x in items)
    return declaration, np.asarray(values, dtype=np.float64)


def tail_size(declaration: Sequence[tuple[str, int]]) -> int:
    """Ring elements of the tail of a declaration: the weight, the weighted metrics and the clipped-coordinate count,
    :data:`EXACT_LIMBS` limbs each."""
    return EXACT_LIMBS * (2 + sum(max(1, int(length)) for _, length in declaration))


def read_tail(sums: NDArray[np.float64], declaration: Sequence[tuple[str, int]]
              ) -> tuple[float, dict[str, float | list[float]], float]:
    """``(total weight, {name: weighted mean}, clipped coordinates)`` from the decoded sum of a buffer's tails."""
    total = float(sums[0])
    if not total > 0:
        raise ValueError(f"the buffer's total weight is {total:g}")
    means: dict[str, float | list[float]] = {}
    pos = 1
    for name, length in declaration:
        n = max(1, int(length))
        chunk = [float(v) / total for v in sums[pos:pos + n]]
        means[name] = chunk if length >= 0 else chunk[0]
        pos += n
    return total, means, float(sums[pos])


# --- buffers -----------------------------------------------------------------------------------------------------


@overload
def buffer_partition(members: int, size: int, rng: np.random.Generator) -> list[list[int]]: ...


@overload
def buffer_partition(
    members: Sequence[int], size: int, rng: np.random.Generator
) -> tuple[list[list[int]], list[int]]: ...


def buffer_partition(
    members: int | Sequence[int], size: int, rng: np.random.Generator
) -> list[list[int]] | tuple[list[list[int]], list[int]]:
    """Random buffers of ``size`` clients for one round (spec 3.1, 11.6): a fresh uniform permutation per call.

    * ``buffer_partition(m, s, rng)``: all ``m`` clients ``0 .. m - 1``; returns ``m/s`` buffers (buffer ``l`` holds
      ``pi(ls), ..., pi(ls + s - 1)``). ``m % s != 0`` raises ``ValueError``.
    * ``buffer_partition(members, s, rng)``: only the clients present this round (those that missed phase 1 left
      out); returns ``(buffers, leftover)`` where ``leftover`` holds the ``len(members) % s`` randomly chosen
      clients of the short last group, who are told to skip phase 2. The result depends only on the *set* of
      members and the state of ``rng``.
    """
    if isinstance(size, bool) or size < 1:
        raise ValueError(f"buffer size must be >= 1, got {size}")
    if isinstance(members, (int, np.integer)):
        m = int(members)
        if m < 0 or m % size != 0:
            raise ValueError(f"the number of clients ({m}) must be a non-negative multiple of the buffer size {size}")
        order = rng.permutation(m)
        return [[int(c) for c in order[start : start + size]] for start in range(0, m, size)]
    ids = sorted(int(c) for c in members)
    if len(set(ids)) != len(ids):
        raise ValueError("members repeat a partition id")
    shuffled = [ids[i] for i in rng.permutation(len(ids))]
    full = len(ids) - len(ids) % size
    return [shuffled[start : start + size] for start in range(0, full, size)], shuffled[full:]


# --- the threshold protocol: identities, shares, masked inputs, unmasking (issue 18) --------------------------------

_LABEL_RE_MAX = 256


def round_label(run_label: str, server_round: int, buffer_id: int) -> bytes:
    """The HKDF label of one buffer's masks, shares and channel keys in one round of one run."""
    return f"fedapp-secagg|run={run_label}|round={int(server_round)}|buffer={int(buffer_id)}".encode()


def signing_statement(run_label: bytes, server_round: int, client_id: int, public_key: bytes) -> bytes:
    """What a member signs for one round's key: run label, round, its id and the public key, unambiguously framed."""
    if not 0 < len(run_label) <= _LABEL_RE_MAX:
        raise ValueError("the run label must be 1..256 bytes")
    return b"fedapp-secagg-key-v1|" + b"|".join([
        len(run_label).to_bytes(2, "big"), run_label, int(server_round).to_bytes(8, "big", signed=True),
        int(client_id).to_bytes(8, "big", signed=True), len(public_key).to_bytes(4, "big"), public_key,
    ])


def default_threshold(size: int) -> int:
    """t = floor(s / 2) + 1: the smallest threshold with 2t > s (a majority of the buffer must survive)."""
    return size // 2 + 1


def check_threshold(size: int, threshold: int) -> None:
    """Raise ValueError unless 2 <= t <= s and 2t > s (two disjoint majorities could each rebuild a self-mask)."""
    if isinstance(threshold, bool) or not isinstance(threshold, int | np.integer) or not (
            2 <= threshold <= size and 2 * threshold > size):
        raise ValueError(f"threshold {threshold!r} for a buffer of {size}: need 2 <= t <= s and 2t > s")


def check_buffer(me: int, members: Sequence[int], threshold: int, min_buffer: int) -> None:
    """A device's policy on the buffer it is put in: it is a member, the buffer holds at least ``min_buffer``
    distinct members, and the threshold is a majority of at least 2. Raises ValueError naming what is wrong."""
    if len(set(members)) != len(members):
        raise ValueError(f"the buffer's members {list(members)} repeat a client id")
    if me not in members:
        raise ValueError(f"this node (client {me}) is not among the buffer's members {list(members)}")
    if len(members) < min_buffer:
        raise ValueError(f"a buffer of {len(members)} is below this device's minimum of {min_buffer}")
    try:
        check_threshold(len(members), threshold)
    except ValueError:
        raise ValueError(f"threshold {threshold} for a buffer of {len(members)}: this device needs 2 <= t and "
                         "2t > s") from None
class NodeIdentity:
    """A node's long-term Ed25519 signing key (its identity in every trust store that lists it).

    Parameters
    ----------
    private_key
        The Ed25519 private key; :meth:`generate` makes one, :meth:`load` reads one (PEM, PKCS8, unencrypted).
    """

    def __init__(self, private_key: Any) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        if not isinstance(private_key, Ed25519PrivateKey):
            raise TypeError(f"a node identity is an Ed25519 private key, got {type(private_key).__name__}")
        self._key = private_key

    @classmethod
    def generate(cls) -> NodeIdentity:
        """A fresh identity (from the OS CSPRNG)."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | Any) -> NodeIdentity:
        """Read a PEM private key file (errors name the path, never the content)."""
        from pathlib import Path

        p = Path(path)
        try:
            key = serialization.load_pem_private_key(p.read_bytes(), password=None)
        except (OSError, ValueError, TypeError, UnsupportedAlgorithm) as err:
            raise ValueError(f"cannot read a node identity from {str(p)!r}: {type(err).__name__}") from None
        return cls(key)

    def save(self, path: str | Any) -> None:
        """Write the private key as PEM, readable by the owner only (0600)."""
        import os
        from pathlib import Path

        p = Path(path)
        data = self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)

    def public_bytes(self) -> bytes:
        """The 32-byte raw public key (what a trust store lists)."""
        return self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``data``."""
        return bytes(self._key.sign(data))


class TrustStore:
    """The peers a node accepts: client id -> Ed25519 public key (32 raw bytes). A device keeps its own copy.

    The file format is JSON ``{"<client id>": "<64 hex digits>", ...}``.
    """

    def __init__(self, keys: Mapping[int, bytes]) -> None:
        self.keys: dict[int, bytes] = {}
        for cid, key in keys.items():
            if isinstance(cid, bool) or not isinstance(cid, int | np.integer) or len(bytes(key)) != 32:
                raise ValueError("a trust store maps integer client ids to 32-byte Ed25519 public keys")
            self.keys[int(cid)] = bytes(key)

    @classmethod
    def load(cls, path: str | Any) -> TrustStore:
        """Read a trust store file (errors name the path and, for a bad entry, its key -- never the content)."""
        import json
        from pathlib import Path

        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read a trust store from {str(p)!r}: {type(err).__name__}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"trust store {str(p)!r} must be a JSON object of client id -> hex key")
        keys = {}
        for cid, hexkey in raw.items():
            try:
                keys[int(cid)] = bytes.fromhex(str(hexkey))
            except ValueError:
                raise ValueError(f"trust store {str(p)!r}: entry {cid!r} is not an integer id with a hex key") from None
        return cls(keys)

    def save(self, path: str | Any) -> None:
        """Write the trust store as JSON."""
        import json
        from pathlib import Path

        Path(path).write_text(json.dumps({str(k): v.hex() for k, v in sorted(self.keys.items())}, indent=1))

    def verify(self, client_id: int, data: bytes, signature: bytes) -> None:
        """Raise ValueError unless ``client_id`` is trusted and ``signature`` is its signature of ``data``."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        key = self.keys.get(int(client_id))
        if key is None:
            raise ValueError(f"client {client_id} is not in this device's trust store")
        try:
            Ed25519PublicKey.from_public_bytes(key).verify(bytes(signature), data)
        except InvalidSignature:
            raise ValueError(f"the key of client {client_id} is not signed by its trusted identity") from None


def derive(key32: bytes, label: bytes, purpose: bytes) -> bytes:
    """A 32-byte key for one purpose ("mask", "channel", "self") from a 32-byte secret and a round label (HKDF)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=label + b"|" + purpose).derive(key32)


def encrypt_share(channel_key: bytes, share: bytes, aad: bytes) -> bytes:
    """AES-256-GCM of a share under a pairwise channel key (12-byte random nonce prepended; ``aad`` authenticated)."""
    import os

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = os.urandom(12)
    return nonce + AESGCM(channel_key).encrypt(nonce, share, aad)


def decrypt_share(channel_key: bytes, blob: bytes, aad: bytes) -> bytes:
    """The share of :func:`encrypt_share` (ValueError if it was altered or is not for this pair and label)."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(blob) < 12 + 16:
        raise ValueError("an encrypted share is too short")
    try:
        return bytes(AESGCM(channel_key).decrypt(blob[:12], blob[12:], aad))
    except InvalidTag:
        raise ValueError("an encrypted share failed authentication") from None


def split_secret(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """Shamir t-of-n shares of a 32-byte secret over GF(2^128), two 16-byte chunks (pycryptodome's Shamir): share i
    (1-based) is ``i`` as one byte followed by its two 16-byte chunk shares."""
    from Crypto.Protocol.SecretSharing import Shamir

    if len(secret) != 32:
        raise ValueError("the secret must be 32 bytes")
    if not 2 <= threshold <= count <= 255:
        raise ValueError(f"need 2 <= threshold <= count <= 255, got threshold {threshold}, count {count}")
    halves = [Shamir.split(threshold, count, secret[i:i + 16], ssss=False) for i in (0, 16)]
    return [bytes([idx]) + a + b for (idx, a), (_, b) in zip(halves[0], halves[1], strict=True)]


def combine_secret(shares: Sequence[bytes]) -> bytes:
    """The 32-byte secret from at least ``threshold`` shares of :func:`split_secret` (extra shares are ignored by
    Lagrange interpolation at the given points; a wrong share gives a wrong secret, which the caller must detect)."""
    from Crypto.Protocol.SecretSharing import Shamir

    if not shares or any(len(s) != 33 for s in shares) or len({s[0] for s in shares}) != len(shares):
        raise ValueError("shares must be distinct 33-byte shares of split_secret")
    return b"".join(bytes(Shamir.combine([(s[0], s[1 + 16 * h:17 + 16 * h]) for s in shares], ssss=False))
                    for h in (0, 1))


def self_mask(seed: bytes, label: bytes, n: int) -> NDArray[np.uint32]:
    """PRG(b_i): the self-mask of a member's upload."""
    return expand_mask(derive(seed, label, b"self"), label, n)


def threshold_masked_upload(
    x: ArrayLike, me: int, private_key: bytes, peers: Mapping[int, bytes], label: bytes, self_seed: bytes,
    rng: np.random.Generator, clip: float = DEFAULT_CLIP, levels: int = DEFAULT_LEVELS, *, encoded: bool = False,
) -> NDArray[np.uint32]:
    """``q(x) + PRG(b) + sum_{j > me} PRG(s_j) - sum_{j < me} PRG(s_j)`` (mod 2^32), s_j = HKDF(ECDH, label, "mask").

    With ``encoded`` x is already a uint32 vector on the ring (the caller's own encoding, e.g. the distributed
    Skellam mechanism's signed integers mod 2^32, :mod:`fedpdm_flower.fedapp.privacy.skellam`); the caller then answers for wraps.
    """
    if not peers:
        raise ValueError("masking needs at least one buffer-mate")
    if encoded:
        upload = np.asarray(x)
        if upload.dtype != np.uint32 or upload.ndim != 1:
            raise ValueError(f"an encoded x must be a 1-D uint32 vector, got {upload.dtype} {upload.shape}")
        upload = upload.copy()
        values = upload
    else:
        values = np.asarray(x, dtype=np.float64)
        if values.ndim != 1:
            raise ValueError(f"x must be 1-D, got shape {values.shape}")
        _check_capacity(len(peers) + 1, levels)
        upload = quantize(values, rng, clip, levels)
    upload += self_mask(self_seed, label, values.size)
    for peer in sorted(peers):
        seed = derive(pairwise_key(private_key, peers[peer]), label, b"mask")
        mask = expand_mask(seed, label, values.size)
        if peer > me:
            upload += mask
        else:
            upload -= mask
    return upload


def pair_seed(private_key: bytes, peer_public: bytes, label: bytes) -> bytes:
    """s_ij of :func:`threshold_masked_upload` (what a survivor reveals for a dropped peer j)."""
    return derive(pairwise_key(private_key, peer_public), label, b"mask")


def unmask_sum(
    uploads: Mapping[int, NDArray[np.uint32]], self_seeds: Mapping[int, bytes],
    revealed_pairs: Mapping[tuple[int, int], bytes], label: bytes,
) -> NDArray[np.uint32]:
    """The survivors' quantized sum: their uploads minus their self-masks, minus the masks they hold with dropped
    members (``revealed_pairs[(survivor, dropped)]`` = s_ij as revealed by the survivor). Pairwise masks between
    survivors cancel in the sum."""
    survivors = sorted(uploads)
    if len(survivors) < 2:
        raise ValueError("never unmask fewer than 2 survivors: one upload alone is one member's vector")
    n = uploads[survivors[0]].size
    if any(u.dtype != np.uint32 or u.shape != (n,) for u in uploads.values()):
        raise ValueError(f"the survivors' uploads must be 1-D uint32 arrays of one length ({n})")
    total = np.zeros(n, dtype=np.uint32)
    for i in survivors:
        total += uploads[i]
        total -= self_mask(self_seeds[i], label, n)
    for (i, j), seed in revealed_pairs.items():
        if i not in uploads or j in uploads:
            raise ValueError(f"a revealed pair ({i}, {j}) must join a survivor to a dropped member")
        mask = expand_mask(seed, label, n)
        if j > i:  # i added +PRG(s_ij): take it out
            total -= mask
        else:
            total += mask
    return total


# --- one member's steps and the server's rebuild ----------------------------------------------------------------


@dataclass(frozen=True)
class MaskedInput:
    """What :func:`mask_input` makes: the upload (``masked``, the encrypted shares by holder id, the commitment)
    and the member's own share of its self-mask seed, which it keeps for the unmask step."""

    masked: NDArray[np.uint32]
    shares: dict[int, bytes]
    commit: bytes
    own_share: bytes


def _channel(private_key: bytes, peer_public: bytes, label: bytes) -> bytes:
    """The AES key of the pair's share channel in one round and buffer."""
    return derive(pairwise_key(private_key, peer_public), label, b"channel")


def mask_input(
    x: ArrayLike, me: int, private_key: bytes, peers: Mapping[int, bytes], threshold: int, label: bytes,
    rng: np.random.Generator, clip: float = DEFAULT_CLIP, levels: int = DEFAULT_LEVELS, *, encoded: bool = False,
) -> MaskedInput:
    """Step 2 of the protocol for member ``me``: y = q(x) + PRG(b) +- PRG(s_ij) (:func:`threshold_masked_upload`),
    b a fresh seed from the OS CSPRNG, Shamir-shared t-of-s over the buffer (members = ``me`` and ``peers``, share i
    for the i-th smallest id), each share for a peer encrypted under the pair's channel key with the direction
    ``me->peer`` authenticated, and the SHA-256 commitment to b.

    ``peers`` are the buffer-mates' verified public keys by client id; ``rng`` draws the stochastic rounding only;
    ``encoded``: x is already on the ring (:func:`threshold_masked_upload`).
    """
    if me in peers:
        raise ValueError(f"client {me} is listed among its own buffer-mates")
    order = sorted([me, *peers])
    check_threshold(len(order), threshold)
    seed = os.urandom(32)
    masked = threshold_masked_upload(x, me, private_key, peers, label, seed, rng, clip, levels, encoded=encoded)
    shares = dict(zip(order, split_secret(seed, threshold, len(order)), strict=True))
    sealed = {cid: encrypt_share(_channel(private_key, pk, label), shares[cid], label + f"|{me}->{cid}".encode())
              for cid, pk in peers.items()}
    return MaskedInput(masked, sealed, hashlib.sha256(seed).digest(), shares[me])


def reveal(
    me: int, private_key: bytes, peer_keys: Mapping[int, bytes], own_share: bytes, threshold: int,
    survivors: Sequence[int], dropped: Sequence[int], sealed_for_me: Mapping[int, bytes], label: bytes,
) -> tuple[dict[int, bytes], dict[int, bytes]]:
    """Step 3 for member ``me``: ``(self-mask shares by owner, pairwise seeds by dropped peer)``.

    Refuses (ValueError) unless survivors and dropped split the buffer (``me`` and ``peer_keys``), ``me`` survived
    and at least t survived: for every peer it reveals EITHER its share of the peer's self-mask seed (decrypted from
    ``sealed_for_me[peer]``; the peer survived) OR their pairwise seed (the peer dropped), never both.
    """
    members = sorted([me, *peer_keys])
    if sorted([*survivors, *dropped]) != members or set(survivors) & set(dropped):
        raise ValueError(f"survivors {list(survivors)} and dropped {list(dropped)} must split the buffer {members}")
    if me not in survivors:
        raise ValueError("this node is told it dropped, yet it is asked to unmask")
    if len(survivors) < threshold:
        raise ValueError(f"{len(survivors)} survivor(s) are below the threshold {threshold}: nothing is revealed")
    shares = {me: own_share}
    for cid in survivors:
        if cid != me:
            if cid not in sealed_for_me:
                raise ValueError(f"the request lacks the share that survivor {cid} sealed for this node")
            shares[cid] = decrypt_share(_channel(private_key, peer_keys[cid], label), sealed_for_me[cid],
                                        label + f"|{cid}->{me}".encode())
    return shares, {cid: pair_seed(private_key, peer_keys[cid], label) for cid in dropped}


def rebuild_sum(
    uploads: Mapping[int, NDArray[np.uint32]], commits: Mapping[int, bytes], shares: Mapping[int, Sequence[bytes]],
    revealed_pairs: Mapping[tuple[int, int], bytes], label: bytes,
) -> NDArray[np.uint32]:
    """The server's step 3: the survivors' exact quantized sum (mod 2^32) from their uploads.

    ``shares[i]`` are the revealed shares of survivor i's self-mask seed (at least t of them); the rebuilt seed must
    hash to i's commitment (a wrong or forged share is caught here). ``revealed_pairs[(i, j)]`` is s_ij as revealed
    by survivor i for dropped j. Raises ValueError for fewer than 2 survivors, a seed that misses its commitment, or
    a pair that does not join a survivor to a dropped member.
    """
    seeds: dict[int, bytes] = {}
    for cid in uploads:
        seed = combine_secret(shares[cid])
        if hashlib.sha256(seed).digest() != commits[cid]:
            raise ValueError(f"the self-mask seed rebuilt for client {cid} does not match its commitment")
        seeds[cid] = seed
    return unmask_sum(uploads, seeds, revealed_pairs, label)
