"""Record-level DP-SGD on the device (Opacus) in a user's Flower train function: the device's budget holds.

Independent truth: dp-accounting's PLD recomputes the epsilon of the device's recorded (z, q, steps) history; the
user's module comes back without Opacus's hooks and trains; the device refuses a round past its budget.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict
from test_public_api import TinyCNN, accuracy, images
from torch.utils.data import DataLoader

from fedpdm_flower.clients.dpsgd import DeviceDPSGD


def context() -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})


def test_three_rounds_spend_the_devices_budget_as_dp_accounting_counts_it() -> None:
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    torch.manual_seed(0)
    net, data, ctx = TinyCNN(), images(300, 0), context()
    policy = DeviceDPSGD(epsilon=8.0, delta=1e-5, max_rounds=3, clip_norm=1.0)
    before = accuracy(net, images(300, 99))
    for _ in range(3):
        m = policy.train(net, DataLoader(data, batch_size=30), lr=0.5, context=ctx)
    assert m["dp_epsilon"] == pytest.approx(8.0, rel=0.01) and m["dp_epsilon"] <= 8.0 * 1.001
    assert m["dp_sample_rate"] == pytest.approx(0.1) and m["dp_steps"] == 30
    pld = PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(
        m["dp_noise_multiplier"])), 30))
    assert pld.get_epsilon(1e-5) <= m["dp_epsilon"]  # PLD is tighter than Opacus's RDP, and not far below
    assert pld.get_epsilon(1e-5) > 0.7 * m["dp_epsilon"]
    assert accuracy(net, images(300, 99)) > max(before, 0.6)  # it learned, under the noise
    assert not any(getattr(mod, "_forward_hooks", {}) for mod in net.modules())  # Opacus's hooks are gone
    with pytest.raises(ValueError, match=r"budget .* is spent"):
        policy.train(net, DataLoader(data, batch_size=30), lr=0.5, context=ctx)


def test_the_ledger_file_carries_the_spend_across_runs(tmp_path: Path) -> None:
    path = tmp_path / "dpsgd.json"
    data = images(100, 1)
    first = DeviceDPSGD(epsilon=4.0, max_rounds=2, ledger_path=path)
    first.train(TinyCNN(), DataLoader(data, batch_size=20), lr=0.1, context=context())
    again = DeviceDPSGD(epsilon=4.0, max_rounds=2, ledger_path=path)  # a new run, a new context
    m = again.train(TinyCNN(), DataLoader(data, batch_size=20), lr=0.1, context=context())
    assert m["dp_steps"] == 2 * math.ceil(100 / 20)
    with pytest.raises(ValueError, match="spent"):
        again.train(TinyCNN(), DataLoader(data, batch_size=20), lr=0.1, context=context())


def test_bad_policies_are_refused() -> None:
    for kw, match in [({"epsilon": 0.0, "max_rounds": 1}, "epsilon"), ({"epsilon": 1.0, "max_rounds": 0}, "max_rounds"),
                      ({"epsilon": 1.0, "max_rounds": 1, "delta": 1.0}, "delta")]:
        with pytest.raises(ValueError, match=match):
            DeviceDPSGD(**kw)  # type: ignore[arg-type]


def test_batchnorm_is_refused_with_opacus_fix_named() -> None:
    policy = DeviceDPSGD(epsilon=8.0, max_rounds=1)
    with pytest.raises(ValueError, match=r"BatchNorm .* ModuleValidator\.fix"):
        policy.train(TinyCNN(norm=True), DataLoader(images(40, 0), batch_size=10), lr=0.1, context=context())
