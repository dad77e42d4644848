"""DP-IADMM (ObjP / ObjPM, Algorithm 1) and the OutP baseline, server side.

Ryu & Kim, "Differentially Private Federated Learning via Inexact ADMM with Multiple Local Updates" (seed 002);
spec ``shared/specs/dp_iadmm.md`` sections 2.3, 5.2, 9.3, 9.4 and 9.7.

Consensus ADMM over every connected agent p (agent = client id, fixed when the federation forms): the server keeps
a copy of every agent's dual lambda_p and last upload z_p, computes w^{t+1} by (4a) and updates its dual copies by
(4c); duals never travel. Each agent reports a CRC of its own dual and the server compares it with its copy every
round (metric ``dual_mismatch``, which must stay 0). A round in which an agent does not reply stops the run
(:class:`ReplicatedDualError`): its two dual copies could no longer be kept identical.

**Privacy** goes through ``privacy=``, which is required (built without it, a strategy of the family refuses to
start with :class:`~fedpdm_flower.fedapp.privacy.target.PrivacyNotChosen`, naming what to pass):

* :class:`fedpdm_flower.fedapp.privacy.target.PrivacyTarget` -- record-level DP-SGD in the local solves, the route
  that learns at an honest epsilon: every solve's gradient is the core's DP-SGD release (Poisson sample of the
  device's records from its own randomness, per-record clipping, Gaussian noise at every step), and everything ADMM
  does with it is post-processing (:class:`fedpdm_flower.fedapp.algorithms.iadmm.DPSGDObjective`). The strategy
  calibrates z for ``E x rounds`` steps per device; every device charges its own RDP ledger and refuses past its
  floor (checked for the whole run before round 1).
* the paper's own mechanism, the reproduction setting: :class:`~fedpdm_flower.fedapp.algorithms.iadmm.ObjectivePerturbation`
  (DP-IADMM) or :class:`~fedpdm_flower.fedapp.algorithms.iadmm.OutputPerturbation` (OutP), with the rigorous
  composition over every solve reported beside the paper's per-solve epsilon-bar;
* ``None``: no noise (non-private IADMM).

Works on any model's ``ArrayRecord``: z_p^1 is the initial model for every agent and lambda_p^1 = 0, so round 1
broadcasts the initial model itself (with the paper's zero initialisation, the zero matrix, spec A7).

The global sample count I (every f_p carries 1/I, (2c)) is ``total_samples`` when the operator knows it; otherwise
the strategy asks every agent for its count I_p in one extra exchange before round 1 (``query.whoami``, which
:class:`fedpdm_flower.clients.iadmm.IADMMClient` answers with ``num-examples``). Flower's per-reply ``num-examples`` would come
too late: round 1's local solves already need I. A wrong I changes only the weight of the data term, not
privacy: the noise and the data term's gradient carry the same 1/I. The counts are treated as public, as Flower's
``num-examples`` is; a deployment that must hide them passes ``total_samples``.

**Client level without a trusted server**: the server step (4a) is a mean of the agents' terms ``z_p - lambda_p /
rho``; :class:`IADMMMean` runs Algorithm 1 in that form (the duals stay on the agents), which is Flower's FedAvg
convention, so ``DistributedDP(IADMMMean(...), ...)`` adds secure buffers and distributed Skellam noise to the
uploads (:mod:`fedpdm_flower.strategies.distributed_dp`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from numpy.typing import NDArray

from fedpdm_flower.fedapp.algorithms.iadmm import (
    EtaSchedule,
    ObjectivePerturbation,
    OutputPerturbation,
    RhoSchedule,
    dual_fingerprint,
    dual_update,
    server_w_update,
)
from fedpdm_flower.fedapp.compression.codec import MalformedPayload, decode_vector, encode_dense, wire_round
from fedpdm_flower.fedapp.compression.payload import FORMAT_KEY, from_arrays, to_arrays
from fedpdm_flower.fedapp.layout import ArrayLayout, LayoutMismatch
from fedpdm_flower.fedapp.privacy.dpsgd import DPSGDMechanism, dpsgd_epsilon
from fedpdm_flower.fedapp.privacy.target import MISSING, PrivacyTarget, require_privacy
from fedpdm_flower.strategies.base import WHOAMI, FederatedStrategy, FederationError, RoundFailed, Scalar, arrays_of

__all__ = ["DPIADMM", "ConsensusADMM", "IADMMMean", "ObjP", "ObjPM", "OutP", "ReplicatedDualError"]

#: the message-config key naming the algorithm, so that a client of the other kind refuses the message
ALGORITHM_KEY = "iadmm-algorithm"
#: "replicated" (the server keeps every dual, Algorithm 1 as written) or "mean" (IADMMMean: the agents upload their
#: term of (4a) and keep the only copy of their dual)
FORM_KEY = "iadmm-form"
#: the whoami config key asking a device to check the whole run's privacy plan against its floor before round 1
PLAN_KEY = "dp-plan-rounds"
#: the steps (local solves) per round of that plan
PLAN_STEPS_KEY = "dp-plan-steps-per-round"
#: IADMMMean's weighting key: every agent's term counts once in (4a) (the clients report 1)
WEIGHT_KEY = "iadmm-weight"


class ReplicatedDualError(RoundFailed):
    """An agent did not reply: its dual copies on the server and the agent can no longer be kept identical."""


def _positive(name: str, value: Any, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if not allow_inf and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _schedule(name: str, value: Any, kind: type) -> Any:
    """A constant (a float > 0) or a schedule object."""
    if isinstance(value, kind):
        return value
    return _positive(name, value)


def _check_privacy(privacy: Any, owner: str, paper: type) -> Any:
    """``privacy`` of a DP-IADMM-family strategy: a PrivacyTarget, the paper's mechanism ``paper``, or None."""
    privacy = require_privacy(privacy, owner, reproduction=f"{paper.__name__}(epsilon_bar=...)")
    if privacy is not None and not isinstance(privacy, PrivacyTarget | paper):
        raise TypeError(f"{owner} privacy must be a PrivacyTarget (record-level DP-SGD), {paper.__name__} (the "
                        f"paper's mechanism) or None, got {type(privacy).__name__}")
    if isinstance(privacy, PrivacyTarget):
        privacy.rate(owner)  # no sample rate: say so now, not before round 1
    return privacy


