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
import warnings
from collections.abc import Callable

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


_RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 256))


def _rdp_epsilon(z: float, q: float, rounds: int, delta: float) -> float:
    """Opacus's RDP bound of the same releases: looser than the PLD, milliseconds to compute (a bracket guess)."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    rdp = compute_rdp(q=q, noise_multiplier=z, steps=rounds, orders=_RDP_ORDERS)
    with warnings.catch_warnings():  # "optimal order is the smallest alpha": a loose guess is all this needs
        warnings.simplefilter("ignore")
        return float(get_privacy_spent(orders=_RDP_ORDERS, rdp=rdp, delta=delta)[0])


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
    z = float(brentq(excess, lo, hi, xtol=xtol))
    while excess(z) > 0:  # Brent's root may sit a hair below the crossing: step up to the private side
        z += xtol
    return z


def poisson_noise_multiplier_for(epsilon: float, delta: float, q: float, rounds: int) -> float:
    """The smallest z (to 1e-4 absolute) with which ``rounds`` Poisson(q)-subsampled Gaussian releases are
    (epsilon, delta)-DP under the PLD accountant (grid 1e-4, as :func:`poisson_epsilon`). The search covers z in
    [0.3, 100]: a target that needs less noise than 0.3 (its PLD grid would not fit in memory) or more than 100 is
    refused with a ValueError.

    The search is staged for speed only (a PLD evaluation costs seconds, more at small z): the RDP accountant (a
    looser bound, milliseconds) guesses the bracket, Brent's method finds the root on a 10x coarser PLD grid, and
    then on the fine grid inside a narrow bracket around it. The result is the fine grid's root: epsilon(z) <= target
    is checked there."""
    _check(q, rounds)
    if not (math.isfinite(epsilon) and epsilon > 0) or not 0.0 < delta < 1.0:
        raise ValueError(f"need epsilon > 0 and delta in (0, 1), got {epsilon!r}, {delta!r}")
    lower, upper = 0.3, 100.0
    try:
        guess = _root(lambda z: _rdp_epsilon(z, q, rounds, delta) - epsilon, 0.5, 2.0, 1e-3, 1e4, 1e-3)
        hi = min(upper, max(lower, guess))
        coarse = _root(lambda z: poisson_epsilon(z, q, rounds, delta, 1e-3) - epsilon, max(lower, 0.8 * hi), hi,
                       lower, upper, 1e-3)
        return _root(lambda z: poisson_epsilon(z, q, rounds, delta) - epsilon, max(lower, coarse - 2e-3),
                     min(upper, coarse + 2e-3), lower, upper, 5e-5)
    except ValueError as side:
        if str(side) == "below":
            raise ValueError(f"epsilon = {epsilon:g} at delta = {delta:g} over {rounds} round(s) at q = {q:g} needs a "
                             f"noise multiplier below {lower}: a target this loose is outside the calibrated range") from None
        raise ValueError(f"epsilon = {epsilon:g} at delta = {delta:g} over {rounds} round(s) at q = {q:g} needs a noise "
                         f"multiplier above {upper}: lower the rounds or the sampling rate, or raise epsilon") from None
