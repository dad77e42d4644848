"""DP-RECAL's Table V baselines on Flower: DP-PG-EXTRA, DP-NIDS (synchronous) and DP-RW-ADMM (random walk).

Seed 001, spec shared/specs/dp_recal.md 5.6, 5.7, 7.7; the math (per-agent init / publish / step functions, noise
streams, calibration, communication constants) is :mod:`fedpdm_flower.fedapp.algorithms.recal_baselines`, which the agents call
(:mod:`fedpdm_flower.clients.recal_baselines`). Like DP-RECAL's strategy, the server only routes and never computes on the
agents' messages for the algorithm. All three solve DP-RECAL's problem (1), ``sum_i f_i + n r`` with the elastic
net r, each agent bringing its smooth f_i and L_i.

Registration (round 1, before the first train message; :class:`fedpdm_flower.strategies.recal.RecalFamily`)
    One ``query.register`` exchange sends the public common start x^0 (the user's initial arrays) to every agent and
    collects L_i: the common stepsize (PG-EXTRA ``alpha_scale 2 lambda_min(W~) / L_max``, NIDS ``alpha_scale 2 /
    L_max``) and the RW-ADMM penalty (``beta_scale L_max``) need ``L_max = max_i L_i``, and so does the sensitivity
    (``Delta = 2 alpha L_max``; RW-ADMM ``4 L_max / (n beta)``) of the paper's mechanism
    (``privacy=Theorem3Calibration(...)``, the reproduction setting). sigma_1 is then calibrated with the section-4.5
    formulas (:func:`fedpdm_flower.fedapp.privacy.zcdp.sigma1_for_budget`) at ``xi = T`` = the number of rounds for the
    synchronous methods (every agent publishes every round) and at the planned LCI of the walk for RW-ADMM. As for
    DP-RECAL, L_max comes from the agents' reports; ``lipschitz_bound`` clamps them.

DP-PG-EXTRA, DP-NIDS: synchronous routing (:class:`fedpdm_flower.strategies.decentralized.SyncRouter`)
    Every agent every round. Round k sends agent i its graph neighbours' round-(k-1) published messages (the
    server's outbox, unchanged; nothing in round 1), its row of the Metropolis-Hastings W (W_ii, W_ij) and the
    scalars (alpha, sigma_1, R, nu1, nu2); the agent
    * round 1: initialises (``pg_extra_init`` / ``nids_init`` from the registered x^0), round k >= 2: steps with
      the received messages (``pg_extra_step`` / ``nids_step``), i.e. from x^{k-1} to x^k;
    * publishes its round-k message with the noise of its k-th publication (``pg_extra_publish``: x_i^k,
      ``nids_publish``: v_i^k) and replies with it; the server stores it in the outbox.
    Each agent therefore runs exactly the per-agent sequence of the simulators' ``engine="per_agent"``
    (init, publish 1, step 1, publish 2, ...): after T rounds it holds ``x_i^T`` (= ``simulate_*(T - 1)``'s agent
    states, bit for bit) and has published T messages (LCI = T, xi = T), the last of which -- the round-T outbox --
    is the run's output. The step that would follow (x^{T+1}) is not run: nobody would ever see its result.

DP-RW-ADMM: the token routed like DP-RECAL's baton (:class:`fedpdm_flower.strategies.recal.RelayRouter`)
    One holder per round (K = the number of rounds = token hops); the holder runs ``rw_admm_step`` on the received
    (noisy) token and ``rw_admm_publish``, and replies with the new noisy token; the server stores it and draws the
    next holder along the graph with :func:`fedpdm_flower.fedapp.topology.next_agent` (walk, walk_start, seed: the holders of
    :func:`fedpdm_flower.fedapp.topology.walk_path`, hence of :func:`simulate_rw_admm`). The failure rule is DP-RECAL's (one retry
    of the holder, then the run stops); ``stop_on_budget`` ends the run before a holder would exceed xi_plan.

The model the strategies return (and ``evaluate_fn`` sees) is built only from what the server already holds:
the synchronous methods' is the **average of the agents' latest published (noisy) messages** (noisy x_i^k for
PG-EXTRA, noisy v_i^k for NIDS, which equals x at a fixed point), RW-ADMM's is ``prox_{r/beta}(token)`` of the
latest published token (what the next holder would compute; exactly :func:`simulate_rw_admm`'s x). The agents'
exact x_i never leave them, so the synchronous methods' model is *not* the simulators' exact agent average
``x-bar`` (spec 5.7 [interp]) -- it is noisier. Reported per round: the paper's communication count ``graph_msgs``
(:func:`messages_per_iteration` x iterations; RW-ADMM: x completed paper iterations, one paper iteration =
activation_prob x n hops), the messages actually sent, the LCI, and the realised epsilon (Theorem 3's formulas via
:func:`fedpdm_flower.fedapp.privacy.zcdp.epsilon_from_noise` with the baseline's Delta at xi = LCI; its rigorous
figure is unbounded: Delta ignores the divergence earlier rounds accumulate and no gradient is clipped).

**Record-level DP-SGD** (``privacy=PrivacyTarget(...)``, the rigorous mechanism): every evaluation of grad f_i is a
DP-SGD step of the agent (Poisson sample of its records from its own randomness, per-record clipping, Gaussian
noise), the stored noisy gradient is what the recursion reuses (PG-EXTRA's and NIDS's grad f_i(x^{k-1}) terms), and
the published vectors carry no noise of their own: they are post-processing of the noisy gradients, so the
guarantee holds against the server, every neighbour and any eavesdropper. One step per round (NIDS's first round:
two), calibrated for the run; each agent's ledger and floor enforce it (docs/private-learning-decentralized.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.algorithms.recal_baselines import (
    RW_ADMM_ACTIVATION_PROB,
    elastic_net_prox,
    gradient_message_sensitivity,
    messages_per_iteration,
    nids_alpha_bound,
    pg_extra_alpha_bound,
    rw_admm_initial_token,
    rw_admm_paper_iterations,
    rw_admm_sensitivity,
)
from fedpdm_flower.fedapp.results import RoundRecord
from fedpdm_flower.strategies.base import Scalar
from fedpdm_flower.strategies.decentralized import SyncRouter
from fedpdm_flower.strategies.recal import RecalFamily, RelayRouter

__all__ = ["DPNids", "DPPGExtra", "DPRWAdmm"]


class _TableV(RecalFamily):
    """The baselines' communication records (spec 5.6)."""

    #: canonical algorithm name of :mod:`fedpdm_flower.fedapp.algorithms.recal_baselines`
    algorithm = ""

    def step_size(self) -> float:
        """alpha (synchronous methods) or beta (RW-ADMM), for the records."""
        raise NotImplementedError

    def paper_iterations(self) -> int:
        """Iterations as the paper counts them (for ``graph_msgs``)."""
        raise NotImplementedError

    def messages_sent(self) -> int:
        """Graph messages this implementation sent (the simulators' ``messages_sent``)."""
        raise NotImplementedError

    def graph_msgs(self) -> int:
        """The paper's communication count: :func:`messages_per_iteration` x iterations (spec 5.6 constants)."""
        assert self.graph is not None
        return messages_per_iteration(self.algorithm, self.graph) * self.paper_iterations()

    def evaluate_round(self, server_round: int) -> RoundRecord:
        rec = super().evaluate_round(server_round)
        rec.extra.update({"lci": float(self.lci()), "graph_msgs": float(self.graph_msgs()),
                          "messages_sent": float(self.messages_sent()),
                          "paper_iterations": float(self.paper_iterations()), "step": self.step_size()})
        return rec

    def privacy_summary(self) -> dict[str, float]:
        return {**super().privacy_summary(), **self.mechanism_summary(), "lci": float(self.lci()),
                "graph_msgs": float(self.graph_msgs()), "messages_sent": float(self.messages_sent())}


