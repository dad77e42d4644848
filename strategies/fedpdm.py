"""DP-FedPDM (Alg. 1) and BSDP-FedPDM (Alg. 2) server side.

Li, Huang, Wang, Chi, Quek, "Privacy-preserving Federated Primal-dual Learning for Non-convex and Non-smooth
Problems with Model Sparsification", arXiv 2310.19558.

The server keeps only x_0 (dense, after the prox): no duals, no stale uploads, no error memory (spec 2.4).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedapp.algorithms.fedpdm import server_update
from fedapp.compression.codec import SparseVector, decode_vector, encode_dense, encode_sparse
from fedapp.compression.payload import FORMAT_KEY, from_arrays, to_arrays
from fedapp.compression.sparsify import resolve_k, top_k
from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.sampling import STREAM_INIT, rng_for
from fedapp.strategy_base import FederatedStrategy, Scalar
from fedapp.task import Evaluator, build_model


class DPFedPDM(FederatedStrategy):
    """Alg. 1: broadcast x_0, average the noisy y's, soft-threshold at gamma/rho (12).

    Parameters
    ----------
    cfg
        Run config: rho, gamma (l1 weight of h), eta0, nu, max-local-steps, dp, epsilon-total, delta, clip-norm,
        c0, num-clients N, clients-per-round K, first-round-all (S_0 = [N]), seed, init-std.
    evaluator
        Central test-set evaluation.
    """

    sparse = False

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None) -> None:
        self.dim = build_model(cfg).dim
        self._downlink: tuple[int, list[NDArray[Any]], int] | None = None
        super().__init__(cfg, evaluator)

    def initial_model(self) -> FloatArray:
        """x_0^0 ~ N(0, init_std^2) i.i.d. (spec A9), seeded."""
        return rng_for(self.cfg.seed, STREAM_INIT).normal(0.0, self.cfg.init_std, size=self.dim)

    def downlink_vector(self) -> SparseVector:
        """What the clients receive: x_0 (Alg. 1) or top_k'(x_0) (Alg. 2, eq. 27)."""
        d = self.dim
        k = resolve_k(self.cfg.alpha_down, d) if self.sparse else d
        idx = top_k(self.x, k) if k < d else np.arange(d)
        return SparseVector(indices=idx.astype(np.int64), values=self.x[idx], dim=d)

    def client_payload(self, server_round: int, partition_id: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        if self._downlink is None or self._downlink[0] != server_round:  # encode once per round, send to all
            v = self.downlink_vector()
            enc = encode_sparse(v) if self.sparse and len(v.indices) < self.dim else encode_dense(v.to_dense())
            arrays, code = to_arrays(enc)
            self._downlink = (server_round, arrays, code)
        _, arrays, code = self._downlink
        return arrays, {FORMAT_KEY: code}

    def decode_update(self, server_round: int, partition_id: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> SparseVector:
        k = resolve_k(self.cfg.alpha_up, self.dim) if self.sparse else self.dim
        v = decode_vector(from_arrays(arrays, metrics.get(FORMAT_KEY)), self.dim, max_k=k)
        if len(v.indices) != k:
            raise ValueError(f"expected k={k} uploaded values, got {len(v.indices)}")
        return v

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """(12) / (20): prox of the element-wise mean over the clients that sent each coordinate."""
        self.x, counts = server_update([updates[p] for p in sorted(updates)], self.dim, self.cfg.gamma, self.cfg.rho)
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


class BSDPFedPDM(DPFedPDM):
    """Alg. 2: sparse uplink (top_k / rand_k, k = alpha_U d) and top_k' downlink (k' = alpha_D d)."""

    sparse = True
