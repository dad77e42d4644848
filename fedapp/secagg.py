"""Buffered secure aggregation for FedREP: pairwise additive masking inside each buffer (spec 3.1, 4.3, 11.19).

FedREP (Yang, Wang, Li; spec ``fedrep.md``) lets the server learn only the *mean* of each buffer of ``s`` clients,
then applies a robust aggregator across buffer means. This module is the recommended "buffer SecAgg" of spec 4.3:
the pairwise masking of Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning"
(CCS 2017), run independently in every buffer and fitted into FedREP's two message exchanges per round:

1. phase-1 reply: each client sends a fresh per-round public key (:func:`new_keypair`) beside its proposal;
2. phase-2 instruction: the server sends each client its buffer id and the public keys of its buffer-mates, keyed
   by partition id. The client calls :func:`masked_upload`: it quantizes its vector ``x`` (:func:`quantize`) and
   adds, for every buffer-mate ``j``, ``+PRG(k_ij)`` if ``j > i`` and ``-PRG(k_ij)`` if ``j < i`` (mod ``2^32``).
   The server sums a buffer's uploads mod ``2^32`` -- the pairwise masks cancel exactly -- and decodes the buffer
   mean (:func:`decode_buffer_mean`, or :func:`decode_buffers` for a whole round).

Cryptography (nothing home-made):

* key agreement: Flower's EC key pairs (SECP384R1, PEM) and ``generate_shared_key`` (ECDH + HKDF-SHA256, 32
  bytes); the spec suggests X25519, P-384 is used because Flower ships it (same role, same security here);
* mask expansion (:func:`expand_mask`): HKDF-SHA256 of the full 32-byte pairwise key with a label naming run,
  round and buffer (:func:`mask_label`), then the ChaCha20 key stream. Flower's ``pseudo_rand_gen`` is *not* used:
  it XOR-folds the key to a 32-bit seed of numpy's Mersenne Twister, so a curious server could recover a mask by
  trying 2^32 seeds.

Encoding (spec 4.3 item 3): clip to ``[-c, c]`` (``c = 8``), stochastic rounding of ``(x + c)(Q - 1)/(2c)`` with
``Q = 2^22`` levels, modulus ``M = 2^32``; ``s * Q < M`` is required so a buffer sum never wraps. The decoded mean
is within ``2c/(Q - 1)`` (about 3.8e-6) of the mean of the clipped inputs, and unbiased.

Dropouts (spec 4.3, 11.19): a buffer with a missing, malformed or late member is **discarded** for the round; the
robust aggregator runs on the remaining buffer means. Survivors are never unmasked: with ``s = 2`` removing the
dropped partner's masks would hand the server the survivor's individual vector. This is why no Shamir secret
sharing is needed. Bonawitz et al. share each client's DH secret key so that the server can rebuild a *dropped*
client's pairwise masks and unmask the survivors; and, because that reveals the dropped client's pairwise seeds,
they add a per-client self-mask (also Shamir-shared) so that an upload of the "dropped" client arriving late
cannot then be unmasked. Under the discard policy no pairwise seed is ever revealed, so a late upload stays
hidden behind its pairwise masks and no self-mask is needed either; all the server ever learns is the sum of a
complete buffer, which it is meant to learn. Recovery would also cost a third message exchange per round (about
6 s per exchange in a deployment) on top of FedREP's two.

Security model and caller obligations:

* honest-but-curious server: without authenticated public keys, an actively malicious server can substitute keys
  (man-in-the-middle) or put a client in a "buffer" of clients it controls -- the same as Bonawitz et al.'s
  semi-honest variant;
* a client masks at most one vector per (key pair, label): a fresh key pair per round and one phase-2 reply per
  round guarantee it (two uploads under the same mask would reveal the difference of the two vectors);
* ``s = 1`` cannot be masked (the "mean" of one client is its vector): :func:`masked_upload` and
  :func:`decode_buffers` raise ``ValueError`` and the caller must use ``secagg_mode = plain``.
"""

from __future__ import annotations

import base64
import importlib
from collections.abc import Callable, Mapping, Sequence
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
    "buffer_partition",
    "check_public_key",
    "decode_buffer_mean",
    "decode_buffers",
    "dequantize",
    "expand_mask",
    "mask_label",
    "masked_upload",
    "new_keypair",
    "pairwise_key",
    "quantize",
]

