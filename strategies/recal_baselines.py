"""DP-RECAL's Table V baselines on Flower: DP-PG-EXTRA, DP-NIDS (synchronous) and DP-RW-ADMM (random walk).

Seed 001, spec shared/specs/dp_recal.md 5.6, 5.7, 7.7; the math (per-agent init / publish / step functions, noise
streams, calibration, communication constants) is :mod:`fedapp.algorithms.recal_baselines`, which the agents call
(clients/recal_baselines.py). Like DP-RECAL's strategy, the server only routes and never computes on the agents'
messages for the algorithm.

Registration (round 1, before the first train message)
    One ``query.register`` exchange sends the public common start x^0 (``x1-init``: the same start as DP-RECAL's
    x^1) to every agent and collects (L_i, m_i): the common stepsize (PG-EXTRA ``alpha_scale 2 lambda_min(W~) /
    L_max``, NIDS ``alpha_scale 2 / L_max``) and the RW-ADMM penalty (``rw-beta-scale L_max``) need
    ``L_max = max_i L_i``, and so does the sensitivity (``Delta = 2 alpha L_max``; RW-ADMM ``4 L_max / (n beta)``).
    sigma_1 is then calibrated with the section-4.5 formulas (:func:`baseline_sigma1`) from recal-epsilon /
    recal-delta / recal-r (recal-epsilon = 0: recal-sigma1 as given), at ``xi = T = num-server-rounds`` for the
    synchronous methods (every agent publishes every round) and at the planned LCI of the walk for RW-ADMM.

DP-PG-EXTRA, DP-NIDS: synchronous routing (:class:`strategies.decentralized.SyncRouter`)
    Every agent every round. Round k sends agent i its graph neighbours' round-(k-1) published messages (the
    server's outbox, unchanged; nothing in round 1) plus the scalars (alpha, sigma_1, R); the agent
    * round 1: initialises (``pg_extra_init`` / ``nids_init`` from the registered x^0), round k >= 2: steps with
      the received messages (``pg_extra_step`` / ``nids_step``), i.e. from x^{k-1} to x^k;
    * publishes its round-k message with the noise of its k-th publication (``pg_extra_publish``: x_i^k,
      ``nids_publish``: v_i^k) and replies with it; the server stores it in the outbox.
    Each agent therefore runs exactly the per-agent sequence of the simulators' ``engine="per_agent"``
    (init, publish 1, step 1, publish 2, ...): after T rounds it holds ``x_i^T`` (= ``simulate_*(T - 1)``'s agent
    states, bit for bit) and has published T messages (LCI = T, xi = T), the last of which -- the round-T outbox --
    is the run's output. The step that would follow (x^{T+1}) is not run: nobody would ever see its result.

    **W and alpha:** each agent computes its own row of the Metropolis-Hastings W
    (:func:`fedapp.topology.metropolis_weights`, :func:`mixing_row`) from the graph spec in the run config (a real
    agent needs only its and its neighbours' degrees); the server sends the neighbour ids of the messages it
    forwards (``config["neighbours"]``) and the agent checks they are its graph neighbours. The stepsize alpha is
    sent by the server, because it depends on L_max, known only after registration.

DP-RW-ADMM: the token routed like DP-RECAL's baton
    One holder per round (T = num-server-rounds token hops); the holder runs ``rw_admm_step`` on the received
    (noisy) token and ``rw_admm_publish``, and replies with the new noisy token; the server stores it and draws
    the next holder along the graph with :func:`fedapp.topology.next_agent` (walk, walk-start, seed: the holders of
    :func:`fedapp.topology.walk_path`, hence of :func:`simulate_rw_admm`). The failure rule is DP-RECAL's (one retry
    of the holder, then the run stops); ``stop-on-budget`` ends the run before a holder would exceed xi_plan.

Evaluation (simulation-side, evaluation only)
    The server holds no model of its own. For the metrics it uses only what it already holds: the synchronous
    methods' "model" is the **average of the agents' latest published (noisy) messages** (noisy x_i^k for
    PG-EXTRA, noisy v_i^k for NIDS, which equals x at a fixed point), RW-ADMM's is ``prox_{r/beta}(token)`` of the
    latest published token (what the next holder would compute; exactly :func:`simulate_rw_admm`'s x). The
    agents' exact x_i never leave them, so the synchronous methods' objective_gap is *not* the simulators' exact
    agent average ``x-bar`` (spec 5.7 [interp]) -- it is noisier; the exact one is available from the simulators,
    which the tests pin equal to these runs bit for bit. Reported per round: relative error
    ``||x - x*|| / ||x^0 - x*||`` (x* computed centrally, simulation only), the paper's communication count
    ``graph_msgs`` (:func:`messages_per_iteration` x iterations; RW-ADMM: x completed paper iterations, one paper
    iteration = rw-activation-prob x n hops), the messages actually sent, the LCI, and the realised epsilon
    (Theorem 3's formulas via :func:`fedapp.privacy.zcdp.epsilon_from_noise` with the baseline's Delta at xi = LCI).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import RecordDict
from flwr.common.logger import log
from numpy.typing import NDArray

from clients.recal import recal_problem
from fedapp import topology
from fedapp.algorithms.recal import relative_error, solve_elastic_net
from fedapp.algorithms.recal_baselines import (
    baseline_sigma1,
    elastic_net_prox,
    gradient_message_sensitivity,
    messages_per_iteration,
    nids_alpha_bound,
    pg_extra_alpha_bound,
    rw_admm_initial_token,
    rw_admm_paper_iterations,
    rw_admm_sensitivity,
)
from fedapp.compression.codec import MalformedPayload
from fedapp.config import ConfigError, RunConfig
from fedapp.models.base import FloatArray
from fedapp.privacy import zcdp
from fedapp.results import RoundRecord
from fedapp.sampling import rng_for
from fedapp.strategy_base import FederatedStrategy, Scalar, client_error_text
from fedapp.wire import train_content
from strategies._legacy_decentralized import PUBLICATIONS, SyncRouter
from strategies.recal import REGISTER, STREAM_X1


class _TableVBaseline(FederatedStrategy):
    """What the three baselines share: the elastic-net problem, x^0, x*, registration, calibration, metrics."""

    #: canonical algorithm name of :mod:`fedapp.algorithms.recal_baselines`
    algorithm = ""
    privacy_label = "eps(Thm 3)"
    tau: NDArray[np.int64]
    graph: topology.Graph

    def __init__(self, cfg: RunConfig, evaluator: Any = None) -> None:
        self.problem = recal_problem(cfg)
        self.x_star = solve_elastic_net(self.problem).x
        self.sigma1 = cfg.recal_sigma1
        self.delta_sens = 0.0
        self.l_max = 0.0
        self.xi_plan = 0
        self.registered = False
        super().__init__(cfg, evaluator=None)  # the metric is the relative error to x*, not test accuracy
        self.x0 = self.x.copy()

    def initial_model(self) -> FloatArray:
        """x^0: a seeded N(0, I) or zeros (``x1-init``), the same start as DP-RECAL's x^1 (spec A9)."""
        if self.cfg.x1_init == "zero":
            return np.zeros(self.problem.x_shape)
        return rng_for(self.cfg.seed, STREAM_X1).standard_normal(self.problem.x_shape)

    # ------------------------------------------------------------------ hooks
    def on_register(self) -> None:
        """Set the step (alpha or beta), ``delta_sens`` and ``xi_plan`` from ``l_max``."""
        raise NotImplementedError

    def step_size(self) -> float:
        """alpha (synchronous methods) or beta (RW-ADMM), for the records."""
        raise NotImplementedError

    def paper_iterations(self) -> int:
        """Iterations as the paper counts them (for ``graph_msgs``)."""
        raise NotImplementedError

    def messages_sent(self) -> int:
        """Graph messages this implementation sent (the simulators' ``messages_sent``)."""
        raise NotImplementedError

    def extra_metrics(self) -> dict[str, float]:
        """Algorithm-specific per-round metrics."""
        return {}

    # ------------------------------------------------------------------ registration (before round 1)
    def pre_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        if server_round != 1:
            return []
        return self.to_all(REGISTER, train_content([self.x0], {"server-round": 0}))

    def consume_pre_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> None:
        """Collect L_i; L_max; the step, Delta and xi_plan (:meth:`on_register`); calibrate sigma_1."""
        c = self.cfg
        lips: dict[int, float] = {}
        for node_id, content in replies:
            pid = self.pid_of.get(node_id)
            if isinstance(content, str) or pid is None:
                why = client_error_text(content) if isinstance(content, str) else "unknown node"
                self._reject(server_round, node_id, why)
                continue
            self.count_up(content)
            value = content.metric_records["metrics"].get("L")
            if not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
                self._reject(server_round, node_id, f"agent {pid} registered an invalid L_i = {value!r}")
                continue
            lips[pid] = float(value)
        if sorted(lips) != list(range(c.num_clients)):
            raise self.round_failed(server_round, f"agent(s) {sorted(set(range(c.num_clients)) - set(lips))} failed to "
                                    "register (the step and Delta need every agent's L_i)")
        self.l_max = max(lips.values())
        self.on_register()
        if c.recal_epsilon > 0:
            try:
                self.sigma1 = baseline_sigma1(c.recal_epsilon, c.recal_delta, c.recal_r, self.xi_plan, self.delta_sens)
            except zcdp.CalibrationOverflowError as err:  # needs L_max, so only known after registration
                raise ConfigError(f"run config keys 'recal-epsilon' ({c.recal_epsilon:g}) and 'recal-r' ({c.recal_r:g}) "
                                  f"cannot be met over xi_plan = {self.xi_plan} activations: {err}") from None
        self.registered = True
        log(INFO, "registered %d agents: L_max=%.4g step=%.4g Delta=%.4g xi=%d sigma_1=%.4g", c.num_clients,
            self.l_max, self.step_size(), self.delta_sens, self.xi_plan, self.sigma1)

    # ------------------------------------------------------------------ metrics
    def lci(self) -> int:
        """Local communication involvement ``max_i tau_i`` (spec 1.5)."""
        return int(self.tau.max())

    def graph_msgs(self) -> int:
        """The paper's communication count: :func:`messages_per_iteration` x iterations (spec 5.6 constants)."""
        return messages_per_iteration(self.algorithm, self.graph) * self.paper_iterations()

    def realised_epsilon(self) -> float:
        """Theorem 3's formulas with this baseline's Delta at the realised LCI (inf without noise)."""
        xi = self.lci()
        if xi == 0:
            return 0.0
        if self.sigma1 <= 0:
            return math.inf
        return zcdp.epsilon_from_noise(self.sigma1, self.delta_sens, self.cfg.recal_r, xi, self.cfg.recal_delta)

    def evaluate_round(self, server_round: int) -> RoundRecord:
        """Relative error of the evaluation-only model (module docstring), communication, LCI, realised epsilon."""
        rec = super().evaluate_round(server_round)
        rec.objective_gap = relative_error(self.global_model(), self.x_star, self.x0)
        rec.epsilon, rec.delta = self.realised_epsilon(), self.cfg.recal_delta
        rec.extra.update({"relative_error": rec.objective_gap, "lci": float(self.lci()),
                          "graph_msgs": float(self.graph_msgs()), "messages_sent": float(self.messages_sent()),
                          "paper_iterations": float(self.paper_iterations()), "xi_plan": float(self.xi_plan),
                          "sigma1": self.sigma1, "delta_sensitivity": self.delta_sens, "step": self.step_size()})
        rec.extra.update(self.extra_metrics())
        if server_round % self.cfg.eval_every == 0 or server_round == self.cfg.num_server_rounds:
            log(INFO, "  k=%d relative error %.4g, LCI %d, graph msgs %d, eps(Thm 3) %.4g", server_round,
                rec.objective_gap, self.lci(), self.graph_msgs(), rec.epsilon)
        return rec

    def privacy_summary(self) -> dict[str, float]:
        return {"eps_theorem3_realised": self.realised_epsilon(), "lci": float(self.lci()),
                "graph_msgs": float(self.graph_msgs()), "messages_sent": float(self.messages_sent())}

    def summary(self) -> None:
        c = self.cfg
        log(INFO, "%s: n=%d graph=%s T=%d q=%s eps target=%s delta=%g R=%g", self.algorithm, c.num_clients,
            self.graph.label or c.graph, c.num_server_rounds, self.problem.x_shape,
            c.recal_epsilon or "none (sigma1 given)", c.recal_delta, c.recal_r)

    def check_vector(self, arr: NDArray[Any], what: str) -> NDArray[np.float64]:
        """A published vector must be finite float64 of the problem's shape."""
        if arr.dtype != np.float64 or arr.shape != self.problem.x_shape or not np.all(np.isfinite(arr)):
            raise MalformedPayload(f"{what} must be finite float64 of shape {self.problem.x_shape}, "
                                   f"got {arr.dtype} {arr.shape}")
        return np.asarray(arr, dtype=np.float64)


