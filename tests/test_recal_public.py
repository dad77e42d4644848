"""DP-RECAL and its baselines as a Flower user meets them: the agents' own local problems, defined only here.

Nothing comes from the reproduction app (run config, dataset registry, fedpdm_flower.fedapp.apps): each agent's smooth loss, its
data and its L_i are the user's, the strategies are built with keywords, and the runs go through
``simulations.inprocess.run_clients`` (the messages a Flower simulation carries). The truth they are checked
against is independent: the normal equations of the pooled problem, and scikit-learn's ElasticNet.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, MetricRecord
from numpy.typing import NDArray
from sklearn.linear_model import ElasticNet
from torch import nn

from fedpdm_flower.clients.recal import RecalClient
from fedpdm_flower.clients.recal_baselines import NidsClient, PGExtraClient, RWAdmmClient
from fedpdm_flower.fedapp.privacy.zcdp import Theorem3Calibration
from fedpdm_flower.strategies.base import RoundFailed
from fedpdm_flower.strategies.recal import DPRECAL
from fedpdm_flower.strategies.recal_baselines import DPNids, DPPGExtra, DPRWAdmm
from simulations.inprocess import run_clients

torch.set_num_threads(1)
N, Q = 5, 4
F = NDArray[np.float64]


# ----------------------------------------------------------------------------- the user's problem
def agent_data(i: int, m: int = 30) -> tuple[F, F]:
    """Agent i's rows: a shared linear truth plus noise, with agent-dependent feature scales (heterogeneous L_i)."""
    rng = np.random.default_rng(100 + i)
    x = rng.normal(0.0, 1.0 + 0.1 * i, (m, Q))
    y = x @ np.array([1.5, -2.0, 0.0, 0.7]) + 0.1 * rng.standard_normal(m)
    return x, y


class Ridge:
    """The user's smooth local loss f_i(w) = ||X w - y||^2 / (2 m) on its own rows: value, gradient and L_i."""

    def __init__(self, x: F, y: F) -> None:
        self.x, self.y = x, y

    @property
    def dim(self) -> int:
        return self.x.shape[1]

    @property
    def lipschitz(self) -> float:
        return float(np.linalg.eigvalsh(self.x.T @ self.x / len(self.y))[-1])

    def value(self, w: F) -> float:
        r = self.x @ w - self.y
        return float(r @ r) / (2 * len(self.y))

    def grad(self, w: F) -> F:
        return np.asarray(self.x.T @ (self.x @ w - self.y) / len(self.y), dtype=np.float64)


class LinearModel:
    """A user's numpy model with the generic flat-model interface (``dim``, ``grad``, ``loss`` on given samples)."""

    dim = Q

    def loss(self, w: F, inputs: F, targets: F) -> float:
        r = inputs @ w - targets
        return float(r @ r) / (2 * len(targets))

    def grad(self, w: F, inputs: F, targets: F) -> F:
        return np.asarray(inputs.T @ (inputs @ w - targets) / len(targets), dtype=np.float64)


def optimum(nu2: float, n: int = N) -> F:
    """argmin sum_i f_i(w) + n nu2 ||w||^2 by the normal equations: (sum_i G_i + 2 n nu2 I) w = sum_i h_i."""
    g = sum(x.T @ x / len(y) for x, y in map(agent_data, range(n)))
    h = sum(x.T @ y / len(y) for x, y in map(agent_data, range(n)))
    return np.asarray(np.linalg.solve(g + 2 * n * nu2 * np.eye(Q), h), dtype=np.float64)


def pid(context: Context) -> int:
    return int(context.node_config["partition-id"])


def relative_error_fn(x_star: F, x0: F) -> Any:
    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        w = arrays["w"].numpy()
        return MetricRecord({"relative_error": float(np.linalg.norm(w - x_star) / np.linalg.norm(x0 - x_star))})

    return evaluate


W0 = np.zeros(Q)


# ----------------------------------------------------------------------------- DP-RECAL
@pytest.mark.parametrize("agent", ["objective", "model+data"])
def test_recal_exact_mode_without_noise_reaches_the_pooled_ridge_optimum(agent: str) -> None:
    """Noise off, exact mode, ring of 5: the baton's x converges to the normal equations' solution (spec 9.13 with a
    ridge r), with the user's objective or with the user's model and data; the user's layout comes back."""
    nu2 = 0.05
    x_star = optimum(nu2)

    def client_fn(context: Context) -> RecalClient:
        x, y = agent_data(pid(context))
        if agent == "objective":
            return RecalClient(Ridge(x, y), seed=0)
        return RecalClient(LinearModel(), (x, y), lipschitz=Ridge(x, y).lipschitz, seed=0)

    strategy = DPRECAL(graph="ring", min_available_nodes=N, privacy=None, mode="exact", nu1=0.0,
                       nu2=nu2, seed=3, eval_every=500)
    run_clients(strategy, client_fn, num_nodes=N, num_rounds=2000, initial_arrays=ArrayRecord({"w": Array(W0)}),
                evaluate_fn=relative_error_fn(x_star, W0))
    out = strategy.current_arrays()
    assert list(out) == ["w"] and out["w"].numpy().shape == (Q,) and out["w"].numpy().dtype == np.float64
    assert np.linalg.norm(out["w"].numpy() - x_star) < 1e-7 * np.linalg.norm(x_star)
    errs = [r.objective_gap for r in strategy.history if r.objective_gap is not None]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 1e-7  # recorded from the user's evaluate_fn
    assert strategy.hops == 2000 and int(strategy.tau.sum()) == 2000
    assert strategy.history[-1].epsilon is None  # privacy=None: no noise, no privacy figure


