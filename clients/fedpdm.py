"""DP-FedPDM / BSDP-FedPDM client (Li et al., arXiv 2310.19558, Alg. 1 lines 4-12 and Alg. 2 lines 1-6).

State in `context.state`: the dual lambda_i (float64, zero-initialised, spec A9) and the privacy ledger. x_i is not
persisted: every round restarts from the received global model (spec A15).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedapp.algorithms.fedpdm import local_update, step_size
from fedapp.client_base import FedClient
from fedapp.compression.codec import FLOAT32_MAX, decode_vector
from fedapp.compression.payload import FORMAT_KEY, from_arrays
from fedapp.privacy.gaussian import fedpdm_sensitivity

DUAL = "fedpdm.dual"


class FedPDMClient(FedClient):
    """One round of (8a)-(8d), then sparsify (18), add Gaussian noise (11)/(19) and upload.

    `sparse_uplink` False is DP-FedPDM (dense y on the wire); True is BSDP-FedPDM (k = alpha_U d values + indices).
    """

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        cfg, d = self.cfg, self.model.dim
        server_round = int(config["server-round"])
        # Downlink: dense x_0^t, or the top_k' sparse model xhat_0^t zero-padded (Alg. 2 lines 1-2); the client uses
        # what it received everywhere, in (8a), (10) and (8c) (spec A12).
        x0 = decode_vector(from_arrays(parameters, config.get(FORMAT_KEY, 0)), d).to_dense()
        dual = self.load_vector(DUAL)
        if dual is None:
            dual = np.zeros(d)
        eta = step_size(cfg.eta0, server_round - 1)  # t is the paper's 0-based round index
        res = local_update(
            x0, dual, self.data.x, self.data.y, self.model, eta=eta, rho=cfg.rho, nu=cfg.nu,
            batch_size=cfg.batch_size, max_steps=cfg.max_local_steps, clip=cfg.clip_norm if cfg.dp else None,
            rng=self.rng(server_round),
        )
        largest = float(np.max(np.abs(res.y)))
        if not largest <= FLOAT32_MAX:  # NaN fails this too
            raise ValueError(f"local training diverged: |y| reached {largest:.3g} (float32 range {FLOAT32_MAX:.3g}) "
                             f"after {res.steps} step(s) of size eta = {eta:g}; lower eta0 ({cfg.eta0:g})")
        self.save_vector(DUAL, res.dual)
        idx = self.uplink_indices(res.y, server_round)  # (18)
        values, metrics = self.release(
            res.y[idx], server_round, sensitivity=fedpdm_sensitivity(eta, cfg.rho, res.steps, cfg.clip_norm),
            steps=res.steps,
        )
        metrics.update({
            "Q": res.steps,
            "stopped_by_nu": int(res.stopped_by_nu),
            "final_dir_sqnorm": res.final_dir_sqnorm,
            "k_up": len(idx),
            "uplink_bits_paper": 32 * len(idx),
            "train_loss": self.model.loss(res.x, self.data.x, self.data.y),
            "primal_residual": float(np.linalg.norm(res.x - x0)),
            "dual_norm": float(np.linalg.norm(res.dual)),
        })
        arrays, metrics[FORMAT_KEY] = self.encode(idx, values)
        return arrays, len(self.data), metrics


class BSDPFedPDMClient(FedPDMClient):
    """BSDP-FedPDM: top_k / rand_k uplink sparsification before the noise (Alg. 2)."""

    sparse_uplink = True