DEFAULT_CLIP = 8.0
"""Clipping range ``c``: values are clipped to ``[-c, c]`` before quantization (spec 11.19)."""
DEFAULT_LEVELS = 2**22
"""Quantization levels ``Q``: a value maps to an integer in ``[0, Q - 1]`` (spec 11.19)."""
MODULUS = 2**32
"""Modulus ``M`` of the masked arithmetic: uint32 wraparound."""

KEY_BYTES = 32

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

    Make one per client and round; send the public bytes with the phase-1 reply, keep the private bytes until the
    phase-2 reply (in the client's ``Context.state``) and then forget them.
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

    The server checks every phase-1 key before forwarding it, so a client cannot make its buffer-mates fail.
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


def mask_label(run_seed: int, server_round: int, buffer_id: int) -> bytes:
    """The HKDF ``info`` label of the masks of one buffer in one round: ``b"fedrep-mask|run=..|round=..|buffer=.."``.

    Both members of a pair must use the same label. With fresh key pairs every round the label is domain
    separation; with key pairs kept for a whole run it is what makes the masks of different rounds differ.
    """
    return f"fedrep-mask|run={int(run_seed)}|round={int(server_round)}|buffer={int(buffer_id)}".encode()


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


def masked_upload(
    x: ArrayLike,
    me: int,
    private_key: bytes,
    peers: Mapping[int, bytes],
    label: bytes,
    rng: np.random.Generator,
    clip: float = DEFAULT_CLIP,
    levels: int = DEFAULT_LEVELS,
) -> NDArray[np.uint32]:
    """A client's phase-2 upload: ``quantize(x) + sum_{j > me} PRG(k_j) - sum_{j < me} PRG(k_j)`` (mod ``2^32``).

    Parameters
    ----------
    x
        The client's vector (1-D, length n), e.g. its sparse update on the consensus coordinates.
    me
        The client's partition id; masks are signed by comparing it with the peers' ids.
    private_key
        The client's private key of this round (PEM bytes from :func:`new_keypair`).
    peers
        Buffer-mates' public keys (PEM bytes) keyed by partition id, ``me`` excluded; at least one.
    label
        :func:`mask_label` of this run, round and buffer (the same for every member of the buffer).
    rng
        Randomness of the stochastic rounding; consumed exactly as ``quantize(x, rng, ...)``.
    """
    if not peers:
        raise ValueError("masking needs at least one buffer-mate: with s = 1 use plain (unmasked) mode")
    if me in peers:
        raise ValueError(f"partition id {me} is listed among its own buffer-mates")
    values = np.asarray(x, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"x must be 1-D, got shape {values.shape}")
    _check_capacity(len(peers) + 1, levels)
    upload = quantize(values, rng, clip, levels)
    for peer in sorted(peers):
        mask = expand_mask(pairwise_key(private_key, peers[peer]), label, values.size)
        # Deliberate uint32 wraparound: numpy array arithmetic on unsigned integers is exact mod 2^32.
        if peer > me:
            upload += mask
        else:
            upload -= mask
    return upload


# --- server side -------------------------------------------------------------------------------------------------


def decode_buffer_mean(
    uploads: Sequence[NDArray[np.uint32]], clip: float = DEFAULT_CLIP, levels: int = DEFAULT_LEVELS
) -> NDArray[np.float64]:
    """The mean of a *complete* buffer's vectors from its members' masked uploads: their sum mod ``2^32`` (the
    pairwise masks cancel) dequantized. Raises ``ValueError`` for fewer than 2 uploads or mismatched arrays."""
    if len(uploads) < 2:
        raise ValueError("never decode fewer than 2 uploads: one upload alone is a single client's vector")
    _check_capacity(len(uploads), levels)
    first = uploads[0]
    for upload in uploads:
        if not isinstance(upload, np.ndarray) or upload.dtype != np.dtype(np.uint32) or upload.ndim != 1:
            raise ValueError("uploads must be 1-D uint32 arrays")
        if upload.shape != first.shape:
            raise ValueError(f"upload shapes differ: {upload.shape} vs {first.shape}")
    total = np.sum(np.stack(uploads), axis=0, dtype=np.uint64) % MODULUS
    return dequantize(total, len(uploads), clip, levels)


def decode_buffers(
    received: Mapping[int, Any],
    buffers: Sequence[Sequence[int]],
    *,
    length: int | None = None,
    clip: float = DEFAULT_CLIP,
    levels: int = DEFAULT_LEVELS,
) -> tuple[dict[int, NDArray[np.float64]], list[int]]:
    """Decode every complete buffer of a round; discard the others.

    Parameters
    ----------
    received
        Masked uploads keyed by partition id (whatever arrived; entries of clients in no buffer are ignored).
    buffers
        The round's buffers (buffer id = position), each of >= 2 partition ids; e.g. from :func:`buffer_partition`.
    length
        The expected vector length n (the number of consensus coordinates). If None, the members of a buffer must
        merely agree on the length.

    Returns
    -------
    ``(means, discarded)``: ``means[buffer_id]`` is the float64 mean of the buffer, and ``discarded`` lists (in
    ascending order) the buffers with a missing member or an upload that is not a 1-D uint32 array of ``length``
    (or, without ``length``, of its buffer-mates' length).
    A discarded buffer is never partially unmasked.

    Raises ``ValueError`` for a buffer of fewer than 2 members (s = 1 cannot be masked), a partition id in two
    buffers, or ``s * levels >= 2^32``.
    """
    seen: set[int] = set()
    for buffer_id, members in enumerate(buffers):
        if len(members) < 2:
            raise ValueError(f"buffer {buffer_id} has {len(members)} member(s): masking needs s >= 2")
        if len(set(members)) != len(members) or seen.intersection(members):
            raise ValueError(f"buffer {buffer_id} repeats a partition id")
        seen.update(members)
        _check_capacity(len(members), levels)
    expected = np.dtype(np.uint32)
    means: dict[int, NDArray[np.float64]] = {}
    discarded: list[int] = []
    for buffer_id, members in enumerate(buffers):
        uploads = [received.get(member) for member in members]
        shape = (length,) if length is not None else getattr(uploads[0], "shape", None)
        if all(
            isinstance(upload, np.ndarray) and upload.dtype == expected and upload.ndim == 1 and upload.shape == shape
            for upload in uploads
        ):
            means[buffer_id] = decode_buffer_mean(cast(list[NDArray[np.uint32]], uploads), clip, levels)
        else:
            discarded.append(buffer_id)
    return means, discarded


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


# --- the threshold protocol: authenticated keys, self-masks, dropout recovery (issue 18) -------------------------
#
# Per round and buffer (members sorted, size s, threshold t with 2t > s and t >= 2):
#
# 1. keys: each member makes a fresh key pair and signs (run label, round, its id, its public key) with its long-term
#    Ed25519 identity; the server forwards the signed keys of the buffer-mates, and a member accepts only mates
#    whose signature verifies against its own trust store (whoever writes the trust store decides who the peers are);
# 2. masked input: y_i = q(x_i) + PRG(b_i) + sum_{j > i} PRG(s_ij) - sum_{j < i} PRG(s_ij) (mod 2^32), with b_i a
#    fresh self-mask seed and s_ij the pairwise seed (ECDH + HKDF); b_i is Shamir-shared t-of-s among the members
#    (its own share kept), each share encrypted for its holder (AES-GCM under the pairwise channel key);
# 3. unmask: told which members survived, each survivor reveals, for every peer, EITHER its share of b_j (j
#    survived) OR its pairwise seed s_ij (j dropped) -- never both, and only once per round. The server rebuilds
#    b_i of every survivor from t shares and removes the masks of the dropped: it learns the survivors' sum.
#
# Why a survivor is never unmasked: its y_i still carries the pairwise masks with the other survivors, which nobody
# reveals; with fewer than t (>= 2) survivors no self-mask can be rebuilt, and the buffer is discarded. A member told
# "j dropped" reveals s_ij but never b_j's share, so a late upload of j stays behind PRG(b_j).

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
    rng: np.random.Generator, clip: float = DEFAULT_CLIP, levels: int = DEFAULT_LEVELS,
) -> NDArray[np.uint32]:
    """``q(x) + PRG(b) + sum_{j > me} PRG(s_j) - sum_{j < me} PRG(s_j)`` (mod 2^32), s_j = HKDF(ECDH, label, "mask")."""
    if not peers:
        raise ValueError("masking needs at least one buffer-mate")
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
