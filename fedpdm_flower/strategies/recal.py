"""DP-RECAL on Flower: the server only routes (seed 001; spec shared/specs/dp_recal.md 7).

L. Wang, L. Guo, S. Yang, X. Shi, "Differentially Private Decentralized Optimization with Relay Communication".
Problem (1): ``min_x sum_i f_i(x) + n r(x)`` with agent i's smooth loss f_i on its own data and the global
regulariser ``r = nu1 ||x||_1 + nu2 ||x||^2`` (r = 0 with nu1 = nu2 = 0).

One Flower round = one DP-RECAL iteration = one hop of the baton: the server sends the baton (x, u~[, u]) to the
current holder i_k, receives the holder's new baton, and draws the next holder along the graph (a random walk,
:func:`fedpdm_flower.fedapp.topology.next_agent`). It never computes on private data and never changes the baton; every graph
hop i -> j is realised as i -> server -> j, and the server checks that j is a neighbour of i.

Before iteration 1 one ``query.register`` exchange sends x^1 (the user's initial arrays, flattened) to every agent
(I1) and collects (L_i, alpha_i, m_i): the step sizes and, for the paper's mechanism, the sensitivity of Lemma 4
(Delta = 4 alpha beta L) need alpha_max and L_max.

**Privacy** (``privacy=``, required; docs/private-learning-decentralized.md):

* ``PrivacyTarget(epsilon, sample_rate, clip_norm)`` -- record-level DP-SGD in the agents' gradient step (12c):
  everything else, the baton included, is post-processing, so the guarantee holds against everyone who sees a
  message -- the routing server, every agent the baton passes through, an eavesdropper on every link. z is
  calibrated before round 1 for xi_plan steps per agent (its planned activations; RDP of the Poisson-subsampled
  Gaussian), each agent charges its own ledger and refuses an activation past its floor, and the run stops before
  any agent would exceed xi_plan. The history reports the worst agent's epsilon.
* ``Theorem3Calibration(...)`` -- the paper's mechanism (the reproduction setting): sigma_1 calibrated from the
  target of Theorem 3 at the planned LCI xi_plan (spec 4.5) after registration; with ``stop_on_budget`` the run ends
  before any agent's activation count would exceed xi_plan. The history reports the realised LCI and Theorem 3's
  epsilon at it (it covers only the u~ message: the x message leaks y_i, spec 8 A1 -- simulations/dlg.py
  demonstrates it), and the rigorous epsilon beside it: inf.
* ``None`` -- RECAL without noise.

**Who sets everyone's noise.** Delta comes from the agents' *reports* of L_i and alpha_i, so one agent that
over-reports L_i raises the noise of every agent (it cannot lower anyone else's: the maximum only grows). With a
public bound ``lipschitz_bound`` each report is clamped to it (DESIGN.md: no client's report sets what others get);
the bound must hold for every honest agent, or that agent's releases are calibrated to the bound instead of its
own L_i. Without it the reports are used as the paper does (registration only checks they are finite and obey
Assumption 2).

:class:`RecalFamily` (registration, calibration, accounting) and :class:`RelayRouter` (one holder per round along
the walk) are shared with the Table V baselines (:mod:`fedpdm_flower.strategies.recal_baselines`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import RecordDict
from flwr.common.logger import log
from numpy.typing import NDArray

from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.algorithms.recal import MODES, alpha_bound, beta_for
from fedpdm_flower.fedapp.compression.codec import MalformedPayload
from fedpdm_flower.fedapp.privacy import zcdp
from fedpdm_flower.fedapp.privacy.dpsgd import DPSGDMechanism, dpsgd_epsilon
from fedpdm_flower.fedapp.privacy.target import DEFAULT_DELTA, MISSING, PrivacyTarget, require_privacy
from fedpdm_flower.fedapp.privacy.zcdp import Theorem3Calibration
from fedpdm_flower.fedapp.results import RoundRecord
from fedpdm_flower.fedapp.wire import train_content
from fedpdm_flower.strategies.base import DIM_KEY, ROUND_KEY, Scalar, client_error_text
from fedpdm_flower.strategies.decentralized import AGENT_KEY, PUBLICATIONS, GraphRouting

#: message type of the registration exchange before iteration 1 (the clients declare it in ``actions``)
REGISTER = "query.register"

__all__ = ["DPRECAL", "REGISTER", "RecalFamily", "RelayRouter"]


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return float(value)


class RecalFamily(GraphRouting):
    """What DP-RECAL and its Table V baselines share: registration, the privacy mechanism and its accounting.

    Parameters
    ----------
    privacy
        Required; no epsilon is chosen for you (built without it, the strategy refuses to start with
        :class:`~fedpdm_flower.fedapp.privacy.target.PrivacyNotChosen`, naming what to pass). One of:

        * :class:`fedpdm_flower.fedapp.privacy.target.PrivacyTarget` -- **record-level DP-SGD in every gradient step
          of the agents** (the rigorous mechanism): each step Poisson-samples the agent's records at
          ``sample_rate`` from the device's own randomness, clips every record's gradient to ``clip_norm`` and adds
          Gaussian noise; everything the algorithm does with the noisy gradients -- the duals, the prox, the baton /
          the broadcast vectors -- is post-processing, so no noise is added to the messages. z is calibrated under
          the RDP accountant of the subsampled Gaussian for the most DP-SGD steps one agent takes in the run
          (:meth:`dpsgd_steps`: its planned activations for the random walks, every round for the synchronous
          methods); the run ends before an agent would take more (an agent's ledger and floor enforce it too).
          Unit: one record of an agent's data; adversary: everyone who sees any message -- the routing server, every
          other agent (the baton / a broadcast passes through its neighbours), an eavesdropper on every link.
        * :class:`fedpdm_flower.fedapp.privacy.zcdp.Theorem3Calibration` -- the paper's own mechanism (noise on the
          published message, Theorem 3's accounting), named as the reproduction setting; its rigorous epsilon is
          unbounded (x travels in the clear, spec A1) and is reported as inf beside Theorem 3's figure.
        * ``None`` -- no noise (RECAL, PG-EXTRA, NIDS, RW-ADMM).
    nu1, nu2
        The regulariser r(x) = nu1 ||x||_1 + nu2 ||x||^2 of problem (1), applied in the agents' prox (default 1/2
        each, Section VII; 0 and 0 is r = 0).
    lipschitz_bound
        A public upper bound on every agent's L_i (Assumption 1): reported L_i are clamped to it before they set
        everyone's step and noise (module docstring). None (default): reports are used as they come, as in the paper.
    **routing
        :class:`fedpdm_flower.strategies.decentralized.GraphRouting`'s ``graph`` and the federation arguments (``seed`` draws the
        graph, the walk and nothing else; ``min_available_nodes`` = the number of agents).
    """

    resume_unsupported: str | None = ("the registration, the walk / baton and the per-agent budgets of the DP-RECAL family are "
                          "not checkpointed yet")

    privacy_label = "eps(Thm 3)"
    #: the agents' rigorous cumulative epsilon under DP-SGD (their ledgers, RDP of the subsampled Gaussian)
    PRIVACY_KEYS = ("eps_dpsgd",)
    RIGOROUS_PRIVACY = ("eps_dpsgd", "RDP (record-level DP-SGD, Poisson-subsampled Gaussian)")
    tau: NDArray[np.int64]

    def __init__(self, *, privacy: Any = MISSING, nu1: float = 0.5, nu2: float = 0.5,
                 lipschitz_bound: float | None = None, **routing: Any) -> None:
        privacy = require_privacy(privacy, type(self).__name__, "Theorem3Calibration(epsilon=..., delta=..., R=...)")
        super().__init__(**routing)
        self.target: PrivacyTarget | None = None
        self.paper: Theorem3Calibration | None = None
        self.epsilon: float | None = None
        self.sigma1 = 0.0
        self.delta, self.R = DEFAULT_DELTA, 1.0
        if isinstance(privacy, PrivacyTarget):
            privacy.rate(type(self).__name__)  # the sample rate is required: said now, not at round 1
            self.target, self.delta = privacy, float(privacy.delta)
            self.privacy_label = "eps(DP-SGD, RDP)"
        elif isinstance(privacy, Theorem3Calibration):
            self.paper = privacy
            self.epsilon = None if privacy.epsilon is None else float(privacy.epsilon)
            self.sigma1 = 0.0 if privacy.sigma1 is None else float(privacy.sigma1)
            self.delta, self.R = float(privacy.delta), float(privacy.R)
        elif privacy is not None:
            raise TypeError(f"privacy must be a PrivacyTarget (record-level DP-SGD), a Theorem3Calibration (the "
                            f"paper's mechanism) or None (no noise), got {type(privacy).__name__}")
        #: the DP-SGD mechanism every agent's step uses (z, q, C; steps per message), set before round 1
        self.dpsgd: DPSGDMechanism | None = None
        self.nu1 = _positive("nu1", nu1, allow_zero=True)
        self.nu2 = _positive("nu2", nu2, allow_zero=True)
        self.lipschitz_bound = None if lipschitz_bound is None else _positive("lipschitz_bound", lipschitz_bound)
        self.reports: dict[int, dict[str, float]] = {}
        self.l_max = 0.0
        self.delta_sens = 0.0
        self.xi_plan = 0
        self.registered = False

    # ------------------------------------------------------------------ record-level DP-SGD
    def dpsgd_steps(self) -> int:
        """The most DP-SGD steps one agent takes in the run: what z is calibrated for (needs the graph and the
        number of rounds)."""
        raise NotImplementedError

    def steps_in_message(self, server_round: int) -> int:
        """DP-SGD steps one train message asks of an agent (one gradient evaluation by default)."""
        return 1

    def attach(self, node_of: Mapping[int, int]) -> None:
        """GraphRouting's attach, then (DP-SGD) the calibration of z: before round 1, so an unreachable target
        stops the run naming the knob."""
        super().attach(node_of)
        if self.target is not None:
            steps = self.dpsgd_steps()
            self.dpsgd = self.target.mechanism(1, steps, owner=type(self).__name__)
            log(INFO, "%s: record-level DP-SGD, (epsilon, delta) = (%g, %g) per agent over %d step(s): z = %.4g, "
                "q = %g, C = %g", type(self).__name__, self.target.epsilon, self.target.delta,
                self.target.horizon or steps, self.dpsgd.noise_multiplier, self.dpsgd.sample_rate,
                self.dpsgd.clip_norm)

    def dpsgd_config(self, server_round: int) -> dict[str, Scalar]:
        """The DP-SGD keys of a train message (none without a PrivacyTarget)."""
        if self.target is None or self.dpsgd is None:
            return {}
        mech = replace(self.dpsgd, steps=self.steps_in_message(server_round))
        return dict(self.target.message_config(mech))

    def dpsgd_epsilon_of(self, steps: int) -> float:
        """The RDP epsilon of ``steps`` DP-SGD steps of this run's mechanism at the target's delta (0 for none)."""
        if self.dpsgd is None or steps <= 0:
            return 0.0
        return dpsgd_epsilon(self.dpsgd.noise_multiplier, self.dpsgd.sample_rate, int(steps), self.delta)

    # ------------------------------------------------------------------ algorithm hooks
    def register_config(self) -> dict[str, Scalar]:
        """Config of the registration message besides d (e.g. DP-RECAL's alpha_scale)."""
        return {}

    def read_report(self, agent: int, metrics: dict[str, Any]) -> dict[str, float]:
        """One agent's registration report, checked and clamped: L_i (every method)."""
        lip = metrics.get("L")
        if isinstance(lip, bool) or not isinstance(lip, int | float) or not (math.isfinite(lip) and lip > 0):
            raise MalformedPayload(f"agent {agent} registered L_i = {lip!r}; it must be a finite number > 0")
        if self.lipschitz_bound is not None and lip > self.lipschitz_bound:
            log(WARNING, "agent %d reported L_i = %.6g above lipschitz_bound = %.6g: clamped", agent, lip,
                self.lipschitz_bound)
            lip = self.lipschitz_bound
        return {"L": float(lip)}

    def on_register(self) -> None:
        """Set the step size(s), ``delta_sens`` and ``xi_plan`` from ``self.reports`` / ``self.l_max``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ registration (before iteration 1)
    def pre_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        """Round 1: x^1 (the initial model, flat) to every agent, with d and :meth:`register_config`."""
        if server_round != 1:
            return []
        config = {ROUND_KEY: 0, DIM_KEY: self.dim, **self.register_config()}
        return self.to_all(REGISTER, train_content([self.x], config, arrays_key=self.arrayrecord_key,
                                                   config_key=self.configrecord_key))

    def consume_pre_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> None:
        """Collect the reports; L_max; :meth:`on_register`; calibrate sigma_1 (spec 7.4, round 1).

        Raises
        ------
        RoundFailed
            Naming the agents that did not register: every agent must, before iteration 1.
        """
        self.reports = {}
        for node_id, content in replies:
            agent = self.pid_of.get(node_id)
            if agent is None:
                self.reject(server_round, node_id, "unknown node")
                continue
            if isinstance(content, str):
                self.reject(server_round, node_id, client_error_text(content))
                continue
            self.count_up(content)
            try:
                metrics = dict(content.metric_records["metrics"])
                self.reports[agent] = self.read_report(agent, metrics)
            except (KeyError, ValueError) as err:
                self.reject(server_round, node_id, f"registration rejected: {err}")
        missing = sorted(set(range(self.num_clients)) - set(self.reports))
        if missing:
            raise self.round_failed(server_round, f"agent(s) {missing} failed to register (every agent must, before "
                                    "iteration 1: the step and the noise need every agent's L_i)")
        self.l_max = max(r["L"] for r in self.reports.values())
        self.on_register()
        if self.epsilon is not None:
            try:
                self.sigma1 = zcdp.sigma1_for_budget(self.epsilon, self.delta, self.delta_sens, self.R, self.xi_plan)
            except zcdp.CalibrationOverflowError as err:  # needs L_max, so only known after registration
                raise ValueError(f"Theorem3Calibration epsilon = {self.epsilon:g} and R = {self.R:g} cannot be met "
                                 f"over xi_plan = {self.xi_plan} activations: {err}") from None
        self.registered = True
        log(INFO, "%s: %d agents registered: L_max=%.4g Delta=%.4g xi_plan=%d sigma_1=%.4g", type(self).__name__,
            self.num_clients, self.l_max, self.delta_sens, self.xi_plan, self.sigma1)

    def noise_config(self) -> dict[str, Scalar]:
        """What every publishing agent needs besides its own state: the noise schedule and the regulariser."""
        if not self.registered:
            raise RuntimeError("the agents have not registered yet (no sigma_1)")
        return {"sigma1": self.sigma1, "R": self.R, "nu1": self.nu1, "nu2": self.nu2}

    # ------------------------------------------------------------------ accounting and records
    def lci(self) -> int:
        """Local communication involvement ``max_i tau_i`` (spec 1.5)."""
        return int(self.tau.max()) if self.tau.size else 0

    def steps_taken(self) -> int:
        """DP-SGD steps of the agent that took the most so far (one per publication by default)."""
        return self.lci()

    def realised_epsilon(self) -> float:
        """The worst agent's epsilon so far: with DP-SGD the RDP epsilon of its steps (server-side recomputation of
        what its ledger reports); with the paper's mechanism Theorem 3 with this method's Delta at the realised LCI
        (inf without noise)."""
        if self.target is not None:
            return self.dpsgd_epsilon_of(self.steps_taken())
        xi = self.lci()
        if xi == 0:
            return 0.0
        if self.sigma1 <= 0:
            return math.inf
        return zcdp.epsilon_from_noise(self.sigma1, self.delta_sens, self.R, xi, self.delta)

    def headline_privacy(self, priv: Any) -> tuple[float | None, float | None]:
        """(epsilon, delta) of the round record: with DP-SGD the worst agent's ledger (its report, else the
        server's recomputation); with the paper's mechanism Theorem 3 at the realised LCI; None without noise."""
        if self.target is not None:
            eps = priv.get("eps_dpsgd") if isinstance(priv, Mapping) else None
            return (float(eps) if isinstance(eps, int | float) else self.realised_epsilon()), self.delta
        if self.paper is None:
            return None, None
        return self.realised_epsilon(), self.delta

    def mechanism_summary(self) -> dict[str, float]:
        """The privacy figures every record carries: DP-SGD's z, q, C and the server's recomputation of the worst
        agent's epsilon; or Theorem 3's figure and the rigorous one beside it (inf, spec A1)."""
        if self.dpsgd is not None:
            return {"dp_noise_multiplier": self.dpsgd.noise_multiplier, "dp_sample_rate": self.dpsgd.sample_rate,
                    "dp_clip": self.dpsgd.clip_norm, "dp_steps_max": float(self.steps_taken()),
                    "eps_dpsgd_server": self.realised_epsilon()}
        if self.paper is not None:
            return {"eps_theorem3_realised": self.realised_epsilon(),
                    "eps_rigorous": Theorem3Calibration.RIGOROUS_EPSILON}
        return {}

    def evaluate_round(self, server_round: int) -> RoundRecord:
        """The base's record; an ``evaluate_fn`` metric "relative_error" or "objective_gap" (spec 5.7) becomes the
        record's objective gap; the calibration figures are added."""
        rec = super().evaluate_round(server_round)
        for key in ("objective_gap", "relative_error"):
            if isinstance(gap := rec.extra.get(key), int | float):
                rec.objective_gap = float(gap)
                break
        rec.extra.update({"xi_plan": float(self.xi_plan), "sigma1": self.sigma1,
                          "delta_sensitivity": self.delta_sens, **self.mechanism_summary()})
        if rec.objective_gap is not None:
            log(INFO, "  k=%d relative error %.4g, LCI %d, %s %s", server_round, rec.objective_gap, self.lci(),
                self.privacy_label, "n/a" if rec.epsilon is None else f"{rec.epsilon:.4g}")
        return rec

    def describe(self) -> dict[str, Any]:
        privacy = ("none" if self.target is None and self.paper is None else
                   f"PrivacyTarget{self.target}" if self.target is not None else f"{self.paper}")
        return {**super().describe(), "privacy": privacy, "epsilon": self.epsilon, "sigma1": self.sigma1,
                "delta": self.delta, "R": self.R, "nu1": self.nu1, "nu2": self.nu2,
                "lipschitz_bound": self.lipschitz_bound}

    def check_vector(self, arr: NDArray[Any], what: str) -> NDArray[np.float64]:
        """A published vector must be finite float64 of d entries."""
        if arr.dtype != np.float64 or arr.shape != (self.dim,) or not np.all(np.isfinite(arr)):
            raise MalformedPayload(f"{what} must be {self.dim} finite float64 values, got {arr.dtype} {arr.shape}")
        return arr


