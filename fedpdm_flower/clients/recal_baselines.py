"""Agents of DP-RECAL's Table V baselines (fedpdm_flower/strategies/recal_baselines.py; spec dp_recal.md 5.6, 7.7).

Every agent calls the per-agent functions of :mod:`fedpdm_flower.fedapp.algorithms.recal_baselines` on its own smooth local
problem f_i (as DP-RECAL's agents, :class:`fedpdm_flower.clients.recal.LocalProblemAgent`: an objective with ``value`` / ``grad``,
or a model with its data, and L_i), with its state in ``context.state``, and adds the DP noise itself before a
message leaves the node (stateless streams ``default_rng([seed, STREAM_*, agent, t])``, t = its publication count,
exactly as the simulators; ``seed`` is the device's, None: OS entropy). Everything algorithmic (stepsize or penalty,
sigma_1, R, nu1, nu2, n, the mixing row) comes in the message config.

``register`` (message ``query.register``, once, before round 1)
    Store the public common start x^0 and report (L_i, m_i): the server needs L_max for the stepsize / penalty
    and the sensitivity.
:class:`PGExtraClient`, :class:`NidsClient` (``train``, every round k)
    Round 1: initialise from x^0 (``pg_extra_init`` / ``nids_init``); round k >= 2: step with the neighbours'
    round-(k-1) messages the server forwarded and the agent's row of W it sent (``pg_extra_step`` / ``nids_step``).
    Then publish the round-k message (``pg_extra_publish``: x_i^k, ``nids_publish``: v_i^k; with the paper's
    noise, or none under DP-SGD) and reply with it.
:class:`RWAdmmClient` (``train``, when holding the token)
    ``rw_admm_step`` on the received token, ``rw_admm_publish``; reply with the new token.

Record-level DP-SGD (the strategy's ``PrivacyTarget``): every gradient evaluation is a DP-SGD step on a Poisson
sample of the agent's records (one per round; NIDS's first round two), admitted against the device's floor and
charged to its ledger (:class:`fedpdm_flower.clients.decentralized.AgentClient`); the stored noisy gradient is what
the recursion reuses, and the published vectors carry no noise of their own (post-processing).
"""

from __future__ import annotations

from typing import Any

from numpy.typing import NDArray

