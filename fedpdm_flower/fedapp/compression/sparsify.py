"""Sparsifiers of BSDP-FedPDM: top-k and rand-k index selection (Definition 3, eqs. 16-18 and 27).

Li, Huang, Wang, Chi, Quek, arXiv 2310.19558. The functions return index sets only; the values are gathered by the
caller (``y[idx]``), and no d/k rescaling is applied because the server's element-wise mean (20)/(23) handles the
missing coordinates. Indices are always returned in ascending order: the Gaussian noise (19) is then added to the
values in index order, so that k = d draws exactly the same noise per coordinate as the dense path (spec 10.12).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

__all__ = ["RandK", "TopK", "rand_k", "resolve_k", "top_k"]

# Guards floor(alpha*d) against alpha*d landing just below an integer in floating point (spec A17).
_ROUNDING_SLACK = 1e-9


def resolve_k(alpha: float, d: int) -> int:
    """Number of kept entries, ``k = max(1, floor(alpha * d + 1e-9))`` (spec section 5, A17).

    Parameters
    ----------
    alpha
        Compression ratio alpha_U or alpha_D, in (0, 1].
    d
        Vector dimension (>= 1).

    Returns
    -------
    int
        k in [1, d].
    """
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d must be an integer >= 1, got {d!r}")
    if not (0.0 < alpha <= 1.0):
        raise ValueError(f"alpha must lie in (0, 1], got {alpha!r}")
    return max(1, math.floor(alpha * d + _ROUNDING_SLACK))


def _check_k(k: int, d: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not (1 <= k <= d):
        raise ValueError(f"k must be an integer in [1, d={d}], got {k!r}")


def top_k(y: NDArray[Any], k: int) -> NDArray[np.int64]:
    """Indices of the k entries of largest magnitude, ``I(top_k(y))`` (eqs. 16a, 17a, 27).

    Ties in |y_j| are broken by taking the lower index first (spec A17), so the result is deterministic. The
    k-th largest magnitude is found with ``np.argpartition`` (O(d)); every entry strictly above it is kept, and the
    remaining slots go to the lowest-indexed entries equal to it. This equals a full sort by (-|y_j|, j).

    Parameters
    ----------
    y
        1-D real vector with finite entries.
    k
        Number of entries to keep, 1 <= k <= len(y).

    Returns
    -------
    NDArray[np.int64]
        k distinct indices in ascending order.
    """
    vec = np.asarray(y)
    if vec.ndim != 1:
        raise ValueError(f"y must be 1-D, got shape {vec.shape}")
    d = vec.shape[0]
    _check_k(k, d)
    mag = np.abs(vec.astype(np.float64, copy=False))
    if not np.all(np.isfinite(mag)):
        raise ValueError("y contains NaN or Inf; top_k needs finite magnitudes to rank")
    if k == d:
        return np.arange(d, dtype=np.int64)
    pivot = d - k
    kth = mag[np.argpartition(mag, pivot)[pivot]]  # the k-th largest magnitude
    above = np.flatnonzero(mag > kth)
    ties = np.flatnonzero(mag == kth)[: k - above.size]  # flatnonzero is ascending: lower index first
    return np.union1d(above, ties).astype(np.int64, copy=False)


def rand_k(d: int, k: int, rng: np.random.Generator) -> NDArray[np.int64]:
    """k distinct indices drawn uniformly without replacement, ``I(rand_k(y))`` (eqs. 16b, 17b).

    The choice does not depend on the data, so the paper's sensitivity argument covers it (spec 4.3).

    Parameters
    ----------
    d
        Vector dimension (>= 1).
    k
        Number of indices, 1 <= k <= d.
    rng
        Seeded generator, fresh per client and round.

    Returns
    -------
    NDArray[np.int64]
        k distinct indices in ascending order.
    """
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d must be an integer >= 1, got {d!r}")
    _check_k(k, d)
    return np.sort(rng.choice(d, size=k, replace=False)).astype(np.int64, copy=False)


@dataclass(frozen=True)
class TopK:
    """The top-k sparsifier as a constructor argument and a codec: keep the k = max(1, floor(fraction d)) entries
    of largest magnitude (eqs. 16a, 17a, 27), sent as k float32 values plus compact indices.

    Parameters
    ----------
    fraction
        alpha in (0, 1]: the kept fraction of the d coordinates.
    """

    fraction: float
    name: ClassVar[str] = "topk"
    #: every client keeps other coordinates: encodings of different clients cannot be summed coordinate-wise
    shared_support: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, int | float) or not 0 < self.fraction <= 1:
            raise ValueError(f"{type(self).__name__} fraction must lie in (0, 1], got {self.fraction!r}")

    @property
    def spec(self) -> str:
        """``"<name>:<fraction>"``, the form a message carries (:func:`fedpdm_flower.fedapp.compression.codecs.codec_from_spec`)."""
        return f"{self.name}:{self.fraction!r}"

    def k(self, d: int) -> int:
        """k for a vector of dimension d (:func:`resolve_k`)."""
        return resolve_k(self.fraction, d)

    def indices(self, v: NDArray[Any], rng: np.random.Generator | None = None) -> NDArray[np.int64]:
        """The kept indices of v, ascending."""
        return top_k(v, self.k(len(v)))

    def encode(self, v: NDArray[Any], rng: np.random.Generator | None = None) -> dict[str, NDArray[Any]]:
        """The kept entries of v as a compact payload (:func:`fedpdm_flower.fedapp.compression.codec.encode_sparse`)."""
        from fedpdm_flower.fedapp.compression.codec import SparseVector, encode_dense, encode_sparse

        vec = np.asarray(v, dtype=np.float64)
        idx = self.indices(vec, rng)
        if len(idx) == len(vec):
            return encode_dense(vec)
        return encode_sparse(SparseVector(indices=idx, values=vec[idx], dim=len(vec)))

    def decode(self, arrays: Mapping[str, Any], dim: int) -> NDArray[np.float64]:
        """The dense vector of a received payload (at most k entries; MalformedPayload otherwise)."""
        from fedpdm_flower.fedapp.compression.codec import decode_vector

        return decode_vector(arrays, dim, max_k=self.k(dim)).to_dense()


@dataclass(frozen=True)
class RandK(TopK):
    """The rand-k sparsifier: k = max(1, floor(fraction d)) coordinates drawn uniformly without replacement
    (eqs. 16b, 17b), independently of the values."""

    name: ClassVar[str] = "randk"

    def indices(self, v: NDArray[Any], rng: np.random.Generator | None = None) -> NDArray[np.int64]:
        """k uniformly random indices, ascending (``rng`` is required)."""
        if rng is None:
            raise ValueError("rand-k needs a random generator")
        return rand_k(len(v), self.k(len(v)), rng)
