"""Noise for a target (epsilon, delta) when the releases are Poisson-subsampled: privacy loss distributions.

A round of DP-FedAvg with secret Poisson sampling (each client takes part independently with probability q) and
Gaussian noise of multiplier z on the clipped sum is the Poisson-subsampled Gaussian mechanism; T rounds are its
T-fold composition. Google's ``dp-accounting`` PLD accountant (Koskela et al. 2020; Doroshenko et al. 2022)
gives its (epsilon, delta) numerically and tightly, and ``dp_accounting.calibrate_dp_mechanism`` searches the
smallest z that meets a target. Amplification by sampling is claimed only where the sampling is random and
secret from the adversary: :class:`fedpdm_flower.strategies.central_dp.CentralDP` states that adversary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

__all__ = ["composed_pld", "poisson_epsilon", "poisson_noise_multiplier_for"]


def _check(q: float, rounds: int) -> None:
    if not 0.0 < q <= 1.0:
        raise ValueError(f"the sampling rate q must lie in (0, 1], got {q!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")


@functools.lru_cache(maxsize=8)
def _subsampled_pld(z: float, q: float, value_discretization_interval: float) -> Any:
    from dp_accounting.pld import privacy_loss_distribution as pld

    return pld.from_gaussian_mechanism(standard_deviation=z, value_discretization_interval=value_discretization_interval,
                                       sampling_prob=q)


@functools.lru_cache(maxsize=8)
def composed_pld(z: float, q: float | None, count: int, value_discretization_interval: float = 1e-4) -> Any:
    """The PLD (pessimistic, add-or-remove-one) of ``count`` Gaussian releases with noise multiplier z, each
    Poisson-subsampled at rate q (``q=None``: not sampled), built exactly as ``dp_accounting``'s ``PLDAccountant``
    builds it for ``PoissonSampledDpEvent`` (``from_gaussian_mechanism(...).self_compose(count)``) and
    ``GaussianDpEvent`` (one Gaussian of standard deviation ``z / sqrt(count)``).

    Cached, because a PLD on the 1e-4 grid costs about a second: a run composes the same release every round (and
    once more in each would-exceed check), right after the calibration built it. dp-accounting's PLDs are not
    changed by ``compose`` and ``self_compose`` (they return new ones), so sharing them is safe.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld

    if q is None:
        return pld.from_gaussian_mechanism(standard_deviation=z / math.sqrt(count),
                                           value_discretization_interval=value_discretization_interval)
    return _subsampled_pld(z, q, value_discretization_interval).self_compose(count)


def poisson_epsilon(z: float, q: float, rounds: int, delta: float, value_discretization_interval: float = 1e-4) -> float:
    """epsilon at ``delta`` of ``rounds`` Poisson-subsampled (rate q) Gaussian releases with noise multiplier z."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    _check(q, rounds)
    if not (math.isfinite(z) and z > 0):
        raise ValueError(f"z must be a finite number > 0, got {z!r}")
    # as PLDAccountant composes its events, starting from the identity; q = 1 is the plain Gaussian mechanism
    start = pld.identity(value_discretization_interval=value_discretization_interval)
    composed = start.compose(composed_pld(z, None if q == 1.0 else q, rounds, value_discretization_interval))
    return float(composed.get_epsilon_for_delta(delta))


def _root(excess: Callable[[float], float], lo: float, hi: float, lower: float, upper: float, xtol: float) -> float:
    """The smallest z in [lower, upper], to ``xtol``, with ``excess(z) <= 0`` (excess decreasing in z), searched by
    Brent's method from the guess bracket [lo, hi], which is widened geometrically until it brackets the root.
    Raises ValueError("below") / ValueError("above") when the root lies outside [lower, upper]."""
    from scipy.optimize import brentq

    excess = functools.lru_cache(maxsize=None)(excess)  # brentq evaluates the bracket ends again: seconds each
    f_hi = excess(hi)
    while f_hi > 0:
        if hi >= upper:
            raise ValueError("above")
        lo, hi = hi, min(upper, hi * 1.25)
        f_hi = excess(hi)
    f_lo = excess(lo)
    while f_lo <= 0:
        if lo <= lower:
            raise ValueError("below")
        hi, lo = lo, max(lower, lo * 0.8)
        f_lo = excess(lo)
    if hi - lo <= xtol:  # bracketed to the tolerance already: hi is on the private side (excess(hi) <= 0)
        return hi
    z = float(brentq(excess, lo, hi, xtol=xtol))
    while excess(z) > 0:  # Brent's root may sit a hair below the crossing: step up to the private side
        z += xtol
    return z


def poisson_noise_multiplier_for(epsilon: float, delta: float, q: float, rounds: int) -> float:
    """The smallest z (to 1e-4 absolute) with which ``rounds`` Poisson(q)-subsampled Gaussian releases are
    (epsilon, delta)-DP under the PLD accountant (grid 1e-4, as :func:`poisson_epsilon`). The search covers z in
    [0.3, 100]: a target that needs less noise than 0.3 (its PLD grid would not fit in memory) or more than 100 is
    refused with a ValueError.

    The search is staged for speed only. A PLD evaluation on the 1e-4 grid costs about a second (more at small z),
    on a 1e-3 grid a tenth of that, on a 1e-2 grid a few hundredths. Brent's method finds the root on the 1e-2
    grid from the bracket [0.5, 2] (widened until it brackets the root), then on the 1e-3 grid to 1e-5 inside
    +-2e-3 of it; the 1e-4 grid is then evaluated at the two ends of a bracket 2.5e-5 wide around that. Each grid's
    epsilon is an upper bound of the same curve, and their roots lie far closer than these brackets (4e-8 apart at
    epsilon 8, q = 0.5, 3 releases), so two fine evaluations usually settle it. Where a bracket misses the root it
    is widened and searched as before. The result is the fine grid's root: epsilon(z) <= target is checked there.
    """
    _check(q, rounds)
    if not (math.isfinite(epsilon) and epsilon > 0) or not 0.0 < delta < 1.0:
        raise ValueError(f"need epsilon > 0 and delta in (0, 1), got {epsilon!r}, {delta!r}")
    lower, upper = 0.3, 100.0
    try:
        guess = _root(lambda z: poisson_epsilon(z, q, rounds, delta, 1e-2) - epsilon, 0.5, 2.0, lower, upper, 1e-3)
        coarse = _root(lambda z: poisson_epsilon(z, q, rounds, delta, 1e-3) - epsilon, max(lower, guess - 2e-3),
                       min(upper, guess + 2e-3), lower, upper, 1e-5)
        return _root(lambda z: poisson_epsilon(z, q, rounds, delta) - epsilon, max(lower, coarse - 1.25e-5),
                     min(upper, coarse + 1.25e-5), lower, upper, 5e-5)
    except ValueError as side:
        if str(side) == "below":
            raise ValueError(f"epsilon = {epsilon:g} at delta = {delta:g} over {rounds} round(s) at q = {q:g} needs a "
                             f"noise multiplier below {lower}: a target this loose is outside the calibrated range") from None
        raise ValueError(f"epsilon = {epsilon:g} at delta = {delta:g} over {rounds} round(s) at q = {q:g} needs a noise "
                         f"multiplier above {upper}: lower the rounds or the sampling rate, or raise epsilon") from None
