"""Gaussian differential privacy (Dong, Roth & Su, "Gaussian differential privacy", JRSS-B 2022): the exact
privacy of Gaussian releases without amplification, and the noise that meets a target (epsilon, delta).

A release of a function with L2 sensitivity S plus N(0, (z S)^2 I) noise is (1/z)-GDP (Thm. 2.7). GDP composes
exactly (Cor. 3.3): releases with noise multipliers z_1..z_n are mu-GDP with ``mu = sqrt(sum_t 1 / z_t^2)``. A
mu-GDP mechanism is (epsilon, delta(epsilon))-DP for every epsilon >= 0 with (Cor. 2.13; Balle & Wang 2018,
Thm. 8, the analytic Gaussian mechanism)

    delta(epsilon) = Phi(-epsilon / mu + mu / 2) - e^epsilon Phi(-epsilon / mu - mu / 2),

and for no smaller delta: this curve is the mechanism's exact privacy profile, so no accountant can report less.
Everything here is O(1) per release: a ledger keeps ``sum 1 / z_t^2``.

Calibration: for T releases of equal noise to meet (epsilon, delta), find mu* with delta(epsilon; mu*) = delta
(:func:`mu_for`), then ``z = sqrt(T) / mu*`` (:func:`noise_multiplier_for`).
"""

from __future__ import annotations

import math

__all__ = ["delta_for", "epsilon_for", "mu_for", "mu_of", "noise_multiplier_for"]


def _check_mu(mu: float) -> None:
    if not (math.isfinite(mu) and mu >= 0):
        raise ValueError(f"mu must be a finite number >= 0, got {mu!r}")


def _check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")


def _log_delta(epsilon: float, mu: float) -> float:
    """log delta(epsilon; mu), stable down to the smallest deltas: log Phi(a) + log(1 - e^(eps + log Phi(b) -
    log Phi(a))). The difference of the two terms in linear space loses every digit once both are subnormal
    (at delta = 1e-320 a calibration on it spent 3e7 times the target)."""
    from scipy.special import log_ndtr

    if mu == 0.0:
        return -math.inf
    la = float(log_ndtr(mu / 2 - epsilon / mu))
    ratio = epsilon + float(log_ndtr(-mu / 2 - epsilon / mu)) - la  # log of the second term over the first, < 0
    return -math.inf if ratio >= 0.0 else la + math.log(-math.expm1(ratio))


def delta_for(epsilon: float, mu: float) -> float:
    """delta(epsilon) of a mu-GDP mechanism (the formula above; 0 for mu = 0)."""
    _check_mu(mu)
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    return math.exp(_log_delta(epsilon, mu))


def epsilon_for(delta: float, mu: float) -> float:
    """The smallest epsilon with delta(epsilon; mu) <= delta (0 when even epsilon = 0 meets it)."""
    from scipy.optimize import brentq

    _check_delta(delta)
    _check_mu(mu)
    target = math.log(delta)
    if _log_delta(0.0, mu) <= target:
        return 0.0
    hi = 1.0
    while _log_delta(hi, mu) > target:
        hi *= 2.0
    return float(brentq(lambda e: _log_delta(e, mu) - target, 0.0, hi, xtol=1e-12, rtol=1e-12))


def mu_for(epsilon: float, delta: float) -> float:
    """mu* with delta(epsilon; mu*) = delta: the most GDP a run may spend to stay (epsilon, delta)-DP.

    delta(epsilon; mu) grows with mu (Dong et al., Prop. 2.12's ordering), so the root is unique; it is found on
    log delta, which keeps its precision for any delta a float holds.
    """
    from scipy.optimize import brentq

    _check_delta(delta)
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    target = math.log(delta)
    lo, hi = 1.0, 1.0
    while _log_delta(epsilon, hi) < target:
        hi *= 2.0
    while _log_delta(epsilon, lo) > target:
        lo /= 2.0
    if lo == hi:
        lo = hi / 2.0
    return float(brentq(lambda m: _log_delta(epsilon, m) - target, lo, hi, xtol=1e-15, rtol=1e-13))


def noise_multiplier_for(epsilon: float, delta: float, releases: int) -> float:
    """z such that ``releases`` Gaussian releases with noise multiplier z are exactly (epsilon, delta)-DP."""
    if isinstance(releases, bool) or not isinstance(releases, int) or releases < 1:
        raise ValueError(f"releases must be an integer >= 1, got {releases!r}")
    return math.sqrt(releases) / mu_for(epsilon, delta)


def mu_of(inverse_square_sum: float) -> float:
    """mu of composed releases from a ledger's ``sum_t 1 / z_t^2`` (Cor. 3.3)."""
    if not (math.isfinite(inverse_square_sum) and inverse_square_sum >= 0):
        raise ValueError(f"the sum of 1 / z^2 must be a finite number >= 0, got {inverse_square_sum!r}")
    return math.sqrt(inverse_square_sum)
