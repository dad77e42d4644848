"""DP-FedPDM (Alg. 1) and BSDP-FedPDM (Alg. 2) server side.

Li, Huang, Wang, Chi, Quek, "Privacy-preserving Federated Primal-dual Learning for Non-convex and Non-smooth
Problems with Model Sparsification", arXiv 2310.19558.

The server keeps only x_0 (dense, after the prox): no duals, no stale uploads, no error memory (spec 2.4). It works
on any model's ``ArrayRecord``; the clients (:mod:`fedpdm_flower.clients.fedpdm`) train the user's model on the user's data.
"""

from __future__ import annotations

from typing import Any

from fedpdm_flower.fedapp.algorithms.fedpdm import server_update
from fedpdm_flower.fedapp.compression.codec import FLOAT32_MAX
from fedpdm_flower.fedapp.compression.sparsify import TopK
from fedpdm_flower.fedapp.privacy.target import MISSING, require_privacy
from fedpdm_flower.strategies.base import Scalar
from fedpdm_flower.strategies.broadcast import BroadcastStrategy, round_diagnostics

__all__ = ["BSDPFedPDM", "DPFedPDM"]


class DPFedPDM(BroadcastStrategy):
    """Alg. 1: broadcast x_0, the clients run (8a)-(8d) and upload y_i, the server averages them and applies the
    l1 prox (12): x_0^{t+1} = prox_{h/rho}(mean y), h = gamma ||x||_1.

    The defaults are the paper's, for its linear model. For a neural network use ``rho=0.1, eta0=0.2, gamma=0``
    (a small CNN on MNIST: 0.86 after 5 rounds, 0.94 after 20, where the defaults stay at 0.15;
    docs/models-and-data.md).

    Parameters
    ----------
    rho
        Penalty rho of the augmented Lagrangian (default 10, Section V-C).
    gamma
        Weight of h(x) = gamma ||x||_1 (default 0.005: the paper's 0.5 makes x = 0 stationary on [0, 1] pixel
        features, docs/fedpdm.md "Deviations").
    eta0
        Step size scale, eta^t = eta0 / sqrt(1 + t) (default 0.04).
    nu
        Stopping threshold of (10) on the squared direction norm (default 0.01).
    max_local_steps
        Upper bound on Q (default 10).
    batch_size
        b (default None: each client's DataLoader batch size; the paper uses 10).
    uplink, downlink
        Sparsifiers (BSDP-FedPDM, Alg. 2): ``TopK(alpha_U)`` / ``RandK(alpha_U)`` and ``TopK(alpha_D)``; None is
        dense (DP-FedPDM).
    privacy
        Required (a DP-named strategy picks no epsilon for you):

        * :class:`fedpdm_flower.fedapp.privacy.target.PrivacyTarget` -- record-level DP-SGD: the steps of (8a) are
          DP-SGD steps on every device (Poisson sampling at ``sample_rate``, per-record clipping to ``clip_norm``,
          Gaussian noise each step), every one of the ``max_local_steps`` steps a participation may take charged
          to the device's RDP ledger; the duals, the proximal term, the sparsifiers and the noise-free upload are
          post-processing. (epsilon, delta) holds for one record of each device against everyone, the server too.
        * :class:`fedpdm_flower.fedapp.privacy.gaussian.Eq36Calibration` -- the paper's own mechanism (noise on the
          upload, calibrated by (32)/(36)): the reproduction setting; the devices report its rigorous GDP / RDP
          epsilon beside the paper's figure.
        * ``None`` -- no noise, said explicitly.
    first_round_all
        S_0 = [N]: every client in round 1 (Alg. 1 line 2; default True).
    **federation
        fraction_train (K/N), min_train_nodes, min_available_nodes, seed, ... (:class:`fedpdm_flower.strategies.base.FederatedStrategy`).

    Examples
    --------
    >>> strategy = BSDPFedPDM(fraction_train=1.0, min_available_nodes=10, uplink=TopK(0.5), downlink=TopK(0.75),
    ...                       privacy=PrivacyTarget(epsilon=8.0, sample_rate=64 / 6000))
    >>> result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=50)
    """

    def __init__(self, *, rho: float = 10.0, gamma: float = 0.005, nu: float = 0.01, first_round_all: bool = True,
                 privacy: Any = MISSING, **kwargs: Any) -> None:
        privacy = require_privacy(privacy, type(self).__name__, "Eq36Calibration(epsilon=..., delta=...)")
        super().__init__(first_round_all=first_round_all, privacy=privacy, **kwargs)
        if not (isinstance(rho, int | float) and rho > 0):
            raise ValueError(f"rho must be > 0, got {rho!r}")
        if not (isinstance(gamma, int | float) and gamma >= 0):
            raise ValueError(f"gamma must be >= 0, got {gamma!r}")
        if not (isinstance(nu, int | float) and nu >= 0):
            raise ValueError(f"nu must be >= 0, got {nu!r}")
        if gamma > 0 and not gamma / rho < FLOAT32_MAX:  # the mean of float32 uploads never exceeds FLOAT32_MAX
            raise ValueError(f"gamma / rho = {gamma:g} / {rho:g} = {gamma / rho:.3g} is beyond the float32 range of the "
                             "uploads: the prox (12) would set every coordinate to 0; raise rho or lower gamma")
        self.rho, self.gamma, self.nu = float(rho), float(gamma), float(nu)

    def round_config(self) -> dict[str, Scalar]:
        """rho and nu of (8a)-(10)."""
        return {"rho": self.rho, "nu": self.nu}

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """(12) / (20): prox of the element-wise mean over the clients that sent each coordinate."""
        self.x, counts = server_update([updates[p] for p in sorted(updates)], self.dim, self.gamma, self.rho)
        return round_diagnostics(counts, metrics)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "rho": self.rho, "gamma": self.gamma, "nu": self.nu}


class BSDPFedPDM(DPFedPDM):
    """Alg. 2: DP-FedPDM with a sparse uplink (top_k / rand_k, k = alpha_U d) and a top_k' downlink
    (k' = alpha_D d). Defaults ``uplink=TopK(0.5)``, ``downlink=TopK(0.75)`` (this project's quick start)."""

    def __init__(self, *, uplink: TopK | None = None, downlink: TopK | None = None, **kwargs: Any) -> None:
        super().__init__(uplink=uplink if uplink is not None else TopK(0.5),
                         downlink=downlink if downlink is not None else TopK(0.75), **kwargs)
