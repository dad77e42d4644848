"""DP-IADMM (ObjP / ObjPM, Algorithm 1) and the OutP baseline, server side.

Ryu & Kim, "Differentially Private Federated Learning via Inexact ADMM with Multiple Local Updates" (seed 002);
spec ``shared/specs/dp_iadmm.md`` sections 2.3, 5.2, 9.3, 9.4 and 9.7.

Consensus ADMM over every connected agent p (agent = client id, fixed when the federation forms): the server keeps
a copy of every agent's dual lambda_p and last upload z_p, computes w^{t+1} by (4a) and updates its dual copies by
(4c); duals never travel. Each agent reports a CRC of its own dual and the server compares it with its copy every
round (metric ``dual_mismatch``, which must stay 0). A round in which an agent does not reply stops the run
(:class:`ReplicatedDualError`): its two dual copies could no longer be kept identical.

Works on any model's ``ArrayRecord``: z_p^1 is the initial model for every agent and lambda_p^1 = 0, so round 1
broadcasts the initial model itself (with the paper's zero initialisation, the zero matrix, spec A7).

The global sample count I (every f_p carries 1/I, (2c)) is ``total_samples`` when the operator knows it; otherwise
the strategy asks every agent for its count I_p in one extra exchange before round 1 (``query.whoami``, which
:class:`fedpdm_flower.clients.iadmm.IADMMClient` answers with ``num-examples``). Flower's per-reply ``num-examples`` would come
too late: round 1's local solves already need I. A wrong I changes only the weight of the data term, not
privacy: the Laplace scale Delta / epsilon and the data term's gradient carry the same 1/I.
"""

from __future__ import annotations

import math
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, RecordDict
from flwr.common.logger import log
from numpy.typing import NDArray

from fedpdm_flower.fedapp.algorithms.iadmm import (
    OUTP_SENSITIVITY_MODES,
    SENSITIVITY_MODES,
    EtaSchedule,
    RhoSchedule,
    dual_fingerprint,
    dual_update,
    server_w_update,
)
from fedpdm_flower.fedapp.compression.codec import MalformedPayload, decode_vector, encode_dense, wire_round
from fedpdm_flower.fedapp.compression.payload import FORMAT_KEY, from_arrays, to_arrays
from fedpdm_flower.strategies.base import WHOAMI, FederatedStrategy, FederationError, RoundFailed, Scalar

__all__ = ["DPIADMM", "ConsensusADMM", "ObjP", "ObjPM", "OutP", "ReplicatedDualError"]

#: the message-config key naming the mechanism, so that a client of the other kind refuses the message
MECHANISM_KEY = "mechanism"


class ReplicatedDualError(RoundFailed):
    """An agent did not reply: its dual copies on the server and the agent can no longer be kept identical."""


