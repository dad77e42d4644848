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
from fedapp.compression.codec import SparseVector, decode_vector, encode_dense, encode_sparse
from fedapp.compression.payload import FORMAT_KEY, from_arrays, to_arrays
from fedapp.compression.sparsify import rand_k, resolve_k, top_k
from fedapp.privacy.gaussian import (
    add_gaussian_noise,
    data_fraction,
    fedpdm_sensitivity,
    gaussian_noise_std,
    per_round_epsilon_eq36,
    total_privacy_eq36,
)

DUAL = "fedpdm.dual"
_NOISE, _RANDK = 1, 2  # RNG streams; stream 0 draws the mini-batch permutation


class FedPDMClient(FedClient):
    """One round of (8a)-(8d), then sparsify (18), add Gaussian noise (11)/(19) and upload."""

    #: False for DP-FedPDM (dense y on the wire), True for BSDP-FedPDM (k = alpha_U d values + indices)
    sparse_uplink = False

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        cfg, d = self.cfg, self.model.dim
        server_round = int(config["server-round"])
        t = server_round - 1  # the paper's 0-based round index
        # Downlink: dense x_0^t, or the top_k' sparse model xhat_0^t zero-padded (Alg. 2 lines 1-2).
        x0 = decode_vector(from_arrays(parameters, config.get(FORMAT_KEY, 0)), d).to_dense()
        dual = self.load_vector(DUAL)
        if dual is None:
            dual = np.zeros(d)
        eta = step_size(cfg.eta0, t)
        res = local_update(
            x0, dual, self.data.x, self.data.y, self.model, eta=eta, rho=cfg.rho, nu=cfg.nu,
            batch_size=cfg.batch_size, max_steps=cfg.max_local_steps, clip=cfg.clip_norm if cfg.dp else None,
            rng=self.rng(server_round),
        )
        self.save_vector(DUAL, res.dual)

        # Uplink sparsification (18): indices ascending, so alpha_U = 1 equals the dense path (spec 10.12).
        if self.sparse_uplink:
            k = resolve_k(cfg.alpha_up, d)
            idx = top_k(res.y, k) if cfg.uplink_sparsifier == "topk" else rand_k(d, k, self.rng(server_round, _RANDK))
        else:
            k, idx = d, np.arange(d)
        values = res.y[idx]

        metrics: dict[str, Any] = {
            "Q": res.steps,
            "stopped_by_nu": int(res.stopped_by_nu),
            "final_dir_sqnorm": res.final_dir_sqnorm,
            "k_up": k,
            "uplink_bits_paper": 32 * k,
            "train_loss": self.model.loss(res.x, self.data.x, self.data.y),
            "primal_residual": float(np.linalg.norm(res.x - x0)),
            "dual_norm": float(np.linalg.norm(res.dual)),
        }
        if cfg.dp:
            # (36) inverted for this round's epsilon, (35) sensitivity, (32) noise std; q from the actual Q (spec A3).
            q = data_fraction(res.steps, cfg.batch_size, len(self.data))
            p = cfg.clients_per_round / cfg.num_clients
            eps_round = per_round_epsilon_eq36(cfg.epsilon_total, cfg.c0, q, p, cfg.horizon, q_power=cfg.privacy_q_power)
            sens = fedpdm_sensitivity(eta, cfg.rho, res.steps, cfg.clip_norm)
            sigma = gaussian_noise_std(sens, eps_round, cfg.delta)
            values = add_gaussian_noise(values, sigma, self.rng(server_round, _NOISE))  # (11)/(19)
            ledger = self.load_ledger()
            ledger.record(eps_round, sigma / sens)
            self.save_ledger(ledger)
            eps_basic, delta_basic = ledger.basic_composition()
            metrics.update({
                "q": q, "eps_round": eps_round, "sensitivity": sens, "sigma": sigma,
                "eps_round_gt_1": int(eps_round > 1.0),  # Lemma 1 needs eps < 1 (spec caveat 1)
                "eps_eq36": total_privacy_eq36(eps_round, cfg.c0, q, p, min(server_round, cfg.horizon), q_power=cfg.privacy_q_power),
                "eps_rdp": ledger.rdp_epsilon(cfg.delta),
                "eps_basic": eps_basic, "delta_basic": delta_basic,
                "participations": len(ledger.eps_rounds),
            })
        if self.sparse_uplink:
            encoded = encode_sparse(SparseVector(indices=idx.astype(np.int64), values=values, dim=d))
        else:
            encoded = encode_dense(values)
        arrays, code = to_arrays(encoded)
        metrics[FORMAT_KEY] = code
        return arrays, len(self.data), metrics


class BSDPFedPDMClient(FedPDMClient):
    """BSDP-FedPDM: top_k / rand_k uplink sparsification before the noise (Alg. 2)."""

    sparse_uplink = True
