"""The models and data users have (issue 23, device side): BatchNorm, dict samples, loaders, devices, evaluation.

Real torch models (tests/usertorch.py, the user's own), real strategies and clients, in process (the same
RecordDicts Flower carries) or through Flower's own FedAvg on a LocalGrid. Independent truths: Flower's
``aggregate_arrayrecords`` for the buffers' weighted mean, plain torch for what a user's loop computes, Opacus's
``ModuleValidator`` for the fix the refusal names, and the recomputed counts of clipped coordinates.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg
from torch import nn
from torch.utils.data import DataLoader, Dataset, SubsetRandomSampler, TensorDataset
from usertorch import TinyCNN, accuracy, images

from fedpdm_flower.clients.base import FedClient
from fedpdm_flower.clients.dpq import DPQClient
from fedpdm_flower.clients.fedavg import FedAvgClient
from fedpdm_flower.clients.feddyn import FedDynClient
from fedpdm_flower.clients.fedpdm import FedPDMClient
from fedpdm_flower.clients.fedrep import FedREPClient
from fedpdm_flower.clients.iadmm import IADMMClient, OutPClient
from fedpdm_flower.clients.mods import secure_buffers_mod
from fedpdm_flower.clients.scaffold import ScaffoldClient
from fedpdm_flower.fedapp import secagg
from fedpdm_flower.fedapp.compression import TopK
from fedpdm_flower.fedapp.compression.codec import encode_dense
from fedpdm_flower.fedapp.compression.payload import FORMAT_KEY, to_arrays
from fedpdm_flower.fedapp.localdata import TorchData, as_local_data
from fedpdm_flower.fedapp.models.torch_model import TorchModel
from fedpdm_flower.fedapp.privacy import GaussianTarget
from fedpdm_flower.fedapp.wire import BUFFERS_KEY
from fedpdm_flower.strategies.base import arrays_of
from fedpdm_flower.strategies.dpq import DPQDSGD
from fedpdm_flower.strategies.fedavg import FedAvg
from fedpdm_flower.strategies.feddyn import FedDyn
from fedpdm_flower.strategies.fedpdm import BSDPFedPDM, DPFedPDM
from fedpdm_flower.strategies.fedrep import SHARE
from fedpdm_flower.strategies.iadmm import DPIADMM, OutP
from fedpdm_flower.strategies.scaffold import Scaffold
from fedpdm_flower.strategies.wrappers import SecureBuffers
from simulations.inprocess import LocalGrid, run_clients

torch.set_num_threads(1)

N, SAMPLES, BATCH = 3, 40, 10
BUFFERS = ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]


def ctx(pid: int = 0) -> Context:
    return Context(run_id=1, node_id=pid + 1, node_config={"partition-id": pid, "num-partitions": N},
                   state=RecordDict(), run_config={})


def state_of(net: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


# ----------------------------------------------------------------------------- BatchNorm in every non-private client
#: (strategy, client class, client kwargs, rounds, local steps per round (None: not a counted loop))
Q = (SAMPLES - 1) // BATCH  # Q b < |D_i| (spec A6): 3 steps of 10
ALGORITHMS: dict[str, tuple[Any, Any, dict[str, Any], int, int | None]] = {
    "fedpdm": (lambda: DPFedPDM(min_available_nodes=N, privacy=None, rho=0.1, eta0=0.2, gamma=0.0, nu=0.0, seed=0), FedPDMClient, {},
               2, Q),
    "bsdp-fedpdm": (lambda: BSDPFedPDM(min_available_nodes=N, privacy=None, rho=0.1, eta0=0.2, gamma=0.0, nu=0.0, seed=0,
                                       uplink=TopK(0.3), downlink=TopK(0.75)), FedPDMClient, {}, 2, Q),
    "fedavg": (lambda: FedAvg(min_available_nodes=N, eta0=0.2, seed=0), FedAvgClient, {}, 2, Q),
    "scaffold": (lambda: Scaffold(min_available_nodes=N, eta0=0.2, seed=0), ScaffoldClient, {}, 2, Q),
    "feddyn": (lambda: FedDyn(min_available_nodes=N, eta0=0.2, seed=0), FedDynClient, {}, 2, Q),
    "iadmm": (lambda: DPIADMM(local_updates=2, privacy=None, min_available_nodes=N, seed=0, total_samples=N * SAMPLES),
              IADMMClient, {}, 2, None),
    "outp": (lambda: OutP(privacy=None, min_available_nodes=N, seed=0, total_samples=N * SAMPLES), OutPClient, {}, 2,
             None),
    "dpq-dsgd (no noise)": (lambda: DPQDSGD(min_available_nodes=N, privacy=None, q_step=0.0, horizon=10, seed=0, evaluate_average=True),
                            DPQClient, {"share_model": True}, 3, None),
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_non_private_client_trains_a_batchnorm_model_with_its_buffers_beside_the_vector(name: str) -> None:
    make_strategy, client_cls, kwargs, rounds, steps = ALGORITHMS[name]
    torch.manual_seed(0)
    net = TinyCNN(norm=True)
    init = state_of(net)

    def client_fn(context: Context) -> FedClient:
        pid = int(context.node_config["partition-id"])
        return client_cls(TinyCNN(norm=True), DataLoader(images(SAMPLES, pid), batch_size=BATCH),
                          loss_fn=nn.CrossEntropyLoss(), seed=pid, **kwargs)

    strategy, contexts = run_clients(make_strategy(), client_fn, num_nodes=N, num_rounds=rounds,
                                     initial_arrays=ArrayRecord(net.state_dict()))
    assert len(strategy.history) == rounds and strategy.rejected_total == 0
    params = sum(p.numel() for p in net.parameters())
    assert strategy.dim == params  # the algorithm's vector: the parameters, no buffer among them
    result = arrays_of(strategy.current_arrays())
    assert [(k, v.shape, v.dtype) for k, v in result.items()] == [(k, v.shape, v.dtype) for k, v in init.items()]
    for c in contexts.values():  # duals, control variates, start points, x_i: the parameters only
        for rec_name, rec in c.state.array_records.items():
            sizes = {k: a.numpy().size for k, a in rec.items()}
            if rec_name == "dpq":
                assert sizes["x"] == params
            elif rec_name != "model.buffers":
                assert set(sizes.values()) == {params}, (rec_name, sizes)
    if steps is not None:  # the server's mean of the clients' counters, cast back: every client took Q steps a round
        assert result["norm.num_batches_tracked"].dtype == np.int64
        assert int(result["norm.num_batches_tracked"]) == rounds * steps
    if name.startswith("dpq"):  # the nodes own their statistics; the server averages what they share
        kept = [c.state.array_records["model.buffers"]["norm.running_mean"].numpy() for c in contexts.values()]
        assert not np.allclose(kept[0], kept[1])  # each node its own
        np.testing.assert_allclose(result["norm.running_mean"], np.mean(kept, axis=0), rtol=1e-6, atol=1e-7)
    else:
        assert not np.allclose(result["norm.running_mean"], init["norm.running_mean"])  # they followed the data
    user = TinyCNN(norm=True)
    user.load_state_dict(strategy.current_arrays().to_torch_state_dict())  # the user's own loader takes it


def test_the_buffers_mean_is_flowers_fedavg_mean_with_the_integer_counter_cast_back() -> None:
    """Three replies with 10, 20 and 70 examples: the server's buffers are Flower's ``aggregate_arrayrecords``
    weighted mean (a second implementation), except that ``num_batches_tracked`` comes back an int64 rounded to
    the nearest integer where Flower leaves a fractional float."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    torch.manual_seed(0)
    net = TinyCNN(norm=True)
    strategy = FedAvg(min_available_nodes=N, eta0=0.1, seed=0)
    strategy.initialize(ArrayRecord(net.state_dict()))
    strategy.prepare(1)
    strategy.attach({i: i for i in range(N)})
    sent = dict(strategy.train_contents(1))
    assert sorted(arrays_of(sent[0][BUFFERS_KEY])) == sorted(BUFFERS)  # the server's buffers go down with the model
    rng = np.random.default_rng(1)
    replies, records = [], []
    for cid, n in enumerate((10, 20, 70)):
        buf = {"norm.running_mean": rng.normal(size=4).astype(np.float32),
               "norm.running_var": rng.uniform(0.5, 2.0, size=4).astype(np.float32),
               "norm.num_batches_tracked": np.array(3 + 5 * cid, dtype=np.int64)}
        x = strategy.x + rng.normal(scale=0.01, size=strategy.dim)
        arrays, code = to_arrays(encode_dense(x))
        content = RecordDict({"arrays": ArrayRecord(arrays),
                              "metrics": MetricRecord({"num-examples": n, FORMAT_KEY: code}),
                              BUFFERS_KEY: ArrayRecord({k: Array(v) for k, v in buf.items()})})
        replies.append((cid, content))
        records.append(RecordDict({"arrays": content[BUFFERS_KEY], "metrics": MetricRecord({"num-examples": n})}))
    strategy.consume_replies(1, replies)
    flower = aggregate_arrayrecords(records, "num-examples")
    got = arrays_of(strategy.current_arrays())
    for name in BUFFERS[:2]:
        np.testing.assert_allclose(got[name], flower[name].numpy(), rtol=1e-6)
    # (3 * 10 + 8 * 20 + 13 * 70) / 100 = 11.0 ... Flower's float, ours the int64 it rounds to
    assert float(flower["norm.num_batches_tracked"].numpy()) == pytest.approx(11.0)
    assert got["norm.num_batches_tracked"].dtype == np.int64 and int(got["norm.num_batches_tracked"]) == 11


