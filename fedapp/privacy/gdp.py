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


def delta_for(epsilon: float, mu: float) -> float:
    """delta(epsilon) of a mu-GDP mechanism (the formula above; 0 for mu = 0)."""
    from scipy.special import log_ndtr, ndtr

    _check_mu(mu)
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    if mu == 0.0:
        return 0.0
    # the second term in log space: e^eps Phi(.) overflows for large eps where Phi(.) underflows
    return float(max(0.0, ndtr(mu / 2 - epsilon / mu) - math.exp(epsilon + log_ndtr(-mu / 2 - epsilon / mu))))


def epsilon_for(delta: float, mu: float) -> float:
    """The smallest epsilon with delta(epsilon; mu) <= delta (0 when even epsilon = 0 meets it)."""
    from scipy.optimize import brentq

    _check_delta(delta)
    _check_mu(mu)
    if delta_for(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while delta_for(hi, mu) > delta:
        hi *= 2.0
    return float(brentq(lambda e: delta_for(e, mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))


def mu_for(epsilon: float, delta: float) -> float:
    """mu* with delta(epsilon; mu*) = delta: the most GDP a run may spend to stay (epsilon, delta)-DP.

    delta(epsilon; mu) grows with mu (Dong et al., Prop. 2.12's ordering), so the root is unique.
    """
    from scipy.optimize import brentq

    _check_delta(delta)
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    hi = 1.0
    while delta_for(epsilon, hi) < delta:
        hi *= 2.0
    return float(brentq(lambda m: delta_for(epsilon, m) - delta, 1e-12, hi, xtol=1e-14, rtol=1e-12))


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