def _positive(name: str, value: Any, *, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if not allow_inf and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _clip(mode: str, clip: Any) -> float:
    if clip is None:
        raise ValueError(f"sensitivity_mode {mode!r} needs its clipping bound: pass clip=C > 0")
    return _positive("clip", clip)


def _schedule(name: str, value: Any, kind: type) -> Any:
    """A constant (a float > 0) or a schedule object."""
    if isinstance(value, kind):
        return value
    return _positive(name, value)


class ConsensusADMM(FederatedStrategy):
    """Server side shared by DP-IADMM and OutP: replicated duals, (4a), (4c), every agent every round.

    Parameters
    ----------
    epsilon
        Per-local-solve privacy budget epsilon-bar; None (or ``math.inf``) runs without noise.
    rho
        The penalty rho^t: a :class:`fedpdm_flower.fedapp.algorithms.iadmm.RhoSchedule` (schedule (24)), or a constant > 0.
        Default None: (24) with the paper's MNIST constants c1 = 2, c2 = 5, T_c = 10 000.
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

    PRIVACY_KEYS = ("eps_basic", "delta_basic", "eps_advanced", "delta_advanced")
    privacy_label = "eps(basic)"
    #: the mechanism the clients must run (sent as ``mechanism``)
    mechanism = ""
    #: "alg1": w^{t+1} by (4a) before the local solves; "huang": local first, then W and the duals (OutP)
    order = "alg1"

    def __init__(self, *, epsilon: float | None, rho: float | RhoSchedule | None, beta: float,
                 total_samples: int | None, **federation: Any) -> None:
        if federation.get("fraction_train", 1.0) != 1.0:
            raise ValueError(f"fraction_train must be 1.0, got {federation['fraction_train']!r}: Algorithm 1 uses "
                             "every agent every round (each one's dual is replicated on the server, (4c))")
        super().__init__(**federation)
        self.epsilon = math.inf if epsilon is None else _positive("epsilon", epsilon, allow_inf=True)
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
    def private(self) -> bool:
        """True when the local solves are perturbed (epsilon-bar < inf)."""
        return not math.isinf(self.epsilon)

    def rho_at(self, t: int) -> float:
        """rho^t: the schedule at (t, epsilon-bar), or the constant."""
        return self.penalty(t, self.epsilon) if isinstance(self.penalty, RhoSchedule) else self.penalty

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

    # ------------------------------------------------------------------ I from the agents, before round 1
    def pre_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        """Before round 1, without ``total_samples``: ask every agent for its count I_p."""
        if self.total is not None:
            return []
        return self.to_all(WHOAMI, RecordDict({"config": ConfigRecord()}))

    def consume_pre_train(self, server_round: int, replies: Any) -> None:
        """I = sum_p I_p from the agents' ``num-examples``; an agent that cannot say stops the run, named."""
        counts: dict[int, int] = {}
        for node, content in replies:
            cid = self.pid_of.get(node)
            if isinstance(content, str):
                raise FederationError(f"node {node} (agent {cid}) could not report its sample count: {content}")
            self.count_up(content)
            info = dict(content.config_records.get("info", ConfigRecord()))
            n = info.get("num-examples")
            if cid is None or isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise FederationError(
                    f"node {node} (agent {cid}) did not report num-examples >= 1 (got {n!r}): pass "
                    f"total_samples=I to {type(self).__name__}, or give the node an IADMMClient / OutPClient")
            counts[cid] = n
        missing = sorted(set(range(self.num_clients)) - set(counts))
        if missing:
            raise FederationError(f"agent(s) {missing} did not report their sample count before round 1")
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
        cfg: dict[str, Scalar] = {MECHANISM_KEY: self.mechanism, "rho": self.rho_t, "dp": self.private,
                                  "beta": self.beta, "num-agents": self.num_clients, "total-samples": self.total}
        if self.private:
            cfg["epsilon"] = self.epsilon
        return cfg

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
            **{k: float(np.mean([m[k] for m in ms])) for k in ("delta_mean", "lap_scale_mean", "sigma") if k in ms[0]},
            **{k: float(np.max([m[k] for m in ms])) for k in ("delta_max",) if k in ms[0]},
            **{k: float(ms[0][k]) for k in ("eps_iter", "delta_iter", "eps_round") if k in ms[0]},
        }

    def headline_privacy(self, priv: Any) -> tuple[float | None, float | None]:
        """(epsilon, delta) of the round record: basic composition over every local solve so far, worst agent (A4, A5)."""
        if "eps_basic" in priv:
            return float(priv["eps_basic"]), float(priv.get("delta_basic", 0.0))
        return None, None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "epsilon": self.epsilon, "rho": self.penalty, "beta": self.beta,
                "total_samples": self.total}


