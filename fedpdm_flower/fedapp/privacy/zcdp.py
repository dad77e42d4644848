"""zCDP accounting of DP-RECAL: sensitivity, per-activation rho, composition over activations, (eps, delta) bound.

Wang, Guo, Yang, Shi, "Differentially Private Decentralized Optimization with Relay Communication" (seed 001).
Equation, lemma and proposition numbers are the paper's; the formulas follow section 4 of
``shared/specs/dp_recal.md``.

* Lemma 4       sensitivity of the relayed running dual sum u^{k+1}: ``Delta = 4 alpha beta L``  -> :func:`sensitivity`
* Sec. III-D    noise of agent i's t-th activation: ``sigma_t = sigma_1 R^{-(t-1)/2}``         -> :func:`sigma_at`
* Lemma 5       (19)-(21): that release is rho^t-zCDP, ``rho^t = Delta^2 / (2 sigma_t^2)``      -> :func:`rho_step`
* Props. 1, 2   sequential composition inside an agent, parallel composition across agents:
  ``rho = sum_{t=1..xi} rho^1 R^{t-1} = rho^1 (R^xi - 1)/(R - 1)``, xi = LCI = max_i tau_i   -> :func:`rho_total`
* Prop. 4       rho-zCDP implies ``(rho + 2 sqrt(rho ln(1/delta)), delta)``-DP and its inverse -> :func:`eps_from_rho`,
  :func:`rho_from_eps`
* Theorem 3     the whole run's epsilon, and the sigma_1 that meets a target epsilon        -> :func:`epsilon_dp_recal`,
  :func:`calibrate_sigma1`
* Spec 4.7      the noise a budget forces on the last activation                            -> :func:`noise_floor`

``R^xi`` and a calibrated ``sigma_1`` leave float64 for plans the paper would accept (``R = 1.2, xi = 4800`` gives
``sigma_1 ~ e^436``, so ``sigma_1^2`` and ``R^xi`` overflow), so everything composes in log space. A sigma_1 beyond
float64 itself (``R = 2, xi = 4800``: ``ln sigma_1 ~ 1661``) is rejected with :class:`CalibrationOverflowError`.
R = 1 (constant noise) is accepted as the continuous limit of the formulas (``geom_sum -> xi``).

What the numbers mean (spec 8, items A1-A3): the accounting covers the u-channel only. The x-channel is not
privatised and leaks ``y_i^k`` exactly where the prox is invertible (A1). Lemma 4 ignores that ``y_i^k``,
``lambda_i^k`` already differ between neighbouring datasets after the first activation and bounds a gradient
difference by the smoothness constant L (A3). The epsilon computed here is therefore *the paper's accounting*, not
a proof of privacy. A labelled smaller-sensitivity deviation is :func:`sensitivity_per_record`. At any epsilon <= 10
the accounting forces noise of order Delta or more on every draw (:func:`noise_floor`), which is why Table V's
~1e-16 accuracies cannot be reproduced under it (A2).

:class:`ActivationLedger` is the per-agent accountant that lives in a Flower client's ``context.state``. Besides
Prop. 4 it offers the RDP conversion of Balle et al. (2020) through Opacus for the same releases and the same Delta;
Prop. 4 is Mironov's classic conversion at the best order, so the RDP number is never larger (up to the order grid):
about 1.4x smaller at eps = 1 and 1.1x at eps = 10 (delta = 1e-3, tests/test_zcdp.py).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.privacy.gaussian import (  # one home for these input checks
    _require_non_negative,
    _require_positive,
)

__all__ = [
    "ActivationLedger",
    "CalibrationOverflowError",
    "Theorem3Calibration",
    "calibrate_sigma1",
    "default_xi_plan",
    "eps_from_rho",
    "epsilon_dp_recal",
    "epsilon_from_noise",
    "geom_sum",
    "lci",
    "log_geom_sum",
    "log_sigma1_for_budget",
    "noise_floor",
    "per_agent_rho",
    "rho_from_eps",
    "rho_step",
    "rho_total",
    "sensitivity",
    "sensitivity_per_record",
    "sigma1_for_budget",
    "sigma_at",
]

# ln of the largest float64, ~709.78: exp() of anything larger is not representable.
_LOG_FLOAT_MAX = math.log(sys.float_info.max)

# Safety factor of the markov/iid xi_plan default over the expected LCI K * max_i g_i (spec 4.5).
_XI_PLAN_MARGIN = 1.15

# RDP orders of ActivationLedger.rdp_epsilon: Opacus's fine grid near 1, then geometric up to 1e6, so the optimal
# order 1 + sqrt(ln(1/delta) / rho) is inside the grid for any rho >= ~1e-11 at delta >= 1e-10.
_RDP_ORDERS: NDArray[np.float64] = np.unique(
    np.concatenate([np.linspace(1.01, 11.0, 1000), np.geomspace(11.0, 1e6, 2000)])
)


class CalibrationOverflowError(ValueError, OverflowError):
    """The sigma_1 a budget requires is beyond float64 (ln sigma_1 > ~709.78); the (eps, R, xi) plan is unusable.

    It is a ``ValueError`` (a configuration error) and an ``OverflowError`` (what plain float code would raise).
    ``log_sigma1`` holds the natural log of the required sigma_1.
    """

    def __init__(self, message: str, log_sigma1: float) -> None:
        super().__init__(message)
        self.log_sigma1 = log_sigma1


# --- input checks ---------------------------------------------------------------------------------------------------


def _require_int(name: str, value: int, minimum: int) -> None:
    # bool is an int subclass; True as an activation count is a caller bug.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _require_delta(delta: float) -> None:
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must lie in the open interval (0, 1), got {delta!r}")


def _require_ratio(R: float) -> None:
    if not (math.isfinite(R) and R >= 1.0):
        raise ValueError(
            f"R must be a finite number >= 1 (the paper needs R > 1; R = 1 is the constant-noise limit), got {R!r}"
        )


def _exp_or_inf(log_value: float) -> float:
    # exp() that answers inf instead of raising: a privacy loss beyond float64 is a vacuous (infinite) bound.
    return math.inf if log_value > _LOG_FLOAT_MAX else math.exp(log_value)


# --- Lemma 4: sensitivity -------------------------------------------------------------------------------------------


def sensitivity(alpha_max: float, beta: float, L_max: float) -> float:
    """L2 sensitivity of the relayed u^{k+1} as printed in Lemma 4: ``Delta = 4 alpha beta L``.

    The paper's derivation writes the difference of ``u^{k+1}`` on neighbouring datasets as
    ``beta ||-2 y_D + 2 y_D'||`` and bounds the gradient difference by ``2 L``. Spec 8, item A3 lists why this is
    loose and arguably wrong (the factor 2 on y is spurious, L is not a gradient-norm bound, the 1/m_i averaging is
    ignored, earlier activations' divergence is ignored). Implemented as stated so that epsilon matches the paper.

    Parameters
    ----------
    alpha_max
        ``alpha = max_i alpha_i`` (> 0).
    beta
        Dual stepsize ``beta = 1/(2(n+1))`` (> 0).
    L_max
        ``L = max_i L_i``, the largest smoothness constant (> 0).

    Returns
    -------
    float
        Delta.
    """
    _require_positive("alpha_max", alpha_max)
    _require_positive("beta", beta)
    _require_positive("L_max", L_max)
    return 4.0 * alpha_max * beta * L_max


def sensitivity_per_record(alpha_max: float, beta: float, clip: float, m_min: int) -> float:
    """Labelled deviation (spec 8, item A3): per-record sensitivity ``Delta = 4 alpha beta G / m_min``.

    **Not the paper's accounting.** It assumes exactly this:

    * neighbouring datasets differ by replacing one record of one agent's D_i;
    * ``f_i`` is the *average* of per-record losses over ``m_i >= m_min`` records;
    * step S3 (12c) clips every per-record gradient to L2 norm ``<= G`` before averaging, so one replaced record
      moves ``grad f_i`` by at most ``2 G / m_i``. Without that clipping in the algorithm this bound is false;
    * like Lemma 4 it keeps the paper's factor 2 on y (conservative: ``x^{k+1}`` does not depend on D_i within the
      iteration, so ``2 alpha beta G / m_min`` would do under the same assumptions), and ``alpha = max_i alpha_i``;
    * like Lemma 4 it treats ``y_i^k``, ``lambda_i^k`` (and hence ``x^{k+1}``) as equal on both datasets, i.e. it
      ignores the divergence accumulated over the agent's earlier activations and the x-channel leak (A1).

    It therefore gives a per-activation sensitivity under the paper's (optimistic) model with a gradient-norm bound
    in place of L, small enough for Fig.-3-like curves; it is not a proof of privacy of the whole run.

    Parameters
    ----------
    alpha_max
        ``max_i alpha_i`` (> 0).
    beta
        Dual stepsize (> 0).
    clip
        Per-record gradient clipping norm G (> 0).
    m_min
        Smallest local dataset size ``min_i m_i`` (>= 1).

    Returns
    -------
    float
        Delta.
    """
    _require_positive("alpha_max", alpha_max)
    _require_positive("beta", beta)
    _require_positive("clip", clip)
    _require_int("m_min", m_min, 1)
    return 4.0 * alpha_max * beta * clip / int(m_min)


# --- Sec. III-D and Lemma 5: per-activation noise and rho ---------------------------------------------------------


def sigma_at(t: int, sigma1: float, R: float) -> float:
    """Noise standard deviation of an agent's t-th activation: ``sigma_t = sigma_1 R^{-(t-1)/2}`` (Sec. III-D).

    From ``sigma_t^2 = R sigma_{t+1}^2``; t counts the agent's own activations (tau_i after incrementing), not
    global iterations. Same expression as the spec's reference step, so simulators agree bit for bit.

    Parameters
    ----------
    t
        Activation index, 1-based (>= 1).
    sigma1
        Standard deviation of the first activation (>= 0; 0 is non-private RECAL).
    R
        Attenuation factor (>= 1).

    Returns
    -------
    float
        sigma_t.
    """
    _require_int("t", t, 1)
    _require_non_negative("sigma1", sigma1)
    _require_ratio(R)
    # float(): typeshed types float ** float as Any (complex for a negative base; R >= 1 here).
    return float(sigma1 * R ** (-(int(t) - 1) / 2.0))


def _log_gaussian_rho(Delta: float, log_sigma: float) -> float:
    # ln(Delta^2 / (2 sigma^2)) for Delta > 0.
    return 2.0 * math.log(Delta) - math.log(2.0) - 2.0 * log_sigma


def _gaussian_rho(Delta: float, sigma: float) -> float:
    # rho of one Gaussian release N(f(D), sigma^2 I) with L2 sensitivity Delta (Bun & Steinke, Prop. 1.6).
    if Delta == 0.0:
        return 0.0
    if sigma == 0.0:
        return math.inf
    return _exp_or_inf(_log_gaussian_rho(Delta, math.log(sigma)))


def rho_step(t: int, sigma1: float, R: float, Delta: float) -> float:
    """zCDP parameter of an agent's t-th release, Lemma 5: ``rho^t = Delta^2 / (2 sigma_t^2) = rho^1 R^{t-1}``.

    The paper's (21) writes Delta / 2 sigma^2 in one line; the final expression (and Bun & Steinke's Gaussian
    mechanism) has Delta^2 (spec 4.3). With Lemma 4's Delta this is ``8 alpha^2 beta^2 L^2 / sigma_t^2``.
    Evaluated in logs, so a huge sigma_1 gives a tiny rho instead of overflowing ``sigma_t^2``.

    Parameters
    ----------
    t
        Activation index, 1-based (>= 1).
    sigma1
        First-activation standard deviation (>= 0).
    R
        Attenuation factor (>= 1).
    Delta
        L2 sensitivity (>= 0).

    Returns
    -------
    float
        rho^t; inf when ``sigma1 = 0`` and ``Delta > 0`` (no noise), 0 when ``Delta = 0``.
    """
    _require_int("t", t, 1)
    _require_non_negative("sigma1", sigma1)
    _require_ratio(R)
    _require_non_negative("Delta", Delta)
    if Delta == 0.0:
        return 0.0
    if sigma1 == 0.0:
        return math.inf
    # ln sigma_t = ln sigma_1 - (t-1)/2 ln R, exact in logs even where sigma_t itself underflows.
    log_sigma_t = math.log(sigma1) - 0.5 * (int(t) - 1) * math.log(R)
    return _exp_or_inf(_log_gaussian_rho(Delta, log_sigma_t))


# --- Props. 1 and 2: composition over an agent's activations ------------------------------------------------------


def geom_sum(R: float, xi: int) -> float:
    """``sum_{t=1..xi} R^{t-1} = (R^xi - 1)/(R - 1)``, equal to xi at R = 1 and continuous there.

    Uses ``expm1(xi log1p(R - 1)) / (R - 1)``; ``R - 1`` is exact in float64 for R in [1, 2], so R = 1 + 1e-12
    agrees with the R = 1 branch to 3e-10 relative at xi = 600 (the true first-order gap ``(xi - 1)(R - 1)/2``).

    Parameters
    ----------
    R
        Attenuation factor (>= 1).
    xi
        Number of activations (>= 0).

    Returns
    -------
    float
        The geometric sum.

    Raises
    ------
    OverflowError
        When the sum is beyond float64 (``xi ln R > ~709.78``, e.g. R = 2 with xi >= 1025); use
        :func:`log_geom_sum`.
    """
    _require_ratio(R)
    _require_int("xi", xi, 0)
    if R == 1.0:
        return float(xi)
    h = R - 1.0
    try:
        return math.expm1(int(xi) * math.log1p(h)) / h
    except OverflowError:
        raise OverflowError(
            f"geom_sum(R={R!r}, xi={xi}) = (R^xi - 1)/(R - 1) is beyond float64 (xi ln R = "
            f"{int(xi) * math.log1p(h):.6g} > {_LOG_FLOAT_MAX:.6g}); use log_geom_sum"
        ) from None


def log_geom_sum(R: float, xi: int) -> float:
    """Natural log of :func:`geom_sum`, finite wherever geom_sum overflows.

    ``ln((R^xi - 1)/(R - 1)) = a + ln(-expm1(-a)) - ln(R - 1)`` with ``a = xi ln R``; ``ln xi`` at R = 1.

    Parameters
    ----------
    R
        Attenuation factor (>= 1).
    xi
        Number of activations (>= 0).

    Returns
    -------
    float
        ``ln geom_sum(R, xi)``; ``-inf`` for ``xi = 0`` (an empty sum).
    """
    _require_ratio(R)
    _require_int("xi", xi, 0)
    if xi == 0:
        return -math.inf
    if R == 1.0:
        return math.log(int(xi))
    h = R - 1.0
    a = int(xi) * math.log1p(h)
    return a + math.log(-math.expm1(-a)) - math.log(h)


def rho_total(rho1: float, R: float, xi: int) -> float:
    """zCDP of xi activations of one agent (Props. 1, 2): ``sum_{t=1..xi} rho^1 R^{t-1} = rho^1 geom_sum(R, xi)``.

    With xi = LCI this is the whole run's rho (Theorem 3's proof): parallel composition over agents with disjoint
    data keeps the largest per-agent sum, which belongs to the agent with the most activations.

    Parameters
    ----------
    rho1
        zCDP of the first activation (>= 0).
    R
        Attenuation factor (>= 1).
    xi
        Number of activations (>= 0).

    Returns
    -------
    float
        rho_total; inf if beyond float64 (a vacuous bound), 0 for ``xi = 0`` or ``rho1 = 0``.
    """
    _require_non_negative("rho1", rho1)
    _require_ratio(R)
    _require_int("xi", xi, 0)
    if xi == 0 or rho1 == 0.0:
        return 0.0
    try:
        return rho1 * geom_sum(R, xi)
    except OverflowError:
        # geom_sum alone overflows; rho1 may be small enough (a calibrated plan) for the product to be finite.
        return _exp_or_inf(math.log(rho1) + log_geom_sum(R, xi))


def per_agent_rho(tau_i: int, rho1: float, R: float) -> float:
    """Agent i's own running zCDP budget after ``tau_i`` activations: ``rho_total(rho1, R, tau_i)`` (spec 4.5)."""
    return rho_total(rho1, R, tau_i)


