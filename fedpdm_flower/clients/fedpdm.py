"""DP-FedPDM / BSDP-FedPDM client (Li et al., arXiv 2310.19558, Alg. 1 lines 4-12 and Alg. 2 lines 1-6).

State in ``context.state``: the dual lambda_i (float64, zero-initialised, spec A9) and the privacy ledger. x_i is
not persisted: every round restarts from the received global model (spec A15). Works on the flat parameters of
any model: a torch ``nn.Module`` with a loss, or a numpy model with ``grad`` / ``loss`` (the paper's eq. (41)
non-convex logistic regression is one).

Message config (besides :mod:`fedpdm_flower.clients.broadcast`'s): ``rho`` (> 0) and ``nu`` (>= 0) of (8a)-(10).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.clients.base import MessageConfig
from fedpdm_flower.clients.broadcast import BroadcastClient, Fit
from fedpdm_flower.fedapp.algorithms.fedpdm import local_update
from fedpdm_flower.fedapp.compression.codec import FLOAT32_MAX
from fedpdm_flower.fedapp.privacy.gaussian import fedpdm_sensitivity

DUAL = "fedpdm.dual"

__all__ = ["BSDPFedPDMClient", "FedPDMClient"]


class FedPDMClient(BroadcastClient):
    """One round of (8a)-(8d), then sparsify (18), add Gaussian noise (11)/(19) and upload y_i.

    Parameters
    ----------
    model
        The user's model: a torch ``nn.Module`` (with ``loss_fn``) or a numpy model object with ``dim``,
        ``grad(x, inputs, targets)`` and ``loss(x, inputs, targets)``. BatchNorm trains without DP (its running
        statistics travel beside (8a)'s x, :mod:`fedpdm_flower.clients.base`); a private round refuses it.
    data
        The local data D_i: ``(x, y)`` arrays or a torch ``Dataset`` / ``DataLoader`` (mini-batches are drawn by
        the algorithm: consecutive slices of one permutation per round, Thm. 2's sampling; without DP the
        permutation is of one pass of the loader's own sampler, if it has one).
    loss_fn
        The torch model's loss (default cross-entropy); f_i is its mean over a mini-batch.
    context
        The node's Flower Context (bound per message by :meth:`client_app`).
    seed
        The device's seed for batch order and noise (None: OS entropy).
    max_epsilon
        The device's privacy floor (see :class:`fedpdm_flower.clients.broadcast.BroadcastClient`).
    test_data, test_fn
        Flower's federated evaluation (:meth:`fedpdm_flower.clients.base.FedClient.evaluate`).

    Examples
    --------
    >>> def client_fn(context):
    ...     return FedPDMClient(Net(), train_loader, loss_fn=nn.CrossEntropyLoss(), max_epsilon=10.0)
    >>> app = FedPDMClient.client_app(client_fn)
    """

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        """Alg. 1 lines 4-12 (Alg. 2 lines 1-6 with a sparse downlink / uplink)."""
        cfg = MessageConfig(config)
        server_round = cfg.integer("server-round", lo=1)
        # Downlink: dense x_0^t, or the top_k' sparse model xhat_0^t zero-padded (Alg. 2 lines 1-2); the client uses
        # what it received everywhere, in (8a), (10) and (8c) (spec A12).
        private = self.private(cfg)
        x0 = self.receive(parameters, cfg)
        rho = cfg.number("rho", lo=0.0, lo_open=True)
        eta, clip, b = self.eta(cfg), self.clip(cfg), self.batch_size(cfg)
        dual = self.load_vector(DUAL)
        if dual is None or dual.shape != x0.shape:
            dual = np.zeros(self.model.dim)
        # record-level DP-SGD: the steps of (8a) are DP-SGD steps (admitted by the device's floor before training);
        # the dual, the proximal pull, (10), (8c), (8d), the sparsifier and the upload are post-processing
        dpsgd = self.dpsgd_oracle(cfg)
        max_steps = cfg.integer("max-steps", lo=1)
        if dpsgd is not None:
            max_steps = min(max_steps, dpsgd.mechanism.steps)
        res = local_update(
            x0, dual, self.training_data(private), self.model, eta=eta, rho=rho, nu=cfg.number("nu", lo=0.0),
            batch_size=b, max_steps=max_steps, clip=None if dpsgd is not None else clip, rng=self.rng(server_round),
            gradient=dpsgd,
        )
        largest = float(np.max(np.abs(res.y)))
        if not largest <= FLOAT32_MAX:  # NaN fails this too; nothing is sent, the dual is not saved
            raise ValueError(f"local training diverged: |y| reached {largest:.3g} (float32 range {FLOAT32_MAX:.3g}) "
                             f"after {res.steps} step(s) of size eta = {eta:g}; lower the strategy's eta0")
        self.save_vector(DUAL, res.dual)
        idx = self.uplink_indices(res.y, cfg, server_round)  # (18)
        sens = fedpdm_sensitivity(eta, rho, res.steps, clip) if clip is not None and dpsgd is None else 0.0
        values, metrics = self.release(res.y[idx], server_round, cfg, sensitivity=sens, steps=res.steps, batch_size=b)
        metrics.update({
            "Q": res.steps,
            "stopped_by_nu": int(res.stopped_by_nu),
            "final_dir_sqnorm": res.final_dir_sqnorm,
            "k_up": len(idx),
            "uplink_bits_paper": 32 * len(idx),
            "primal_residual": float(np.linalg.norm(res.x - x0)),
            "dual_norm": float(np.linalg.norm(res.dual)),
        })
        if dpsgd is None:  # under DP-SGD the loss on the raw records would be a release outside the accountant
            metrics["train_loss"] = self.data_loss(res.x)
        return self.finish(self.encode(idx, values), metrics)


class BSDPFedPDMClient(FedPDMClient):
    """BSDP-FedPDM's client: the same code (the message says which uplink sparsifier to apply, Alg. 2)."""
