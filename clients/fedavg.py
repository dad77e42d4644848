"""FedAvg / FedProx client, and the plumbing every baseline client shares (Figs. 7-8 of arXiv 2310.19558).

FedAvg: McMahan et al., AISTATS 2017 (the DP-FedAvg of Li, Chang, Chi, MLSP 2020); FedProx: Li et al., MLSys 2020.
The math is :mod:`fedapp.algorithms.local_sgd`; the choices marked [OURS] follow spec 6.4 / A22.

* [OURS] DP (run config ``dp``): each mini-batch (sub)gradient ``grad f_i + gamma sign(x)`` is clipped to
  clip-norm G; the per-round epsilon is (36) inverted with q = Q b / |D_i| from the actual Q and p = K/N, exactly
  as the FedPDM client does; the sensitivity of the uploaded vector is
  ``local_sgd_sensitivity(eta, Q, G, contraction)`` (B.2; contraction 0 for FedAvg and SCAFFOLD, mu for FedProx,
  alpha for FedDyn); Gaussian noise (32) is added to the uploaded values (after sparsification) and every release
  is recorded in the client's PrivacyLedger.
* [OURS] Sparse variants (Fig. 8): the uploaded vector is top_k / rand_k sparsified with k = alpha-up d before the
  noise; the indices of top_k depend on the data and travel in the clear, the same gap as BSDP-FedPDM's (spec 4.3,
  caveat 4, A16).
* The downlink is dense x_0^t or, for the sparse variants, top_k'(x_0^t) zero-padded (k' = alpha-down d), which
  the client uses everywhere (spec A12). A message without "payload-format" is dense, so Flower's own FedAvg /
  FedProx (``flwr-fedavg`` / ``flwr-fedprox``) can drive this client; FedProx's mu arrives as "proximal-mu", the key
  Flower's FedProx sends, and our ``fedprox`` strategy sends the same key.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedapp.algorithms.fedpdm import step_size
from fedapp.algorithms.local_sgd import LocalSGDResult, local_sgd
from fedapp.client_base import FedClient
from fedapp.compression.codec import (
    SparseVector,
    decode_vector,
    encode_dense,
    encode_sparse,
)
from fedapp.compression.payload import DENSE, FORMAT_KEY, from_arrays, to_arrays
from fedapp.compression.sparsify import rand_k, resolve_k, top_k
from fedapp.models.base import FloatArray
from fedapp.privacy.gaussian import (
    add_gaussian_noise,
    data_fraction,
    gaussian_noise_std,
    local_sgd_sensitivity,
    per_round_epsilon_eq36,
    total_privacy_eq36,
)

#: config key of the FedProx proximal weight mu (the key Flower's FedProx strategy sends)
PROX_KEY = "proximal-mu"
_NOISE, _RANDK = 1, 2  # RNG streams; stream 0 draws the mini-batch permutation

Fit = tuple[list[NDArray[Any]], int, dict[str, Any]]


class LocalSGDClient(FedClient):
    """What the baseline clients share: the local loop's settings, uplink index choice, the DP release, encoding."""

    #: False: the dense vector on the wire; True: k = alpha_U d values plus their indices (the "-sparse" keys)
    sparse_uplink = False

    def receive(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> FloatArray:
        """The broadcast model, dense or zero-padded top_k' (no "payload-format" means dense)."""
        return decode_vector(from_arrays(parameters, config.get(FORMAT_KEY, DENSE)), self.model.dim).to_dense()

    def local_steps(
        self, x0: FloatArray, server_round: int, *, prox: float = 0.0, correction: FloatArray | None = None,
        linear: FloatArray | None = None,
    ) -> tuple[LocalSGDResult, float]:
        """Run :func:`local_sgd` on this client's data with the run's gamma, b, Q cap and clipping (DP only).

        Parameters
        ----------
        x0
            The received model.
        server_round
            Flower's 1-based round; eta^t = eta0 / sqrt(1 + t) with t = server_round - 1.
        prox, correction, linear
            As in :func:`local_sgd` (defaults 0.0, None, None).

        Returns
        -------
        tuple[LocalSGDResult, float]
            The local model with Q, and eta^t.
        """
        cfg = self.cfg
        eta = step_size(cfg.eta0, server_round - 1)
        res = local_sgd(
            x0, self.data.x, self.data.y, self.model, eta=eta, batch_size=cfg.batch_size,
            max_steps=cfg.max_local_steps, clip=cfg.clip_norm if cfg.dp else None, rng=self.rng(server_round),
            gamma=cfg.gamma, prox=prox, correction=correction, linear=linear,
        )
        return res, eta

    def uplink_indices(self, v: FloatArray, server_round: int) -> NDArray[np.int64]:
        """All d indices, or top_k(v) / rand_k (k = alpha_U d, ascending) for the sparse variants."""
        d = self.model.dim
        if not self.sparse_uplink:
            return np.arange(d, dtype=np.int64)
        k = resolve_k(self.cfg.alpha_up, d)
        return top_k(v, k) if self.cfg.uplink_sparsifier == "topk" else rand_k(d, k, self.rng(server_round, _RANDK))

    def release(
        self, values: FloatArray, server_round: int, *, eta: float, steps: int, contraction: float
    ) -> tuple[FloatArray, dict[str, Any]]:
        """Gaussian mechanism on the uploaded values when DP is on; the values unchanged and no metrics otherwise.

        (36) inverted for the round's epsilon with q from the actual Q (spec A3) and p = K/N, sensitivity
        ``local_sgd_sensitivity(eta, Q, G, contraction)``, noise std (32), then the ledger and the same privacy
        metrics as the FedPDM client ("q", "eps_round", "sigma", "eps_eq36", "eps_rdp", "eps_basic", ...).

        Parameters
        ----------
        values
            The (possibly sparsified) uploaded values.
        server_round
            Flower's 1-based round (seeds the noise; rounds seen so far for (36)).
        eta
            The round's step size.
        steps
            Local steps Q actually taken.
        contraction
            Proximal weight of the local step (0, mu or alpha), see ``local_sgd_sensitivity``.

        Returns
        -------
        tuple[FloatArray, dict[str, Any]]
            The released values and the privacy metrics ({} with DP off).
        """
        cfg = self.cfg
        if not cfg.dp:
            return values, {}
        q = data_fraction(steps, cfg.batch_size, len(self.data))
        p = cfg.clients_per_round / cfg.num_clients
        eps_round = per_round_epsilon_eq36(cfg.epsilon_total, cfg.c0, q, p, cfg.horizon, q_power=cfg.privacy_q_power)
        sens = local_sgd_sensitivity(eta, steps, cfg.clip_norm, contraction)
        sigma = gaussian_noise_std(sens, eps_round, cfg.delta)
        noisy = add_gaussian_noise(values, sigma, self.rng(server_round, _NOISE))
        ledger = self.load_ledger()
        ledger.record(eps_round, sigma / sens)
        self.save_ledger(ledger)
        eps_basic, delta_basic = ledger.basic_composition()
        return noisy, {
            "q": q, "eps_round": eps_round, "sensitivity": sens, "sigma": sigma,
            "eps_round_gt_1": int(eps_round > 1.0),  # Lemma 1 needs eps < 1 (spec caveat 1)
            "eps_eq36": total_privacy_eq36(eps_round, cfg.c0, q, p, min(server_round, cfg.horizon), q_power=cfg.privacy_q_power),
            "eps_rdp": ledger.rdp_epsilon(cfg.delta),
            "eps_basic": eps_basic, "delta_basic": delta_basic,
            "participations": len(ledger.eps_rounds),
        }

    def encode(self, idx: NDArray[np.int64], values: FloatArray) -> tuple[list[NDArray[Any]], int]:
        """Codec arrays and format code of the upload: dense, or (values, indices) for the sparse variants."""
        if self.sparse_uplink:
            return to_arrays(encode_sparse(SparseVector(indices=idx, values=values, dim=self.model.dim)))
        return to_arrays(encode_dense(values))

    def round_metrics(self, res: LocalSGDResult, k: int) -> dict[str, Any]:
        """Q, k, the paper's uplink bits 32 k and the local model's training loss."""
        return {"Q": res.steps, "k_up": k, "uplink_bits_paper": 32 * k,
                "train_loss": self.model.loss(res.x, self.data.x, self.data.y)}


class FedAvgClient(LocalSGDClient):
    """Q local SGD steps on f_i + gamma ||x||_1 (plus (mu/2)||x - x_0||^2 for FedProx), then upload the model."""

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        server_round = int(config["server-round"])
        x0 = self.receive(parameters, config)
        mu = float(config.get(PROX_KEY, 0.0))  # 0: FedAvg
        res, eta = self.local_steps(x0, server_round, prox=mu)
        idx = self.uplink_indices(res.x, server_round)
        values, metrics = self.release(res.x[idx], server_round, eta=eta, steps=res.steps, contraction=mu)
        metrics.update(self.round_metrics(res, len(idx)))
        arrays, metrics[FORMAT_KEY] = self.encode(idx, values)
        return arrays, len(self.data), metrics


class SparseFedAvgClient(FedAvgClient):
    """FedAvg / FedProx with top_k / rand_k uplink sparsification before the noise (Fig. 8, [OURS])."""

    sparse_uplink = True