def lci(tau: Sequence[int]) -> int:
    """Local communication involvement ``xi = max_i tau_i`` (Sec. II), the xi of Theorem 3.

    Parameters
    ----------
    tau
        Per-agent activation counts (non-empty, each an integer >= 0).

    Returns
    -------
    int
        max(tau).
    """
    if len(tau) == 0:
        raise ValueError("tau must hold at least one agent's activation count")
    for i, count in enumerate(tau):
        _require_int(f"tau[{i}]", count, 0)
    return int(max(tau))


# --- Prop. 4: zCDP -> (eps, delta) ---------------------------------------------------------------------------------


def eps_from_rho(rho: float, delta: float) -> float:
    """Prop. 4 (Bun & Steinke, Prop. 1.3): rho-zCDP implies ``(rho + 2 sqrt(rho ln(1/delta)), delta)``-DP.

    Parameters
    ----------
    rho
        zCDP parameter (>= 0; inf gives inf).
    delta
        Target delta in (0, 1).

    Returns
    -------
    float
        epsilon.
    """
    if math.isnan(rho) or rho < 0.0:
        raise ValueError(f"rho must be >= 0, got {rho!r}")
    _require_delta(delta)
    if math.isinf(rho):
        return math.inf
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def rho_from_eps(eps: float, delta: float) -> float:
    """Inverse of Prop. 4: the largest rho whose conversion is at most ``eps``.

    Solving ``rho + 2 sqrt(rho a) = eps`` (``a = ln(1/delta)``) gives ``rho = (sqrt(a + eps) - sqrt(a))^2``, evaluated
    without cancellation as ``eps^2 / (sqrt(a + eps) + sqrt(a))^2``.

    Parameters
    ----------
    eps
        Target epsilon (finite, >= 0).
    delta
        Target delta in (0, 1).

    Returns
    -------
    float
        rho.
    """
    _require_non_negative("eps", eps)
    _require_delta(delta)
    a = math.log(1.0 / delta)
    return eps**2 / (math.sqrt(a + eps) + math.sqrt(a)) ** 2


