"""The one privacy target a user passes (``privacy=PrivacyTarget(...)``), and the vocabulary around it.

Every DP-named strategy of the project takes its privacy through ``privacy=``:

* :class:`PrivacyTarget` -- **the** target: each device's releases over the run are (epsilon, delta)-DP for one
  record of its data, against everyone who sees them, the server included (record-level DP-SGD on the device,
  :mod:`fedpdm_flower.fedapp.privacy.dpsgd`). ``delta`` defaults to 1e-5 everywhere.
* a paper's own mechanism, named as the reproduction setting (e.g. DP-FedPDM's
  :class:`fedpdm_flower.fedapp.privacy.gaussian.Eq36Calibration`), whose rigorous epsilon the devices report beside
  the paper's figure;
* ``None``, said explicitly: no noise.

No strategy picks an epsilon for the user, and none trains without noise unless told to: a DP-named strategy built
without ``privacy=`` refuses to start (:func:`require_privacy` raises :class:`PrivacyNotChosen`, a ``TypeError`` as
for any missing required argument, naming the three things to pass). A user who swaps a DP-named strategy into an
app that ran Flower's FedAvg therefore learns at construction that a privacy decision is theirs to make, instead of
finding out from a results file that no epsilon held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedpdm_flower.fedapp.privacy.dpsgd import (
    DPSGDMechanism,
    check_clip_norm,
    check_delta,
    check_sample_rate,
    noise_multiplier_for,
)

__all__ = ["DEFAULT_DELTA", "MISSING", "PrivacyNotChosen", "PrivacyTarget", "require_privacy"]

#: the one delta default of the project
DEFAULT_DELTA = 1e-5


class _Missing:
    """The default of a DP-named strategy's ``privacy=``: not given (distinct from an explicit None)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"


#: ``privacy=MISSING`` (the default of a DP-named strategy): not chosen, refused by :func:`require_privacy`
MISSING: Any = _Missing()


@dataclass(frozen=True)
class PrivacyTarget:
    """A rigorous (epsilon, delta) for one record of each device's data, reached by DP-SGD on the device.

    The strategy calibrates the noise multiplier z once (:meth:`mechanism`) for every DP-SGD step a device may
    take over the run -- ``steps_per_participation * horizon`` -- under the RDP accountant of the Poisson-
    subsampled Gaussian, and sends (z, q, C, steps) in every message; each device charges the steps to its own
    ledger and refuses a message that would take it past its floor.

    Parameters
    ----------
    epsilon
        Target epsilon (> 0), e.g. 8. No default: the user chooses it.
    delta
        Target delta in (0, 1) (default 1e-5).
    clip_norm
        C: every per-record gradient is clipped to this L2 norm (default 1.0).
    sample_rate
        q in (0, 1]: the Poisson rate at which a step samples a device's records; the expected batch is q n_i on a
        device of n_i records (e.g. 64 / 6000). None: the strategy refuses to start and asks for it.
    horizon
        The most participations of one device the calibration covers (None: the run's number of rounds, which is
        exact when every device takes part in every round).

    Examples
    --------
    >>> PrivacyTarget(epsilon=8.0, sample_rate=0.01).mechanism(steps_per_participation=40, participations=20)
    DPSGDMechanism(noise_multiplier=..., sample_rate=0.01, clip_norm=1.0, steps=40)
    """

    epsilon: float
    delta: float = DEFAULT_DELTA
    clip_norm: float = 1.0
    sample_rate: float | None = None
    horizon: int | None = None

    def __post_init__(self) -> None:
        e = self.epsilon
        if isinstance(e, bool) or not isinstance(e, int | float) or not (math.isfinite(e) and e > 0):
            raise ValueError(f"PrivacyTarget epsilon must be a finite number > 0, got {e!r}")
        check_delta(self.delta, "PrivacyTarget delta")
        check_clip_norm(self.clip_norm, "PrivacyTarget clip_norm")
        if self.sample_rate is not None:
            check_sample_rate(self.sample_rate, "PrivacyTarget sample_rate")
        h = self.horizon
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
            raise ValueError(f"PrivacyTarget horizon must be an integer >= 1 or None, got {h!r}")

    def rate(self, owner: str) -> float:
        """q, or a ValueError telling the user of ``owner`` what to pass."""
        if self.sample_rate is None:
            raise ValueError(
                f"{owner} runs DP-SGD on the devices and needs the Poisson sample rate of their records: pass "
                "PrivacyTarget(..., sample_rate=q), the expected batch over the records per device (e.g. 64 / 6000)")
        return float(self.sample_rate)

    def mechanism(self, steps_per_participation: int, participations: int, owner: str = "the strategy") -> DPSGDMechanism:
        """(z, q, C, steps) with z calibrated for ``steps_per_participation * (horizon or participations)`` steps.

        Raises
        ------
        ValueError
            When no noise multiplier meets the target in those steps (the message names the knobs).
        """
        q = self.rate(owner)
        total = steps_per_participation * (self.horizon or participations)
        try:
            z = noise_multiplier_for(float(self.epsilon), float(self.delta), q, int(total))
        except ValueError as err:
            raise ValueError(f"PrivacyTarget epsilon: {err}") from None
        return DPSGDMechanism(noise_multiplier=z, sample_rate=q, clip_norm=float(self.clip_norm),
                              steps=steps_per_participation)

    def message_config(self, mechanism: DPSGDMechanism) -> dict[str, float | int | str | bool]:
        """The keys a client reads: the mechanism's, and the target (epsilon, delta) the devices report against."""
        return {**mechanism.message_config(), "dp-epsilon": float(self.epsilon), "dp-delta": float(self.delta)}


class PrivacyNotChosen(TypeError):
    """A DP-named strategy was built without ``privacy=``: the user has not said which privacy, if any, is meant."""


def require_privacy(privacy: Any, owner: str, reproduction: str = "") -> Any:
    """``privacy`` as given (a target, a paper's mechanism, or an explicit None); refuses :data:`MISSING`.

    Parameters
    ----------
    privacy
        The constructor's argument (:data:`MISSING` when not given).
    owner
        The strategy's name, for the message.
    reproduction
        The paper's own mechanism to name in the message (e.g. "Eq36Calibration(epsilon=..., delta=...)").

    Raises
    ------
    PrivacyNotChosen
        ``privacy`` is :data:`MISSING`; the message names what to pass. No epsilon is chosen for the user.
    """
    if privacy is MISSING:
        paper = f", privacy={reproduction} for the paper's own mechanism (the reproduction setting)" if reproduction else ""
        raise PrivacyNotChosen(
            f"{owner} is a differentially private strategy and needs privacy=: pass "
            f"privacy=PrivacyTarget(epsilon=..., sample_rate=...) (record-level DP-SGD on every device; delta defaults "
            f"to {DEFAULT_DELTA:g}){paper}, or privacy=None to train without noise. No epsilon is chosen for you.")
    return privacy
