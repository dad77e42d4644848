"""DP-IADMM / OutP on the public layer, as a Flower user meets them: their own model and data, our classes.

The models and data of the user-facing tests are defined here, and the checks are against independent truth: a
from-scratch numpy Algorithm 1 for a torch softmax regression, torch autograd sample by sample for the clipped
gradients, the paper's formulas for the noise scales. One test also pins that the reproduction app is a thin
caller of the same classes (bit for bit).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedpdm_flower.clients.base import FedClient
from fedpdm_flower.clients.iadmm import IADMMClient, OutPClient
from fedpdm_flower.fedapp.algorithms.iadmm import (
    AgentData,
    EtaSchedule,
    ModelObjective,
    MultinomialObjective,
    ObjectivePerturbation,
    OutputPerturbation,
    RhoSchedule,
    local_objective,
    rho_schedule,
)
from fedpdm_flower.fedapp.localdata import ArrayData
from fedpdm_flower.fedapp.models.multinomial import MultinomialLogistic
from fedpdm_flower.fedapp.models.torch_model import TorchModel
from fedpdm_flower.fedapp.privacy.dpsgd import dpsgd_epsilon
from fedpdm_flower.fedapp.privacy.gaussian import gaussian_noise_std
from fedpdm_flower.fedapp.privacy.laplace import laplace_rdp_epsilon
from fedpdm_flower.fedapp.privacy.target import PrivacyNotChosen, PrivacyTarget
from fedpdm_flower.strategies.base import FederationError, RoundFailed
from fedpdm_flower.strategies.iadmm import DPIADMM, ObjP, ObjPM, OutP, ReplicatedDualError
from simulations.inprocess import run_clients

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- a user's models and data
class Softmax(nn.Module):
    """Softmax regression without bias: the paper's model (63) written as a torch module."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class MLP(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def blobs(n: int, seed: int, features: int = 8, classes: int = 3) -> TensorDataset:
    """Gaussian blobs around fixed class centres (the same centres for every seed)."""
    centres = torch.Generator().manual_seed(123)
    mu = 2.0 * torch.randn(classes, features, generator=centres)
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(mu[y] + torch.randn(n, features, generator=g), y)


def accuracy(net: nn.Module, data: TensorDataset) -> float:
    with torch.no_grad():
        return float((net(data.tensors[0]).argmax(1) == data.tensors[1]).double().mean())


def context(node: int = 0) -> Context:
    return Context(run_id=1, node_id=node, node_config={"partition-id": node}, state=RecordDict(), run_config={})


SIZES = (60, 90, 75)