def test_a_malformed_buffers_record_costs_only_its_reply() -> None:
    torch.manual_seed(0)
    strategy = FedAvg(min_available_nodes=2, eta0=0.1, seed=0)
    strategy.initialize(ArrayRecord(TinyCNN(norm=True).state_dict()))
    strategy.prepare(1)
    strategy.attach({0: 0, 1: 1})
    strategy.train_contents(1)
    good = {"norm.running_mean": np.ones(4, np.float32), "norm.running_var": np.ones(4, np.float32),
            "norm.num_batches_tracked": np.array(4, np.int64)}
    bad = {**good, "norm.running_var": np.full(4, np.nan, np.float32)}
    arrays, code = to_arrays(encode_dense(strategy.x))
    replies = [(cid, RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": 5, FORMAT_KEY: code}),
                                 BUFFERS_KEY: ArrayRecord({k: Array(v) for k, v in b.items()})}))
               for cid, b in ((0, good), (1, bad))]
    strategy.consume_replies(1, replies)
    assert strategy.rejected_total == 1 and "buffer 'norm.running_var' holds non-finite" in str(strategy.round_errors())
    np.testing.assert_array_equal(arrays_of(strategy.current_arrays())["norm.running_var"], np.ones(4, np.float32))


def test_fedavg_client_under_flowers_own_fedavg_trains_batchnorm_and_evaluates_on_its_test_data() -> None:
    """Flower's FedAvg sends the state dict: our client trains it (buffers included), replies under the user's names,
    and answers Flower's federated evaluation on its test data; the aggregated accuracy equals the test sets'
    accuracy of the final model recomputed here (FedAvg's weighted mean)."""
    torch.manual_seed(0)
    net = TinyCNN(norm=True)
    tests = {i: images(20 + 10 * i, 50 + i) for i in range(N)}

    def client_fn(context: Context) -> FedClient:
        pid = int(context.node_config["partition-id"])
        return FedAvgClient(TinyCNN(norm=True), DataLoader(images(SAMPLES, pid), batch_size=BATCH), seed=pid,
                            test_data=DataLoader(tests[pid], batch_size=7))

    strategy = FlowerFedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_available_nodes=N, min_train_nodes=N,
                            min_evaluate_nodes=N)
    result = strategy.start(grid=LocalGrid(FedAvgClient.client_app(client_fn), N),
                            initial_arrays=ArrayRecord(net.state_dict()), num_rounds=2,
                            train_config=ConfigRecord({"eta": 0.2, "max-steps": 3}))
    assert list(result.arrays) == list(net.state_dict())  # the user's names: load_state_dict takes it
    final = TinyCNN(norm=True)
    final.load_state_dict(result.arrays.to_torch_state_dict())
    assert not torch.equal(final.norm.running_mean, net.norm.running_mean)  # the statistics followed the data
    want = sum(accuracy(final, tests[i]) * len(tests[i]) for i in range(N)) / sum(len(t) for t in tests.values())
    assert result.evaluate_metrics_clientapp[2]["accuracy"] == pytest.approx(want, abs=1e-9)
    assert "loss" in result.evaluate_metrics_clientapp[2]


