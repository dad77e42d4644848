"""Secure aggregation with distributed noise: the server sees only buffer sums, each already carrying DP noise.

:class:`DistributedDP` is :class:`fedpdm_flower.strategies.wrappers.SecureBuffers` with the distributed Skellam mechanism
(Agarwal, Kairouz & Liu, NeurIPS 2021; math in :mod:`fedpdm_flower.fedapp.privacy.skellam`, device side in
:class:`fedpdm_flower.clients.distributed_dp.DeviceSkellam` through :func:`fedpdm_flower.clients.mods.secure_buffers_mod`). Each round every
device clips its update ``w_k - w`` to L2 norm C, encodes it on the secure aggregation's ring (scale gamma,
conditional randomized rounding) and adds its share of Skellam noise; the masks cancel in the buffer's sum, which
then carries Skellam noise of variance >= (z D2)^2 per coordinate (D2 the rounded L2 sensitivity in integer units).
The server decodes the sum, divides by gamma and by the survivors' count, and the inner strategy averages the
buffer means as usual.

**Unit**: one client (its whole update, clipped to C), under the zero-out relation (the client's update replaced by
zero; it still takes part, so the noise is the same in both worlds), passed to Flower's protocol as
ADD_OR_REMOVE_ONE, whose sensitivity it is.

**Adversary**: the server and everyone who sees the models. The server never sees an update alone (masks), and
every buffer sum it can unmask has at least t survivors (the self-mask seeds are shared t-of-s), so it carries at
least t shares of ``Sk((z D2)^2 / (2 t))``: the full noise, by the closure of Skellam under sums. **Collusion**:
a buffer-mate colluding with the server knows its own share and can subtract it; with c colluders among t
survivors only t - c honest shares remain, a variance of (t - c) / t of the target. A device's ``max_colluders = c``
calibrates its share to t - c shares instead, restoring the full noise against c colluders (at the price of more
noise when nobody colludes). The guarantee assumes the devices' policies are honest and their noise secret; and,
as for SecureBuffers, that the trust stores name real devices (a server that forges members breaks both).

**Accountant**: :class:`fedpdm_flower.fedapp.privacy.SkellamAccountant` (the Skellam RDP bound composed over rounds,
Flower's protocol); z is calibrated to (epsilon, delta) over ``num_rounds`` rounds. No amplification by sampling
is claimed: the server chooses who takes part and sees it. The run stops with Flower's ``PrivacyBudgetExhausted``
before a round past the target; a round counts as a release as soon as its mask requests go out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from numpy.typing import NDArray

from fedpdm_flower.clients.distributed_dp import DDP_BETA, DDP_CLIP, DDP_SCALE, DDP_Z
from fedpdm_flower.fedapp.layout import FloatArray
from fedpdm_flower.fedapp.privacy import skellam
from fedpdm_flower.fedapp.privacy.protocol import SkellamAccountant, SkellamPrivacyEvent, no_amplification
from fedpdm_flower.strategies.wrappers import _TOTAL_WEIGHT, SecureBuffers, _weight_value

__all__ = ["DistributedDP"]

#: a decoded coordinate this close to the ring's edge is taken as a possible wrap: the buffer is discarded
EDGE = 2**31 - 2**27


class DistributedDP(SecureBuffers):
    """SecureBuffers with the distributed Skellam mechanism (module docstring).

    **The model mean is unweighted**: every client's clipped update counts once, whatever its ``num-examples``. The
    sensitivity C bounds one client's contribution, and a weight released without noise would fall outside the
    guarantee; Flower's own DP wrappers require uniform weights for accounting likewise. The clients' train metrics
    keep FedAvg's weighting (weighted sums inside the masks, as :class:`SecureBuffers` carries them), released as
    buffer aggregates **without noise, outside the (epsilon, delta) guarantee** -- as Flower's DP wrappers say of
    theirs ("training and evaluation metrics are not included"). A device that must not release them returns none
    from its train function but its weight.

    Parameters
    ----------
    inner
        The wrapped strategy (Flower's FedAvg convention), e.g. Flower's ``FedAvg``.
    epsilon, delta
        The target: over ``num_rounds`` rounds the released buffer sums (and so the models) are (epsilon, delta)-DP
        for one client.
    num_rounds
        T, the rounds z is calibrated for; the run stops before round T + 1.
    clip_norm
        C, the L2 bound of each client's update (default 1.0).
    buffer_size, threshold, seed, timeout
        As :class:`SecureBuffers`.
    max_colluders
        The colluders the devices guard against (default 0): only used here to size the ring's headroom; each
        device's own ``DeviceSkellam(max_colluders=...)`` sets its share.
    noise_multiplier
        z directly instead of calibrating it (``epsilon`` stays the budget the run stops at); 0 asks the devices for
        no noise (no privacy; a device with a floor refuses).
    scale
        gamma; None: the largest that keeps the noisy sum of a buffer of s + 1 off the ring's edge.
    beta
        The conditional rounding's parameter (default e^-0.5).
    """

    weighted_model = False

    def __init__(self, inner: Strategy, *, epsilon: float, delta: float = 1e-5, num_rounds: int,
                 clip_norm: float = 1.0, buffer_size: int = 4, threshold: int | None = None, max_colluders: int = 0,
                 noise_multiplier: float | None = None, scale: float | None = None,
                 beta: float = skellam.DEFAULT_BETA, seed: int | None = None, timeout: float | None = None) -> None:
        super().__init__(inner, buffer_size, threshold=threshold, seed=seed, timeout=timeout)
        self.secure.count_clipped = False  # the devices encode their vectors themselves (clipped by the DP clip norm)
        for name, v in (("epsilon", epsilon), ("clip_norm", clip_norm)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if not 0.0 < delta < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
        if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1:
            raise ValueError(f"num_rounds must be an integer >= 1, got {num_rounds!r}")
        if isinstance(max_colluders, bool) or not isinstance(max_colluders, int) or max_colluders < 0:
            raise ValueError(f"max_colluders must be an integer >= 0, got {max_colluders!r}")
        t_min = min(self.secure.threshold_for(buffer_size), self.secure.threshold_for(buffer_size + 1))
        if t_min - max_colluders < 1:
            raise ValueError(f"threshold {t_min} leaves no honest share against {max_colluders} colluder(s)")
        if noise_multiplier is not None and not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
        if scale is not None and not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must lie in [0, 1), got {beta!r}")
        self.epsilon, self.delta, self.num_rounds = float(epsilon), float(delta), num_rounds
        self.clip_norm, self.max_colluders, self.beta = float(clip_norm), max_colluders, float(beta)
        self._shares = t_min - max_colluders
        self._z_arg, self._scale_arg = noise_multiplier, scale
        self.z: float | None = None
        self.scale: float | None = None
        self.l1 = self.l2 = 0.0
        self.accountant: SkellamAccountant | None = None
        self._releases = 0

    # ------------------------------------------------------------------ calibration
    def calibrate(self, dim: int) -> None:
        """z and gamma for a model of ``dim`` coordinates (module docstring). z depends on gamma only through the
        rounding's inflation of D2, gamma on z through the ring's headroom: a few alternations settle both."""
        members = self.buffer_size + 1
        if self._z_arg is not None:
            z = self._z_arg
            scale = self._scale_arg or skellam.largest_scale(self.clip_norm, members, dim, z, self._shares,
                                                             beta=self.beta)
        else:
            big = 2.0**20  # gamma C where rounding costs little: the reference z
            d2 = skellam.rounded_l2_bound(big, dim, self.beta)
            z = skellam.noise_multiplier_for(self.epsilon, self.delta, self.num_rounds, skellam.l1_bound(d2, dim), d2)
            scale = self._scale_arg or 1.0
            for _ in range(8):
                if self._scale_arg is None:
                    scale = skellam.largest_scale(self.clip_norm, members, dim, 1.05 * z, self._shares, beta=self.beta)
                d1, d2 = skellam.sensitivities(self.clip_norm, scale, dim, self.beta)
                new_z = skellam.noise_multiplier_for(self.epsilon, self.delta, self.num_rounds, d1, d2)
                if new_z <= 1.05 * z or self._scale_arg is not None:
                    z = new_z
                    break
                z = new_z
        d1, d2 = skellam.sensitivities(self.clip_norm, scale, dim, self.beta)
        room = skellam.headroom(scale, self.clip_norm, members, members * (z * d2) ** 2 / self._shares, dim)
        if room < 0:
            raise ValueError(f"scale {scale:g} with z = {z:g}: a buffer of {members} could wrap the 2^32 ring")
        self.z, self.scale, self.l1, self.l2 = float(z), float(scale), d1, d2
        self.accountant = SkellamAccountant(no_amplification(self.delta, 1, max_epsilon=self.epsilon * (1 + 1e-6)))

    # ------------------------------------------------------------------ checkpoints (strategies/checkpointed.py)
    def state_dict(self) -> dict[str, Any]:
        """SecureBuffers' state, the calibration (z, gamma, the sensitivities) and the accountant (its composed
        releases): a resumed run keeps the noise it was calibrated with and continues the ledger."""
        return {**super().state_dict(), "z": self.z, "scale": self.scale, "l1": self.l1, "l2": self.l2,
                "releases": self._releases,
                "accountant": None if self.accountant is None else self.accountant.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.z = None if state["z"] is None else float(state["z"])
        self.scale = None if state["scale"] is None else float(state["scale"])
        self.l1, self.l2, self._releases = float(state["l1"]), float(state["l2"]), int(state["releases"])
        self.accountant = None
        if state["accountant"] is not None:
            self.accountant = SkellamAccountant(no_amplification(self.delta, 1, max_epsilon=self.epsilon * (1 + 1e-6)))
            self.accountant.load_state_dict(dict(state["accountant"]))

    def _event(self) -> SkellamPrivacyEvent | None:
        assert self.z is not None
        return None if self.z == 0 else SkellamPrivacyEvent.of((self.z * self.l2) ** 2, self.l1, self.l2)

    def privacy_spent(self) -> Any:
        """Flower's protocol: the (epsilon, delta) spent so far (Skellam RDP, one client), None before round 1."""
        from flwr.supercore.privacy_accounting import PrivacySpent

        if self.z == 0.0 and self._releases:
            return PrivacySpent(epsilon=math.inf, delta=self.delta, num_releases=self._releases,
                                accounting_method="none (noise off)")
        return None if self.accountant is None else self.accountant.get_privacy_spent()

    def summary(self) -> None:
        log(INFO, "DistributedDP: epsilon=%g delta=%g over %d rounds, clip C=%g, z=%s, scale=%s, colluders=%d "
            "(Skellam RDP, client-level, no amplification)", self.epsilon, self.delta, self.num_rounds,
            self.clip_norm, self.z, self.scale, self.max_colluders)
        super().summary()

    # ------------------------------------------------------------------ round
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        from flwr.serverapp.exception import PrivacyBudgetExhausted

        self.learn_layout(Message(RecordDict({"arrays": arrays}), dst_node_id=0, message_type="train"))
        assert self.layout is not None
        if self.accountant is None:
            self.calibrate(self.layout.dim)
        assert self.accountant is not None
        event = self._event()
        if event is not None and self.accountant.would_exceed(event):
            spent = self.accountant.get_privacy_spent()
            raise PrivacyBudgetExhausted(f"round {server_round}: the next release would exceed epsilon = "
                                         f"{self.epsilon} (spent {spent.epsilon:.4g} at delta = {spent.delta:g} in "
                                         f"{spent.num_releases} rounds)")
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if messages:  # the mask requests are out: count the release, whatever happens next
            self._releases += 1
            if event is not None:
                self.accountant.compose(event)
        return messages

    def mask_extra(self, server_round: int, members: list[int]) -> dict[str, Any]:
        assert self.z is not None and self.scale is not None
        return {DDP_Z: self.z, DDP_CLIP: self.clip_norm, DDP_SCALE: self.scale, DDP_BETA: self.beta}

    def decode_sum(self, total: NDArray[np.uint32], count: int) -> FloatArray:
        assert self.scale is not None
        v = skellam.decode_signed(total)
        if np.any(np.abs(v) >= EDGE):
            raise ValueError("the noisy sum reaches the ring's edge: it may have wrapped")
        return np.asarray(v, dtype=np.float64) / (self.scale * count)

    def decode_update(self, total: NDArray[np.uint32], count: int, weight: float) -> FloatArray:
        """The buffer's unweighted mean of the survivors' clipped updates (class docstring)."""
        return self.decode_sum(total, count)

    def buffer_metrics(self, means: Any, weight: float, count: int) -> dict[str, Any]:
        """The inner strategy weighs the buffer by its survivors (an unweighted model mean); the total weight rides
        along for the metrics' FedAvg weighting (:meth:`SecureBuffers.aggregate_train`)."""
        return {**means, self.weight_key: count, _TOTAL_WEIGHT: _weight_value(weight)}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        spent = self.privacy_spent()
        if spent is None:
            log(WARNING, "round %d: DistributedDP has no accountant yet", server_round)
            return arrays, metrics
        self.record_diagnostics(server_round, {
            "ddp.noise_multiplier": float(self.z or 0.0), "ddp.scale": float(self.scale or 0.0),
            "ddp.l2_sensitivity": self.l2, "ddp.epsilon": float(spent.epsilon),
            "ddp.releases": float(spent.num_releases), "ddp.sample_rate": 1.0})
        return arrays, metrics