# ----------------------------------------------------------------------------- independent truth: Algorithm 1
def test_torch_softmax_regression_follows_a_from_scratch_algorithm_1() -> None:
    """Non-private DP-IADMM on a user's torch softmax regression equals Algorithm 1 written here in numpy."""
    torch.manual_seed(0)
    parts = [blobs(n, 10 + i) for i, n in enumerate(SIZES)]
    net = Softmax(8, 3)
    w0 = net.state_dict()["fc.weight"].numpy().astype(np.float64)
    beta, rounds, big_e = 1e-2, 4, 3
    strategy = DPIADMM(local_updates=big_e, privacy=None, beta=beta, min_available_nodes=3, seed=0)

    def client_fn(ctx: Context) -> FedClient:
        return IADMMClient(Softmax(8, 3), parts[int(ctx.node_config["partition-id"])], seed=0)

    run_clients(strategy, client_fn, num_nodes=3, num_rounds=rounds, initial_arrays=ArrayRecord(net.state_dict()))

    total, p = sum(SIZES), len(SIZES)
    z = [w0.copy() for _ in parts]
    last = [w0.copy() for _ in parts]
    lam = [np.zeros_like(w0) for _ in parts]
    for t in range(1, rounds + 1):
        rho, eta = 2.0 * 1.2 ** (t // 10_000), 1.0 / math.sqrt(t)  # (24) without privacy, (19)
        w = sum(zp - lp / rho for zp, lp in zip(z, lam, strict=True)) / p
        for i, ds in enumerate(parts):
            x, y = ds.tensors[0].double().numpy(), ds.tensors[1].numpy()
            zz, acc = last[i], np.zeros_like(w0)
            for _ in range(big_e):
                s = x @ zz.T
                h = np.exp(s - s.max(1, keepdims=True))
                h /= h.sum(1, keepdims=True)
                h[np.arange(len(y)), y] -= 1.0
                g = h.T @ x / total + 2 * beta / p * zz
                zz = (zz / eta + rho * w + lam[i] - g) / (1 / eta + rho)
                acc += zz
            z[i], last[i] = acc / big_e, zz
            lam[i] = lam[i] + rho * (w - z[i])
    got = strategy.current_arrays()
    assert list(got) == ["fc.weight"] and got["fc.weight"].numpy().dtype == np.float32
    np.testing.assert_allclose(strategy.x.reshape(3, 8), w, rtol=0, atol=2e-5)  # float32 torch vs float64 here
    np.testing.assert_allclose(strategy.lam.reshape(3, 3, 8), np.stack(lam), rtol=0, atol=2e-5)
    assert all(r.extra["dual_mismatch"] == 0.0 for r in strategy.history)
    assert strategy.total == total  # learned from the agents before round 1


def test_the_reproduction_app_builds_the_same_public_classes_bit_for_bit() -> None:
    """run_inprocess on a run config == a user's ObjPM / OutP + clients given the same model, data and seeds."""
    from fedpdm_flower.fedapp.apps.iadmm import iadmm_client, iadmm_strategy
    from fedpdm_flower.fedapp.config import parse_run_config
    from fedpdm_flower.fedapp.task import build_model, client_dataset
    from simulations.inprocess import run_inprocess

    for algorithm in ("objpm", "outp"):
        cfg = parse_run_config({"dataset": "synthetic", "partitioner": "iid", "num-clients": 3,
                                "clients-per-round": 3, "model": "multinomial-nobias", "num-server-rounds": 3,
                                "iadmm-epsilon": 0.5, "algorithm": algorithm})
        app, _, _ = run_inprocess(cfg, evaluate=False)
        assert isinstance(app, type(iadmm_strategy(cfg)))
        parts = [client_dataset(cfg, i, 3) for i in range(3)]
        total = sum(len(d) for d in parts)
        user: Any = (ObjPM(privacy=ObjectivePerturbation(0.5), min_available_nodes=3, seed=cfg.seed)
                     if algorithm == "objpm" else
                     OutP(privacy=OutputPerturbation(0.5), min_available_nodes=3, seed=cfg.seed))
        cls = IADMMClient if algorithm == "objpm" else OutPClient

        def client_fn(ctx: Context, cls: Any = cls, parts: Any = parts, cfg: Any = cfg) -> FedClient:
            return cls(build_model(cfg), parts[int(ctx.node_config["partition-id"])], seed=cfg.seed)

        dim = build_model(cfg).dim
        run_clients(user, client_fn, num_nodes=3, num_rounds=3, initial_arrays=ArrayRecord([np.zeros(dim)]))
        np.testing.assert_array_equal(user.x, app.x)
        np.testing.assert_array_equal(user.lam, app.lam)
        assert user.total == total == app.total
        node = Context(run_id=1, node_id=0, node_config={"partition-id": 0, "num-partitions": 3},
                       state=RecordDict(), run_config={})
        assert isinstance(iadmm_client(cfg, node), cls)


# ----------------------------------------------------------------------------- a user's MLP with clipped sensitivity
def _mlp_run(strategy: Any, rounds: int = 4, client: type[IADMMClient] = IADMMClient,
             **client_kw: Any) -> tuple[Any, nn.Module, TensorDataset, dict[int, Context]]:
    torch.manual_seed(1)
    net, test = MLP(), blobs(300, 99)

    def client_fn(ctx: Context) -> FedClient:
        pid = int(ctx.node_config["partition-id"])
        return client(MLP(), DataLoader(blobs(SIZES[pid], pid), batch_size=32), loss_fn=nn.CrossEntropyLoss(),
                      seed=pid, **client_kw)

    def central(rnd: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"accuracy": accuracy(net, test)})

    _, contexts = run_clients(strategy, client_fn, num_nodes=3, num_rounds=rounds,
                              initial_arrays=ArrayRecord(net.state_dict()), evaluate_fn=central)
    return strategy, net, test, contexts


