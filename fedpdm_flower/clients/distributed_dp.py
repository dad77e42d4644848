"""The device side of distributed DP under secure aggregation: each device adds its share of Skellam noise.

Used by :func:`fedpdm_flower.clients.mods.secure_buffers_mod` (``distributed_dp=DeviceSkellam(...)``) under
:class:`fedpdm_flower.strategies.distributed_dp.DistributedDP`. The math is :mod:`fedpdm_flower.fedapp.privacy.skellam`'s.

In a mask request the server names the mechanism: ``ddp.z`` (the noise multiplier: std of the buffer's total
noise over the L2 sensitivity, both in integer units), ``ddp.clip`` (C), ``ddp.scale`` (gamma) and ``ddp.beta``
(conditional rounding). The device, before anything is trained:

* refuses a request without them (noise switched off), with ``z`` below its owner's floor
  (``min_noise_multiplier``), or whose release would cost more (in RDP, at any order) than a Gaussian release at
  that floor -- a tiny scale inflates the sensitivity by rounding and the Skellam bound's discrete term -- and,
  with ``max_epsilon``, a release that would take its own ledger past it;
* refuses a scale whose noisy sum could wrap the ring (:func:`fedpdm_flower.fedapp.privacy.skellam.headroom`, the buffer's
  members all surviving, each adding this device's share);

then clips its update to C (L2), scales by gamma, rounds conditionally (the L2 bound D2 enforced) and adds
``Sk(lam)`` per coordinate with ``2 lam = (z D2)^2 / (t - c)``: t is the buffer's threshold and c the colluders
this device guards against (``max_colluders``, default 0). Any t survivors (the server never gets a sum from fewer:
the shares of every self-mask are t-of-s), less c colluders who subtract their own shares, still carry
``Sk`` of variance >= (z D2)^2, by Skellam's closure under sums.

The noise comes from numpy's Poisson sampler on a Philox generator keyed afresh for every upload with 128 bits
from the OS CSPRNG (``secrets``); nothing in a message seeds it. Philox is a counter-based generator, not a
certified CSPRNG: a deployment that needs one replaces :meth:`DeviceSkellam.rng`.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, RecordDict
from numpy.typing import NDArray

from fedpdm_flower.fedapp.privacy import skellam

__all__ = ["DDP_BETA", "DDP_CLIP", "DDP_SCALE", "DDP_Z", "DeviceSkellam"]

#: the mask request's config keys of the mechanism (fedpdm_flower/strategies/distributed_dp.py writes the same)
DDP_Z, DDP_CLIP, DDP_SCALE, DDP_BETA = "ddp.z", "ddp.clip", "ddp.scale", "ddp.beta"
#: context.state: the device's own ledger (its RDP curve over skellam.ORDERS and its release count)
LEDGER = "ddp.ledger"


def _number(cfg: Mapping[str, Any], key: str) -> float:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"message config {key!r} must be a finite number, got {v!r}")
    return float(v)


class DeviceSkellam:
    """A device's distributed-DP policy (module docstring). The server cannot switch it off or lower its noise.

    Parameters
    ----------
    min_noise_multiplier
        The floor that the device's owner sets: a request with a smaller z, or whose Skellam release costs more RDP
        than a Gaussian release with this noise multiplier, is refused. 0 follows the server, even to no noise at
        all (z = 0, for a non-private baseline).
    max_colluders
        c: how many of its buffer-mates may collude with the server (subtract their own shares); the device's share
        is calibrated to ``t - c`` shares so that the honest survivors alone carry the full noise.
    max_epsilon, delta
        With ``max_epsilon``, the device keeps its own Skellam RDP ledger in ``context.state`` and refuses a release
        that would take it past ``max_epsilon`` at ``delta``.
    """

    def __init__(self, *, min_noise_multiplier: float, max_colluders: int = 0, max_epsilon: float | None = None,
                 delta: float = 1e-5) -> None:
        if isinstance(min_noise_multiplier, bool) or not isinstance(min_noise_multiplier, int | float) or not (
                math.isfinite(min_noise_multiplier) and min_noise_multiplier >= 0):
            raise ValueError(f"min_noise_multiplier must be a finite number >= 0, got {min_noise_multiplier!r}")
        if isinstance(max_colluders, bool) or not isinstance(max_colluders, int) or max_colluders < 0:
            raise ValueError(f"max_colluders must be an integer >= 0, got {max_colluders!r}")
        if max_epsilon is not None and not (math.isfinite(max_epsilon) and max_epsilon > 0):
            raise ValueError(f"max_epsilon must be a finite number > 0 or None, got {max_epsilon!r}")
        if not 0.0 < delta < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
        self.min_noise_multiplier, self.max_colluders = float(min_noise_multiplier), max_colluders
        self.max_epsilon, self.delta = max_epsilon, float(delta)
        #: a test hook: called with {"encoded": the clipped, rounded update, "noise": this device's share} (int64)
        self.observer: Callable[[dict[str, NDArray[np.int64]]], None] | None = None

    def __repr__(self) -> str:
        return (f"DeviceSkellam(min_noise_multiplier={self.min_noise_multiplier}, max_colluders={self.max_colluders}, "
                f"max_epsilon={self.max_epsilon})")

    @staticmethod
    def rng() -> np.random.Generator:
        """A fresh generator for one upload's rounding and noise, keyed from the OS CSPRNG."""
        return np.random.Generator(np.random.Philox(key=secrets.randbits(128)))

    # ------------------------------------------------------------------ the request
    def plan(self, cfg: Mapping[str, Any], members: int, threshold: int, dim: int, state: RecordDict | None) -> dict[str, float]:
        """Check a mask request's mechanism before anything is trained; its parameters (ValueError names a refusal)."""
        if DDP_Z not in cfg:
            raise ValueError("distributed DP is on at this device and the request asks for no noise (no 'ddp.z')")
        z, clip, scale = _number(cfg, DDP_Z), _number(cfg, DDP_CLIP), _number(cfg, DDP_SCALE)
        beta = _number(cfg, DDP_BETA) if DDP_BETA in cfg else skellam.DEFAULT_BETA
        if z < self.min_noise_multiplier or z < 0:  # z = 0 (no noise) passes only a device whose floor is 0
            raise ValueError(f"the request's noise multiplier z = {z:g} is below this device's floor of "
                             f"{self.min_noise_multiplier:g}")
        if clip <= 0 or scale <= 0 or not 0.0 <= beta < 1.0:
            raise ValueError(f"the request's clip {clip!r}, scale {scale!r} and beta {beta!r} must be > 0, > 0, in [0, 1)")
        shares = threshold - self.max_colluders
        if shares < 1:
            raise ValueError(f"threshold {threshold} leaves no honest share against {self.max_colluders} colluder(s)")
        d2 = skellam.rounded_l2_bound(clip * scale, dim, beta)
        d1 = skellam.l1_bound(d2, dim)
        variance = (z * d2) ** 2
        if z > 0 and self.min_noise_multiplier > 0:
            # the floor bounds the release's cost, not just z: a tiny scale inflates D2 by rounding (sqrt(d)) and
            # the discrete surcharge grows with D1 / V, so the device requires the Skellam bound to stay below the
            # RDP of a Gaussian release at its floor, alpha / (2 z_floor^2), at every order
            orders = np.asarray(skellam.ORDERS, dtype=np.float64)
            if np.any(skellam.skellam_rdp(variance, d1, d2) > orders / (2 * self.min_noise_multiplier**2)):
                raise ValueError(f"at scale {scale:g} the release costs more than a Gaussian one at this device's floor "
                                 f"z = {self.min_noise_multiplier:g} (rounding and discreteness): raise the scale")
        room = skellam.headroom(scale, clip, members, members * variance / shares, dim)
        if room < 0:
            raise ValueError(f"scale {scale:g}: a buffer of {members} could wrap the 2^32 ring (short by {-room:.3g})")
        if self.max_epsilon is not None:
            rdp = self._ledger(state) + skellam.skellam_rdp(variance, d1, d2)
            eps = skellam.epsilon_of_rdp(rdp, self.delta)
            if eps > self.max_epsilon * (1 + 1e-9):
                raise ValueError(f"this release would take the device to epsilon = {eps:.4g} at delta = "
                                 f"{self.delta:g}, past its max_epsilon = {self.max_epsilon:g}")
        return {"z": z, "clip": clip, "scale": scale, "l1": d1, "l2": d2, "variance": variance,
                "lam": variance / (2 * shares)}

    # ------------------------------------------------------------------ the upload
    def encode(self, update: NDArray[np.float64], plan: Mapping[str, float], state: RecordDict | None) -> NDArray[np.uint32]:
        """clip(update, C) * gamma, rounded conditionally, plus this device's Sk(lam) share, mod 2^32; the release
        goes into the device's ledger."""
        x = np.asarray(update, dtype=np.float64)
        norm = float(np.linalg.norm(x))
        if norm > plan["clip"]:
            x = x * (plan["clip"] / norm)
        rng = self.rng()
        encoded = skellam.conditional_round(x * plan["scale"], plan["l2"], rng)
        noise = skellam.skellam_noise(plan["lam"], x.size, rng)
        if self.observer is not None:
            self.observer({"encoded": encoded.copy(), "noise": noise.copy()})
        if state is not None and self.max_epsilon is not None:
            rdp = self._ledger(state) + skellam.skellam_rdp(plan["variance"], plan["l1"], plan["l2"])
            state[LEDGER] = ConfigRecord({"rdp": [float(v) for v in rdp]})
        return (encoded + noise).astype(np.int64).astype(np.uint32)  # two's complement: mod 2^32

    def epsilon_spent(self, state: RecordDict) -> float:
        """The device's own epsilon at its delta (0 before any release)."""
        rdp = self._ledger(state)
        return 0.0 if not rdp.any() else skellam.epsilon_of_rdp(rdp, self.delta)

    @staticmethod
    def _ledger(state: RecordDict | None) -> NDArray[np.float64]:
        rec = state.config_records.get(LEDGER) if state is not None else None
        if rec is None:
            return np.zeros(len(skellam.ORDERS))
        return np.asarray(rec["rdp"], dtype=np.float64)
