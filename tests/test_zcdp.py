"""Tests of DP-RECAL's zCDP accounting (spec dp_recal.md sections 4.2-4.7, 8 A2/A3, 9 items 6-11).

Every spec constant is derived by hand in a comment and recomputed with 50-digit mpmath from the closed forms
(independently of fedpdm_flower.fedapp.privacy.zcdp) before our float64 functions are asserted against it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fedpdm_flower.fedapp.privacy.zcdp import (
    ActivationLedger,
    CalibrationOverflowError,
    calibrate_sigma1,
    default_xi_plan,
    eps_from_rho,
    epsilon_dp_recal,
    epsilon_from_noise,
    geom_sum,
    lci,
    log_geom_sum,
    log_sigma1_for_budget,
    noise_floor,
    per_agent_rho,
    rho_from_eps,
    rho_step,
    rho_total,
    sensitivity,
    sensitivity_per_record,
    sigma1_for_budget,
    sigma_at,
)

REL = 1e-9  # spec 9: relative tolerance of the accounting constants
DELTA = 1e-3
# Worked example of spec 4.6: alpha = 0.1, beta = 1/(2(8+1)) = 1/18, L = 10.
ALPHA, BETA, L = 0.1, 1.0 / 18.0, 10.0
# Delta = 4 * 0.1 * (1/18) * 10 = 4/18 = 2/9 = 0.2222...
DELTA_W = 2.0 / 9.0
# rho^1 at sigma_1 = 1: Delta^2 / 2 = (4/81) / 2 = 2/81 = 0.0246913580...  (= 8 a^2 b^2 L^2 = 8 * 0.01 * 100 / 324)
RHO1 = 2.0 / 81.0


# --- independent 50-digit references (closed forms of the paper, not our code) --------------------------------------


def _mp() -> Any:
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    return mpmath


def _ref_geom(mp: Any, R: str, xi: int) -> Any:
    r = mp.mpf(R)
    return mp.mpf(xi) if r == 1 else (r**xi - 1) / (r - 1)


def _ref_eps(mp: Any, rho: Any) -> Any:
    return rho + 2 * mp.sqrt(rho * mp.log(1 / mp.mpf(DELTA)))


def _ref_rho_from_eps(mp: Any, eps: float) -> Any:
    a = mp.log(1 / mp.mpf(DELTA))
    return (mp.sqrt(a + eps) - mp.sqrt(a)) ** 2


def _ref_delta(mp: Any) -> Any:
    return 4 * mp.mpf("0.1") / 18 * 10


# --- 4.2 / 4.3: sensitivity and per-activation rho (spec 9.6) ------------------------------------------------------


def test_sensitivity_and_rho1_worked_numbers() -> None:
    mp = _mp()
    assert float(_ref_delta(mp)) == pytest.approx(DELTA_W, rel=1e-15)
    assert float(_ref_delta(mp) ** 2 / 2) == pytest.approx(RHO1, rel=1e-15)
    assert sensitivity(ALPHA, BETA, L) == pytest.approx(0.2222222222222222, rel=REL)
    assert rho_step(1, 1.0, 1.0, sensitivity(ALPHA, BETA, L)) == pytest.approx(RHO1, rel=REL)
    assert abs(RHO1 - 0.024691358024691) < 1e-13 * RHO1


def test_rho_step_is_rho1_times_r_power() -> None:
    # Lemma 5 / Theorem 3's proof: rho^{t+1} = R rho^t, i.e. rho^t = rho^1 R^{t-1}; and rho^t = Delta^2/(2 sigma_t^2).
    for t in (1, 2, 7, 50):
        expected = RHO1 * 1.05 ** (t - 1)
        assert rho_step(t, 1.0, 1.05, DELTA_W) == pytest.approx(expected, rel=1e-12)
        assert rho_step(t, 1.0, 1.05, DELTA_W) == pytest.approx(
            DELTA_W**2 / (2 * sigma_at(t, 1.0, 1.05) ** 2), rel=1e-12
        )
    # 8 alpha^2 beta^2 L^2 / sigma^2 form of Lemma 5 at sigma_1 = 3.
    assert rho_step(1, 3.0, 1.01, DELTA_W) == pytest.approx(8 * ALPHA**2 * BETA**2 * L**2 / 9.0, rel=1e-12)
    assert rho_step(3, 0.0, 1.01, DELTA_W) == math.inf
    assert rho_step(3, 0.0, 1.01, 0.0) == 0.0
    # sigma_1 = e^436 (a calibrated R = 1.2, xi = 4800 plan): sigma_1^2 ~ e^872 and R^4799 ~ e^875 are beyond float64
    # and rho^1 ~ e^-875 underflows, but the last activation's rho^4800 = rho^1 R^4799 is O(1) and computed in logs.
    log_expected = 2 * math.log(DELTA_W) - math.log(2) - 872.0 + 4799 * math.log(1.2)
    assert rho_step(4800, math.exp(436.0), 1.2, DELTA_W) == pytest.approx(math.exp(log_expected), rel=1e-9)
    assert 1e-3 < math.exp(log_expected) < 1e3
    assert rho_step(1, math.exp(436.0), 1.2, DELTA_W) == 0.0  # honest underflow of e^-875


def test_sigma_schedule_matches_spec_expression() -> None:
    # Spec 2.3, S6: sigma = sigma_1 * R ** (-(tau - 1) / 2); bit-for-bit equal so simulators agree.
    for t in (1, 2, 10, 600):
        assert sigma_at(t, 2.5, 1.01) == 2.5 * 1.01 ** (-(t - 1) / 2.0)
    assert sigma_at(1, 2.5, 1.3) == 2.5
    assert sigma_at(3, 4.0, 4.0) == pytest.approx(1.0, rel=1e-15)  # 4 * 4^{-1}


def test_noise_schedule_empirical_std() -> None:
    # Spec 9.11: 10^5 draws at t = 1 and t = 50 with R = 1.05 have the expected std to 2%.
    rng = np.random.default_rng(0)
    for t in (1, 50):
        sigma = sigma_at(t, 3.0, 1.05)
        draws = sigma * rng.standard_normal(100_000)
        assert float(np.std(draws)) == pytest.approx(sigma, rel=0.02)
    # By hand: sigma_50 = 3 * 1.05^{-24.5} = 3 * exp(-24.5 * 0.0487902) = 3 * exp(-1.195359) = 3 * 0.302595 = 0.907786.
    assert sigma_at(50, 3.0, 1.05) == pytest.approx(0.907786, rel=1e-5)


# --- 4.4: composition (spec 9.7) -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("R", "xi", "spec_rho"),
    [
        # R = 1: 600 * 2/81 = 1200/81 = 14.8148...
        ("1.0", 600, 1200.0 / 81.0),
        # R = 1.01: 1.01^600 = exp(600 * 0.00995033) = exp(5.970199) = 391.5834; (391.5834 - 1)/0.01 = 39058.34;
        # * 2/81 = 964.4034.
        ("1.01", 600, 964.40344938104),
        # R = 2: (2^10 - 1)/(2 - 1) = 1023; * 2/81 = 2046/81 = 25.259...
        ("2.0", 10, 2046.0 / 81.0),
    ],
)
def test_rho_total_worked_numbers(R: str, xi: int, spec_rho: float) -> None:
    mp = _mp()
    ref = _ref_delta(mp) ** 2 / 2 * _ref_geom(mp, R, xi)
    assert float(ref) == pytest.approx(spec_rho, rel=1e-13)  # the spec's constant is right
    assert rho_total(RHO1, float(R), xi) == pytest.approx(spec_rho, rel=REL)
    assert per_agent_rho(xi, RHO1, float(R)) == pytest.approx(spec_rho, rel=REL)
    assert geom_sum(float(R), xi) == pytest.approx(float(_ref_geom(mp, R, xi)), rel=REL)
    assert log_geom_sum(float(R), xi) == pytest.approx(float(mp.log(_ref_geom(mp, R, xi))), rel=1e-12)


def test_rho_total_limit_r_to_one_is_continuous() -> None:
    # Spec 9.7: R = 1 + 1e-12 matches R = 1 to 1e-6 (first-order term (xi-1) h / 2 = 3e-10 here).
    assert rho_total(RHO1, 1.0 + 1e-12, 600) == pytest.approx(rho_total(RHO1, 1.0, 600), rel=1e-6)
    assert log_geom_sum(1.0 + 1e-12, 600) == pytest.approx(math.log(600), rel=1e-9)
    assert noise_floor(1.0, DELTA, 1.0, 1.0 + 1e-12, 600) == pytest.approx(
        noise_floor(1.0, DELTA, 1.0, 1.0, 600), rel=1e-6
    )
    assert geom_sum(1.3, 0) == 0.0 and rho_total(RHO1, 1.3, 0) == 0.0 and log_geom_sum(1.3, 0) == -math.inf
    assert geom_sum(1.3, 1) == pytest.approx(1.0, rel=1e-15)


# --- 4.4: Prop. 4 and Theorem 3 (spec 9.8, 9.9) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("R", "xi", "spec_eps"),
    [
        # ln(1e3) = 6.9077553; 14.814815 + 2 sqrt(14.814815 * 6.9077553) = 14.814815 + 2 * 10.116178 = 35.047171.
        ("1.0", 600, 35.04717653995),
        # 964.403449 + 2 sqrt(964.403449 * 6.9077553) = 964.403449 + 2 sqrt(6661.8630) = 964.403449 + 2 * 81.620237
        # = 1127.643923.
        ("1.01", 600, 1127.6439225307),
        # 25.259259 + 2 sqrt(25.259259 * 6.9077553) = 25.259259 + 2 sqrt(174.48478) = 25.259259 + 2 * 13.209269
        # = 51.677797.
        ("2.0", 10, 51.677796803289),
    ],
)
def test_eps_from_rho_and_theorem3_worked_numbers(R: str, xi: int, spec_eps: float) -> None:
    mp = _mp()
    ref = _ref_eps(mp, _ref_delta(mp) ** 2 / 2 * _ref_geom(mp, R, xi))
    assert float(ref) == pytest.approx(spec_eps, rel=1e-12)
    assert eps_from_rho(rho_total(RHO1, float(R), xi), DELTA) == pytest.approx(spec_eps, rel=REL)
    # Theorem 3 directly (log-space path) with sigma_1 = 1.
    assert epsilon_dp_recal(ALPHA, BETA, L, 1.0, float(R), xi, DELTA) == pytest.approx(spec_eps, rel=REL)
    assert epsilon_from_noise(1.0, DELTA_W, float(R), xi, DELTA) == pytest.approx(spec_eps, rel=REL)


@pytest.mark.parametrize(
    ("eps", "spec_rho"),
    [
        # a = 6.9077553: (sqrt(7.9077553) - sqrt(6.9077553))^2 = (2.8120732 - 2.6282609)^2 = 0.1838123^2 = 0.033787
        (1.0, 0.033786940836572),
        # (sqrt(11.9077553) - 2.6282609)^2 = (3.4507616 - 2.6282609)^2 = 0.8225007^2 = 0.676507
        (5.0, 0.676507345084437),
        # (sqrt(16.9077553) - 2.6282609)^2 = (4.1119041 - 2.6282609)^2 = 1.4836432^2 = 2.201197
        (10.0, 2.201197172235182),
    ],
)
def test_rho_from_eps_worked_numbers(eps: float, spec_rho: float) -> None:
    mp = _mp()
    assert float(_ref_rho_from_eps(mp, eps)) == pytest.approx(spec_rho, rel=1e-13)
    assert rho_from_eps(eps, DELTA) == pytest.approx(spec_rho, rel=REL)


@pytest.mark.parametrize("eps", [0.1, 1.0, 5.0, 10.0, 1e3])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 0.5])
def test_rho_from_eps_round_trip(eps: float, delta: float) -> None:
    assert eps_from_rho(rho_from_eps(eps, delta), delta) == pytest.approx(eps, rel=1e-12)


# --- calibration (spec 4.6 table, 9.10) ----------------------------------------------------------------------------

_CALIBRATION_TABLE = [
    # sigma_1 = Delta sqrt(geom_sum / (2 rho_from_eps)). By hand for R = 1, xi = 600, eps = 1:
    # (2/9) sqrt(600 / (2 * 0.0337869)) = 0.222222 * sqrt(8879.15) = 0.222222 * 94.2293 = 20.9398.
    (1.0, "1.0", 600, 20.939855379985),
    # eps = 10: 0.222222 * sqrt(600 / 4.402394) = 0.222222 * 11.67432 = 2.594293.
    (10.0, "1.0", 600, 2.5942907099927),
    # R = 1.01, xi = 700: 1.01^700 = exp(700 * 0.00995033) = exp(6.965232) = 1059.160; geom = 1058.160 / 0.01
    # = 105816.0; 0.222222 sqrt(105816.0 / 0.0675739) = 0.222222 sqrt(1565931) = 0.222222 * 1251.372 = 278.083.
    (1.0, "1.01", 700, 278.08256552768),
    (10.0, "1.01", 700, 34.452339964533),
    # R = 1.05, xi = 700: 1.05^700 = exp(700 * 0.0487902) = exp(34.15313) = 6.8e14; geom = 1.36e16;
    # 0.222222 sqrt(1.36e16 / 0.0675739) = 0.222222 * 4.49e8 = 9.97e7.
    (1.0, "1.05", 700, 9.9693702404e7),
    (10.0, "1.05", 700, 1.2351300488e7),
]


@pytest.mark.parametrize(("eps", "R", "xi", "spec_sigma1"), _CALIBRATION_TABLE)
def test_calibrate_sigma1_worked_numbers(eps: float, R: str, xi: int, spec_sigma1: float) -> None:
    mp = _mp()
    ref = _ref_delta(mp) * mp.sqrt(_ref_geom(mp, R, xi) / (2 * _ref_rho_from_eps(mp, eps)))
    # The spec gives 11-14 significant digits; the R = 1.05 column only 11.
    assert float(ref) == pytest.approx(spec_sigma1, rel=1e-10)
    sigma1 = calibrate_sigma1(eps, DELTA, float(R), xi, ALPHA, BETA, L)
    assert sigma1 == pytest.approx(float(ref), rel=REL)
    assert sigma1_for_budget(eps, DELTA, DELTA_W, float(R), xi) == pytest.approx(float(ref), rel=REL)


@pytest.mark.parametrize(
    ("R", "xi"), [(1.0, 600), (1.0, 1), (1.001, 700), (1.01, 700), (1.05, 700), (2.0, 10), (1.2, 4800)]
)
@pytest.mark.parametrize("eps", [0.1, 1.0, 5.0, 10.0])
def test_calibrate_then_theorem3_round_trip(R: float, xi: int, eps: float) -> None:
    sigma1 = calibrate_sigma1(eps, DELTA, R, xi, ALPHA, BETA, L)
    assert epsilon_dp_recal(ALPHA, BETA, L, sigma1, R, xi, DELTA) == pytest.approx(eps, rel=REL)


def test_round_trip_at_r_1_2_xi_4800_has_ln_sigma1_436() -> None:
    # Spec 9.10: ln sigma_1 = ln(2/9) + (4800 ln 1.2 + ln(1 - 1.2^-4800) - ln 0.2 - ln(2 * 2.2011972)) / 2
    #          = -1.504077 + (875.143473 + 0 + 1.609438 - 1.482149) / 2 = -1.504077 + 437.635381 = 436.131304.
    sigma1 = calibrate_sigma1(10.0, DELTA, 1.2, 4800, ALPHA, BETA, L)
    assert math.isfinite(sigma1)
    assert math.log(sigma1) == pytest.approx(436.131304, abs=1e-5)
    assert log_sigma1_for_budget(10.0, DELTA, DELTA_W, 1.2, 4800) == pytest.approx(math.log(sigma1), rel=1e-14)


def test_monotonicity() -> None:
    # Theorem 3: eps grows with xi (more releases) and with R at fixed sigma_1; it falls as sigma_1 grows.
    eps_xi = [epsilon_dp_recal(ALPHA, BETA, L, 5.0, 1.01, xi, DELTA) for xi in (0, 1, 10, 100, 600, 700, 4800)]
    assert eps_xi[0] == 0.0
    assert all(a < b for a, b in itertools.pairwise(eps_xi))
    eps_sigma = [epsilon_dp_recal(ALPHA, BETA, L, s, 1.01, 600, DELTA) for s in (0.1, 1.0, 5.0, 50.0, 1e3, 1e100)]
    assert all(a > b for a, b in itertools.pairwise(eps_sigma))
    eps_r = [epsilon_dp_recal(ALPHA, BETA, L, 5.0, r, 600, DELTA) for r in (1.0, 1.001, 1.01, 1.05)]
    assert all(a < b for a, b in itertools.pairwise(eps_r))
    # Calibration: sigma_1 decreases as eps increases (spec 9.10), increases with xi.
    sig = [calibrate_sigma1(e, DELTA, 1.01, 700, ALPHA, BETA, L) for e in (0.1, 1.0, 5.0, 10.0, 100.0)]
    assert all(a > b for a, b in itertools.pairwise(sig))
    sig_xi = [calibrate_sigma1(1.0, DELTA, 1.01, xi, ALPHA, BETA, L) for xi in (1, 10, 600, 700)]
    assert all(a < b for a, b in itertools.pairwise(sig_xi))


def test_trivial_cases() -> None:
    assert epsilon_dp_recal(ALPHA, BETA, L, 1.0, 1.01, 0, DELTA) == 0.0  # nothing released
    assert epsilon_dp_recal(ALPHA, BETA, L, 0.0, 1.01, 5, DELTA) == math.inf  # RECAL: no noise, no guarantee
    assert epsilon_from_noise(1.0, 0.0, 1.01, 5, DELTA) == 0.0
    assert calibrate_sigma1(1.0, DELTA, 1.01, 0, ALPHA, BETA, L) == 0.0
    assert eps_from_rho(0.0, DELTA) == 0.0 and eps_from_rho(math.inf, DELTA) == math.inf
    assert rho_from_eps(0.0, DELTA) == 0.0


# --- overflow handling (spec 4.5, 9.10) ----------------------------------------------------------------------------


def test_calibration_beyond_float64_is_rejected() -> None:
    # R = 2, xi = 4800: ln sigma_1 = ln(2/9) + (4800 ln 2 - ln(2 * 2.2011972)) / 2
    #                             = -1.504077 + (3327.1066 - 1.482147) / 2 = 1661.308 > ln(max float) = 709.78.
    with pytest.raises(CalibrationOverflowError, match="beyond float64") as info:
        calibrate_sigma1(10.0, DELTA, 2.0, 4800, ALPHA, BETA, L)
    assert info.value.log_sigma1 == pytest.approx(1661.308, abs=1e-3)
    assert isinstance(info.value, ValueError) and isinstance(info.value, OverflowError)
    with pytest.raises(ValueError, match="lower R or xi_plan"):
        sigma1_for_budget(1.0, DELTA, DELTA_W, 2.0, 4800)
    # The log-space quantities stay finite.
    assert log_sigma1_for_budget(10.0, DELTA, DELTA_W, 2.0, 4800) == pytest.approx(1661.308, abs=1e-3)
    assert log_geom_sum(2.0, 4800) == pytest.approx(4800 * math.log(2.0), rel=1e-15)  # ln((2^4800 - 1)/1)
    assert math.isfinite(log_geom_sum(1.2, 4800))
    # The last activation's noise of that (unusable) plan is still computable: ~ Delta sqrt(2 / (2 rho)).
    assert noise_floor(10.0, DELTA, DELTA_W, 2.0, 4800) == pytest.approx(
        DELTA_W * math.sqrt(2.0 / (2 * rho_from_eps(10.0, DELTA))), rel=1e-12
    )


def test_geom_sum_overflow_names_the_log_twin() -> None:
    assert geom_sum(2.0, 1023) == pytest.approx(2.0**1023, rel=1e-12)  # expm1 of 709.09: ~3e-14 relative error
    # Spec 4.5 says "R = 2, xi >= 1024". 2^1024 - 1 is indeed above the largest float64 ((2 - 2^-52) 2^1023), but
    # 1024 ln 2 rounds to ln(max float) and expm1 returns 1.7976931348622732e308 (2.4e-14 relative low), so in
    # float64 the OverflowError starts at xi = 1025.
    with pytest.raises(OverflowError, match="log_geom_sum"):
        geom_sum(2.0, 1025)
    with pytest.raises(OverflowError, match="log_geom_sum"):
        geom_sum(1.2, 4800)


def test_rho_and_epsilon_stay_finite_through_huge_intermediates() -> None:
    # sigma_1 ~ e^436 with R = 1.2, xi = 4800: rho^1 ~ e^-875 underflows and R^xi ~ e^875 overflows float64, their
    # product is O(1).
    log_s = log_sigma1_for_budget(5.0, DELTA, DELTA_W, 1.2, 4800)
    assert DELTA_W**2 / 2 * math.exp(-2 * log_s) == 0.0  # rho^1 ~ e^-875 underflows float64: only logs work
    eps = epsilon_from_noise(math.exp(log_s), DELTA_W, 1.2, 4800, DELTA)
    assert eps == pytest.approx(5.0, rel=REL)
    # A tiny rho1 of 1e-300 with geom_sum ~ e^875 (overflowing on its own) gives a finite product.
    assert rho_total(1e-300, 1.2, 4800) == pytest.approx(
        math.exp(math.log(1e-300) + log_geom_sum(1.2, 4800)), rel=1e-12
    )
    # A privacy loss beyond float64 is reported as inf (vacuous), not an exception.
    assert rho_total(1.0, 2.0, 4800) == math.inf
    assert epsilon_dp_recal(ALPHA, BETA, L, 1.0, 2.0, 4800, DELTA) == math.inf
    assert rho_step(4800, 1.0, 2.0, DELTA_W) == math.inf


# --- bad inputs ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: sensitivity(0.0, BETA, L), "alpha_max"),
        (lambda: sensitivity(ALPHA, -1.0, L), "beta"),
        (lambda: sensitivity(ALPHA, BETA, math.inf), "L_max"),
        (lambda: sensitivity_per_record(ALPHA, BETA, 1.0, 0), "m_min"),
        (lambda: sensitivity_per_record(ALPHA, BETA, 0.0, 10), "clip"),
        (lambda: sigma_at(0, 1.0, 1.01), "t"),
        (lambda: sigma_at(True, 1.0, 1.01), "t"),
        (lambda: sigma_at(1, -1.0, 1.01), "sigma1"),
        (lambda: sigma_at(1, 1.0, 0.99), "R"),
        (lambda: sigma_at(1, 1.0, math.nan), "R"),
        (lambda: rho_step(1, 1.0, 1.01, -0.1), "Delta"),
        (lambda: geom_sum(1.01, -1), "xi"),
        (lambda: geom_sum(1.01, 2.5), "xi"),  # type: ignore[arg-type]
        (lambda: log_geom_sum(math.inf, 3), "R"),
        (lambda: rho_total(-1.0, 1.01, 3), "rho1"),
        (lambda: eps_from_rho(-1.0, DELTA), "rho"),
        (lambda: eps_from_rho(math.nan, DELTA), "rho"),
        (lambda: eps_from_rho(1.0, 0.0), "delta"),
        (lambda: eps_from_rho(1.0, 1.0), "delta"),
        (lambda: rho_from_eps(-1.0, DELTA), "eps"),
        (lambda: rho_from_eps(math.inf, DELTA), "eps"),
        (lambda: epsilon_dp_recal(ALPHA, BETA, L, 1.0, 1.01, 600, 1.5), "delta"),
        (lambda: epsilon_dp_recal(ALPHA, BETA, L, -1.0, 1.01, 600, DELTA), "sigma1"),
        (lambda: calibrate_sigma1(0.0, DELTA, 1.01, 600, ALPHA, BETA, L), "eps"),
        (lambda: calibrate_sigma1(1.0, DELTA, 0.5, 600, ALPHA, BETA, L), "R"),
        (lambda: calibrate_sigma1(1.0, DELTA, 1.01, -3, ALPHA, BETA, L), "xi"),
        (lambda: noise_floor(1.0, DELTA, 1.0, 1.01, 0), "xi"),
        (lambda: noise_floor(1.0, DELTA, -1.0, 1.01, 5), "Delta"),
        (lambda: lci([]), "tau"),
        (lambda: lci([1, -1]), "tau"),
        (lambda: default_xi_plan(4800, "ring", [0.5, 0.5]), "walk"),
        (lambda: default_xi_plan(4800, "markov", [0.5, 0.6]), "g"),
        (lambda: default_xi_plan(-1, "cyclic", [1.0]), "K"),
    ],
)
def test_bad_inputs_raise_value_error(call: Callable[[], object], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}\b"):
        call()


# --- 4.7: the noise a budget implies -------------------------------------------------------------------------------


def test_noise_floor_statements_of_4_7() -> None:
    mp = _mp()
    # Delta / sqrt(2 rho): eps = 10 -> 1 / sqrt(4.4023943) = 1 / 2.0981883 = 0.47660 (spec: ~0.48 Delta);
    # eps = 1 -> 1 / sqrt(0.0675739) = 1 / 0.2599498 = 3.84690 (spec: ~3.85 Delta).
    floor10 = float(1 / mp.sqrt(2 * _ref_rho_from_eps(mp, 10.0)))
    floor1 = float(1 / mp.sqrt(2 * _ref_rho_from_eps(mp, 1.0)))
    assert floor10 == pytest.approx(0.48, abs=5e-3) and floor1 == pytest.approx(3.85, abs=5e-3)
    # xi = 1 attains the bound exactly (one release, sigma_xi = sigma_1).
    assert noise_floor(10.0, DELTA, 1.0, 1.01, 1) == pytest.approx(floor10, rel=1e-12)
    assert noise_floor(1.0, DELTA, 1.0, 1.3, 1) == pytest.approx(floor1, rel=1e-12)
    # Always >= Delta / sqrt(2 rho_total), whatever R and xi.
    for eps in (0.1, 1.0, 5.0, 10.0):
        bound = DELTA_W / math.sqrt(2.0 * rho_from_eps(eps, DELTA))
        for R in (1.0, 1.0 + 1e-9, 1.001, 1.01, 1.05, 1.2, 2.0, 100.0):
            for xi in (1, 2, 10, 600, 700, 4800):
                assert noise_floor(eps, DELTA, DELTA_W, R, xi) >= bound * (1 - 1e-12)
    # n = 8 (Delta = (2/9) alpha L): 0.2222 * 0.4766 = 0.1059 alpha L at eps 10, 0.2222 * 3.8469 = 0.8549 at eps 1.
    assert noise_floor(10.0, DELTA, 2.0 / 9.0, 1.0, 1) == pytest.approx(0.106, abs=1e-3)
    assert noise_floor(1.0, DELTA, 2.0 / 9.0, 1.0, 1) == pytest.approx(0.855, abs=1e-3)


def test_noise_floor_closed_forms_and_consistency() -> None:
    rho = rho_from_eps(5.0, DELTA)
    # R = 1: Delta^2 xi / (2 rho).
    assert noise_floor(5.0, DELTA, DELTA_W, 1.0, 600) == pytest.approx(DELTA_W * math.sqrt(600 / (2 * rho)), rel=1e-12)
    # Spec formula Delta^2 (R - R^{1-xi}) / (2 rho (R - 1)), evaluated directly where it is representable.
    for R, xi in ((1.01, 700), (1.05, 50), (2.0, 10)):
        direct = DELTA_W * math.sqrt((R - R ** (1 - xi)) / (2 * rho * (R - 1)))
        assert noise_floor(5.0, DELTA, DELTA_W, R, xi) == pytest.approx(direct, rel=1e-12)
        # It is the calibrated schedule's last sigma.
        sigma1 = sigma1_for_budget(5.0, DELTA, DELTA_W, R, xi)
        assert noise_floor(5.0, DELTA, DELTA_W, R, xi) == pytest.approx(sigma_at(xi, sigma1, R), rel=1e-10)
    # Large-xi limit Delta^2 R / (2 rho (R - 1)).
    assert noise_floor(5.0, DELTA, DELTA_W, 1.05, 4800) == pytest.approx(
        DELTA_W * math.sqrt(1.05 / (2 * rho * 0.05)), rel=1e-12
    )


def test_last_activation_noise_factor_and_first_activation_sigma_of_4_7() -> None:
    # Factor sqrt((R - R^{1-xi}) / (R - 1)) at xi = 700: R = 1.01 -> sqrt((1.01 - 1.01^-699)/0.01)
    # = sqrt((1.01 - 0.000951)/0.01) = sqrt(100.905) = 10.045 (spec ~10x); R = 1.001 -> sqrt((1.001 - 0.4973)/0.001)
    # = sqrt(503.7) = 22.44 (spec ~22x).
    for R, factor in ((1.01, 10.045), (1.001, 22.444)):
        ratio = noise_floor(10.0, DELTA, 1.0, R, 700) / noise_floor(10.0, DELTA, 1.0, R, 1)
        assert ratio == pytest.approx(factor, rel=1e-4)
    # sigma_1 at xi = 700 with the worked Delta = 2/9: ~1e7-1e8 at R = 1.05, ~1e104-1e105 at R = 2 (spec: "~1e7",
    # "~1e104"; those are orders of magnitude: eps = 10 gives 1.24e7 and 2.43e104, eps = 1 gives 9.97e7, 1.96e105).
    for eps in (1.0, 10.0):
        assert 1e7 < calibrate_sigma1(eps, DELTA, 1.05, 700, ALPHA, BETA, L) < 1e8
        assert 1e104 < calibrate_sigma1(eps, DELTA, 2.0, 700, ALPHA, BETA, L) < 1e106


# --- 8 A3: labelled per-record sensitivity -------------------------------------------------------------------------


def test_sensitivity_per_record() -> None:
    # 4 * 0.1 * (1/18) * 1.0 / 7500 = 0.4 / 135000 = 2.96296e-6.
    assert sensitivity_per_record(ALPHA, BETA, 1.0, 7500) == pytest.approx(0.4 / 135000, rel=1e-14)
    # Same formula as Lemma 4 with L replaced by G / m_min: the paper's Delta scaled by G / (L m_min).
    assert sensitivity_per_record(ALPHA, BETA, 2.0, 50) == pytest.approx(sensitivity(ALPHA, BETA, 2.0 / 50), rel=1e-14)
    # Plugs into the generic calibration: Delta / 7500 needs sigma_1 / 7500.
    s_paper = sigma1_for_budget(5.0, DELTA, DELTA_W, 1.01, 700)
    s_rec = sigma1_for_budget(5.0, DELTA, DELTA_W / 7500, 1.01, 700)
    assert s_rec == pytest.approx(s_paper / 7500, rel=1e-12)


# --- LCI and xi_plan (spec 1.5, 4.5, 9.3) --------------------------------------------------------------------------


def test_lci_and_default_xi_plan() -> None:
    seq = [0, 1, 0, 2, 0, 1]
    tau = [seq.count(i) for i in range(4)]
    assert tau == [3, 2, 1, 0] and lci(tau) == 3
    assert lci(np.array([600] * 8)) == 600  # type: ignore[arg-type]
    ring8 = [1.0 / 8] * 8
    assert default_xi_plan(4800, "cyclic", ring8) == 600  # ceil(4800/8)
    assert default_xi_plan(4801, "cyclic", ring8) == 601
    assert default_xi_plan(4800, "markov", ring8) == 690  # ceil(1.15 * 4800 / 8) = ceil(690.0)
    assert default_xi_plan(4800, "iid", [0.5, 1 / 6, 1 / 6, 1 / 6]) == 2760  # star-4: ceil(1.15 * 2400)
    assert default_xi_plan(10, "markov", [1.0]) == 10  # capped at K


# --- the per-agent ledger ------------------------------------------------------------------------------------------


def test_ledger_follows_the_schedule_and_theorem3() -> None:
    sigma1 = calibrate_sigma1(5.0, DELTA, 1.01, 40, ALPHA, BETA, L)
    ledger = ActivationLedger(sensitivity(ALPHA, BETA, L))
    assert ledger.tau == 0 and ledger.rho == 0.0 and ledger.epsilon(DELTA) == 0.0 and ledger.rdp_epsilon(DELTA) == 0.0
    drawn = [ledger.activate(sigma1, 1.01) for _ in range(40)]
    assert drawn == [sigma_at(t, sigma1, 1.01) for t in range(1, 41)]
    assert ledger.tau == len(ledger) == 40
    assert ledger.rho == pytest.approx(rho_total(rho_step(1, sigma1, 1.01, DELTA_W), 1.01, 40), rel=1e-12)
    assert ledger.epsilon(DELTA) == pytest.approx(5.0, rel=REL)
    assert ledger.next_sigma(sigma1, 1.01) == sigma_at(41, sigma1, 1.01)
    assert ledger.record(0.0) == math.inf  # a noiseless release ends the guarantee
    assert ledger.epsilon(DELTA) == math.inf and ledger.rdp_epsilon(DELTA) == math.inf


def test_ledger_round_trip_through_a_record() -> None:
    ledger = ActivationLedger(DELTA_W)
    for _ in range(5):
        ledger.activate(math.exp(436.0), 1.2)  # huge sigmas (a calibrated R = 1.2 plan) survive the record
    ledger.record(0.7)
    record = ledger.to_record()
    assert set(record) == {"sensitivity", "tau", "rho", "sigmas"}
    assert isinstance(record["tau"], int) and record["tau"] == 6
    assert isinstance(record["sigmas"], list) and all(isinstance(s, float) for s in record["sigmas"])
    back = ActivationLedger.from_record(record)
    assert back == ledger and back.rho == ledger.rho and back.epsilon(DELTA) == ledger.epsilon(DELTA)
    # Through Flower's ConfigRecord, the type that lives in context.state.
    flwr_common = pytest.importorskip("flwr.common")
    stored = flwr_common.ConfigRecord(record)
    assert ActivationLedger.from_record(dict(stored)) == ledger


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda r: r.pop("sigmas"), ValueError, "missing key 'sigmas'"),
        (lambda r: r.update(tau=3), ValueError, "tau"),
        (lambda r: r.update(rho=1.0), ValueError, "rho"),
        (lambda r: r.update(tau=2.0), TypeError, "tau"),
        (lambda r: r.update(sigmas="1.0"), TypeError, "sigmas"),
        (lambda r: r.update(sensitivity=True), TypeError, "sensitivity"),
        (lambda r: r.update(sensitivity=-1.0), ValueError, "sensitivity"),
        (lambda r: r.update(sigmas=[1.0, -2.0], rho=0.0), ValueError, "sigma"),
    ],
)
def test_ledger_rejects_bad_records(mutate: Callable[[dict[str, Any]], object], error: type, match: str) -> None:
    ledger = ActivationLedger(DELTA_W, [1.0, 2.0])
    record: dict[str, Any] = dict(ledger.to_record())
    mutate(record)
    with pytest.raises(error, match=match):
        ActivationLedger.from_record(record)


# --- cross-check of Prop. 4 against an independent accountant (Opacus RDP) ----------------------------------------


def _opacus_epsilon(noise_multipliers: list[float], delta: float, orders: list[float]) -> tuple[float, float]:
    # Compose the per-activation Gaussians (sample rate q = 1) with Opacus's own RDP of the Gaussian mechanism.
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    rdp = np.zeros(len(orders))
    for z in noise_multipliers:
        rdp += np.asarray(compute_rdp(q=1.0, noise_multiplier=z, steps=1, orders=orders), dtype=np.float64)
    eps, best = get_privacy_spent(orders=orders, rdp=list(rdp), delta=delta)
    return float(eps), float(best)


@pytest.mark.parametrize(
    ("eps", "R", "xi", "max_ratio"),
    [
        # Measured Theorem-3 / RDP ratios: 2.08 (eps 0.1), 1.39 (1), 1.18 (5), 1.12 (10); Prop. 4 is loosest at
        # small eps, where the RDP conversion's -log(a)/(a-1) + log((a-1)/a) correction is relatively largest.
        (0.1, 1.0, 60, 2.2),
        (1.0, 1.01, 60, 1.5),
        (5.0, 1.05, 30, 1.25),
        (10.0, 1.2, 20, 1.2),
    ],
)
def test_theorem3_epsilon_vs_opacus_rdp(eps: float, R: float, xi: int, max_ratio: float) -> None:
    sigma1 = calibrate_sigma1(eps, DELTA, R, xi, ALPHA, BETA, L)
    ledger = ActivationLedger(DELTA_W)
    for _ in range(xi):
        ledger.activate(sigma1, R)
    # Dense order grid so that the grid's optimum is the RDP optimum (best order stays well inside it).
    orders = list(np.geomspace(1.001, 1e4, 400))
    eps_rdp, best = _opacus_epsilon([s / DELTA_W for s in ledger.sigmas], DELTA, orders)
    assert orders[0] < best < orders[-1]
    # RDP of the composition is a * rho (q = 1 Gaussians are rho-zCDP with equality): Opacus agrees with our rho.
    from opacus.accountants.analysis.rdp import compute_rdp

    rdp_sum = sum(
        np.asarray(compute_rdp(q=1.0, noise_multiplier=s / DELTA_W, steps=1, orders=orders)) for s in ledger.sigmas
    )
    np.testing.assert_allclose(rdp_sum, np.asarray(orders) * ledger.rho, rtol=1e-10)
    eps_thm3 = epsilon_dp_recal(ALPHA, BETA, L, sigma1, R, xi, DELTA)
    assert eps_thm3 == pytest.approx(eps, rel=REL)
    assert eps_rdp < eps_thm3 <= max_ratio * eps_rdp
    # The ledger's own RDP conversion gives the same number (its grid is finer).
    assert ledger.rdp_epsilon(DELTA) == pytest.approx(eps_rdp, rel=1e-3)
    assert ledger.rdp_epsilon(DELTA) <= eps_thm3


def test_prop4_is_the_classic_rdp_conversion_at_the_best_order() -> None:
    # Mironov's conversion eps = a rho + ln(1/delta)/(a-1) is minimised at a = 1 + sqrt(ln(1/delta)/rho), where it
    # equals rho + 2 sqrt(rho ln(1/delta)) = Prop. 4. So Prop. 4 loses only the Balle et al. (2020) refinement.
    for rho in (1e-3, 0.0337869, 2.2, 964.4):
        a_star = 1 + math.sqrt(math.log(1 / DELTA) / rho)
        classic = a_star * rho + math.log(1 / DELTA) / (a_star - 1)
        assert classic == pytest.approx(eps_from_rho(rho, DELTA), rel=1e-12)


def test_theorem3_vs_exact_gaussian_privacy_profile() -> None:
    # The tightest (eps, delta) of a composition of Gaussians with zCDP rho is that of one Gaussian with
    # mu = sqrt(2 rho) (Balle & Wang 2018, Thm. 8): delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu).
    special = pytest.importorskip("scipy.special")
    optimize = pytest.importorskip("scipy.optimize")

    def exact_eps(rho: float) -> float:
        mu = math.sqrt(2 * rho)

        def gap(e: float) -> float:
            a = float(special.log_ndtr(mu / 2 - e / mu))
            b = e + float(special.log_ndtr(-mu / 2 - e / mu))
            return a + math.log1p(-math.exp(b - a)) - math.log(DELTA)

        return float(optimize.brentq(gap, 1e-9, 1e4, xtol=1e-12))

    # Measured Theorem-3 / exact ratios at delta = 1e-3: 1.61 at eps 1, 1.32 at 5, 1.24 at 10.
    for eps, lo, hi in ((1.0, 1.55, 1.65), (5.0, 1.28, 1.36), (10.0, 1.2, 1.28)):
        ratio = eps / exact_eps(rho_from_eps(eps, DELTA))
        assert lo < ratio < hi