class _SyncBaseline(_TableV, SyncRouter):
    """DP-PG-EXTRA / DP-NIDS router: every agent every round, the outbox forwarded unchanged (module docstring).

    Parameters
    ----------
    alpha_scale
        The common stepsize is alpha_scale times the method's bound at L_max (default 0.5).
    **kwargs
        :class:`fedpdm_flower.strategies.recal.RecalFamily`'s (privacy, nu1, nu2, lipschitz_bound) and
        :class:`fedpdm_flower.strategies.decentralized.GraphRouting`'s (graph, federation) arguments.
    """

    def __init__(self, *, alpha_scale: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(alpha_scale, bool) or not isinstance(alpha_scale, int | float) or not 0.0 < alpha_scale < 1.0:
            raise ValueError(f"alpha_scale must lie in (0, 1), got {alpha_scale!r}")
        self.alpha_scale = float(alpha_scale)
        self.alpha = 0.0

    def alpha_bound(self, l_max: float) -> float:
        """The stepsize bound of the method at L_max."""
        raise NotImplementedError

    def on_register(self) -> None:
        self.alpha = self.alpha_scale * self.alpha_bound(self.l_max)  # as the simulators' _setup_sync
        self.delta_sens = gradient_message_sensitivity(self.alpha, self.l_max)
        self.xi_plan = self.num_rounds  # every agent publishes every round

    #: DP-SGD steps of an agent's first round beyond the one of every round (NIDS evaluates grad f_i at x^0 and x^1)
    first_round_extra_steps = 0

    def steps_in_message(self, server_round: int) -> int:
        """One gradient evaluation per round (the first round of NIDS: two)."""
        return 1 + (self.first_round_extra_steps if server_round == 1 else 0)

    def dpsgd_steps(self) -> int:
        """Every agent steps every round: num_rounds DP-SGD steps (+ the first round's extra), or the target's
        ``horizon`` when given (the run may not then take more rounds than that covers)."""
        assert self.target is not None
        need = self.num_rounds + self.first_round_extra_steps
        if self.target.horizon is not None and self.target.horizon < need:
            raise ValueError(f"PrivacyTarget horizon = {self.target.horizon} covers fewer DP-SGD steps than the "
                             f"{need} every agent of {type(self).__name__} takes in {self.num_rounds} rounds")
        return need

    def steps_taken(self) -> int:
        publications = self.lci()
        return publications + (self.first_round_extra_steps if publications else 0)

    def step_size(self) -> float:
        return self.alpha

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        return {"alpha": self.alpha, **self.noise_config(), **self.dpsgd_config(server_round)}

    def validate_message(self, agent: int, arrays: list[NDArray[Any]]) -> list[NDArray[Any]]:
        return [self.check_vector(arrays[0], f"agent {agent}'s message")]

    def global_model(self) -> NDArray[np.float64]:
        """The average of the agents' latest published messages (x^0 before round 1)."""
        if not self.outbox:
            return self.x
        return np.asarray(self.outbox_stack(0).mean(axis=0), dtype=np.float64)

    def paper_iterations(self) -> int:
        return self.outbox_round

    def messages_sent(self) -> int:
        """Each publication is addressed to every neighbour: ``sum_i d_i`` per round (the simulators' count)."""
        assert self.graph is not None
        return 2 * self.graph.num_edges * self.outbox_round

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        diag = super().aggregate(server_round, updates, metrics)
        ordered = [metrics[i] for i in sorted(metrics)]  # agent order, not arrival order: the same sum in every driver
        diag["mean_sigma"] = float(np.mean([float(m.get("sigma", 0.0)) for m in ordered]))
        diag["mean_local_loss"] = float(np.mean([float(m.get("local_loss", math.nan)) for m in ordered]))
        return diag

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "alpha_scale": self.alpha_scale}


