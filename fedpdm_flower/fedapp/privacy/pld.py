"""Noise for a target (epsilon, delta) when the releases are Poisson-subsampled: privacy loss distributions.

A round of DP-FedAvg with secret Poisson sampling (each client takes part independently with probability q) and
Gaussian noise of multiplier z on the clipped sum is the Poisson-subsampled Gaussian mechanism; T rounds are its
T-fold composition. Google's ``dp-accounting`` PLD accountant (Koskela et al. 2020; Doroshenko et al. 2022)
gives its (epsilon, delta) numerically and tightly, and ``dp_accounting.calibrate_dp_mechanism`` searches the
smallest z that meets a target. Amplification by sampling is claimed only where the sampling is random and
secret from the adversary: :class:`fedpdm_flower.strategies.central_dp.CentralDP` states that adversary.
"""

from __future__ import annotations

import math

__all__ = ["poisson_epsilon", "poisson_noise_multiplier_for"]


def _check(q: float, rounds: int) -> None:
    if not 0.0 < q <= 1.0:
        raise ValueError(f"the sampling rate q must lie in (0, 1], got {q!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")


def _event(z: float, q: float, rounds: int) -> object:
    from dp_accounting import dp_event

    one = dp_event.GaussianDpEvent(z)
    return dp_event.SelfComposedDpEvent(one if q == 1.0 else dp_event.PoissonSampledDpEvent(q, one), rounds)


def poisson_epsilon(z: float, q: float, rounds: int, delta: float, value_discretization_interval: float = 1e-4) -> float:
    """epsilon at ``delta`` of ``rounds`` Poisson-subsampled (rate q) Gaussian releases with noise multiplier z."""
    from dp_accounting.pld import PLDAccountant

    _check(q, rounds)
    if not (math.isfinite(z) and z > 0):
        raise ValueError(f"z must be a finite number > 0, got {z!r}")
    acc = PLDAccountant(value_discretization_interval=value_discretization_interval)
    acc.compose(_event(z, q, rounds))
    return float(acc.get_epsilon(delta))


def poisson_noise_multiplier_for(epsilon: float, delta: float, q: float, rounds: int) -> float:
    """The smallest z (to 1e-4 relative) with which ``rounds`` Poisson(q)-subsampled Gaussian releases are
    (epsilon, delta)-DP under the PLD accountant. The search covers z in [0.3, 100]: a target that needs less
    noise than 0.3 (its PLD grid would not fit in memory) or more than 100 is refused with a ValueError."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    _check(q, rounds)
    if not (math.isfinite(epsilon) and epsilon > 0) or not 0.0 < delta < 1.0:
        raise ValueError(f"need epsilon > 0 and delta in (0, 1), got {epsilon!r}, {delta!r}")
    lo, hi = 0.3, 100.0
    if poisson_epsilon(lo, q, rounds, delta) <= epsilon:
        raise ValueError(f"epsilon = {epsilon:g} at delta = {delta:g} over {rounds} round(s) at q = {q:g} needs a noise "
                         f"multiplier below {lo}: a target this loose is outside the calibrated range")
    if poisson_epsilon(hi, q, rounds, delta) > epsilon:
        raise ValueError(f"epsilon = {epsilon:g} at delta = {delta:g} over {rounds} round(s) at q = {q:g} needs a noise "
                         f"multiplier above {hi}: lower the rounds or the sampling rate, or raise epsilon")
    z = dp_accounting.calibrate_dp_mechanism(
        lambda: PLDAccountant(value_discretization_interval=1e-4), lambda z: _event(z, q, rounds),
        epsilon, delta, bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi), tol=1e-4)
    return float(z)
