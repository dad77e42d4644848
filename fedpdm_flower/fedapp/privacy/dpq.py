"""DPQ-DSGD privacy accountant (Chen, Wang, Zhang, arXiv 2403.18254, first version; spec dp_quantized.md section 4).

Everything is numpy/stdlib only. Symbols follow spec 1.1: ``alpha_hat``, ``beta_hat``, ``batch`` (gamma_hat),
``dp_C``/``C`` (Definition 1), ``sigma_exp``, ``delta_exp``; the sensitivity Delta_k of eq. (7) is ``sens_k`` here
(the quantizer step is ``q_step`` elsewhere).

What is computed (the "paper accountant")
-----------------------------------------
* Schedules (Theorem 1): ``alpha_hat = a1 (ln K)^2 / K^alpha``, ``beta_hat = a2 / K^beta``,
  ``gamma_hat = floor(a3 K^gamma) + 1`` (constant within a run of horizon K); noise STD
  ``sigma_k = scale (k + offset)^sigma_exp`` (theory: offset 1; the paper's MNIST runs: offset 5);
  ``delta_k = (k + 1 + shift)^(-delta_exp)`` (paper: shift 0) and ``c_k = sqrt(4 ln(1.25 / delta_k))``.
* Sensitivity, Lemma 2 bound used as S_k: ``S_k = (alpha_hat C / gamma_hat) sum_{m=0..k} |1 - beta_hat|^m``,
  in closed form (expm1/log1p, so tiny beta_hat loses no digits); limit ``alpha_hat C / (gamma_hat beta_hat)``.
* Per iteration (Lemma 3 = Dwork-Roth Thm A.1, eq. (24)): the release after update k is
  ``x_{k+1} + n_{k+1}``, paid for by the NEXT noise, so ``eps_k = c_k S_k / sigma_{k+1}``.
* Cumulative over k = 0..K (Theorem 1, (25)-(27)): ``eps = sum_k eps_k`` and
  ``delta_hat = exp(sum_k eps_k) (prod_k (1 + delta_k) - 1)``.
* Theorem 1's closed-form bound verbatim and corrected (:func:`paper_eps_bound_verbatim`,
  :func:`paper_eps_bound_corrected`), the finiteness condition (:func:`privacy_finite`) and, clearly NOT from the
  paper, a zCDP cross-check (:func:`zcdp_crosscheck`).

Errors and gaps in the paper (spec 4.3, 4.4, 6.4 and 9), and what this module does about them
-------------------------------------------------------------------------------------------
1. **Theorem 1's closed form is misprinted.** The printed term ``2 C a1 a2 (ln K)^2 sqrt(ln(1.25 (k+1)^delta)) /
   (a3 K^(alpha+gamma-beta) (k+1)^sigma)`` must have ``a1 / (a2 a3)`` (alpha_hat / beta_hat = (a1/a2) (ln K)^2
   K^(beta-alpha)), i.e. it is 1 / a2^2 = 11.1x too small for a2 = 0.3; the statement writes ``(k+1)^sigma``
   where the proof (correctly, for offset 1) writes ``(k+2)^sigma`` = sigma_{k+1}. Both versions are implemented;
   the exact per-iteration sum (:func:`cumulative`) is the primary number. With offset 1 every exact eps_k is <=
   the corrected term.
2. **The proof's last line** says the algorithm is ``(e^{sum eps_k}, ...)``-DP; the inequality it proves gives
   ``(sum eps_k, ...)``. We report ``sum eps_k``.
3. **delta_hat as defined is vacuous.** ``delta_0 = (0 + 1)^(-delta) = 1``, so the k = 0 guarantee says nothing,
   ``prod_k (1 + delta_k) - 1 >= 1`` and ``delta_hat >= exp(sum eps_k) >= 1`` for every K and every schedule.
   :class:`DPQBudget` reports it exactly (``vacuous`` flags it), next to ``sum_{k=0..K} delta_k`` and
   ``sum_{k=1..K} delta_k``; ``delta_shift=1`` gives the non-vacuous variant ``delta_k = (k+2)^(-delta)`` (it
   changes c_k accordingly, since c_k is calibrated to delta_k). Off by default.
4. **The reported "sum_{k=0}^{2000} eps_k = 0.4861" does not follow from the paper's own formulas** for the stated
   MNIST configuration (K = 2000, a1 = .35, alpha = 1, a2 = .3, beta = .75, a3 = .24, gamma = .7, C = .2,
   delta = 3, sigma_k = (k+5)^0.1). Ours: exact accountant 209.5721, printed bound 33.9520, corrected bound
   377.1185; not even without the accumulation of Lemma 2 (S_k = alpha_hat C / gamma_hat for every k: 0.3709).
   The printed bound reaches 0.485464 only at sigma = 0.8. The reported "sum delta_k = 0.2021" is
   ``sum_{k=1}^{2000} (k+1)^-3`` = 0.202057 (k = 0, where delta_0 = 1, silently dropped; equal to the
   ``delta_shift=1`` sum); ``sum_{k=0}^{2000}`` is 1.202057. Neither 0.4861 nor 0.2021 is a target of ours.
5. **Composition.** (25)-(27) multiply per-iteration probabilities as if the releases were independent; that is
   not a rigorous adaptive-composition argument. We implement it as stated and call it the paper accountant.
6. **Lemma 3 needs 0 < eps_k < 1.** :func:`cumulative` and :meth:`DPQLedger.record` warn
   (:class:`Lemma3Warning`) when some eps_k >= 1 (the MNIST settings stay below: eps_k <= 0.7166). It also needs
   ``c_k^2 > 2 ln(1.25 / delta_k)``, which ``c_k^2 = 4 ln(1.25 / delta_k)`` satisfies whenever delta_k <= 1.
7. **Lemma 2 is an upper bound** on the sup in (7); we use the bound as S_k everywhere. It also conditions on
   identical received messages, as the paper does. Bounded per-sample gradient differences (C) are assumed, not
   enforced: the paper never clips (spec 2.3, 9.11).

Reference values (spec 4.6, all reproduced by tests/test_dpq_privacy.py): alpha_hat = 0.01011040068,
beta_hat = 0.001003110457, gamma_hat = 50, S_0 = 4.044160e-5, S_2000 = 3.490472e-2, S_inf = 4.031620e-2;
offset 5: sum eps_k = 209.5721 (sigma 0.1), 104.2350 (0.2), 855.0128 (-0.1); prod(1 + delta_k) - 1 = 1.428189.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "DPQBudget",
    "DPQLedger",
    "DPQSchedule",
    "Lemma3Warning",
    "TimeVaryingNoise",
    "c_k",
    "cumulative",
    "delta_k",
    "eps_decay_exponent",
    "eps_k",
    "eps_schedule",
    "paper_eps_bound_corrected",
    "paper_eps_bound_terms",
    "paper_eps_bound_verbatim",
    "privacy_finite",
    "sensitivity",
    "sensitivity_limit",
    "sigma_k",
    "step_sizes",
    "zcdp_crosscheck",
]

_LN_1_25 = math.log(1.25)
_MAX_LOG = math.log(np.finfo(np.float64).max)


class Lemma3Warning(UserWarning):
    """Some eps_k >= 1: Lemma 3 (Gaussian mechanism, Dwork-Roth Thm A.1) no longer backs the per-iteration claim."""


# ------------------------------------------------------------------------------------------------------ validation


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def _positive(name: str, value: object) -> float:
    out = _real(name, value)
    if out <= 0.0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return out


def _non_negative(name: str, value: object) -> float:
    out = _real(name, value)
    if out < 0.0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return out


def _integer(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _ks(k_last: int) -> NDArray[np.float64]:
    return np.arange(_integer("K_last", k_last, -1) + 1, dtype=np.float64)


# ------------------------------------------------------------------------------------------------------- schedules


def step_sizes(
    K: int, a1: float, alpha: float, a2: float, beta: float, a3: float, gamma: float
) -> tuple[float, float, int]:
    """Theorem 1's run constants ``(alpha_hat, beta_hat, gamma_hat)`` for horizon K.

    ``alpha_hat = a1 (ln K)^2 / K^alpha``, ``beta_hat = a2 / K^beta``, ``gamma_hat = floor(a3 K^gamma) + 1``.

    Raises
    ------
    ValueError
        If K < 2, a1, a2 or a3 <= 0, an exponent is not finite, or ``a2 >= K^beta`` (Theorem 1 needs
        0 < beta_hat < 1).
    """
    k_hor = _integer("K", K, 2)
    c1, c2, c3 = _positive("a1", a1), _positive("a2", a2), _positive("a3", a3)
    e_a, e_b, e_g = _real("alpha", alpha), _real("beta", beta), _real("gamma", gamma)
    alpha_hat = c1 * math.log(k_hor) ** 2 / math.pow(k_hor, e_a)
    beta_hat = c2 / math.pow(k_hor, e_b)
    if not beta_hat < 1.0:
        raise ValueError(f"Theorem 1 needs 0 < a2 < K^beta (beta_hat < 1), got beta_hat = {beta_hat!r}")
    batch = math.floor(c3 * math.pow(k_hor, e_g)) + 1
    return alpha_hat, beta_hat, batch


def _sigma_array(ks: NDArray[np.float64], sigma_exp: float, offset: float, scale: float) -> NDArray[np.float64]:
    return scale * (ks + offset) ** sigma_exp


def sigma_k(k: int, sigma_exp: float, offset: float = 1.0, scale: float = 1.0) -> float:
    """Noise standard deviation ``scale (k + offset)^sigma_exp`` (offset 1: Theorem 1; 5: the paper's MNIST runs)."""
    kk = _integer("k", k, 0)
    return float(
        _sigma_array(
            np.array([kk], dtype=np.float64),
            _real("sigma_exp", sigma_exp),
            _positive("offset", offset),
            _non_negative("scale", scale),
        )[0]
    )


def _log_inv_delta(ks: NDArray[np.float64], delta_exp: float, shift: int) -> NDArray[np.float64]:
    # ln(1 / delta_k) = delta ln(k + 1 + shift): no overflow of (k+1)^delta for large k or delta.
    return delta_exp * np.log(ks + 1.0 + shift)


def delta_k(k: int, delta_exp: float, shift: int = 0) -> float:
    """Per-iteration delta ``(k + 1 + shift)^(-delta_exp)``; the paper's (shift 0) delta_0 is 1 (vacuous)."""
    kk = _integer("k", k, 0)
    return float((kk + 1 + _integer("shift", shift, 0)) ** (-_positive("delta_exp", delta_exp)))


def _c_array(ks: NDArray[np.float64], delta_exp: float, shift: int) -> NDArray[np.float64]:
    return 2.0 * np.sqrt(_LN_1_25 + _log_inv_delta(ks, delta_exp, shift))


def c_k(k: int, delta_exp: float, shift: int = 0) -> float:
    """Gaussian-mechanism constant ``sqrt(4 ln(1.25 / delta_k))`` = ``2 sqrt(ln(1.25 (k + 1 + shift)^delta))``."""
    kk = _integer("k", k, 0)
    return float(
        _c_array(np.array([kk], dtype=np.float64), _positive("delta_exp", delta_exp), _integer("shift", shift, 0))[0]
    )


# ----------------------------------------------------------------------------------------------------- sensitivity


def _geometric(ks: NDArray[np.float64], beta_hat: float) -> NDArray[np.float64]:
    """``sum_{m=0..k} |1 - beta_hat|^m`` without cancellation, for every beta_hat > 0."""
    if beta_hat == 1.0:
        return np.ones_like(ks)
    if beta_hat == 2.0:
        return ks + 1.0
    if beta_hat < 1.0:  # r = 1 - beta_hat in (0, 1); 1 - r = beta_hat exactly
        return -np.expm1((ks + 1.0) * math.log1p(-beta_hat)) / beta_hat
    r = beta_hat - 1.0  # r = |1 - beta_hat| > 0, r != 1
    return np.expm1((ks + 1.0) * math.log(r)) / (r - 1.0)


def _sens_array(
    ks: NDArray[np.float64], alpha_hat: float, beta_hat: float, batch: int, C: float
) -> NDArray[np.float64]:
    return alpha_hat * C / batch * _geometric(ks, beta_hat)


def _check_mech(alpha_hat: float, beta_hat: float, batch: int, C: float) -> tuple[float, float, int, float]:
    return (
        _non_negative("alpha_hat", alpha_hat),
        _positive("beta_hat", beta_hat),
        _integer("batch", batch, 1),
        _non_negative("C", C),
    )


def sensitivity(k: int, alpha_hat: float, beta_hat: float, batch: int, C: float) -> float:
    """Lemma 2 bound on the sensitivity (7) of the release after update k (S_k in spec 4.2).

    ``S_k = (alpha_hat C / batch) sum_{m=0..k} |1 - beta_hat|^m``, evaluated in closed form.
    """
    kk = _integer("k", k, 0)
    a, b, g, c = _check_mech(alpha_hat, beta_hat, batch, C)
    return float(_sens_array(np.array([kk], dtype=np.float64), a, b, g, c)[0])


def sensitivity_limit(alpha_hat: float, beta_hat: float, batch: int, C: float) -> float:
    """``lim_k`` of the Lemma 2 bound for 0 < beta_hat < 2: ``alpha_hat C / (batch beta_hat)`` (its supremum)."""
    a, b, g, c = _check_mech(alpha_hat, beta_hat, batch, C)
    if b >= 2.0:
        return math.inf
    return a * c / (g * (1.0 - abs(1.0 - b)))


# ------------------------------------------------------------------------------------------------------ eps / delta


def _eps_array(
    ks: NDArray[np.float64],
    alpha_hat: float,
    beta_hat: float,
    batch: int,
    C: float,
    sigma_exp: float,
    offset: float,
    delta_exp: float,
    scale: float,
    delta_shift: int,
) -> NDArray[np.float64]:
    sens = _sens_array(ks, alpha_hat, beta_hat, batch, C)
    num = _c_array(ks, delta_exp, delta_shift) * sens
    return _ratio(num, _sigma_array(ks + 1.0, sigma_exp, offset, scale))


def _ratio(num: NDArray[np.float64], sig: NDArray[np.float64]) -> NDArray[np.float64]:
    # sigma = 0 (noise off) releases x_{k+1} itself: eps = inf (0 only if the sensitivity is 0 too).
    safe = np.where(sig > 0.0, sig, 1.0)
    return np.where(sig > 0.0, num / safe, np.where(num > 0.0, np.inf, 0.0))


def _check_eps_args(
    alpha_hat: float,
    beta_hat: float,
    batch: int,
    C: float,
    sigma_exp: float,
    offset: float,
    delta_exp: float,
    scale: float,
    delta_shift: int,
) -> tuple[float, float, int, float, float, float, float, float, int]:
    a, b, g, c = _check_mech(alpha_hat, beta_hat, batch, C)
    return (
        a,
        b,
        g,
        c,
        _real("sigma_exp", sigma_exp),
        _positive("offset", offset),
        _positive("delta_exp", delta_exp),
        _non_negative("scale", scale),
        _integer("delta_shift", delta_shift, 0),
    )


def eps_k(
    k: int,
    alpha_hat: float,
    beta_hat: float,
    batch: int,
    C: float,
    sigma_exp: float,
    offset: float,
    delta_exp: float,
    scale: float = 1.0,
    delta_shift: int = 0,
) -> float:
    """Per-iteration epsilon ``c_k S_k / sigma_{k+1}`` of Lemma 3 / eq. (24) for the release ``x_{k+1} + n_{k+1}``.

    Parameters
    ----------
    k
        Update index, 0 <= k <= K.
    alpha_hat, beta_hat, batch, C
        Step sizes, gamma_hat and Definition 1's C (sensitivity, Lemma 2).
    sigma_exp, offset, scale
        Noise schedule ``sigma_j = scale (j + offset)^sigma_exp``, evaluated at j = k + 1.
    delta_exp, delta_shift
        ``delta_k = (k + 1 + delta_shift)^(-delta_exp)``, which sets c_k.

    Returns
    -------
    float
        eps_k; inf when sigma_{k+1} = 0 (noise off) and the sensitivity is positive.
    """
    kk = _integer("k", k, 0)
    args = _check_eps_args(alpha_hat, beta_hat, batch, C, sigma_exp, offset, delta_exp, scale, delta_shift)
    return float(_eps_array(np.array([kk], dtype=np.float64), *args)[0])


def eps_schedule(
    K_last: int,
    alpha_hat: float,
    beta_hat: float,
    batch: int,
    C: float,
    sigma_exp: float,
    offset: float,
    delta_exp: float,
    scale: float = 1.0,
    delta_shift: int = 0,
) -> NDArray[np.float64]:
    """``[eps_0, ..., eps_{K_last}]`` (vectorised :func:`eps_k`)."""
    args = _check_eps_args(alpha_hat, beta_hat, batch, C, sigma_exp, offset, delta_exp, scale, delta_shift)
    return _eps_array(_ks(K_last), *args)


@dataclass(frozen=True)
class DPQBudget:
    """Cumulative privacy of iterations k = 0..K_last by Theorem 1 (the paper accountant).

    Attributes
    ----------
    K_last
        Last accounted update (-1: nothing released yet).
    eps_total
        ``sum_k eps_k``, the epsilon of Theorem 1 (not its exponential, see module note 2).
    delta_hat
        ``exp(eps_total) (prod_k (1 + delta_k) - 1)`` exactly as defined (inf if it overflows float64);
        >= 1, i.e. vacuous, whenever delta_0 = 1 (module note 3).
    log_delta_hat
        Natural log of ``delta_hat`` (finite even when delta_hat overflows; -inf for nothing released).
    delta_prod_minus_1
        ``prod_{k=0..K_last} (1 + delta_k) - 1``.
    delta_sum
        ``sum_{k=0..K_last} delta_k``.
    delta_sum_from1
        ``sum_{k=1..K_last} delta_k`` (what the paper reports as "sum_{k=0}^{2000} delta_k = 0.2021").
    eps_max
        ``max_k eps_k`` (0 when empty).
    lemma3_violations
        Number of k with eps_k >= 1, where Lemma 3 does not apply.
    """

    K_last: int
    eps_total: float
    delta_hat: float
    log_delta_hat: float
    delta_prod_minus_1: float
    delta_sum: float
    delta_sum_from1: float
    eps_max: float
    lemma3_violations: int

    @property
    def vacuous(self) -> bool:
        """True when ``delta_hat >= 1``: the (eps, delta_hat) statement excludes nothing."""
        return self.delta_hat >= 1.0


def _budget(
    eps: NDArray[np.float64], ks: NDArray[np.float64], delta_exp: float, delta_shift: int, warn: bool
) -> DPQBudget:
    deltas = np.exp(-_log_inv_delta(ks, delta_exp, delta_shift))
    eps_total = math.fsum(eps.tolist())
    prod_m1 = math.expm1(math.fsum(np.log1p(deltas).tolist()))
    log_dh = eps_total + math.log(prod_m1) if prod_m1 > 0.0 else -math.inf
    violations = int(np.count_nonzero(eps >= 1.0))
    if warn and violations:
        warnings.warn(
            f"{violations} of {eps.size} per-iteration eps_k are >= 1 (max {float(eps.max()):.4g}); Lemma 3 "
            "(Gaussian mechanism) assumes eps_k < 1, so the paper's guarantee does not cover them",
            Lemma3Warning,
            stacklevel=3,
        )
    return DPQBudget(
        K_last=int(ks.size) - 1,
        eps_total=eps_total,
        delta_hat=math.exp(log_dh) if log_dh < _MAX_LOG else math.inf,
        log_delta_hat=log_dh,
        delta_prod_minus_1=prod_m1,
        delta_sum=math.fsum(deltas.tolist()),
        delta_sum_from1=math.fsum(deltas[1:].tolist()),
        eps_max=float(eps.max()) if eps.size else 0.0,
        lemma3_violations=violations,
    )


def cumulative(
    K_last: int,
    alpha_hat: float,
    beta_hat: float,
    batch: int,
    C: float,
    sigma_exp: float,
    offset: float,
    delta_exp: float,
    scale: float = 1.0,
    delta_shift: int = 0,
    warn: bool = True,
) -> DPQBudget:
    """Theorem 1's cumulative (eps, delta_hat) over k = 0..K_last, from the exact per-iteration eps_k (spec 4.5).

    Sums are exact (``math.fsum``); the product is ``expm1(fsum(log1p(delta_k)))``. With ``warn`` a
    :class:`Lemma3Warning` is issued if some eps_k >= 1.
    """
    args = _check_eps_args(alpha_hat, beta_hat, batch, C, sigma_exp, offset, delta_exp, scale, delta_shift)
    ks = _ks(K_last)
    return _budget(_eps_array(ks, *args), ks, args[6], args[8], warn)


# --------------------------------------------------------------------------------------------- Theorem 1 closed form


def paper_eps_bound_terms(
    K: int,
    a1: float,
    alpha: float,
    a2: float,
    beta: float,
    a3: float,
    gamma: float,
    C: float,
    sigma_exp: float,
    delta_exp: float,
    corrected: bool,
) -> NDArray[np.float64]:
    """Per-k terms (k = 0..K) of Theorem 1's closed-form epsilon bound.

    Verbatim (``corrected=False``): ``2 C a1 a2 (ln K)^2 sqrt(ln(1.25 (k+1)^delta)) / (a3 K^(alpha+gamma-beta)
    (k+1)^sigma)``, as printed in the statement. Corrected: ``a1 / (a2 a3)`` instead of ``a1 a2 / a3`` and
    ``(k+2)^sigma`` (= sigma_{k+1} with offset 1) as in the proof (module note 1).
    """
    k_hor = _integer("K", K, 2)
    c1, c2, c3 = _positive("a1", a1), _positive("a2", a2), _positive("a3", a3)
    e_a, e_b, e_g = _real("alpha", alpha), _real("beta", beta), _real("gamma", gamma)
    c, s, d = _non_negative("C", C), _real("sigma_exp", sigma_exp), _positive("delta_exp", delta_exp)
    ks = np.arange(k_hor + 1, dtype=np.float64)
    coeff = c1 / c2 if corrected else c1 * c2
    root = np.sqrt(_LN_1_25 + d * np.log(ks + 1.0))
    base = ks + (2.0 if corrected else 1.0)
    return 2.0 * c * coeff * math.log(k_hor) ** 2 * root / (c3 * math.pow(k_hor, e_a + e_g - e_b) * base**s)


def paper_eps_bound_verbatim(
    K: int,
    a1: float,
    alpha: float,
    a2: float,
    beta: float,
    a3: float,
    gamma: float,
    C: float,
    sigma_exp: float,
    delta_exp: float,
) -> float:
    """Theorem 1's epsilon bound exactly as printed (for figure reproduction only; module note 1)."""
    terms = paper_eps_bound_terms(K, a1, alpha, a2, beta, a3, gamma, C, sigma_exp, delta_exp, corrected=False)
    return math.fsum(terms.tolist())


def paper_eps_bound_corrected(
    K: int,
    a1: float,
    alpha: float,
    a2: float,
    beta: float,
    a3: float,
    gamma: float,
    C: float,
    sigma_exp: float,
    delta_exp: float,
) -> float:
    """Theorem 1's epsilon bound with the printed errors fixed (module note 1); >= the exact sum for offset 1."""
    terms = paper_eps_bound_terms(K, a1, alpha, a2, beta, a3, gamma, C, sigma_exp, delta_exp, corrected=True)
    return math.fsum(terms.tolist())


def eps_decay_exponent(alpha: float, beta: float, gamma: float, sigma_exp: float) -> float:
    """``alpha + gamma - beta - max{1 - sigma, 0}``: the K-exponent of (30) (sum eps_k = O(ln^{5/2} K / K^this))."""
    return (
        _real("alpha", alpha)
        + _real("gamma", gamma)
        - _real("beta", beta)
        - max(1.0 - _real("sigma_exp", sigma_exp), 0.0)
    )


def privacy_finite(alpha: float, beta: float, gamma: float, sigma_exp: float, delta_exp: float) -> bool:
    """Theorem 1's condition for finite (eps, delta) as K -> infinity: ``alpha + gamma - beta > max{1 - sigma, 0}``
    and ``delta > 1`` (asymptotic only: for the paper's exponents the sum still grows at practical K, spec 4.4)."""
    return eps_decay_exponent(alpha, beta, gamma, sigma_exp) > 0.0 and _real("delta_exp", delta_exp) > 1.0


def zcdp_crosscheck(
    K_last: int,
    alpha_hat: float,
    beta_hat: float,
    batch: int,
    C: float,
    sigma_exp: float,
    offset: float,
    delta: float,
    scale: float = 1.0,
) -> tuple[float, float]:
    """NOT FROM THE PAPER: per-node zCDP of the same Gaussian releases, ``rho = sum_k S_k^2 / (2 sigma_{k+1}^2)``,
    and its (eps, delta) conversion ``rho + 2 sqrt(rho ln(1/delta))`` (Bun-Steinke), as a sanity reference.

    Returns
    -------
    tuple[float, float]
        ``(rho, eps)``; inf when some sigma_{k+1} is 0 with positive sensitivity.
    """
    a, b, g, c = _check_mech(alpha_hat, beta_hat, batch, C)
    target = _real("delta", delta)
    if not 0.0 < target < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    ks = _ks(K_last)
    sens = _sens_array(ks, a, b, g, c)
    sig = _sigma_array(
        ks + 1.0, _real("sigma_exp", sigma_exp), _positive("offset", offset), _non_negative("scale", scale)
    )
    if np.any((sig == 0.0) & (sens > 0.0)):
        return math.inf, math.inf
    safe = np.where(sig > 0.0, sig, 1.0)
    rho = math.fsum((np.where(sig > 0.0, sens / safe, 0.0) ** 2 / 2.0).tolist())
    return rho, rho + 2.0 * math.sqrt(rho * math.log(1.0 / target))


# ---------------------------------------------------------------------------------------------------- the mechanism
@dataclass(frozen=True)
class TimeVaryingNoise:
    """DPQ-DSGD's own mechanism, the **reproduction setting**: ``DPQDSGD(privacy=TimeVaryingNoise(...))``.

    Each node adds ``N(0, sigma_k^2 I)``, ``sigma_k = sigma_scale (k + sigma_offset)^sigma_exp``, to its model
    before quantizing it (Algorithm 1, line 2), and its ledger charges ``eps_k = c_k S_k / sigma_{k+1}`` per release
    with Lemma 2's sensitivity ``S_k = (alpha_hat C / gamma_hat) sum_{m<=k} (1 - beta_hat)^m`` (the paper accountant:
    Theorem 1's ``sum_k eps_k``, :class:`DPQLedger`).

    **Its rigorous epsilon is unbounded** (:meth:`rigorous_epsilon`, reported as inf beside the paper's figure):
    Definition 1 assumes every per-sample gradient difference is at most C, which the paper never enforces (no
    clipping, spec 9.11), so one record can move the model arbitrarily. Clipping alone would not rescue Lemma 2:
    S_k bounds the minibatch gradient's change as if only the replaced sample's gradient changed, but from the
    second update on x_{i,k} itself differs between neighbouring datasets, so *every* sample's gradient does. With
    every per-sample gradient clipped to C/2 (any two differ by at most C wherever they are evaluated) the bound
    that holds is ``S_k = alpha_hat C sum_{m<=k} (1 - beta_hat)^m`` -- gamma_hat times Lemma 2's -- and the releases
    compose to zCDP ``sum_k S_k^2 / (2 sigma_{k+1}^2)`` (:meth:`clipped_epsilon`, replace-one neighbours, no
    amplification claimed): what the same noise would buy if the gradients were clipped. The rigorous mechanism of
    DPQ-DSGD is record-level DP-SGD in the gradient (5): ``privacy=PrivacyTarget(...)``.

    Parameters
    ----------
    sigma_exp, sigma_offset, sigma_scale
        The noise schedule (defaults 0.1, 5, 1: the paper's MNIST experiment; offset 1 is the theory's).
    delta_exp, delta_shift
        ``delta_k = (k + 1 + delta_shift)^(-delta_exp)`` of Theorem 1 (3 and 0; the paper's delta_0 = 1 makes its
        delta_hat vacuous, spec 9.8; ``delta_shift=1`` is the non-vacuous variant).
    dp_C
        C of Definition 1 (default 0.2, the paper's): an accountant parameter only, as in the paper.
    """

    sigma_exp: float = 0.1
    sigma_offset: float = 5.0
    sigma_scale: float = 1.0
    delta_exp: float = 3.0
    delta_shift: int = 0
    dp_C: float = 0.2

    def __post_init__(self) -> None:
        for name, value in (("sigma_exp", self.sigma_exp), ("sigma_offset", self.sigma_offset),
                            ("sigma_scale", self.sigma_scale), ("delta_exp", self.delta_exp), ("dp_C", self.dp_C)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"TimeVaryingNoise {name} must be a finite number, got {value!r}")
        for name, value in (("sigma_offset", self.sigma_offset), ("sigma_scale", self.sigma_scale),
                            ("delta_exp", self.delta_exp), ("dp_C", self.dp_C)):
            if not value > 0:
                raise ValueError(f"TimeVaryingNoise {name} must be > 0, got {value!r}")
        if self.delta_shift not in (0, 1) or isinstance(self.delta_shift, bool):
            raise ValueError(f"TimeVaryingNoise delta_shift must be 0 (the paper) or 1, got {self.delta_shift!r}")

    #: the rigorous epsilon of the paper's (unclipped) configuration, and why (docstring)
    RIGOROUS_EPSILON = math.inf
    RIGOROUS_WHY = "unbounded: no per-sample gradient is clipped, so Definition 1's C bounds nothing (spec 9.11)"

    def rigorous_epsilon(self) -> float:
        """inf: the paper's configuration bounds no record's influence (docstring)."""
        return self.RIGOROUS_EPSILON

    def clipped_epsilon(self, K_last: int, alpha_hat: float, beta_hat: float, delta: float) -> float:
        """The zCDP epsilon (Bun-Steinke conversion at ``delta``) of the same noise over the releases after updates
        0..K_last, were every per-sample gradient clipped to C/2: sensitivity ``alpha_hat C sum_{m<=k}
        (1 - beta_hat)^m`` (:func:`zcdp_crosscheck` with a batch of 1: the divergent x changes every sample's
        gradient, docstring)."""
        return zcdp_crosscheck(K_last, alpha_hat, beta_hat, 1, self.dp_C, self.sigma_exp, self.sigma_offset, delta,
                               self.sigma_scale)[1]


# ---------------------------------------------------------------------------------------------------- run schedule


@dataclass(frozen=True)
class DPQSchedule:
    """All public constants of one DPQ-DSGD run and its paper accountant (spec 2.1, 4).

    Parameters
    ----------
    K
        Horizon (k = 0..K, K + 1 updates); sets alpha_hat, beta_hat and gamma_hat.
    a1, alpha, a2, beta, a3, gamma
        Step-size and sample-size constants/exponents of Theorem 1.
    dp_C
        Definition 1's bound C on per-sample gradient differences.
    delta_exp
        delta of ``delta_k = (k + 1 + delta_shift)^(-delta)``.
    sigma_exp, sigma_offset, sigma_scale
        Noise STD ``sigma_k = sigma_scale (k + sigma_offset)^sigma_exp``.
    delta_shift
        0 (paper) or 1 (the non-vacuous variant of spec 9.8).
    """

    K: int
    a1: float
    alpha: float
    a2: float
    beta: float
    a3: float
    gamma: float
    dp_C: float
    delta_exp: float
    sigma_exp: float
    sigma_offset: float = 1.0
    sigma_scale: float = 1.0
    delta_shift: int = 0

    def __post_init__(self) -> None:
        step_sizes(self.K, self.a1, self.alpha, self.a2, self.beta, self.a3, self.gamma)
        _check_eps_args(
            1.0,
            0.5,
            1,
            self.dp_C,
            self.sigma_exp,
            self.sigma_offset,
            self.delta_exp,
            self.sigma_scale,
            self.delta_shift,
        )

    @classmethod
    def paper_mnist(cls, sigma_exp: float = 0.1, K: int = 2000, sigma_offset: float = 5.0) -> DPQSchedule:
        """The paper's MNIST preset (Section 4): a1=.35, alpha=1, a2=.3, beta=.75, a3=.24, gamma=.7, C=.2, delta=3."""
        return cls(
            K=K,
            a1=0.35,
            alpha=1.0,
            a2=0.3,
            beta=0.75,
            a3=0.24,
            gamma=0.7,
            dp_C=0.2,
            delta_exp=3.0,
            sigma_exp=sigma_exp,
            sigma_offset=sigma_offset,
        )

    @property
    def alpha_hat(self) -> float:
        """Gradient step ``a1 (ln K)^2 / K^alpha``."""
        return step_sizes(self.K, self.a1, self.alpha, self.a2, self.beta, self.a3, self.gamma)[0]

    @property
    def beta_hat(self) -> float:
        """Consensus step ``a2 / K^beta``."""
        return step_sizes(self.K, self.a1, self.alpha, self.a2, self.beta, self.a3, self.gamma)[1]

    @property
    def batch_size(self) -> int:
        """Minibatch size gamma_hat ``floor(a3 K^gamma) + 1``."""
        return step_sizes(self.K, self.a1, self.alpha, self.a2, self.beta, self.a3, self.gamma)[2]

    def _mech(self) -> tuple[float, float, int, float, float, float, float, float, int]:
        a, b, g = step_sizes(self.K, self.a1, self.alpha, self.a2, self.beta, self.a3, self.gamma)
        return (
            a,
            b,
            g,
            float(self.dp_C),
            float(self.sigma_exp),
            float(self.sigma_offset),
            float(self.delta_exp),
            float(self.sigma_scale),
            int(self.delta_shift),
        )

    def sigma(self, k: int) -> float:
        """Noise STD sigma_k of iteration k."""
        return sigma_k(k, self.sigma_exp, self.sigma_offset, self.sigma_scale)

    def eps(self, k: int) -> float:
        """eps_k of the release after update k."""
        return eps_k(k, *self._mech())

    def eps_array(self, K_last: int | None = None) -> NDArray[np.float64]:
        """``[eps_0, ..., eps_{K_last}]``, K_last = K by default."""
        return eps_schedule(self.K if K_last is None else K_last, *self._mech())

    def budget(self, K_last: int | None = None, warn: bool = True) -> DPQBudget:
        """:func:`cumulative` over k = 0..K_last (K by default)."""
        return cumulative(self.K if K_last is None else K_last, *self._mech(), warn=warn)

    def _bound_args(self) -> tuple[int, float, float, float, float, float, float, float, float, float]:
        return (
            self.K,
            self.a1,
            self.alpha,
            self.a2,
            self.beta,
            self.a3,
            self.gamma,
            self.dp_C,
            self.sigma_exp,
            self.delta_exp,
        )

    def bound_verbatim(self) -> float:
        """:func:`paper_eps_bound_verbatim` for this run (ignores sigma_offset/scale, as the paper does)."""
        return paper_eps_bound_verbatim(*self._bound_args())

    def bound_corrected(self) -> float:
        """:func:`paper_eps_bound_corrected` for this run (a bound on the exact sum for offset 1, scale 1)."""
        return paper_eps_bound_corrected(*self._bound_args())

    def privacy_finite(self) -> bool:
        """:func:`privacy_finite` of this run's exponents."""
        return privacy_finite(self.alpha, self.beta, self.gamma, self.sigma_exp, self.delta_exp)

    def ledger(self) -> DPQLedger:
        """An empty :class:`DPQLedger` with this run's constants."""
        a, b, g, c, s, off, d, sc, sh = self._mech()
        return DPQLedger(
            alpha_hat=a,
            beta_hat=b,
            batch_size=g,
            dp_C=c,
            sigma_exp=s,
            delta_exp=d,
            sigma_offset=off,
            sigma_scale=sc,
            delta_shift=sh,
        )


# ---------------------------------------------------------------------------------------------------------- ledger

_FLOAT_KEYS = ("alpha_hat", "beta_hat", "dp_C", "sigma_exp", "delta_exp", "sigma_offset", "sigma_scale")
_INT_KEYS = ("batch_size", "delta_shift", "k_next")


@dataclass
class DPQLedger:
    """One node's DPQ-DSGD privacy ledger: the noise of each release after update k = 0, 1, ... (spec 4, 7.3).

    Stores the constants of :func:`eps_k` and the STD ``sigmas[k]`` actually used for ``n_{k+1}`` (normally the
    schedule's sigma_{k+1}; 0 = noise off). Plain ints, floats and float lists, so it fits Flower's
    ``context.state`` as a ConfigRecord (:meth:`to_record` / :meth:`from_record`). Every node of a run has the same
    ledger (shared hyper-parameters); the release of z_0 is data-independent and costs nothing.

    Parameters
    ----------
    alpha_hat, beta_hat, batch_size, dp_C
        Mechanism constants (Lemma 2).
    sigma_exp, delta_exp, sigma_offset, sigma_scale, delta_shift
        Schedules, as in :func:`eps_k`.
    sigmas
        ``sigmas[k]`` = STD of n_{k+1} for each recorded update k (finite, >= 0).
    """

    alpha_hat: float
    beta_hat: float
    batch_size: int
    dp_C: float
    sigma_exp: float
    delta_exp: float
    sigma_offset: float = 1.0
    sigma_scale: float = 1.0
    delta_shift: int = 0
    sigmas: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        a, b, g, c, s, off, d, sc, sh = _check_eps_args(
            self.alpha_hat,
            self.beta_hat,
            self.batch_size,
            self.dp_C,
            self.sigma_exp,
            self.sigma_offset,
            self.delta_exp,
            self.sigma_scale,
            self.delta_shift,
        )
        self.alpha_hat, self.beta_hat, self.batch_size, self.dp_C = a, b, g, c
        self.sigma_exp, self.sigma_offset, self.delta_exp, self.sigma_scale, self.delta_shift = s, off, d, sc, sh
        self.sigmas = [_non_negative("sigma", v) for v in self.sigmas]

    def __len__(self) -> int:
        """Number of recorded updates."""
        return len(self.sigmas)

    @property
    def k_next(self) -> int:
        """Index of the next update to record (= number recorded)."""
        return len(self.sigmas)

    def _mech(self) -> tuple[float, float, int, float]:
        return self.alpha_hat, self.beta_hat, self.batch_size, self.dp_C

    def eps_array(self) -> NDArray[np.float64]:
        """Recorded ``[eps_0, ..., eps_{k_next - 1}]`` with the sigmas actually used."""
        ks = np.arange(len(self.sigmas), dtype=np.float64)
        num = _c_array(ks, self.delta_exp, self.delta_shift) * _sens_array(ks, *self._mech())
        return _ratio(num, np.asarray(self.sigmas, dtype=np.float64))

    def scheduled_sigma(self, k: int) -> float:
        """The schedule's STD sigma_{k+1} for the release after update k."""
        return sigma_k(k + 1, self.sigma_exp, self.sigma_offset, self.sigma_scale)

    def record(self, k: int, sigma: float | None = None) -> float:
        """Record the release after update k (must be :attr:`k_next`) and return its eps_k.

        Parameters
        ----------
        k
            Update index; a mismatch with :attr:`k_next` means client and server are out of sync.
        sigma
            STD actually used for n_{k+1}; the schedule's sigma_{k+1} when None.

        Warns
        -----
        Lemma3Warning
            If eps_k >= 1.
        """
        kk = _integer("k", k, 0)
        if kk != self.k_next:
            raise ValueError(f"ledger out of sync: recording update k = {kk}, expected k = {self.k_next}")
        used = self.scheduled_sigma(kk) if sigma is None else _non_negative("sigma", sigma)
        self.sigmas.append(used)
        eps = float(self.eps_array()[-1])
        if math.isinf(eps):
            warnings.warn(f"eps_{kk} = inf: no noise on a data-dependent release", Lemma3Warning, stacklevel=2)
        elif eps >= 1.0:
            warnings.warn(f"eps_{kk} = {eps:.4g} >= 1: outside Lemma 3's range", Lemma3Warning, stacklevel=2)
        return eps

    @property
    def eps_total(self) -> float:
        """``sum_k eps_k`` over the recorded updates (exact sum)."""
        return math.fsum(self.eps_array().tolist())

    def budget(self) -> DPQBudget:
        """Theorem 1's (eps, delta_hat) over the recorded updates k = 0..k_next - 1 (no warning)."""
        ks = np.arange(len(self.sigmas), dtype=np.float64)
        return _budget(self.eps_array(), ks, self.delta_exp, self.delta_shift, warn=False)

    def to_record(self) -> dict[str, int | float | list[float]]:
        """Plain-Python form for Flower's ``context.state`` (ConfigRecord: int, float, list[float]).

        ``k_next``, ``eps_total`` and ``eps`` are informational; :meth:`from_record` checks them against ``sigmas``.
        """
        record: dict[str, int | float | list[float]] = {key: float(getattr(self, key)) for key in _FLOAT_KEYS}
        record.update({"batch_size": self.batch_size, "delta_shift": self.delta_shift, "k_next": self.k_next})
        record["eps_total"] = self.eps_total
        record["sigmas"] = list(self.sigmas)
        record["eps"] = [float(e) for e in self.eps_array()]
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, object]) -> DPQLedger:
        """Rebuild a ledger from :meth:`to_record`'s output.

        Raises
        ------
        ValueError
            If a key is missing, a value is out of range, ``k_next != len(sigmas)``, or ``eps`` / ``eps_total``
            disagree with the sigmas (relative 1e-9).
        TypeError
            If a value has the wrong type.
        """
        for key in (*_FLOAT_KEYS, *_INT_KEYS, "eps_total", "sigmas", "eps"):
            if key not in record:
                raise ValueError(f"DPQ ledger record is missing key {key!r}")
        floats: dict[str, float] = {}
        for key in (*_FLOAT_KEYS, "eps_total"):
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"DPQ ledger {key!r} must be a float, got {type(value).__name__}")
            floats[key] = float(value)
        ints: dict[str, int] = {}
        for key in _INT_KEYS:
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"DPQ ledger {key!r} must be an int, got {type(value).__name__}")
            ints[key] = value
        lists: dict[str, list[float]] = {}
        for key in ("sigmas", "eps"):
            values = record[key]
            if not isinstance(values, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
            ):
                raise TypeError(f"DPQ ledger {key!r} must be a list of floats")
            lists[key] = [float(v) for v in values]
        ledger = cls(
            alpha_hat=floats["alpha_hat"],
            beta_hat=floats["beta_hat"],
            batch_size=ints["batch_size"],
            dp_C=floats["dp_C"],
            sigma_exp=floats["sigma_exp"],
            delta_exp=floats["delta_exp"],
            sigma_offset=floats["sigma_offset"],
            sigma_scale=floats["sigma_scale"],
            delta_shift=ints["delta_shift"],
            sigmas=lists["sigmas"],
        )
        if ints["k_next"] != ledger.k_next:
            raise ValueError(f"DPQ ledger 'k_next' = {ints['k_next']} != len(sigmas) = {ledger.k_next}")
        eps = ledger.eps_array().tolist()
        if len(lists["eps"]) != len(eps) or not all(
            math.isclose(x, y, rel_tol=1e-9, abs_tol=0.0) for x, y in zip(lists["eps"], eps, strict=True)
        ):
            raise ValueError("DPQ ledger 'eps' disagrees with the recorded sigmas")
        if not math.isclose(floats["eps_total"], ledger.eps_total, rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(f"DPQ ledger 'eps_total' = {floats['eps_total']!r} disagrees with the recorded sigmas")
        return ledger
