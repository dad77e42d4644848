"""The public layer as a Flower user meets it: their own torch model and data, our strategies and clients.

Nothing here uses the reproduction app (run config, dataset registry, model zoo): the models and data are defined
in this file. Checks are against independent truth: torch autograd, hand-built state dicts, the layouts given.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from usertorch import TinyCNN, accuracy, images

from fedpdm_flower.clients.base import FedClient, as_flat_model
from fedpdm_flower.clients.fedavg import FedAvgClient
from fedpdm_flower.clients.fedpdm import FedPDMClient
from fedpdm_flower.fedapp.compression import RandK, TopK
from fedpdm_flower.fedapp.layout import ArrayLayout, LayoutMismatch
from fedpdm_flower.fedapp.localdata import ArrayData, TorchData, as_local_data
from fedpdm_flower.fedapp.models.torch_model import TorchModel
from fedpdm_flower.fedapp.privacy import Eq36Calibration
from fedpdm_flower.strategies.base import RoundFailed, arrays_of, client_error_text, record_of
from fedpdm_flower.strategies.fedavg import FedAvg
from fedpdm_flower.strategies.fedpdm import BSDPFedPDM, DPFedPDM
from simulations.inprocess import run_clients

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- a user's model and data
# ----------------------------------------------------------------------------- layout
def test_layout_round_trips_a_state_dict_and_carries_integer_entries() -> None:
    net = TinyCNN(norm=True)
    state = {k: v.numpy() for k, v in net.state_dict().items()}
    layout = ArrayLayout.of(state)
    floats = [k for k, v in state.items() if v.dtype == np.float32]
    assert layout.dim == sum(state[k].size for k in floats)
    assert [e.name for e in layout.entries if not e.in_vector] == ["norm.num_batches_tracked"]
    x = layout.flatten(state)
    back = layout.unflatten(x + 1.0, state)
    assert list(back) == list(state)
    for k, v in state.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v + 1.0 if k in floats else v)  # ints carried, not shifted


def test_layout_keeps_zero_dimensional_entries_zero_dimensional() -> None:
    """A scalar parameter (0-d float) and a 0-d counter come back 0-d, through the layout and an ArrayRecord."""
    state = {"temperature": np.array(1.5, np.float32), "w": np.ones((2, 2), np.float32), "n": np.array(7, np.int64)}
    layout = ArrayLayout.of(state)
    back = layout.unflatten(layout.flatten(state) * 2, state)
    assert back["temperature"].shape == () and back["temperature"] == 3.0 and back["n"].shape == () and back["n"] == 7
    got = arrays_of(record_of(back))
    assert {k: v.shape for k, v in got.items()} == {"temperature": (), "w": (2, 2), "n": ()}
    assert ArrayLayout.of(got).fingerprint() == layout.fingerprint()  # server and client agree on the layout


def test_layout_names_what_does_not_match() -> None:
    state = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)}
    layout = ArrayLayout.of(state)
    with pytest.raises(LayoutMismatch, match="entry 'w' has shape"):
        layout.flatten({"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)})
    with pytest.raises(LayoutMismatch, match=r"missing \['b'\]"):
        layout.flatten({"w": np.zeros((2, 3), np.float32)})
    with pytest.raises(LayoutMismatch, match="entry 'b' has dtype int64"):
        layout.check({"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.int64)})
    with pytest.raises(LayoutMismatch, match="nothing to train"):
        ArrayLayout.of({"steps": np.zeros(3, np.int64)})


# ----------------------------------------------------------------------------- the torch adapter
def test_torch_model_gradient_is_autograds_in_state_dict_order() -> None:
    torch.manual_seed(0)
    net, data = TinyCNN(), images(16, 1)
    model = TorchModel(net, nn.CrossEntropyLoss())
    x = model.get_flat() + 0.01
    g = model.grad(x, *data.tensors)
    ref = TinyCNN()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in model.layout.unflatten(x, model.state_arrays()).items()})
    nn.functional.cross_entropy(ref(data.tensors[0]), data.tensors[1]).backward()
    want = np.concatenate([ref.get_parameter(k).grad.numpy().ravel() for k in model.layout.names])  # type: ignore[union-attr]
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


def test_torch_model_refuses_tied_weights_and_numpy_models_refuse_a_loss() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = self.a

    with pytest.raises(ValueError, match="tied"):
        TorchModel(Tied())

    class NumpyQuadratic:
        dim = 3

        def grad(self, x: Any, f: Any, t: Any) -> Any:
            return x

        def loss(self, x: Any, f: Any, t: Any) -> float:
            return 0.0

    assert isinstance(as_flat_model(NumpyQuadratic()), NumpyQuadratic)
    with pytest.raises(ValueError, match="own loss"):
        as_flat_model(NumpyQuadratic(), nn.MSELoss())
    with pytest.raises(TypeError, match="cannot train str"):
        as_flat_model("net")


def test_local_data_from_a_loader_arrays_or_a_dataset_gives_the_same_batches() -> None:
    ds = images(20, 2)
    idx = np.array([3, 0, 17])
    via_loader = as_local_data(DataLoader(ds, batch_size=7))
    assert isinstance(via_loader, TorchData) and via_loader.default_batch_size == 7 and len(via_loader) == 20
    arrays = as_local_data((ds.tensors[0].numpy(), ds.tensors[1].numpy()))
    assert isinstance(arrays, ArrayData)
    for a, b in zip(via_loader.batch(idx), arrays.batch(idx), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    class Plain(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):  # not a TensorDataset: collated
        def __len__(self) -> int:
            return len(ds)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return ds[i]

    for a, b in zip(TorchData(Plain()).batch(idx), arrays.batch(idx), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- a user's app, end to end in process
def _fedpdm_run(strategy: Any, rounds: int = 4, nodes: int = 3) -> tuple[Any, nn.Module, TensorDataset]:
    torch.manual_seed(0)
    net, test = TinyCNN(), images(300, 99)
    init = ArrayRecord(net.state_dict())

    def client_fn(context: Context) -> FedClient:
        pid = int(context.node_config["partition-id"])
        return FedPDMClient(TinyCNN(), DataLoader(images(200, pid), batch_size=16), loss_fn=nn.CrossEntropyLoss(),
                            seed=pid)

    def central(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": accuracy(net, test)})

    run_clients(strategy, client_fn, num_nodes=nodes, num_rounds=rounds, initial_arrays=init, evaluate_fn=central)
    return strategy, net, test


def test_bsdp_fedpdm_trains_a_users_cnn_and_returns_its_state_dict() -> None:
    strategy, net, test = _fedpdm_run(BSDPFedPDM(min_available_nodes=3, rho=0.1, gamma=0.0, eta0=0.2, seed=0,
                                                 uplink=TopK(0.5), downlink=TopK(0.75), privacy=None))
    acc = [r.test_accuracy for r in strategy.history]
    assert acc[-1] > 0.9 > acc[0] - 0.5, acc  # three separable classes: chance is 1/3
    out = strategy.current_arrays()
    assert list(out) == list(net.state_dict())
    net.load_state_dict(out.to_torch_state_dict())  # the user's own load works on what we return
    assert accuracy(net, test) == pytest.approx(acc[-1])
    # the uplink really is sparse: against a dense run each reply saves the d - k float32 values, less the index bitmask
    # and the serialization overhead of that second array (its .npy header is 128 B, plus the record's fields)
    dense, _, _ = _fedpdm_run(BSDPFedPDM(min_available_nodes=3, rho=0.1, gamma=0.0, eta0=0.2, seed=0,
                                         uplink=TopK(1.0), downlink=TopK(0.75), privacy=None))
    d, k = strategy.dim, strategy.upload_k
    saved = sum(r.uplink_bytes for r in dense.history) - sum(r.uplink_bytes for r in strategy.history)
    assert saved >= 4 * 3 * (4 * (d - k) - (d + 7) // 8 - 200), (saved, d, k)


def test_the_papers_upload_mechanism_at_an_exact_gdp_target() -> None:
    # ../shared/API.md's server side, its keyword names and values (10 nodes, 30 % per round, 5 rounds here), with the
    # paper's own mechanism (noise on the upload) calibrated to an exact GDP target
    from flwr.supercore.privacy_accounting import PrivacySpent

    from fedpdm_flower.fedapp.privacy import GaussianTarget

    strategy = BSDPFedPDM(fraction_train=0.3, min_available_nodes=10, rho=10.0, gamma=0.005, eta0=0.04,
                          uplink=TopK(0.1), downlink=TopK(0.75), privacy=GaussianTarget(epsilon=8.0, delta=1e-5))
    strategy, _, _ = _fedpdm_run(strategy, rounds=5, nodes=10)
    spent = strategy.privacy_spent()  # flwr's PrivacySpent, worst client, exact GDP
    assert isinstance(spent, PrivacySpent) and spent.delta == 1e-5
    assert 0 < spent.epsilon <= 8.0 + 1e-9  # calibrated for 5 releases; sampled clients spent at most the target


def test_the_strategy_is_the_single_source_of_truth_for_hyperparameters() -> None:
    s = DPFedPDM(min_available_nodes=2, rho=3.0, nu=0.5, eta0=0.3, max_local_steps=4, batch_size=8, seed=1,
                 uplink=RandK(0.25), privacy=Eq36Calibration(epsilon=5.0, delta=1e-6, clip_norm=2.0))
    s.initialize(ArrayRecord(TinyCNN().state_dict()))
    s.prepare(10, train_config=ConfigRecord({"user-key": 7}))
    s.attach({0: 10, 1: 11})
    (_, content), _ = s.train_contents(2)
    cfg = dict(content.config_records["config"])
    assert cfg["rho"] == 3.0 and cfg["nu"] == 0.5 and cfg["max-steps"] == 4 and cfg["batch-size"] == 8
    assert cfg["eta"] == pytest.approx(0.3 / np.sqrt(2)) and cfg["uplink"] == "randk" and cfg["k-up"] == s.dim // 4
    assert cfg["dp"] is True and cfg["dp-epsilon"] == 5.0 and cfg["clip"] == 2.0 and cfg["dp-horizon"] == 10
    assert cfg["user-key"] == 7 and cfg["server-round"] == 2
    with pytest.raises(ValueError, match="set by DPFedPDM itself"):
        s.prepare(10, train_config=ConfigRecord({"dim": 3}))


def _one_client_reply(client: FedClient, content: RecordDict) -> RecordDict | str:
    try:
        return client.handle("train", content)
    except Exception as err:  # what Flower turns into an error reply
        return f"{type(err).__name__}: {err}"


def test_a_device_floor_refuses_a_noiseless_or_over_budget_release() -> None:
    data = DataLoader(images(100, 0), batch_size=10)
    ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    for privacy, why in [(None, "without noise"), (Eq36Calibration(epsilon=50.0, delta=1e-5), "exact, GDP")]:
        s = DPFedPDM(min_available_nodes=1, min_train_nodes=1, privacy=privacy, seed=0)
        s.initialize(ArrayRecord(TinyCNN().state_dict()))
        s.prepare(3)
        s.attach({0: 5})
        client = FedPDMClient(TinyCNN(), data, context=ctx, max_epsilon=5.0)
        s.begin_round(1)
        (node, content), = s.train_contents(1)
        reply = _one_client_reply(client, content)
        assert isinstance(reply, str) and "refused" in reply and why in reply
        with pytest.raises(RoundFailed, match=f"1x .*refused.*{why}"):
            s.consume_replies(1, [(node, reply)])
        assert "privacy" not in ctx.state.config_records  # nothing was released, nothing spent


def test_a_client_checks_every_value_of_the_message() -> None:
    data = DataLoader(images(50, 0), batch_size=10)
    client = FedPDMClient(TinyCNN(), data, context=Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                                                           run_config={}))
    s = DPFedPDM(min_available_nodes=1, min_train_nodes=1, seed=0, privacy=None)
    s.initialize(ArrayRecord(TinyCNN().state_dict()))
    s.prepare(1)
    s.attach({0: 1})
    (_, content), = s.train_contents(1)
    good = dict(content.config_records["config"])
    for key, bad, why in [("rho", -1.0, "'rho' = -1.0 lies outside"), ("eta", float("nan"), "'eta' must be a finite"),
                          ("max-steps", 2.5, "'max-steps' must be an integer"), ("uplink", "all", "'uplink' = 'all'"),
                          ("dim", 5, "d = 5 parameters")]:
        msg = RecordDict({"arrays": content.array_records["arrays"], "config": ConfigRecord({**good, key: bad})})
        with pytest.raises(ValueError, match=why):
            client.handle("train", msg)
    other = RecordDict({"arrays": content.array_records["arrays"],
                        "config": ConfigRecord({**good, "layout-crc": good["layout-crc"] + 1})})
    with pytest.raises(ValueError, match=r"ArrayRecord\(net.state_dict\(\)\)"):
        client.handle("train", other)


def test_our_fedavg_client_answers_a_plain_flower_message_in_the_users_layout() -> None:
    """Flower's own FedAvg sends the state dict and a static config: the reply has the same names and shapes."""
    torch.manual_seed(0)
    net = TinyCNN()
    client = FedAvgClient(TinyCNN(), DataLoader(images(64, 3), batch_size=16), seed=0,
                          context=Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}))
    msg = RecordDict({"arrays": ArrayRecord(net.state_dict()),
                      "config": ConfigRecord({"server-round": 1, "eta": 0.1, "max-steps": 3})})
    reply = client.handle("train", msg)
    got = arrays_of(reply.array_records["arrays"])
    want = {k: v.numpy() for k, v in net.state_dict().items()}
    assert [(k, v.shape, v.dtype) for k, v in got.items()] == [(k, v.shape, v.dtype) for k, v in want.items()]
    assert "payload-format" not in reply.metric_records["metrics"]
    assert not all(np.array_equal(a, b) for a, b in zip(got.values(), want.values(), strict=True))  # it trained


def test_fedavg_over_a_users_model_in_process() -> None:
    strategy = FedAvg(min_available_nodes=3, eta0=0.3, max_local_steps=8, seed=2)
    torch.manual_seed(0)
    net, test = TinyCNN(), images(300, 98)

    def client_fn(context: Context) -> FedClient:
        return FedAvgClient(TinyCNN(), DataLoader(images(150, int(context.node_config["partition-id"]) + 10),
                                                  batch_size=16), seed=0)

    def central(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": accuracy(net, test)})

    run_clients(strategy, client_fn, num_nodes=3, num_rounds=3, initial_arrays=ArrayRecord(net.state_dict()),
                evaluate_fn=central)
    assert strategy.history[-1].test_accuracy > 0.9


def test_client_error_text_extracts_the_clients_message() -> None:
    wrapped = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'ray::ClientAppActor.run() ...\n"
               "Traceback ...\nValueError: refused: budget\n\nException ClientAppException occurred. Message: "
               "refused: budget'>")
    assert client_error_text(wrapped) == "ValueError: refused: budget"
    assert client_error_text("<class 'ValueError'>:<'bad rho'>") == "ValueError: bad rho"
