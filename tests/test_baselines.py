"""The comparison baselines of arXiv 2310.19558 (Figs. 7-8): FedAvg, FedProx, SCAFFOLD, FedDyn (+ sparse, DP, Flower's own).

Closed forms on quadratics, the server updates by hand, the papers' known fixed points, and every registry key on
the in-process driver.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message
from flwr.supercore.task_identity import TaskIdentity
from numpy.typing import NDArray

from fedpdm_flower.fedapp.algorithms.local_sgd import (
    feddyn_linear_update,
    feddyn_server_update,
    local_sgd,
    model_average,
    scaffold_control_delta,
    scaffold_server_update,
)
from fedpdm_flower.fedapp.client_app import handle
from fedpdm_flower.fedapp.compression.codec import MalformedPayload, SparseVector
from fedpdm_flower.fedapp.compression.paired import pair_from_arrays, pair_to_arrays
from fedpdm_flower.fedapp.config import RunConfig, parse_run_config
from fedpdm_flower.fedapp.localdata import ArrayData
from fedpdm_flower.fedapp.models import NonconvexL1Logistic
from fedpdm_flower.fedapp.privacy.gaussian import gaussian_noise_std, local_sgd_sensitivity, per_round_epsilon_eq36
from fedpdm_flower.fedapp.runner import build_strategy
from fedpdm_flower.strategies.flower_builtin import FlowerOnlyError, FlwrFedAvg, FlwrFedProx
from simulations.inprocess import make_contexts, run_inprocess

FloatArray = NDArray[np.float64]
BASE = ("fedavg", "fedprox", "scaffold", "feddyn")
SMALL = {"dataset": "synthetic", "partitioner": "iid", "num-clients": 6, "clients-per-round": 3, "num-server-rounds": 3,
         "batch-size": 10, "eta0": 0.05, "alpha-up": 0.1, "alpha-down": 0.5, "dp-calibration": "eq36", "delta": 1e-4}


class Quadratic:
    """f(x) = (s/2)||x - a||^2 whatever the batch: grad = s (x - a)."""

    def __init__(self, a: FloatArray, s: float = 1.0) -> None:
        self.a, self.s = a, s

    def grad(self, x: FloatArray, features: FloatArray, targets: NDArray[Any]) -> FloatArray:
        return self.s * (x - self.a)


def _full_batch(model: Quadratic, x0: FloatArray, q: int, eta: float, **kw: Any) -> FloatArray:
    # batch_size >= |D_i| = 4: every step is full-batch and Q = max_steps
    return local_sgd(x0, ArrayData(np.zeros((4, 1)), np.zeros(4)), model, eta=eta, batch_size=4, max_steps=q, clip=kw.pop("clip", None),
                     rng=np.random.default_rng(0), **kw).x


def _dense(x: FloatArray) -> SparseVector:
    return SparseVector(indices=np.arange(len(x)), values=x, dim=len(x))


X0, A = np.array([1.0, -2.0, 0.5]), np.array([0.0, 1.0, 2.0])


# ----------------------------------------------------------------------------- local loop: closed forms
def test_fedavg_steps_closed_form() -> None:
    eta, q = 0.1, 7
    np.testing.assert_allclose(_full_batch(Quadratic(A), X0, q, eta), X0 + (1 - (1 - eta) ** q) * (A - X0), rtol=1e-14)


def test_fedprox_steps_closed_form() -> None:
    eta, q, mu = 0.1, 7, 0.5
    star = (A + mu * X0) / (1 + mu)  # minimiser of f + (mu/2)||x - x0||^2
    expected = star + (1 - eta * (1 + mu)) ** q * (X0 - star)
    np.testing.assert_allclose(_full_batch(Quadratic(A), X0, q, eta, prox=mu), expected, rtol=1e-14)


def test_scaffold_correction_closed_form() -> None:
    eta, q, v = 0.1, 5, np.array([0.3, -0.1, 0.2])  # v = c - c_i shifts the target to a - v
    expected = X0 + (1 - (1 - eta) ** q) * (A - v - X0)
    np.testing.assert_allclose(_full_batch(Quadratic(A), X0, q, eta, correction=v), expected, rtol=1e-14)


def test_feddyn_local_problem_closed_form() -> None:
    eta, q, alpha, gl = 0.05, 9, 2.0, np.array([0.4, 0.0, -1.0])
    star = (A + alpha * X0 + gl) / (1 + alpha)  # minimiser of f - <gl, x> + (alpha/2)||x - x0||^2
    expected = star + (1 - eta * (1 + alpha)) ** q * (X0 - star)
    np.testing.assert_allclose(_full_batch(Quadratic(A), X0, q, eta, prox=alpha, linear=gl), expected, rtol=1e-13)


def test_l1_subgradient_and_clipping_one_step_by_hand() -> None:
    x0 = np.array([0.5, -0.5, 0.0])
    # x - eta (x - 0 + gamma sign(x)), sign(0) = 0
    np.testing.assert_allclose(_full_batch(Quadratic(np.zeros(3)), x0, 1, 0.1, gamma=0.2), [0.43, -0.43, 0.0], rtol=1e-14)
    # the whole subgradient [3.25, 4.25, 0] is clipped to norm 1 (not the data gradient alone)
    g = np.array([3.25, 4.25, 0.0])
    got = _full_batch(Quadratic(np.zeros(3)), np.array([3.0, 4.0, 0.0]), 1, 0.5, gamma=0.25, clip=1.0)
    np.testing.assert_allclose(got, [3.0, 4.0, 0.0] - 0.5 * g / np.linalg.norm(g), rtol=1e-14)


def test_minibatches_are_disjoint_slices_of_one_permutation_with_q_cap() -> None:
    seen: list[NDArray[Any]] = []

    class Recorder(Quadratic):
        def grad(self, x: FloatArray, features: FloatArray, targets: NDArray[Any]) -> FloatArray:
            seen.append(features[:, 0].astype(int))
            return np.zeros_like(x)

    feats = np.arange(25.0)[:, None]
    res = local_sgd(np.zeros(2), ArrayData(feats, np.zeros(25)), Recorder(np.zeros(2)), eta=0.1, batch_size=10, max_steps=10,
                    clip=None, rng=np.random.default_rng(7))
    assert res.steps == 2  # Q*b < |D_i| = 25 caps Q at 2
    perm = np.random.default_rng(7).permutation(25)
    np.testing.assert_array_equal(np.concatenate(seen), perm[:20])


# ----------------------------------------------------------------------------- server updates by hand
def test_model_average_dense_and_elementwise() -> None:
    x, _ = model_average([_dense(np.array([1.0, 2.0])), _dense(np.array([3.0, 6.0]))], 2)
    np.testing.assert_allclose(x, [2.0, 4.0])
    sparse = [SparseVector(np.array([0]), np.array([1.0]), 3), SparseVector(np.array([0, 1]), np.array([3.0, 2.0]), 3)]
    x, counts = model_average(sparse, 3)
    np.testing.assert_allclose(x, [2.0, 2.0, 0.0])  # nobody sent index 2: 0 (spec A11)
    assert counts.tolist() == [2, 1, 0]


def test_scaffold_updates_by_hand() -> None:
    np.testing.assert_allclose(scaffold_control_delta(np.array([1.0, 2.0]), np.array([0.5, -1.0]), 2, 0.25), [-2.0, 0.0])
    x, c = np.array([1.0, 2.0]), np.zeros(2)
    dy = [_dense(np.array([1.0, 0.0])), _dense(np.array([3.0, 2.0]))]
    dc = [_dense(np.array([2.0, 2.0])), _dense(np.array([0.0, 4.0]))]
    x1, c1, _ = scaffold_server_update(x, c, dy, dc, num_clients=4)
    np.testing.assert_allclose(x1, [3.0, 3.0])  # x + mean dy
    np.testing.assert_allclose(c1, [0.5, 1.5])  # c + (|S|/N) mean dc = c + sum dc / N
    dy_s = [SparseVector(np.array([0]), np.array([1.0]), 2), SparseVector(np.array([0, 1]), np.array([3.0, 2.0]), 2)]
    dc_s = [SparseVector(np.array([0]), np.array([2.0]), 2), SparseVector(np.array([0, 1]), np.array([0.0, 4.0]), 2)]
    x2, c2, counts = scaffold_server_update(x, c, dy_s, dc_s, num_clients=4)
    np.testing.assert_allclose(x2, [3.0, 4.0])  # element-wise mean [2, 2]
    np.testing.assert_allclose(c2, [0.5, 1.0])
    assert counts.tolist() == [2, 1]


def test_feddyn_updates_by_hand() -> None:
    np.testing.assert_allclose(feddyn_linear_update(np.ones(2), np.array([2.0, 0.0]), np.ones(2), 3.0), [-2.0, 4.0])
    thetas = [_dense(np.array([1.0, 3.0])), _dense(np.array([3.0, 5.0]))]
    theta, h, _ = feddyn_server_update(np.zeros(2), thetas, np.ones(2), alpha=2.0, num_clients=4)
    np.testing.assert_allclose(h, [-1.0, -3.0])  # -alpha/N * sum(theta_i - theta_s) = -0.5 * [2, 6]
    np.testing.assert_allclose(theta, [2.5, 5.5])  # mean [2, 4] - h/alpha
    sparse = [SparseVector(np.array([1]), np.array([3.0]), 2), SparseVector(np.array([0, 1]), np.array([3.0, 5.0]), 2)]
    theta, h, _ = feddyn_server_update(np.zeros(2), sparse, np.ones(2), alpha=2.0, num_clients=4)
    np.testing.assert_allclose(h, [-1.0, -3.0])  # drift summed over the senders of each coordinate: [2, 2 + 4]
    np.testing.assert_allclose(theta, [3.5, 5.5])


# ----------------------------------------------------------------------------- algorithm-level properties
def _hetero_quadratics() -> tuple[list[Quadratic], FloatArray]:
    rng = np.random.default_rng(3)
    clients = [Quadratic(rng.normal(size=4), s) for s in (0.5, 1.0, 3.0)]
    weights = np.array([c.s for c in clients])
    optimum = weights @ np.array([c.a for c in clients]) / weights.sum()  # argmin (1/N) sum_i f_i
    return clients, optimum


def _fedavg_rounds(clients: list[Quadratic], rounds: int, eta: float, q: int) -> FloatArray:
    x = np.zeros(4)
    for _ in range(rounds):
        x, _ = model_average([_dense(_full_batch(m, x, q, eta)) for m in clients], 4)
    return x


def _scaffold_rounds(clients: list[Quadratic], rounds: int, eta: float, q: int) -> FloatArray:
    n = len(clients)
    x, c, ci = np.zeros(4), np.zeros(4), [np.zeros(4) for _ in clients]
    for _ in range(rounds):
        dys, dcs = [], []
        for i, m in enumerate(clients):
            dy = _full_batch(m, x, q, eta, correction=c - ci[i]) - x
            dc = scaffold_control_delta(c, dy, q, eta)
            ci[i] = ci[i] + dc
            dys.append(_dense(dy))
            dcs.append(_dense(dc))
        x, c, _ = scaffold_server_update(x, c, dys, dcs, n)
    return x


def test_scaffold_and_feddyn_remove_client_drift_fedavg_does_not() -> None:
    """Full participation, Q = 10 local steps on heterogeneous quadratics: SCAFFOLD and FedDyn reach the optimum."""
    clients, optimum = _hetero_quadratics()
    eta, q, n = 0.1, 10, len(clients)
    assert np.linalg.norm(_fedavg_rounds(clients, 300, eta, q) - optimum) > 1e-2  # FedAvg's biased fixed point
    np.testing.assert_allclose(_scaffold_rounds(clients, 300, eta, q), optimum, atol=1e-8)
    alpha = 1.0
    theta, h, gls = np.zeros(4), np.zeros(4), [np.zeros(4) for _ in clients]
    for _ in range(300):
        thetas = []
        for i, m in enumerate(clients):
            th = _full_batch(m, theta, q, eta, prox=alpha, linear=gls[i])
            gls[i] = feddyn_linear_update(gls[i], th, theta, alpha)
            thetas.append(_dense(th))
        theta, h, _ = feddyn_server_update(h, thetas, theta, alpha, n)
    np.testing.assert_allclose(theta, optimum, atol=1e-8)
    np.testing.assert_allclose(h, np.mean(gls, axis=0), atol=1e-12)  # h = (1/N) sum_i grad L_i


def test_scaffold_with_identical_clients_and_full_participation_equals_fedavg() -> None:
    """c_i = c after every round, so the correction vanishes: the real model, mini-batches, l1 and clipping."""
    rng = np.random.default_rng(0)
    model = NonconvexL1Logistic(3, 5, beta=0.5)
    feats, labels = rng.random((60, 5)), rng.integers(0, 3, 60)
    kw: dict[str, Any] = {"batch_size": 10, "max_steps": 4, "clip": 1.0, "gamma": 0.01}
    x_avg = x_sc = rng.normal(0, 0.1, model.dim)
    c, ci = np.zeros(model.dim), [np.zeros(model.dim) for _ in range(3)]
    for t in range(5):
        eta = 0.1 / math.sqrt(1 + t)
        ys = [local_sgd(x_avg, ArrayData(feats, labels), model, eta=eta, rng=np.random.default_rng(t), **kw).x for _ in range(3)]
        x_avg, _ = model_average([_dense(y) for y in ys], model.dim)
        dys, dcs = [], []
        for i in range(3):
            res = local_sgd(x_sc, ArrayData(feats, labels), model, eta=eta, rng=np.random.default_rng(t), correction=c - ci[i], **kw)
            dy = res.x - x_sc
            dc = scaffold_control_delta(c, dy, res.steps, eta)
            ci[i] = ci[i] + dc
            dys.append(_dense(dy))
            dcs.append(_dense(dc))
        x_sc, c, _ = scaffold_server_update(x_sc, c, dys, dcs, num_clients=3)
        np.testing.assert_allclose(x_sc, x_avg, rtol=0, atol=1e-12)


def _run(alg: str, dp: bool, **over: Any) -> Any:
    cfg = parse_run_config({**SMALL, "algorithm": alg, "dp": dp, **over})
    return run_inprocess(cfg)[0], cfg


@pytest.mark.parametrize("dp", [False, True])
def test_fedprox_with_mu_zero_equals_fedavg_exactly(dp: bool) -> None:
    a, _ = _run("fedavg", dp)
    b, _ = _run("fedprox", dp, mu=0.0)
    np.testing.assert_array_equal(a.x, b.x)


@pytest.mark.parametrize("alg", BASE)
def test_sparse_variant_with_alpha_one_equals_dense(alg: str) -> None:
    a, _ = _run(alg, True)
    b, _ = _run(f"{alg}-sparse", True, **{"alpha-up": 1.0, "alpha-down": 1.0})
    np.testing.assert_array_equal(a.x, b.x)


# ----------------------------------------------------------------------------- every key on the in-process driver
@pytest.mark.parametrize("dp", [False, True])
@pytest.mark.parametrize("alg", BASE)
def test_every_baseline_runs_dense_and_sparse(alg: str, dp: bool) -> None:
    dense, cfg = _run(alg, dp)
    sparse, _ = _run(f"{alg}-sparse", dp)
    for s in (dense, sparse):
        assert len(s.history) == 3 and s.rejected_total == 0
        assert np.all(np.isfinite(s.x)) and all(math.isfinite(r.test_accuracy) for r in s.history)
        priv = s.privacy_summary()
        if dp:
            assert {"eps_eq36", "eps_rdp", "eps_basic", "delta_basic"} <= set(priv)
            for r in s.history:  # (36) inverted per round: after r of T rounds the paper's total is epsbar sqrt(r/T)
                assert r.epsilon == pytest.approx(cfg.epsilon_total * math.sqrt(r.round / 3), rel=1e-9)
                assert r.extra["mean_sigma"] > 0 and r.extra["mean_Q"] == 10
        else:
            assert priv == {} and all(r.epsilon is None and "mean_sigma" not in r.extra for r in s.history)
    # same sampled clients each round, k = 0.1 d uploaded entries instead of d
    for rd, rs in zip(dense.history, sparse.history, strict=True):
        assert rs.uplink_bytes < rd.uplink_bytes
    assert all(r.extra["coverage"] == 1.0 for r in dense.history)
    assert all(r.extra["coverage"] < 1.0 for r in sparse.history)


@pytest.mark.parametrize("alg", BASE)
def test_dp_noise_is_calibrated_with_the_algorithms_contraction(alg: str) -> None:
    cfg = parse_run_config({**SMALL, "algorithm": alg, "dp": True})
    strategy = build_strategy(cfg, evaluate=False)
    ctx = make_contexts(cfg)
    strategy.attach({p: p for p in ctx})
    node, content = strategy.train_contents(1)[0]
    m = {k: float(v) for k, v in handle("train", content, ctx[node]).metric_records["metrics"].items()}  # type: ignore[arg-type]
    eta, q = cfg.eta0, int(m["Q"])
    contraction = {"fedavg": 0.0, "scaffold": 0.0, "fedprox": cfg.mu, "feddyn": cfg.feddyn_alpha}[alg]
    sens = local_sgd_sensitivity(eta, q, cfg.clip_norm, contraction)
    assert m["sensitivity"] == pytest.approx(sens, rel=1e-12)
    eps = per_round_epsilon_eq36(cfg.epsilon_total, cfg.c0, q * cfg.batch_size / m["num-examples"], 0.5, 3)
    assert m["eps_round"] == pytest.approx(eps, rel=1e-12)
    assert m["sigma"] == pytest.approx(gaussian_noise_std(sens, eps, cfg.delta), rel=1e-12)


def test_scaffold_control_delta_is_post_processing_of_the_noisy_upload() -> None:
    cfg = parse_run_config({**SMALL, "algorithm": "scaffold-sparse", "dp": True, "epsilon-total": 1.0})
    strategy = build_strategy(cfg, evaluate=False)
    ctx = make_contexts(cfg)
    strategy.attach({p: p for p in ctx})
    node, content = strategy.train_contents(1)[0]
    reply = handle("train", content, ctx[node])
    m = {k: float(v) for k, v in reply.metric_records["metrics"].items()}  # type: ignore[arg-type]
    dy, dc = pair_from_arrays(reply.array_records["arrays"].to_numpy_ndarrays(), m["payload-format"], strategy.dim)  # type: ignore[attr-defined]
    eta = cfg.eta0
    # round 1: c = 0, so Delta c = -Delta y_noisy / (Q eta), on the same indices, and c_i is exactly that
    np.testing.assert_allclose(dc.values, -dy.values / (m["Q"] * eta), rtol=1e-5)
    ci = ctx[node].state.array_records["scaffold.control"].to_numpy_ndarrays()[0]
    np.testing.assert_allclose(ci[dy.indices], dc.values, rtol=1e-6)
    assert np.count_nonzero(ci) == dy.k == int(0.1 * strategy.dim)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("alg", "state", "server"), [("scaffold-sparse", "scaffold.control", "c"), ("feddyn-sparse", "feddyn.linear", "h")])
def test_server_state_is_the_mean_of_client_states(alg: str, state: str, server: str) -> None:
    """SCAFFOLD c = (1/N) sum_i c_i and FedDyn h = (1/N) sum_i grad L_i survive sparsification, DP and sampling."""
    cfg = parse_run_config({**SMALL, "algorithm": alg, "dp": True, "num-server-rounds": 4})
    strategy, ctx, _ = run_inprocess(cfg, evaluate=False)
    states = [c.state.array_records[state].to_numpy_ndarrays()[0] if state in c.state else np.zeros(strategy.dim)  # type: ignore[attr-defined]
              for c in ctx.values()]
    np.testing.assert_allclose(getattr(strategy, server), np.mean(states, axis=0), atol=1e-5)


def test_fedavg_without_dp_improves_test_accuracy() -> None:
    # softmax regression: eq. (41)'s one-row loss makes the toy's accuracy oscillate from round to round
    s, _ = _run("fedavg", False, model="multinomial", beta=0.0, eta0=0.5, **{"num-server-rounds": 10})
    acc = [r.test_accuracy for r in s.history]
    loss = [r.test_loss for r in s.history]
    assert all(b < a for a, b in itertools.pairwise(loss))
    assert acc[-1] > acc[0] + 0.1 and acc[-1] > 0.9


# ----------------------------------------------------------------------------- wire format of SCAFFOLD's pairs
@pytest.mark.parametrize("sparse", [False, True])
def test_pair_codec_round_trip(sparse: bool) -> None:
    idx = np.array([1, 4, 6]) if sparse else np.arange(8)
    first = SparseVector(idx, np.arange(len(idx), dtype=float) + 1.0, 8)
    arrays, code = pair_to_arrays(first, -first.values, sparse=sparse)
    a, b = pair_from_arrays(arrays, code, 8)
    np.testing.assert_array_equal(a.indices, idx)
    np.testing.assert_array_equal(b.indices, idx)
    np.testing.assert_array_equal(b.values, -a.values)
    with pytest.raises(MalformedPayload):
        pair_from_arrays([*arrays[:-1], arrays[-1][:-1]], code, 8)
    with pytest.raises(MalformedPayload):
        pair_from_arrays(arrays[:1], code, 8)


# ----------------------------------------------------------------------------- Flower's own FedAvg / FedProx
def _flwr_cfg(alg: str, **over: Any) -> RunConfig:
    return parse_run_config({**SMALL, "algorithm": alg, **over})


def test_flower_builtin_strategies_construct_and_summarise() -> None:
    for alg, cls in (("flwr-fedavg", FlwrFedAvg), ("flwr-fedprox", FlwrFedProx)):
        cfg = _flwr_cfg(alg, mu=0.1)
        s = build_strategy(cfg, evaluate=False)
        assert isinstance(s, cls)
        s.summary()
        assert s.x.shape == (84,) and s.history == [] and s.privacy_summary() == {} and s.rejected_total == 0
        assert s.fraction_train == 0.5 and s.min_train_nodes == 3 and s.min_available_nodes == 6
    assert build_strategy(_flwr_cfg("flwr-fedprox", mu=0.1), evaluate=False).proximal_mu == 0.1
    # the same x_0^0 as our strategies
    np.testing.assert_array_equal(build_strategy(_flwr_cfg("flwr-fedavg"), evaluate=False).x,
                                  build_strategy(_flwr_cfg("fedavg"), evaluate=False).x)


def test_flower_builtin_refuses_the_inprocess_driver() -> None:
    with pytest.raises(FlowerOnlyError, match="needs a Flower Grid"):
        run_inprocess(_flwr_cfg("flwr-fedavg"), evaluate=False)


def test_flower_builtin_bookkeeping_with_a_stub_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the Flower engine: Flower's own configure/aggregate on a stub Grid, our FedAvg client answering."""
    for attr in ("_run_id", "_node_id", "_task_id"):  # what the ServerApp runtime would set
        monkeypatch.setattr(TaskIdentity, attr, 0)

    class StubGrid:
        def get_node_ids(self) -> list[int]:
            return list(range(6))

    cfg = _flwr_cfg("flwr-fedprox", dp=True, **{"num-server-rounds": 2})
    s = build_strategy(cfg, evaluate=False)
    ctx = make_contexts(cfg)
    arrays = s.current_arrays()
    for rnd in (1, 2):
        msgs = list(s.configure_train(rnd, arrays, ConfigRecord(), StubGrid()))
        config = msgs[0].content["config"]
        assert len(msgs) == 3 and config["proximal-mu"] == cfg.mu
        # the local loop's settings travel in the message: eta^t = eta0 / sqrt(t), T of (36) = num rounds, p = K/N
        assert config["eta"] == pytest.approx(cfg.eta0 / np.sqrt(rnd)) and config["dp-horizon"] == 2
        assert config["dp-participation"] == 0.5 and config["batch-size"] == cfg.batch_size
        replies = [Message(handle("train", m.content, ctx[m.metadata.dst_node_id]), reply_to=m) for m in msgs]
        new, _ = s.aggregate_train(rnd, replies)
        assert new is not None
        np.testing.assert_array_equal(s.x, new.to_numpy_ndarrays()[0])
        s._evaluate_hook(rnd, new)
        arrays = new
    assert [r.round for r in s.history] == [1, 2]
    assert all(r.uplink_bytes > 0 and r.downlink_bytes > 0 and r.extra["clients"] == 3 for r in s.history)
    assert s.history[-1].epsilon == pytest.approx(cfg.epsilon_total, rel=1e-9)  # T = 2 rounds of (36)
