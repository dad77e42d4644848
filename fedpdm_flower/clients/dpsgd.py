"""Record-level DP-SGD on the device, through Opacus, for a user's torch training loop under any Flower strategy.

The device owner fixes the privacy: ``DeviceDPSGD(epsilon, delta, max_rounds, ...)``. Each round the device runs
DP-SGD (Abadi et al., CCS 2016) with Opacus: Poisson sampling of its records at rate q = b / n, per-example
gradients clipped to ``clip_norm``, Gaussian noise of multiplier z on their sum. z is calibrated once, for
``max_rounds`` participations of ``epochs`` local epochs each, so that everything the device ever uploads is
(epsilon, delta)-DP for one record of its data; the device refuses a participation past ``max_rounds``.

**Unit and adversary.** One record of this device's data; against everyone, the server included: the upload is
already private when it leaves the device. Amplification by subsampling is claimed because the Poisson sampling of
records happens on the device, from its own randomness, and nobody else sees which records a step used.

The accounting (Opacus's RDP accountant, its history of (z, q, steps)) lives in ``context.state`` -- or in a file
(``ledger_path``) so that the spend accumulates across runs -- and the reply's metrics carry ``dp_epsilon``,
``dp_noise_multiplier``, ``dp_sample_rate`` and ``dp_steps``. A strategy cannot lower the noise: nothing in a
message sets it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["DeviceDPSGD"]

_STATE = "dpsgd"


class DeviceDPSGD:
    """The device's DP-SGD policy and its ledger (module docstring).

    Parameters
    ----------
    epsilon, delta
        The device's total budget over ``max_rounds`` participations.
    max_rounds
        The most rounds this device takes part in; the noise is calibrated for them.
    clip_norm
        C, the L2 bound of each per-example gradient (default 1.0).
    epochs
        Local epochs per round (default 1): with q = b / n, one epoch is n / b steps.
    ledger_path
        A file that keeps the device's accounting across runs (None: ``context.state`` only).
    secure_mode
        Opacus's cryptographically secure noise (needs ``torchcsprng``); off by default, as in Opacus: the noise
        then comes from torch's PRNG, fine for experiments, not for deployment.
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
        self._z: dict[tuple[int, int], float] = {}

    def noise_multiplier(self, num_examples: int, batch_size: int) -> float:
        """z for q = b / n and ``max_rounds * epochs * ceil(n / b)`` steps (Opacus's RDP calibration)."""
        from opacus.accountants.utils import get_noise_multiplier

        key = (num_examples, batch_size)
        if key not in self._z:
            if not 0 < batch_size <= num_examples:
                raise ValueError(f"batch size {batch_size} must lie in (0, n = {num_examples}]")
            steps = self.max_rounds * self.epochs * math.ceil(num_examples / batch_size)
            self._z[key] = float(get_noise_multiplier(target_epsilon=self.epsilon, target_delta=self.delta,
                                                      sample_rate=batch_size / num_examples, steps=steps,
                                                      accountant="rdp", epsilon_tolerance=0.001))
        return self._z[key]

    # ------------------------------------------------------------------ the ledger
    def _load(self, context: Any) -> list[list[float]]:
        if self.ledger_path is not None and self.ledger_path.exists():
            return [list(map(float, h)) for h in json.loads(self.ledger_path.read_text())["history"]]
        rec = context.state.config_records.get(_STATE) if context is not None else None
        if rec is None:
            return []
        flat = [float(v) for v in rec["history"]]
        return [flat[i:i + 3] for i in range(0, len(flat), 3)]

    def _save(self, context: Any, history: list[list[float]]) -> None:
        from flwr.app import ConfigRecord

        if context is not None:
            context.state[_STATE] = ConfigRecord({"history": [v for h in history for v in h]})
        if self.ledger_path is not None:
            tmp = self.ledger_path.with_name(self.ledger_path.name + ".tmp")
            tmp.write_text(json.dumps({"history": history}))
            tmp.replace(self.ledger_path)

    def epsilon_spent(self, history: list[list[float]], delta: float | None = None) -> float:
        """Opacus's RDP epsilon of a history of (z, q, steps)."""
        from opacus.accountants import RDPAccountant

        acc = RDPAccountant()
        acc.history = [(z, q, int(steps)) for z, q, steps in history]
        return 0.0 if not history else float(acc.get_epsilon(self.delta if delta is None else delta))

    # ------------------------------------------------------------------ one round
    def train(self, net: Any, loader: Any, *, lr: float, context: Any, loss_fn: Any = None,
              momentum: float = 0.0) -> dict[str, float]:
        """Run this round's DP-SGD on ``net`` in place (the user's module, the user's DataLoader's dataset and
        batch size); returns the metrics to put in the reply.

        Raises
        ------
        ValueError
            When the device has already taken part in ``max_rounds`` rounds (its budget): nothing is trained.
        """
        import torch
        from opacus import PrivacyEngine

        history = self._load(context)
        rounds = len(history) // self.epochs if self.epochs else len(history)
        if rounds >= self.max_rounds:
            raise ValueError(f"refused: this device's DP-SGD budget (epsilon = {self.epsilon:g} at delta = "
                             f"{self.delta:g} over {self.max_rounds} rounds) is spent: epsilon = "
                             f"{self.epsilon_spent(history):.4g}")
        n, b = len(loader.dataset), int(loader.batch_size)
        z = self.noise_multiplier(n, b)
        net.train()  # Opacus wraps a module in training mode only
        engine = PrivacyEngine(accountant="rdp", secure_mode=self.secure_mode)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        model, optimizer, private_loader = engine.make_private(
            module=net, optimizer=optimizer, data_loader=loader, noise_multiplier=z, max_grad_norm=self.clip_norm,
            poisson_sampling=True)
        criterion = loss_fn or torch.nn.CrossEntropyLoss()
        model.train()
        total, seen = 0.0, 0
        for _ in range(self.epochs):
            for x, y in private_loader:
                optimizer.zero_grad()
                # Poisson sampling can draw an empty batch: the step still happens (noise only), as the analysis
                # of the subsampled Gaussian assumes; skipping it would show that the batch was empty
                loss = criterion(model(x), y) if len(y) else model(x).sum() * 0.0
                loss.backward()
                optimizer.step()
                total, seen = total + float(loss.detach()) * len(y), seen + len(y)
        history.extend([[z, b / n, float(math.ceil(n / b))] for _ in range(self.epochs)])
        self._save(context, history)
        if hasattr(model, "remove_hooks"):  # the user's module goes back without Opacus's hooks
            model.remove_hooks()
        return {"train_loss": total / max(seen, 1), "dp_epsilon": self.epsilon_spent(history),
                "dp_noise_multiplier": z, "dp_sample_rate": b / n, "dp_steps": float(sum(h[2] for h in history))}
