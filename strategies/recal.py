"""DP-RECAL on Flower: the server only routes (seed 001; spec shared/specs/dp_recal.md 7).

One Flower round = one DP-RECAL iteration = one hop of the baton: the server sends the baton (x, u~[, u]) to the
current holder i_k, receives the holder's new baton, and draws the next holder along the graph (a random walk,
:func:`fedapp.topology.next_agent`). It never computes on private data and never changes the baton; every graph
hop i -> j is realised as i -> server -> j, and the server checks that j is a neighbour of i.

Before iteration 1 one ``query.register`` exchange sends x^1 to every agent (I1) and collects (L_i, alpha_i, m_i):
the server needs alpha_max and L_max for the sensitivity of Lemma 4, Delta = 4 alpha beta L, and calibrates
sigma_1 from the target (epsilon, delta) of Theorem 3 with the planned LCI xi_plan (spec 4.5); with
``stop-on-budget`` the run ends before any agent's activation count would exceed xi_plan. results.json reports
the realised LCI and the epsilon of Theorem 3 at it (the paper's accounting; it covers only the u~ message: the
x message leaks y_i, spec 8 A1 -- simulations/dlg.py demonstrates it).

``recal-mode = exact`` carries the clean u beside u~ (the paper's Algorithm 1 taken literally, convergent, but the
routing server sees u: reproduction only); ``private`` (default) sends only (x, u~) and the noise accumulates
(spec 2.4).
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
from fedapp.algorithms.recal import beta_for, relative_error, solve_elastic_net
from fedapp.compression.codec import MalformedPayload
from fedapp.config import ConfigError, RunConfig
from fedapp.models.base import FloatArray
from fedapp.privacy import zcdp
from fedapp.results import RoundRecord
from fedapp.sampling import rng_for
from fedapp.strategy_base import FederatedStrategy, Scalar, client_error_text
from fedapp.wire import train_content

REGISTER = "query.register"
STREAM_X1 = 40


class DPRECAL(FederatedStrategy):
    """The DP-RECAL router (key ``dp-recal``).

    Parameters
    ----------
    cfg
        Run config: num-clients n, graph, walk, walk-start, num-server-rounds K, recal-mode, recal-epsilon
        (0: use recal-sigma1 as given), recal-delta, recal-R, xi-plan, stop-on-budget, alpha-scale, recal-nu1/nu2,
        label-mode, recal-samples, x1-init, seed (data split, walk, x^1), noise-seed.
    evaluator
        Unused (the relative error to the centrally computed x* is evaluated here); kept for the common signature.
    """

    privacy_label = "eps(Thm 3)"
    #: spec 7.4: a holder that fails gets one retry before the run stops
    retries_without_reply = 1

    def __init__(self, cfg: RunConfig, evaluator: Any = None) -> None:
        self.problem = recal_problem(cfg)
        self.graph = topology.parse_graph(cfg.graph, cfg.num_clients, cfg.seed)
        self.beta = beta_for(cfg.num_clients)
        self.x_star = solve_elastic_net(self.problem).x
        self.tau = np.zeros(cfg.num_clients, dtype=np.int64)
        self.holder = -1
        self.first_holder = -1
        self.finished = False
        self.sigma1 = cfg.recal_sigma1
        self.delta_sens = 0.0
        self.xi_plan = 0
        self.graph_msgs = 0
        self.agent_rho: dict[int, float] = {}
        super().__init__(cfg, evaluator=None)
        self.x1 = self.x.copy()
        self.baton: list[NDArray[np.float64]] = [self.x.copy(), np.zeros_like(self.x)]
        if cfg.recal_mode == "exact":
            self.baton.append(np.zeros_like(self.x))
            log(WARNING, "recal-mode=exact: the clean u travels beside u~, the routing server sees it (not private; "
                "reproduction of the paper's Algorithm 1 only)")

    def initial_model(self) -> FloatArray:
        """x^1: zeros, or a seeded N(0, I) (spec A9: on MNIST x* is nearly 0, so a zero start makes the relative
        error's denominator tiny)."""
        shape = self.problem.x_shape
        if self.cfg.x1_init == "zero":
            return np.zeros(shape)
        return rng_for(self.cfg.seed, STREAM_X1).standard_normal(shape)

    def global_model(self) -> FloatArray:
        return self.baton[0] if hasattr(self, "baton") else self.x

    def summary(self) -> None:
        c = self.cfg
        log(INFO, "DP-RECAL: n=%d graph=%s walk=%s K=%d mode=%s q=%s eps target=%s delta=%g R=%g",
            c.num_clients, self.graph.label or c.graph, c.walk, c.num_server_rounds, c.recal_mode,
            self.problem.x_shape, c.recal_epsilon or "none (sigma1 given)", c.recal_delta, c.recal_r)

    # ------------------------------------------------------------------ registration (before iteration 1)
    def pre_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        if server_round != 1:
            return []
        return self.to_all(REGISTER, train_content([self.x1], {"server-round": 0}))

    def consume_pre_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> None:
        """Collect (L_i, alpha_i, m_i); Delta of Lemma 4; calibrate sigma_1; draw i_1."""
        c = self.cfg
        info: dict[int, dict[str, float]] = {}
        for node_id, content in replies:
            pid = self.pid_of.get(node_id)
            if isinstance(content, str) or pid is None:
                why = client_error_text(content) if isinstance(content, str) else "unknown node"
                self._reject(server_round, node_id, why)
                continue
            self.count_up(content)
            info[pid] = {k: float(v) for k, v in content.metric_records["metrics"].items() if isinstance(v, int | float)}
        if sorted(info) != list(range(c.num_clients)):
            raise self.round_failed(server_round, f"agent(s) {sorted(set(range(c.num_clients)) - set(info))} failed to "
                                    "register (sigma_1 and Delta need every agent's L_i and alpha_i)")
        alpha_max = max(v["alpha"] for v in info.values())
        l_max = max(v["L"] for v in info.values())
        self.delta_sens = zcdp.sensitivity(alpha_max, self.beta, l_max)
        g = topology.stationary_distribution(self.graph)
        self.xi_plan = c.num_server_rounds if c.xi_plan == "K" else zcdp.default_xi_plan(c.num_server_rounds, c.walk, list(g))
        if c.recal_epsilon > 0:
            try:
                self.sigma1 = zcdp.calibrate_sigma1(c.recal_epsilon, c.recal_delta, c.recal_r, self.xi_plan, alpha_max,
                                                    self.beta, l_max)
            except zcdp.CalibrationOverflowError as err:  # needs L_max, so only known after registration
                raise ConfigError(f"run config keys 'recal-epsilon' ({c.recal_epsilon:g}) and 'recal-r' ({c.recal_r:g}) "
                                  f"cannot be met over xi_plan = {self.xi_plan} activations: {err}") from None
        self.first_holder = topology.start_agent(self.graph, c.walk_start, c.seed)
        self.holder = self.first_holder
        log(INFO, "registered %d agents: alpha_max=%.4g L_max=%.4g Delta=%.4g xi_plan=%d sigma_1=%.4g start=%d",
            c.num_clients, alpha_max, l_max, self.delta_sens, self.xi_plan, self.sigma1, self.first_holder)

    # ------------------------------------------------------------------ one hop per round
    def participants(self, server_round: int) -> list[int]:
        """Only the holder of the baton (none once the budget stop ended the run)."""
        if self.finished:
            return []
        if self.cfg.stop_on_budget and self.tau[self.holder] + 1 > self.xi_plan:
            log(WARNING, "iteration %d: agent %d would exceed xi_plan=%d activations; the run stops here (budget)",
                server_round, self.holder, self.xi_plan)
            self.finished = True
            return []
        return [self.holder]

    def client_payload(self, server_round: int, partition_id: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        c = self.cfg
        return list(self.baton), {"mode": c.recal_mode, "sigma1": self.sigma1, "R": c.recal_r, "beta": self.beta,
                                  "sensitivity": self.delta_sens}

    def decode_update(self, server_round: int, partition_id: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        if partition_id != self.holder:
            raise MalformedPayload(f"agent {partition_id} replied but agent {self.holder} holds the baton")
        if len(arrays) != len(self.baton):
            raise MalformedPayload(f"baton has {len(arrays)} arrays, expected {len(self.baton)}")
        out = []
        for a in arrays:
            if a.dtype != np.float64 or a.shape != self.problem.x_shape or not np.all(np.isfinite(a)):
                raise MalformedPayload(f"baton arrays must be finite float64 of shape {self.problem.x_shape}")
            out.append(a)
        if int(metrics.get("tau", -1)) != int(self.tau[partition_id]) + 1:
            raise MalformedPayload(f"agent {partition_id} reports tau={metrics.get('tau')}, "
                                   f"expected {int(self.tau[partition_id]) + 1}")
        return out

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Store the new baton (unchanged), count the hop, draw the next holder along the graph."""
        (pid,) = updates
        self.baton = updates[pid]
        self.tau[pid] += 1
        self.graph_msgs += 1
        self.agent_rho[pid] = float(metrics[pid].get("rho_total", 0.0))
        nxt = topology.next_agent(self.graph, pid, server_round, self.cfg.seed, self.cfg.walk, start=self.first_holder)
        if self.cfg.walk != "iid" and not self.graph.has_edge(pid, nxt):
            raise RuntimeError(f"walk proposed hop {pid} -> {nxt}, which is not a graph edge")
        self.holder = nxt
        return {"agent": float(pid), "sigma": float(metrics[pid].get("sigma", 0.0)),
                "local_loss": float(metrics[pid].get("local_loss", math.nan)), "graph_msgs": float(self.graph_msgs),
                "lci": float(self.tau.max())}

    def consume_replies(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> Any:
        """As the base, plus the failure rule of spec 7.4: the holder gets one retry (the baton and the walk stay
        put, ``retries_without_reply``); a second consecutive failure stops the run with RoundFailed -- skipping the
        holder would lose its update and break the u = sum lambda invariant."""
        if self.finished:
            return None
        return super().consume_replies(server_round, replies)

    def no_reply_cause(self, server_round: int, expected: int, failed: int, attempts: int) -> str:
        again = " twice in a row" if attempts == 2 else f" {attempts} times in a row" if attempts > 2 else ""
        return f"agent {self.holder} failed to relay the baton{again}"

    # ------------------------------------------------------------------ evaluation and privacy
    def realised_epsilon(self) -> float:
        """Theorem 3 at the realised LCI (max_i tau_i): the paper's accounting of the u~ messages."""
        xi = int(self.tau.max())
        if xi == 0 or self.sigma1 <= 0:
            return 0.0 if xi == 0 else math.inf
        return zcdp.epsilon_from_noise(self.sigma1, self.delta_sens, self.cfg.recal_r, xi, self.cfg.recal_delta)

    def evaluate_round(self, server_round: int) -> RoundRecord:
        """Relative error ||x - x*|| / ||x^1 - x*|| (results.json "objective_gap"), LCI, realised epsilon."""
        rec = super().evaluate_round(server_round)
        rec.objective_gap = relative_error(self.baton[0], self.x_star, self.x1)
        rec.epsilon, rec.delta = self.realised_epsilon(), self.cfg.recal_delta
        rec.extra.update({"relative_error": rec.objective_gap, "xi_plan": float(self.xi_plan),
                          "sigma1": self.sigma1, "delta_sensitivity": self.delta_sens})
        if server_round % self.cfg.eval_every == 0 or server_round == self.cfg.num_server_rounds:
            log(INFO, "  k=%d relative error %.4g, LCI %d, eps(Thm 3) %.4g", server_round, rec.objective_gap,
                int(self.tau.max()), rec.epsilon)
        return rec

    def privacy_summary(self) -> dict[str, float]:
        out = {"eps_theorem3_realised": self.realised_epsilon(), "lci": float(self.tau.max()),
               "graph_msgs": float(self.graph_msgs)}
        for pid, rho in sorted(self.agent_rho.items()):
            out[f"eps_agent{pid}"] = zcdp.eps_from_rho(rho, self.cfg.recal_delta) if rho > 0 else 0.0
        return out
