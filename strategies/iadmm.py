"""DP-IADMM (ObjP / ObjPM, Algorithm 1) and the OutP baseline, server side.

Ryu & Kim, "Differentially Private Federated Learning via Inexact ADMM with Multiple Local Updates" (seed 002);
spec ``shared/specs/dp_iadmm.md`` sections 2.3, 5.2, 9.4 and 9.7.

The server keeps a copy of every agent's dual lambda_p and last upload z_p (persisted in the strategy), computes
w^{t+1} by (4a) and updates its dual copies by (4c); duals never travel. Each agent reports a CRC of its own dual
and the server compares it with its copy every round (metric ``dual_mismatch``, which must stay 0).
"""

from __future__ import annotations

from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import RecordDict
from flwr.common.logger import log

from fedapp.algorithms.iadmm import (
    dual_fingerprint,
    dual_update,
    eta_of,
    local_updates_of,
    rho_of,
    server_w_update,
)
from fedapp.compression.codec import wire_round
from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.strategy_base import BroadcastStrategy, RoundFailed, Scalar
from fedapp.task import Evaluator, total_train_samples


class ReplicatedDualError(RoundFailed):
    """An agent did not reply: its dual copies on the server and the agent can no longer be kept identical."""


class DPIADMM(BroadcastStrategy):
    """Algorithm 1 lines 1-9 (server), in Algorithm 1's order: w first (4a), then the agents, then the duals (4c).

    Serves the keys ``dp-iadmm`` (E = ``local-updates``), ``objp`` (E = 1) and ``objpm`` (E = 10).

    Parameters
    ----------
    cfg
        Run config: num-clients P (= clients-per-round), rho schedule (24) constants or constant ``rho``, eta
        schedule, ``iadmm-epsilon``, ``dp`` (false: epsilon-bar = inf), ``total-samples`` (0: computed).
    evaluator
        Central test-set evaluation of w.
    """

    privacy_label = "eps(basic)"
    #: "alg1": w^{t+1} by (4a) before the local solves; "huang": local first, then W and the duals (OutP)
    order = "alg1"

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None) -> None:
        super().__init__(cfg, evaluator)
        p = cfg.num_clients
        self.total = cfg.total_samples or total_train_samples(cfg)
        self.local_updates = local_updates_of(cfg)
        self.z: FloatArray = np.zeros((p, self.dim))  # z_p^t, zero initialisation (spec A7)
        self.lam: FloatArray = np.zeros((p, self.dim))  # server copy of lambda_p^t
        self.rho = 0.0
        self.eta = 0.0

    def initial_model(self) -> FloatArray:
        """w = 0: with z_p^1 = lambda_p^1 = 0, (4a) broadcasts the zero matrix in round 1 (spec A7)."""
        return np.zeros(self.dim)

    def round_config(self) -> dict[str, Scalar]:
        """Public scalars of the round (spec 9.5): rho^t, eta^t and I."""
        return {"rho": self.rho, "eta": self.eta, "total-samples": self.total}

    def prepare_round(self, server_round: int) -> None:
        """Schedules of round t, then line 5: w^{t+1} = (1/P) sum_p (z_p^t - lambda_p^t / rho^t) (4a).

        (Not ``begin_round``: that is the base class's reset of the round's byte / wall-clock accumulators.)
        """
        self.rho, self.eta = rho_of(self.cfg, server_round), eta_of(self.cfg, server_round)
        self.x = wire_round(server_w_update(self.z, self.lam, self.rho))

    def train_contents(self, server_round: int) -> list[tuple[int, RecordDict]]:
        self.prepare_round(server_round)
        return super().train_contents(server_round)

    def dual_mismatches(self, metrics: dict[int, dict[str, Any]]) -> tuple[int, float]:
        """Agents whose reported dual CRC differs from the server copy, and the largest relative gap of ||lambda||^2."""
        bad, gap = 0, 0.0
        for p, m in metrics.items():
            if int(m["dual_crc"]) != dual_fingerprint(self.lam[p]):
                bad += 1
            mine = float(np.dot(self.lam[p], self.lam[p]))
            gap = max(gap, abs(float(m["dual_sqnorm"]) - mine) / max(mine, 1e-300))
        return bad, gap

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Lines 7-8: store z_p^{t+1}, then lambda_p^{t+1} = lambda_p^t + rho^t (w^{t+1} - z_p^{t+1}) for all p."""
        missing = sorted(set(range(self.cfg.num_clients)) - set(updates))
        if missing:
            raise ReplicatedDualError(
                server_round, f"no valid reply from partition(s) {missing} (Algorithm 1 needs every agent every round: "
                "their duals would diverge from the server's copies)", self.round_errors(),
            )
        for p in sorted(updates):
            self.z[p] = updates[p].to_dense()
        before = self.dual_mismatches(metrics) if self.order == "huang" else None
        if self.order == "huang":  # W^{k+1} from the new uploads and the old duals (spec 5.2)
            self.x = wire_round(server_w_update(self.z, self.lam, self.rho))
        for p in sorted(updates):
            self.lam[p] = dual_update(self.lam[p], self.x, self.z[p], self.rho)
        bad, gap = before if before is not None else self.dual_mismatches(metrics)
        if bad:
            log(WARNING, "round %d: %d agent dual(s) differ from the server's copies", server_round, bad)
        ms = list(metrics.values())
        return {
            "rho": self.rho,
            **({"eta": self.eta} if self.eta > 0 else {}),
            "local_updates": float(self.local_updates),
            "dual_mismatch": float(bad),
            "dual_sqnorm_rel_gap": gap,
            "consensus_l1": float(np.mean(np.abs(self.z - self.x).sum(axis=1))),
            "noise_abs_mean": float(np.mean([m["noise_abs_mean"] for m in ms])),
            **{k: float(np.mean([m[k] for m in ms])) for k in ("delta_mean", "lap_scale_mean", "sigma") if k in ms[0]},
            **{k: float(np.max([m[k] for m in ms])) for k in ("delta_max",) if k in ms[0]},
            **{k: float(ms[0][k]) for k in ("eps_iter", "delta_iter", "eps_round") if k in ms[0]},
        }

    def headline_privacy(self, priv: Any) -> tuple[float | None, float | None]:
        """results.json's (epsilon, delta): basic composition over every local solve so far, worst agent (A4, A5)."""
        if "eps_basic" in priv:
            return float(priv["eps_basic"]), float(priv.get("delta_basic", 0.0))
        return None, None


class OutP(DPIADMM):
    """OutP baseline (Huang et al. DP-ADMM as in the paper's reference code, spec 5.2 and 9.7).

    ``outp-order = "huang"`` (default): round r sends W^{r-1} (W^0 = 0), the agents step and perturb their output,
    the server forms W^r = (1/P) sum_p (z~_p - lambda_p / rho) and updates the duals with W^r; the agents apply that
    dual update at the start of their next round, when W^r reaches them. ``"alg1"`` uses Algorithm 1's order.
    """

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None) -> None:
        super().__init__(cfg, evaluator)
        self.order = cfg.outp_order

    def round_config(self) -> dict[str, Scalar]:
        """rho^t and I (OutP's proximity comes from Huang's formula on the agent, spec 5.2)."""
        return {"rho": self.rho, "total-samples": self.total}

    def prepare_round(self, server_round: int) -> None:
        """rho^t; in Algorithm 1's order also w^{t+1} by (4a). Huang's order sends the W of the last aggregate."""
        if self.order == "alg1":
            super().prepare_round(server_round)
        self.rho = rho_of(self.cfg, server_round)
