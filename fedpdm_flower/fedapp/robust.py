"""Robust aggregators over n vectors: plain mean, geometric median, trimmed mean, centered clipping, norm trimming.

Yang, Wang, Li, "FedREP: A Byzantine-Robust, Communication-Efficient and Privacy-Preserving Framework for Federated
Learning" (seed 003). The server applies ``Agg`` to the ``n = m/s`` buffer means ``b_1..b_n`` packed on the
consensus set I^t (spec fedrep.md 5). The paper fixes only: geoMed by Weiszfeld with 5 iterations (Pillutla et al.
2019), TMean with trimming fraction 7/16 (Yin et al. 2018), CClip with radius 0.5 and 5 iterations (Karimireddy et
al. 2021). Initialisations and the smoothing constant are our readings (spec 11.7). ``norm_trimmed_mean`` is the
server rule of the RCGD-EF baseline (Ghosh et al. 2021, spec 7.1).

Every function takes a 2-D array, one row per input vector, and computes in float64. The same rules are also
callables configured at construction (:class:`Mean`, :class:`GeometricMedian`, :class:`TrimmedMean`,
:class:`CenteredClipping`; ``agg = GeometricMedian(iters=5); agg(vectors)``), the form a strategy takes as its
``aggregator`` argument. Nothing here imports Flower.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "AGGREGATORS",
    "AdaptiveCenteredClipping",
    "Aggregator",
    "Bucketing",
    "CenteredClipping",
    "CoordinateMedian",
    "GeometricMedian",
    "Krum",
    "Mean",
    "NearestNeighborMixing",
    "TrimmedMean",
    "aggregate",
    "bucketing",
    "centered_clipping",
    "coordinate_median",
    "geometric_median",
    "krum_scores",
    "mean",
    "multi_krum",
    "nearest_neighbor_mixing",
    "norm_trimmed_mean",
    "trimmed_mean",
]

def _rows(b: NDArray[Any] | Any, what: str = "b") -> NDArray[np.float64]:
    """``b`` as a float64 (n, d) array (a copy when the dtype changes), after checking shape and finiteness."""
    arr = np.asarray(b, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"{what} must be a 2-D array (one row per vector), got shape {arr.shape}")
    if arr.shape[0] < 1:
        raise ValueError(f"{what} must hold at least one vector, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} contains non-finite values")
    return arr


def _check_iters(iters: int) -> None:
    if isinstance(iters, bool) or not isinstance(iters, (int, np.integer)) or iters < 0:
        raise ValueError(f"iters must be an integer >= 0, got {iters!r}")


def _trim_count(trim_fraction: float, n: int) -> int:
    """``floor(trim_fraction * n)``; the 1e-9 keeps e.g. (1/3)*3 = 0.999... from flooring to 0."""
    if not (math.isfinite(trim_fraction) and trim_fraction >= 0.0):
        raise ValueError(f"trim_fraction must be a finite number >= 0, got {trim_fraction!r}")
    return math.floor(trim_fraction * n + 1e-9)


def _column_mean(arr: NDArray[np.float64]) -> NDArray[np.float64]:
    out: NDArray[np.float64] = np.mean(arr, axis=0)
    return out


def mean(b: NDArray[Any]) -> NDArray[np.float64]:
    """Coordinate-wise mean of the rows (spec 5.4): no robustness, the no-attack and SHARE-equivalence reference.

    Parameters
    ----------
    b
        (n, d) array, one row per input vector.

    Returns
    -------
    NDArray[np.float64]
        The (d,) mean.
    """
    return _column_mean(_rows(b))


def geometric_median(
    b: NDArray[Any], iters: int = 5, nu: float = 1e-6, init: str = "mean"
) -> NDArray[np.float64]:
    """Geometric median by smoothed Weiszfeld iterations (spec 5.1; Pillutla et al. 2019).

    ``z <- sum_i beta_i b_i / sum_i beta_i`` with ``beta_i = 1 / max(nu, ||z - b_i||)``; equal input weights cancel.

    Caveat (measured, see tests): from the mean, each iteration shrinks the offset caused by far outliers only by
    about ``f / (n - f)`` (7/9 for 7 of 16), so 5 iterations leave the estimate ~1e5 from the honest points when 7
    of 16 inputs are ~1e6. The paper's attacks (bit-flip, ALIE, FoE) send vectors of the honest scale, where the
    slow start costs far less; ``init="median"`` starts inside the honest majority and needs no warm-up.

    Parameters
    ----------
    b
        (n, d) array, one row per input vector.
    iters
        Weiszfeld iterations (default 5, the paper's setting). 0 returns the starting point.
    nu
        Smoothing constant (> 0) that bounds the weight of an input the iterate sits on (default 1e-6, spec 11.7;
        the epfml reference code uses 0.1).
    init
        Starting point: "mean" (default, spec 11.7), "median" (coordinate-wise median) or "zeros" (the epfml
        reference; degenerate when an input is exactly 0: that input gets weight 1/nu and the iterate leaves it
        only slowly).

    Returns
    -------
    NDArray[np.float64]
        The (d,) estimate after ``iters`` iterations.
    """
    arr = _rows(b)
    _check_iters(iters)
    if not (math.isfinite(nu) and nu > 0.0):
        raise ValueError(f"nu must be a finite number > 0, got {nu!r}")
    if init == "mean":
        z = _column_mean(arr)
    elif init == "median":
        z = np.median(arr, axis=0)
    elif init == "zeros":
        z = np.zeros(arr.shape[1], dtype=np.float64)
    else:
        raise ValueError(f"init must be 'mean', 'median' or 'zeros', got {init!r}")
    for _ in range(iters):
        beta = 1.0 / np.maximum(nu, np.linalg.norm(arr - z, axis=1))
        z = (beta / beta.sum()) @ arr
    return np.asarray(z, dtype=np.float64)


def trimmed_mean(b: NDArray[Any], trim_fraction: float = 7 / 16) -> NDArray[np.float64]:
    """Coordinate-wise trimmed mean (spec 5.2; Yin et al. 2018).

    Per coordinate, drop the ``t = floor(trim_fraction * n)`` smallest and the ``t`` largest values and average the
    remaining ``n - 2t``. With the paper's 7/16 and n = 16 buffers, t = 7: the mean of the middle two.

    Parameters
    ----------
    b
        (n, d) array, one row per input vector.
    trim_fraction
        Fraction trimmed from each side (default 7/16, the paper's setting).

    Returns
    -------
    NDArray[np.float64]
        The (d,) trimmed mean.

    Raises
    ------
    ValueError
        If nothing would remain (``n - 2t < 1``).
    """
    arr = _rows(b)
    n = arr.shape[0]
    t = _trim_count(trim_fraction, n)
    if n - 2 * t < 1:
        raise ValueError(f"trim_fraction {trim_fraction!r} trims {t} per side of n={n}, leaving nothing to average")
    return _column_mean(np.sort(arr, axis=0)[t : n - t])


def centered_clipping(
    b: NDArray[Any], tau: float = 0.5, iters: int = 5, center: NDArray[Any] | None = None
) -> NDArray[np.float64]:
    """Centered clipping (spec 5.3; Karimireddy et al. 2021).

    ``v <- v + (1/n) sum_i (b_i - v) * min(1, tau / ||b_i - v||)``, ``iters`` times from ``v = center``. Each
    outlier moves ``v`` by at most ``tau / n`` per iteration, whatever its size.

    Parameters
    ----------
    b
        (n, d) array, one row per input vector.
    tau
        Clipping radius (> 0; ``inf`` disables clipping, so one iteration gives the mean). Default 0.5, the paper's.
    iters
        Clipping iterations (default 5, the paper's setting).
    center
        Starting point, shape (d,). None (default) means zeros, the stateless choice of spec 11.7 (ConSpar changes
        the coordinate set every round); pass the previous aggregate restricted to I^t for the "prev" variant.

    Returns
    -------
    NDArray[np.float64]
        The (d,) aggregate.
    """
    arr = _rows(b)
    _check_iters(iters)
    if math.isnan(tau) or tau <= 0.0:
        raise ValueError(f"tau must be > 0 (inf allowed), got {tau!r}")
    d = arr.shape[1]
    if center is None:
        v = np.zeros(d, dtype=np.float64)
    else:
        v = np.array(center, dtype=np.float64)  # a copy: the caller's centre is not updated in place
        if v.shape != (d,):
            raise ValueError(f"center must have shape ({d},), got {v.shape}")
        if not np.isfinite(v).all():
            raise ValueError("center contains non-finite values")
    n = arr.shape[0]
    for _ in range(iters):
        diff = arr - v
        norms = np.linalg.norm(diff, axis=1)
        # A row at distance 0 contributes nothing; the `where` avoids tau/0 (and inf/0 when tau is inf).
        scale = np.minimum(1.0, np.divide(tau, norms, out=np.ones_like(norms), where=norms > 0.0))
        v = v + (scale @ diff) / n
    return v


def norm_trimmed_mean(b: NDArray[Any], norms: NDArray[Any], trim_fraction: float) -> NDArray[np.float64]:
    """Mean of the rows left after dropping those with the largest reported norms (RCGD-EF server, spec 5.5 / 7.1).

    Drops ``t = floor(trim_fraction * n)`` rows. The norms are what the clients *reported* (a Byzantine client may
    lie), so they are taken as given, not recomputed from ``b``. Ties are broken by row index: among equal norms
    the later rows are dropped first.

    Parameters
    ----------
    b
        (n, d) array, one row per client's (decompressed) update.
    norms
        (n,) reported norms, finite.
    trim_fraction
        Fraction of rows dropped (spec 11.18 recommends 7/32, the Byzantine fraction).

    Returns
    -------
    NDArray[np.float64]
        The (d,) mean of the kept rows.

    Raises
    ------
    ValueError
        If ``norms`` does not match ``b`` or nothing would remain (``n - t < 1``).
    """
    arr = _rows(b)
    n = arr.shape[0]
    reported = np.asarray(norms, dtype=np.float64)
    if reported.shape != (n,):
        raise ValueError(f"norms must have shape ({n},) to match b, got {reported.shape}")
    if not np.isfinite(reported).all():
        raise ValueError("norms contains non-finite values")
    t = _trim_count(trim_fraction, n)
    if n - t < 1:
        raise ValueError(f"trim_fraction {trim_fraction!r} drops {t} of n={n} rows, leaving nothing to average")
    keep = np.sort(np.argsort(reported, kind="stable")[: n - t])  # kept rows summed in their original order
    return _column_mean(arr[keep])


#: The robust aggregators FedREP can be configured with (spec 5), by config name.
AGGREGATORS: dict[str, Callable[..., NDArray[np.float64]]] = {
    "mean": mean,
    "geomed": geometric_median,
    "tmean": trimmed_mean,
    "cclip": centered_clipping,
}


def aggregate(name: str, b: NDArray[Any], **params: Any) -> NDArray[np.float64]:
    """Apply the aggregator registered as ``name`` in :data:`AGGREGATORS` to ``b`` with keyword ``params``.

    Parameters
    ----------
    name
        "mean", "geomed", "tmean" or "cclip".
    b
        (n, d) array, one row per input vector.
    **params
        Keyword arguments of that aggregator (e.g. ``tau=0.5`` for "cclip").

    Returns
    -------
    NDArray[np.float64]
        The (d,) aggregate.
    """
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}; valid: {', '.join(AGGREGATORS)}")
    return AGGREGATORS[name](b, **params)


# ------------------------------------------------------------------------------ the rules as configured callables


@runtime_checkable
class Aggregator(Protocol):
    """A robust aggregation rule: ``agg(vectors)`` maps an (n, d) array (one row per input) to the (d,) aggregate."""

    def __call__(self, vectors: NDArray[Any]) -> NDArray[np.float64]:
        """The aggregate of the rows of ``vectors``."""
        ...


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Mean:
    """The coordinate-wise mean (:func:`mean`): no robustness; FedREP with it is SHARE's plain average (spec 5.4)."""

    def __call__(self, vectors: NDArray[Any]) -> NDArray[np.float64]:
        return mean(vectors)


@dataclass(frozen=True)
class GeometricMedian:
    """The geometric median by smoothed Weiszfeld iterations (:func:`geometric_median`; Pillutla et al. 2019).

    Parameters
    ----------
    iters
        Weiszfeld iterations (default 5, the paper's setting, Sec. 5).
    nu
        Smoothing constant > 0 (default 1e-6, spec 11.7).
    init
        Starting point: "mean" (default, spec 11.7), "median" or "zeros".
    """

    iters: int = 5
    nu: float = 1e-6
    init: str = "mean"

    def __post_init__(self) -> None:
        _check_count("iters", self.iters)
        if not (isinstance(self.nu, int | float) and math.isfinite(self.nu) and self.nu > 0):
            raise ValueError(f"nu must be a finite number > 0, got {self.nu!r}")
        if self.init not in ("mean", "median", "zeros"):
            raise ValueError(f"init must be 'mean', 'median' or 'zeros', got {self.init!r}")

    def __call__(self, vectors: NDArray[Any]) -> NDArray[np.float64]:
        return geometric_median(vectors, self.iters, self.nu, self.init)


@dataclass(frozen=True)
class TrimmedMean:
    """The coordinate-wise trimmed mean (:func:`trimmed_mean`; Yin et al. 2018).

    Parameters
    ----------
    trim_fraction
        Fraction trimmed from each side, in [0, 0.5) (default 7/16, the paper's setting, Sec. 5).
    """

    trim_fraction: float = 7 / 16

    def __post_init__(self) -> None:
        f = self.trim_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 <= f < 0.5:
            raise ValueError(f"trim_fraction must lie in [0, 0.5), got {f!r}")

    def __call__(self, vectors: NDArray[Any]) -> NDArray[np.float64]:
        return trimmed_mean(vectors, self.trim_fraction)


@dataclass(frozen=True)
class CenteredClipping:
    """Centered clipping from the origin (:func:`centered_clipping`; Karimireddy et al. 2021), stateless (spec 11.7).

    Parameters
    ----------
    tau
        Clipping radius > 0 (default 0.5, the paper's, tuned for ResNet-20 updates: match it to the scale of the
        inputs, a radius far above their norms clips nothing and gives the mean).
    iters
        Clipping iterations (default 5, the paper's).
    """

    tau: float = 0.5
    iters: int = 5

    def __post_init__(self) -> None:
        if isinstance(self.tau, bool) or not isinstance(self.tau, int | float) or math.isnan(self.tau) or self.tau <= 0:
            raise ValueError(f"tau must be > 0 (inf allowed), got {self.tau!r}")
        _check_count("iters", self.iters)

    def __call__(self, vectors: NDArray[Any]) -> NDArray[np.float64]:
        return centered_clipping(vectors, self.tau, self.iters)


@dataclass(frozen=True)
class AdaptiveCenteredClipping:
    """Centered clipping whose radius follows the scale of the round's inputs instead of a fixed constant (issue 16).

    The center starts at the coordinate-wise median (a robust point, where clipping from the origin would clip the
    honest updates of a model whose updates are large, and clip nothing where they are tiny); the radius is the
    ``quantile`` of the inputs' distances to it; then :func:`centered_clipping` runs ``iters`` times from there.
    Scaling every input by c scales the output by c, which no fixed tau does. With a quantile <= 1/2 the radius is
    set by honest inputs as long as they are the majority.

    Parameters
    ----------
    quantile
        The quantile of the distances to the median that becomes tau, in (0, 1] (default 0.5).
    iters
        Clipping iterations (default 5).
    """

    quantile: float = 0.5
    iters: int = 5

    def __post_init__(self) -> None:
        q = self.quantile
        if isinstance(q, bool) or not isinstance(q, int | float) or not 0.0 < q <= 1.0:
            raise ValueError(f"quantile must lie in (0, 1], got {q!r}")
        _check_count("iters", self.iters)

    def radius(self, vectors: NDArray[Any]) -> tuple[NDArray[np.float64], float]:
        """(the starting center, tau) for these inputs."""
        arr = _rows(vectors)
        center = coordinate_median(arr)
        dist = np.linalg.norm(arr - center, axis=1)
        return center, float(np.quantile(dist, self.quantile))

    def __call__(self, vectors: NDArray[Any]) -> NDArray[np.float64]:
        center, tau = self.radius(vectors)
        if tau <= 0.0:  # at least half the inputs sit on the median: it is the answer
            return center
        return centered_clipping(vectors, tau, self.iters, center=center)


# ------------------------------------------------------------------------------ more rules (issue 13: any strategy)


def coordinate_median(b: NDArray[Any]) -> NDArray[np.float64]:
    """Coordinate-wise median of the rows (Yin et al. 2018; numpy's: the mean of the middle two for even n)."""
    return np.asarray(np.median(_rows(b), axis=0), dtype=np.float64)


def _pairwise_sq_dists(arr: NDArray[np.float64]) -> NDArray[np.float64]:
    """(n, n) squared Euclidean distances, computed by differences (no ||a||^2 + ||b||^2 - 2ab cancellation)."""
    n = arr.shape[0]
    out = np.zeros((n, n))
    for i in range(n):
        diff = arr - arr[i]
        out[i] = np.einsum("ij,ij->i", diff, diff)
    return out


def krum_scores(b: NDArray[Any], f: int) -> NDArray[np.float64]:
    """Krum's score of every row: the sum of its squared distances to its n - f - 2 nearest other rows (Blanchard
    et al. 2017, Def. 1); at least 1 neighbour is used when n - f - 2 < 1."""
    arr = _rows(b)
    n = arr.shape[0]
    if isinstance(f, bool) or not isinstance(f, int | np.integer) or not 0 <= f < n:
        raise ValueError(f"f must be an integer in [0, n = {n}), got {f!r}")
    d2 = _pairwise_sq_dists(arr)
    np.fill_diagonal(d2, np.inf)
    k = max(1, n - f - 2) if n > 1 else 0
    return np.asarray(np.sort(d2, axis=1)[:, :k].sum(axis=1), dtype=np.float64)


def multi_krum(b: NDArray[Any], f: int, m: int = 1) -> NDArray[np.float64]:
    """Multi-Krum: the mean of the m rows with the lowest Krum scores (m = 1 is Krum; ties to the lower index)."""
    arr = _rows(b)
    if isinstance(m, bool) or not isinstance(m, int | np.integer) or not 1 <= m <= arr.shape[0]:
        raise ValueError(f"m must be an integer in [1, n = {arr.shape[0]}], got {m!r}")
    if arr.shape[0] == 1:
        return np.array(arr[0], dtype=np.float64)
    order = np.argsort(krum_scores(arr, f), kind="stable")
    return _column_mean(arr[np.sort(order[:m])])


def nearest_neighbor_mixing(b: NDArray[Any], f: int) -> NDArray[np.float64]:
    """NNM (Allouah et al., "Fixing by Mixing", AISTATS 2023): each row replaced by the mean of its n - f nearest
    rows, itself included (ties to the lower index). Returns the (n, d) mixed rows, to feed an aggregator."""
    arr = _rows(b)
    n = arr.shape[0]
    if isinstance(f, bool) or not isinstance(f, int | np.integer) or not 0 <= f < n:
        raise ValueError(f"f must be an integer in [0, n = {n}), got {f!r}")
    d2 = _pairwise_sq_dists(arr)
    near = np.argsort(d2, axis=1, kind="stable")[:, : n - f]
    return np.stack([arr[idx].mean(axis=0) for idx in near])


def bucketing(b: NDArray[Any], size: int, rng: np.random.Generator) -> NDArray[np.float64]:
    """Bucketing (Karimireddy, He, Jaggi, ICLR 2022): a random permutation of the rows cut into ceil(n / s) buckets
    of s consecutive rows (the last may be smaller), each replaced by its mean. Returns the bucket means."""
    arr = _rows(b)
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
        raise ValueError(f"bucket size must be an integer >= 1, got {size!r}")
    perm = rng.permutation(arr.shape[0])
    return np.stack([arr[perm[i:i + size]].mean(axis=0) for i in range(0, arr.shape[0], size)])


@dataclass(frozen=True)
class CoordinateMedian:
    """The coordinate-wise median (:func:`coordinate_median`; Yin et al. 2018)."""

    def __call__(self, vectors: NDArray[Any]) -> NDArray[np.float64]:
        return coordinate_median(vectors)


@dataclass(frozen=True)
class Krum:
    """Krum / Multi-Krum (:func:`multi_krum`; Blanchard et al. 2017): the mean of the ``m`` inputs closest to their
    n - f - 2 nearest others. Its guarantee needs n > 2f + 2. ByzFL's ``Krum(f)`` counts n - f - 1 neighbours: it is
    our ``Krum(f - 1)``, and its ``MultiKrum(f)`` our ``Krum(f - 1, m=n - f)`` (tests/test_byzfl_crosscheck.py).

    Parameters
    ----------
    f
        Number of Byzantine inputs tolerated.
    m
        Inputs averaged (default 1: Krum).
    """

    f: int
    m: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.f, bool) or not isinstance(self.f, int) or self.f < 0:
            raise ValueError(f"f must be an integer >= 0, got {self.f!r}")
        _check_count("m", self.m)

    def __call__(self, vectors: NDArray[Any]) -> NDArray[np.float64]:
        return multi_krum(vectors, min(self.f, len(vectors) - 1), min(self.m, len(vectors)))


@dataclass(frozen=True)
class NearestNeighborMixing:
    """The NNM pre-aggregator (:func:`nearest_neighbor_mixing`; Allouah et al. 2023): ``pre(vectors)`` returns the
    mixed vectors, which any aggregator then combines.

    Parameters
    ----------
    f
        Number of Byzantine inputs tolerated: each input is mixed with its n - f nearest.
    """

    f: int

    def __post_init__(self) -> None:
        if isinstance(self.f, bool) or not isinstance(self.f, int) or self.f < 0:
            raise ValueError(f"f must be an integer >= 0, got {self.f!r}")

    def __call__(self, vectors: NDArray[Any], rng: np.random.Generator | None = None) -> NDArray[np.float64]:
        return nearest_neighbor_mixing(vectors, min(self.f, len(vectors) - 1))


@dataclass(frozen=True)
class Bucketing:
    """The bucketing pre-aggregator (:func:`bucketing`; Karimireddy et al. 2022): ``pre(vectors, rng)`` returns the
    means of random buckets of ``size`` inputs.

    Parameters
    ----------
    size
        Inputs per bucket (default 2; Karimireddy et al. take s with f s < n / 2, so that most buckets are honest).
    """

    size: int = 2

    def __post_init__(self) -> None:
        _check_count("size", self.size)

    def __call__(self, vectors: NDArray[Any], rng: np.random.Generator | None = None) -> NDArray[np.float64]:
        if rng is None:
            raise ValueError("bucketing needs a random generator (the buckets must be unpredictable)")
        return bucketing(vectors, self.size, rng)