def test_evaluate_returns_the_users_test_fn_keys_and_refuses_without_test_data() -> None:
    torch.manual_seed(0)
    net, test = TinyCNN(norm=True), images(25, 9)

    def test_fn(module: nn.Module, data: Any) -> dict[str, Any]:  # the template's test(): the user's keys
        return {"eval_acc": accuracy(module, data), "eval_count": torch.tensor(len(data))}

    client = FedAvgClient(TinyCNN(norm=True), images(SAMPLES, 0), test_data=test, test_fn=test_fn, context=ctx())
    reply = client.handle("evaluate", RecordDict({"arrays": ArrayRecord(net.state_dict()), "config": ConfigRecord()}))
    metrics = dict(reply.metric_records["metrics"])
    assert metrics == {"eval_acc": pytest.approx(accuracy(net, test)), "eval_count": 25, "num-examples": 25}
    bare = FedAvgClient(TinyCNN(norm=True), images(SAMPLES, 0), context=ctx())
    with pytest.raises(ValueError, match="built without test_data: pass test_data="):
        bare.handle("evaluate", RecordDict({"arrays": ArrayRecord(net.state_dict()), "config": ConfigRecord()}))


# ----------------------------------------------------------------------------- private rounds refuse BatchNorm
def test_a_private_round_refuses_batchnorm_and_names_the_opacus_fix_which_works() -> None:
    from opacus.validators import ModuleValidator

    torch.manual_seed(0)
    strategy = DPFedPDM(min_available_nodes=N, rho=0.1, eta0=0.2, seed=0,
                        privacy=GaussianTarget(epsilon=8.0, delta=1e-5, clip_norm=1.0))
    fix = "opacus.validators.ModuleValidator.fix(model)"
    with pytest.raises(Exception, match=r"floating-point buffers \['norm.running_mean', 'norm.running_var'\]"):
        run_clients(strategy, lambda c: FedPDMClient(TinyCNN(norm=True), DataLoader(images(SAMPLES, 0), batch_size=BATCH),
                                                     seed=0),
                    num_nodes=N, num_rounds=1, initial_arrays=ArrayRecord(TinyCNN(norm=True).state_dict()))
    assert fix in str(strategy.round_errors()) and "privacy" in str(strategy.round_errors())
    with pytest.raises(ValueError, match=r"privacy floor \(max_epsilon = 5.0\).*ModuleValidator"):
        FedAvgClient(TinyCNN(norm=True), images(SAMPLES, 0), max_epsilon=5.0)
    fixed = ModuleValidator.fix(TinyCNN(norm=True))  # the one line the message names: GroupNorm, no buffers
    assert ModuleValidator.validate(fixed, strict=False) == []
    strategy = DPFedPDM(min_available_nodes=N, rho=0.1, eta0=0.2, seed=0,
                        privacy=GaussianTarget(epsilon=8.0, delta=1e-5, clip_norm=1.0))
    run_clients(strategy, lambda c: FedPDMClient(ModuleValidator.fix(TinyCNN(norm=True)),
                                                 DataLoader(images(SAMPLES, 0), batch_size=BATCH), seed=0),
                num_nodes=N, num_rounds=1, initial_arrays=ArrayRecord(fixed.state_dict()))
    assert strategy.rejected_total == 0 and strategy.privacy_spent() is not None