class _SyncBaseline(_TableVBaseline, SyncRouter):
    """DP-PG-EXTRA / DP-NIDS router: every agent every round, the outbox forwarded unchanged (module docstring)."""

    def __init__(self, cfg: RunConfig, evaluator: Any = None) -> None:
        self.alpha = 0.0
        super().__init__(cfg, evaluator)
        self.weights = topology.metropolis_weights(self.graph)

    def alpha_bound(self, l_max: float) -> float:
        """The stepsize bound of the method at L_max."""
        raise NotImplementedError

    def on_register(self) -> None:
        self.alpha = self.cfg.alpha_scale * self.alpha_bound(self.l_max)  # as _setup_sync
        self.delta_sens = gradient_message_sensitivity(self.alpha, self.l_max)
        self.xi_plan = self.cfg.num_server_rounds  # every agent publishes every round

    def step_size(self) -> float:
        return self.alpha

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        if not self.registered:
            raise RuntimeError("the agents have not registered (no alpha, sigma_1 yet)")
        return {"alpha": self.alpha, "sigma1": self.sigma1, "R": self.cfg.recal_r}

    def validate_message(self, partition_id: int, arrays: list[NDArray[Any]]) -> list[NDArray[Any]]:
        return [self.check_vector(arrays[0], f"agent {partition_id}'s message")]

    def global_model(self) -> FloatArray:
        """Evaluation only: the average of the agents' latest published messages (x^0 before round 1)."""
        if not getattr(self, "outbox", None):
            return self.x
        return np.asarray(self.outbox_stack(0).mean(axis=0), dtype=np.float64)

    def paper_iterations(self) -> int:
        return self.outbox_round

    def messages_sent(self) -> int:
        """Each publication is addressed to every neighbour: ``sum_i d_i`` per round (the simulators' count)."""
        return 2 * self.graph.num_edges * self.outbox_round

    def extra_metrics(self) -> dict[str, float]:
        out = {"forwarded": float(self.forwarded)}
        if self.outbox:
            diffs = (self.outbox_stack(0) - self.x_star).reshape(self.cfg.num_clients, -1)
            den = float(np.linalg.norm(self.x0 - self.x_star))
            out["published_max_rel_error"] = float(np.linalg.norm(diffs, axis=1).max()) / den
        return out

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        diag = super().aggregate(server_round, updates, metrics)
        diag["mean_sigma"] = float(np.mean([float(m.get("sigma", 0.0)) for m in metrics.values()]))
        diag["mean_local_loss"] = float(np.mean([float(m.get("local_loss", math.nan)) for m in metrics.values()]))
        return diag


