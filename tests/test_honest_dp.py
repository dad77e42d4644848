"""Honest differential privacy (issue 14): a target (epsilon, delta) that holds under a rigorous accountant.

A user's CNN under DP-FedPDM with ``GaussianTarget(epsilon=8, delta=1e-5)``. Independent truth: Google's
dp-accounting (PLD) recomputes the epsilon of what each device released from the noise multipliers the device
itself recorded; the noise actually added is measured against the configured std; the ledger file of a device
carries its spend across runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from flwr.serverapp.exception import PrivacyBudgetExhausted
from test_public_api import TinyCNN, images
from torch import nn
from torch.utils.data import DataLoader

from fedpdm_flower.clients.broadcast import LEDGER
from fedpdm_flower.clients.fedpdm import FedPDMClient
from fedpdm_flower.fedapp.privacy import gdp
from fedpdm_flower.fedapp.privacy.accountants import PrivacyLedger
from fedpdm_flower.fedapp.privacy.gaussian import GaussianTarget
from fedpdm_flower.strategies.fedpdm import DPFedPDM
from simulations.inprocess import run_clients

TARGET = GaussianTarget(epsilon=8.0, delta=1e-5)


def run(rounds: int, nodes: int = 3, *, target: GaussianTarget = TARGET, node_config: dict[str, Any] | None = None,
        max_epsilon: float | None = None) -> tuple[Any, dict[int, Context], BaseException | None]:
    torch.manual_seed(0)
    contexts: dict[int, Context] = {}

    def client_fn(context: Context) -> FedPDMClient:
        pid = int(context.node_config["partition-id"])
        context.node_config.update(node_config or {})
        contexts[pid] = context
        return FedPDMClient(TinyCNN(), DataLoader(images(200, pid), batch_size=16), loss_fn=nn.CrossEntropyLoss(),
                            seed=pid, max_epsilon=max_epsilon)

    strategy = DPFedPDM(min_available_nodes=nodes, privacy=target, seed=0, eta0=0.1)
    stopped: BaseException | None = None
    try:
        run_clients(strategy, client_fn, num_nodes=nodes, num_rounds=rounds,
                    initial_arrays=ArrayRecord(TinyCNN().state_dict()))
    except PrivacyBudgetExhausted as err:
        stopped = err
    return strategy, contexts, stopped


def test_the_target_is_spent_exactly_as_a_second_library_counts_it() -> None:
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    strategy, ctx, stopped = run(4)
    assert stopped is None
    for c in ctx.values():
        ledger = PrivacyLedger.from_record(dict(c.state.config_records[LEDGER]))
        assert len(ledger) == 4  # every client takes part in every round here (K = N)
        pld = PLDAccountant(value_discretization_interval=1e-4)
        for z in ledger.noise_multipliers:
            pld.compose(dp_event.GaussianDpEvent(z))
        assert pld.get_epsilon(1e-5) == pytest.approx(8.0, rel=5e-4)  # dp-accounting: the target, spent
        assert ledger.gdp_epsilon(1e-5) == pytest.approx(8.0, rel=1e-9)
        assert ledger.rdp_epsilon(1e-5) > 8.0  # RDP's conversion bounds it from above
    spent = strategy.privacy_spent()
    assert spent.epsilon == pytest.approx(8.0, rel=1e-9) and spent.accounting_method == "gdp, worst client"
    assert strategy.history[-1].epsilon == pytest.approx(8.0, rel=1e-9)


def test_the_noise_added_has_the_configured_std() -> None:
    """The same round with and without noise (the noise has its own RNG stream): the difference is the noise."""
    def upload(privacy: GaussianTarget | None) -> tuple[np.ndarray, dict[str, Any]]:
        s = DPFedPDM(min_available_nodes=1, min_train_nodes=1, privacy=privacy, seed=0)
        torch.manual_seed(0)
        s.initialize(ArrayRecord(TinyCNN().state_dict()))
        s.prepare(5)
        s.attach({0: 5})
        s.begin_round(1)
        (_, content), = s.train_contents(1)
        ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
        torch.manual_seed(1)
        client = FedPDMClient(TinyCNN(), DataLoader(images(400, 0), batch_size=16), loss_fn=nn.CrossEntropyLoss(),
                              context=ctx, seed=7)
        reply = client.handle("train", content)
        return reply.array_records["arrays"].to_numpy_ndarrays()[0].astype(np.float64), dict(
            reply.metric_records["metrics"])

    noisy, m = upload(TARGET)
    clean, _ = upload(None)
    noise = noisy - clean
    z = gdp.noise_multiplier_for(8.0, 1e-5, 5)
    assert m["noise_multiplier"] == pytest.approx(z, rel=1e-12) and m["sigma"] == pytest.approx(z * m["sensitivity"])
    # d = 532 draws: the sample std is within 10 % of sigma with probability > 0.999
    assert np.std(noise) == pytest.approx(m["sigma"], rel=0.1)
    assert abs(np.mean(noise)) < 4 * m["sigma"] / np.sqrt(noise.size)


def test_the_run_stops_before_a_release_would_pass_the_target() -> None:
    # noise for 2 releases, a run of 5 rounds: round 3 is refused by the strategy before any device releases
    strategy, ctx, stopped = run(5, target=GaussianTarget(epsilon=8.0, delta=1e-5, horizon=2))
    assert isinstance(stopped, PrivacyBudgetExhausted) and "round 3" in str(stopped)
    for c in ctx.values():
        assert len(PrivacyLedger.from_record(dict(c.state.config_records[LEDGER]))) == 2
    assert strategy.privacy_spent().epsilon <= 8.0 * (1 + 1e-9)


def test_a_devices_ledger_file_carries_its_spend_across_runs(tmp_path: Path) -> None:
    """Node config privacy-ledger: the second run starts from the first run's spend, and the device's floor
    refuses the release that would take the total past it."""
    path = tmp_path / "ledger-{pid}.json"
    # one node with its own file; each run asks for 2 releases calibrated to epsilon 3
    target = GaussianTarget(epsilon=3.0, delta=1e-5, horizon=2)
    cfg = {"privacy-ledger": str(path).format(pid=0)}
    _, _, stopped = run(2, nodes=1, target=target, node_config=cfg)
    first = PrivacyLedger.load(cfg["privacy-ledger"], 1e-5)
    assert stopped is None and len(first) == 2 and first.gdp_epsilon() == pytest.approx(3.0, rel=1e-9)
    # the second run: its own target again, but the device's ledger continues where the first one stopped
    z = first.noise_multipliers[0]
    floor = gdp.epsilon_for(1e-5, gdp.mu_of(3 / z**2)) * 1.000001  # room for exactly one more release
    from fedpdm_flower.strategies.base import RoundFailed

    with pytest.raises(RoundFailed, match="exact, GDP"):
        run(2, nodes=1, target=target, node_config=cfg, max_epsilon=floor)
    after = PrivacyLedger.load(cfg["privacy-ledger"], 1e-5)
    assert len(after) == 3  # one release allowed, the next refused: the spend of both runs is on the device
    assert after.gdp_epsilon() <= floor
