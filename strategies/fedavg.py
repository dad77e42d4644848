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

import numpy as np
from numpy.typing import NDArray

from clients.fedavg import PROX_KEY
from fedapp.algorithms.local_sgd import model_average
from fedapp.compression.codec import (
    SparseVector,
    decode_vector,
    encode_dense,
    encode_sparse,
)
from fedapp.compression.payload import FORMAT_KEY, from_arrays, to_arrays
from fedapp.compression.sparsify import resolve_k, top_k
from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.sampling import STREAM_INIT, rng_for
from fedapp.strategy_base import FederatedStrategy, Scalar
from fedapp.task import Evaluator, build_model


class LocalSGDStrategy(FederatedStrategy):
    """Shared server plumbing of the baselines: x_0^0, the (top_k') downlink, decoding, round diagnostics.

    Parameters
    ----------
    cfg
        Run config: num-clients N, clients-per-round K, first-round-all, seed, init-std, and for the sparse
        variants alpha-up / alpha-down.
    evaluator
        Central test-set evaluation; None skips it (default None).
    """

    #: False: dense downlink and uploads; True: top_k' downlink and k = alpha_U d uploaded entries (the "-sparse" keys)
    sparse = False

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None) -> None:
        self.dim = build_model(cfg).dim
        self._downlink: tuple[int, list[NDArray[Any]], int] | None = None
        super().__init__(cfg, evaluator)

    def initial_model(self) -> FloatArray:
        """x_0^0 ~ N(0, init_std^2) i.i.d., seeded (the same start as DP-FedPDM, spec A9)."""
        return rng_for(self.cfg.seed, STREAM_INIT).normal(0.0, self.cfg.init_std, size=self.dim)

    @property
    def upload_k(self) -> int:
        """Number of entries each client uploads: alpha_U d for the sparse variants, else d."""
        return resolve_k(self.cfg.alpha_up, self.dim) if self.sparse else self.dim

    def downlink_indices(self) -> NDArray[np.int64]:
        """All d indices, or the indices of top_k'(x) (k' = alpha_D d) for the sparse variants."""
        d = self.dim
        k = resolve_k(self.cfg.alpha_down, d) if self.sparse else d
        return top_k(self.x, k) if k < d else np.arange(d, dtype=np.int64)

    def encode_downlink(self, idx: NDArray[np.int64]) -> tuple[list[NDArray[Any]], int]:
        """Codec arrays and format code of x at ``idx`` (sparse only when fewer than d entries)."""
        v = SparseVector(indices=idx, values=self.x[idx], dim=self.dim)
        return to_arrays(encode_sparse(v) if len(idx) < self.dim else encode_dense(v.to_dense()))

    def round_config(self) -> dict[str, Scalar]:
        """Algorithm-specific config sent with the model (none for FedAvg)."""
        return {}

    def client_payload(self, server_round: int, partition_id: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        if self._downlink is None or self._downlink[0] != server_round:  # encode once per round, send to all
            arrays, code = self.encode_downlink(self.downlink_indices())
            self._downlink = (server_round, arrays, code)
        _, arrays, code = self._downlink
        return arrays, {FORMAT_KEY: code, **self.round_config()}

    def decode_update(self, server_round: int, partition_id: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        k = self.upload_k
        v = decode_vector(from_arrays(arrays, metrics.get(FORMAT_KEY)), self.dim, max_k=k)
        if v.k != k:
            raise ValueError(f"expected k={k} uploaded values, got {v.k}")
        return v

    def diagnostics(self, counts: NDArray[np.int64], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Coverage of the aggregated coordinates, mean Q and training loss, and mean sigma / eps_round under DP."""
        diag = {
            "coverage": float(np.mean(counts > 0)),
            "mean_Q": float(np.mean([m.get("Q", np.nan) for m in metrics.values()])),
            "mean_train_loss": float(np.mean([m.get("train_loss", np.nan) for m in metrics.values()])),
        }
        sig = [m["sigma"] for m in metrics.values() if "sigma" in m]
        if sig:
            diag["mean_sigma"] = float(np.mean(sig))
            diag["mean_eps_round"] = float(np.mean([m["eps_round"] for m in metrics.values()]))
        return diag


class FedAvg(LocalSGDStrategy):
    """FedAvg: broadcast x, average the uploaded local models (unweighted; element-wise when sparse)."""

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        self.x, counts = model_average([updates[p] for p in sorted(updates)], self.dim)
        return self.diagnostics(counts, metrics)


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
