"""Our accountants behind Flower's privacy-accounting protocol (flwr.supercore.privacy_accounting, 1.42).

Independent truth: the exact privacy curve of one Gaussian release integrated numerically from the two output
densities; Google's dp-accounting PLD (numerical composition) against the closed-form GDP composition; the
papers' formulas evaluated by hand; Flower's own DP wrapper and RDP accountant.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from scipy import integrate, stats
from userapp import initial, user_app

from fedpdm_flower.fedapp.privacy.accountants import PrivacyLedger
from fedpdm_flower.fedapp.privacy.gaussian import total_privacy_eq36
from fedpdm_flower.fedapp.privacy.protocol import (
    BasicCompositionAccountant,
    Eq36Accountant,
    GdpAccountant,
    PldAccountant,
    ZcdpAccountant,
    no_amplification,
    rdp_accountant,
)
from fedpdm_flower.fedapp.privacy.zcdp import eps_from_rho
from simulations.inprocess import LocalGrid

POP = 10
CONFIG = no_amplification(1e-5, POP)


def event(z: float, k: int = 1) -> GaussianPrivacyEvent:
    return GaussianPrivacyEvent(noise_multiplier=z, sample_size=k, population_size=POP)


def exact_delta(z: float, eps: float) -> float:
    """delta(eps) of one Gaussian release, sensitivity 1, noise z: integral of max(0, p - e^eps q) (Dwork & Roth,
    the hockey-stick divergence), p = N(1, z^2), q = N(0, z^2), by quadrature -- no closed form involved."""
    p, q = stats.norm(1.0, z), stats.norm(0.0, z)
    # the integrand is positive right of the crossing p = e^eps q, at x* = z^2 eps + 1/2
    x0 = z * z * eps + 0.5
    value, _ = integrate.quad(lambda x: p.pdf(x) - math.exp(eps) * q.pdf(x), x0, x0 + 40 * z, epsabs=1e-14)
    return float(value)


@pytest.mark.parametrize(("z", "eps"), [(1.0, 0.5), (2.0, 0.1), (0.7, 3.0), (5.0, 0.05)])
def test_gdp_is_the_exact_curve_of_one_gaussian_release(z: float, eps: float) -> None:
    g = GdpAccountant(CONFIG)
    g.compose(event(z))
    assert g.get_delta(eps) == pytest.approx(exact_delta(z, eps), rel=1e-7, abs=1e-15)


@pytest.mark.parametrize(("z", "n"), [(1.0, 5), (0.8, 30), (4.0, 100)])
def test_gdp_composition_equals_dp_accountings_numerical_pld(z: float, n: int) -> None:
    g, p = GdpAccountant(CONFIG), PldAccountant(CONFIG)
    for acc in (g, p):
        acc.compose(event(z), n)
    assert g.get_epsilon(1e-5) == pytest.approx(p.get_epsilon(1e-5), rel=1e-6)
    # n releases at z are one release at z / sqrt(n), exactly
    one = GdpAccountant(CONFIG)
    one.compose(event(z / math.sqrt(n)))
    assert one.get_epsilon(1e-5) == pytest.approx(g.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize(("z", "n"), [(1.0, 5), (2.0, 50), (0.6, 3)])
def test_every_rigorous_bound_sits_above_the_exact_one(z: float, n: int) -> None:
    accs: dict[str, Any] = {"gdp": GdpAccountant(CONFIG), "pld": PldAccountant(CONFIG), "zcdp": ZcdpAccountant(CONFIG),
                            "rdp": rdp_accountant(CONFIG)}
    for acc in accs.values():
        acc.compose(event(z), n)
    eps = {k: a.get_epsilon(1e-5) for k, a in accs.items()}
    assert eps["gdp"] <= eps["pld"] * (1 + 1e-6)
    assert eps["pld"] < eps["rdp"] < eps["zcdp"]
    # zCDP is the project's named accountant of DP-IADMM / DP-RECAL: the same figure as fedpdm_flower.fedapp.privacy.zcdp
    assert eps["zcdp"] == pytest.approx(eps_from_rho(n / (2 * z * z), 1e-5), rel=1e-12)


def test_basic_composition_is_the_papers_formula() -> None:
    acc = BasicCompositionAccountant(CONFIG, release_delta=1e-6)
    zs = [3.0, 5.0, 5.0, 8.0]
    for z in zs:
        acc.compose(event(z))
    by_hand = [math.sqrt(2 * math.log(1.25 / 1e-6)) / z for z in zs]  # Dwork & Roth Thm. A.1 solved for eps
    spent = acc.get_privacy_spent()
    assert spent.epsilon == pytest.approx(sum(by_hand), rel=1e-12) and spent.delta == pytest.approx(4e-6)
    ledger = PrivacyLedger(delta=1e-6, eps_rounds=by_hand, noise_multipliers=zs)
    assert ledger.basic_composition() == pytest.approx((spent.epsilon, spent.delta))
    assert not acc.valid  # z = 3 gives eps_t = 1.77 > 1, where Thm. A.1 does not hold
    assert acc.get_epsilon(1e-6) == math.inf  # the formula says nothing below the delta it spent


def test_eq36_is_dp_fedpdms_theorem_2() -> None:
    acc = Eq36Accountant(CONFIG, data_fraction=0.2, c0=1.0)
    acc.compose(event(4.0, k=3), 7)
    eps_t = math.sqrt(2 * math.log(1.25 / 1e-5)) / 4.0
    assert acc.get_epsilon(1e-5) == pytest.approx(total_privacy_eq36(eps_t, 1.0, 0.2, 3 / POP, 7), rel=1e-12)
    assert acc.get_epsilon(1e-5) == pytest.approx(0.2**2 * eps_t * math.sqrt(3 / POP * 7 / 0.8), rel=1e-12)
    with pytest.raises(ValueError, match="identical"):
        acc.compose(event(2.0, k=3))


def test_the_protocols_bookkeeping() -> None:
    acc = GdpAccountant(no_amplification(1e-5, POP, max_epsilon=8.0))
    acc.compose(event(1.0), 2)
    before = acc.get_epsilon(1e-5)
    assert acc.would_exceed(event(1.0), count=3) and not acc.would_exceed(event(50.0))
    assert acc.num_releases == 2 and acc.get_epsilon(1e-5) == before  # would_exceed changed nothing
    again = GdpAccountant(no_amplification(1e-5, POP, max_epsilon=8.0))
    again.load_state_dict(acc.state_dict())
    assert again.get_epsilon(1e-5) == before and again.num_releases == 2
    with pytest.raises(ValueError, match="configuration"):
        GdpAccountant(CONFIG).load_state_dict(acc.state_dict())
    with pytest.raises(ValueError, match="gdp"):
        ZcdpAccountant(no_amplification(1e-5, POP, max_epsilon=8.0)).load_state_dict(acc.state_dict())
    with pytest.raises(ValueError, match="population_size"):
        acc.compose(GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=1, population_size=POP + 1))
    poisson = PrivacyConfig(target_delta=1e-5, population_size=POP, neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                            sampling_method=SamplingMethod.POISSON)
    for cls in (GdpAccountant, ZcdpAccountant, BasicCompositionAccountant):
        with pytest.raises(ValueError, match="sampling_method"):
            cls(poisson)
    # PLD covers Poisson sampling, and is tighter than Flower's RDP there too
    pld, rdp = PldAccountant(poisson), rdp_accountant(poisson)
    for a in (pld, rdp):
        a.compose(event(1.0, k=2), 50)
    assert 0 < pld.get_epsilon(1e-5) < rdp.get_epsilon(1e-5)


def test_our_accountant_runs_flowers_dp_wrapper_to_its_budget() -> None:
    """Flower's DifferentialPrivacyServerSideFixedClipping around its FedAvg, accountant=GdpAccountant: the run
    stops with PrivacyBudgetExhausted before the release that would pass max_epsilon, not after it."""
    z, nodes = 2.0, 4
    # the budget lies between the exact epsilon of 5 and of 6 releases (dp-accounting's PLD, an independent code)
    eps_n = []
    for n in (5, 6):
        p = PldAccountant(no_amplification(1e-5, nodes))
        p.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=nodes, population_size=nodes), n)
        eps_n.append(p.get_epsilon(1e-5))
    budget = float(np.mean(eps_n))
    acc = GdpAccountant(no_amplification(1e-5, nodes, max_epsilon=budget))
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes),
        noise_multiplier=z, clipping_norm=10.0, num_sampled_clients=nodes, accountant=acc)
    with pytest.raises(PrivacyBudgetExhausted, match="max_epsilon"):
        strategy.start(grid=LocalGrid(user_app(), nodes), initial_arrays=initial(), num_rounds=10)
    assert acc.num_releases == 5
    assert strategy.privacy_spent().epsilon == pytest.approx(eps_n[0], rel=1e-6) and eps_n[0] <= budget


def test_dp_fedpdm_accounts_each_client_on_the_server_and_stops_before_the_budget() -> None:
    """A user's CNN under DP-FedPDM: the server's per-client GDP accountants mirror the devices' own ledgers, and
    the run stops with PrivacyBudgetExhausted before the release that would pass max_epsilon -- no device has
    released it."""
    import torch
    from flwr.app import ArrayRecord, Context
    from test_public_api import TinyCNN, images
    from torch import nn
    from torch.utils.data import DataLoader

    from fedpdm_flower.clients.broadcast import LEDGER
    from fedpdm_flower.clients.fedpdm import FedPDMClient
    from fedpdm_flower.fedapp.privacy import Eq36Calibration
    from fedpdm_flower.strategies.fedpdm import DPFedPDM
    from simulations.inprocess import run_clients

    nodes, calib = 3, Eq36Calibration(epsilon=40.0, delta=1e-5, horizon=10)

    def run(accountant: Any, rounds: int) -> tuple[Any, dict[int, Context]]:
        torch.manual_seed(0)
        contexts: dict[int, Context] = {}

        def client_fn(context: Context) -> FedPDMClient:
            pid = int(context.node_config["partition-id"])
            contexts[pid] = context
            return FedPDMClient(TinyCNN(), DataLoader(images(200, pid), batch_size=16), loss_fn=nn.CrossEntropyLoss(),
                                seed=pid)

        strategy = DPFedPDM(min_available_nodes=nodes, privacy=calib, accountant=accountant, seed=0)
        try:
            run_clients(strategy, client_fn, num_nodes=nodes, num_rounds=rounds,
                        initial_arrays=ArrayRecord(TinyCNN().state_dict()))
        except PrivacyBudgetExhausted as err:
            strategy.stopped = err
        return strategy, contexts

    free, ctx = run(None, 4)
    ledgers = [PrivacyLedger.from_record(c.state.config_records[LEDGER]) for c in ctx.values()]
    assert all(len(led) == 4 for led in ledgers)
    spent = free.privacy_spent()  # no server accountant: the devices' own exact (GDP) figures, worst client
    assert spent.epsilon == pytest.approx(max(led.gdp_epsilon() for led in ledgers)) and spent.num_releases == 4
    assert spent.accounting_method.startswith("gdp")
    assert all(led.gdp_epsilon() < led.rdp_epsilon() for led in ledgers)  # RDP's conversion is an upper bound
    # the exact epsilon of 2 and 3 releases of the worst device, from its ledger, by dp-accounting's PLD
    worst = max(ledgers, key=lambda led: led.rdp_epsilon())
    eps_at = []
    for n in (2, 3):
        pld = PldAccountant(no_amplification(1e-5, nodes))
        for z in worst.noise_multipliers[:n]:
            pld.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=nodes, population_size=nodes))
        eps_at.append(pld.get_epsilon(1e-5))
    budget = float(np.mean(eps_at))

    capped, ctx = run(lambda: GdpAccountant(no_amplification(1e-5, nodes, max_epsilon=budget)), 10)
    assert isinstance(getattr(capped, "stopped", None), PrivacyBudgetExhausted)
    assert "round 3" in str(capped.stopped) and "max_epsilon" in str(capped.stopped)
    for c in ctx.values():  # nothing was released past the budget: every device holds two releases
        assert len(PrivacyLedger.from_record(c.state.config_records[LEDGER])) == 2
    spent = capped.privacy_spent()
    assert spent.epsilon == pytest.approx(eps_at[0], rel=1e-6) and spent.num_releases == 2
    assert spent.epsilon <= budget < eps_at[1] and spent.accounting_method == "gdp, worst client"
