"""DP-FedPDM (Alg. 1) and BSDP-FedPDM (Alg. 2) server side.

Li, Huang, Wang, Chi, Quek, "Privacy-preserving Federated Primal-dual Learning for Non-convex and Non-smooth
Problems with Model Sparsification", arXiv 2310.19558.

The server keeps only x_0 (dense, after the prox): no duals, no stale uploads, no error memory (spec 2.4).
"""

from __future__ import annotations

from typing import Any

from fedapp.algorithms.fedpdm import server_update
from fedapp.strategy_base import BroadcastStrategy, round_diagnostics


class DPFedPDM(BroadcastStrategy):
    """Alg. 1: broadcast x_0, average the noisy y's, soft-threshold at gamma/rho (12).

    Parameters
    ----------
    cfg
        Run config: rho, gamma (l1 weight of h), eta0, nu, max-local-steps, dp, epsilon-total, delta, clip-norm,
        c0, num-clients N, clients-per-round K, first-round-all (S_0 = [N]), seed, init-std.
    evaluator
        Central test-set evaluation.
    """

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """(12) / (20): prox of the element-wise mean over the clients that sent each coordinate."""
        self.x, counts = server_update([updates[p] for p in sorted(updates)], self.dim, self.cfg.gamma, self.cfg.rho)
        return round_diagnostics(counts, metrics)


class BSDPFedPDM(DPFedPDM):
    """Alg. 2: sparse uplink (top_k / rand_k, k = alpha_U d) and top_k' downlink (k' = alpha_D d)."""

    sparse = True
