"""FedAvg / FedProx client, and the plumbing every baseline client shares (Figs. 7-8 of arXiv 2310.19558).

FedAvg: McMahan et al., AISTATS 2017 (the DP-FedAvg of Li, Chang, Chi, MLSP 2020); FedProx: Li et al., MLSys 2020.
The math is :mod:`fedpdm_flower.fedapp.algorithms.local_sgd`; the choices marked [OURS] follow spec 6.4 / A22.

* [OURS] DP (the message's ``dp``): each mini-batch (sub)gradient ``grad f_i + gamma sign(x)`` is clipped to
  clip-norm G; the per-round epsilon is (36) inverted with q = Q b / |D_i| from the actual Q and p = K/N, exactly
  as the FedPDM client does; the sensitivity of the uploaded vector is
  ``local_sgd_sensitivity(eta, Q, G, contraction)`` (B.2; contraction 0 for FedAvg and SCAFFOLD, mu for FedProx,
  alpha for FedDyn); Gaussian noise (32) is added to the uploaded values (after sparsification) and every release
  is recorded in the client's PrivacyLedger.
* [OURS] Sparse variants (Fig. 8): the uploaded vector is top_k / rand_k sparsified with the message's k before the
  noise; the indices of top_k depend on the data and travel in the clear, the same gap as BSDP-FedPDM's (spec 4.3,
  caveat 4, A16).
* The downlink is dense x_0^t or, for the sparse variants, top_k'(x_0^t) zero-padded (k' = alpha-down d), which
  the client uses everywhere (spec A12). A message without "payload-format" carries the model's own arrays, so
  Flower's own FedAvg / FedProx (``flwr-fedavg`` / ``flwr-fedprox``) can drive this client, which then replies in
  the same arrays; FedProx's mu arrives as "proximal-mu", the key Flower's FedProx sends, and our ``fedprox``
  strategy sends the same key. The l1 weight arrives as ``gamma`` (default 0).
"""

from __future__ import annotations

from typing import Any

from numpy.typing import NDArray

from fedpdm_flower.clients.base import MessageConfig
from fedpdm_flower.clients.broadcast import BroadcastClient, Fit
from fedpdm_flower.fedapp.algorithms.local_sgd import LocalSGDResult, local_sgd
from fedpdm_flower.fedapp.layout import FloatArray
from fedpdm_flower.fedapp.privacy.gaussian import local_sgd_sensitivity

#: config key of the FedProx proximal weight mu (the key Flower's FedProx strategy sends)
PROX_KEY = "proximal-mu"

__all__ = ["PROX_KEY", "FedAvgClient", "LocalSGDClient"]


class LocalSGDClient(BroadcastClient):
    """What the baseline clients share: the local loop's settings, the DP release with the local-SGD sensitivity.

    Parameters are those of :class:`fedpdm_flower.clients.broadcast.BroadcastClient` (the user's model and data, the device's
    seed and privacy floor).
    """

    def local_steps(
        self, x0: FloatArray, server_round: int, cfg: MessageConfig, *, prox: float = 0.0,
        correction: FloatArray | None = None, linear: FloatArray | None = None,
    ) -> tuple[LocalSGDResult, float, int]:
        """Run :func:`local_sgd` on this client's data with the message's eta, gamma, b, Q cap and clip.

        Returns the local model with Q, eta^t and b.
        """
        eta, b = self.eta(cfg), self.batch_size(cfg)
        data = self.training_data(self.private(cfg))
        dpsgd = self.dpsgd_oracle(cfg)  # record-level DP-SGD steps, admitted by the device's floor before training
        max_steps = cfg.integer("max-steps", lo=1)
        if dpsgd is not None:
            max_steps = min(max_steps, dpsgd.mechanism.steps)
        res = local_sgd(
            x0, data, self.model, eta=eta, batch_size=b, max_steps=max_steps,
            clip=None if dpsgd is not None else self.clip(cfg), rng=self.rng(server_round),
            gamma=cfg.number("gamma", 0.0, lo=0.0), prox=prox, correction=correction, linear=linear, gradient=dpsgd,
        )
        return res, eta, b

    def release_local(
        self, values: FloatArray, server_round: int, cfg: MessageConfig, *, eta: float, steps: int,
        contraction: float, batch_size: int,
    ) -> tuple[FloatArray, dict[str, Any]]:
        """:meth:`BroadcastClient.release` with the local-SGD sensitivity (B.2): 2 eta G sum_r |1 - contraction eta|^r.

        `contraction` is the proximal weight of the local step: 0 (FedAvg, SCAFFOLD), mu (FedProx), alpha (FedDyn).
        """
        clip = self.clip(cfg)
        sens = local_sgd_sensitivity(eta, steps, clip, contraction) if clip is not None and self._dpsgd is None else 0.0
        return self.release(values, server_round, cfg, sensitivity=sens, steps=steps, batch_size=batch_size)

    def round_metrics(self, res: LocalSGDResult, k: int, private: bool = False) -> dict[str, Any]:
        """Q, k, the paper's uplink bits 32 k and (without DP-SGD: it would be a release outside the accountant)
        the local model's training loss."""
        out: dict[str, Any] = {"Q": res.steps, "k_up": k, "uplink_bits_paper": 32 * k}
        if not private:
            out["train_loss"] = self.data_loss(res.x)
        return out


class FedAvgClient(LocalSGDClient):
    """Q local SGD steps on f_i + gamma ||x||_1 (plus (mu/2)||x - x_0||^2 for FedProx), then upload the model."""

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        cfg = MessageConfig(config)
        server_round = cfg.integer("server-round", lo=1)
        x0 = self.receive(parameters, cfg)
        mu = cfg.number(PROX_KEY, 0.0, lo=0.0)  # 0: FedAvg
        res, eta, b = self.local_steps(x0, server_round, cfg, prox=mu)
        idx = self.uplink_indices(res.x, cfg, server_round)
        values, metrics = self.release_local(res.x[idx], server_round, cfg, eta=eta, steps=res.steps, contraction=mu,
                                             batch_size=b)
        metrics.update(self.round_metrics(res, len(idx), private="eps_dpsgd" in metrics))
        return self.finish(self.encode(idx, values), metrics)
