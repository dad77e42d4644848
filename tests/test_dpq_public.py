"""DPQ-DSGD as a Flower user meets it: their own torch CNN or numpy model and data, DPQDSGD + DPQClient.

Nothing here uses the reproduction app (run config, dataset registry, model zoo): the models and data are defined in
this file and driven through simulations.inprocess.run_clients (the RecordDicts and context.state of a Flower run).
Checks are against independent truth: update (6) computed by hand with torch autograd and the quantizer of eq. (3)
written out here; the closed-form fixed point of DSGD on least squares; the framework-free simulator fed the same
numpy model. Then what a lying neighbour, a lying server and a careful device do.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from numpy.typing import NDArray
from torch import nn
from usertorch import TinyCNN, images

from fedpdm_flower.clients.dpq import STATE, DPQClient
from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.algorithms import dpq
from fedpdm_flower.fedapp.compression import quantize
from fedpdm_flower.fedapp.localdata import ArrayData, as_local_data
from fedpdm_flower.fedapp.models.torch_model import TorchModel
from fedpdm_flower.strategies.base import RoundFailed, Scalar
from fedpdm_flower.strategies.dpq import DPQDSGD
from simulations.inprocess import run_clients

torch.set_num_threads(1)
N = 4


# ----------------------------------------------------------------------------- a user's models and data
class LeastSquares:
    """A user's numpy model: f(x) = mean_l 1/2 (a_l'x - t_l)^2, with its mean per-sample gradient."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def grad(self, x: NDArray[np.float64], a: NDArray[np.float64], t: NDArray[np.float64]) -> NDArray[np.float64]:
        return np.asarray(a.T @ (a @ x - t) / a.shape[0], dtype=np.float64)

    def loss(self, x: NDArray[np.float64], a: NDArray[np.float64], t: NDArray[np.float64]) -> float:
        r = a @ x - t
        return 0.5 * float(r @ r) / a.shape[0]


def least_squares_data(rows: int = 30, dim: int = 3) -> list[tuple[NDArray[np.float64], NDArray[np.float64]]]:
    rng = np.random.default_rng(5)
    return [(rng.standard_normal((rows, dim)), rng.standard_normal(rows)) for _ in range(N)]


def pid(context: Context) -> int:
    return int(context.node_config["partition-id"])


def flat(net: nn.Module) -> NDArray[np.float64]:
    return torch.cat([p.detach().reshape(-1) for p in net.state_dict().values()]).double().numpy()


# ----------------------------------------------------------------------------- the user's CNN: update (6) by hand
def test_a_users_cnn_takes_update_6_as_computed_by_hand() -> None:
    """Round 2 (update k = 0) at node 0 of a 4-ring: x_1 = (1 - b) x_0 + b (a_00 z_0 + a_01 z_1 + a_03 z_3) - a g,
    with z_j = Delta Q((x_0 + sigma_0 n_j) / Delta) by eq. (3) from the device streams and g = torch autograd of the
    mean cross-entropy on the minibatch drawn without replacement; every upload is an integer array."""
    seed, q_step = 7, 0.5
    data = [images(40, 10 + i) for i in range(N)]
    net = TinyCNN()
    torch.manual_seed(0)
    x0 = flat(net)
    strategy = DPQDSGD(min_available_nodes=N, horizon=10, a3=2.0, q_step=q_step, seed=0)
    strategy, contexts = run_clients(
        strategy, lambda c: DPQClient(TinyCNN(), data[pid(c)], loss_fn=nn.CrossEntropyLoss(), seed=seed),
        num_nodes=N, num_rounds=2, initial_arrays=ArrayRecord(net.state_dict()))
    p = strategy.params
    assert p is not None and p.batch_size == math.floor(2.0 * 10**0.7) + 1 == 11
    a_hat, b_hat = 0.35 * math.log(10) ** 2 / 10, 0.3 / 10**0.75
    assert (p.alpha_hat, p.beta_hat) == pytest.approx((a_hat, b_hat), rel=1e-15)
    d = x0.size
    sigma0 = (0 + 5.0) ** 0.1

    def z(j: int) -> NDArray[np.float64]:  # eq. (3), written out
        v = (x0 + sigma0 * np.random.default_rng([seed, 50, j, 0]).standard_normal(d)) / q_step
        low = np.floor(v)
        return q_step * (low + (np.random.default_rng([seed, 51, j, 0]).random(d) < v - low))

    idx = np.random.default_rng([seed, 52, 0, 0]).choice(40, 11, replace=False)
    ref = TinyCNN()
    ref.load_state_dict(net.state_dict())
    nn.functional.cross_entropy(ref(data[0].tensors[0][idx]), data[0].tensors[1][idx]).backward()
    g = torch.cat([q.grad.reshape(-1) for q in ref.parameters()]).double().numpy()  # type: ignore[union-attr]
    w = 1.0 / 3.0  # Metropolis on the ring: every weight 1/3
    expect = (1 - b_hat) * x0 + b_hat * ((1 - 2 * w) * z(0) + w * z(1) + w * z(3)) - a_hat * g
    got = contexts[0].state.array_records[STATE]["x"].numpy()
    np.testing.assert_allclose(got, expect, rtol=0, atol=1e-12)
    assert all(m[0].dtype == np.uint8 for m in strategy.outbox.values())  # spec 7.7: integer uploads only
    assert strategy.history[-1].epsilon is not None and strategy.history[-1].epsilon > 0