def test_objpm_trains_a_users_mlp_with_clipped_sensitivity_and_returns_its_state_dict() -> None:
    eps, clip = 1.0, 10.0
    strategy, net, test, contexts = _mlp_run(ObjPM(privacy=ObjectivePerturbation(eps, "clipped", clip_norm=clip),
                                                   rho=0.5, eta=2.0, min_available_nodes=3, seed=0))
    acc = [r.test_accuracy for r in strategy.history]
    # three blobs, chance 1/3; round 1 evaluates the initial model (the w it broadcast, spec A11); measured
    # 0.42 -> 0.97 over the four rounds
    assert acc[-1] > 0.85 > acc[0], acc
    out = strategy.current_arrays()
    assert list(out) == list(net.state_dict())
    assert all(out[k].numpy().dtype == np.float32 for k in out)
    net.load_state_dict(out.to_torch_state_dict())
    assert accuracy(net, test) == pytest.approx(acc[-1])
    total = sum(SIZES)
    for t, rec in enumerate(strategy.history, start=1):
        assert rec.extra["dual_mismatch"] == 0.0
        assert rec.extra["delta_max"] == pytest.approx(2 * clip / total)  # Delta = 2 C / I, data-independent
        assert rec.extra["lap_scale_mean"] == pytest.approx(2 * clip / total / eps)  # b = Delta / eps-bar (9a)
        # Renyi DP of the t E solves (basic composition, t E eps-bar, is the bound beside it)
        assert rec.epsilon == pytest.approx(laplace_rdp_epsilon(10 * t, eps, 1e-5)) and rec.delta == 1e-5
        assert rec.epsilon < 10 * t * eps
    assert set(contexts[0].state.array_records) >= {"iadmm.dual", "iadmm.z"}


def test_clipped_gradient_sum_moves_by_at_most_2c_when_one_sample_is_replaced() -> None:
    """The sensitivity of the clipped data term, checked with torch autograd one sample at a time."""
    torch.manual_seed(2)
    model = TorchModel(MLP(), nn.CrossEntropyLoss())
    z = model.get_flat()
    ds = blobs(40, 3)
    x, y = ds.tensors[0].clone(), ds.tensors[1].clone()
    for norm, clip in ((1, 0.5), (2, 0.2)):
        obj = ModelObjective(model, ArrayData(x, y), 40, 0.0, 1, clip=clip, norm=norm, chunk=16)
        total = obj.data_gradient_sum(z)
        ref = np.zeros(model.dim)  # sample by sample with autograd, clipped here
        for i in range(40):
            g = model.grad(z, x[i:i + 1], y[i:i + 1])
            ref += g * min(1.0, clip / np.linalg.norm(g, ord=norm))
        np.testing.assert_allclose(total, ref, rtol=1e-5, atol=1e-6)
        for _ in range(5):
            x2, y2 = x.clone(), y.clone()
            i = int(torch.randint(0, 40, ()))
            x2[i], y2[i] = 10 * torch.randn(8), int(torch.randint(0, 3, ()))
            other = ModelObjective(model, ArrayData(x2, y2), 40, 0.0, 1, clip=clip, norm=norm).data_gradient_sum(z)
            assert np.linalg.norm(total - other, ord=norm) <= 2 * clip * (1 + 1e-6)
        _, delta = obj.terms(z)
        assert delta == pytest.approx(2 * clip / 40)


def test_multinomial_clipped_closed_form_equals_clipping_every_sample() -> None:
    rng = np.random.default_rng(4)
    x, y = rng.uniform(0, 1, (30, 6)), rng.integers(0, 4, 30)
    z = rng.normal(0, 0.3, (4, 6))
    for norm, clip in ((1, 1.5), (2, 0.4)):
        obj = MultinomialObjective(AgentData(x, y, 4, 50, 0.1, 2), "clipped", clip, norm=norm)
        g, delta = obj.terms(z)
        ref = np.zeros((4, 6))
        for i in range(30):
            s = z @ x[i]
            h = np.exp(s - s.max())
            h /= h.sum()
            h[y[i]] -= 1.0
            gi = np.outer(h, x[i])
            ref += gi * min(1.0, clip / np.linalg.norm(gi.ravel(), ord=norm))
        np.testing.assert_allclose(g, ref / 50 + 2 * 0.1 / 2 * z, rtol=1e-12, atol=1e-14)
        assert delta == 2 * clip / 50