# ----------------------------------------------------------------------------- data: dict samples, collate, sampler
class DictSamples(Dataset[dict[str, Any]]):
    """flwr-datasets' / Hugging Face's sample shape: ``{"img": tensor, "label": int}`` (keys configurable)."""

    def __init__(self, base: TensorDataset, keys: tuple[str, str] = ("img", "label")) -> None:
        self.base, self.keys = base, keys
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.read.append(int(i))
        x, y = self.base[i]
        return {self.keys[0]: x, self.keys[1]: int(y), "id": i}


def one_round(data: Any, *, dp: bool = False, batch: int = BATCH) -> np.ndarray:
    """One FedAvgClient round on ``data`` from a fixed model and seed: the trained flat vector."""
    torch.manual_seed(0)
    net = TinyCNN()
    client = FedAvgClient(TinyCNN(), data, seed=3, context=ctx())
    config = {"server-round": 1, "eta": 0.2, "max-steps": 3, "batch-size": batch}
    if dp:
        config.update({"dp": True, "clip": 1.0, "dp-calibration": "gdp", "dp-epsilon": 100.0, "dp-delta": 1e-5,
                       "dp-horizon": 1})
    reply = client.handle("train", RecordDict({"arrays": ArrayRecord(net.state_dict()),
                                               "config": ConfigRecord(config)}))
    return np.concatenate([v.numpy().ravel() for v in reply.array_records["arrays"].values()])