# --- Theorem 3 and its inverse -------------------------------------------------------------------------------------


def epsilon_from_noise(sigma1: float, Delta: float, R: float, xi: int, delta: float) -> float:
    """Theorem 3 for any sensitivity: epsilon of xi activations with noise ``sigma_1 R^{-(t-1)/2}``.

    ``rho = Delta^2 / (2 sigma_1^2) * geom_sum(R, xi)`` composed in logs (so ``sigma_1 ~ e^436`` is fine), then
    Prop. 4. Use it with :func:`sensitivity_per_record`; :func:`epsilon_dp_recal` is the paper's Delta.

    Parameters
    ----------
    sigma1
        First-activation standard deviation (>= 0; 0 means no noise).
    Delta
        L2 sensitivity (>= 0).
    R
        Attenuation factor (>= 1).
    xi
        LCI, or any agent's activation count (>= 0).
    delta
        Target delta in (0, 1).

    Returns
    -------
    float
        epsilon; 0 for ``xi = 0`` or ``Delta = 0``, inf for ``sigma1 = 0`` or a rho beyond float64.
    """
    _require_non_negative("sigma1", sigma1)
    _require_non_negative("Delta", Delta)
    _require_ratio(R)
    _require_int("xi", xi, 0)
    _require_delta(delta)
    if xi == 0 or Delta == 0.0:
        return 0.0
    if sigma1 == 0.0:
        return math.inf
    log_rho = _log_gaussian_rho(Delta, math.log(sigma1)) + log_geom_sum(R, xi)
    return eps_from_rho(_exp_or_inf(log_rho), delta)