# ----------------------------------------------------------------------------- what a model lacks, named
def test_the_paper_sensitivity_needs_the_multinomial_model_and_clipping_needs_per_sample_gradients() -> None:
    with pytest.raises(RoundFailed, match="closed form of the paper's multinomial logistic model"):
        _mlp_run(ObjP(privacy=ObjectivePerturbation(1.0), min_available_nodes=3, seed=0), rounds=1)

    class NumpyQuadratic:  # a user's numpy model without per-sample gradients
        dim = 4

        def grad(self, x: Any, f: Any, t: Any) -> Any:
            return x - np.mean(f, axis=0)

        def loss(self, x: Any, f: Any, t: Any) -> float:
            return 0.0

    data = ArrayData(np.ones((5, 4)), np.zeros(5))
    with pytest.raises(TypeError, match=r"NumpyQuadratic has no per_sample_grads\(x, inputs, targets\)"):
        local_objective(NumpyQuadratic(), data, total=5, beta=0.0, num_agents=1, sensitivity="clipped", clip=1.0)
    plain = local_objective(NumpyQuadratic(), data, total=10, beta=0.0, num_agents=1, sensitivity=None)
    g, delta = plain.terms(np.zeros(4))
    np.testing.assert_allclose(g, -0.5 * np.ones(4))  # (I_p / I) times the model's mean gradient
    assert delta == 0.0


def test_without_noise_any_model_runs_under_the_default_mode() -> None:
    strategy, *_ = _mlp_run(DPIADMM(privacy=None, rho=1.0, eta=1.0, local_updates=5, min_available_nodes=3, seed=0),
                            rounds=3)
    assert strategy.history[-1].test_accuracy > 0.8 and strategy.history[-1].epsilon is None


# ----------------------------------------------------------------------------- the federation and the messages
def test_a_missing_agent_stops_the_run_naming_it() -> None:
    parts = [blobs(n, i) for i, n in enumerate(SIZES)]

    def client_fn(ctx: Context) -> FedClient:
        pid = int(ctx.node_config["partition-id"])
        if pid == 2:
            raise RuntimeError("disk full")
        return IADMMClient(MLP(), parts[pid], seed=0)

    strategy = ObjP(privacy=None, min_available_nodes=3, seed=0, total_samples=sum(SIZES))
    with pytest.raises(ReplicatedDualError, match=r"agent\(s\) \[2\] \(node\(s\) \[2\];.*diverge\).*disk full"):
        run_clients(strategy, client_fn, num_nodes=3, num_rounds=2, initial_arrays=ArrayRecord(MLP().state_dict()))
    assert issubclass(ReplicatedDualError, FederationError)  # as RoundFailed: the server app reports it the same way

    without = ObjP(privacy=None, min_available_nodes=3, seed=0)  # I must be asked first: the agent is named there
    with pytest.raises(FederationError, match=r"node 2 \(agent 2\) failed before round 1.*disk full"):
        run_clients(without, client_fn, num_nodes=3, num_rounds=1, initial_arrays=ArrayRecord(MLP().state_dict()))