from fedpdm_flower.clients.base import MessageConfig
from fedpdm_flower.clients.decentralized import PrivateSteps, SyncAgentClient, drop_state, load_state, save_state
from fedpdm_flower.clients.recal import FloatArray, LocalProblemAgent
from fedpdm_flower.fedapp.algorithms.recal_baselines import (
    NidsState,
    NoiseConfig,
    PGExtraState,
    ProxFn,
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
from fedpdm_flower.fedapp.privacy import zcdp

X0 = "baseline-x0"

__all__ = ["NidsClient", "PGExtraClient", "RWAdmmClient"]

Fit = tuple[list[NDArray[Any]], int, dict[str, Any]]


class _BaselineAgent(LocalProblemAgent):
    """x^0 from registration, the noise and prox from the message."""

    #: context.state key of the algorithm state
    state_key = ""

    def on_register(self, x1: FloatArray, cfg: MessageConfig) -> dict[str, Any]:
        """Store x^0, forget any earlier state (:meth:`initial_state` for the algorithm's own)."""
        self.save_vector(X0, x1)
        drop_state(self.state, self.state_key)
        self.initial_state(x1)
        return {}

    def initial_state(self, x0: FloatArray) -> None:
        """Algorithm state at registration (none by default: the synchronous methods start in round 1)."""

    def x0(self) -> FloatArray:
        x0 = self.load_vector(X0)
        if x0 is None:
            raise ValueError(f"agent {self.agent_id} was not registered (no x^0 in its state)")
        return x0

    def noise(self, cfg: MessageConfig) -> NoiseConfig:
        """sigma_1 and R from the message, the device's noise seed."""
        return NoiseConfig(cfg.number("sigma1", lo=0.0), cfg.number("R", lo=1.0), self.noise_seed())

    @staticmethod
    def prox(step: float, cfg: MessageConfig) -> ProxFn:
        """``prox_{step r}`` of the elastic net with the message's nu1, nu2."""
        return elastic_net_prox(step, cfg.number("nu1", lo=0.0), cfg.number("nu2", lo=0.0))

    def gradients(self, config: dict[str, Any], noise: NoiseConfig) -> tuple[Any, PrivateSteps | None]:
        """grad f_i for this message: DP-SGD's noisy one when the message asks for it (admitted against the device's
        floor), else the exact one (refused by a device with a floor)."""
        what = "the paper's noise on the published vector only" if noise.sigma1 > 0 else "no noise"
        return self.gradient_oracle(config, what)

    def metrics(self, t: int, noise: NoiseConfig, model: FloatArray, private: PrivateSteps | None) -> dict[str, Any]:
        """The reply's metrics: publication count t, its sigma_t, and the local loss (outside any DP claim, so not
        sent under DP-SGD); with DP-SGD the charge of this message's steps (the ledger's ``eps_dpsgd``, z, q)."""
        sigma = zcdp.sigma_at(t, noise.sigma1, noise.R) if noise.sigma1 > 0 else 0.0
        if private is not None:
            return {"t": t, "sigma": sigma, **private.charge()}
        return {"t": t, "sigma": sigma, "local_loss": float(self.objective.value(model))}


class _SyncAgent(_BaselineAgent, SyncAgentClient):
    """Round logic shared by PG-EXTRA and NIDS agents (``neighbours=`` pins the device's neighbours)."""

    def neighbour_vectors(self, msgs: dict[int, list[NDArray[Any]]]) -> dict[int, FloatArray]:
        return {j: self.vector(m[0], f"agent {j}'s message") for j, m in msgs.items()}

    def state_at(self, k: int, cls: type[Any]) -> Any:
        """The saved state, which must hold k - 1 publications (None in round 1)."""
        state = load_state(self.state, self.state_key, cls)
        if k == 1:
            if state is not None:
                raise ValueError(f"agent {self.agent_id} is already initialised (round 1 twice?)")
            return None
        if state is None or state.t != k - 1:
            got = None if state is None else state.t
            raise ValueError(f"agent {self.agent_id} has {got} publications, round {k} needs {k - 1}")
        return state

    def round_inputs(self, parameters: list[Any], config: dict[str, Any]) -> tuple[MessageConfig, int, dict[int, FloatArray], float]:
        """(config, k, the neighbours' vectors, alpha) of a round-k message."""
        cfg = MessageConfig(config)
        self.check_dim(cfg)
        k, msgs = self.inbox(parameters, cfg)
        return cfg, k, self.neighbour_vectors(msgs), cfg.number("alpha", lo=0.0, lo_open=True)


class PGExtraClient(_SyncAgent):
    """A DP-PG-EXTRA agent: step with the neighbours' published x_j^{k-1}, publish noisy x_i^k.

    Parameters are :class:`fedpdm_flower.clients.recal.LocalProblemAgent`'s, plus ``neighbours`` (the device's own graph
    neighbours, :class:`fedpdm_flower.clients.decentralized.SyncAgentClient`).
    """

    state_key = "pg-extra"

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> Fit:
        cfg, k, msgs, alpha = self.round_inputs(parameters, config)
        noise, prox = self.noise(cfg), self.prox(alpha, cfg)
        state: PGExtraState | None = self.state_at(k, PGExtraState)
        w_row = self.mixing_row(cfg) if state is not None else None  # checked before the data is touched
        grad, private = self.gradients(config, noise)
        if state is None:
            state = pg_extra_init(self.x0(), grad, alpha, prox)
        else:
            assert w_row is not None
            state = pg_extra_step(state, msgs, w_row[0], w_row[1], grad, alpha, prox)
        state, msg = pg_extra_publish(state, self.agent_id, noise)
        save_state(self.state, self.state_key, state)
        return [msg], self.m, self.metrics(state.t, noise, state.x, private)


class NidsClient(_SyncAgent):
    """A DP-NIDS agent: step with the neighbours' published v_j^{k-1}, publish noisy v_i^k.

    Parameters as :class:`PGExtraClient`.
    """

    state_key = "nids"

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> Fit:
        cfg, k, msgs, alpha = self.round_inputs(parameters, config)
        noise, prox = self.noise(cfg), self.prox(alpha, cfg)
        state: NidsState | None = self.state_at(k, NidsState)
        w_row = self.mixing_row(cfg) if state is not None else None  # checked before the data is touched
        grad, private = self.gradients(config, noise)
        if state is None:  # round 1: grad f_i(x^0) here and grad f_i(x^1) in nids_publish (two DP-SGD steps)
            state = nids_init(self.x0(), grad, alpha, prox)
        else:
            assert w_row is not None
            state = nids_step(state, msgs, w_row[0], w_row[1], prox)
        state, msg = nids_publish(state, grad, alpha, self.agent_id, noise)
        save_state(self.state, self.state_key, state)
        return [msg], self.m, self.metrics(state.t, noise, state.x, private)


class RWAdmmClient(_BaselineAgent):
    """A DP-RW-ADMM agent: (y_i, z_i, t_i) in ``context.state``; one linearised ADMM activation per token visit.

    Parameters are :class:`fedpdm_flower.clients.recal.LocalProblemAgent`'s.
    """

    state_key = "rw-admm"

    def initial_state(self, x0: FloatArray) -> None:
        save_state(self.state, self.state_key, RWAdmmState.initial(x0))

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> Fit:
        cfg = MessageConfig(config)
        self.check_addressed(cfg)
        self.check_dim(cfg)
        if len(parameters) != 1:
            raise ValueError(f"the token is one array, got {len(parameters)}")
        token = self.vector(parameters[0], "the token")
        beta, noise = cfg.number("beta", lo=0.0, lo_open=True), self.noise(cfg)
        state = load_state(self.state, self.state_key, RWAdmmState)
        if state is None:
            raise ValueError(f"agent {self.agent_id} was not registered (no y_i, z_i in its state)")
        prox = self.prox(1.0 / beta, cfg)  # prox_{r/beta}, as simulate_rw_admm
        n = cfg.integer("n", lo=1)
        grad, private = self.gradients(config, noise)
        state, clean, _ = rw_admm_step(token, state, grad, beta, n, prox)
        state, published = rw_admm_publish(clean, state, self.agent_id, noise)
        save_state(self.state, self.state_key, state)
        return [published], self.m, self.metrics(state.t, noise, state.y, private)