class DPPGExtra(_SyncBaseline):
    """DP-PG-EXTRA (Shi, Ling, Wu, Yin 2015; spec 5.6): agents publish noisy x_i^k every round, the server forwards
    them to the graph neighbours; W~ = (I + W)/2 with Metropolis-Hastings W.

    Parameters
    ----------
    alpha_scale
        alpha = alpha_scale 2 lambda_min(W~) / L_max, below PG-EXTRA's bound (default 0.5).
    privacy, nu1, nu2, lipschitz_bound
        :class:`fedpdm_flower.strategies.recal.RecalFamily` (privacy required). ``PrivacyTarget``: every
        gradient evaluation grad f_i(x_i^k) is a DP-SGD step (one per round; calibrated for T rounds) and the
        published x_i^k carries no noise (post-processing). ``Theorem3Calibration``: noise on each published x_i^k
        with Delta = 2 alpha L_max (spec 5.6 [interp]) at xi = T rounds (the reproduction setting).
    graph, **federation
        :class:`fedpdm_flower.strategies.decentralized.GraphRouting` (default "ring"; ``min_available_nodes`` = n agents).

    Examples
    --------
    >>> strategy = DPPGExtra(graph="ring", min_available_nodes=8, seed=0,
    ...                      privacy=PrivacyTarget(epsilon=8.0, sample_rate=0.1, clip_norm=20.0))
    >>> result = strategy.start(grid=grid, initial_arrays=ArrayRecord([x0]), num_rounds=600)
    """

    algorithm = "pg-extra"

    def alpha_bound(self, l_max: float) -> float:
        assert self.weights is not None
        return pg_extra_alpha_bound(self.weights, l_max)