class DPPGExtra(_SyncBaseline):
    """DP-PG-EXTRA (key ``dp-pg-extra``): agents publish noisy x_i^k; stepsize ``alpha-scale 2 lambda_min(W~)/L``.

    Parameters
    ----------
    cfg
        Run config: num-clients n, graph, num-server-rounds T, alpha-scale, recal-epsilon (0: recal-sigma1 as
        given), recal-delta, recal-r, recal-nu1/nu2, label-mode, recal-samples, x1-init, seed, noise-seed.
    evaluator
        Unused (the metric is the relative error to the central x*); kept for the common signature.
    """

    algorithm = "pg-extra"

    def alpha_bound(self, l_max: float) -> float:
        return pg_extra_alpha_bound(self.weights, l_max)


class DPNids(_SyncBaseline):
    """DP-NIDS (key ``dp-nids``): agents publish noisy v_i^k; stepsize ``alpha-scale 2 / L_max``.

    Parameters as :class:`DPPGExtra`.
    """

    algorithm = "nids"

    def alpha_bound(self, l_max: float) -> float:
        return nids_alpha_bound(l_max)


class DPRWAdmm(_TableVBaseline):
    """DP-RW-ADMM (key ``dp-rw-admm``): one token hop per round along the walk, the server only relays it.

    Parameters
    ----------
    cfg
        Run config: num-clients n, graph, walk, walk-start, num-server-rounds K (token hops), rw-beta-scale,
        rw-activation-prob (paper-iteration mapping of the communication count), recal-epsilon / recal-sigma1,
        recal-delta, recal-r, xi-plan, stop-on-budget, recal-nu1/nu2, label-mode, recal-samples, x1-init, seed
        (data split, walk, x^0), noise-seed.
    evaluator
        Unused; kept for the common signature.
    """

    #: as DP-RECAL (spec 7.4): a holder that fails gets one retry before the run stops
    retries_without_reply = 1

    algorithm = "rw-admm"

    def __init__(self, cfg: RunConfig, evaluator: Any = None) -> None:
        self.graph = topology.parse_graph(cfg.graph, cfg.num_clients, cfg.seed)
        self.tau = np.zeros(cfg.num_clients, dtype=np.int64)
        self.holder = -1
        self.first_holder = -1
        self.finished = False
        self.hops = 0
        self.beta = 0.0
        super().__init__(cfg, evaluator)
        self.token = rw_admm_initial_token(self.x0)

    def on_register(self) -> None:
        c = self.cfg
        self.beta = c.rw_beta_scale * self.l_max  # as simulate_rw_admm
        self.delta_sens = rw_admm_sensitivity(self.beta, self.l_max, c.num_clients)
        self.xi_plan = topology.plan_xi(c.num_server_rounds, self.graph, c.walk, rule=c.xi_plan)
        self.first_holder = topology.start_agent(self.graph, c.walk_start, c.seed)
        self.holder = self.first_holder

    def step_size(self) -> float:
        return self.beta

    def global_model(self) -> FloatArray:
        """Evaluation only: ``prox_{r/beta}`` of the latest published token (x^0 before registration)."""
        if self.beta <= 0 or not hasattr(self, "token"):
            return self.x
        return elastic_net_prox(1.0 / self.beta, self.problem.nu1, self.problem.nu2)(self.token)

    def paper_iterations(self) -> int:
        return rw_admm_paper_iterations(self.hops, self.cfg.rw_activation_prob, self.cfg.num_clients)

    def messages_sent(self) -> int:
        """One token message per hop."""
        return self.hops

    def extra_metrics(self) -> dict[str, float]:
        return {"hops": float(self.hops)}

    # ------------------------------------------------------------------ one hop per round
    def participants(self, server_round: int) -> list[int]:
        """Only the token holder (none once the budget stop ended the run)."""
        if self.finished:
            return []
        if self.cfg.stop_on_budget and self.tau[self.holder] + 1 > self.xi_plan:
            log(WARNING, "hop %d: agent %d would exceed xi_plan=%d publications; the run stops here (budget)",
                server_round, self.holder, self.xi_plan)
            self.finished = True
            return []
        return [self.holder]

    def client_payload(self, server_round: int, partition_id: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        return [self.token], {"beta": self.beta, "sigma1": self.sigma1, "R": self.cfg.recal_r}

    def decode_update(self, server_round: int, partition_id: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        if partition_id != self.holder:
            raise MalformedPayload(f"agent {partition_id} replied but agent {self.holder} holds the token")
        if len(arrays) != 1:
            raise MalformedPayload(f"the token is one array, got {len(arrays)}")
        if int(metrics.get(PUBLICATIONS, -1)) != int(self.tau[partition_id]) + 1:
            raise MalformedPayload(f"agent {partition_id} reports publication {metrics.get(PUBLICATIONS)}, "
                                   f"expected {int(self.tau[partition_id]) + 1}")
        return self.check_vector(arrays[0], "the token")

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Store the new token (unchanged), count the hop, draw the next holder along the graph."""
        (pid,) = updates
        self.token = updates[pid]
        self.tau[pid] += 1
        self.hops += 1
        nxt = topology.next_agent(self.graph, pid, server_round, self.cfg.seed, self.cfg.walk, start=self.first_holder)
        if self.cfg.walk != "iid" and not self.graph.has_edge(pid, nxt):
            raise RuntimeError(f"walk proposed hop {pid} -> {nxt}, which is not a graph edge")
        self.holder = nxt
        return {"agent": float(pid), "sigma": float(metrics[pid].get("sigma", 0.0)),
                "local_loss": float(metrics[pid].get("local_loss", math.nan)), "lci": float(self.tau.max())}

    def consume_replies(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> Any:
        """As DP-RECAL: the holder gets one retry (token and walk stay put), a second failure stops the run."""
        if self.finished:
            return None
        return super().consume_replies(server_round, replies)

    def no_reply_cause(self, server_round: int, expected: int, failed: int, attempts: int) -> str:
        again = " twice in a row" if attempts == 2 else f" {attempts} times in a row" if attempts > 2 else ""
        return f"agent {self.holder} failed to relay the token{again}"


__all__ = ["DPNids", "DPPGExtra", "DPRWAdmm"]