def test_dict_samples_train_exactly_as_the_same_samples_as_pairs() -> None:
    base = images(SAMPLES, 4)
    want = one_round(DataLoader(base, batch_size=BATCH))
    np.testing.assert_array_equal(one_round(DataLoader(DictSamples(base), batch_size=BATCH)), want)
    renamed = DictSamples(base, keys=("pixels", "digit"))
    np.testing.assert_array_equal(one_round(TorchData(DataLoader(renamed, batch_size=BATCH),
                                                      keys=("pixels", "digit"))), want)
    with pytest.raises(ValueError, match=r"keys=\(input_key, target_key\)"):
        one_round(DataLoader(renamed, batch_size=BATCH))


def test_a_hugging_face_dataset_with_the_templates_transform_is_read_like_the_pairs() -> None:
    datasets = pytest.importorskip("datasets")
    base = images(SAMPLES, 4)
    hf = datasets.Dataset.from_dict({"img": base.tensors[0].numpy(), "label": base.tensors[1].numpy()})

    def apply_transforms(batch: dict[str, Any]) -> dict[str, Any]:  # the template's with_transform
        batch["img"] = [torch.tensor(np.asarray(img), dtype=torch.float32) for img in batch["img"]]
        return batch

    loader = DataLoader(hf.with_transform(apply_transforms), batch_size=BATCH, shuffle=True)
    np.testing.assert_array_equal(one_round(loader), one_round(DataLoader(base, batch_size=BATCH)))


def test_the_loaders_collate_fn_is_used() -> None:
    base = images(SAMPLES, 4)
    doubled = TensorDataset(2 * base.tensors[0], base.tensors[1])

    def collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:  # the user's own
        return {"x": torch.stack([2 * x for x, _ in batch]), "y": torch.stack([y for _, y in batch])}

    np.testing.assert_array_equal(one_round(DataLoader(base, batch_size=BATCH, collate_fn=collate)),
                                  one_round(DataLoader(doubled, batch_size=BATCH)))


def test_the_loaders_own_sampler_is_honoured_without_dp_and_not_under_dp() -> None:
    """A SubsetRandomSampler over the first 12 samples: without DP every training batch comes from them; with DP
    the analysis' uniform permutation of all samples is used (documented), so samples outside the subset are read.
    The user's collate_fn records what each batch read (the train-loss metric reads all 40 in one call)."""
    from torch.utils.data import default_collate

    calls: list[list[int]] = []

    def collate(items: list[dict[str, Any]]) -> Any:
        calls.append([int(it["id"]) for it in items])
        return default_collate(items)

    loader = DataLoader(DictSamples(images(SAMPLES, 4)), batch_size=4, sampler=SubsetRandomSampler(range(12)),
                        collate_fn=collate)
    one_round(loader, batch=4)
    train = [c for c in calls if len(c) == 4]
    assert len(train) == 2 and set().union(*train) <= set(range(12))  # Q = (12 - 1) // 4 = 2 batches of the subset
    assert len(set().union(*train)) == 8  # without replacement within the round
    calls.clear()
    one_round(loader, batch=4, dp=True)
    train = [c for c in calls if len(c) == 4]
    assert len(train) == 3 and set().union(*train) - set(range(12))  # Q = min(3, 39 // 4): all 40 samples in play


