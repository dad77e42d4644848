"""FedAvg and FedProx server side, and the server plumbing every baseline shares (arXiv 2310.19558, Figs. 7-8).

FedAvg: McMahan et al., AISTATS 2017 (the DP-FedAvg of Li, Chang, Chi, MLSP 2020, the paper's [10]); FedProx:
Li et al., MLSys 2020 ([44]). The math is :mod:`fedpdm_flower.fedapp.algorithms.local_sgd`; [OURS] marks choices of spec 6.4.

* The server keeps the dense model x (plus SCAFFOLD's c or FedDyn's h in their subclasses), starting from the
  ``initial_arrays`` it is given, and evaluates it centrally through ``evaluate_fn``.
* Downlink: dense x, or [OURS] top_k'(x) with ``downlink=TopK(alpha_D)`` (the "-sparse" keys; like BSDP-FedPDM,
  eq. 27); uplink: dense, or top_k / rand_k with ``uplink=TopK(alpha_U)`` / ``RandK(alpha_U)``.
* Aggregation: unweighted mean of the uploaded models, element-wise over the senders of each coordinate when the
  uploads are sparse; no prox at the server. [OURS] The l1 term is handled by the clients' subgradient steps.
* FedProx differs from FedAvg only on the clients; its strategy sends mu under Flower's FedProx config key
  "proximal-mu". Every baseline sends gamma, the weight of the l1 subgradient of objective (40).
"""

from __future__ import annotations

from typing import Any

from fedpdm_flower.clients.fedavg import PROX_KEY
from fedpdm_flower.fedapp.algorithms.local_sgd import model_average
from fedpdm_flower.strategies.base import Scalar
from fedpdm_flower.strategies.broadcast import BroadcastStrategy, round_diagnostics

__all__ = ["FedAvg", "FedProx", "LocalSGDStrategy"]


class LocalSGDStrategy(BroadcastStrategy):
    """Server side shared by the local-SGD baselines (FedAvg, FedProx, SCAFFOLD, FedDyn).

    For a neural network use ``eta0=0.2`` (FedDyn: also ``alpha=0.1``): on a small CNN the default eta0 = 0.04 is
    at 0.49 after 5 rounds where 0.2 reaches 0.86 (docs/models-and-data.md).

    Parameters
    ----------
    gamma
        Weight of the l1 term of objective (40); the clients add its subgradient gamma sign(x) (default 0.0).
    **kwargs
        :class:`fedpdm_flower.strategies.broadcast.BroadcastStrategy`'s arguments (eta0, max_local_steps, batch_size, uplink,
        downlink, privacy) and the federation's (fraction_train, min_available_nodes, seed, ...).
    """

    def __init__(self, *, gamma: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not (isinstance(gamma, int | float) and gamma >= 0):
            raise ValueError(f"gamma must be >= 0, got {gamma!r}")
        self.gamma = float(gamma)

    def round_config(self) -> dict[str, Scalar]:
        return {"gamma": self.gamma}


class FedAvg(LocalSGDStrategy):
    """FedAvg: broadcast x, average the uploaded local models (unweighted; element-wise when sparse)."""

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        self.x, counts = model_average([updates[p] for p in sorted(updates)], self.dim)
        return round_diagnostics(counts, metrics)


class FedProx(FedAvg):
    """FedProx: FedAvg's server; the clients add (mu/2)||x - x_0||^2.

    Parameters
    ----------
    mu
        Proximal weight (default 0.01); sent under Flower's FedProx key "proximal-mu".
    **kwargs
        :class:`LocalSGDStrategy`'s arguments.
    """

    def __init__(self, *, mu: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not (isinstance(mu, int | float) and mu >= 0):
            raise ValueError(f"mu must be >= 0, got {mu!r}")
        self.mu = float(mu)

    def round_config(self) -> dict[str, Scalar]:
        return {**super().round_config(), PROX_KEY: self.mu}