class DPIADMM(ConsensusADMM):
    """DP-IADMM with multiple local updates (Algorithm 1, lines 1-9 on the server), in Algorithm 1's order:
    w first (4a), then E objective-perturbed inexact local solves (8) on every agent, then the duals (4c).

    For a neural network use constant ``rho=0.2, eta=3.0`` with ``sensitivity_mode="clipped", clip=200.0``: the
    paper's schedules fit its linear model (an MLP on MNIST, ObjPM at epsilon-bar 5: 0.22 after 3 rounds with them,
    0.56 with these; docs/models-and-data.md).

    Parameters
    ----------
    local_updates
        E, the local solves per round (Algorithm 1 lines 17-20); their average is sent (line 21). Default 1 (ObjP);
        the paper's ObjPM uses 10 (:class:`ObjPM`).
    epsilon
        epsilon-bar, the budget of each local solve (Theorem 1: each solve is epsilon-bar-DP; a round of E solves
        is E epsilon-bar by basic composition, spec A4). Default 0.05, the paper's headline setting; None (or
        ``math.inf``) is non-private IADMM (no noise, and no c2 / epsilon-bar term in (24)).
    rho
        rho^t: a :class:`fedpdm_flower.fedapp.algorithms.iadmm.RhoSchedule` (schedule (24); ``RhoSchedule.femnist()`` for the
        FEMNIST constants) or a constant > 0. Default None: (24) with the MNIST constants (2, 5, 10 000).
    eta
        eta^t, the proximity parameter of the local solves: an :class:`fedpdm_flower.fedapp.algorithms.iadmm.EtaSchedule`
        ((19) ``a / sqrt(t)``, (15), (22) or a constant) or a constant > 0. Default None: (19) with a = 1, the
        reference code's choice (the paper does not state it, spec A3).
    beta
        beta of objective (1): f_p carries ``(beta / P) ||z||^2`` (default 1e-6, Section IV).
    sensitivity_mode
        How each agent calibrates the Laplace noise (9a), b = Delta / epsilon-bar:

        * ``"paper"`` (default): Section IV's Delta = ``(1/I) max_i ||x_i||_1 ||h(z; x_i) - y_i||_1`` at every
          iterate. Valid only for the paper's multinomial logistic model (63) (a
          :class:`fedpdm_flower.fedapp.models.MultinomialLogistic` on the agents), data-dependent and not a rigorous bound
          (spec A2): it reproduces the paper;
        * ``"bounded"``: every feature vector L1-clipped to ``clip`` = C1, Delta = ``4 C1 / I`` (spec 4.6; model
          (63) only);
        * ``"clipped"``: every per-sample gradient clipped to L1 norm ``clip`` = C, Delta = ``2 C / I``. Rigorous
          for any model with per-sample gradients: a torch ``nn.Module``, or the multinomial model.
    clip
        C1 of ``"bounded"`` or C of ``"clipped"`` (required by those modes; None otherwise).
    box
        B > 0 projects every local iterate onto W = [-B, B]^d (exact for the isotropic subproblem (8), spec A6);
        None (default): W = R^d, as the paper's experiments.
    total_samples
        I (f_p carries 1/I). None (default): the sum of the agents' counts, asked before round 1.
    accounting_delta
        delta' of the advanced composition (Dwork-Roth Thm 3.20) the agents report beside the basic one
        (default 1e-6). The paper states per-solve DP only (Remark 1).
    **federation
        :class:`fedpdm_flower.strategies.base.FederatedStrategy`'s arguments: ``min_available_nodes`` (the agents P; every
        connected node is an agent), ``seed``, ``node_wait_s``, ``eval_every``, ... ``fraction_train`` must stay
        1.0. The agents are the connected nodes, numbered by partition id when every node reports one.

    Examples
    --------
    >>> strategy = ObjPM(min_available_nodes=10, epsilon=1.0, sensitivity_mode="clipped", clip=10.0)
    >>> result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=50)
    """

    mechanism = "laplace-objective"

    def __init__(self, *, local_updates: int = 1, epsilon: float | None = 0.05, rho: float | RhoSchedule | None = None,
                 eta: float | EtaSchedule | None = None, beta: float = 1e-6, sensitivity_mode: str = "paper",
                 clip: float | None = None, box: float | None = None, total_samples: int | None = None,
                 accounting_delta: float = 1e-6, **federation: Any) -> None:
        super().__init__(epsilon=epsilon, rho=rho, beta=beta, total_samples=total_samples, **federation)
        if isinstance(local_updates, bool) or not isinstance(local_updates, int) or local_updates < 1:
            raise ValueError(f"local_updates must be an integer >= 1, got {local_updates!r}")
        self.local_updates = local_updates
        self.proximity: float | EtaSchedule = EtaSchedule() if eta is None else _schedule("eta", eta, EtaSchedule)
        if sensitivity_mode not in SENSITIVITY_MODES:
            raise ValueError(f"sensitivity_mode must be one of {list(SENSITIVITY_MODES)}, got {sensitivity_mode!r}")
        if sensitivity_mode == "paper" and clip is not None:
            raise ValueError("clip applies to sensitivity_mode 'bounded' (C1) and 'clipped' (C), not 'paper'")
        self.sensitivity_mode = sensitivity_mode
        self.clip = None if sensitivity_mode == "paper" else _clip(sensitivity_mode, clip)
        self.box = None if box is None else _positive("box", box)
        if not (isinstance(accounting_delta, float) and 0.0 < accounting_delta < 1.0):
            raise ValueError(f"accounting_delta must be a float in (0, 1), got {accounting_delta!r}")
        self.accounting_delta = accounting_delta
        self.eta_t = 0.0

    def eta_at(self, t: int) -> float:
        """eta^t: the schedule at (t, epsilon-bar), or the constant."""
        return self.proximity(t, self.epsilon) if isinstance(self.proximity, EtaSchedule) else self.proximity

    def prepare_round(self, server_round: int) -> None:
        self.eta_t = self.eta_at(server_round)
        super().prepare_round(server_round)

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        """rho^t, eta^t, E, epsilon-bar, the sensitivity calibration, I, beta, P (spec 9.5)."""
        cfg = super().round_config(server_round)
        cfg.update({"eta": self.eta_t, "local-updates": self.local_updates,
                    "sensitivity-mode": self.sensitivity_mode, "accounting-delta": self.accounting_delta})
        if self.clip is not None:
            cfg["clip"] = self.clip
        if self.box is not None:
            cfg["box"] = self.box
        return cfg

    def round_diagnostics(self) -> dict[str, float]:
        return {"rho": self.rho_t, "eta": self.eta_t, "local_updates": float(self.local_updates)}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "local_updates": self.local_updates, "eta": self.proximity,
                "sensitivity_mode": self.sensitivity_mode, "clip": self.clip, "box": self.box}


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

    One noiseless inexact step (5) per round with Huang's proximity, then Gaussian noise on its output,
    (epsilon-bar, delta-bar)-DP per step; the noisy iterate is kept by the agent and sent.

    Parameters
    ----------
    epsilon, delta
        (epsilon-bar, delta-bar) of each step (defaults 0.05 and 1e-6, Section IV); epsilon None (or
        ``math.inf``) runs without noise.
    rho
        As :class:`DPIADMM` (default (24), MNIST constants; the paper uses the same rho^t for OutP, App. H).
    eta_scale
        a of Huang's proximity ``1/eta^t = (0.25 I_p + 2 sqrt(t ln(1.25/delta-bar)) / epsilon-bar) / a``
        (reference code, a = 1 by default; I_p is each agent's own count).
    beta
        beta of objective (1) (default 1e-6).
    order
        ``"huang"`` (default, the reference code): round r sends W^{r-1} (the initial model in round 1), the agents
        step and perturb, the server forms W^r = (1/P) sum_p (z~_p - lambda_p / rho) and updates the duals with
        W^r; the agents apply that dual update when W^r reaches them. ``"alg1"``: Algorithm 1's order (w first).
    noise_std
        ``"sigma"`` (default, the calibrated Gaussian mechanism) or ``"sigma-squared"``: the reference code's bug,
        sigma^2 used as the standard deviation (spec A9; less noise than calibrated for sigma < 1).
    grad_scale
        ``"local"`` (default, the reference code): the data term is scaled by 1/I_p; ``"global"``: by 1/I, (2c).
    sensitivity_mode
        The L2 sensitivity of the output: ``"reference"`` (default): the reference code's ``2 / (rho + 1/eta)``,
        Huang's bound c1 = I_p, defined for the paper's multinomial model (63) only; ``"clipped"``: every
        per-sample gradient clipped to L2 norm ``clip`` = C, ``2 C / (n (rho + 1/eta))`` with n = I_p or I.
        Rigorous for any model with per-sample gradients (a torch ``nn.Module``).
    clip
        C of ``"clipped"`` (required there; None otherwise).
    total_samples
        I. None (default): the sum of the agents' counts, asked before round 1.
    **federation
        As :class:`DPIADMM`.
    """

    mechanism = "gaussian-output"

    def __init__(self, *, epsilon: float | None = 0.05, delta: float = 1e-6, rho: float | RhoSchedule | None = None,
                 eta_scale: float = 1.0, beta: float = 1e-6, order: str = "huang", noise_std: str = "sigma",
                 grad_scale: str = "local", sensitivity_mode: str = "reference", clip: float | None = None,
                 total_samples: int | None = None, **federation: Any) -> None:
        super().__init__(epsilon=epsilon, rho=rho, beta=beta, total_samples=total_samples, **federation)
        if not (isinstance(delta, float) and 0.0 < delta < 1.0):
            raise ValueError(f"delta must be a float in (0, 1), got {delta!r}")
        for name, value, choices in (("order", order, ("huang", "alg1")),
                                     ("noise_std", noise_std, ("sigma", "sigma-squared")),
                                     ("grad_scale", grad_scale, ("local", "global")),
                                     ("sensitivity_mode", sensitivity_mode, OUTP_SENSITIVITY_MODES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        if sensitivity_mode == "reference" and clip is not None:
            raise ValueError("clip applies to sensitivity_mode 'clipped', not 'reference'")
        self.delta, self.eta_scale = delta, _positive("eta_scale", eta_scale)
        self.order, self.noise_std, self.grad_scale = order, noise_std, grad_scale
        self.sensitivity_mode = sensitivity_mode
        self.clip = None if sensitivity_mode == "reference" else _clip(sensitivity_mode, clip)

    def prepare_round(self, server_round: int) -> None:
        """rho^t; in Algorithm 1's order also w^{t+1} by (4a). Huang's order sends the W of the last aggregate."""
        if self.order == "alg1":
            super().prepare_round(server_round)
            return
        self.agents_ready()
        self.rho_t = self.rho_at(server_round)

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        """rho^t, (epsilon-bar, delta-bar), Huang's proximity scale, the order and noise options, I, beta, P."""
        cfg = super().round_config(server_round)
        cfg.update({"delta": self.delta, "eta-scale": self.eta_scale, "order": self.order,
                    "noise-std": self.noise_std, "grad-scale": self.grad_scale,
                    "sensitivity-mode": self.sensitivity_mode})
        if self.clip is not None:
            cfg["clip"] = self.clip
        return cfg

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "delta": self.delta, "eta_scale": self.eta_scale, "order": self.order,
                "noise_std": self.noise_std, "grad_scale": self.grad_scale,
                "sensitivity_mode": self.sensitivity_mode, "clip": self.clip}