def test_the_model_stays_on_the_users_device(monkeypatch: pytest.MonkeyPatch) -> None:
    moved: list[Any] = []
    original = nn.Module.to

    def spy(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        moved.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", spy)
    model = TorchModel(TinyCNN(norm=True))
    assert moved == [] and model.device == torch.device("cpu")
    TorchModel(TinyCNN(norm=True), device="cpu")  # an explicit device moves it
    assert moved == [(torch.device("cpu"),)]


# ----------------------------------------------------------------------------- masked updates: clipping is counted
def test_secure_buffers_count_and_report_the_coordinates_the_fixed_point_code_clips() -> None:
    """Node i's update is 20 (beyond the range [-8, 8]) on its first i + 1 coordinates: the round reports
    1 + 2 + 3 + 4 = 10 clipped coordinates, and the aggregate is the mean of the clipped values. Each node holds
    max_weight = 1000 examples, so SecureBuffers' weighting scales its update by 1000 / 1000 = 1 before encoding."""
    n, d = 4, 50
    identities = [secagg.NodeIdentity.generate() for _ in range(n)]
    trust = secagg.TrustStore({i: identities[i].public_bytes() for i in range(n)})
    app = ClientApp(mods=[secure_buffers_mod(identity=lambda c: identities[int(c.node_config["partition-id"])],
                                             trust_store=trust)])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        w = msg.content["arrays"]["w"].numpy().copy()
        w[:pid + 1] += 20.0
        return Message(RecordDict({"arrays": ArrayRecord({"w": Array(w)}), "metrics": MetricRecord({"num-examples": 1000})}),
                       reply_to=msg)

    inner = FlowerFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)
    strategy = SecureBuffers(inner, buffer_size=n)
    result = strategy.start(grid=LocalGrid(app, n), num_rounds=1,
                            initial_arrays=ArrayRecord({"w": Array(np.zeros(d, np.float32))}))
    assert strategy.diagnostics[1]["secure.clipped_coordinates"] == 10
    w = result.arrays["w"].numpy()
    # coordinate j: 4 - j nodes sent 20, clipped to 8, the others 0 -- the mean of what the range let through
    np.testing.assert_allclose(w[:4], [8.0, 6.0, 4.0, 2.0], atol=1e-4)
    np.testing.assert_allclose(w[4:], 0.0, atol=1e-4)


def test_encode_counted_appends_the_number_of_clipped_coordinates() -> None:
    rng = np.random.default_rng(0)
    x = np.array([0.5, -9.0, 8.0, 12.5, -8.0001])
    enc = secagg.encode_counted(x, 2, rng)
    q, clipped = secagg.split_counted(enc)
    assert clipped == 3 and q.shape == x.shape  # 8.0 fits; -9, 12.5 and -8.0001 do not
    np.testing.assert_allclose(secagg.dequantize(q), np.clip(x, -8, 8), atol=4e-6)


# ----------------------------------------------------------------------------- FedREP + BatchNorm (the collapse)
def test_fedrep_batchnorm_statistics_never_overshoot_when_a_client_sits_out() -> None:
    """Regression (issue 23, item 8). Three clients in buffers of two: each round one sits out, and its update g,
    never sent, is folded into its error memory u. For a weight that is right (the step was not applied); for a
    running statistic g = w^t - w_k^{t+1} is the distance to the device's statistics, and adding it again the next
    round overshoots. With small input variance (running_var of about 0.003 against its initial 1) the old code drove
    the global running_var to -0.37 in round 3: every prediction NaN, accuracy at chance (0.317) for rounds 3-6,
    then a recovery. Now the statistics ride along every round without error memory: they stay positive and the
    model stays at 1.0 once it gets there."""
    def small(n: int, seed: int) -> TensorDataset:
        d = images(n, seed)
        return TensorDataset(0.05 * d.tensors[0], d.tensors[1])

    torch.manual_seed(0)
    net, test = TinyCNN(norm=True), small(300, 99)
    accs: list[float] = []
    least: list[float] = []

    def central(rnd: int, arrays: ArrayRecord) -> None:
        user = TinyCNN(norm=True)
        user.load_state_dict(arrays.to_torch_state_dict())
        accs.append(accuracy(user, test))
        least.append(float(arrays["norm.running_var"].numpy().min()))

    strategy = SHARE(min_available_nodes=3, masked=False, buffer_size=2, eta0=0.5, local_steps=10, batch_size=16,
                     seed=0, reproducible_buffers=True)
    _, contexts = run_clients(strategy, lambda c: FedREPClient(
        TinyCNN(norm=True), DataLoader(small(60, int(c.node_config["partition-id"])), batch_size=16),
        seed=int(c.node_config["partition-id"])), num_nodes=3, num_rounds=8,
        initial_arrays=ArrayRecord(net.state_dict()), evaluate_fn=central)
    assert min(least) > 0, least
    first = next(i for i, a in enumerate(accs) if a > 0.95)
    assert all(a > 0.95 for a in accs[first:]), accs
    for c in contexts.values():  # no error memory on the statistics' coordinates
        u = c.state.array_records["u"].to_numpy_ndarrays()[0]
        client = FedREPClient(TinyCNN(norm=True), small(10, 0))
        assert np.all(u[client.buffer_idx] == 0.0) and client.buffer_idx.size == 8


