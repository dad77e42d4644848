"""FedREP on the public layer as a Flower user meets it: their own torch model (with BatchNorm) and data, defined in
this file; our FedREP / SHARE strategies and FedREPClient / MomentumSGDClient, driven by
simulations.inprocess.run_clients (the same RecordDicts Flower carries).

Checks are against independent truth: Eq. (180) re-implemented here with plain torch autograd, the buffer means
computed here, the user's own ``load_state_dict``, and every value of the messages.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from usertorch import TinyCNN, accuracy, images

from fedpdm_flower.clients.fedrep import FedREPClient, MomentumSGDClient
from fedpdm_flower.clients.secure import SecureDevice
from fedpdm_flower.fedapp.attacks import ClientAttack, OmniscientOracle
from fedpdm_flower.fedapp.compression import ConSpar
from fedpdm_flower.fedapp.robust import CenteredClipping, GeometricMedian, Mean, TrimmedMean
from fedpdm_flower.fedapp.secagg import NodeIdentity, TrustStore
from fedpdm_flower.strategies.base import RoundFailed, arrays_of
from fedpdm_flower.strategies.fedrep import SHARE, DenseFedAvg, FedREP, SparseSecAgg
from simulations.inprocess import run_clients

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
#: the devices' long-term identities and the trust store every device holds (a masked run puts them in secure mode)
IDENTITIES = [NodeIdentity.generate() for _ in range(8)]
TRUST = TrustStore({i: ident.public_bytes() for i, ident in enumerate(IDENTITIES)})


# ----------------------------------------------------------------------------- a user's model and data
def flat(state: dict[str, Any]) -> np.ndarray[Any, Any]:
    """The floating-point entries of a state dict, in its order (what the strategy's x holds)."""
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in state.values()
                           if np.issubdtype(np.asarray(v).dtype, np.floating)])