def test_the_strategy_is_the_single_source_of_truth() -> None:
    s = DPIADMM(local_updates=3, privacy=ObjectivePerturbation(0.5, "clipped", clip_norm=4.0, delta=1e-6),
                rho=RhoSchedule.femnist(), eta=EtaSchedule("const", 0.2), beta=1e-3, box=5.0, total_samples=999,
                min_available_nodes=2, seed=0)
    s.initialize(ArrayRecord(MLP().state_dict()))
    s.prepare(10)
    s.attach({0: 10, 1: 11})
    s.begin_round(2)
    (_, content), _ = s.train_contents(2)
    cfg = dict(content.config_records["config"])
    assert cfg["rho"] == rho_schedule(2, 0.5, 0.005, 0.05, 2000) and cfg["eta"] == 0.2
    assert cfg["local-updates"] == 3 and cfg["dp"] is True and cfg["epsilon"] == 0.5
    assert cfg["dp-mechanism"] == "laplace-objective" and cfg["dp-delta"] == 1e-6
    assert cfg["sensitivity-mode"] == "clipped" and cfg["clip"] == 4.0 and cfg["box"] == 5.0
    assert cfg["beta"] == 1e-3 and cfg["num-agents"] == 2 and cfg["total-samples"] == 999
    assert cfg["iadmm-algorithm"] == "dp-iadmm" and cfg["iadmm-form"] == "replicated" and cfg["server-round"] == 2

    d = ObjPM(privacy=PrivacyTarget(epsilon=3.0, clip_norm=2.0, sample_rate=0.05), total_samples=999,
              min_available_nodes=2, seed=0)
    d.initialize(ArrayRecord(MLP().state_dict()))
    d.prepare(20)  # calibrated for 10 steps x 20 rounds per device
    d.attach({0: 10, 1: 11})
    d.begin_round(1)
    (_, content), _ = d.train_contents(1)
    cfg = dict(content.config_records["config"])
    assert (cfg["dp-mechanism"], cfg["dp-sample-rate"], cfg["clip"], cfg["dp-steps"]) == ("dp-sgd", 0.05, 2.0, 10)
    z = cfg["dp-noise-multiplier"]
    assert dpsgd_epsilon(z, 0.05, 200, 1e-5) <= 3.0 < dpsgd_epsilon(0.999 * z, 0.05, 200, 1e-5)
    assert cfg["rho"] == 2.0  # (24) without its c2 / epsilon-bar offset: DP-SGD has no per-solve budget
    assert "epsilon" not in cfg and "sensitivity-mode" not in cfg

    o = OutP(privacy=OutputPerturbation(1.0, delta_bar=1e-5, sensitivity_mode="clipped", clip_norm=1.0,
                                        noise_std="sigma-squared"), rho=3.0, eta_scale=2.0, order="alg1",
             grad_scale="global", total_samples=50, min_available_nodes=2)
    o.initialize(ArrayRecord(MLP().state_dict()))
    o.prepare(1)
    o.attach({0: 0, 1: 1})
    (_, content), _ = o.train_contents(1)
    cfg = dict(content.config_records["config"])
    assert cfg["dp"] is True and cfg["epsilon"] == 1.0 and cfg["rho"] == 3.0 and cfg["eta-scale"] == 2.0
    assert (cfg["order"], cfg["noise-std"], cfg["grad-scale"]) == ("alg1", "sigma-squared", "global")
    assert cfg["iadmm-algorithm"] == "outp" and cfg["dp-mechanism"] == "gaussian-output" and cfg["delta"] == 1e-5
    n = OutP(privacy=None, total_samples=50, min_available_nodes=2)
    n.initialize(ArrayRecord(MLP().state_dict()))
    n.prepare(1)
    n.attach({0: 0, 1: 1})
    assert n.pre_train_contents(1) == []  # I is known and nothing to check: no exchange before round 1
    (_, content), _ = n.train_contents(1)
    assert content.config_records["config"]["dp"] is False


