"""FedAvg and FedProx server side, and the server plumbing every baseline shares (arXiv 2310.19558, Figs. 7-8).

FedAvg: McMahan et al., AISTATS 2017 (the DP-FedAvg of Li, Chang, Chi, MLSP 2020, the paper's [10]); FedProx:
Li et al., MLSys 2020 ([44]). The math is :mod:`fedapp.algorithms.local_sgd`; [OURS] marks choices of spec 6.4.

* The server keeps the dense model x (plus SCAFFOLD's c or FedDyn's h in their subclasses), initialised like
  DP-FedPDM's x_0^0 ~ N(0, init-std^2) with the run's seed, and evaluates it centrally.
* Downlink: dense x, or [OURS] top_k'(x) with k' = alpha-down d for the "-sparse" keys (like BSDP-FedPDM, eq. 27).
* Aggregation: unweighted mean of the uploaded models, element-wise over the senders of each coordinate when the
  uploads are sparse; no prox at the server. [OURS] The l1 term is handled by the clients' subgradient steps.
* FedProx differs from FedAvg only on the clients; its strategy sends mu under Flower's FedProx config key
  "proximal-mu".
"""

from __future__ import annotations

from typing import Any

from clients.fedavg import PROX_KEY
from fedapp.algorithms.local_sgd import model_average
from fedapp.strategy_base import BroadcastStrategy, Scalar, round_diagnostics


class LocalSGDStrategy(BroadcastStrategy):
    """Server side shared by the local-SGD baselines (FedAvg, FedProx, SCAFFOLD, FedDyn)."""


class FedAvg(LocalSGDStrategy):
    """FedAvg: broadcast x, average the uploaded local models (unweighted; element-wise when sparse)."""

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        self.x, counts = model_average([updates[p] for p in sorted(updates)], self.dim)
        return round_diagnostics(counts, metrics)


class SparseFedAvg(FedAvg):
    """FedAvg with top_k / rand_k uplink and top_k' downlink (Fig. 8, [OURS])."""

    sparse = True


class FedProx(FedAvg):
    """FedProx: FedAvg's server; the clients add (mu/2)||x - x_0||^2, mu = the run config's ``mu``."""

    def round_config(self) -> dict[str, Scalar]:
        return {PROX_KEY: self.cfg.mu}


class SparseFedProx(FedProx):
    """FedProx with top_k / rand_k uplink and top_k' downlink (Fig. 8, [OURS])."""

    sparse = True
