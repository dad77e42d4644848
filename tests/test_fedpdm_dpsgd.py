"""BSDP-FedPDM on record-level DP-SGD (privacy=PrivacyTarget): a user's CNN learns under it, every device's epsilon
stays within the target as a second library recomputes it, the device refuses before training what would pass its
floor, and bad input is refused before round 1 naming the knob.

Independent truth: dp-accounting's RdpAccountant recomputes each device's epsilon from the (z, q, steps) it reports;
the noise-free upload is checked against the dual identity of (8c)/(8d) (y = 2 x - x_0 - lambda / rho).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader
from usertorch import TinyCNN, accuracy, images

from fedpdm_flower.clients.base import FedClient
from fedpdm_flower.clients.fedpdm import FedPDMClient
from fedpdm_flower.fedapp.compression import TopK
from fedpdm_flower.fedapp.privacy import Eq36Calibration, PrivacyTarget
from fedpdm_flower.fedapp.privacy.dpsgd import DPSGDLedger, recompute_epsilon
from fedpdm_flower.fedapp.privacy.target import PrivacyNotChosen
from fedpdm_flower.strategies.fedpdm import BSDPFedPDM, DPFedPDM
from simulations.inprocess import run_clients

torch.set_num_threads(1)
PER_NODE = 300


def _run(strategy: Any, rounds: int, nodes: int = 3, floor: float | None = None) -> tuple[Any, dict[int, Context], float]:
    torch.manual_seed(0)
    net, test = TinyCNN(), images(300, 99)

    def client_fn(context: Context) -> FedClient:
        pid = int(context.node_config["partition-id"])
        return FedPDMClient(TinyCNN(), DataLoader(images(PER_NODE, pid), batch_size=30), loss_fn=nn.CrossEntropyLoss(),
                            seed=pid, max_epsilon=floor)

    def central(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": accuracy(net, test)})

    _, contexts = run_clients(strategy, client_fn, num_nodes=nodes, num_rounds=rounds,
                              initial_arrays=ArrayRecord(net.state_dict()), evaluate_fn=central)
    return strategy, contexts, accuracy(net, test)


def test_a_users_cnn_learns_under_record_level_dpsgd_and_each_device_stays_within_the_target() -> None:
    target = PrivacyTarget(epsilon=8.0, sample_rate=30 / PER_NODE, clip_norm=1.0)
    strategy = BSDPFedPDM(min_available_nodes=3, rho=0.1, gamma=0.0, eta0=0.5, max_local_steps=10, seed=0,
                          uplink=TopK(0.5), downlink=TopK(0.75), privacy=target)
    strategy, contexts, acc = _run(strategy, rounds=4)
    mech = strategy.mechanism
    assert mech is not None and (mech.sample_rate, mech.clip_norm, mech.steps) == (0.1, 1.0, 10)
    assert acc > 2 / 3, [r.test_accuracy for r in strategy.history]  # chance is 1/3
    for cid, ctx in contexts.items():
        ledger = DPSGDLedger.from_record(dict(ctx.state.config_records["dpsgd"]))
        assert ledger.history == [(mech.noise_multiplier, 0.1, 40)] and ledger.participations == 4
        reported = strategy.client_privacy[cid]["eps_dpsgd"]
        second = recompute_epsilon([(strategy.client_privacy[cid]["dp_noise_multiplier"],
                                     strategy.client_privacy[cid]["dp_sample_rate"],
                                     int(strategy.client_privacy[cid]["dp_steps"]))], 1e-5)
        assert reported <= 8.0 and reported >= 0.98 * second  # no more than 2 % below the recomputation
        assert reported == pytest.approx(8.0, rel=1e-3)  # 4 rounds of 10 steps was the calibration's horizon
    spent = strategy.privacy_spent()
    assert spent.epsilon <= 8.0 and "rdp of every DP-SGD step" in spent.accounting_method


def test_the_upload_is_noise_free_post_processing_and_no_raw_data_metric_leaves() -> None:
    """Under DP-SGD the device adds nothing to y: with lambda^t = 0, (8c) and (8d) give y = x_0 - 2 lambda^{t+1} / rho
    exactly, which noise on the upload would break."""
    s = DPFedPDM(min_available_nodes=1, min_train_nodes=1, rho=0.5, eta0=0.3, max_local_steps=5, seed=0,
                 privacy=PrivacyTarget(epsilon=4.0, sample_rate=0.2))
    net = TinyCNN()
    s.initialize(ArrayRecord(net.state_dict()))
    s.prepare(2)
    s.attach({0: 1})
    (_, content), = s.train_contents(1)
    cfg = dict(content.config_records["config"])
    assert cfg["dp-mechanism"] == "dp-sgd" and cfg["dp-steps"] == 5 and cfg["dp-sample-rate"] == 0.2
    assert cfg["dp-noise-multiplier"] == pytest.approx(s.mechanism.noise_multiplier)  # type: ignore[union-attr]
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    client = FedPDMClient(TinyCNN(), DataLoader(images(50, 0), batch_size=10), context=ctx)
    reply = client.handle("train", content)
    y = np.concatenate([a.numpy().ravel() for a in reply.array_records["arrays"].values()]).astype(np.float64)
    x0 = np.concatenate([v.numpy().ravel() for v in net.state_dict().values()]).astype(np.float64)
    dual = ctx.state.array_records["fedpdm.dual"].to_numpy_ndarrays()[0]
    metrics = dict(reply.metric_records["metrics"])
    assert "train_loss" not in metrics and metrics["dp_steps_taken"] == metrics["Q"] <= 5
    assert metrics["dp_steps"] == 5  # charged for every step it could take, whatever (10) stopped at
    assert np.linalg.norm(dual) > 0  # it trained
    np.testing.assert_allclose(y, x0 - 2 * dual / 0.5, rtol=0, atol=2e-6)  # float32 on the wire


def test_the_device_floor_refuses_before_any_training_and_nothing_is_charged() -> None:
    s = DPFedPDM(min_available_nodes=1, min_train_nodes=1, max_local_steps=5, seed=0,
                 privacy=PrivacyTarget(epsilon=8.0, sample_rate=0.2))
    s.initialize(ArrayRecord(TinyCNN().state_dict()))
    s.prepare(3)
    s.attach({0: 1})
    (_, content), = s.train_contents(1)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    client = FedPDMClient(TinyCNN(), DataLoader(images(50, 0), batch_size=10), context=ctx, max_epsilon=2.0)
    calls: list[int] = []
    original = client.model.clipped_grad_sum
    client.model.clipped_grad_sum = lambda *a, **k: calls.append(1) or original(*a, **k)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"refused: 5 DP-SGD step\(s\) .* > its floor max_epsilon = 2"):
        client.handle("train", content)
    assert calls == [] and "dpsgd" not in ctx.state.config_records and "fedpdm.dual" not in ctx.state.array_records
    # the floor is reported in whoami, and a strategy refuses to start a run above it (before round 1)
    assert client.get_properties({})["dp-max-epsilon"] == 2.0
    with pytest.raises(ValueError, match=r"client 0 .* accepts at most epsilon = 2 .* PrivacyTarget epsilon = 8"):
        s.check_nodes({0: client.get_properties({})})
    # a tampered message (less noise than the floor allows) is refused the same way
    cheap = RecordDict({"arrays": content.array_records["arrays"],
                        "config": ConfigRecord({**dict(content.config_records["config"]), "dp-noise-multiplier": 0.05})})
    roomy = FedPDMClient(TinyCNN(), DataLoader(images(50, 0), batch_size=10), context=ctx, max_epsilon=20.0)
    with pytest.raises(ValueError, match="refused"):
        roomy.handle("train", cheap)


def test_bad_input_is_refused_before_round_1_naming_the_knob() -> None:
    with pytest.raises(PrivacyNotChosen, match=r"BSDPFedPDM is a differentially private strategy and needs "
                       r"privacy=: .*Eq36Calibration.*privacy=None"):
        BSDPFedPDM(min_available_nodes=1)
    assert BSDPFedPDM(min_available_nodes=1, privacy=None).privacy is None
    with pytest.raises(ValueError, match=r"needs the Poisson sample rate .* sample_rate=q"):
        BSDPFedPDM(min_available_nodes=1, privacy=PrivacyTarget(epsilon=8.0))
    with pytest.raises(ValueError, match="PrivacyTarget sample_rate"):
        PrivacyTarget(epsilon=8.0, sample_rate=1.5)
    with pytest.raises(ValueError, match="PrivacyTarget clip_norm"):
        PrivacyTarget(epsilon=8.0, sample_rate=0.1, clip_norm=0.0)
    s = DPFedPDM(min_available_nodes=1, max_local_steps=50, privacy=PrivacyTarget(epsilon=0.1, sample_rate=1.0))
    s.initialize(ArrayRecord(TinyCNN().state_dict()))
    with pytest.raises(ValueError, match=r"PrivacyTarget epsilon: epsilon = 0.1 .* cannot be met by any noise"):
        s.prepare(20)  # before any message
    assert DPFedPDM(min_available_nodes=1, privacy=None).privacy is None  # no noise, said explicitly
    assert isinstance(DPFedPDM(min_available_nodes=1, privacy=Eq36Calibration(epsilon=8.0, delta=1e-5)).privacy,
                      Eq36Calibration)  # the paper's own mechanism, the reproduction setting