def test_the_node_average_comes_back_in_the_users_layout_and_learns() -> None:
    """evaluate_average with devices that allow it: Result-style arrays are the node-average model in the user's
    state-dict layout, evaluate_fn sees it, and a few rounds of DSGD on the toy images beat chance (1/3)."""
    data = [images(60, 20 + i) for i in range(N)]
    test = images(150, 99)
    net = TinyCNN()
    seen: list[float] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = TinyCNN()
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        with torch.no_grad():
            acc = float((model(test.tensors[0]).argmax(1) == test.tensors[1]).double().mean())
        seen.append(acc)
        return MetricRecord({"accuracy": acc})

    strategy = DPQDSGD(min_available_nodes=N, variant="dsgd", horizon=12, a1=0.6, a2=1.0, a3=4.0, seed=0,
                       evaluate_average=True, eval_every=4)
    strategy, contexts = run_clients(
        strategy, lambda c: DPQClient(TinyCNN(), data[pid(c)], seed=1, share_model=True),
        num_nodes=N, num_rounds=14, initial_arrays=ArrayRecord(net.state_dict()), evaluate_fn=evaluate_fn)
    out = strategy.current_arrays()
    assert list(out.keys()) == list(net.state_dict().keys())
    assert all(out[k].numpy().dtype == np.float32 and out[k].numpy().shape == tuple(v.shape)
               for k, v in net.state_dict().items())
    xs = np.stack([contexts[i].state.array_records[STATE]["x"].numpy() for i in range(N)])
    np.testing.assert_array_equal(strategy.global_model(), xs.mean(axis=0))
    assert len(seen) == 4 and strategy.history[-1].extra["avg_model_test_accuracy"] == seen[-1]  # rounds 4, 8, 12, 14
    assert strategy.history[-1].test_accuracy == seen[-1] > 0.6


# ----------------------------------------------------------------------------- a user's numpy model
def test_numpy_least_squares_dsgd_reaches_the_closed_form_fixed_point() -> None:
    """dsgd with full batches on a user's numpy least-squares model: the nodes converge to the fixed point of (6),
    (alpha blockdiag(A_i'A_i / D) + beta (I - W) (x) I) x = alpha [A_i't_i / D], solved here with numpy (float32
    messages: to float32 accuracy)."""
    data = least_squares_data()
    # alpha = 0 / beta = 0 exponents make the steps constants: alpha_hat = a1 (ln K)^2, beta_hat = a2; a3 = D -> full batch
    K = 200
    a_hat, b_hat = 0.2, 0.5
    strategy = DPQDSGD(min_available_nodes=N, variant="dsgd", horizon=K, a1=a_hat / math.log(K) ** 2, alpha=0.0,
                       a2=b_hat, beta=0.0, a3=30.0, gamma=0.0, seed=0)
    strategy, contexts = run_clients(strategy, lambda c: DPQClient(LeastSquares(3), data[pid(c)], seed=0),
                                     num_nodes=N, num_rounds=K + 2, initial_arrays=ArrayRecord([np.zeros(3)]))
    w = topology.metropolis_weights(topology.ring(N))
    mat = b_hat * np.kron(np.eye(N) - w, np.eye(3))
    rhs = np.zeros(3 * N)
    for i, (a, t) in enumerate(data):
        mat[3 * i:3 * i + 3, 3 * i:3 * i + 3] += a_hat * a.T @ a / a.shape[0]
        rhs[3 * i:3 * i + 3] = a_hat * a.T @ t / a.shape[0]
    x_star = np.linalg.solve(mat, rhs).reshape(N, 3)
    xs = np.stack([contexts[i].state.array_records[STATE]["x"].numpy() for i in range(N)])
    np.testing.assert_allclose(xs, x_star, rtol=0, atol=1e-6)
    assert strategy.history[-1].epsilon is None  # no noise, no privacy claim


