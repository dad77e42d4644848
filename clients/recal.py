"""DP-RECAL agent (Algorithm 1 of the seed-001 paper; spec shared/specs/dp_recal.md 2.3, 7.3): one agent per node.

``register`` (message ``query.register``, once, before iteration 1)
    Compute L_i = lambda_max(B_i^T B_i)/m_i and alpha_i = alpha_scale 2/(L_i + 1) (spec 2.6) from the local data,
    initialise y_i = x^1, lambda_i = 0, tau_i = 0 (I1), and report (L_i, alpha_i, m_i): the server needs
    alpha_max and L_max for the sensitivity of Lemma 4 and the noise calibration.
``fit`` (message ``train``, when this agent holds the baton)
    Steps S1-S8 on the received baton (x, u~[, u]) with :func:`fedapp.algorithms.recal.dprecal_step`: the noise is
    drawn here, before the baton leaves the node. Reply: the new baton and (tau_i, sigma, rho of this activation).

The agent's private state (y_i, lambda_i, tau_i, and its activation ledger) lives in ``context.state``; the
data partition is cached per process (it is a deterministic function of the run config).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from numpy.typing import NDArray

from fedapp.algorithms.recal import (
    AgentState,
    Baton,
    ElasticNetProblem,
    RecalConfig,
    alpha_for,
    dprecal_step,
)
from fedapp.client_base import FedClient
from fedapp.config import RunConfig
from fedapp.privacy.zcdp import ActivationLedger

STATE = "dprecal"
_PROBLEMS: dict[tuple[Any, ...], ElasticNetProblem] = {}


def recal_problem(cfg: RunConfig) -> ElasticNetProblem:
    """The elastic-net problem of the run (spec 5.1-5.2), all agents' partitions; cached per process.

    MNIST (offline): pixels / 255, one-hot +-1 (or parity) targets, seeded equal split over num-clients agents.
    covtype (online, scikit-learn's loader): per-feature min-max, seeded 55,500-sample subset.
    """
    from fedapp.algorithms.recal import load_covtype_problem, load_mnist_problem

    key = (cfg.dataset, cfg.data_source, cfg.num_clients, cfg.seed, cfg.label_mode, cfg.recal_samples,
           cfg.recal_nu1, cfg.recal_nu2)
    if key not in _PROBLEMS:
        if len(_PROBLEMS) >= 8:
            _PROBLEMS.clear()
        if cfg.dataset == "covtype":
            _PROBLEMS[key] = load_covtype_problem(
                cfg.num_clients, seed=cfg.seed, label_mode=cfg.label_mode, nu1=cfg.recal_nu1, nu2=cfg.recal_nu2,
                num_samples=cfg.recal_samples or 55_500,
            )
        else:
            _PROBLEMS[key] = load_mnist_problem(
                cfg.num_clients, seed=cfg.seed, label_mode=cfg.label_mode, nu1=cfg.recal_nu1, nu2=cfg.recal_nu2,
                num_samples=cfg.recal_samples or None, source=cfg.data_source,
            )
    return _PROBLEMS[key]


class RecalClient(FedClient):
    """A DP-RECAL agent: S1-S8 when it holds the baton, its (y_i, lambda_i, tau_i) in context.state.

    Parameters
    ----------
    context
        Flower Context (node_config: partition-id = agent id, num-partitions = n).
    cfg
        Run config: dataset, num-clients n, seed, label-mode, recal-samples, recal-nu1/nu2, alpha-scale,
        recal-mode, recal-R, noise-seed.
    """

    def __init__(self, context: Context, cfg: RunConfig) -> None:  # no linear model: the agent's least squares
        self.bind_node(context, cfg, check_partitions=True)
        self.problem = recal_problem(cfg)
        self.local = self.problem.agents[self.partition_id]
        self.alpha = alpha_for(self.local.lipschitz, cfg.alpha_scale)

    # ---------------------------------------------------------------- state
    def _load(self) -> tuple[AgentState, ActivationLedger]:
        st = self.node_context.state
        if STATE not in st.array_records:
            raise ValueError(f"agent {self.partition_id} was not registered (no y_i, lambda_i in its state)")
        y, lam = st.array_records[STATE].to_numpy_ndarrays()
        tau = int(st.config_records[STATE + "-meta"]["tau"])  # type: ignore[arg-type]
        ledger = ActivationLedger.from_record(dict(st.config_records[STATE + "-ledger"]))
        return AgentState(y=np.asarray(y, np.float64), lam=np.asarray(lam, np.float64), tau=tau), ledger

    def _save(self, state: AgentState, ledger: ActivationLedger) -> None:
        self.node_context.state[STATE] = ArrayRecord([state.y, state.lam])
        self.node_context.state[STATE + "-meta"] = ConfigRecord({"tau": state.tau})
        self.node_context.state[STATE + "-ledger"] = ConfigRecord(ledger.to_record())  # type: ignore[arg-type]

    # ---------------------------------------------------------------- registration
    def register(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], dict[str, Any]]:
        """I1: y_i = x^1, lambda_i = 0, tau_i = 0; report L_i, alpha_i, m_i."""
        x1 = np.asarray(parameters[0], dtype=np.float64)
        if x1.shape != self.problem.x_shape:
            raise ValueError(f"x^1 has shape {x1.shape}, the problem's x has {self.problem.x_shape}")
        ledger = ActivationLedger(sensitivity=float(config["sensitivity"]), sigmas=[]) if "sensitivity" in config \
            else ActivationLedger(sensitivity=0.0, sigmas=[])
        self._save(AgentState(y=x1.copy(), lam=np.zeros_like(x1), tau=0), ledger)
        return [], {"L": self.local.lipschitz, "alpha": self.alpha, "m": self.local.m}

    # ---------------------------------------------------------------- one activation
    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        """S0-S8 on the baton; the reply is the new (noisy) baton."""
        cfg = self.cfg
        mode = str(config["mode"])
        want = 3 if mode == "exact" else 2
        if len(parameters) != want:
            raise ValueError(f"baton must carry {want} arrays in {mode} mode, got {len(parameters)}")
        arrays = [np.asarray(p, dtype=np.float64) for p in parameters]
        baton = Baton(x=arrays[0], ut=arrays[1], u=arrays[2] if mode == "exact" else None)
        state, ledger = self._load()
        if ledger.sensitivity == 0.0:  # the server's Delta arrives with the first activation
            ledger = ActivationLedger(sensitivity=float(config["sensitivity"]), sigmas=[])
        rc = RecalConfig(n=self.problem.n, nu1=self.problem.nu1, nu2=self.problem.nu2, sigma1=float(config["sigma1"]),
                         R=float(config["R"]), mode=mode, noise_seed=cfg.noise_seed, beta=float(config["beta"]))
        res = dprecal_step(baton, state, self.local.grad, self.alpha, rc, self.partition_id)
        out = [res.baton.x, res.baton.ut] + ([res.baton.u] if res.baton.u is not None else [])
        loss = self.local.value(res.state.y)
        if not (math.isfinite(loss) and all(np.all(np.isfinite(a)) for a in out)):
            # Checked before the state is saved, so the server's retry finds the agent as it was.
            cause = ("without noise" if res.sigma <= 0
                     else f"with noise std sigma = {res.sigma:.3g}: lower recal-sigma1 or raise recal-epsilon")
            raise ValueError(f"agent {self.partition_id}: activation {res.state.tau} overflowed float64 (local loss "
                             f"{loss:.3g}) {cause}")
        rho = ledger.record(res.sigma) if res.sigma > 0 and ledger.sensitivity > 0 else 0.0
        self._save(res.state, ledger)
        metrics = {"agent_id": self.partition_id, "tau": res.state.tau, "sigma": res.sigma, "rho_step": rho,
                   "rho_total": ledger.rho, "local_loss": loss}
        return out, self.local.m, metrics

    def evaluate(self, parameters: list[Any], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        """The local least-squares loss of a model x."""
        x = np.asarray(parameters[0], dtype=np.float64)
        return float(self.local.value(x)), self.local.m, {}
