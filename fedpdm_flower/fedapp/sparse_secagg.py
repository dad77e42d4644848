"""SparseSecAgg: sparsified secure aggregation with pairwise location masks, framework-free.

Ergun, Sami, Guler, "Sparsified Secure Aggregation for Privacy-Preserving Federated Learning", arXiv 2112.12872;
the FedREP paper's communication-efficient + private (not robust) baseline (spec shared/specs/fedrep.md 7.2, where
the details are marked "from memory, verify": what follows is our reading, stated so it can be checked).

Each pair (i, j) derives from its shared key a Bernoulli(p) location mask l_ij in {0,1}^d and an additive mask
r_ij (both ChaCha20 streams keyed by HKDF of the full ECDH secret, :func:`fedpdm_flower.fedapp.secagg.expand_mask`). Client i
sends only the coordinates U_i = {c : l_ij[c] = 1 for some j != i}, with values

    y_i[c] = q(x_i[c]) + sum_{j > i} l_ij[c] r_ij[c] - sum_{j < i} l_ij[c] r_ij[c]      (mod 2^32)

Since l_ij = l_ji, a coordinate c of a pair's mask is sent by both or neither, so the masks cancel in the
per-coordinate sum over the clients that sent c; the server learns sum_{i : c in U_i} x_i[c] and how many clients
sent c. Each client sends a fraction Gamma ~ 1 - (1 - p)^(N - 1) of the coordinates: p = 1 - (1 - Gamma)^(1/(N-1)).
There is no error compensation. All N clients form one group: a client missing in the upload phase leaves
unmatched masks, so the round's aggregate is discarded (our dropout rule for this baseline).

This baseline keeps its own key exchange: one fresh, unsigned SECP384R1 key per client and round, relayed by the
server (an honest-but-curious server, as in the paper it reproduces). It is not the threshold protocol of
:mod:`fedpdm_flower.fedapp.secagg` that FedREP and SecureBuffers use, so a device in secure mode refuses to take part in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp import secagg

_LOC, _VAL = b"|location", b"|value"


def mask_label(run_seed: int, server_round: int) -> bytes:
    """The HKDF label of one round's pairwise masks in one run: ``b"sparse-secagg|run=..|round=.."``."""
    return f"sparse-secagg|run={int(run_seed)}|round={int(server_round)}".encode()


def location_probability(gamma: float, n: int) -> float:
    """p of the pairwise Bernoulli location masks that makes a client send a fraction ``gamma`` of coordinates."""
    if not 0 < gamma <= 1 or n < 2:
        raise ValueError(f"need 0 < gamma <= 1 and n >= 2 clients, got gamma={gamma}, n={n}")
    return float(1.0 - (1.0 - gamma) ** (1.0 / (n - 1)))


def _pair_masks(key: bytes, label: bytes, d: int, p: float) -> tuple[NDArray[np.bool_], NDArray[np.uint32]]:
    threshold = np.uint64(min(int(p * 2**32), 2**32 - 1))
    loc = secagg.expand_mask(key, label + _LOC, d).astype(np.uint64) < threshold
    return loc, secagg.expand_mask(key, label + _VAL, d)


def sparse_masked_upload(
    x: NDArray[Any], me: int, private_key: bytes, peers: Mapping[int, bytes], label: bytes, p: float,
    rng: np.random.Generator,
) -> tuple[NDArray[np.uint32], NDArray[np.uint32]]:
    """Client i's upload (U_i ascending, y_i on U_i) for its dense vector ``x`` (length d)."""
    if not peers:
        raise ValueError("SparseSecAgg needs at least one peer")
    x = np.asarray(x, dtype=np.float64)
    d = x.size
    total = np.zeros(d, dtype=np.uint32)
    union = np.zeros(d, dtype=bool)
    for peer in sorted(peers):
        loc, val = _pair_masks(secagg.pairwise_key(private_key, peers[peer]), label, d, p)
        union |= loc
        masked = np.where(loc, val, np.uint32(0)).astype(np.uint32)
        total = total + masked if peer > me else total - masked  # uint32 wraparound = arithmetic mod 2^32
    idx = np.flatnonzero(union).astype(np.uint32)
    return idx, (secagg.quantize(x[idx], rng) + total[idx]).astype(np.uint32)


def decode_sparse_sum(uploads: Mapping[int, tuple[NDArray[Any], NDArray[Any]]], d: int) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Per-coordinate sum of the clients' values over the clients that sent the coordinate, and those counts.

    Raises ValueError for a malformed upload (indices not ascending unique in [0, d), lengths differing).
    """
    acc = np.zeros(d, dtype=np.uint64)
    counts = np.zeros(d, dtype=np.int64)
    for cid, (idx, vals) in uploads.items():
        idx = np.asarray(idx)
        vals = np.asarray(vals)
        if idx.dtype != np.uint32 or vals.dtype != np.uint32 or idx.ndim != 1 or idx.shape != vals.shape:
            raise ValueError(f"client {cid}: upload must be two 1-D uint32 arrays of one length")
        if idx.size and (int(idx[-1]) >= d or np.any(np.diff(idx.astype(np.int64)) <= 0)):
            raise ValueError(f"client {cid}: indices must be ascending, unique and < {d}")
        acc[idx] += vals
        counts[idx] += 1
    total = acc % np.uint64(secagg.MODULUS)
    step = 2.0 * secagg.DEFAULT_CLIP / (secagg.DEFAULT_LEVELS - 1)
    return total.astype(np.float64) * step - counts * secagg.DEFAULT_CLIP, counts