class PrivacyPlan:
    """What a DP-IADMM-family strategy asks of the devices: the privacy keys of every train message, the mechanism
    calibrated for the run (DP-SGD), the per-solve epsilon-bar that (24) uses, and the pre-round-1 plan check.

    Parameters
    ----------
    privacy
        The checked ``privacy=`` argument.
    steps_per_round
        DP-SGD steps (= local solves) of one device in one round: E for DP-IADMM, 1 for OutP.
    """

    def __init__(self, privacy: Any, steps_per_round: int) -> None:
        self.privacy, self.steps_per_round = privacy, int(steps_per_round)
        self.mechanism: DPSGDMechanism | None = None

    @property
    def private(self) -> bool:
        """True when the local solves are perturbed."""
        return self.privacy is not None

    @property
    def label(self) -> str:
        """The accountant behind the headline epsilon (progress line, ``privacy_spent``)."""
        if isinstance(self.privacy, PrivacyTarget):
            return "eps(RDP, DP-SGD ledgers)"
        if isinstance(self.privacy, ObjectivePerturbation):
            return "eps(RDP of the Laplace solves)"
        if isinstance(self.privacy, OutputPerturbation):
            return "eps(RDP of the Gaussian outputs)"
        return "eps"

    @property
    def rho_epsilon(self) -> float:
        """epsilon-bar of (24)'s ``c2 / epsilon-bar`` offset: the paper's per-solve budget, else inf (no offset).

        The offset is the paper's compensation for its per-solve Laplace noise; DP-SGD has no per-solve budget, so
        (24) keeps its non-private constants there (a constant ``rho`` is used as given either way).
        """
        if isinstance(self.privacy, ObjectivePerturbation | OutputPerturbation):
            return float(self.privacy.epsilon_bar)
        return math.inf

    def calibrate(self, num_rounds: int, owner: str) -> None:
        """z of the DP-SGD target for ``steps_per_round x rounds`` steps per device (every agent, every round).

        Raises
        ------
        ValueError
            Naming the knob, before round 1: a target that no noise multiplier meets, a missing sample rate.
        """
        if isinstance(self.privacy, PrivacyTarget):
            self.mechanism = self.privacy.mechanism(self.steps_per_round, num_rounds, owner=owner)
            log(INFO, "%s: DP-SGD in the local solves, z = %.4g, q = %g, C = %g, %d step(s) per round over %d "
                "round(s): (epsilon, delta) = (%g, %g) per record of every device (RDP, Poisson-subsampled Gaussian)",
                owner, self.mechanism.noise_multiplier, self.mechanism.sample_rate, self.mechanism.clip_norm,
                self.steps_per_round, self.privacy.horizon or num_rounds, self.privacy.epsilon, self.privacy.delta)

    def message_config(self) -> dict[str, Scalar]:
        """The privacy keys of a train message (``dp`` false without privacy)."""
        if self.privacy is None:
            return {"dp": False}
        if isinstance(self.privacy, PrivacyTarget):
            assert self.mechanism is not None, "the DP-SGD mechanism is calibrated in prepare()/start()"
            return dict(self.privacy.message_config(self.mechanism))
        return dict(self.privacy.message_config())

    def plan_config(self, rounds: int) -> dict[str, Scalar]:
        """The whoami config of the pre-round-1 check: the privacy keys and the rounds the run will take."""
        return {**self.message_config(), PLAN_KEY: int(rounds), PLAN_STEPS_KEY: self.steps_per_round}

    def epsilon_after(self, rounds: int) -> float | None:
        """The (worst device's) rigorous epsilon after ``rounds`` rounds of the plan (None without privacy)."""
        if self.privacy is None:
            return None
        if isinstance(self.privacy, PrivacyTarget):
            m = self.mechanism
            assert m is not None
            return 0.0 if rounds == 0 else dpsgd_epsilon(m.noise_multiplier, m.sample_rate, m.steps * rounds,
                                                         float(self.privacy.delta))
        return float(self.privacy.epsilon(self.steps_per_round * rounds))

    def describe(self) -> dict[str, Any]:
        """The privacy setting for results.json."""
        if self.privacy is None:
            return {"privacy": None}
        out: dict[str, Any] = {"privacy": type(self.privacy).__name__, **vars(self.privacy)}
        if self.mechanism is not None:
            out.update({"noise_multiplier": self.mechanism.noise_multiplier, "sample_rate": self.mechanism.sample_rate,
                        "clip_norm": self.mechanism.clip_norm, "steps_per_round": self.mechanism.steps})
        return out