def test_constructors_name_the_bad_argument() -> None:
    # built without privacy=: refused, naming what to pass; no epsilon picked, and no silent noiseless run
    with pytest.raises(PrivacyNotChosen, match=r"DPIADMM is a differentially private strategy and needs privacy=: "
                                               r".*privacy=ObjectivePerturbation\(epsilon_bar=...\)"
                                               r".*or privacy=None"):
        DPIADMM()
    with pytest.raises(PrivacyNotChosen, match=r"privacy=OutputPerturbation\(epsilon_bar=...\)"):
        OutP()
    assert DPIADMM(privacy=None).plan.private is False
    for make, why in [
        (lambda: DPIADMM(privacy=PrivacyTarget(epsilon=8.0)), "needs the Poisson sample rate"),
        (lambda: DPIADMM(privacy=None, fraction_train=0.5), "fraction_train must be 1.0"),
        (lambda: DPIADMM(privacy=None, local_updates=0), "local_updates must be an integer >= 1"),
        (lambda: DPIADMM(privacy=None, rho=-1.0), "rho must be a number > 0"),
        (lambda: DPIADMM(privacy=None, eta="1/sqrt(t)"), "eta must be a number > 0"),
        (lambda: DPIADMM(privacy=None, beta=-1.0), "beta must be a finite number >= 0"),
        (lambda: DPIADMM(privacy=None, total_samples=0), "total_samples must be an integer >= 1"),
        (lambda: DPIADMM(privacy=None, box=0.0), "box must be a number > 0"),
        (lambda: ObjectivePerturbation(0.0), "epsilon_bar must be a finite number > 0"),
        (lambda: ObjectivePerturbation(1.0, "clipped"), "'clipped' needs its clipping bound: pass clip_norm=C"),
        (lambda: ObjectivePerturbation(1.0, "rdp"), "sensitivity_mode must be one of"),
        (lambda: ObjectivePerturbation(1.0, clip_norm=1.0), "clip_norm applies to sensitivity_mode 'bounded'"),
        (lambda: OutP(privacy=None, order="paper"), "order must be one of"),
        (lambda: OutputPerturbation(1.0, delta_bar=0.0), "delta_bar must be a float in"),
        (lambda: OutputPerturbation(1.0, sensitivity_mode="clipped"), "pass clip_norm=C"),
        (lambda: PrivacyTarget(epsilon=8.0, sample_rate=1.5), "sample_rate"),
        (lambda: PrivacyTarget(epsilon=8.0, clip_norm=0.0), "clip_norm"),
        (lambda: RhoSchedule(c1=0.0), "RhoSchedule c1"),
        (lambda: EtaSchedule("smooth"), "needs lipschitz"),
    ]:
        with pytest.raises(ValueError, match=why):
            make()
    with pytest.raises(TypeError, match="ObjPM fixes local_updates = 10"):
        ObjPM(privacy=None, local_updates=3)
    with pytest.raises(TypeError, match=r"OutP privacy must be a PrivacyTarget .*OutputPerturbation .* or None"):
        OutP(privacy=ObjectivePerturbation(1.0))
    # a target no noise meets in the run's steps: named before round 1 (prepare, which start() calls first)
    s = ObjPM(privacy=PrivacyTarget(epsilon=0.01, sample_rate=1.0), min_available_nodes=1, total_samples=10)
    s.initialize(ArrayRecord(MLP().state_dict()))
    with pytest.raises(ValueError, match=r"PrivacyTarget epsilon: .*cannot be met by any noise multiplier"):
        s.prepare(1000)


def _one_message(strategy: Any, model: nn.Module) -> RecordDict:
    strategy.initialize(ArrayRecord(model.state_dict()))
    strategy.prepare(3)
    strategy.attach({0: 0})
    strategy.begin_round(1)
    ((_, content),) = strategy.train_contents(1)
    return content


def test_a_client_refuses_the_other_mechanism_a_lost_state_and_what_its_floor_forbids() -> None:
    data = blobs(40, 0)
    kw: dict[str, Any] = {"min_available_nodes": 1, "min_train_nodes": 1, "total_samples": 40, "seed": 0}
    outp_msg = _one_message(OutP(privacy=OutputPerturbation(1.0, sensitivity_mode="clipped", clip_norm=1.0), **kw), MLP())
    with pytest.raises(ValueError, match=r"'iadmm-algorithm' = 'outp'.*OutP with OutPClient"):
        IADMMClient(MLP(), data, context=context()).handle("train", outp_msg)
    with pytest.raises(TypeError, match=r"'reference' noise calibration.*multinomial"):
        OutPClient(MLP(), data, context=context()).handle(
            "train", _one_message(OutP(privacy=OutputPerturbation(1.0), **kw), MLP()))
    assert "arrays" in OutPClient(MLP(), data, context=context()).handle("train", outp_msg).array_records

    msg = _one_message(ObjP(privacy=ObjectivePerturbation(1.0, "clipped", clip_norm=1.0), **kw), MLP())
    ctx = context()
    client = IADMMClient(MLP(), data, context=ctx)
    client.handle("train", msg)
    config = ConfigRecord({**dict(msg.config_records["config"]), "server-round": 2})
    round2 = RecordDict({"arrays": msg.array_records["arrays"], "config": config})
    client.handle("train", round2)  # the state carries over
    with pytest.raises(ValueError, match=r"no IADMM state.*round 2.*cannot be rebuilt"):
        IADMMClient(MLP(), data, context=context()).handle("train", round2)

    for strategy, why in [(ObjP(privacy=None, **kw), "without noise"),
                          (ObjP(privacy=ObjectivePerturbation(1.0), **kw), "'paper' is data-dependent"),
                          (ObjPM(privacy=ObjectivePerturbation(1.0, "clipped", clip_norm=1.0), **kw),
                           r"epsilon = 10 .* > its floor")]:
        floor = IADMMClient(MLP(), data, context=context(), max_epsilon=5.0)
        with pytest.raises(ValueError, match=f"refused: .*{why}"):
            floor.handle("train", _one_message(strategy, MLP()))
        assert "iadmm.dual" not in floor.state.array_records  # nothing was released
    ok = IADMMClient(MLP(), data, context=context(), max_epsilon=5.0).handle("train", msg)
    assert ok.metric_records["metrics"]["eps_basic"] == 1.0