def epsilon_dp_recal(
    alpha_max: float, beta: float, L_max: float, sigma1: float, R: float, xi: int, delta: float
) -> float:
    """Theorem 3: DP-RECAL is (epsilon, delta)-DP after K iterations with LCI xi, where

    ``epsilon = rho^1 (R^xi - 1)/(R - 1) + 2 sqrt(rho^1 (R^xi - 1) ln(1/delta) / (R - 1))``,
    ``rho^1 = 8 alpha^2 beta^2 L^2 / sigma_1^2``.

    Evaluated in logs (spec 4.5). Covers the u-channel only, under Lemma 4's sensitivity (module docstring).

    Parameters
    ----------
    alpha_max, beta, L_max
        As in :func:`sensitivity`.
    sigma1
        First-activation standard deviation (>= 0).
    R
        Attenuation factor (>= 1; the paper states R > 1, R = 1 is the limit).
    xi
        LCI ``max_i tau_i(K)`` (>= 0); pass the realised one to report the realised epsilon (spec A12).
    delta
        Target delta in (0, 1).

    Returns
    -------
    float
        epsilon; 0 for ``xi = 0``, inf for ``sigma1 = 0``.
    """
    return epsilon_from_noise(sigma1, sensitivity(alpha_max, beta, L_max), R, xi, delta)