@pytest.mark.parametrize("variant", ["dpq", "dp-only"])
def test_numpy_model_on_flower_equals_the_simulator(variant: str) -> None:
    """The same user model and data in simulate() (per-node engine) and through the strategy: bit for bit."""
    data = least_squares_data(rows=25)
    strategy = DPQDSGD(min_available_nodes=N, variant=variant, q_step=0.25, horizon=20, a3=2.0, seed=0)
    strategy, contexts = run_clients(strategy, lambda c: DPQClient(LeastSquares(3), data[pid(c)], seed=3),
                                     num_nodes=N, num_rounds=6, initial_arrays=ArrayRecord([np.full(3, 0.5)]))
    assert strategy.params is not None
    params = replace(strategy.params, seed=3)  # the devices' seed
    objectives = [dpq.local_objective(LeastSquares(3), ArrayData(*data[i])) for i in range(N)]
    ref = dpq.simulate(params, topology.metropolis_weights(topology.ring(N)), objectives, np.full(3, 0.5), 5,
                       engine="per_node")
    xs = np.stack([contexts[i].state.array_records[STATE]["x"].numpy() for i in range(N)])
    np.testing.assert_array_equal(xs, ref.x)


# ----------------------------------------------------------------------------- untrusted input
def padded(raw: NDArray[np.uint8]) -> NDArray[np.uint8]:
    """The same levels with a 16-bit width: decodable bit by bit, but not what the codec writes (and 16 / b times
    the bytes the server would forward to every neighbour)."""
    levels = quantize.decode_levels({"qlevels": raw})
    head = raw[:13].copy()
    head[8] = 16
    return np.concatenate([head, (levels - levels.min()).astype(">u2").view(np.uint8)])


class Padder(DPQClient):
    """A lying node: publishes its round-2 message padded."""

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[Any], int, dict[str, Any]]:
        arrays, n, metrics = super().fit(parameters, config)
        if self.agent_id == 2 and int(config["server-round"]) == 2:
            arrays[0] = padded(arrays[0])
        return arrays, n, metrics


def test_a_padded_message_is_refused_by_the_server_and_the_run_stops() -> None:
    data = least_squares_data()
    strategy = DPQDSGD(min_available_nodes=N, horizon=10, seed=0)
    with pytest.raises(RoundFailed, match=r"round 2: no valid \w+ from \w+\(s\) \[2\].*non-canonical header"):
        run_clients(strategy, lambda c: Padder(LeastSquares(3), data[pid(c)], seed=0), num_nodes=N, num_rounds=4,
                    initial_arrays=ArrayRecord([np.zeros(3)]))
    assert strategy.outbox_round == 1  # nothing of round 2 is in the outbox: it is never forwarded


def _client(i: int, **kw: Any) -> DPQClient:
    context = Context(run_id=0, node_id=i, node_config={"partition-id": i, "num-partitions": N}, state=RecordDict(),
                      run_config={})
    return DPQClient(LeastSquares(3), least_squares_data()[i], context=context, seed=0, **kw)


def _messages(strategy: DPQDSGD, server_round: int) -> dict[int, RecordDict]:
    return dict(strategy.train_contents(server_round))


def _started(**kw: Any) -> DPQDSGD:
    strategy = DPQDSGD(min_available_nodes=N, horizon=10, seed=0, **kw)
    strategy.initialize(ArrayRecord([np.zeros(3)]))
    strategy.prepare(6)
    strategy.attach({i: i for i in range(N)})
    return strategy


def test_a_node_refuses_what_a_lying_server_forwards() -> None:
    """The node decodes and range-checks every neighbour message itself, and holds the server to the run constants
    of the bootstrap."""
    strategy = _started()
    clients = {i: _client(i) for i in range(N)}
    first = _messages(strategy, 1)
    strategy.consume_replies(1, [(i, clients[i].handle("train", first[i])) for i in range(N)])
    second = _messages(strategy, 2)

    # a huge (but decodable) neighbour message
    forged = RecordDict({"arrays": ArrayRecord([quantize.encode_levels(np.array([0, 2**40, 5]))["qlevels"],
                                                second[0]["arrays"].to_numpy_ndarrays()[1]]),
                         "config": second[0]["config"]})
    with pytest.raises(ValueError, match=r"refused neighbour 1's message: \|z\| reaches 1.1e\+12"):
        clients[0].handle("train", forged)
    # a padded one
    inbox = second[0]["arrays"].to_numpy_ndarrays()
    bad = RecordDict({"arrays": ArrayRecord([padded(inbox[0]), inbox[1]]), "config": second[0]["config"]})
    with pytest.raises(ValueError, match="refused neighbour 1's message: non-canonical header"):
        clients[0].handle("train", bad)
    # changed run constants
    config = dict(second[0]["config"])
    config["dpq-alpha-hat"] = float(config["dpq-alpha-hat"]) * 2  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"changed the run constants \['dpq-alpha-hat'\]"):
        clients[0].handle("train", RecordDict({"arrays": second[0]["arrays"], "config": ConfigRecord(config)}))
    # a mixing row that is not a probability vector
    config = dict(second[0]["config"])
    config["weights"] = json.dumps([0.5, 0.5])
    with pytest.raises(ValueError, match="not a probability vector"):
        clients[0].handle("train", RecordDict({"arrays": second[0]["arrays"], "config": ConfigRecord(config)}))
    # the untouched message still works: nothing above changed the node's state
    reply = clients[0].handle("train", second[0])
    assert reply["metrics"]["t"] == 2


