"""Tests of the DP formulas (spec 4.6, 10.6, 10.7) and the per-client privacy ledger."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest

from fedpdm_flower.fedapp.privacy import (
    PrivacyLedger,
    add_gaussian_noise,
    data_fraction,
    fedpdm_sensitivity,
    gaussian_noise_std,
    local_sgd_sensitivity,
    per_round_epsilon_eq36,
    total_privacy_eq36,
)

REL = 1e-9


# --- spec 4.6 test vectors (spec 10.6) -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("eta", "rho", "steps", "clip", "expected"),
    [
        (0.04, 10.0, 10, 1.0, 0.39758135296),  # MNIST, t = 0
        (0.2, 10.0, 5, 1.0, 4.0),  # rho*eta = 2: the a = 1 branch, 4*eta*Q*G
        (0.25, 10.0, 3, 1.0, 4.75),  # a = 1.5 > 1
        (0.04 / math.sqrt(200), 10.0, 10, 1.0, 0.09977122336),  # MNIST, t = 199
        (0.01, 10.0, 10, 1.0, 0.26052862396),  # Adult, t = 0
    ],
)
def test_fedpdm_sensitivity_vectors(eta: float, rho: float, steps: int, clip: float, expected: float) -> None:
    assert fedpdm_sensitivity(eta, rho, steps, clip) == pytest.approx(expected, rel=REL)


def _reference_sensitivity(eta: float, rho: float, q: int, g: float) -> float:
    # Verbatim from spec 4.6.
    a = abs(1.0 - rho * eta)
    if math.isclose(a, 1.0, rel_tol=0.0, abs_tol=1e-12):
        return 4.0 * eta * q * g
    return 4.0 * eta * g * (1.0 - a**q) / (1.0 - a)


@pytest.mark.parametrize("eta", [0.001, 0.01, 0.04, 0.1, 0.2, 0.25, 0.3])
@pytest.mark.parametrize("steps", [1, 2, 10, 59])
def test_fedpdm_sensitivity_matches_reference_bitwise(eta: float, steps: int) -> None:
    assert fedpdm_sensitivity(eta, 10.0, steps, 0.7) == _reference_sensitivity(eta, 10.0, steps, 0.7)


def test_rho_eta_two_branch_is_linear_in_steps() -> None:
    assert fedpdm_sensitivity(0.2, 10.0, 7, 1.0) == pytest.approx(4.0 * 0.2 * 7, rel=REL)
    # Just inside the 1e-12 tolerance still takes the linear branch.
    assert fedpdm_sensitivity(0.2 + 1e-14, 10.0, 7, 1.0) == pytest.approx(4.0 * (0.2 + 1e-14) * 7, rel=REL)


def test_sensitivity_never_exceeds_4g_over_rho_when_contracting() -> None:
    for steps in (1, 10, 100, 1000):
        assert fedpdm_sensitivity(0.04, 10.0, steps, 1.0) <= 4.0 / 10.0


def test_local_sgd_sensitivity_without_contraction_is_2_eta_q_g() -> None:
    # Spec 6.4: baselines that upload x itself.
    assert local_sgd_sensitivity(0.04, 10, 1.0) == pytest.approx(2 * 0.04 * 10 * 1.0, rel=REL)
    assert local_sgd_sensitivity(0.04, 10, 1.0, contraction=10.0) * 2 == fedpdm_sensitivity(0.04, 10.0, 10, 1.0)


def test_noise_std_vector() -> None:
    assert gaussian_noise_std(0.39758135296, 1.0, 1e-4) == pytest.approx(1.7269392565, rel=REL)
    assert math.sqrt(2.0 * math.log(1.25 / 1e-4)) == pytest.approx(4.34361230, rel=1e-8)


def test_per_round_epsilon_vectors() -> None:
    assert per_round_epsilon_eq36(20.0, 1.0, 1 / 6, 0.3, 200) == pytest.approx(84.852813742, rel=REL)
    q_adult = data_fraction(10, 10, 325)
    assert q_adult == pytest.approx(10 / 32.5, rel=REL)
    assert per_round_epsilon_eq36(0.5, 1.0, q_adult, 0.3, 200) == pytest.approx(0.56729725178, rel=REL)


@pytest.mark.parametrize("q_power", [1.0, 2.0, 3.5])
@pytest.mark.parametrize("eps_total", [0.1, 0.5, 20.0, 1e4])
def test_eq36_round_trip(eps_total: float, q_power: float) -> None:
    eps = per_round_epsilon_eq36(eps_total, 1.3, 0.2, 0.3, 200, q_power=q_power)
    assert total_privacy_eq36(eps, 1.3, 0.2, 0.3, 200, q_power=q_power) == pytest.approx(eps_total, rel=1e-12)


def test_eq36_is_linear_in_epsilon() -> None:
    # Theorem 2: the total loss grows linearly with the per-round epsilon.
    one = total_privacy_eq36(1.0, 1.0, 0.1, 0.3, 200)
    assert total_privacy_eq36(3.0, 1.0, 0.1, 0.3, 200) == pytest.approx(3 * one, rel=1e-12)


def test_worked_noise_levels_table() -> None:
    # Spec 4.6 worked table, t = 0, G = c0 = 1, delta = 1e-4.
    def sigma(eps_total: float, eta: float, q_steps: int, n_local: int) -> float:
        q = data_fraction(q_steps, 10, n_local)
        eps = per_round_epsilon_eq36(eps_total, 1.0, q, 0.3, 200)
        return gaussian_noise_std(fedpdm_sensitivity(eta, 10.0, q_steps, 1.0), eps, 1e-4)

    assert sigma(20.0, 0.04, 10, 600) == pytest.approx(0.0204, rel=5e-3)
    assert sigma(20.0, 0.04, 59, 600) == pytest.approx(5.04, rel=5e-3)
    assert sigma(0.5, 0.01, 10, 325) == pytest.approx(1.99, rel=5e-3)
    assert sigma(0.5, 0.01, 32, 325) == pytest.approx(203, rel=5e-3)


def test_data_fraction_bounds() -> None:
    assert data_fraction(10, 10, 600) == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match="q"):
        data_fraction(60, 10, 600)  # q = 1
    with pytest.raises(ValueError, match="steps"):
        data_fraction(0, 10, 600)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: gaussian_noise_std(1.0, 0.0, 1e-4), "epsilon"),
        (lambda: gaussian_noise_std(1.0, -1.0, 1e-4), "epsilon"),
        (lambda: gaussian_noise_std(1.0, 1.0, 0.0), "delta"),
        (lambda: gaussian_noise_std(1.0, 1.0, 1.0), "delta"),
        (lambda: gaussian_noise_std(-1.0, 1.0, 1e-4), "sensitivity"),
        (lambda: fedpdm_sensitivity(0.0, 10.0, 1, 1.0), "eta"),
        (lambda: fedpdm_sensitivity(0.1, 0.0, 1, 1.0), "rho"),
        (lambda: fedpdm_sensitivity(0.1, 10.0, 0, 1.0), "steps"),
        (lambda: fedpdm_sensitivity(0.1, 10.0, 1, 0.0), "clip"),
        (lambda: local_sgd_sensitivity(0.1, 1, 1.0, contraction=-1.0), "contraction"),
        (lambda: per_round_epsilon_eq36(0.0, 1.0, 0.1, 0.3, 200), "eps_total"),
        (lambda: per_round_epsilon_eq36(1.0, 0.0, 0.1, 0.3, 200), "c0"),
        (lambda: per_round_epsilon_eq36(1.0, 1.0, 1.0, 0.3, 200), "q"),
        (lambda: per_round_epsilon_eq36(1.0, 1.0, 0.1, 1.5, 200), "p"),
        (lambda: per_round_epsilon_eq36(1.0, 1.0, 0.1, 0.3, 0), "rounds"),
        (lambda: total_privacy_eq36(-1.0, 1.0, 0.1, 0.3, 200), "eps_round"),
        (lambda: add_gaussian_noise(np.zeros(3), -1.0, np.random.default_rng(0)), "std"),
    ],
)
def test_invalid_inputs_name_the_argument(call: Callable[[], object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()


# --- noise (spec 10.7) -----------------------------------------------------------------------------------------


def test_noise_std_empirical() -> None:
    sigma = 1.7269392565
    noisy = add_gaussian_noise(np.zeros(100_000), sigma, np.random.default_rng(12345))
    assert abs(float(np.std(noisy)) / sigma - 1.0) < 0.01
    assert abs(float(np.mean(noisy))) < 0.05 * sigma


def test_zero_std_adds_nothing_and_draws_nothing() -> None:
    y = np.random.default_rng(1).normal(size=50)
    rng = np.random.default_rng(7)
    out = add_gaussian_noise(y, 0.0, rng)
    assert np.array_equal(out, y)
    assert out is not y
    # The generator was not advanced.
    assert rng.normal() == np.random.default_rng(7).normal()


def test_noise_does_not_modify_input_and_is_seeded() -> None:
    y = np.arange(5, dtype=np.float32)
    a = add_gaussian_noise(y, 0.3, np.random.default_rng(3))
    b = add_gaussian_noise(y, 0.3, np.random.default_rng(3))
    assert np.array_equal(y, np.arange(5, dtype=np.float32))
    assert a.dtype == np.float64
    assert np.array_equal(a, b)


# --- PrivacyLedger -----------------------------------------------------------------------------------------------


def test_ledger_empty() -> None:
    ledger = PrivacyLedger(delta=1e-4)
    assert len(ledger) == 0
    assert ledger.basic_composition() == (0.0, 0.0)
    assert ledger.rdp_epsilon() == 0.0


def test_ledger_basic_composition_by_hand() -> None:
    ledger = PrivacyLedger(delta=1e-4)
    for eps, z in [(0.5, 2.0), (0.25, 3.0), (1.5, 1.0)]:
        ledger.record(eps, z)
    eps_total, delta_total = ledger.basic_composition()
    assert eps_total == pytest.approx(2.25, rel=1e-12)
    assert delta_total == pytest.approx(3e-4, rel=1e-12)


def test_ledger_rdp_decreases_with_noise_multiplier() -> None:
    eps = []
    for z in (0.8, 1.0, 2.0, 5.0, 20.0):
        ledger = PrivacyLedger(delta=1e-5)
        for _ in range(10):
            ledger.record(1.0, z)
        eps.append(ledger.rdp_epsilon())
    assert all(a > b for a, b in itertools.pairwise(eps))


def test_ledger_rdp_matches_opacus_accountant() -> None:
    from opacus.accountants import RDPAccountant

    z, n, delta = 1.3, 17, 1e-5
    ledger = PrivacyLedger(delta=1e-4)
    for _ in range(n):
        ledger.record(2.0, z)
    accountant = RDPAccountant()
    accountant.history = [(z, 1.0, n)]
    assert ledger.rdp_epsilon(delta) == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)


def test_ledger_rdp_mixed_multipliers_match_opacus() -> None:
    from opacus.accountants import RDPAccountant

    ledger = PrivacyLedger(delta=1e-5)
    for z in (2.0, 3.0, 2.0, 4.0):
        ledger.record(1.0, z)
    accountant = RDPAccountant()
    accountant.history = [(2.0, 1.0, 2), (3.0, 1.0, 1), (4.0, 1.0, 1)]
    assert ledger.rdp_epsilon() == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)


def test_ledger_zero_multiplier_is_infinite() -> None:
    ledger = PrivacyLedger(delta=1e-4)
    ledger.record(1.0, 2.0)
    ledger.record(math.inf, 0.0)
    assert ledger.rdp_epsilon() == math.inf


def test_classic_calibration_is_conservative_under_rdp() -> None:
    eps, delta = 0.5, 1e-5
    z = math.sqrt(2.0 * math.log(1.25 / delta)) / eps
    ledger = PrivacyLedger(delta=delta)
    ledger.record(eps, z)
    rdp_eps = ledger.rdp_epsilon()
    assert 0.0 < rdp_eps <= eps


def test_ledger_record_round_trip() -> None:
    ledger = PrivacyLedger(delta=1e-4)
    ledger.record(84.85, 0.05)
    ledger.record(0.567, 7.6)
    record = ledger.to_record()
    assert all(isinstance(v, (float, list)) for v in record.values())
    back = PrivacyLedger.from_record(record)
    assert back == ledger
    assert back.rdp_epsilon() == ledger.rdp_epsilon()
    # The record is a snapshot: later records do not leak into it.
    ledger.record(1.0, 1.0)
    assert len(PrivacyLedger.from_record(record)) == 2


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"eps_rounds": [], "noise_multipliers": []}, "delta"),
        ({"delta": 1e-4, "eps_rounds": [1.0], "noise_multipliers": []}, "equal length"),
        ({"delta": 2.0, "eps_rounds": [], "noise_multipliers": []}, "delta"),
    ],
)
def test_ledger_from_bad_record(record: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PrivacyLedger.from_record(record)


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"delta": "1e-4", "eps_rounds": [], "noise_multipliers": []}, "delta"),
        ({"delta": 1e-4, "eps_rounds": "x", "noise_multipliers": []}, "eps_rounds"),
        ({"delta": 1e-4, "eps_rounds": [], "noise_multipliers": [None]}, "noise_multipliers"),
    ],
)
def test_ledger_from_mistyped_record(record: dict[str, object], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        PrivacyLedger.from_record(record)


def test_ledger_record_validation() -> None:
    ledger = PrivacyLedger(delta=1e-4)
    with pytest.raises(ValueError, match="eps_round"):
        ledger.record(0.0, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        ledger.record(1.0, -1.0)
    with pytest.raises(ValueError, match="delta"):
        ledger.rdp_epsilon(0.0)