class DPNids(_SyncBaseline):
    """DP-NIDS (Li, Shi, Yan 2019; spec 5.6): agents publish noisy v_i^k every round, the server forwards them.

    Parameters
    ----------
    alpha_scale
        alpha = alpha_scale 2 / L_max, below NIDS's bound (default 0.5).
    privacy, nu1, nu2, lipschitz_bound, graph, **federation
        As :class:`DPPGExtra` (with a PrivacyTarget the first round takes two DP-SGD steps, grad f_i(x^0) and
        grad f_i(x^1), so z is calibrated for T + 1 steps; v_i^k is published without noise).
    """

    algorithm = "nids"
    first_round_extra_steps = 1  # round 1: nids_init's grad f_i(x^0) and nids_publish's grad f_i(x^1)

    def alpha_bound(self, l_max: float) -> float:
        return nids_alpha_bound(l_max)


class DPRWAdmm(_TableV, RelayRouter):
    """DP-RW-ADMM (Walkman-style stand-in for Shah & Avrachenkov 2018, spec 5.6 [interp]): one token hop per
    round along the walk, the server only relays it.

    Parameters
    ----------
    beta_scale
        ADMM penalty beta = beta_scale L_max (default 2: the linearised step needs beta large relative to L).
    activation_prob
        P of Table V (default 0.5): one paper iteration is P n token hops; used only to report the paper's
        communication count (16 per paper iteration on ring-8).
    privacy, nu1, nu2, lipschitz_bound
        :class:`fedpdm_flower.strategies.recal.RecalFamily` (privacy required). ``PrivacyTarget``: the gradient of
        each activation is a DP-SGD step (calibrated for the planned LCI), the token carries no noise.
        ``Theorem3Calibration``: noise on the token with Delta = 4 L_max / (n beta) at the planned LCI.
    walk, walk_start, xi_plan, stop_on_budget
        :class:`fedpdm_flower.strategies.recal.RelayRouter`.
    graph, **federation
        :class:`fedpdm_flower.strategies.decentralized.GraphRouting`.
    """

    algorithm = "rw-admm"
    message_name = "token"

    def __init__(self, *, beta_scale: float = 2.0, activation_prob: float = RW_ADMM_ACTIVATION_PROB,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(beta_scale, bool) or not isinstance(beta_scale, int | float) \
                or not (math.isfinite(beta_scale) and beta_scale > 0):
            raise ValueError(f"beta_scale must be a finite number > 0, got {beta_scale!r}")
        if isinstance(activation_prob, bool) or not isinstance(activation_prob, int | float) \
                or not 0.0 < activation_prob <= 1.0:
            raise ValueError(f"activation_prob must lie in (0, 1], got {activation_prob!r}")
        self.beta_scale = float(beta_scale)
        self.activation_prob = float(activation_prob)
        self.beta = 0.0
        self.token: NDArray[np.float64] = np.zeros(0)

    def on_initialize(self) -> None:
        """t^1 = x^0 (every y_i = x^0, z_i = 0)."""
        self.token = rw_admm_initial_token(self.x)

    def on_register(self) -> None:
        self.beta = self.beta_scale * self.l_max  # as simulate_rw_admm
        self.delta_sens = rw_admm_sensitivity(self.beta, self.l_max, self.num_clients)
        if self.target is None:  # with DP-SGD, xi_plan was fixed with z before round 1
            self.xi_plan = self.plan_xi()

    def step_size(self) -> float:
        return self.beta

    def global_model(self) -> NDArray[np.float64]:
        """``prox_{r/beta}`` of the latest published token (x^0 before registration)."""
        if self.beta <= 0:
            return self.x
        return elastic_net_prox(1.0 / self.beta, self.nu1, self.nu2)(self.token)

    def paper_iterations(self) -> int:
        return rw_admm_paper_iterations(self.hops, self.activation_prob, self.num_clients)

    def messages_sent(self) -> int:
        """One token message per hop."""
        return self.hops

    # ------------------------------------------------------------------ one hop per round
    def client_payload(self, server_round: int, client: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        return [self.token], {"beta": self.beta, "n": self.num_clients, **self.noise_config(),
                              **self.dpsgd_config(server_round), **self.holder_config(client)}

    def decode_update(self, server_round: int, client: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        self.check_holder(client, arrays, metrics, 1)
        return self.check_vector(arrays[0], "the token")

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Store the new token (unchanged), count the hop, draw the next holder along the graph."""
        (agent,) = updates
        self.token = updates[agent]
        self.advance(server_round, agent)
        return {"agent": float(agent), "sigma": float(metrics[agent].get("sigma", 0.0)),
                "local_loss": float(metrics[agent].get("local_loss", math.nan)), "lci": float(self.lci()),
                "hops": float(self.hops)}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "beta_scale": self.beta_scale, "activation_prob": self.activation_prob}