class RelayRouter(RecalFamily):
    """One holder per round: a message (DP-RECAL's baton, RW-ADMM's token) walks the graph, the server relays it.

    Parameters
    ----------
    walk
        How the next holder is drawn (spec 3.2): "markov" (default, Assumption 3: a uniform neighbour), "cyclic" (a
        closed walk through every agent along graph edges) or "iid" (a draw from the stationary distribution g,
        not graph-local: an ablation).
    walk_start
        The first holder: "stationary" (default, a draw from g), "uniform", or an agent id (or "fixed:<id>").
    xi_plan
        The planned LCI sigma_1 is calibrated at (spec 4.5): "walk" (default; cyclic: the exact count, markov /
        iid: ceil(1.15 K max_i g_i), :func:`fedpdm_flower.fedapp.topology.plan_xi`), "K" (the most conservative: K = the number of
        rounds), or an integer.
    stop_on_budget
        End the run before any agent's activation count would exceed xi_plan, so the realised epsilon stays within
        the target (default False: run all K rounds and report the realised epsilon). Always on with a
        PrivacyTarget: z is calibrated for xi_plan DP-SGD steps per agent (or the target's ``horizon``), and no
        agent may take more.
    **kwargs
        :class:`RecalFamily`'s arguments.
    """

    #: what travels, for messages
    message_name = "baton"

    def dpsgd_steps(self) -> int:
        """One DP-SGD step per activation: an agent's planned activations xi_plan (the target's ``horizon`` when
        given); the run stops before any agent would exceed it."""
        assert self.target is not None
        self.xi_plan = self.target.horizon or self.plan_xi()
        self.stop_on_budget = True
        return self.xi_plan

    def __init__(self, *, walk: str = "markov", walk_start: str | int = "stationary", xi_plan: str | int = "walk",
                 stop_on_budget: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if walk not in topology.WALKS:
            raise ValueError(f"walk must be one of {list(topology.WALKS)}, got {walk!r}")
        if isinstance(walk_start, bool) or not isinstance(walk_start, int | str):
            raise ValueError(f"walk_start must be 'stationary', 'uniform' or an agent id, got {walk_start!r}")
        if isinstance(walk_start, int):
            if walk_start < 0:
                raise ValueError(f"walk_start must be an agent id >= 0, got {walk_start}")
            walk_start = f"fixed:{walk_start}"
        elif walk_start not in ("stationary", "uniform") and not walk_start.startswith("fixed:"):
            raise ValueError(f"walk_start must be 'stationary', 'uniform' or an agent id, got {walk_start!r}")
        if not (xi_plan in ("walk", "K") or (isinstance(xi_plan, int) and not isinstance(xi_plan, bool)
                                             and xi_plan >= 1)):
            raise ValueError(f"xi_plan must be 'walk', 'K' or an integer >= 1, got {xi_plan!r}")
        self.walk = walk
        self.walk_start = walk_start
        self.xi_rule = xi_plan
        self.stop_on_budget = bool(stop_on_budget)
        self.tau = np.zeros(0, dtype=np.int64)
        self.holder = -1
        self.first_holder = -1
        self.hops = 0
        self.finished = False

    def on_graph(self) -> None:
        assert self.graph is not None
        self.tau = np.zeros(self.num_clients, dtype=np.int64)
        self.first_holder = topology.start_agent(self.graph, self.walk_start, self.seed)
        self.holder = self.first_holder

    def plan_xi(self) -> int:
        """xi_plan for a run of ``num_rounds`` hops (the rule of ``xi_plan``)."""
        assert self.graph is not None
        if isinstance(self.xi_rule, int):
            return self.xi_rule
        return topology.plan_xi(self.num_rounds, self.graph, self.walk, rule=self.xi_rule)

    # ------------------------------------------------------------------ one hop per round
    def participants(self, server_round: int) -> list[int]:
        """Only the holder (none once the budget stop ended the run)."""
        if self.finished:
            return []
        if self.stop_on_budget and self.tau[self.holder] + 1 > self.xi_plan:
            log(WARNING, "round %d: agent %d would exceed xi_plan=%d activations; the run stops here (budget)",
                server_round, self.holder, self.xi_plan)
            self.finished = True
            return []
        return [self.holder]

    def check_holder(self, agent: int, arrays: list[NDArray[Any]], metrics: dict[str, Any], count: int) -> None:
        """The reply comes from the holder, with ``count`` arrays and the holder's next publication count."""
        if agent != self.holder:
            raise MalformedPayload(f"agent {agent} replied but agent {self.holder} holds the {self.message_name}")
        if len(arrays) != count:
            raise MalformedPayload(f"the {self.message_name} has {count} array(s), got {len(arrays)}")
        if metrics.get(PUBLICATIONS) != int(self.tau[agent]) + 1:
            raise MalformedPayload(f"agent {agent} reports publication {metrics.get(PUBLICATIONS)!r}, "
                                   f"expected {int(self.tau[agent]) + 1}")

    def advance(self, server_round: int, agent: int) -> None:
        """Count the hop and draw the next holder along the graph (stateless walk: seed, round, start)."""
        assert self.graph is not None
        self.tau[agent] += 1
        self.hops += 1
        nxt = topology.next_agent(self.graph, agent, server_round, self.seed, self.walk, start=self.first_holder)
        if self.walk != "iid" and not self.graph.has_edge(agent, nxt):
            raise RuntimeError(f"walk proposed hop {agent} -> {nxt}, which is not a graph edge")
        self.holder = nxt

    def holder_config(self, agent: int) -> dict[str, Scalar]:
        """Config of the holder's message: its agent id (the agent checks it is the one addressed)."""
        return {AGENT_KEY: agent}

    #: spec 7.4: a holder that fails gets one retry (the message and the walk stay put) before the run stops --
    #: skipping the holder would lose its update (for DP-RECAL it would break the u = sum lambda invariant)
    retries_without_reply = 1

    def no_reply_cause(self, server_round: int, expected: int, failed: int, attempts: int) -> str:
        again = " twice in a row" if attempts == 2 else f" {attempts} times in a row" if attempts > 2 else ""
        return f"agent {self.holder} failed to relay the {self.message_name}{again}"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "walk": self.walk, "walk_start": self.walk_start, "xi_plan": self.xi_rule,
                "stop_on_budget": self.stop_on_budget}


