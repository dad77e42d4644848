"""Record-level DP-SGD on the device: the device's side of the mechanism, for our clients and for a user's own loop.

Two things live here, both on :mod:`fedpdm_flower.fedapp.privacy.dpsgd` (the step, the RDP accountant, the ledger):

* :class:`DeviceAccount` -- where a device keeps its DP-SGD ledger (``context.state`` and, when the device has one,
  a file that carries the spend across runs), the check of the device's floor that refuses a message *before*
  any training, and the charge. Every client of the project whose local solver takes DP-SGD steps uses it (FedPDM's,
  and the other seeds' DP clients).
* :class:`DeviceDPSGD` -- the device owner's DP-SGD policy for a user's torch training loop under any Flower strategy
  (Flower's FedAvg included): ``DeviceDPSGD(epsilon, delta, max_rounds, ...)`` calibrates z once for
  ``max_rounds`` participations of ``epochs`` local epochs (q = b / n, ``ceil(n / b)`` steps an epoch), and each
  round's :meth:`DeviceDPSGD.train` runs the core's DP-SGD steps on the user's module.

**Unit and adversary.** One record of this device's data; against everyone, the server included: the upload is
already private when it leaves the device. Amplification by subsampling is claimed because the Poisson sampling of
records happens on the device, from its own randomness (``device_rng``: the operating system's entropy), and nobody
else sees which records a step used. A strategy cannot lower the noise below what the device accepts: the
device's floor is checked against the message before training, and DeviceDPSGD's noise is set by the device alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpdm_flower.fedapp.privacy.dpsgd import (
    DPSGDLedger,
    DPSGDMechanism,
    DPSGDStep,
    device_rng,
    noise_multiplier_for,
)

__all__ = ["DeviceAccount", "DeviceDPSGD"]

#: the context.state key of a device's DP-SGD ledger
STATE_KEY = "dpsgd"


class DeviceAccount:
    """A device's DP-SGD ledger, its floor, and the metrics its replies carry.

    Parameters
    ----------
    max_epsilon
        The device owner's floor: the most epsilon (RDP accountant, at the message's delta) this device accepts to
        spend over everything it ever released. None: no floor.
    ledger_path
        A file that keeps the ledger across runs (None: ``context.state`` only).
    """

    def __init__(self, max_epsilon: float | None = None, ledger_path: str | Path | None = None) -> None:
        if max_epsilon is not None and (isinstance(max_epsilon, bool) or not isinstance(max_epsilon, int | float)
                                        or not (math.isfinite(max_epsilon) and max_epsilon > 0)):
            raise ValueError(f"max_epsilon must be a finite number > 0 or None, got {max_epsilon!r}")
        self.max_epsilon = None if max_epsilon is None else float(max_epsilon)
        self.ledger_path = Path(ledger_path) if ledger_path is not None else None

    # ------------------------------------------------------------------ the ledger
    def load(self, context: Any) -> DPSGDLedger:
        """The file's ledger when the device has one, else ``context.state``'s, else an empty one."""
        if self.ledger_path is not None and self.ledger_path.exists():
            return DPSGDLedger.load(self.ledger_path)
        rec = context.state.config_records.get(STATE_KEY) if context is not None else None
        return DPSGDLedger() if rec is None else DPSGDLedger.from_record(dict(rec))

    def save(self, context: Any, ledger: DPSGDLedger) -> None:
        """Into ``context.state`` (compact: the RDP vector and the (z, q, steps) history) and the file."""
        from flwr.app import ConfigRecord

        if context is not None:
            context.state[STATE_KEY] = ConfigRecord(ledger.to_record())  # type: ignore[arg-type]
        if self.ledger_path is not None:
            ledger.save(self.ledger_path)

    # ------------------------------------------------------------------ admit, then charge
    def admit(self, context: Any, mechanism: DPSGDMechanism, delta: float) -> DPSGDLedger:
        """The ledger, when charging ``mechanism`` keeps the device within its floor; else ValueError (refused
        before any training: nothing has been computed on the data)."""
        ledger = self.load(context)
        if self.max_epsilon is not None:
            after = ledger.epsilon_after(mechanism, delta)
            if not after <= self.max_epsilon:
                raise ValueError(
                    f"refused: {mechanism.steps} DP-SGD step(s) at z = {mechanism.noise_multiplier:.4g}, q = "
                    f"{mechanism.sample_rate:.4g} would take this device's epsilon from "
                    f"{ledger.epsilon(delta):.4g} to {after:.4g} (RDP, delta = {delta:g}) > its floor max_epsilon = "
                    f"{self.max_epsilon:g}")
        return ledger

    def charge(self, context: Any, ledger: DPSGDLedger, mechanism: DPSGDMechanism, delta: float) -> dict[str, float]:
        """Record the participation's steps, persist the ledger, and return the reply's privacy metrics."""
        ledger.record(mechanism)
        self.save(context, ledger)
        return self.metrics(ledger, delta)

    @staticmethod
    def metrics(ledger: DPSGDLedger, delta: float) -> dict[str, float]:
        """``eps_dpsgd`` (RDP, every step ever) and what another library needs to recompute it: the mechanism's
        z, q and the steps (the last (z, q) of the history; ``dp_mechanisms`` counts the distinct ones)."""
        z, q, _ = ledger.history[-1]
        return {"eps_dpsgd": ledger.epsilon(delta), "dp_noise_multiplier": z, "dp_sample_rate": q,
                "dp_steps": float(ledger.steps), "dp_mechanisms": float(len(ledger.history))}


class DeviceDPSGD:
    """The device's DP-SGD policy for a user's torch loop, and its ledger (module docstring).

    Parameters
    ----------
    epsilon, delta
        The device's total budget over ``max_rounds`` participations.
    max_rounds
        The most rounds this device takes part in; the noise is calibrated for them.
    clip_norm
        C, the L2 bound of each per-example gradient (default 1.0).
    epochs
        Local epochs per round (default 1): with q = b / n, one epoch is ``ceil(n / b)`` steps.
    ledger_path
        A file that keeps the device's accounting across runs (None: ``context.state`` only).
    secure_mode
        Draw the noise from ``os.urandom`` (a CSPRNG) instead of a PCG64 generator seeded from it.
    """

    def __init__(self, *, epsilon: float, delta: float = 1e-5, max_rounds: int, clip_norm: float = 1.0,
                 epochs: int = 1, ledger_path: str | Path | None = None, secure_mode: bool = False) -> None:
        for name, v in (("epsilon", epsilon), ("clip_norm", clip_norm)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if not 0.0 < delta < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
        for name, n in (("max_rounds", max_rounds), ("epochs", epochs)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
        self.epsilon, self.delta, self.max_rounds = float(epsilon), float(delta), max_rounds
        self.clip_norm, self.epochs = float(clip_norm), epochs
        self.ledger_path = Path(ledger_path) if ledger_path is not None else None
        self.secure_mode = bool(secure_mode)
        # the floor is the budget itself, widened by 1e-9 relative so that the last calibrated round is not refused
        # for a rounding error
        self.account = DeviceAccount(max_epsilon=self.epsilon * (1 + 1e-9), ledger_path=self.ledger_path)

    def steps_per_round(self, num_examples: int, batch_size: int) -> int:
        """``epochs * ceil(n / b)`` DP-SGD steps in one round."""
        return self.epochs * math.ceil(num_examples / batch_size)

    def mechanism(self, num_examples: int, batch_size: int) -> DPSGDMechanism:
        """One round's mechanism: q = b / n, z calibrated for ``max_rounds`` rounds of :meth:`steps_per_round`."""
        if not 0 < batch_size <= num_examples:
            raise ValueError(f"batch size {batch_size} must lie in (0, n = {num_examples}]")
        q, per_round = batch_size / num_examples, self.steps_per_round(num_examples, batch_size)
        z = noise_multiplier_for(self.epsilon, self.delta, q, self.max_rounds * per_round)
        return DPSGDMechanism(noise_multiplier=z, sample_rate=q, clip_norm=self.clip_norm, steps=per_round)

    def noise_multiplier(self, num_examples: int, batch_size: int) -> float:
        """z for q = b / n and ``max_rounds * epochs * ceil(n / b)`` steps (RDP calibration)."""
        return self.mechanism(num_examples, batch_size).noise_multiplier

    def epsilon_spent(self, context: Any = None, delta: float | None = None) -> float:
        """The device's RDP epsilon so far (its ledger: the file, else ``context.state``)."""
        return self.account.load(context).epsilon(self.delta if delta is None else delta)

    # ------------------------------------------------------------------ one round
    def train(self, net: Any, loader: Any, *, lr: float, context: Any, loss_fn: Any = None,
              momentum: float = 0.0) -> dict[str, float]:
        """Run this round's DP-SGD on ``net`` in place (the user's module, the user's DataLoader's dataset and
        batch size; the loader's own sampler is not used: the records are Poisson-sampled on the device), with
        ``torch.optim.SGD(lr, momentum)`` on the noisy gradients; returns the metrics to put in the reply.

        ``train_loss`` is the mean loss of the sampled records, a diagnostic outside the DP guarantee (as the loss
        Opacus's examples print); drop it from the reply to release nothing else.

        Raises
        ------
        ValueError
            When the round would take the device past its budget (after ``max_rounds`` rounds): nothing is trained.
        """
        import torch

        from fedpdm_flower.fedapp.localdata import TorchData
        from fedpdm_flower.fedapp.models.torch_model import TorchModel

        data = TorchData(loader)
        n, b = len(data), int(loader.batch_size)
        mech = self.mechanism(n, b)
        try:
            ledger = self.account.admit(context, mech, self.delta)
        except ValueError:
            raise ValueError(f"refused: this device's DP-SGD budget (epsilon = {self.epsilon:g} at delta = "
                             f"{self.delta:g} over {self.max_rounds} rounds) is spent: epsilon = "
                             f"{self.epsilon_spent(context):.4g}") from None
        model = TorchModel(net, loss_fn if loss_fn is not None else torch.nn.CrossEntropyLoss())
        step = DPSGDStep(model, data, mech, device_rng(), secure=self.secure_mode)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        total, seen = 0.0, 0
        for _ in range(mech.steps):
            before = step.sampled
            model.load_grads(step(model.get_flat()))
            optimizer.step()
            if step.sampled > before and math.isfinite(model.last_batch_loss):
                total += model.last_batch_loss * (step.sampled - before)
                seen += step.sampled - before
        optimizer.zero_grad(set_to_none=True)
        metrics = self.account.charge(context, ledger, mech, self.delta)
        return {"train_loss": total / max(seen, 1), "dp_epsilon": metrics["eps_dpsgd"],
                "dp_noise_multiplier": mech.noise_multiplier, "dp_sample_rate": mech.sample_rate,
                "dp_steps": metrics["dp_steps"]}


def mechanism_of(config: Mapping[str, Any]) -> tuple[DPSGDMechanism, float] | None:
    """The DP-SGD mechanism and delta a message config asks for, or None when it asks for another (or none)."""
    if config.get("dp-mechanism") != "dp-sgd":
        return None
    delta = config.get("dp-delta")
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0.0 < float(delta) < 1.0:
        raise ValueError(f"message config 'dp-delta' must lie in (0, 1), got {delta!r}")
    return DPSGDMechanism.from_config(config), float(delta)