def test_dataset_of_pairs_or_arrays_still_reads_as_before() -> None:
    data = as_local_data(images(12, 0))
    x, y = data.batch(np.array([3, 1]))
    assert tuple(x.shape) == (2, 1, 14, 14) and y.tolist() == images(12, 0).tensors[1][[3, 1]].tolist()
    assert math.isclose(float(x.sum()), float(images(12, 0).tensors[0][[3, 1]].sum()))


def test_compress_mod_sends_batchnorm_statistics_as_they_are_never_through_the_codec() -> None:
    """Under Compressed, the codec and its error memory cover the parameters; the running statistics and the counter
    go up as training left them (error feedback would re-send a statistic's change each round and overshoot)."""
    from fedpdm_flower.clients.mods import NEW_CRC, UPLINK, _crc, _layout, compress_mod

    torch.manual_seed(0)
    net = TinyCNN(norm=True)
    named = state_of(net)
    layout = _layout(named)
    assert layout.dim == sum(p.numel() for p in net.parameters())
    trained = {**named, "norm.running_var": named["norm.running_var"] * 0.25,
               "norm.num_batches_tracked": np.array(7, np.int64), "fc.bias": named["fc.bias"] + 1.0}

    def call_next(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in trained.items()}),
                                   "metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)

    LocalGrid(ClientApp(), 1)  # plays the ServerApp's task identity, which Flower's Message constructor reads
    msg = Message(RecordDict({"arrays": ArrayRecord(net.state_dict()),
                              "config": ConfigRecord({NEW_CRC: _crc(layout.flatten(named)), UPLINK: "topk:0.1"})}),
                  dst_node_id=1, message_type="train")
    msg.metadata.__dict__["_message_id"] = "m"
    reply = compress_mod()(msg, ctx(), call_next)
    sent = arrays_of(reply.content["arrays"])
    np.testing.assert_array_equal(sent["k.norm.running_var"], trained["norm.running_var"])
    assert int(sent["k.norm.num_batches_tracked"]) == 7
    assert not any(k.startswith("c.") and "norm.running" in k for k in sent)


@pytest.mark.parametrize("family", ["broadcast", "fedrep"])
def test_batch_size_none_with_a_plain_dataset_names_both_fixes(family: str) -> None:
    """batch_size=None means "each client's DataLoader batch size" in every family; a client given a plain Dataset
    has none, and the round's error says what to change on either side (not a missing wire key)."""
    from fedpdm_flower.strategies.base import RoundFailed

    if family == "broadcast":
        strategy: Any = FedAvg(min_available_nodes=2, batch_size=None, eta0=0.1, seed=0)
        make: Any = lambda c: FedAvgClient(TinyCNN(), images(20, 0), loss_fn=nn.CrossEntropyLoss())  # noqa: E731
    else:
        strategy = SHARE(min_available_nodes=2, masked=False, batch_size=None, eta0=0.1, seed=0)
        make = lambda c: FedREPClient(TinyCNN(), images(20, 0), loss_fn=nn.CrossEntropyLoss())  # noqa: E731
    with pytest.raises(RoundFailed, match=r"batch_size=None .*give the client a DataLoader, or pass batch_size=\.\.\."):
        run_clients(strategy, make, num_nodes=2, num_rounds=1, initial_arrays=ArrayRecord(TinyCNN().state_dict()))