def test_recal_with_an_l1_term_matches_sklearn_elastic_net() -> None:
    """nu1 > 0: the prox soft-thresholds; the optimum of sum_i f_i + n (nu1 |w|_1 + nu2 |w|^2) is scikit-learn's
    ElasticNet on the pooled rows (equal m_i: alpha = nu1 + 2 nu2, l1_ratio = nu1 / alpha)."""
    nu1, nu2 = 0.3, 0.05
    rows = [agent_data(i) for i in range(N)]
    fit = ElasticNet(alpha=nu1 + 2 * nu2, l1_ratio=nu1 / (nu1 + 2 * nu2), fit_intercept=False, tol=1e-14,
                     max_iter=1_000_000).fit(np.vstack([x for x, _ in rows]), np.concatenate([y for _, y in rows]))
    strategy = DPRECAL(graph="complete", min_available_nodes=N, privacy=None, mode="exact", nu1=nu1,
                       nu2=nu2, seed=1, eval_every=2000)
    run_clients(strategy, lambda c: RecalClient(Ridge(*agent_data(pid(c)))), num_nodes=N, num_rounds=2000,
                initial_arrays=ArrayRecord({"w": Array(W0)}))
    w = strategy.current_arrays()["w"].numpy()
    assert w[2] == 0.0 and fit.coef_[2] == 0.0  # the same support: the l1 term zeroes the irrelevant feature
    assert np.linalg.norm(w - fit.coef_) < 1e-7 * np.linalg.norm(fit.coef_)


def test_recal_trains_a_torch_linear_layer_with_mse() -> None:
    """A torch nn.Linear with MSELoss (smooth) and the agent's tensors: float32 gradients, so the baton gets within
    float32 accuracy of the pooled ridge optimum over (weight, bias); the state dict's names and shapes come back."""
    nu2 = 0.05
    data = [agent_data(i) for i in range(N)]
    # MSELoss is mean (Xw + b - y)^2 = 2 f_i on the augmented rows [x, 1]: gradient Lipschitz constant 2 lambda_max
    aug = [np.hstack([x, np.ones((len(y), 1))]) for x, y in data]
    lips = [2 * float(np.linalg.eigvalsh(a.T @ a / len(a))[-1]) for a in aug]
    g = sum(2 * a.T @ a / len(a) for a in aug)
    h = sum(2 * a.T @ y / len(y) for a, (_, y) in zip(aug, data, strict=True))
    x_star = np.linalg.solve(g + 2 * N * nu2 * np.eye(Q + 1), h)

    def client_fn(context: Context) -> RecalClient:
        i = pid(context)
        x, y = data[i]
        tensors = (torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32).unsqueeze(1))
        return RecalClient(nn.Linear(Q, 1), tensors, loss_fn=nn.MSELoss(), lipschitz=lips[i])

    net = nn.Linear(Q, 1)
    strategy = DPRECAL(graph="ring", min_available_nodes=N, privacy=None, mode="exact", nu1=0.0,
                       nu2=nu2, seed=2, eval_every=2000)
    run_clients(strategy, client_fn, num_nodes=N, num_rounds=2000, initial_arrays=ArrayRecord(net.state_dict()))
    out = strategy.current_arrays()
    assert list(out) == ["weight", "bias"] and out["weight"].numpy().dtype == np.float32
    net.load_state_dict(out.to_torch_state_dict())
    got = np.concatenate([net.weight.detach().numpy().ravel(), net.bias.detach().numpy()])
    assert np.linalg.norm(got - x_star) < 1e-5 * np.linalg.norm(x_star)


# ----------------------------------------------------------------------------- the baselines
@pytest.mark.parametrize(("strategy_cls", "client_cls", "rounds"),
                         [(DPNids, NidsClient, 100), (DPPGExtra, PGExtraClient, 120), (DPRWAdmm, RWAdmmClient, 600)],
                         ids=["nids", "pg-extra", "rw-admm"])
def test_baselines_without_noise_reach_the_pooled_optimum(strategy_cls: Any, client_cls: Any, rounds: int) -> None:
    """The Table V baselines on the user's objectives: their returned model (published-message average, or RW-ADMM's
    prox of the token) converges to the same optimum."""
    nu2 = 0.05
    strategy = strategy_cls(graph="ring", min_available_nodes=N, privacy=None, nu1=0.0, nu2=nu2, seed=0,
                            eval_every=rounds)
    run_clients(strategy, lambda c: client_cls(Ridge(*agent_data(pid(c)))), num_nodes=N, num_rounds=rounds,
                initial_arrays=ArrayRecord({"w": Array(W0)}))
    x_star = optimum(nu2)
    assert np.linalg.norm(strategy.current_arrays()["w"].numpy() - x_star) < 1e-9 * np.linalg.norm(x_star)