def test_the_device_keeps_the_last_word_on_its_privacy() -> None:
    # no x_i upload unless the device allows it
    strategy = _started(evaluate_average=True)
    msg = _messages(strategy, 1)[0]
    msg["config"]["dpq-eval"], msg["config"]["dpq-share-state"] = True, True
    with pytest.raises(ValueError, match="share_model=True"):
        _client(0).handle("train", msg)
    reply = _client(0, share_model=True).handle("train", msg)
    assert len(reply["arrays"]) == 2
    # a privacy floor refuses a noiseless run, and the release that would pass it
    plain = _messages(_started(variant="quant-only"), 1)[0]
    with pytest.raises(ValueError, match="without privacy noise"):
        _client(0, max_epsilon=1.0).handle("train", plain)
    strategy = _started(sigma_scale=1e-4)  # tiny noise: eps_0 = c_0 S_0 / sigma_1 is large
    clients = {i: _client(i, max_epsilon=1.0) for i in range(N)}
    first = _messages(strategy, 1)
    strategy.consume_replies(1, [(i, clients[i].handle("train", first[i])) for i in range(N)])
    assert strategy.schedule is not None and strategy.schedule.eps(0) > 1.0
    with pytest.raises(ValueError, match=r"refused: this release would take the device's epsilon \(Theorem 1\)"):
        clients[0].handle("train", _messages(strategy, 2)[0])


# ----------------------------------------------------------------------------- what the constructors say
def test_buffers_stay_beside_x_and_a_private_device_refuses_them() -> None:
    data = images(10, 0)
    client = DPQClient(TinyCNN(norm=True), data)  # no noise asked for yet: the buffers are the node's own
    assert client.model.dim == client.model.num_trainable and client.beside_names[-1] == "norm.num_batches_tracked"
    with pytest.raises(ValueError, match=r"opacus\.validators\.ModuleValidator\.fix\(model\)"):
        DPQClient(TinyCNN(norm=True), data, max_epsilon=5.0)
    with pytest.raises(ValueError, match="must be exactly the trainable weights"):
        dpq.TorchObjective(TorchModel(TinyCNN(norm=True), buffers="in-vector"), as_local_data(data))
    with pytest.raises(ValueError, match="trains the user's model"):
        DPQClient(None, data)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"variant": "noisy"}, "variant"), ({"q_step": 0.0}, "q_step"), ({"a1": -1.0}, "a1"), ({"horizon": 1}, "horizon"),
    ({"sigma_offset": 0.0}, "sigma_offset"), ({"dp_C": 0.0}, "dp_C"), ({"delta_shift": 2}, "delta_shift"),
    ({"self_term": "y"}, "self_term"), ({"sigma_scale": 0.0}, "sigma_scale"),
])
def test_bad_hyperparameters_name_the_argument(kwargs: dict[str, Scalar], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        DPQDSGD(**kwargs)


def _prepared(num_rounds: int, **kw: Any) -> DPQDSGD:
    s = DPQDSGD(min_available_nodes=N, **kw)
    s.initialize(ArrayRecord([np.zeros(3)]))
    s.prepare(num_rounds)
    return s


def test_the_horizon_fixes_the_run_length() -> None:
    with pytest.raises(ValueError, match="num_rounds >= 4"):
        _prepared(3)
    with pytest.raises(ValueError, match="exceeds horizon \\+ 2 = 12"):
        _prepared(13, horizon=10)
    with pytest.raises(ValueError, match="a2 < K\\^beta"):
        _prepared(20, a2=10.0)  # K = 18: 18^0.75 = 8.7
    p = _prepared(2002).params
    assert p is not None and (p.batch_size, p.K) == (50, 2000)  # the paper's MNIST schedule
    assert p.alpha_hat == pytest.approx(0.0101104007, abs=5e-11)
    assert _prepared(5, horizon=2000).params == p  # a few rounds of the horizon-2000 schedule


def test_a_device_without_a_seed_draws_fresh_noise() -> None:
    data = least_squares_data()
    outs = []
    for _ in range(2):
        strategy = DPQDSGD(min_available_nodes=N, horizon=10, seed=0)
        run_clients(strategy, lambda c: DPQClient(LeastSquares(3), data[pid(c)]), num_nodes=N, num_rounds=2,
                    initial_arrays=ArrayRecord([np.zeros(3)]))
        outs.append(strategy.outbox[0][0])
    assert not np.array_equal(outs[0], outs[1])
