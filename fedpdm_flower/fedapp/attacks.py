"""SIMULATION ONLY: Byzantine attacks on what a client submits, for experiments on robustness.

Honest code never imports this module, and no honest code path calls it. A simulation builds its Byzantine
participants from two explicit objects defined here, which the public classes accept as *simulation-only*
arguments and otherwise never touch:

* :class:`ClientAttack`, given to the clients the simulation chose as Byzantine (:func:`byzantine_ids` of the run
  seed): what such a client corrupts in what it sends (bit-flipping its values, the min / rand coordinate attacks);
* :class:`OmniscientOracle`, given to the server strategy: the adversary oracle of spec fedrep.md 10.4, which sees
  every client's plain submission and replaces the Byzantine ones (ALIE, FoE, "same") before aggregation. Only a
  strategy whose uploads are in the clear can run it; with real masking the server cannot, by design.

Yang, Wang, Li, "FedREP" (seed 003), Sec. 5 and App. C.2; spec sections 6 and 11.8-11.10:

* value attacks on the phase-2 vectors ``x_k = (g~_k)_{I^t}``: bit-flipping (``-x_k``), ALIE ("A Little Is
  Enough", Baruch et al. 2019: ``mu - z * sigma`` over the honest vectors) and FoE ("Fall of Empires", Xie et al.
  2020: ``-eps * mean(honest)``, the paper's magnitude eps = 0.5). ALIE and FoE are omniscient.
* coordinate attacks on the phase-1 proposals (App. C.2): ``min`` (the k smallest ``|g|``), ``rand`` (k uniform
  coordinates) and ``same`` (a copy of an honest client's proposal, omniscient).

Byzantine clients otherwise run the honest pipeline (training, memory, momentum); only what they transmit changes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "COORDINATE_ATTACKS",
    "VALUE_ATTACKS",
    "ALittleIsEnough",
    "ClientAttack",
    "InnerProductManipulation",
    "Mimic",
    "MinMax",
    "MinSum",
    "OmniscientOracle",
    "SignFlipping",
    "alie",
    "alie_z",
    "apply_coordinate_attack",
    "apply_value_attack",
    "bit_flip",
    "byzantine_ids",
    "foe",
    "label_flip",
    "min_attack",
    "random_attack",
    "same_attack",
]

VALUE_ATTACKS = ("none", "bit-flip", "alie", "foe")
COORDINATE_ATTACKS = ("none", "min", "rand", "same")

# Stream tag of the Byzantine-id draw, so it is independent of other generators seeded with the bare run seed.
_STREAM_BYZANTINE = 101


def _vector(x: NDArray[Any] | Any, what: str) -> NDArray[np.float64]:
    arr = np.array(x, dtype=np.float64)  # always a copy
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D vector, got shape {arr.shape}")
    return arr


def _honest_rows(honest: NDArray[Any] | Any, min_rows: int) -> NDArray[np.float64]:
    arr = np.asarray(honest, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"honest must be a 2-D array (one row per honest vector), got shape {arr.shape}")
    if arr.shape[0] < min_rows:
        raise ValueError(f"need at least {min_rows} honest vector(s), got {arr.shape[0]}")
    return arr


# ---------------------------------------------------------------------------------------------- value attacks


def bit_flip(x: NDArray[Any]) -> NDArray[np.float64]:
    """Bit-flipping: the client's own honest vector in the opposite direction, ``-x`` (non-omniscient).

    Parameters
    ----------
    x
        The Byzantine client's honest phase-2 vector.

    Returns
    -------
    NDArray[np.float64]
        ``-x`` as a new float64 array.
    """
    return -_vector(x, "x")


def alie(honest: NDArray[Any], z: float) -> NDArray[np.float64]:
    """ALIE: ``mu - z * sigma``, coordinate-wise mean and unbiased (n-1) std over the honest vectors (spec 6, 11.8).

    Parameters
    ----------
    honest
        (n_h, d) array of the honest clients' vectors (client level, not buffer level), n_h >= 2.
    z
        Number of standard deviations, e.g. :func:`alie_z` (0.2533 for m = 32, f = 7 with the epfml formula).

    Returns
    -------
    NDArray[np.float64]
        The (d,) vector every Byzantine client sends.
    """
    if not math.isfinite(z):
        raise ValueError(f"z must be finite, got {z!r}")
    arr = _honest_rows(honest, 2)
    forged: NDArray[np.float64] = np.mean(arr, axis=0) - z * np.std(arr, axis=0, ddof=1)
    return forged


def alie_z(m: int, f: int, formula: str = "epfml") -> float:
    """The ALIE multiplier z for ``m`` clients of which ``f`` are Byzantine (spec 6; the paper gives none).

    Both formulas use ``s = floor(m/2 + 1) - f`` supporters needed for a majority.

    * "epfml" (Karimireddy et al.'s reference code, our default): ``z = Phi^-1((m - f - s) / (m - f))``;
      0.2533 for m = 32, f = 7.
    * "baruch" (Baruch et al. 2019): ``z = Phi^-1((m - s) / m)``; 0.4888 for m = 32, f = 7.

    Parameters
    ----------
    m
        Number of clients.
    f
        Number of Byzantine clients, 0 <= f < m.
    formula
        "epfml" (default, spec 11.8) or "baruch".

    Returns
    -------
    float
        z.

    Raises
    ------
    ValueError
        If the quantile is not in (0, 1) (e.g. f so large that no supporters are needed).
    """
    if m < 1 or not 0 <= f < m:
        raise ValueError(f"need m >= 1 and 0 <= f < m, got m={m}, f={f}")
    s = m // 2 + 1 - f
    if formula == "epfml":
        q = (m - f - s) / (m - f)
    elif formula == "baruch":
        q = (m - s) / m
    else:
        raise ValueError(f"formula must be 'epfml' or 'baruch', got {formula!r}")
    if not 0.0 < q < 1.0:
        raise ValueError(f"ALIE quantile {q} for m={m}, f={f} ({formula}) is not in (0, 1)")
    return statistics.NormalDist().inv_cdf(q)


def foe(honest: NDArray[Any], eps: float = 0.5) -> NDArray[np.float64]:
    """Fall of Empires (inner-product manipulation): ``-eps * mean(honest)`` (spec 6, 11.9; Xie et al. 2020).

    Parameters
    ----------
    honest
        (n_h, d) array of the honest clients' vectors, n_h >= 1.
    eps
        Attack magnitude (default 0.5, the paper's setting).

    Returns
    -------
    NDArray[np.float64]
        The (d,) vector every Byzantine client sends.
    """
    if not math.isfinite(eps):
        raise ValueError(f"eps must be finite, got {eps!r}")
    forged: NDArray[np.float64] = -eps * np.mean(_honest_rows(honest, 1), axis=0)
    return forged


def apply_value_attack(
    name: str,
    vectors: Mapping[int, NDArray[Any]],
    byzantine: AbstractSet[int],
    eps: float = 0.5,
    z: float | None = None,
) -> dict[int, NDArray[np.float64]]:
    """The submissions after the Byzantine clients among ``vectors`` replaced theirs (spec 6).

    Byzantine clients first computed their honest vectors; "bit-flip" negates each one's own, "alie" and "foe"
    give all of them the same vector computed from the honest clients' submissions, "none" changes nothing.
    Byzantine ids absent from ``vectors`` are ignored.

    Parameters
    ----------
    name
        "none", "bit-flip", "alie" or "foe".
    vectors
        Client id -> phase-2 vector (1-D, all of the same length for "alie" and "foe").
    byzantine
        Ids of the Byzantine clients.
    eps
        FoE magnitude (default 0.5, the paper's setting).
    z
        ALIE multiplier; None (default) means ``alie_z(len(vectors), f, "epfml")`` with f the number of Byzantine
        ids present.

    Returns
    -------
    dict[int, NDArray[np.float64]]
        Same keys and order as ``vectors``, every value a new float64 array; honest values equal their inputs.
    """
    if name not in VALUE_ATTACKS:
        raise ValueError(f"unknown value attack {name!r}; valid: {', '.join(VALUE_ATTACKS)}")
    out = {cid: _vector(v, f"vectors[{cid}]") for cid, v in vectors.items()}
    byz = [cid for cid in out if cid in byzantine]
    if name == "none" or not byz:
        return out
    if name == "bit-flip":
        for cid in byz:
            out[cid] = -out[cid]
        return out
    honest_ids = sorted(cid for cid in out if cid not in byzantine)
    lengths = {out[cid].shape[0] for cid in out}
    if len(lengths) != 1:
        raise ValueError(f"{name} needs vectors of one length, got lengths {sorted(lengths)}")
    honest = np.stack([out[cid] for cid in honest_ids]) if honest_ids else np.empty((0, lengths.pop()))
    forged = alie(honest, alie_z(len(out), len(byz)) if z is None else z) if name == "alie" else foe(honest, eps)
    for cid in byz:
        out[cid] = forged.copy()
    return out


# ----------------------------------------------------------------------------------------- coordinate attacks


def _check_k(k: int, d: int) -> None:
    if not 1 <= k <= d:
        raise ValueError(f"k must satisfy 1 <= k <= d={d}, got {k}")


def min_attack(g: NDArray[Any], k: int) -> NDArray[np.int64]:
    """minAtk: the indices of the ``k`` smallest ``|g_j|`` of the Byzantine client's own update (App. C.2).

    Ties are broken by index (the lower index is smaller), mirroring ConSpar's top-k order (spec 11.3).

    Parameters
    ----------
    g
        The Byzantine client's error-compensated update (1-D).
    k
        Proposal size, 1 <= k <= len(g).

    Returns
    -------
    NDArray[np.int64]
        ``k`` distinct indices in ascending order.
    """
    mag = np.abs(_vector(g, "g"))
    _check_k(k, mag.shape[0])
    return np.sort(np.argsort(mag, kind="stable")[:k]).astype(np.int64)


def random_attack(d: int, k: int, rng: np.random.Generator) -> NDArray[np.int64]:
    """randAtk: ``k`` coordinates of ``[0, d)`` uniformly at random without replacement (App. C.2).

    Parameters
    ----------
    d
        Model dimension.
    k
        Proposal size, 1 <= k <= d.
    rng
        Generator of the draw.

    Returns
    -------
    NDArray[np.int64]
        ``k`` distinct indices in ascending order.
    """
    _check_k(k, d)
    return np.sort(rng.choice(d, size=k, replace=False)).astype(np.int64)


def same_attack(honest_proposals: Sequence[NDArray[Any]], rng: np.random.Generator) -> NDArray[np.int64]:
    """sameAtk: a copy of the proposal of one honest client drawn uniformly (App. C.2; spec 6, omniscient).

    Parameters
    ----------
    honest_proposals
        The honest clients' proposals, in a fixed order (e.g. by client id) so the draw is reproducible.
    rng
        Generator of the draw.

    Returns
    -------
    NDArray[np.int64]
        A new array equal to the chosen proposal.
    """
    if len(honest_proposals) == 0:
        raise ValueError("same_attack needs at least one honest proposal")
    return np.array(honest_proposals[int(rng.integers(len(honest_proposals)))], dtype=np.int64)


def apply_coordinate_attack(
    name: str,
    proposals: Mapping[int, NDArray[Any]],
    byzantine: AbstractSet[int],
    d: int,
    rng: np.random.Generator,
    updates: Mapping[int, NDArray[Any]] | None = None,
) -> dict[int, NDArray[np.int64]]:
    """The phase-1 proposals after the Byzantine clients among ``proposals`` replaced theirs (App. C.2).

    Each Byzantine client keeps its proposal size ``k = len(proposal)``. With "same", each Byzantine client copies
    an honest client drawn independently (honest proposals ordered by id). Byzantine clients are processed in
    ascending id order, so a given ``rng`` state gives a reproducible result. Byzantine ids absent from
    ``proposals`` are ignored.

    Parameters
    ----------
    name
        "none", "min", "rand" or "same".
    proposals
        Client id -> proposed coordinate indices (1-D integer array).
    byzantine
        Ids of the Byzantine clients.
    d
        Model dimension.
    rng
        Generator for "rand" and "same".
    updates
        Client id -> error-compensated update ``g_k`` (length d); required for "min", for every Byzantine client.
        Default None.

    Returns
    -------
    dict[int, NDArray[np.int64]]
        Same keys and order as ``proposals``, every value a new int64 array; honest values equal their inputs.
    """
    if name not in COORDINATE_ATTACKS:
        raise ValueError(f"unknown coordinate attack {name!r}; valid: {', '.join(COORDINATE_ATTACKS)}")
    out = {cid: np.array(p, dtype=np.int64) for cid, p in proposals.items()}
    byz = sorted(cid for cid in out if cid in byzantine)
    if name == "none" or not byz:
        return out
    honest = [out[cid] for cid in sorted(cid for cid in out if cid not in byzantine)]
    for cid in byz:
        k = out[cid].shape[0]
        if name == "min":
            if updates is None or cid not in updates:
                raise ValueError(f"min attack needs the update of Byzantine client {cid}")
            g = np.asarray(updates[cid])
            if g.shape != (d,):
                raise ValueError(f"update of client {cid} must have shape ({d},), got {g.shape}")
            out[cid] = min_attack(g, k)
        elif name == "rand":
            out[cid] = random_attack(d, k, rng)
        else:
            out[cid] = same_attack(honest, rng)
    return out


def byzantine_ids(m: int, f: int, seed: int) -> list[int]:
    """The ``f`` Byzantine partition ids among ``m``, drawn without replacement from the run seed (spec 10.4).

    Parameters
    ----------
    m
        Number of clients (partition ids 0..m-1).
    f
        Number of Byzantine clients, 0 <= f <= m.
    seed
        Run seed; the draw uses its own stream, ``default_rng([seed, 101])``.

    Returns
    -------
    list[int]
        Sorted ids, fixed for the run.
    """
    if m < 0 or not 0 <= f <= m:
        raise ValueError(f"need 0 <= f <= m, got m={m}, f={f}")
    rng = np.random.default_rng([seed, _STREAM_BYZANTINE])
    return sorted(int(i) for i in rng.choice(m, size=f, replace=False))



# ------------------------------------------------------------------------------ what a simulation hands out


@dataclass(frozen=True)
class ClientAttack:
    """SIMULATION ONLY: how a Byzantine client corrupts what it transmits (spec 6, 11.10).

    The client otherwise runs the honest pipeline (training, error memory, momentum, its honest proposal); only
    the values it uploads and the coordinates it proposes are replaced. Both attacks here are non-omniscient: the
    client needs nothing but its own update.

    Parameters
    ----------
    values
        "none" (default) or "bit-flip": upload ``-x`` instead of its own vector ``x`` (:func:`bit_flip`).
    coordinates
        "none" (default), "min" (the k smallest ``|g_j|`` of its own update, :func:`min_attack`) or "rand" (k
        uniform coordinates, :func:`random_attack`): the proposal attacks of App. C.2.
    """

    values: str = "none"
    coordinates: str = "none"

    def __post_init__(self) -> None:
        if self.values not in ("none", "bit-flip"):
            raise ValueError(f"values must be 'none' or 'bit-flip' (ALIE / FoE need every client's vector: "
                             f"OmniscientOracle), got {self.values!r}")
        if self.coordinates not in ("none", "min", "rand"):
            raise ValueError(f"coordinates must be 'none', 'min' or 'rand' ('same' needs the honest proposals: "
                             f"OmniscientOracle), got {self.coordinates!r}")

    def corrupt_values(self, x: NDArray[Any]) -> NDArray[Any]:
        """What the client uploads instead of its honest vector ``x``."""
        return bit_flip(x) if self.values == "bit-flip" else x

    def corrupt_proposal(self, proposal: NDArray[np.int64], g: NDArray[Any], k: int,
                         rng: np.random.Generator) -> NDArray[np.int64]:
        """What the client proposes instead of its honest ``proposal`` (its update ``g``, budget ``k``)."""
        if self.coordinates == "min":
            return min_attack(g, k)
        if self.coordinates == "rand":
            return random_attack(len(g), k, rng)
        return proposal


@dataclass(frozen=True)
class OmniscientOracle:
    """SIMULATION ONLY: the server-side adversary of spec 10.4, replacing the Byzantine clients' submissions.

    It sees every client's submission in the clear, so a strategy accepts it only when nothing is masked; the
    Byzantine clients submit their honest vectors and proposals, and the oracle replaces them before aggregation.

    Parameters
    ----------
    byzantine
        Client ids of the Byzantine clients (e.g. :func:`byzantine_ids` of the run seed).
    values
        "none" (default), "alie" (``mu - z sigma`` of the honest vectors, :func:`alie`) or "foe"
        (``-eps mean(honest)``, :func:`foe`).
    coordinates
        "none" (default) or "same": each Byzantine client proposes a copy of a random honest client's proposal
        (App. C.2, :func:`same_attack`).
    z
        ALIE's multiplier; None (default) means :func:`alie_z` of the submissions present (epfml formula).
    eps
        FoE's magnitude (default 0.5, the paper's setting).
    """

    byzantine: frozenset[int] = field(default_factory=frozenset)
    values: str = "none"
    coordinates: str = "none"
    z: float | None = None
    eps: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "byzantine", frozenset(int(b) for b in self.byzantine))
        if self.values not in ("none", "alie", "foe"):
            raise ValueError(f"values must be 'none', 'alie' or 'foe' (bit-flip is the client's own: ClientAttack), "
                             f"got {self.values!r}")
        if self.coordinates not in ("none", "same"):
            raise ValueError(f"coordinates must be 'none' or 'same' (min / rand are the client's own: "
                             f"ClientAttack), got {self.coordinates!r}")
        if not math.isfinite(self.eps):
            raise ValueError(f"eps must be finite, got {self.eps!r}")
        if self.z is not None and not math.isfinite(self.z):
            raise ValueError(f"z must be finite or None, got {self.z!r}")

    def forge_values(self, vectors: Mapping[int, NDArray[Any]]) -> dict[int, NDArray[np.float64]]:
        """The submissions after the Byzantine ones were replaced (:func:`apply_value_attack`)."""
        return apply_value_attack(self.values, vectors, self.byzantine & set(vectors), eps=self.eps, z=self.z)

    def forge_proposals(self, proposals: Mapping[int, NDArray[Any]],
                        rng: np.random.Generator) -> dict[int, NDArray[Any]]:
        """The phase-1 proposals after each Byzantine client copied a random honest one ("same"; honest proposals
        in ascending client id, Byzantine clients served in ascending id)."""
        out = dict(proposals)
        if self.coordinates != "same":
            return out
        honest = [out[c] for c in sorted(out) if c not in self.byzantine]
        for cid in sorted(self.byzantine & set(out)):
            out[cid] = same_attack(honest, rng)
        return out


# ------------------------------------------------------------------------------ attacks that break the mean (issue 16)
# Callables of the honest clients' (n_h, d) vectors that return the (d,) vector every Byzantine client sends (ByzFL's
# shape: ``attack = MinMax("std"); attack(honest)``). All are OMNISCIENT (they read the honest vectors), so they run
# only where uploads are in the clear (OmniscientOracle; never on a masked path). Called on a single row -- a
# client's own vector -- SignFlipping is the non-omniscient, scaled bit-flip.


@dataclass(frozen=True)
class SignFlipping:
    """``-scale * mean(honest)`` (ByzFL's SignFlipping for scale = 1; on one row, the scaled bit-flip)."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.scale, bool) or not isinstance(self.scale, int | float) or not math.isfinite(self.scale):
            raise ValueError(f"scale must be a finite number, got {self.scale!r}")

    def __call__(self, honest: NDArray[Any]) -> NDArray[np.float64]:
        forged: NDArray[np.float64] = -float(self.scale) * np.mean(_honest_rows(honest, 1), axis=0)
        return forged


@dataclass(frozen=True)
class InnerProductManipulation:
    """IPM (Xie et al., "Fall of Empires", UAI 2020): ``-eps * mean(honest)``. Small eps (e.g. 0.1) keeps the
    Byzantine vectors near the honest ones so distance-based rules accept them; large eps (e.g. 10) reverses the
    mean. The same vector as :func:`foe` (ByzFL's InnerProductManipulation(tau=eps))."""

    eps: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.eps, bool) or not isinstance(self.eps, int | float) or not math.isfinite(self.eps):
            raise ValueError(f"eps must be a finite number, got {self.eps!r}")

    def __call__(self, honest: NDArray[Any]) -> NDArray[np.float64]:
        return foe(honest, float(self.eps))


@dataclass(frozen=True)
class ALittleIsEnough:
    """ALIE (Baruch et al., NeurIPS 2019): ``mean - z * std`` (:func:`alie`). ``ALittleIsEnough.for_clients(n, f)``
    takes z from the paper's formula for n clients of which f are Byzantine (:func:`alie_z`, "baruch"). ByzFL's
    ALittleIsEnough(tau) adds ``+ tau * std``: the same attack with the other sign convention."""

    z: float

    def __post_init__(self) -> None:
        if isinstance(self.z, bool) or not isinstance(self.z, int | float) or not math.isfinite(self.z):
            raise ValueError(f"z must be a finite number, got {self.z!r}")

    @classmethod
    def for_clients(cls, n: int, f: int, formula: str = "baruch") -> ALittleIsEnough:
        return cls(alie_z(n, f, formula))

    def __call__(self, honest: NDArray[Any]) -> NDArray[np.float64]:
        return alie(honest, float(self.z))


@dataclass(frozen=True)
class Mimic:
    """Mimic (Karimireddy, He & Jaggi, ICLR 2022): every Byzantine client sends a copy of honest client ``index``'s
    vector, over-weighting it (ByzFL's Mimic(epsilon=index))."""

    index: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"index must be an integer >= 0, got {self.index!r}")

    def __call__(self, honest: NDArray[Any]) -> NDArray[np.float64]:
        rows = _honest_rows(honest, 1)
        if self.index >= len(rows):
            raise ValueError(f"index {self.index} needs more than {len(rows)} honest vectors")
        forged: NDArray[np.float64] = rows[self.index].copy()
        return forged


_DIRECTIONS = ("std", "uv", "sgn")


def _perturbation(rows: NDArray[np.float64], direction: str) -> NDArray[np.float64]:
    """Shejwalkar & Houmansadr's perturbation vectors: ``-std`` (coordinate-wise, n - 1), ``-mean / ||mean||`` (uv),
    ``-sign(mean)`` (sgn)."""
    mean = np.mean(rows, axis=0)
    if direction == "std":
        p: NDArray[np.float64] = -np.std(rows, axis=0, ddof=1)
    elif direction == "uv":
        norm = float(np.linalg.norm(mean))
        p = -mean / norm if norm > 0 else np.zeros_like(mean)
    else:
        p = -np.sign(mean)
    return p


def _largest_gamma(ok: Any, gamma_max: float = 1e6, tol: float = 1e-9) -> float:
    """The largest gamma in [0, gamma_max] with ``ok(gamma)``, for an ``ok`` that holds on an interval [0, gamma*]
    (the constraints below are convex in gamma and hold at 0): bisection to relative ``tol``."""
    if not ok(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while ok(hi):
        lo, hi = hi, 2.0 * hi
        if hi > gamma_max:
            return lo
    while hi - lo > tol * max(hi, 1e-300):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _check_direction(direction: str) -> None:
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be one of {_DIRECTIONS}, got {direction!r}")


@dataclass(frozen=True)
class MinMax:
    """Min-max (Shejwalkar & Houmansadr, "Manipulating the Byzantine", NDSS 2021, Sec. IV-B, AGR-agnostic):
    ``mean + gamma * p`` with the largest gamma such that its distance to every honest vector is at most the largest
    distance between two honest vectors, ``max_i ||m - g_i|| <= max_{i,j} ||g_i - g_j||``. The constraint is convex in
    gamma and holds at 0 (the mean lies in the honest vectors' hull), so gamma is found by bisection, as the paper's
    halving search does."""

    direction: str = "std"

    def __post_init__(self) -> None:
        _check_direction(self.direction)

    def gamma(self, honest: NDArray[Any]) -> float:
        rows = _honest_rows(honest, 2)
        mean, p = np.mean(rows, axis=0), _perturbation(rows, self.direction)
        sq = np.sum(rows * rows, axis=1)
        bound = float(np.sqrt(max(0.0, float(np.max(sq[:, None] + sq[None, :] - 2.0 * rows @ rows.T)))))
        return _largest_gamma(lambda g: float(np.max(np.linalg.norm(rows - (mean + g * p), axis=1))) <= bound)

    def __call__(self, honest: NDArray[Any]) -> NDArray[np.float64]:
        rows = _honest_rows(honest, 2)
        forged: NDArray[np.float64] = np.mean(rows, axis=0) + self.gamma(rows) * _perturbation(rows, self.direction)
        return forged


@dataclass(frozen=True)
class MinSum:
    """Min-sum (Shejwalkar & Houmansadr, NDSS 2021, Sec. IV-B): ``mean + gamma * p`` with the largest gamma such that
    its sum of squared distances to the honest vectors is at most the largest such sum of an honest vector,
    ``sum_i ||m - g_i||^2 <= max_i sum_j ||g_i - g_j||^2``. Since ``sum_i (mean - g_i) = 0`` the left side is
    ``S_0 + n gamma^2 ||p||^2``, so gamma = sqrt((bound - S_0) / (n ||p||^2)); computed here by the same bisection
    as MinMax (the tests check it against that closed form)."""

    direction: str = "std"

    def __post_init__(self) -> None:
        _check_direction(self.direction)

    def gamma(self, honest: NDArray[Any]) -> float:
        rows = _honest_rows(honest, 2)
        mean, p = np.mean(rows, axis=0), _perturbation(rows, self.direction)
        sq = np.sum(rows * rows, axis=1)
        pair = np.maximum(sq[:, None] + sq[None, :] - 2.0 * rows @ rows.T, 0.0)
        bound = float(np.max(pair.sum(axis=1)))
        return _largest_gamma(lambda g: float(np.sum((rows - (mean + g * p)) ** 2)) <= bound)

    def __call__(self, honest: NDArray[Any]) -> NDArray[np.float64]:
        rows = _honest_rows(honest, 2)
        forged: NDArray[np.float64] = np.mean(rows, axis=0) + self.gamma(rows) * _perturbation(rows, self.direction)
        return forged


def label_flip(labels: NDArray[Any], num_classes: int) -> NDArray[np.int64]:
    """Label flipping, data poisoning on the Byzantine client (Tolpegin et al., ESORICS 2020; ByzFL's convention):
    class y becomes ``num_classes - 1 - y``; the client then trains honestly on the poisoned labels."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    y = np.asarray(labels)
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must be integers in [0, {num_classes})")
    return (num_classes - 1 - y).astype(np.int64)