def log_sigma1_for_budget(eps: float, delta: float, Delta: float, R: float, xi: int) -> float:
    """Natural log of :func:`sigma1_for_budget`; finite even where sigma_1 itself is beyond float64.

    ``ln sigma_1 = ln Delta + (ln geom_sum(R, xi) - ln(2 rho_from_eps(eps, delta))) / 2``.

    Returns
    -------
    float
        ``ln sigma_1``; ``-inf`` for ``xi = 0`` or ``Delta = 0`` (no noise needed).
    """
    _require_positive("eps", eps)
    _require_delta(delta)
    _require_non_negative("Delta", Delta)
    _require_ratio(R)
    _require_int("xi", xi, 0)
    if xi == 0 or Delta == 0.0:
        return -math.inf
    rho = rho_from_eps(eps, delta)
    if rho > 0.0:
        log_2rho = math.log(2.0 * rho)
    else:  # eps^2 underflowed (eps below ~1e-154): the same formula factor by factor, in logs
        a = math.log(1.0 / delta)
        log_2rho = math.log(2.0) + 2.0 * (math.log(eps) - math.log(math.sqrt(a + eps) + math.sqrt(a)))
    return math.log(Delta) + 0.5 * (log_geom_sum(R, xi) - log_2rho)


def sigma1_for_budget(eps: float, delta: float, Delta: float, R: float, xi: int) -> float:
    """Smallest sigma_1 whose xi activations are (eps, delta)-DP by Theorem 3, for any sensitivity Delta.

    ``sigma_1 = Delta sqrt(geom_sum(R, xi) / (2 rho_from_eps(eps, delta)))``, evaluated in logs.

    Parameters
    ----------
    eps
        Target epsilon (finite, > 0).
    delta
        Target delta in (0, 1).
    Delta
        L2 sensitivity (>= 0).
    R
        Attenuation factor (>= 1).
    xi
        Planned LCI ``xi_plan`` (>= 0), see :func:`default_xi_plan`.

    Returns
    -------
    float
        sigma_1; 0 for ``xi = 0`` or ``Delta = 0``.

    Raises
    ------
    CalibrationOverflowError
        If sigma_1 is beyond float64 (e.g. R = 2, xi = 4800: ln sigma_1 ~ 1661). Lower R or xi_plan.
    """
    log_sigma1 = log_sigma1_for_budget(eps, delta, Delta, R, xi)
    if log_sigma1 == -math.inf:
        return 0.0
    if log_sigma1 > _LOG_FLOAT_MAX:
        raise CalibrationOverflowError(
            f"calibrated sigma_1 = exp({log_sigma1:.6g}) is beyond float64 (max exp({_LOG_FLOAT_MAX:.6g})) for "
            f"eps={eps!r}, delta={delta!r}, Delta={Delta!r}, R={R!r}, xi={xi}: the noise of the first activations "
            "cannot be represented; lower R or xi_plan, or raise eps",
            log_sigma1,
        )
    return math.exp(log_sigma1)