# ----------------------------------------------------------------------------- what the math needs, and who sets the noise
def test_the_constructor_names_what_the_local_problem_lacks() -> None:
    class NoGradient:
        dim = Q

        def value(self, w: F) -> float:
            return 0.0

    with pytest.raises(TypeError, match="smooth local loss f_i with its gradient: NoGradient lacks grad"):
        RecalClient(NoGradient())

    class NoLipschitz(Ridge):
        lipschitz = None  # type: ignore[assignment]

    with pytest.raises(ValueError, match=r"needs L_i, the Lipschitz constant of grad f_i.*lipschitz="):
        RecalClient(NoLipschitz(*agent_data(0)))
    with pytest.raises(ValueError, match="mean loss of LinearModel on the agent's own data: pass data="):
        RecalClient(LinearModel(), lipschitz=1.0)
    with pytest.raises(ValueError, match="bound to its own data"):
        RecalClient(Ridge(*agent_data(0)), agent_data(0))
    with pytest.raises(ValueError, match="lipschitz must be a finite number > 0"):
        RecalClient(Ridge(*agent_data(0)), lipschitz=-1.0)
    with pytest.raises(ValueError, match="BatchNorm"):
        RecalClient(nn.Sequential(nn.Linear(Q, 2), nn.BatchNorm1d(2)), (np.zeros((4, Q)), np.zeros((4, 2))),
                    loss_fn=nn.MSELoss(), lipschitz=1.0)


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"nu1": -1.0}, "nu1"), ({"lipschitz_bound": 0.0}, "lipschitz_bound"),
    ({"mode": "noisy"}, "mode"), ({"alpha_scale": 1.0}, "alpha_scale"), ({"walk": "levy"}, "walk"),
    ({"walk_start": "last"}, "walk_start"), ({"xi_plan": 0}, "xi_plan"),
])
def test_invalid_arguments_name_the_argument(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        DPRECAL(privacy=None, **kwargs)


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"epsilon": 0.0}, "epsilon"), ({"epsilon": 1.0, "sigma1": 1.0}, "either epsilon"), ({}, "either epsilon"),
    ({"epsilon": 1.0, "delta": 1.0}, "delta"), ({"epsilon": 1.0, "R": 0.5}, "R must"),
])
def test_the_papers_mechanism_names_its_invalid_argument(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ValueError, match=f"Theorem3Calibration.*{argument}"):
        Theorem3Calibration(**kwargs)


def test_an_over_reported_lipschitz_constant_is_clamped_to_the_public_bound() -> None:
    """The agent with the largest L_i reports 1e6 instead: without a bound it alone sets everyone's sensitivity
    (Lemma 4's L_max) and so everyone's noise; with ``lipschitz_bound`` its report is clamped, and sigma_1 is what
    the honest reports give (up to the bound's slack)."""
    true_l = [Ridge(*agent_data(i)).lipschitz for i in range(N)]
    liar = int(np.argmax(true_l))  # its own alpha_i shrinks with the lie, the others' alpha_max does not

    def run(lie: bool, **kw: Any) -> DPRECAL:
        s = DPRECAL(graph="ring", min_available_nodes=N, privacy=Theorem3Calibration(epsilon=5.0), seed=0, **kw)
        run_clients(s, lambda c: RecalClient(Ridge(*agent_data(pid(c))), lipschitz=1e6 if lie and pid(c) == liar
                                             else None), num_nodes=N, num_rounds=1,
                    initial_arrays=ArrayRecord({"w": Array(W0)}))
        return s

    honest = run(False)
    inflated = run(True)
    assert honest.l_max == max(true_l) and inflated.l_max == 1e6 and inflated.sigma1 > 1e4 * honest.sigma1
    bound = max(true_l) * (1 + 1e-9)
    clamped = run(True, lipschitz_bound=bound)
    assert clamped.l_max == bound and clamped.sigma1 == pytest.approx(honest.sigma1, rel=1e-8)
    assert run(False, lipschitz_bound=bound).sigma1 == honest.sigma1  # honest reports below the bound: unchanged


def test_an_agent_that_cannot_register_stops_the_run_before_iteration_one() -> None:
    class OtherModel(Ridge):
        @property
        def dim(self) -> int:
            return Q + 1  # this agent believes in another model

    def client_fn(context: Context) -> RecalClient:
        i = pid(context)
        return RecalClient((OtherModel if i == 2 else Ridge)(*agent_data(i)))

    strategy = DPRECAL(graph="ring", min_available_nodes=N, privacy=None, seed=0)
    with pytest.raises(RoundFailed, match=r"agent\(s\) \[2\] failed to register \(every agent must.*d = 4"):
        run_clients(strategy, client_fn, num_nodes=N, num_rounds=1, initial_arrays=ArrayRecord({"w": Array(W0)}))