class ConsensusADMM(FederatedStrategy):
    """Server side shared by DP-IADMM and OutP: replicated duals, (4a), (4c), every agent every round.

    Parameters
    ----------
    plan
        The privacy plan (built by the subclass from its ``privacy=``).
    rho
        The penalty rho^t: a :class:`fedpdm_flower.fedapp.algorithms.iadmm.RhoSchedule` (schedule (24)), or a constant > 0.
        Default None: (24) with the paper's MNIST constants c1 = 2, c2 = 5, T_c = 10 000 (its c2 / epsilon-bar
        offset only under the paper's mechanism).
    beta
        beta of objective (1): every f_p carries ``(beta / P) ||z||^2`` (default 1e-6, Section IV).
    total_samples
        I, the global number of training samples (f_p carries 1/I, (2c)). None (default): the sum of the counts
        the agents report before round 1.
    **federation
        :class:`fedpdm_flower.strategies.base.FederatedStrategy`'s arguments (``min_available_nodes``: the number of agents P,
        ``seed``, ``node_wait_s``, ``eval_every``, ...). ``fraction_train`` must stay 1.0.
    """

    #: the agents' z_p and the server's copy of lambda_p, and the sample count I learnt before round 1 (x and
    #: rho^t are recomputed from them each round; checkpoints)
    CHECKPOINT_ATTRS = ("z", "lam", "total")

    #: cumulative figures the devices report: DP-SGD's ledger (eps_dpsgd), the paper mechanism's Renyi-DP and basic
    #: composition
    PRIVACY_KEYS = ("eps_dpsgd", "eps_rdp", "eps_basic", "delta_basic")
    #: what a second library needs to recompute a device's DP-SGD figure (results.json's privacy_per_device)
    PRIVACY_DETAIL_KEYS = ("dp_noise_multiplier", "dp_sample_rate", "dp_steps", "dp_mechanisms")
    privacy_label = "eps"
    #: the algorithm the clients must run (sent as ``iadmm-algorithm``)
    algorithm = ""
    #: "alg1": w^{t+1} by (4a) before the local solves; "huang": local first, then W and the duals (OutP)
    order = "alg1"

    def __init__(self, *, plan: PrivacyPlan, rho: float | RhoSchedule | None, beta: float,
                 total_samples: int | None, **federation: Any) -> None:
        if federation.get("fraction_train", 1.0) != 1.0:
            raise ValueError(f"fraction_train must be 1.0, got {federation['fraction_train']!r}: Algorithm 1 uses "
                             "every agent every round (each one's dual is replicated on the server, (4c))")
        super().__init__(**federation)
        self.plan = plan
        self.privacy_label = plan.label
        self.penalty: float | RhoSchedule = RhoSchedule() if rho is None else _schedule("rho", rho, RhoSchedule)
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not (beta >= 0 and math.isfinite(beta)):
            raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
        self.beta = float(beta)
        if total_samples is not None and (isinstance(total_samples, bool) or not isinstance(total_samples, int)
                                          or total_samples < 1):
            raise ValueError(f"total_samples must be an integer >= 1 or None, got {total_samples!r}")
        self.total: int | None = total_samples
        self.z: NDArray[np.float64] = np.zeros((0, 0))  # z_p^t of every agent
        self.lam: NDArray[np.float64] = np.zeros((0, 0))  # the server's copy of lambda_p^t
        self.rho_t = 0.0
        self._downlink: tuple[int, list[NDArray[Any]], int] | None = None

    @property
    def privacy(self) -> Any:
        """The ``privacy=`` setting (a PrivacyTarget, the paper's mechanism, or None)."""
        return self.plan.privacy

    @property
    def private(self) -> bool:
        """True when the local solves are perturbed."""
        return self.plan.private

    def rho_at(self, t: int) -> float:
        """rho^t: the schedule at (t, epsilon-bar of the paper's mechanism, else inf), or the constant."""
        return self.penalty(t, self.plan.rho_epsilon) if isinstance(self.penalty, RhoSchedule) else self.penalty

    def prepare(self, num_rounds: int, **kwargs: Any) -> None:
        """Also calibrate the DP-SGD mechanism for the run (before round 1: a bad target stops here, named)."""
        super().prepare(num_rounds, **kwargs)
        self.plan.calibrate(num_rounds, type(self).__name__)

    def on_initialize(self) -> None:
        """A new initial model: the agents' copies are made from it when the federation is known."""
        self.z = np.zeros((0, self.dim))
        self.lam = np.zeros((0, self.dim))

    def agents_ready(self) -> None:
        """z_p^1 = the initial model and lambda_p^1 = 0 for the P agents (Algorithm 1 lines 2-3; spec A7)."""
        p = self.num_clients
        if self.z.shape != (p, self.dim):
            self.z = np.tile(self.x, (p, 1))
            self.lam = np.zeros((p, self.dim))

    def participants(self, server_round: int) -> list[int]:
        """Every agent, every round."""
        return list(range(self.num_clients))

    # ------------------------------------------------------------------ before round 1: I and the privacy plan
    def pre_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        """Before round 1 of a fresh run: ask every agent for its count I_p (without ``total_samples``) and, under
        privacy, whether the whole run's plan stays within its floor. A resumed run has I in its checkpoint and
        asks nothing (its exchanges stay those of the uninterrupted run); its devices still check every message
        against their floors before training."""
        if server_round != 1 or self.resume_round or (self.total is not None and not self.private):
            return []
        cfg: dict[str, Any] = self.plan.plan_config(self.num_rounds) if self.private else {}
        return self.to_all(WHOAMI, RecordDict({"config": ConfigRecord(cfg)}))

    def consume_pre_train(self, server_round: int, replies: Any) -> None:
        """I = sum_p I_p from the agents' ``num-examples``; an agent that refuses the plan or cannot say its count
        stops the run before round 1, named."""
        counts: dict[int, int] = {}
        for node, content in replies:
            cid = self.pid_of.get(node)
            if isinstance(content, str):
                raise FederationError(f"node {node} (agent {cid}) failed before round 1 (its sample count, the run's "
                                      f"privacy plan): {content}")
            self.count_up(content)
            info = dict(content.config_records.get("info", ConfigRecord()))
            n = info.get("num-examples")
            if self.total is None and (cid is None or isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise FederationError(
                    f"node {node} (agent {cid}) did not report num-examples >= 1 (got {n!r}): pass "
                    f"total_samples=I to {type(self).__name__}, or give the node an IADMMClient / OutPClient")
            if cid is not None and isinstance(n, int):
                counts[cid] = n
        missing = sorted(set(range(self.num_clients)) - set(counts))
        if self.total is None and missing:
            raise FederationError(f"agent(s) {missing} did not report their sample count before round 1")
        if self.total is None:
            self.total = sum(counts.values())

    # ------------------------------------------------------------------ one round
    def prepare_round(self, server_round: int) -> None:
        """rho^t, then line 5: w^{t+1} = (1/P) sum_p (z_p^t - lambda_p^t / rho^t) (4a)."""
        self.agents_ready()
        self.rho_t = self.rho_at(server_round)
        self.x = wire_round(server_w_update(self.z, self.lam, self.rho_t))

    def train_contents(self, server_round: int) -> list[tuple[int, RecordDict]]:
        self.prepare_round(server_round)
        return super().train_contents(server_round)

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        """The public values every agent needs this round (spec 9.5); subclasses add theirs."""
        assert self.total is not None, "total_samples is unknown: the pre-train exchange did not run"
        return {ALGORITHM_KEY: self.algorithm, FORM_KEY: "replicated", "rho": self.rho_t, "beta": self.beta,
                "num-agents": self.num_clients, "total-samples": self.total, **self.plan.message_config()}

    def client_payload(self, server_round: int, client: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        if self._downlink is None or self._downlink[0] != server_round:  # encode once per round, send to all
            arrays, code = to_arrays(encode_dense(self.x))
            self._downlink = (server_round, arrays, code)
        _, arrays, code = self._downlink
        return arrays, {FORMAT_KEY: code, **self.round_config(server_round)}

    def decode_update(self, server_round: int, client: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        """z_p^{t+1} (dense); the reply must carry the agent's dual fingerprint and its mean |noise|."""
        for key in ("dual_crc", "dual_sqnorm", "noise_abs_mean"):
            if key not in metrics:
                raise MalformedPayload(f"reply lacks the metric {key!r}")
        if isinstance(metrics["dual_crc"], float):
            raise MalformedPayload("metric 'dual_crc' must be an integer")
        v = decode_vector(from_arrays(arrays, metrics.get(FORMAT_KEY)), self.dim, max_k=self.dim)
        if v.k != self.dim:
            raise MalformedPayload(f"expected all d={self.dim} entries of z_p, got {v.k}")
        return v

    def update_vector(self, server_round: int, client: int, update: Any) -> Any:
        """z_p^{t+1} - w^t: the agent's local model against the consensus it was sent."""
        return update.to_dense() - self.x

    def dual_mismatches(self, metrics: dict[int, dict[str, Any]]) -> tuple[int, float]:
        """Agents whose reported dual CRC differs from the server copy, and the largest relative gap of ||lambda||^2."""
        bad, gap = 0, 0.0
        for p, m in metrics.items():
            if int(m["dual_crc"]) != dual_fingerprint(self.lam[p]):
                bad += 1
            mine = float(np.dot(self.lam[p], self.lam[p]))
            gap = max(gap, abs(float(m["dual_sqnorm"]) - mine) / max(mine, 1e-300))
        return bad, gap

    def round_diagnostics(self) -> dict[str, float]:
        """Schedule values of the round for the record (a subclass adds its own)."""
        return {"rho": self.rho_t, "local_updates": 1.0}

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Lines 7-8: store z_p^{t+1}, then lambda_p^{t+1} = lambda_p^t + rho^t (w^{t+1} - z_p^{t+1}) for all p."""
        missing = sorted(set(range(self.num_clients)) - set(updates))
        if missing:
            raise ReplicatedDualError(
                server_round, f"no accepted reply from agent(s) {missing} (node(s) "
                f"{[self.node_of.get(c) for c in missing]}; {type(self).__name__} needs every agent every round, or the "
                "server's copies of their duals (4c) diverge)", self.round_errors())
        for p in sorted(updates):
            self.z[p] = updates[p].to_dense()
        before = self.dual_mismatches(metrics) if self.order == "huang" else None
        if self.order == "huang":  # W^{k+1} from the new uploads and the old duals (spec 5.2)
            self.x = wire_round(server_w_update(self.z, self.lam, self.rho_t))
        for p in sorted(updates):
            self.lam[p] = dual_update(self.lam[p], self.x, self.z[p], self.rho_t)
        bad, gap = before if before is not None else self.dual_mismatches(metrics)
        if bad:
            log(WARNING, "round %d: %d agent dual(s) differ from the server's copies", server_round, bad)
        ms = list(metrics.values())
        return {
            **self.round_diagnostics(),
            "dual_mismatch": float(bad),
            "dual_sqnorm_rel_gap": gap,
            "consensus_l1": float(np.mean(np.abs(self.z - self.x).sum(axis=1))),
            "noise_abs_mean": float(np.mean([m["noise_abs_mean"] for m in ms])),
            **{k: float(np.mean([m[k] for m in ms])) for k in ("delta_mean", "lap_scale_mean", "sigma", "dp_noise_std",
                                                                  "dp_batch_mean") if k in ms[0]},
            **{k: float(np.max([m[k] for m in ms])) for k in ("delta_max",) if k in ms[0]},
            **{k: float(ms[0][k]) for k in ("eps_iter", "delta_iter", "eps_round") if k in ms[0]},
        }

    def headline_privacy(self, priv: Any) -> tuple[float | None, float | None]:
        """(epsilon, delta) of the round record, worst agent: the DP-SGD ledger's, or the Renyi-DP composition of the
        paper's per-solve releases (beside which the devices report the basic composition)."""
        delta = getattr(self.privacy, "delta", None)
        for key in ("eps_dpsgd", "eps_rdp"):
            if key in priv and delta is not None:
                return float(priv[key]), float(delta)
        return None, None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **self.plan.describe(), "rho": self.penalty, "beta": self.beta,
                "total_samples": self.total}


class DPIADMM(ConsensusADMM):
    """DP-IADMM with multiple local updates (Algorithm 1, lines 1-9 on the server), in Algorithm 1's order:
    w first (4a), then E perturbed inexact local solves on every agent, then the duals (4c).

    For a neural network use constant ``rho=0.2, eta=3.0``: the paper's schedules fit its linear model (an MLP on
    MNIST, ObjPM with ``ObjectivePerturbation(5.0, sensitivity_mode="clipped", clip_norm=200.0)``: 0.22 after 3 rounds
    with them, 0.56 with these; docs/models-and-data.md).

    Parameters
    ----------
    privacy
        Required (no epsilon is chosen for you):

        * ``PrivacyTarget(epsilon, delta=1e-5, clip_norm=C, sample_rate=q)``: record-level DP-SGD in the solves
          (module docstring). Each local solve (8) takes one DP-SGD step: its gradient is the noisy clipped
          gradient of a Poisson sample of the agent's records (:class:`fedpdm_flower.fedapp.algorithms.iadmm.DPSGDObjective`),
          so a round charges E steps to every device's ledger, calibrated for E x rounds steps.
        * ``ObjectivePerturbation(epsilon_bar, sensitivity_mode="paper", clip_norm=None)``: the paper's Laplace objective
          perturbation (9a), epsilon-bar per solve, full batch: the reproduction setting (its rigorous Renyi-DP
          composition is reported beside epsilon-bar; the paper's own Delta is data-dependent, spec A2).
        * ``None``: non-private IADMM (no noise, and no c2 / epsilon-bar term in (24)).
    local_updates
        E, the local solves per round (Algorithm 1 lines 17-20); their average is sent (line 21). Default 1 (ObjP);
        the paper's ObjPM uses 10 (:class:`ObjPM`).
    rho
        rho^t: a :class:`fedpdm_flower.fedapp.algorithms.iadmm.RhoSchedule` (schedule (24); ``RhoSchedule.femnist()`` for the
        FEMNIST constants) or a constant > 0. Default None: (24) with the MNIST constants (2, 5, 10 000).
    eta
        eta^t, the proximity parameter of the local solves: an :class:`fedpdm_flower.fedapp.algorithms.iadmm.EtaSchedule`
        ((19) ``a / sqrt(t)``, (15), (22) or a constant) or a constant > 0. Default None: (19) with a = 1, the
        reference code's choice (the paper does not state it, spec A3).
    beta
        beta of objective (1): f_p carries ``(beta / P) ||z||^2`` (default 1e-6, Section IV).
    box
        B > 0 projects every local iterate onto W = [-B, B]^d (exact for the isotropic subproblem (8), spec A6);
        None (default): W = R^d, as the paper's experiments.
    total_samples
        I (f_p carries 1/I). None (default): the sum of the agents' counts, asked before round 1.
    **federation
        :class:`fedpdm_flower.strategies.base.FederatedStrategy`'s arguments: ``min_available_nodes`` (the agents P; every
        connected node is an agent), ``seed``, ``node_wait_s``, ``eval_every``, ... ``fraction_train`` must stay
        1.0. The agents are the connected nodes, numbered by partition id when every node reports one.

    Examples
    --------
    >>> strategy = ObjPM(min_available_nodes=10, privacy=PrivacyTarget(epsilon=8.0, clip_norm=10.0, sample_rate=0.1))
    >>> result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=200)
    """

    algorithm = "dp-iadmm"

    def __init__(self, *, privacy: Any = MISSING, local_updates: int = 1, rho: float | RhoSchedule | None = None,
                 eta: float | EtaSchedule | None = None, beta: float = 1e-6, box: float | None = None,
                 total_samples: int | None = None, **federation: Any) -> None:
        privacy = _check_privacy(privacy, type(self).__name__, ObjectivePerturbation)
        if isinstance(local_updates, bool) or not isinstance(local_updates, int) or local_updates < 1:
            raise ValueError(f"local_updates must be an integer >= 1, got {local_updates!r}")
        super().__init__(plan=PrivacyPlan(privacy, local_updates), rho=rho, beta=beta, total_samples=total_samples,
                         **federation)
        self.local_updates = local_updates
        self.proximity: float | EtaSchedule = EtaSchedule() if eta is None else _schedule("eta", eta, EtaSchedule)
        self.box = None if box is None else _positive("box", box)
        self.eta_t = 0.0

    def eta_at(self, t: int) -> float:
        """eta^t: the schedule at (t, epsilon-bar), or the constant."""
        if isinstance(self.proximity, EtaSchedule):
            return self.proximity(t, self.plan.rho_epsilon)
        return self.proximity

    def prepare_round(self, server_round: int) -> None:
        self.eta_t = self.eta_at(server_round)
        super().prepare_round(server_round)

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        """rho^t, eta^t, E, the privacy keys, I, beta, P (spec 9.5)."""
        cfg = super().round_config(server_round)
        cfg.update({"eta": self.eta_t, "local-updates": self.local_updates})
        if self.box is not None:
            cfg["box"] = self.box
        return cfg

    def round_diagnostics(self) -> dict[str, float]:
        return {"rho": self.rho_t, "eta": self.eta_t, "local_updates": float(self.local_updates)}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "local_updates": self.local_updates, "eta": self.proximity, "box": self.box}


class ObjP(DPIADMM):
    """ObjP: DP-IADMM with one local solve per round (E = 1, Section IV). Arguments as :class:`DPIADMM`."""

    def __init__(self, **kwargs: Any) -> None:
        if "local_updates" in kwargs:
            raise TypeError("ObjP fixes local_updates = 1; use DPIADMM(local_updates=E) to choose E")
        super().__init__(local_updates=1, **kwargs)


class ObjPM(DPIADMM):
    """ObjPM: DP-IADMM with E = 10 local solves per round (Section IV). Arguments as :class:`DPIADMM`."""

    def __init__(self, **kwargs: Any) -> None:
        if "local_updates" in kwargs:
            raise TypeError("ObjPM fixes local_updates = 10; use DPIADMM(local_updates=E) to choose E")
        super().__init__(local_updates=10, **kwargs)


class OutP(ConsensusADMM):
    """OutP baseline: Huang et al.'s DP-ADMM as in the paper's reference code (spec 5.2 and 9.7).

    One inexact step (5) per round with Huang's proximity, then noise; the noisy iterate is kept by the agent and
    sent.

    **Output perturbation and DP-SGD.** The step's output is an affine function of the gradient,
    ``z = (z_prev / eta + rho w + lambda - g) / (1/eta + rho)``, so Gaussian noise N(0, s^2) on the output is the
    same random variable as N(0, (1/eta + rho)^2 s^2) on the gradient. OutP's output perturbation therefore does not
    rule out the record-level route: under ``privacy=PrivacyTarget(...)`` the step's gradient is the DP-SGD release
    (Poisson sample, per-record clipping, noise of multiplier z), which is output noise of std
    ``z C / (q n (1/eta + rho))`` with n the gradient's normaliser, calibrated by the subsampled-Gaussian accountant.
    What the paper's output perturbation cannot have is amplification: its step is full-batch and its noise is
    calibrated per step to the sensitivity of the whole mean gradient (:class:`OutputPerturbation`).

    Parameters
    ----------
    privacy
        Required: ``PrivacyTarget(...)`` (record-level DP-SGD, one step per round), ``OutputPerturbation(epsilon_bar,
        delta_bar=1e-6, ...)`` (the reference code's Gaussian output perturbation: the reproduction setting), or
        ``None`` (no noise).
    rho
        As :class:`DPIADMM` (default (24), MNIST constants; the paper uses the same rho^t for OutP, App. H).
    eta_scale
        a of Huang's proximity ``1/eta^t = (0.25 I_p + 2 sqrt(t ln(1.25/delta-bar)) / epsilon-bar) / a``
        (reference code, a = 1 by default; I_p is each agent's own count). Under DP-SGD and without privacy it is
        the non-private ``0.25 I_p / a``: the second term is the reference code's compensation for its per-step
        noise, which DP-SGD does not have.
    beta
        beta of objective (1) (default 1e-6).
    order
        ``"huang"`` (default, the reference code): round r sends W^{r-1} (the initial model in round 1), the agents
        step and perturb, the server forms W^r = (1/P) sum_p (z~_p - lambda_p / rho) and updates the duals with
        W^r; the agents apply that dual update when W^r reaches them. ``"alg1"``: Algorithm 1's order (w first).
    grad_scale
        ``"local"`` (default, the reference code): the data term is scaled by 1/I_p; ``"global"``: by 1/I, (2c).
    total_samples
        I. None (default): the sum of the agents' counts, asked before round 1.
    **federation
        As :class:`DPIADMM`.
    """

    algorithm = "outp"

    def __init__(self, *, privacy: Any = MISSING, rho: float | RhoSchedule | None = None, eta_scale: float = 1.0,
                 beta: float = 1e-6, order: str = "huang", grad_scale: str = "local",
                 total_samples: int | None = None, **federation: Any) -> None:
        privacy = _check_privacy(privacy, type(self).__name__, OutputPerturbation)
        for name, value, choices in (("order", order, ("huang", "alg1")), ("grad_scale", grad_scale, ("local", "global"))):
            if value not in choices:
                raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        super().__init__(plan=PrivacyPlan(privacy, 1), rho=rho, beta=beta, total_samples=total_samples, **federation)
        self.eta_scale = _positive("eta_scale", eta_scale)
        self.order, self.grad_scale = order, grad_scale

    def prepare_round(self, server_round: int) -> None:
        """rho^t; in Algorithm 1's order also w^{t+1} by (4a). Huang's order sends the W of the last aggregate."""
        if self.order == "alg1":
            super().prepare_round(server_round)
            return
        self.agents_ready()
        self.rho_t = self.rho_at(server_round)

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        """rho^t, the privacy keys, Huang's proximity scale, the order and gradient scale, I, beta, P."""
        cfg = super().round_config(server_round)
        cfg.update({"eta-scale": self.eta_scale, "order": self.order, "grad-scale": self.grad_scale})
        return cfg

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "eta_scale": self.eta_scale, "order": self.order, "grad_scale": self.grad_scale}