def eq180_by_hand(net: nn.Module, data: TensorDataset, *, lr: float, beta: float, steps: int) -> dict[str, Any]:
    """Eq. (180) with full batches (the order of the samples does not matter), plain torch: m = beta m + (1 - beta)
    grad, w = w - lr m, from m = 0; BatchNorm updates its running statistics in train mode."""
    momenta = [torch.zeros_like(p) for p in net.parameters()]
    for _ in range(steps):
        net.train()
        net.zero_grad()
        nn.functional.cross_entropy(net(data.tensors[0]), data.tensors[1]).backward()
        with torch.no_grad():
            for p, m in zip(net.parameters(), momenta, strict=True):
                assert p.grad is not None
                m.mul_(beta).add_(p.grad, alpha=1 - beta)
                p.sub_(lr * m)
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def run(strategy: Any, rounds: int, *, nodes: int = 4, samples: int = 60, batch: int | None = None,
        client: type[FedREPClient] = FedREPClient, **client_kw: Any) -> tuple[Any, TinyCNN, dict[int, Context]]:
    """``rounds`` rounds of the user's app; with a masked strategy every device is in secure mode (buffers of 2
    accepted, the paper's s = 2)."""
    torch.manual_seed(0)
    net = TinyCNN(norm=True)
    test = images(300, 99)
    secure = bool(getattr(strategy, "masked", False))

    def client_fn(context: Context) -> FedREPClient:
        pid = int(context.node_config["partition-id"])
        torch.manual_seed(100 + pid)  # each device builds its own, differently initialised, model
        policy = {"secure": SecureDevice(IDENTITIES[pid], TRUST, min_buffer=2)} if secure else {}
        return client(TinyCNN(norm=True), DataLoader(images(samples, pid), batch_size=batch or samples),
                      loss_fn=nn.CrossEntropyLoss(), seed=pid, **policy, **client_kw)

    def central(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": accuracy(net, test)})

    _, contexts = run_clients(strategy, client_fn, num_nodes=nodes, num_rounds=rounds,
                              initial_arrays=ArrayRecord(net.state_dict()), evaluate_fn=central)
    return strategy, net, contexts


# ----------------------------------------------------------------------------- independent truth
def test_share_with_the_mean_is_the_mean_of_eq180_on_a_users_batchnorm_cnn() -> None:
    """k = d, plain buffers, the mean: w^1 = w^0 - mean_k (w^0 - w_k^1), with w_k^1 from plain torch (BatchNorm
    running statistics included: they travel in w); the integer num_batches_tracked comes back as it was given."""
    strategy = SHARE(min_available_nodes=4, masked=False, aggregator=Mean(), eta0=0.3, momentum=0.9, local_steps=2,
                     batch_size=None, seed=0)
    s, net, contexts = run(strategy, 1)
    torch.manual_seed(0)
    w0_state = {k: v.numpy().copy() for k, v in TinyCNN(norm=True).state_dict().items()}
    w0 = flat(w0_state)
    local = []
    for pid in range(4):
        user = TinyCNN(norm=True)
        user.load_state_dict({k: torch.from_numpy(v) for k, v in w0_state.items()})
        local.append(flat(eq180_by_hand(user, images(60, pid), lr=0.3, beta=0.9, steps=2)))
    expected = w0 - np.mean([w0 - w for w in local], axis=0)
    np.testing.assert_allclose(s.global_model(), expected, rtol=0, atol=2e-6)
    out = s.current_arrays()
    assert list(out) == list(w0_state)
    assert out["norm.num_batches_tracked"].numpy().shape == () and int(out["norm.num_batches_tracked"].numpy()) == 0
    assert not np.allclose(out["norm.running_mean"].numpy(), 0)  # the clients' batch statistics arrived
    net.load_state_dict(out.to_torch_state_dict())  # the user's own load works on what we return
    for ctx in contexts.values():  # k = d: every coordinate transmitted, the error memory stays exactly 0
        assert not np.any(ctx.state.array_records["u"].to_numpy_ndarrays()[0])


def test_masked_buffers_give_the_plain_buffer_means_within_one_quantization_step() -> None:
    """Masked FedREP (secure devices, three exchanges) equals plain FedREP (two) up to the fixed-point step."""
    plain, _, _ = run(FedREP(min_available_nodes=4, masked=False, aggregator=Mean(), conspar=ConSpar(0.2), seed=1), 2)
    masked, _, _ = run(FedREP(min_available_nodes=4, masked=True, aggregator=Mean(), conspar=ConSpar(0.2), seed=1), 2)
    step = 2 * 8.0 / (2**22 - 1)
    np.testing.assert_allclose(masked.global_model(), plain.global_model(), rtol=0, atol=2 * step)
    assert not np.array_equal(masked.global_model(), plain.global_model())  # the masked run really went through q
    assert [r.extra["consensus_size"] for r in masked.history] == [r.extra["consensus_size"] for r in plain.history]
    assert all(r.extra["buffers"] == 2 and r.extra["discarded_buffers"] == 0 for r in masked.history)


def test_fedrep_trains_a_users_cnn_with_conspar_masks_and_a_robust_aggregator() -> None:
    s, net, _ = run(FedREP(min_available_nodes=4, conspar=ConSpar(0.1), buffer_size=2, masked=True,
                           aggregator=GeometricMedian(iters=5), eta0=0.5, local_steps=5, seed=0),
                    5, samples=200, batch=16)
    acc = [r.test_accuracy for r in s.history]
    assert acc[-1] > 0.9 and acc[0] < 0.9, acc  # three separable classes: chance is 1/3
    k, m = s.k, 4
    assert k == round(0.1 * s.num_trainable / m) and s.num_trainable == s.dim - 8  # BatchNorm statistics excluded
    for r in s.history:  # the 8 BatchNorm statistics ride along every round, outside the proposals
        assert r.extra["buffers"] == 2 and r.extra["consensus_size"] <= m * k + 8 and r.extra["discarded_buffers"] == 0
        assert r.extra["clipped"] == 0  # every masked coordinate fit the fixed-point range
    net.load_state_dict(s.current_arrays().to_torch_state_dict())
    assert accuracy(net, images(300, 99)) == pytest.approx(acc[-1])


# ----------------------------------------------------------------------------- the strategy is the source of truth
def test_every_value_the_clients_need_travels_in_the_messages() -> None:
    s = FedREP(min_available_nodes=2, conspar=ConSpar(0.1, alpha=0.3), eta0=0.2, eta0_decay_round=3, momentum=0.5,
               local_steps=4, batch_size=8, sparse_downlink=False, seed=5)
    s.initialize(ArrayRecord(TinyCNN(norm=True).state_dict()))
    s.prepare(5, train_config=ConfigRecord({"user-key": 1}))
    s.attach({0: 10, 1: 11})
    s.begin_round(3)
    (node, mtype, content), _ = s.pre_train_contents(3)
    cfg = dict(content.config_records["config"])
    assert node == 10 and mtype == "query.propose"
    assert cfg["lr"] == pytest.approx(0.02) and cfg["momentum"] == 0.5 and cfg["local-steps"] == 4
    assert cfg["batch-size"] == 8 and cfg["k"] == round(0.1 * s.num_trainable / 2) and cfg["alpha"] == 0.3
    assert cfg["masked"] is True and cfg["dense-model"] is True and cfg["sparse-downlink"] is False
    assert cfg["dim"] == s.dim and cfg["user-key"] == 1 and cfg["server-round"] == 3


def test_constructors_name_the_bad_argument() -> None:
    cases: list[tuple[type[Any], dict[str, Any], str]] = [
        (FedREP, {"buffer_size": 1}, "masked=True needs buffer_size"),
        (FedREP, {"buffer_size": 0, "masked": False}, "buffer_size must be"),
        (FedREP, {"fraction_train": 0.5}, "fraction_train must be 1"),
        (FedREP, {"eta0": 0.0}, "eta0 must be"),
        (FedREP, {"momentum": 1.0}, "momentum must lie"),
        (FedREP, {"local_steps": 0}, "local_steps must be"),
        (FedREP, {"aggregator": "geomed"}, "aggregator must be a callable"),
        (FedREP, {"conspar": 0.05}, "conspar must be a ConSpar"),
        (FedREP, {"oracle": OmniscientOracle(frozenset({1}), "alie")}, "needs the clients' uploads in the clear"),
        (SHARE, {"conspar": ConSpar()}, "takes no conspar"),
        (DenseFedAvg, {"buffer_size": 2}, "fixes"),
        (SparseSecAgg, {"gamma": 0.0}, "gamma must lie"),
        (SparseSecAgg, {"scale": "sum"}, "scale must be"),
    ]
    for cls, kw, why in cases:
        with pytest.raises((ValueError, TypeError), match=why):
            cls(**kw)
    for bad, why in [(lambda: ConSpar(0.0), "fraction"), (lambda: ConSpar(0.1, alpha=2.0), "alpha"),
                     (lambda: GeometricMedian(iters=0), "iters"), (lambda: TrimmedMean(0.5), "trim_fraction"),
                     (lambda: CenteredClipping(tau=0.0), "tau"), (lambda: ClientAttack(values="alie"), "values"),
                     (lambda: OmniscientOracle(values="bit-flip"), "values")]:
        with pytest.raises(ValueError, match=why):
            bad()
    # the "same" oracle reads only proposals, which are in the clear in both modes
    FedREP(oracle=OmniscientOracle(frozenset({1}), coordinates="same"))
    s = FedREP(min_available_nodes=2, conspar=ConSpar(3.0))
    s.initialize(ArrayRecord(TinyCNN(norm=True).state_dict()))
    with pytest.raises(ValueError, match="fraction must lie in"):  # K/d > m is refused once m is known
        s.attach({0: 0, 1: 1})


def test_the_client_needs_a_torch_module_and_data() -> None:
    class NumpyModel:
        dim = 3

        def grad(self, x: Any, f: Any, t: Any) -> Any:
            return x

        def loss(self, x: Any, f: Any, t: Any) -> float:
            return 0.0

    with pytest.raises(TypeError, match=r"trains a torch nn\.Module in place"):
        FedREPClient(NumpyModel(), (np.zeros((2, 3)), np.zeros(2)))
    with pytest.raises(ValueError, match="needs local training data"):
        FedREPClient(TinyCNN(norm=True), None)


# ----------------------------------------------------------------------------- the downlink and the devices
def test_a_device_whose_model_is_not_the_servers_w0_is_sent_the_dense_model() -> None:
    """Default (clients_hold_initial=False): round 1 sends every client the dense w^0, later rounds the sparse
    aggregate. With clients_hold_initial=True the devices' own models (initialised differently here) fail the CRC
    check: no proposal is accepted and the round fails loudly."""
    fresh = FedREP(min_available_nodes=4, conspar=ConSpar(0.2), seed=2)
    fresh.initialize(ArrayRecord(TinyCNN(norm=True).state_dict()))
    fresh.prepare(2)
    fresh.attach({i: i for i in range(4)})
    fresh.begin_round(1)
    assert all(c.config_records["config"]["dense-model"] for _, _, c in fresh.pre_train_contents(1))
    s, _, _ = run(FedREP(min_available_nodes=4, conspar=ConSpar(0.2), seed=2), 2)
    assert s.rejected_total == 0
    s.begin_round(3)  # every client answered: from now on the sparse aggregate
    assert not any(c.config_records["config"]["dense-model"] for _, _, c in s.pre_train_contents(3))
    with pytest.raises(RoundFailed, match=r'4x "propose: ValueError: local model out of sync'):
        run(FedREP(min_available_nodes=4, conspar=ConSpar(0.2), seed=2, clients_hold_initial=True), 2)


class Recorded(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A user's map-style dataset that records which samples the client reads."""

    def __init__(self, data: TensorDataset) -> None:
        self.data, self.seen = data, list[int]()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append(int(i))
        return self.data[i]


def test_a_device_without_seed_reads_each_sample_once_per_pass() -> None:
    """seed=None: the order of a pass is drawn from the OS once and kept in the state, so consecutive rounds
    continue one permutation (spec 11.13) instead of redrawing it: 3 rounds x 2 steps x B = 5 cover 30 samples
    exactly once, and the next pass is another permutation."""
    data = Recorded(images(30, 4))
    client = FedREPClient(TinyCNN(norm=True), DataLoader(data, batch_size=5),
                          context=Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={}))
    s = DenseFedAvg(min_available_nodes=1, min_train_nodes=1, local_steps=2, batch_size=None, seed=0)
    run_one = _driver(s, client)
    for rnd in (1, 2, 3):
        run_one(rnd)
    assert sorted(data.seen) == list(range(30)) and data.seen != list(range(30))
    first = list(data.seen)
    for rnd in (4, 5, 6):
        run_one(rnd)
    assert sorted(data.seen[30:]) == list(range(30)) and data.seen[30:] != first


def _driver(strategy: Any, client: FedREPClient) -> Any:
    strategy.initialize(ArrayRecord(TinyCNN(norm=True).state_dict()))
    strategy.prepare(10)
    strategy.attach({0: 7})

    def one(rnd: int) -> None:
        strategy.begin_round(rnd)
        strategy.consume_pre_train(rnd, [(n, client.handle(t, c)) for n, t, c in strategy.pre_train_contents(rnd)])
        strategy.consume_replies(rnd, [(n, client.handle("train", c)) for n, c in strategy.train_contents(rnd)])

    return one


def test_momentum_sgd_client_answers_a_plain_flower_message_in_the_users_layout() -> None:
    """Flower's own strategies send the state dict: the reply keeps names, shapes, dtypes and the integer entry;
    a simulation's bit-flip client returns w^t + (w^t - w_k)."""
    net = TinyCNN(norm=True)
    msg = RecordDict({"arrays": ArrayRecord(net.state_dict()),
                      "config": ConfigRecord({"server-round": 1, "lr": 0.1, "momentum": 0.9, "local-steps": 2})})
    replies = {}
    for name, attack in (("honest", None), ("flip", ClientAttack(values="bit-flip"))):
        ctx = Context(run_id=1, node_id=3, node_config={"partition-id": 3}, state=RecordDict(), run_config={})
        client = MomentumSGDClient(TinyCNN(norm=True), DataLoader(images(40, 1), batch_size=8), context=ctx, seed=0,
                                   attack=attack, test_data=images(30, 7))
        replies[name] = client.handle("train", msg)
    got = arrays_of(replies["honest"].array_records["arrays"])
    want = {k: v.numpy() for k, v in net.state_dict().items()}
    assert [(k, v.shape, v.dtype) for k, v in got.items()] == [(k, v.shape, v.dtype) for k, v in want.items()]
    assert got["norm.num_batches_tracked"] == want["norm.num_batches_tracked"]  # echoed, not trained
    metrics = replies["honest"].metric_records["metrics"]
    assert metrics["partition-id"] == 3 and metrics["num-examples"] == 40
    w = flat(want)
    np.testing.assert_allclose(flat(arrays_of(replies["flip"].array_records["arrays"])), 2 * w - flat(got),
                               rtol=0, atol=1e-6)
    ev = client.handle("evaluate", RecordDict({"arrays": ArrayRecord(net.state_dict()), "config": ConfigRecord()}))
    assert 0.0 <= ev.metric_records["metrics"]["accuracy"] <= 1.0  # Flower's federated evaluation of a state dict
    assert ev.metric_records["metrics"]["num-examples"] == 30  # scored on the test data, not the 40 training samples
    with pytest.raises(ValueError, match="lacks 'lr'"):
        client.handle("train", RecordDict({"arrays": ArrayRecord(net.state_dict()),
                                           "config": ConfigRecord({"server-round": 1})}))


def test_an_honest_deployment_never_loads_the_attack_module() -> None:
    """Importing the FedREP strategies and clients, and running honest ones, does not import fedpdm_flower.fedapp.attacks."""
    code = (
        "import sys, torch\n"
        "from flwr.app import ArrayRecord\n"
        "import fedpdm_flower.strategies.fedrep, fedpdm_flower.strategies.flower_robust, fedpdm_flower.clients.fedrep\n"
        "from fedpdm_flower.clients.fedrep import FedREPClient\n"
        "net = torch.nn.Linear(3, 2)\n"
        "FedREPClient(net, (torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)))\n"
        "s = fedpdm_flower.strategies.fedrep.FedREP(min_available_nodes=1)\n"
        "s.initialize(ArrayRecord(net.state_dict()))\n"
        "print('fedpdm_flower.fedapp.attacks' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_buffers_come_from_the_os_unless_reproducibility_is_asked_for() -> None:
    # 16 clients in buffers of 2: 2,027,025 partitions, so two equal draws in 3 rounds have probability ~1e-19
    def partitions(**kw: Any) -> list[list[list[int]]]:
        s = FedREP(seed=7, buffer_size=2, **kw)
        return [s.make_buffers(list(range(16)), r)[0] for r in (1, 2, 3)]

    assert partitions() != partitions()  # the same seed, different buffers: not predictable from the seed
    assert partitions(reproducible_buffers=True) == partitions(reproducible_buffers=True)
    assert all(sorted(c for b in p for c in b) == list(range(16)) for p in partitions())  # still a partition
