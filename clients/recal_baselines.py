"""Agents of DP-RECAL's Table V baselines on Flower (strategies/recal_baselines.py; spec dp_recal.md 5.6, 7.7).

Every agent calls the per-agent functions of :mod:`fedapp.algorithms.recal_baselines` on its own data partition
(the elastic-net problem of :func:`clients.recal.recal_problem`, cached per process), with its state in
``context.state``, and adds the DP noise itself before a message leaves the node (stateless streams
``default_rng([noise_seed, STREAM_*, agent, t])``, t = its publication count, exactly as the simulators).

``register`` (message ``query.register``, once, before round 1)
    Store the public common start x^0 and report (L_i, m_i): the server needs L_max for the stepsize / penalty
    and the sensitivity.
:class:`PGExtraClient`, :class:`NidsClient` (``train``, every round k)
    Round 1: initialise from x^0 (``pg_extra_init`` / ``nids_init``); round k >= 2: step with the neighbours'
    round-(k-1) messages the server forwarded (``pg_extra_step`` / ``nids_step``; this agent's row of the
    Metropolis W is computed here from the graph). Then publish the round-k message with noise
    (``pg_extra_publish``: x_i^k, ``nids_publish``: v_i^k) and reply with it.
:class:`RWAdmmClient` (``train``, when holding the token)
    ``rw_admm_step`` on the received token, ``rw_admm_publish``; reply with the new noisy token.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context
from numpy.typing import NDArray

from clients._legacy_decentralized import AgentClient, SyncAgentClient, drop_state, load_state, save_state
from clients.recal import recal_problem
from fedapp.algorithms.recal_baselines import (
    NidsState,
    NoiseConfig,
    PGExtraState,
    RWAdmmState,
    elastic_net_prox,
    nids_init,
    nids_publish,
    nids_step,
    pg_extra_init,
    pg_extra_publish,
    pg_extra_step,
    rw_admm_publish,
    rw_admm_step,
)
from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.privacy import zcdp

X0 = "baseline-x0"


class _ElasticNetAgent(AgentClient):
    """Agent i of the elastic-net problem: its partition, x^0 from registration, noise from the server's scalars."""

    #: context.state key of the algorithm state
    state_key = ""

    def __init__(self, context: Context, cfg: RunConfig) -> None:
        super().__init__(context, cfg)
        self.problem = recal_problem(cfg)
        self.local = self.problem.agents[self.partition_id]

    def register(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], dict[str, Any]]:
        """Store x^0 (forgetting any earlier state); report L_i and m_i."""
        x0 = self.as_vector(parameters[0] if parameters else None, "x^0")
        self.node_context.state[X0] = ArrayRecord([x0])
        drop_state(self.node_context.state, self.state_key)
        self.on_register(x0)
        return [], {"agent_id": self.partition_id, "L": self.local.lipschitz, "m": self.local.m}

    def on_register(self, x0: FloatArray) -> None:
        """Algorithm-specific initialisation at registration (none by default)."""

    def x0(self) -> FloatArray:
        if X0 not in self.node_context.state.array_records:
            raise ValueError(f"agent {self.partition_id} was not registered (no x^0 in its state)")
        return np.asarray(self.node_context.state.array_records[X0].to_numpy_ndarrays()[0], dtype=np.float64)

    def as_vector(self, value: Any, what: str) -> FloatArray:
        """A received vector as float64 of the problem's shape (ValueError otherwise)."""
        if value is None:
            raise ValueError(f"{what} is missing")
        arr = np.asarray(value)
        if arr.dtype != np.float64 or arr.shape != self.problem.x_shape or not np.all(np.isfinite(arr)):
            raise ValueError(f"{what} must be finite float64 of shape {self.problem.x_shape}, got {arr.dtype} {arr.shape}")
        return arr

    @staticmethod
    def positive(config: dict[str, Any], key: str) -> float:
        value = float(config[key])
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"config {key!r} must be finite and > 0, got {value}")
        return value

    def noise(self, config: dict[str, Any]) -> NoiseConfig:
        return NoiseConfig(float(config["sigma1"]), float(config["R"]), self.cfg.noise_seed)

    def metrics(self, t: int, noise: NoiseConfig, model: FloatArray) -> dict[str, Any]:
        """The reply's metrics: publication count t, its sigma_t, and the local loss (outside the DP claim)."""
        sigma = zcdp.sigma_at(t, noise.sigma1, noise.R) if noise.sigma1 > 0 else 0.0
        return {"agent_id": self.partition_id, "t": t, "sigma": sigma, "local_loss": self.local.value(model)}

    def evaluate(self, parameters: list[Any], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        """The local least-squares loss of a model x."""
        x = np.asarray(parameters[0], dtype=np.float64)
        return float(self.local.value(x)), self.local.m, {}


class _SyncElasticNetAgent(_ElasticNetAgent, SyncAgentClient):
    """Round logic shared by PG-EXTRA and NIDS agents."""

    def neighbour_vectors(self, msgs: dict[int, list[NDArray[Any]]]) -> dict[int, FloatArray]:
        return {j: self.as_vector(m[0], f"agent {j}'s message") for j, m in msgs.items()}

    def state_at(self, k: int, cls: type[Any]) -> Any:
        """The saved state, which must hold k - 1 publications (None in round 1)."""
        state = load_state(self.node_context.state, self.state_key, cls)
        if k == 1:
            if state is not None:
                raise ValueError(f"agent {self.partition_id} is already initialised (round 1 twice?)")
            return None
        if state is None or state.t != k - 1:
            got = None if state is None else state.t
            raise ValueError(f"agent {self.partition_id} has {got} publications, round {k} needs {k - 1}")
        return state


class PGExtraClient(_SyncElasticNetAgent):
    """A DP-PG-EXTRA agent: step with the neighbours' published x_j^{k-1}, publish noisy x_i^k."""

    state_key = "pg-extra"

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        k, msgs = self.inbox(parameters, config)
        alpha, noise = self.positive(config, "alpha"), self.noise(config)
        prox = elastic_net_prox(alpha, self.problem.nu1, self.problem.nu2)
        state: PGExtraState | None = self.state_at(k, PGExtraState)
        if state is None:
            state = pg_extra_init(self.x0(), self.local.grad, alpha, prox)
        else:
            w_self, w_nbrs = self.mixing_row()
            state = pg_extra_step(state, self.neighbour_vectors(msgs), w_self, w_nbrs, self.local.grad, alpha, prox)
        state, msg = pg_extra_publish(state, self.partition_id, noise)
        save_state(self.node_context.state, self.state_key, state)
        return [msg], self.local.m, self.metrics(state.t, noise, state.x)


class NidsClient(_SyncElasticNetAgent):
    """A DP-NIDS agent: step with the neighbours' published v_j^{k-1}, publish noisy v_i^k."""

    state_key = "nids"

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        k, msgs = self.inbox(parameters, config)
        alpha, noise = self.positive(config, "alpha"), self.noise(config)
        prox = elastic_net_prox(alpha, self.problem.nu1, self.problem.nu2)
        state: NidsState | None = self.state_at(k, NidsState)
        if state is None:
            state = nids_init(self.x0(), self.local.grad, alpha, prox)
        else:
            w_self, w_nbrs = self.mixing_row()
            state = nids_step(state, self.neighbour_vectors(msgs), w_self, w_nbrs, prox)
        state, msg = nids_publish(state, self.local.grad, alpha, self.partition_id, noise)
        save_state(self.node_context.state, self.state_key, state)
        return [msg], self.local.m, self.metrics(state.t, noise, state.x)


class RWAdmmClient(_ElasticNetAgent):
    """A DP-RW-ADMM agent: (y_i, z_i, t_i) in context.state; one linearised ADMM activation per token visit."""

    state_key = "rw-admm"

    def on_register(self, x0: FloatArray) -> None:
        save_state(self.node_context.state, self.state_key, RWAdmmState.initial(x0))

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        if len(parameters) != 1:
            raise ValueError(f"the token is one array, got {len(parameters)}")
        token = self.as_vector(parameters[0], "the token")
        beta, noise = self.positive(config, "beta"), self.noise(config)
        state = load_state(self.node_context.state, self.state_key, RWAdmmState)
        if state is None:
            raise ValueError(f"agent {self.partition_id} was not registered (no y_i, z_i in its state)")
        prox = elastic_net_prox(1.0 / beta, self.problem.nu1, self.problem.nu2)  # prox_{r/beta}, as simulate_rw_admm
        state, clean, _ = rw_admm_step(token, state, self.local.grad, beta, self.problem.n, prox)
        state, published = rw_admm_publish(clean, state, self.partition_id, noise)
        save_state(self.node_context.state, self.state_key, state)
        return [published], self.local.m, self.metrics(state.t, noise, state.y)


__all__ = ["NidsClient", "PGExtraClient", "RWAdmmClient"]
