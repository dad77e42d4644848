"""ConSpar, the consensus sparsification of FedREP (Yang, Wang, Li, arXiv text seed 003, Sec. 3.2; spec fedrep.md 2).

One ConSpar round has two phases:

1. every client proposes ``k = K/m`` coordinates (:func:`propose`: its top-k set with a Binomial(k, alpha) share
   replaced by random coordinates) and sends only those indices;
2. the server broadcasts the union ``I^t`` (:func:`consensus`, after :func:`sanitize_proposal` of every received
   proposal), each client uploads ``(g)_{I^t}`` and keeps the rest as error-compensation memory (:func:`compress`).

The module also holds the paper's closed forms: the contraction constant of Prop. 2 (:func:`contraction_dprime`),
the two DP bounds of Theorem 2 (:func:`theorem2_epsilon`) and the communication bound at the end of Sec. 3.2
(:func:`bits_bound`, :func:`topk_bits`). Index sets are int64 and ascending everywhere, the order in which the
values travel (spec 2.2, "(x)_I"). Pure numpy; no Flower imports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.compression.sparsify import top_k

__all__ = [
    "ConSpar",
    "ProposalParts",
    "bits_bound",
    "compress",
    "consensus",
    "contraction_dprime",
    "k_per_client",
    "propose",
    "propose_parts",
    "sanitize_proposal",
    "scatter",
    "theorem2_epsilon",
    "topk_bits",
]


class ProposalParts(NamedTuple):
    """The pieces of one ConSpar proposal (spec 2.2); only ``indices`` leaves the client.

    Attributes
    ----------
    top
        T: the top-k set by magnitude, ascending.
    kept
        T~: the k - r coordinates of T that are kept, ascending (a uniform subset of T).
    extra
        R: the r uniform coordinates from [d] \\ T~, ascending; ``r = extra.size`` ~ Binomial(k, alpha).
    indices
        I_k = T~ ∪ R (a disjoint union), ascending, exactly k entries.
    """

    top: NDArray[np.int64]
    kept: NDArray[np.int64]
    extra: NDArray[np.int64]
    indices: NDArray[np.int64]


def _check_dim(d: int, name: str = "d") -> None:
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {d!r}")


def _check_k(k: int, d: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not (1 <= k <= d):
        raise ValueError(f"k must be an integer in [1, d={d}], got {k!r}")


def _check_alpha(alpha: float) -> None:
    # `not (0 <= alpha <= 1)` also rejects NaN.
    if isinstance(alpha, bool) or not (0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")


def _check_index_set(idx: NDArray[Any], d: int, name: str) -> NDArray[np.int64]:
    """Validate a trusted index set: 1-D, integer dtype, strictly ascending, within [0, d); return it as int64."""
    arr = np.asarray(idx)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must have an integer dtype, got {arr.dtype}")
    if np.issubdtype(arr.dtype, np.signedinteger) and arr.min() < 0:
        raise ValueError(f"{name} has an index out of range: {arr.min()} < 0")
    if arr.max() >= d:
        raise ValueError(f"{name} has an index out of range: {arr.max()} >= d = {d}")
    out = arr.astype(np.int64)
    if np.any(np.diff(out) <= 0):
        raise ValueError(f"{name} must be strictly ascending (sorted, no duplicates)")
    return out


@dataclass(frozen=True)
class ConSpar:
    """ConSpar's settings as one constructor argument (Sec. 3.2): the budget K/d and the obfuscation alpha.

    Parameters
    ----------
    fraction
        K/d: the union of the m proposals holds at most K = fraction d coordinates, each client proposes
        k = round(K/m) (:func:`k_per_client`, spec 11.1), d counting the trainable parameters. Default 0.05, the
        paper's main setting (Sec. 5); at most m, where k = d (every client proposes all coordinates: SHARE).
    alpha
        Expected share of a client's k proposed coordinates replaced by uniform ones (r ~ Binomial(k, alpha),
        :func:`propose`), in [0, 1]. Default 0, the paper's setting after its alpha study (Figs. 1, 3); alpha > 0
        makes the proposal epsilon-DP with respect to the top-k set (Theorem 2, :func:`theorem2_epsilon`).
    """

    fraction: float = 0.05
    alpha: float = 0.0

    def __post_init__(self) -> None:
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not (math.isfinite(f) and f > 0):
            raise ValueError(f"ConSpar fraction (K/d) must be a finite number > 0, got {f!r}")
        _check_alpha(self.alpha)

    def k(self, d: int, m: int) -> int:
        """k = K/m per client for d trainable parameters and m clients (raises ValueError if fraction > m)."""
        return k_per_client(self.fraction, d, m)


# --- client, phase 1 -------------------------------------------------------------------------------------------


def propose_parts(g: NDArray[Any], k: int, alpha: float, rng: np.random.Generator) -> ProposalParts:
    """ConSparPropose with its intermediate sets exposed (paper Sec. 3.2; spec 2.2 steps 1-5, 11.3, 11.4).

    1. ``T`` = indices of the k largest ``|g_j|``, ties to the lower index (:func:`top_k`, i.e. the first k
       after sorting by ``(-|g_j|, j)``, spec 11.3);
    2. ``r ~ Binomial(k, alpha)``;
    3. ``T~`` = a uniform (k - r)-subset of ``T``;
    4. ``R`` = a uniform r-subset of ``[d] \\ T~``, which may re-pick a dropped top coordinate: this is the
       sampling space of the Theorem-2 proof (spec 11.4);
    5. ``I_k = T~ ∪ R``, so ``|I_k| = k`` exactly.

    The random draws consume ``rng`` in a way that depends on (d, k, alpha) only, never on the values of ``g``.

    Parameters
    ----------
    g
        1-D error-compensated update ``g_k^t`` with finite entries (length d).
    k
        Coordinates proposed per client, ``K/m``; 1 <= k <= d.
    alpha
        Obfuscation level in [0, 1]; 0 proposes the plain top-k set, 1 a uniform k-subset independent of ``g``.
    rng
        The client's seeded generator.

    Returns
    -------
    ProposalParts
        T, T~, R and I_k, each an ascending int64 array.
    """
    vec = np.asarray(g)
    if vec.ndim != 1:
        raise ValueError(f"g must be 1-D, got shape {vec.shape}")
    d = int(vec.shape[0])
    _check_dim(d, "len(g)")
    _check_k(k, d)
    _check_alpha(alpha)
    top = top_k(vec, k)
    r = int(rng.binomial(n=int(k), p=float(alpha)))
    kept = np.sort(rng.choice(top, size=int(k) - r, replace=False)).astype(np.int64, copy=False)
    if r == 0:
        extra = np.zeros(0, dtype=np.int64)
    else:
        free = np.ones(d, dtype=np.bool_)
        free[kept] = False
        extra = np.sort(rng.choice(np.flatnonzero(free), size=r, replace=False)).astype(np.int64, copy=False)
    indices = np.union1d(kept, extra).astype(np.int64, copy=False)
    return ProposalParts(top=top, kept=kept, extra=extra, indices=indices)


def propose(g: NDArray[Any], k: int, alpha: float, rng: np.random.Generator) -> NDArray[np.int64]:
    """The coordinate set ``I_k^t`` a client sends in phase 1 (paper Sec. 3.2; spec 2.2 ConSparPropose).

    See :func:`propose_parts` for the steps and parameters.

    Returns
    -------
    NDArray[np.int64]
        Exactly k distinct indices in [0, d), ascending.
    """
    return propose_parts(g, k, alpha, rng).indices


# --- server ------------------------------------------------------------------------------------------------------


def sanitize_proposal(raw: Any, d: int, k: int, rng: np.random.Generator | None) -> NDArray[np.int64]:
    """Turn an untrusted (possibly Byzantine) proposal into a valid one of at most k indices (spec 11.5).

    Entries that are out of [0, d) are dropped and duplicates removed; if more than k distinct indices remain, only
    the k lowest are kept, so no client can claim more than its share of the union (|I^t| <= m k, which the
    communication bound of Sec. 3.2 needs). Truncation is deterministic on purpose: the sender chose the set, so
    randomising the cut would protect nothing and would make the server's run harder to reproduce. With ``rng``
    given, a short proposal is padded to exactly k with uniform indices not already in it (spec 11.5, "pads with
    random indices"), so every sanitized proposal has the size of an honest one; with ``rng=None`` it is left short.

    A float array is accepted when every entry is a finite whole number (e.g. ``[3.0, 7.0]``, as some transports
    deliver integers); anything else that is not a 1-D integer array raises, so the server can reject the client.

    Parameters
    ----------
    raw
        The received proposal (normally a 1-D integer ndarray).
    d
        Model dimension.
    k
        Per-client budget, 1 <= k <= d.
    rng
        Server-side generator for padding, or None to skip padding.

    Returns
    -------
    NDArray[np.int64]
        At most k (exactly k when ``rng`` is given) distinct indices in [0, d), ascending.

    Raises
    ------
    ValueError
        If ``raw`` is not array-like, not 1-D, of a non-numeric, boolean or complex dtype, or a float array with a
        non-integer or non-finite entry. The message names the problem.
    """
    _check_dim(d)
    _check_k(k, d)
    try:
        arr = np.asarray(raw)
    except (ValueError, TypeError) as exc:  # ragged nested sequences and the like
        raise ValueError(f"proposal is not an array: {exc}") from exc
    if arr.ndim != 1:
        raise ValueError(f"proposal must be a 1-D index array, got ndim {arr.ndim} (shape {arr.shape})")
    if np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.signedinteger):
            arr = arr[arr >= 0]
        # Range is checked in the sender's dtype, before an int64 cast could wrap huge uint64 values.
        idx = arr[arr < d].astype(np.int64)
    elif np.issubdtype(arr.dtype, np.floating):
        if not np.all(np.isfinite(arr)):
            raise ValueError("proposal has a non-finite entry (NaN or Inf); indices must be integers")
        if np.any(arr != np.floor(arr)):
            bad = arr[arr != np.floor(arr)][0]
            raise ValueError(
                f"proposal has a non-integer entry {float(bad)} (dtype {arr.dtype}); indices must be integers"
            )
        idx = arr[(arr >= 0) & (arr < d)].astype(np.int64)
    else:
        raise ValueError(f"proposal has wrong dtype {arr.dtype}, expected an integer dtype")
    idx = np.unique(idx)[:k]  # np.unique sorts: the k lowest survive
    if rng is not None and idx.size < k:
        free = np.ones(d, dtype=np.bool_)
        free[idx] = False
        pad = rng.choice(np.flatnonzero(free), size=int(k) - idx.size, replace=False)
        idx = np.union1d(idx, pad)
    return idx.astype(np.int64, copy=False)


def consensus(proposals: Sequence[NDArray[Any]], d: int, k: int) -> NDArray[np.int64]:
    """The consensus set ``I^t = ∪_k I_k^t`` (paper Sec. 3.2; spec 2.2 ConSparConsensus): a union, no voting.

    The proposals must already be valid (honest output of :func:`propose`, or :func:`sanitize_proposal` of what a
    client sent); an invalid one raises instead of being silently repaired here.

    Parameters
    ----------
    proposals
        One index array per client: 1-D, integer, strictly ascending, within [0, d), at most k entries.
    d
        Model dimension.
    k
        Per-client budget; hence ``|I^t| <= len(proposals) * k``.

    Returns
    -------
    NDArray[np.int64]
        The union, sorted ascending and unique (the packing order of phase 2).
    """
    _check_dim(d)
    _check_k(k, d)
    checked: list[NDArray[np.int64]] = []
    for pos, prop in enumerate(proposals):
        idx = _check_index_set(prop, d, f"proposal {pos}")
        if idx.size > k:
            raise ValueError(f"proposal {pos} has {idx.size} indices > k = {k}; sanitize it first")
        checked.append(idx)
    if not checked:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(checked)).astype(np.int64, copy=False)


# --- client, phase 2 ---------------------------------------------------------------------------------------------


def compress(g: NDArray[Any], indices: NDArray[Any]) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """ConSparCompress: the phase-2 payload and the next error-compensation memory (Sec. 3.2-3.3; spec 2.2, 2.3).

    ``payload = (g)_{I}`` in ascending order of I, and ``u_next = g - g~`` with ``g~`` = g restricted to I, i.e. g
    with the entries in I set to zero (``u_k^{t+1} = g_k^t - g~_k^t``). The identity
    ``u_next + scatter(payload, I, d) == g`` holds exactly: each coordinate is ``x + 0`` for one of the two.

    Parameters
    ----------
    g
        1-D error-compensated update (length d).
    indices
        The consensus set I^t: 1-D integer, strictly ascending, within [0, d).

    Returns
    -------
    tuple[NDArray[np.float64], NDArray[np.float64]]
        ``(payload, u_next)`` of lengths |I| and d.
    """
    vec = np.asarray(g, dtype=np.float64)
    if vec.ndim != 1:
        raise ValueError(f"g must be 1-D, got shape {vec.shape}")
    idx = _check_index_set(indices, vec.shape[0], "indices")
    payload = vec[idx]
    u_next = vec.copy()
    u_next[idx] = 0.0
    return payload, u_next


def scatter(values: NDArray[Any], indices: NDArray[Any], d: int) -> NDArray[np.float64]:
    """The dense length-d vector with ``values`` at ``indices`` and zeros elsewhere (g~ from ``(g)_I``, footnote 2).

    Parameters
    ----------
    values
        1-D values in the ascending order of ``indices`` (e.g. a payload or the aggregate ``(G~^t)_{I^t}``).
    indices
        1-D integer, strictly ascending, within [0, d), same length as ``values``.
    d
        Model dimension.

    Returns
    -------
    NDArray[np.float64]
        The dense vector.
    """
    _check_dim(d)
    idx = _check_index_set(indices, d, "indices")
    val = np.asarray(values, dtype=np.float64)
    if val.ndim != 1 or val.shape[0] != idx.shape[0]:
        raise ValueError(f"values must be 1-D with len(indices) = {idx.shape[0]} entries, got shape {val.shape}")
    out = np.zeros(d, dtype=np.float64)
    out[idx] = val
    return out


# --- sizes and closed forms ----------------------------------------------------------------------------------------


def k_per_client(fraction: float, d: int, m: int) -> int:
    """Per-client budget ``k = max(1, round(fraction * d / m))`` with ``K = fraction * d`` (spec 11.1, 8.2).

    Python's ``round`` (half to even) is used; e.g. fraction 0.05, d = 269 722, m = 32 gives round(421.44) = 421.
    The caller should log the actual ``K = m * k``.

    Parameters
    ----------
    fraction
        K/d, in (0, m]; ``fraction = m`` gives ``k = d`` (every client proposes all coordinates, spec 11.15).
    d
        Model dimension.
    m
        Number of clients.

    Returns
    -------
    int
        k in [1, d].
    """
    _check_dim(d)
    _check_dim(m, "m")
    if not (0.0 < fraction <= m):
        raise ValueError(f"fraction must lie in (0, m = {m}], got {fraction!r}")
    return min(int(d), max(1, round(fraction * d / m)))


def contraction_dprime(d: int, K: float, m: int, alpha: float, delta: float) -> float:
    """``d'_cons`` of Prop. 2: with a Byzantine fraction <= delta, ConSpar is a d'_cons-contraction (Def. 3, Eq. 4).

    ``d'_cons = d (1 - e^{-a}) + (K/m) e^{-a}`` with ``a = alpha K [(1 - delta) m - 1] / (m d)``; so
    ``E||g - g~||^2 <= (1 - d'_cons/d) ||g||^2`` for every honest client, and ``H = d / d'_cons`` (spec 2.4, 11.22).

    Parameters
    ----------
    d
        Model dimension.
    K
        Total budget (m times the per-client k); 0 < K/m <= d. A float is allowed (e.g. ``0.05 * d``).
    m
        Number of clients.
    alpha
        Obfuscation level in [0, 1].
    delta
        Upper bound on the Byzantine fraction, in [0, 1/2).

    Returns
    -------
    float
        d'_cons (between K/m and d).
    """
    _check_dim(d)
    _check_dim(m, "m")
    _check_alpha(alpha)
    if not (0.0 < K / m <= d):
        raise ValueError(f"K/m must lie in (0, d = {d}], got K = {K!r}, m = {m}")
    if not (0.0 <= delta < 0.5):
        raise ValueError(f"delta must lie in [0, 1/2), got {delta!r}")
    a = alpha * K * ((1.0 - delta) * m - 1.0) / (m * d)
    return float(d * -math.expm1(-a) + (K / m) * math.exp(-a))


def theorem2_epsilon(d: int, k: int, alpha: float) -> tuple[float, float]:
    """Both epsilon-DP levels of Theorem 2 for the proposal map ``T_k -> I_k`` (Sec. 3.2 and its proof, Eqs. 42-54).

    * First bound, any alpha in (0, 1]: ``ln((1 + alpha) k (d - k + 1) / (2 alpha))``.
    * Second bound, alpha in [1/2, 1] (Eq. 54): ``ln(1 + ((1 - alpha)/alpha) (2^k + 1) d^k)``, evaluated in log
      space so that k = 421 does not overflow; it is 0 at alpha = 1 and ``inf`` for alpha < 1/2 (not covered).

    The mechanism is epsilon-DP for the smaller of the two. alpha = 0 proposes the exact top-k set: no protection,
    ``(inf, inf)`` (spec 11.23).

    Parameters
    ----------
    d
        Model dimension.
    k
        Per-client budget K/m, 1 <= k <= d.
    alpha
        Obfuscation level in [0, 1].

    Returns
    -------
    tuple[float, float]
        ``(first_bound, second_bound)``.
    """
    _check_dim(d)
    _check_k(k, d)
    _check_alpha(alpha)
    if alpha == 0.0:
        return math.inf, math.inf
    first = math.log((1.0 + alpha) * k * (d - k + 1) / (2.0 * alpha))
    if alpha < 0.5:
        return first, math.inf
    if alpha == 1.0:
        return first, 0.0
    # log of ((1-alpha)/alpha) (2^k + 1) d^k, with ln(2^k + 1) = k ln 2 + log1p(2^-k).
    log_term = math.log((1.0 - alpha) / alpha) + k * math.log(2.0) + math.log1p(2.0**-k) + k * math.log(d)
    second = float(np.logaddexp(0.0, log_term))  # ln(1 + e^log_term)
    return first, second


def bits_bound(K: float, m: int) -> float:
    """Upper bound on the bits one client exchanges per round, ``(96 + 32/m) K`` (end of Sec. 3.2; spec 2.5).

    Up k = K/m indices, down at most K indices, up and down at most K floats each, at 32 bits apiece:
    ``32 (K/m + K + 2K)``.
    """
    _check_dim(m, "m")
    if K < 0:
        raise ValueError(f"K must be >= 0, got {K!r}")
    return float((96.0 + 32.0 / m) * K)


def topk_bits(K: float) -> float:
    """Bits per client per round of vanilla top-K with 32-bit indices and values both ways, ``4 * 32 K = 128 K``."""
    if K < 0:
        raise ValueError(f"K must be >= 0, got {K!r}")
    return float(128.0 * K)