def calibrate_sigma1(eps: float, delta: float, R: float, xi: int, alpha_max: float, beta: float, L_max: float) -> float:
    """Smallest sigma_1 meeting a target epsilon under Theorem 3 with Lemma 4's sensitivity (spec 4.5).

    Parameters
    ----------
    eps
        Target epsilon (finite, > 0).
    delta
        Target delta in (0, 1).
    R
        Attenuation factor (>= 1).
    xi
        Planned LCI ``xi_plan`` (>= 0). Enforce it with ``stop_on_budget`` to guarantee eps (spec 4.5).
    alpha_max, beta, L_max
        As in :func:`sensitivity`.

    Returns
    -------
    float
        sigma_1 (0 for ``xi = 0``).

    Raises
    ------
    CalibrationOverflowError
        If sigma_1 is beyond float64 (a config error rather than inf or nan).
    """
    return sigma1_for_budget(eps, delta, sensitivity(alpha_max, beta, L_max), R, xi)


# --- spec 4.5 accounting notes and 4.7 ----------------------------------------------------------------------------


def default_xi_plan(K: int, walk: str, g: Sequence[float]) -> int:
    """Default planned LCI for calibration (spec 4.5, [interp]); capped at K, the most conservative choice.

    * ``"cyclic"``: every agent is activated ``ceil(K / n)`` times, n = len(g).
    * ``"markov"`` / ``"iid"``: ``ceil(1.15 K max_i g_i)``, g the stationary distribution (E tau_i = K g_i; the
      95th-percentile LCI of ring-8 with K = 4800 is 679, the default 690).

    A Markov walk's LCI is random: the target epsilon is only guaranteed with ``stop_on_budget``.
    """
    _require_int("K", K, 0)
    if len(g) == 0:
        raise ValueError("g must hold the stationary distribution of at least one agent")
    if any(not (math.isfinite(p) and p >= 0.0) for p in g) or not math.isclose(math.fsum(g), 1.0, abs_tol=1e-9):
        raise ValueError(f"g must be a probability vector (entries >= 0 summing to 1), got {list(g)!r}")
    if walk == "cyclic":
        plan = -(-int(K) // len(g))
    elif walk in ("markov", "iid"):
        x = _XI_PLAN_MARGIN * int(K) * max(g)
        # Strip float noise such as 690.0000000001 before rounding up.
        plan = math.ceil(x - 1e-9 * max(1.0, x))
    else:
        raise ValueError(f"walk must be one of 'cyclic', 'markov', 'iid', got {walk!r}")
    return min(int(K), plan)


def noise_floor(eps: float, delta: float, Delta: float, R: float, xi: int) -> float:
    """Standard deviation of the *last* (xi-th) activation when xi activations spend exactly (eps, delta) (spec 4.7).

    ``sigma_xi^2 = Delta^2 (R - R^{1-xi}) / (2 rho (R - 1))``, ``rho = rho_from_eps(eps, delta)``; it equals
    ``Delta^2 xi / (2 rho)`` at R = 1 and tends to ``Delta^2 R / (2 rho (R - 1))`` as xi grows. The factor
    ``(R - R^{1-xi})/(R - 1) = sum_{j<xi} R^{-j} >= 1`` (equality iff xi = 1), so the result is always
    ``>= Delta / sqrt(2 rho)``: about 0.48 Delta at eps = 10 and 3.85 Delta at eps = 1 for delta = 1e-3. Noise
    decreases with t, so every draw of a run calibrated this way has at least this standard deviation.

    Equals ``sigma_at(xi, sigma1_for_budget(eps, delta, Delta, R, xi), R)`` but never overflows, also where the
    calibrated sigma_1 is beyond float64.

    Parameters
    ----------
    eps
        Total epsilon (finite, > 0).
    delta
        Target delta in (0, 1).
    Delta
        L2 sensitivity (>= 0).
    R
        Attenuation factor (>= 1).
    xi
        Number of activations (>= 1).

    Returns
    -------
    float
        sigma_xi.
    """
    _require_positive("eps", eps)
    _require_delta(delta)
    _require_non_negative("Delta", Delta)
    _require_ratio(R)
    _require_int("xi", xi, 1)
    if R == 1.0:
        decay_sum = float(xi)
    else:
        log_r = math.log1p(R - 1.0)
        # (1 - R^{-xi}) / (1 - R^{-1}); both expm1 are negative, no overflow for any xi.
        decay_sum = math.expm1(-int(xi) * log_r) / math.expm1(-log_r)
    return Delta * math.sqrt(decay_sum / (2.0 * rho_from_eps(eps, delta)))


# --- the per-agent accountant ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Theorem3Calibration:
    """DP-RECAL's own mechanism, the **reproduction setting**: ``privacy=Theorem3Calibration(...)`` of the DP-RECAL
    family's strategies (DP-RECAL, and the Table V baselines with their own sensitivities, spec 5.6).

    Gaussian noise on the published message only (DP-RECAL: the relayed u~; the baselines: each broadcast vector),
    ``sigma_t = sigma_1 R^{-(t-1)/2}`` at an agent's t-th publication (Sec. III-D), sigma_1 calibrated to a target
    epsilon of Theorem 3 at the planned LCI (or given as ``sigma1``). Kept to reproduce the paper's figures.

    **Its rigorous epsilon is unbounded** (reported as inf beside Theorem 3's figure): the baton's x travels in the
    clear and reveals y_i exactly where the prox is invertible, and with it grad f_i(y_i) (spec 8 A1, demonstrated
    by simulations/dlg.py); Lemma 4's Delta = 4 alpha beta L bounds neither a record's gradient (no clipping) nor the
    divergence earlier activations accumulate (A3). The baselines' published vectors carry the same accumulated,
    unclipped divergence. The rigorous mechanism of these strategies is record-level DP-SGD in the agents' gradient
    steps: ``privacy=PrivacyTarget(...)`` (:mod:`fedpdm_flower.fedapp.privacy.dpsgd`).

    Parameters
    ----------
    epsilon
        Target epsilon of Theorem 3 (per-activation zCDP, Prop. 4 conversion) at the planned LCI; sigma_1 is
        calibrated to it once the agents have registered (Delta needs L_max). Give this or ``sigma1``.
    sigma1
        The noise std of an agent's first publication, used as given (0: no noise).
    delta
        delta of Theorem 3 (default 1e-5, the project's one default; the paper's Section VII uses 1e-3, which the
        reproduction app passes).
    R
        Attenuation of the noise variance per publication (R >= 1; Theorem 1 wants R > 1). Default 1.01 (the paper
        does not state its R, spec 5.5).
    """

    epsilon: float | None = None
    sigma1: float | None = None
    delta: float = 1e-5
    R: float = 1.01

    def __post_init__(self) -> None:
        if (self.epsilon is None) == (self.sigma1 is None):
            raise ValueError("Theorem3Calibration needs either epsilon (sigma_1 calibrated to it) or sigma1 (used as "
                             f"given), not both or neither; got epsilon={self.epsilon!r}, sigma1={self.sigma1!r}")
        for name, value, zero_ok in (("epsilon", self.epsilon, False), ("sigma1", self.sigma1, True)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and not zero_ok):
                raise ValueError(f"Theorem3Calibration {name} must be a finite number {'>=' if zero_ok else '>'} 0, "
                                 f"got {value!r}")
        if isinstance(self.delta, bool) or not isinstance(self.delta, int | float) or not 0.0 < self.delta < 1.0:
            raise ValueError(f"Theorem3Calibration delta must lie in (0, 1), got {self.delta!r}")
        if isinstance(self.R, bool) or not isinstance(self.R, int | float) or not (math.isfinite(self.R)
                                                                                  and self.R >= 1.0):
            raise ValueError(f"Theorem3Calibration R must be a finite number >= 1, got {self.R!r}")

    #: what the rigorous accounting gives for this mechanism, and why (reported beside Theorem 3's figure)
    RIGOROUS_EPSILON = math.inf
    RIGOROUS_WHY = ("unbounded: x travels in the clear and reveals y_i (spec A1); Lemma 4 bounds neither a record's "
                    "gradient nor the accumulated divergence (A3)")


def _check_sigma(sigma: float) -> None:
    if not (math.isfinite(sigma) and sigma >= 0.0):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")


@dataclass
class ActivationLedger:
    """One agent's DP-RECAL privacy ledger: the noise of each of its activations (spec 3.4, 7.3).

    Every activation is one Gaussian release of u^{k+1} with L2 sensitivity ``sensitivity``; the agent's zCDP is
    the sum of ``Delta^2 / (2 sigma_t^2)`` (Lemma 5, Prop. 1). Plain lists and floats, so it fits in Flower's
    ``context.state`` as a ConfigRecord (:meth:`to_record` / :meth:`from_record`). The whole run's budget is the
    maximum over agents (Prop. 2), i.e. the ledger of the agent with tau = LCI.

    Parameters
    ----------
    sensitivity
        L2 sensitivity Delta of each release (>= 0), e.g. :func:`sensitivity` of (alpha_max, beta, L_max).
    sigmas
        Noise standard deviation used at each activation so far, in order (each finite, >= 0; 0 = no noise).
    """

    sensitivity: float
    sigmas: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require_non_negative("sensitivity", self.sensitivity)
        self.sensitivity = float(self.sensitivity)
        for sigma in self.sigmas:
            _check_sigma(sigma)
        self.sigmas = [float(s) for s in self.sigmas]

    @property
    def tau(self) -> int:
        """Number of recorded activations, tau_i."""
        return len(self.sigmas)

    def __len__(self) -> int:
        """Number of recorded activations, tau_i."""
        return len(self.sigmas)

    @property
    def rho(self) -> float:
        """zCDP spent so far, ``sum_t Delta^2 / (2 sigma_t^2)`` (exactly summed; inf after a noiseless release)."""
        return math.fsum(_gaussian_rho(self.sensitivity, s) for s in self.sigmas)

    def next_sigma(self, sigma1: float, R: float) -> float:
        """Noise of the next activation under the schedule ``sigma_1 R^{-(t-1)/2}``, t = tau + 1."""
        return sigma_at(self.tau + 1, sigma1, R)

    def record(self, sigma: float) -> float:
        """Append one release with noise standard deviation ``sigma`` and return its rho."""
        _check_sigma(sigma)
        self.sigmas.append(float(sigma))
        return _gaussian_rho(self.sensitivity, float(sigma))

    def activate(self, sigma1: float, R: float) -> float:
        """Record the next activation of the schedule and return the sigma to draw the noise with."""
        sigma = self.next_sigma(sigma1, R)
        self.record(sigma)
        return sigma

    def epsilon(self, delta: float) -> float:
        """Epsilon of the recorded releases at ``delta`` by Prop. 4 (the paper's conversion, Theorem 3).

        For the schedule ``sigma_1 R^{-(t-1)/2}`` this equals :func:`epsilon_from_noise` with xi = tau.
        """
        _require_delta(delta)
        return eps_from_rho(self.rho, delta)

    def rdp_epsilon(self, delta: float) -> float:
        """Epsilon of the same releases by the RDP conversion of Balle et al. (2020), computed with Opacus.

        A composition of Gaussian releases with zCDP rho has Renyi DP ``a rho`` at every order a > 1 (Mironov 2017,
        Prop. 7; no subsampling, q = 1). Opacus's ``get_privacy_spent`` converts it on a grid of orders from 1.01 to
        1e6. Same accounting assumptions as Theorem 3 (same Delta), only a tighter conversion: never looser than
        :meth:`epsilon` up to the order grid.
        """
        _require_delta(delta)
        rho = self.rho
        if rho == 0.0:
            return 0.0
        if math.isinf(rho):
            return math.inf
        # Opacus's RDP analysis without the opacus package (which imports torch): numpy-only paths never need torch.
        from fedpdm_flower.fedapp.privacy.accountants import opacus_rdp

        get_privacy_spent = opacus_rdp().get_privacy_spent
        with warnings.catch_warnings():
            # Opacus warns when the best order is at the edge of the grid; the bound is still valid, only looser.
            warnings.filterwarnings("ignore", message="Optimal order is the")
            eps, _ = get_privacy_spent(orders=list(_RDP_ORDERS), rdp=list(_RDP_ORDERS * rho), delta=delta)
        return float(eps)

    def to_record(self) -> dict[str, int | float | list[float]]:
        """Plain-Python form for Flower's ``context.state`` (ConfigRecord: int, float, list[float]).

        ``tau`` and ``rho`` are informational (for metrics); :meth:`from_record` checks them against ``sigmas``.
        """
        return {
            "sensitivity": self.sensitivity,
            "tau": self.tau,
            "rho": self.rho,
            "sigmas": list(self.sigmas),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, object]) -> ActivationLedger:
        """Rebuild a ledger from :meth:`to_record`'s output.

        Raises
        ------
        ValueError
            If a key is missing, a value is out of range, ``tau != len(sigmas)`` or ``rho`` disagrees with the
            sigmas (relative 1e-9).
        TypeError
            If a value has the wrong type.
        """
        for key in ("sensitivity", "tau", "rho", "sigmas"):
            if key not in record:
                raise ValueError(f"activation ledger record is missing key {key!r}")
        sens, tau, rho, sigmas = record["sensitivity"], record["tau"], record["rho"], record["sigmas"]
        for key, value in (("sensitivity", sens), ("rho", rho)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"activation ledger {key!r} must be a float, got {type(value).__name__}")
        if isinstance(tau, bool) or not isinstance(tau, int):
            raise TypeError(f"activation ledger 'tau' must be an int, got {type(tau).__name__}")
        if not isinstance(sigmas, (list, tuple)) or not all(
            isinstance(s, (int, float)) and not isinstance(s, bool) for s in sigmas
        ):
            raise TypeError("activation ledger 'sigmas' must be a list of floats")
        assert isinstance(sens, (int, float)) and isinstance(rho, (int, float))  # narrowed above, for mypy
        ledger = cls(sensitivity=float(sens), sigmas=[float(s) for s in sigmas])
        if tau != ledger.tau:
            raise ValueError(f"activation ledger 'tau' = {tau} but it holds {ledger.tau} sigmas")
        expected = ledger.rho
        if not (float(rho) == expected or math.isclose(float(rho), expected, rel_tol=1e-9)):
            raise ValueError(f"activation ledger 'rho' = {rho!r} disagrees with its sigmas (expected {expected!r})")
        return ledger