def test_outp_trains_a_users_mlp_with_clipped_l2_sensitivity() -> None:
    eps, delta, clip = 5.0, 1e-5, 1.0
    strategy, *_ = _mlp_run(OutP(privacy=OutputPerturbation(eps, delta_bar=delta, sensitivity_mode="clipped", clip_norm=clip),
                                 rho=1.0, min_available_nodes=3, seed=0), rounds=3, client=OutPClient)
    rec = strategy.history[0]
    # round 1, Huang's proximity with I_p of each agent and the Gaussian mechanism on 2 C / (I_p (rho + 1/eta))
    inv = [0.25 * n + 2 * math.sqrt(math.log(1.25 / delta)) / eps for n in SIZES]
    sig = [gaussian_noise_std(2 * clip / (n * (1.0 + v)), eps, delta) for n, v in zip(SIZES, inv, strict=True)]
    assert rec.extra["sigma"] == pytest.approx(np.mean(sig), rel=1e-12)
    # one Gaussian release of multiplier sqrt(2 ln(1.25 / delta-bar)) / eps-bar, under Renyi DP at delta = 1e-5
    assert rec.epsilon == pytest.approx(dpsgd_epsilon(math.sqrt(2 * math.log(1.25 / delta)) / eps, 1.0, 1, 1e-5))
    assert rec.delta == 1e-5
    assert all(r.extra["dual_mismatch"] == 0.0 for r in strategy.history)


def test_per_sample_grads_of_a_torch_model_are_autograds_sample_by_sample() -> None:
    torch.manual_seed(3)
    model = TorchModel(MLP(), nn.CrossEntropyLoss())
    ds = blobs(9, 5)
    x = model.get_flat() + 0.01
    got = model.per_sample_grads(x, *ds.tensors)
    ref = np.stack([model.grad(x, ds.tensors[0][i:i + 1], ds.tensors[1][i:i + 1]) for i in range(9)])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.mean(0), model.grad(x, *ds.tensors), rtol=1e-5, atol=1e-7)


def test_a_users_numpy_multinomial_model_and_nonzero_start() -> None:
    """The numpy model (63) is just a model object; z_p^1 = the user's initial model (not zeros) in both orders."""
    rng = np.random.default_rng(7)
    model = MultinomialLogistic(3, 5, bias=False)
    parts = [(rng.uniform(0, 1, (n, 5)), rng.integers(0, 3, n)) for n in SIZES]
    x0 = rng.normal(0, 0.1, model.dim)
    for strategy in (ObjP(privacy=None, min_available_nodes=3, seed=0), OutP(privacy=None, min_available_nodes=3)):
        seen: list[np.ndarray] = []

        class Spy(OutPClient if isinstance(strategy, OutP) else IADMMClient):  # type: ignore[misc]
            log = seen

            def receive(self, parameters: Any, cfg: Any) -> Any:
                w = super().receive(parameters, cfg)
                self.log.append(w)
                return w

        def client_fn(ctx: Context, spy: Any = Spy) -> FedClient:
            return spy(model, parts[int(ctx.node_config["partition-id"])])

        run_clients(strategy, client_fn, num_nodes=3, num_rounds=2, initial_arrays=ArrayRecord([x0]))
        # round 1 broadcasts the initial model (float32 on the wire, as every downlink)
        np.testing.assert_array_equal(seen[0], x0.astype(np.float32).astype(np.float64))
        assert not np.array_equal(seen[-1], x0)
