"""Calibration to a target (epsilon, delta) by Gaussian DP, checked with two independent libraries.

Google's dp-accounting (PLD, numerical composition) must find the calibrated noise spends the target epsilon; Opacus's
RDP accountant, a looser bound, must find at least that. The GDP curve itself is checked against the hockey-stick
integral in tests/test_privacy_protocol.py.
"""

from __future__ import annotations

import math

import pytest

from fedpdm_flower.fedapp.privacy import gdp


@pytest.mark.parametrize("epsilon", [1.0, 3.0, 8.0])
@pytest.mark.parametrize("releases", [1, 30, 200])
def test_the_calibrated_noise_spends_the_target_under_dp_accountings_pld(epsilon: float, releases: int) -> None:
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    z = gdp.noise_multiplier_for(epsilon, 1e-5, releases)
    pld = PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_event.GaussianDpEvent(z), releases)
    assert pld.get_epsilon(1e-5) == pytest.approx(epsilon, rel=2e-4)  # PLD's discretization: a slight upper bound
    assert pld.get_epsilon(1e-5) >= epsilon * (1 - 1e-9)


@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_opacus_rdp_bounds_the_same_noise_from_above(epsilon: float) -> None:
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    z = gdp.noise_multiplier_for(epsilon, 1e-5, 30)
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 256))
    rdp = compute_rdp(q=1.0, noise_multiplier=z, steps=30, orders=orders)
    eps_rdp, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert epsilon < eps_rdp < 1.3 * epsilon  # RDP's conversion is loose, by about 10-20 % here


def test_the_curve_is_monotone_and_inverts() -> None:
    mu = gdp.mu_for(3.0, 1e-5)
    assert gdp.delta_for(3.0, mu) == pytest.approx(1e-5, rel=1e-8)
    assert gdp.epsilon_for(1e-5, mu) == pytest.approx(3.0, rel=1e-8)
    assert gdp.delta_for(3.0, 0.9 * mu) < 1e-5 < gdp.delta_for(3.0, 1.1 * mu)
    assert gdp.epsilon_for(1e-5, 0.0) == 0.0 and gdp.delta_for(2.0, 0.0) == 0.0
    # composition: T releases at z are one release at z / sqrt(T)
    assert gdp.mu_of(30 / 3.0**2) == pytest.approx(math.sqrt(30) / 3.0)
    for bad in (lambda: gdp.mu_for(0.0, 1e-5), lambda: gdp.mu_for(1.0, 1.0), lambda: gdp.noise_multiplier_for(1, 1e-5, 0),
                lambda: gdp.delta_for(-1.0, 1.0), lambda: gdp.mu_of(float("nan"))):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("epsilon", [0.1, 1.0, 8.0, 50.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-100, 1e-300, 1e-310, 1e-320])
def test_the_calibration_holds_for_any_delta_a_float_holds(epsilon: float, delta: float) -> None:
    # the curve evaluated at 60 digits by mpmath (independent of scipy): the calibrated mu spends delta to 1e-6.
    # Before the curve moved to log space, delta = 1e-320 at epsilon 8 gave a mu whose delta was 3.3e-313
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 60
    mu = gdp.mu_for(epsilon, delta)
    e, m = mp.mpf(epsilon), mp.mpf(mu)
    exact = mp.ncdf(-e / m + m / 2) - mp.exp(e) * mp.ncdf(-e / m - m / 2)
    assert float(exact / mp.mpf(delta)) == pytest.approx(1.0, abs=1e-6)
    assert gdp.epsilon_for(delta, mu) == pytest.approx(epsilon, rel=1e-9)