class DPRECAL(RelayRouter):
    """DP-RECAL (Algorithm 1): one agent per round holds the baton (x, u~[, u]) and runs (12a)-(12e), the server
    relays it along the random walk and accounts the privacy of the u~ messages (Theorem 3).

    The agents are :class:`fedpdm_flower.clients.recal.RecalClient`: each brings its smooth local loss f_i (gradient and value on
    its own data) and L_i; the server sends everything else (beta, n, nu1, nu2, sigma_1, R, the mode) with the
    baton. The model is the user's ``initial_arrays`` (x^1, spec 2.2; every floating-point entry is a coordinate of
    x); ``Result.arrays`` is the final baton x in the same layout.

    Parameters
    ----------
    mode
        u-tracking of the paper's mechanism (spec 2.4): "private" (default; only (x, u~) travel and the receiving
        agent accumulates into u~, so the noise accumulates) or "exact" (the clean u travels beside u~, as
        Algorithm 1 writes it: convergent, but the routing server sees u -- reproduction of the paper's figures
        only). With a PrivacyTarget or None nothing is added to u, so u~ = u and the two modes coincide.
    alpha_scale
        Each agent's stepsize alpha_i = alpha_scale 2 / (L_i + 1), inside Assumption 2's (0, 2/(L_i + 1)) (default
        0.5, i.e. 1/(L_i + 1), spec 2.6). beta = 1/(2(n + 1)) is fixed by the paper (5)/(12).
    privacy
        :class:`RecalFamily` (required). ``PrivacyTarget(epsilon, sample_rate=q, clip_norm=C)``: step (12c) uses
        the DP-SGD gradient ``g~ = (sum_{j in B} clip_C(grad l_j(y_i)) + N(0, z^2 C^2 I)) / (q m_i)`` of a Poisson
        sample B of the agent's records in place of grad f_i(y_i); (12a), (12b), (12d), (12e) and the relay are
        post-processing of it, the baton carries no noise, and x no longer leaks anything the DP-SGD steps do
        not cover (spec A1 is closed). One step per activation, calibrated for xi_plan activations.
        ``Theorem3Calibration(...)``: Algorithm 1's noise on u~ (Lemma 4's Delta = 4 alpha_max beta L_max of the
        reports), the reproduction setting. ``None``: RECAL.
    nu1, nu2, lipschitz_bound
        :class:`RecalFamily`.
    walk, walk_start, xi_plan, stop_on_budget
        :class:`RelayRouter` (Assumption 3's simple random walk by default).
    graph
        The communication graph (:class:`fedpdm_flower.strategies.decentralized.GraphRouting`; default "ring").
    **federation
        :class:`fedpdm_flower.strategies.base.FederatedStrategy`'s arguments (``min_available_nodes`` = n agents, ``seed``).

    Examples
    --------
    >>> strategy = DPRECAL(graph="ring", min_available_nodes=8, seed=0,
    ...                    privacy=PrivacyTarget(epsilon=8.0, sample_rate=0.1, clip_norm=20.0))
    >>> result = strategy.start(grid=grid, initial_arrays=ArrayRecord([x1]), num_rounds=4800)
    """

    def __init__(self, *, mode: str = "private", alpha_scale: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        if isinstance(alpha_scale, bool) or not isinstance(alpha_scale, int | float) or not 0.0 < alpha_scale < 1.0:
            raise ValueError(f"alpha_scale must lie in (0, 1) (Assumption 2), got {alpha_scale!r}")
        self.mode = mode
        self.alpha_scale = float(alpha_scale)
        self.beta = 0.0
        self.alpha_max = 0.0
        self.agent_rho: dict[int, float] = {}
        self.x1: NDArray[np.float64] = np.zeros(0)
        self.baton: list[NDArray[np.float64]] = []
        if mode == "exact":
            log(WARNING, "DP-RECAL mode='exact': the clean u travels beside u~ and the routing server sees it (not "
                "private; reproduction of the paper's Algorithm 1 only)")

    def on_initialize(self) -> None:
        """I2: the baton x = x^1, u~ = 0 and (exact mode) u = 0."""
        self.x1 = self.x.copy()
        self.baton = [self.x.copy(), np.zeros_like(self.x)] + ([np.zeros_like(self.x)] if self.mode == "exact" else [])

    def global_model(self) -> NDArray[np.float64]:
        """The baton's x."""
        return self.baton[0] if self.baton else self.x

    # ------------------------------------------------------------------ registration
    def register_config(self) -> dict[str, Scalar]:
        return {"alpha-scale": self.alpha_scale}

    def read_report(self, agent: int, metrics: dict[str, Any]) -> dict[str, float]:
        """L_i (clamped to ``lipschitz_bound``) and alpha_i, which must obey Assumption 2 for the reported L_i and
        is capped at alpha_scale 2 / (L_i + 1) of the clamped L_i (an honest agent's alpha is exactly that)."""
        out = super().read_report(agent, metrics)
        alpha = metrics.get("alpha")
        lip = metrics["L"]
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 < alpha < alpha_bound(lip):
            raise MalformedPayload(f"agent {agent} registered alpha_i = {alpha!r} outside (0, 2/(L_i + 1)) "
                                   "(Assumption 2)")
        out["alpha"] = min(float(alpha), self.alpha_scale * alpha_bound(out["L"]))
        return out

    def on_register(self) -> None:
        """beta = 1/(2(n + 1)); Lemma 4's Delta = 4 alpha_max beta L_max; xi_plan for K = num_rounds hops."""
        self.beta = beta_for(self.num_clients)
        self.alpha_max = max(r["alpha"] for r in self.reports.values())
        self.delta_sens = zcdp.sensitivity(self.alpha_max, self.beta, self.l_max)
        if self.target is None:  # with DP-SGD, xi_plan was fixed with z before round 1
            self.xi_plan = self.plan_xi()

    # ------------------------------------------------------------------ one hop per round
    def client_payload(self, server_round: int, client: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        return list(self.baton), {"mode": self.mode, "beta": self.beta, "n": self.num_clients,
                                  "sensitivity": self.delta_sens, **self.noise_config(),
                                  **self.dpsgd_config(server_round), **self.holder_config(client)}

    def decode_update(self, server_round: int, client: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        self.check_holder(client, arrays, metrics, len(self.baton))
        return [self.check_vector(a, "the baton") for a in arrays]

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Store the new baton (unchanged), count the hop, draw the next holder along the graph."""
        (agent,) = updates
        self.baton = updates[agent]
        self.agent_rho[agent] = float(metrics[agent].get("rho_total", 0.0))
        self.advance(server_round, agent)
        return {"agent": float(agent), "sigma": float(metrics[agent].get("sigma", 0.0)),
                "local_loss": float(metrics[agent].get("local_loss", math.nan)), "graph_msgs": float(self.hops),
                "lci": float(self.lci())}

    def privacy_summary(self) -> dict[str, float]:
        """The agents' reported DP-SGD epsilon (worst), the mechanism's figures, the LCI, the hops, and with the
        paper's mechanism each agent's own budget (its activation ledger's rho, Theorem 3's conversion)."""
        out = {**super().privacy_summary(), **self.mechanism_summary(), "lci": float(self.lci()),
               "graph_msgs": float(self.hops)}
        for agent, rho in sorted(self.agent_rho.items()):
            out[f"eps_agent{agent}"] = zcdp.eps_from_rho(rho, self.delta) if rho > 0 else 0.0
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mode": self.mode, "alpha_scale": self.alpha_scale}