class IADMMMean(FedAvg):
    """DP-IADMM (Algorithm 1) in mean form: the server step is a plain mean, so secure aggregation can compute it.

    Line 5 of Algorithm 1 is a mean, ``w^{t+2} = (1/P) sum_p (z_p^{t+1} - lambda_p^{t+1} / rho^{t+1})``. Here every
    agent computes its own term after its dual update (line 23) and uploads it
    (:func:`fedpdm_flower.fedapp.algorithms.iadmm.consensus_term`); the server's w is the unweighted mean of the
    uploads -- Flower's FedAvg with every agent weighing 1 (``iadmm-weight``) -- and it keeps no dual. Without noise
    the iterates are Algorithm 1's (tested against :class:`DPIADMM` to rounding); the duals exist only on the agents,
    so there is no replica to check and none to diverge.

    That makes the composition with client-level DP and no trusted server possible:
    ``DistributedDP(IADMMMean(...), epsilon=..., num_rounds=T, clip_norm=C)`` with
    ``secure_buffers_mod(distributed_dp=DeviceSkellam(...))`` on the devices. Each device clips its upload's change
    ``u_p - w`` to C and adds its Skellam share; the server sees only buffer sums, each carrying the full noise.
    The noise enters w once per round: the agents update their duals against the w they receive and the next mean
    is rebuilt from those duals, so it does not accumulate (a server that kept ``sum_p lambda_p`` from noisy sums
    would integrate it, a random walk; measured: 0.32 accuracy against 0.82 on MNIST at one noise level).

    Limits (docs/private-learning-iadmm.md): C clips ``u_p - w = (z_p - w) - lambda_p / rho``, whose dual part does
    not vanish at the optimum for non-IID agents (lambda_p -> grad f_p(w*)), so C must cover ``||grad f_p|| / rho``
    or the fixed point moves; a buffer that drops members averages its survivors (a w over fewer agents, outside the
    paper's analysis); the client-level guarantee is DistributedDP's (one device's whole contribution, zero-out
    neighbours), beside any record-level one of ``privacy=``.

    Parameters
    ----------
    total_samples
        I (f_p carries 1/I): required (the mean form has no exchange before round 1 to learn it).
    privacy
        Required: ``PrivacyTarget(...)`` (record-level DP-SGD in the solves, as :class:`DPIADMM`),
        ``ObjectivePerturbation(...)`` or ``None`` (no record-level noise; e.g. under DistributedDP alone).
    local_updates, rho, eta, beta, box
        As :class:`DPIADMM`.
    num_rounds
        The rounds a ``PrivacyTarget`` is calibrated for when this strategy runs inside a wrapper (whose ``start``
        does not tell it); None: the ``num_rounds`` of :meth:`start`.
    min_available_nodes
        P, the agents (all of them every round).
    fraction_evaluate
        Flower's federated evaluation (default 0: the central ``evaluate_fn`` evaluates w).
    **fedavg
        Flower's FedAvg arguments (``train_metrics_aggr_fn``, record keys, ...).
    """

    algorithm = "dp-iadmm"

    def __init__(self, *, total_samples: int, privacy: Any = MISSING, local_updates: int = 1,
                 rho: float | RhoSchedule | None = None, eta: float | EtaSchedule | None = None, beta: float = 1e-6,
                 box: float | None = None, num_rounds: int | None = None, min_available_nodes: int = 2,
                 fraction_evaluate: float = 0.0, **fedavg: Any) -> None:
        for forbidden in ("fraction_train", "min_train_nodes", "weighted_by_key"):
            if forbidden in fedavg:
                raise ValueError(f"IADMMMean sets {forbidden} itself: every agent takes part in every round and "
                                 "weighs 1 in (4a)")
        privacy = _check_privacy(privacy, type(self).__name__, ObjectivePerturbation)
        super().__init__(fraction_train=1.0, fraction_evaluate=fraction_evaluate, min_train_nodes=min_available_nodes,
                         min_available_nodes=min_available_nodes, weighted_by_key=WEIGHT_KEY, **fedavg)
        if isinstance(local_updates, bool) or not isinstance(local_updates, int) or local_updates < 1:
            raise ValueError(f"local_updates must be an integer >= 1, got {local_updates!r}")
        if isinstance(total_samples, bool) or not isinstance(total_samples, int) or total_samples < 1:
            raise ValueError(f"total_samples must be an integer >= 1 (I of (2c)), got {total_samples!r}")
        if num_rounds is not None and (isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1):
            raise ValueError(f"num_rounds must be an integer >= 1 or None, got {num_rounds!r}")
        if isinstance(beta, bool) or not isinstance(beta, int | float) or not (beta >= 0 and math.isfinite(beta)):
            raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
        self.plan = PrivacyPlan(privacy, local_updates)
        self.total, self.local_updates, self.beta = total_samples, local_updates, float(beta)
        self.penalty: float | RhoSchedule = RhoSchedule() if rho is None else _schedule("rho", rho, RhoSchedule)
        self.proximity: float | EtaSchedule = EtaSchedule() if eta is None else _schedule("eta", eta, EtaSchedule)
        self.box = None if box is None else _positive("box", box)
        self.num_rounds = num_rounds
        self.rounds_done = 0
        self._layout: ArrayLayout | None = None
        self._checked = False

    # ------------------------------------------------------------------ schedules and the plan
    def rho_at(self, t: int) -> float:
        return self.penalty(t, self.plan.rho_epsilon) if isinstance(self.penalty, RhoSchedule) else self.penalty

    def eta_at(self, t: int) -> float:
        return self.proximity(t, self.plan.rho_epsilon) if isinstance(self.proximity, EtaSchedule) else self.proximity

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Any = None) -> Result:
        """Flower's ``Strategy.start``, with the DP-SGD mechanism calibrated for ``num_rounds`` first."""
        self.num_rounds = self.num_rounds or num_rounds
        self.plan.calibrate(self.num_rounds, type(self).__name__)
        return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn)

    def privacy_spent(self) -> Any:
        """Flower's protocol: the record-level (epsilon, delta) every device has spent so far (all take the same
        steps), None without privacy. Under ``DistributedDP`` the wrapper's ``privacy_spent`` is the client-level
        figure; this one stays reachable as ``strategy.inner.privacy_spent()``."""
        from flwr.supercore.privacy_accounting import PrivacySpent

        if not self.plan.private or (isinstance(self.plan.privacy, PrivacyTarget) and self.plan.mechanism is None):
            return None
        eps = self.plan.epsilon_after(self.rounds_done)
        method = ("RDP, Poisson-subsampled Gaussian (DP-SGD), every device" if isinstance(self.plan.privacy, PrivacyTarget)
                  else "RDP composition of the per-solve Laplace releases, every device")
        return PrivacySpent(epsilon=float(eps or 0.0), delta=float(self.plan.privacy.delta),
                            num_releases=self.rounds_done * self.local_updates, accounting_method=method)

    def _check_plan(self, grid: Grid, nodes: list[int], rounds: int, timeout: float = 120.0) -> None:
        """Before round 1: every device checks the whole run's plan against its floor (a refusal stops the run)."""
        plan: dict[str, Any] = self.plan.plan_config(rounds)
        cfg = ConfigRecord(plan)
        msgs = [Message(RecordDict({"config": cfg}), dst_node_id=n, message_type=WHOAMI) for n in nodes]
        for reply in grid.send_and_receive(msgs, timeout=timeout):
            if reply.has_error():
                raise FederationError(f"node {reply.metadata.src_node_id} refused before round 1: {reply.error.reason}")

    # ------------------------------------------------------------------ Flower's Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Flower's FedAvg messages (every agent), with the round's public IADMM values in the config."""
        if self.plan.private and self.plan.mechanism is None and isinstance(self.plan.privacy, PrivacyTarget):
            horizon = self.plan.privacy.horizon or self.num_rounds
            if horizon is None:
                raise ValueError("IADMMMean runs inside a wrapper whose start() does not tell it the rounds: pass "
                                 "num_rounds=T to IADMMMean (or PrivacyTarget(horizon=T)) to calibrate the DP-SGD noise")
            self.plan.calibrate(horizon, type(self).__name__)
        self._layout = ArrayLayout.of(arrays_of(arrays))
        cfg = ConfigRecord({**dict(config), ALGORITHM_KEY: self.algorithm, FORM_KEY: "mean",
                            "rho": self.rho_at(server_round), "rho-next": self.rho_at(server_round + 1),
                            "eta": self.eta_at(server_round), "local-updates": self.local_updates, "beta": self.beta,
                            "total-samples": self.total, **self.plan.message_config()})
        if self.box is not None:
            cfg["box"] = self.box
        messages = list(super().configure_train(server_round, arrays, cfg, grid))
        if self.plan.private and not self._checked and messages:
            self._check_plan(grid, [m.metadata.dst_node_id for m in messages],
                             (self.num_rounds or server_round) - server_round + 1)
            self._checked = True
        for m in messages:  # P, known once FedAvg has sampled every node
            m.content.config_records[self.configrecord_key]["num-agents"] = len(messages)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """(4a) as the mean of the agents' terms; a malformed reply is dropped and logged with its node."""
        kept: list[Message] = []
        for reply in replies:
            if reply.has_error():
                kept.append(reply)  # FedAvg logs it
                continue
            try:
                self._check_reply(reply)
            except (MalformedPayload, LayoutMismatch, ValueError, TypeError, KeyError) as err:
                log(WARNING, "round %d: IADMMMean rejected the reply of node %s: %s", server_round,
                    reply.metadata.src_node_id, err)
                continue
            kept.append(reply)
        self.rounds_done = server_round
        return super().aggregate_train(server_round, kept)

    def _check_reply(self, reply: Message) -> None:
        content = reply.content
        if self.arrayrecord_key not in content.array_records or len(content.metric_records) != 1:
            raise MalformedPayload(f"a reply needs the ArrayRecord {self.arrayrecord_key!r} and one MetricRecord")
        named = arrays_of(content.array_records[self.arrayrecord_key])
        assert self._layout is not None
        self._layout.check(named, what="reply arrays")
        for name, a in named.items():
            if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
                raise MalformedPayload(f"reply array {name!r} holds NaN or Inf")
        metrics = next(iter(content.metric_records.values()))
        weight = metrics.get(WEIGHT_KEY)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not (math.isfinite(weight) and weight > 0):
            raise MalformedPayload(f"metric {WEIGHT_KEY!r} must be a positive finite number, got {weight!r}")
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise MalformedPayload(f"metric {k!r} is not finite")

    def summary(self) -> None:
        log(INFO, "IADMMMean: E=%d, I=%d, %s", self.local_updates, self.total, self.plan.describe())
        super().summary()
