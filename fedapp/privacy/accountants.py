"""Per-client privacy ledger: store each participation's mechanism, compose when asked (Opacus pattern).

Each time a client releases a noisy upload it records the per-round epsilon it targeted and the noise multiplier
``z = sigma / sensitivity`` it actually used. The ledger holds plain lists so that it fits in Flower's
``context.state`` (:meth:`PrivacyLedger.to_record` / :meth:`PrivacyLedger.from_record`) and composes lazily with
two named accountants:

* **Basic composition** (Dwork & Roth, Thm. 3.16): n mechanisms that are (eps_t, delta)-DP compose to
  ``(sum_t eps_t, n * delta)``. It takes the per-round (32) calibration at face value, which is only valid for
  eps_t < 1 (spec 4.6, caveat 1).
* **RDP** (Mironov 2017) of the Gaussian mechanism with noise multiplier z_t, composed over participations and
  converted to (eps, delta) with Opacus's ``opacus.accountants.analysis.rdp``. This holds for any epsilon.

The paper's own total, eq. (36), is :func:`fedapp.privacy.gaussian.total_privacy_eq36`. No amplification by
subsampling is claimed by either accountant here: the server knows which clients participate, and the
sensitivity bound (35) is worst-case over mini-batches, so each participation is accounted at sample rate 1.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PrivacyLedger"]


def _check_delta(delta: float) -> None:
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must lie in the open interval (0, 1), got {delta!r}")


@dataclass
class PrivacyLedger:
    """History of one client's Gaussian releases, one entry per participation.

    Parameters
    ----------
    delta
        Per-round delta of the Gaussian mechanism (32); also the target delta of :meth:`rdp_epsilon`.
    eps_rounds
        Per-round epsilon targeted by each participation (from (36) inverted).
    noise_multipliers
        ``sigma / sensitivity`` used in each participation (0 means no noise).
    """

    delta: float
    eps_rounds: list[float] = field(default_factory=list)
    noise_multipliers: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_delta(self.delta)
        if len(self.eps_rounds) != len(self.noise_multipliers):
            raise ValueError(
                f"eps_rounds and noise_multipliers must have equal length, got "
                f"{len(self.eps_rounds)} and {len(self.noise_multipliers)}"
            )
        self.eps_rounds = [float(e) for e in self.eps_rounds]
        self.noise_multipliers = [float(z) for z in self.noise_multipliers]

    def __len__(self) -> int:
        """Number of recorded participations."""
        return len(self.eps_rounds)

    def record(self, eps_round: float, noise_multiplier: float) -> None:
        """Append one participation.

        Parameters
        ----------
        eps_round
            Per-round epsilon the noise was calibrated for (> 0; may be inf when no noise was added).
        noise_multiplier
            ``sigma / sensitivity`` actually used (>= 0, finite).
        """
        if math.isnan(eps_round) or eps_round <= 0.0:
            raise ValueError(f"eps_round must be > 0, got {eps_round!r}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0.0):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
        self.eps_rounds.append(float(eps_round))
        self.noise_multipliers.append(float(noise_multiplier))

    def basic_composition(self) -> tuple[float, float]:
        """Basic composition (Dwork & Roth, Thm. 3.16) of the recorded per-round guarantees.

        Returns
        -------
        tuple[float, float]
            ``(sum of eps_rounds, participations * delta)``; ``(0.0, 0.0)`` when nothing is recorded.
        """
        return math.fsum(self.eps_rounds), len(self.eps_rounds) * self.delta

    def rdp_epsilon(self, delta: float | None = None) -> float:
        """Epsilon of the composed Gaussian mechanisms at ``delta``, by Renyi DP (Mironov 2017).

        Each participation is the Gaussian mechanism with noise multiplier z_t at sample rate 1 (no subsampling
        amplification, see the module docstring). RDP curves are summed over participations on Opacus's default
        orders and converted with ``get_privacy_spent``, exactly as ``opacus.accountants.RDPAccountant`` does.

        Parameters
        ----------
        delta
            Target delta in (0, 1); the ledger's ``delta`` when None.

        Returns
        -------
        float
            Epsilon; 0.0 with nothing recorded, inf if any participation added no noise (z = 0).
        """
        target = self.delta if delta is None else delta
        _check_delta(target)
        if not self.noise_multipliers:
            return 0.0
        if any(z == 0.0 for z in self.noise_multipliers):
            return math.inf
        # Imported lazily: importing opacus pulls in torch, which the numpy-only paths never need.
        from opacus.accountants import RDPAccountant
        from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

        orders = list(RDPAccountant.DEFAULT_ALPHAS)
        # Identical multipliers compose as `steps` repetitions; grouping keeps one compute_rdp call per value.
        rdp = np.zeros(len(orders), dtype=np.float64)
        for z, count in Counter(self.noise_multipliers).items():
            rdp = rdp + np.asarray(
                compute_rdp(q=1.0, noise_multiplier=z, steps=count, orders=orders), dtype=np.float64
            )
        with warnings.catch_warnings():
            # Opacus warns when the best order is at the edge of the grid; the bound is still valid, only looser.
            warnings.filterwarnings("ignore", message="Optimal order is the")
            eps, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=target)
        return float(eps)

    def to_record(self) -> dict[str, list[float] | float]:
        """Plain-Python form for Flower's ``context.state`` (a ConfigRecord accepts floats and float lists)."""
        return {
            "delta": float(self.delta),
            "eps_rounds": list(self.eps_rounds),
            "noise_multipliers": list(self.noise_multipliers),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, object]) -> PrivacyLedger:
        """Rebuild a ledger from :meth:`to_record`'s output.

        Raises
        ------
        ValueError
            If a key is missing, the lists differ in length, or delta is outside (0, 1).
        TypeError
            If a value has the wrong type.
        """
        for key in ("delta", "eps_rounds", "noise_multipliers"):
            if key not in record:
                raise ValueError(f"privacy ledger record is missing key {key!r}")
        delta = record["delta"]
        if isinstance(delta, bool) or not isinstance(delta, (int, float)):
            raise TypeError(f"privacy ledger 'delta' must be a float, got {type(delta).__name__}")
        lists: list[list[float]] = []
        for key in ("eps_rounds", "noise_multipliers"):
            values = record[key]
            if not isinstance(values, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
            ):
                raise TypeError(f"privacy ledger {key!r} must be a list of floats")
            lists.append([float(v) for v in values])
        return cls(delta=float(delta), eps_rounds=lists[0], noise_multipliers=lists[1])
