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

from numpy.typing import NDArray

from fedapp.algorithms.fedpdm import step_size
from fedapp.algorithms.local_sgd import LocalSGDResult, local_sgd
from fedapp.client_base import FedClient
from fedapp.compression.codec import (
    decode_vector,
)
from fedapp.compression.payload import DENSE, FORMAT_KEY, from_arrays
from fedapp.models.base import FloatArray
from fedapp.privacy.gaussian import (
    local_sgd_sensitivity,
)

#: config key of the FedProx proximal weight mu (the key Flower's FedProx strategy sends)
PROX_KEY = "proximal-mu"

Fit = tuple[list[NDArray[Any]], int, dict[str, Any]]


class LocalSGDClient(FedClient):
    """What the baseline clients share: the local loop's settings, uplink index choice, the DP release, encoding."""

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

    def release_local(
        self, values: FloatArray, server_round: int, *, eta: float, steps: int, contraction: float
    ) -> tuple[FloatArray, dict[str, Any]]:
        """:meth:`FedClient.release` with the local-SGD sensitivity (B.2): 2 eta G sum_r |1 - contraction eta|^r.

        `contraction` is the proximal weight of the local step: 0 (FedAvg, SCAFFOLD), mu (FedProx), alpha (FedDyn).
        """
        sens = local_sgd_sensitivity(eta, steps, self.cfg.clip_norm, contraction) if self.cfg.dp else 0.0
        return self.release(values, server_round, sensitivity=sens, steps=steps)

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
        values, metrics = self.release_local(res.x[idx], server_round, eta=eta, steps=res.steps, contraction=mu)
        metrics.update(self.round_metrics(res, len(idx)))
        arrays, metrics[FORMAT_KEY] = self.encode(idx, values)
        return arrays, len(self.data), metrics


class SparseFedAvgClient(FedAvgClient):
    """FedAvg / FedProx with top_k / rand_k uplink sparsification before the noise (Fig. 8, [OURS])."""

    sparse_uplink = True
