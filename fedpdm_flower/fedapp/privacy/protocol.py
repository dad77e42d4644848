"""Accountants that implement Flower's privacy-accounting protocol (``flwr.supercore.privacy_accounting``, 1.42).

Flower's :class:`~flwr.supercore.privacy_accounting.PrivacyAccountant` composes
:class:`~flwr.supercore.privacy_accounting.GaussianPrivacyEvent` s (a noise multiplier z = sigma / sensitivity and
the sampling of one release) and answers epsilon at a delta, delta at an epsilon, and "would this release pass the
budget?". Flower ships one backend, :class:`flwr.supercore.privacy_accounting.rdp_accountant.RdpAccountant` (RDP,
via Google's ``dp-accounting``). This module adds, behind the same protocol, so that any of them plugs into Flower's
own DP wrappers (``accountant=``) and into ours:

rigorous
    * :class:`GdpAccountant` -- exact for Gaussian releases without amplification: n Gaussians with multipliers
      z_i compose to exactly one Gaussian, mu-GDP with ``mu = sqrt(sum 1 / z_i^2)`` (Dong, Roth & Su 2022,
      Cor. 3.3), whose (eps, delta) curve is Balle & Wang's (2018, Thm. 8). No bound can be tighter; it is also
      instant, which matters when a server keeps one accountant per client.
    * :class:`PldAccountant` -- privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022, Google's
      ``dp-accounting``): the tightest numerical bound for Gaussian releases, tighter than RDP.
    * Flower's ``RdpAccountant`` (Mironov 2017), for which :func:`rdp_accountant` is a shortcut.
    * :class:`SkellamAccountant` -- the distributed Skellam mechanism's RDP bound (Agarwal, Kairouz & Liu 2021;
      :mod:`fedpdm_flower.fedapp.privacy.skellam`), its events :class:`SkellamPrivacyEvent` (a Gaussian event plus the noise
      variance and the L1 / L2 sensitivities in integer units), the RDP curve kept and added to (O(1) per release).
    * :class:`ZcdpAccountant` -- zero-concentrated DP (Bun & Steinke 2016): rho = sum count / (2 z^2), converted by
      their Prop. 1.3, ``eps = rho + 2 sqrt(rho ln(1/delta))``. The named accountant of DP-IADMM and DP-RECAL.

the papers' named formulas (reported beside a rigorous figure, never instead of it)
    * :class:`BasicCompositionAccountant` -- per release the classical Gaussian mechanism bound
      ``eps_t = sqrt(2 ln(1.25 / delta_t)) / z`` (Dwork & Roth 2014, Thm. A.1; DP-FedPDM's (32), DPQ-DSGD's
      Lemma 3), composed by adding (Thm. 3.16): ``(sum eps_t, n delta_t)``. Thm. A.1 needs eps_t < 1;
      :attr:`BasicCompositionAccountant.valid` says whether every release met it.
    * :class:`Eq36Accountant` -- DP-FedPDM's Theorem 2, eq. (36): ``c0 q^2 eps_t sqrt(p T / (1 - q))`` with
      p = sample_size / population_size, for T identical releases; c0 is the paper's unknown constant.

The formula accountants answer only what their formula states: epsilon at the delta it covers (inf below it) and
delta at an epsilon (1 where the formula says nothing). The amplification-free ones refuse a sampling method that
claims amplification.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    PrivacySpent,
    SamplingMethod,
)
from numpy.typing import NDArray

from fedpdm_flower.fedapp.privacy import gdp, skellam

__all__ = [
    "BasicCompositionAccountant",
    "Eq36Accountant",
    "GaussianAccountant",
    "GdpAccountant",
    "PldAccountant",
    "SkellamAccountant",
    "SkellamPrivacyEvent",
    "ZcdpAccountant",
    "no_amplification",
    "privacy_guard",
    "rdp_accountant",
]

_SCHEMA = 1


def no_amplification(target_delta: float, population_size: int = 1, max_epsilon: float | None = None) -> PrivacyConfig:
    """A :class:`PrivacyConfig` without sampling amplification (add-or-remove-one), the setting of every accountant
    here and of Flower's fixed-clipping wrappers: the server knows who takes part, so sampling hides nothing."""
    return PrivacyConfig(target_delta=target_delta, population_size=population_size,
                         neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                         sampling_method=SamplingMethod.NO_AMPLIFICATION, max_epsilon=max_epsilon)


def privacy_guard(target: Any) -> Callable[[], GdpAccountant]:
    """One exact accountant per client whose budget is ``target``'s (epsilon, delta) (a
    :class:`fedpdm_flower.fedapp.privacy.gaussian.GaussianTarget`): the strategy stops before a release would pass it. The
    budget is widened by 1e-9 relative, so that the T-th release of noise calibrated for exactly T is not refused
    for a rounding error."""
    config = no_amplification(target.delta, 1, max_epsilon=target.epsilon * (1 + 1e-9))
    return lambda: GdpAccountant(config)


def rdp_accountant(config: PrivacyConfig) -> Any:
    """Flower's own RDP accountant (needs ``dp-accounting``, a dependency of this project)."""
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    return RdpAccountant(config)


def _check_delta(delta: float) -> None:
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")


def _check_epsilon(epsilon: float) -> None:
    if isinstance(epsilon, bool) or not isinstance(epsilon, int | float) or math.isnan(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon must be a number >= 0, got {epsilon!r}")


class GaussianAccountant:
    """The protocol's bookkeeping shared by the accountants here: the config, the list of (event, count)
    compositions, state_dict / load_state_dict (the events, replayed on load), ``would_exceed`` on a copy.

    A subclass implements :meth:`_epsilon` and :meth:`_delta` of the composed events, and may refuse events in
    :meth:`_check_event`.
    """

    method = "gaussian"
    #: sampling methods the accountant's analysis covers
    supported_sampling: tuple[SamplingMethod, ...] = (SamplingMethod.NO_AMPLIFICATION,)

    def __init__(self, config: PrivacyConfig) -> None:
        if not isinstance(config, PrivacyConfig):
            raise TypeError(f"config must be a flwr PrivacyConfig, got {type(config).__name__}")
        if config.sampling_method not in self.supported_sampling:
            raise ValueError(f"{type(self).__name__} covers sampling_method in "
                             f"{[m.value for m in self.supported_sampling]}, not {config.sampling_method.value!r}")
        self._config = config
        self._compositions: list[tuple[GaussianPrivacyEvent, int]] = []

    # ------------------------------------------------------------------ the protocol
    @property
    def config(self) -> PrivacyConfig:
        return self._config

    @property
    def num_releases(self) -> int:
        return sum(count for _, count in self._compositions)

    def compose(self, event: GaussianPrivacyEvent, count: int = 1) -> None:
        if not isinstance(event, GaussianPrivacyEvent):
            raise TypeError(f"event must be a GaussianPrivacyEvent, got {type(event).__name__}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        if event.population_size != self._config.population_size:
            raise ValueError(f"event population_size {event.population_size} != the config's "
                             f"{self._config.population_size}")
        self._check_event(event)
        self._compositions.append((event, count))
        self._composed(event, count)

    def get_epsilon(self, delta: float) -> float:
        _check_delta(delta)
        return 0.0 if not self._compositions else float(self._epsilon(delta))

    def get_delta(self, epsilon: float) -> float:
        _check_epsilon(epsilon)
        return 0.0 if not self._compositions else float(min(1.0, self._delta(epsilon)))

    def get_privacy_spent(self, delta: float | None = None) -> PrivacySpent:
        target = self._config.target_delta if delta is None else delta
        return PrivacySpent(epsilon=self.get_epsilon(target), delta=target, num_releases=self.num_releases,
                            accounting_method=self.method)

    def would_exceed(self, event: GaussianPrivacyEvent, max_epsilon: float | None = None, count: int = 1) -> bool:
        limit = self._config.max_epsilon if max_epsilon is None else max_epsilon
        if limit is None:
            return False
        projected = copy.deepcopy(self)
        projected.compose(event, count)
        return bool(projected.get_privacy_spent().epsilon > limit)

    def state_dict(self) -> dict[str, object]:
        c = self._config
        return {"schema_version": _SCHEMA, "backend": self.method,
                "config": {"target_delta": c.target_delta, "population_size": c.population_size,
                           "neighboring_relation": c.neighboring_relation.value,
                           "sampling_method": c.sampling_method.value, "max_epsilon": c.max_epsilon},
                "compositions": [{"event": {"noise_multiplier": e.noise_multiplier, "sample_size": e.sample_size,
                                            "population_size": e.population_size}, "count": n}
                                 for e, n in self._compositions]}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if state.get("schema_version") != _SCHEMA or state.get("backend") != self.method:
            raise ValueError(f"not a {self.method} accountant state (schema {_SCHEMA}): "
                             f"{state.get('backend')!r} v{state.get('schema_version')!r}")
        raw = state.get("config")
        if not isinstance(raw, dict):
            raise ValueError("accountant state has no config")
        config = PrivacyConfig(target_delta=raw["target_delta"], population_size=raw["population_size"],
                               neighboring_relation=NeighboringRelation(raw["neighboring_relation"]),
                               sampling_method=SamplingMethod(raw["sampling_method"]),
                               max_epsilon=raw["max_epsilon"])
        if config != self._config:
            raise ValueError("accountant state's privacy configuration differs from this accountant's")
        items = state.get("compositions")
        if not isinstance(items, list):
            raise ValueError("accountant state has no compositions list")
        fresh = copy.deepcopy(self)
        fresh._reset()
        for item in items:
            fresh.compose(GaussianPrivacyEvent(**item["event"]), int(item["count"]))
        self.__dict__.update(fresh.__dict__)

    # ------------------------------------------------------------------ for subclasses
    def _check_event(self, event: GaussianPrivacyEvent) -> None:
        """Refuse an event the analysis does not cover."""

    def _composed(self, event: GaussianPrivacyEvent, count: int) -> None:
        """Update a backend after a composition."""

    def _reset(self) -> None:
        self._compositions = []

    def _epsilon(self, delta: float) -> float:
        raise NotImplementedError

    def _delta(self, epsilon: float) -> float:
        raise NotImplementedError


class GdpAccountant(GaussianAccountant):
    """Exact accounting of Gaussian releases without amplification, by Gaussian DP (Dong, Roth & Su 2022).

    A release with noise multiplier z is (1/z)-GDP, and GDP composes exactly: n releases are mu-GDP with
    ``mu = sqrt(sum_i 1 / z_i^2)`` (Cor. 3.3), that is, exactly as private as one Gaussian release with noise
    multiplier 1/mu. Its privacy curve is ``delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)`` (Balle &
    Wang 2018, Thm. 8; Dong et al., Cor. 2.13); epsilon at a delta is that curve inverted numerically.
    """

    method = "gdp"

    @property
    def mu(self) -> float:
        return gdp.mu_of(math.fsum(n / e.noise_multiplier**2 for e, n in self._compositions))

    def _delta(self, epsilon: float) -> float:
        return gdp.delta_for(epsilon, self.mu)

    def _epsilon(self, delta: float) -> float:
        return gdp.epsilon_for(delta, self.mu)


class PldAccountant(GaussianAccountant):
    """Privacy loss distributions (``dp_accounting.pld.PLDAccountant``): the tightest of the rigorous bounds.

    Covers no amplification (the Gaussian mechanism) and Poisson sampling (the subsampled Gaussian), both under
    add-or-remove-one.

    Parameters
    ----------
    config
        Flower's privacy configuration.
    value_discretization_interval
        The PLD grid step (dp-accounting's default 1e-4); the result is a valid upper bound at any step.
    """

    method = "pld"
    supported_sampling = (SamplingMethod.NO_AMPLIFICATION, SamplingMethod.POISSON)

    def __init__(self, config: PrivacyConfig, value_discretization_interval: float = 1e-4) -> None:
        super().__init__(config)
        if not (math.isfinite(value_discretization_interval) and value_discretization_interval > 0):
            raise ValueError(f"value_discretization_interval must be > 0, got {value_discretization_interval!r}")
        self.value_discretization_interval = value_discretization_interval
        self._reset()

    def _reset(self) -> None:
        from dp_accounting.pld import privacy_loss_distribution as pld

        super()._reset()
        self._pld = pld.identity(value_discretization_interval=self.value_discretization_interval)

    def _composed(self, event: GaussianPrivacyEvent, count: int) -> None:
        # what dp_accounting's PLDAccountant composes for a (Poisson-sampled) Gaussian event, from a cache: the
        # same release recurs every round (fedpdm_flower.fedapp.privacy.pld.composed_pld)
        from fedpdm_flower.fedapp.privacy.pld import composed_pld

        poisson = self._config.sampling_method is SamplingMethod.POISSON
        q = event.sample_size / event.population_size if poisson else None
        self._pld = self._pld.compose(composed_pld(event.noise_multiplier, q, count, self.value_discretization_interval))

    def _epsilon(self, delta: float) -> float:
        return float(self._pld.get_epsilon_for_delta(delta))

    def _delta(self, epsilon: float) -> float:
        return float(self._pld.get_delta_for_epsilon(epsilon))


class ZcdpAccountant(GaussianAccountant):
    """Zero-concentrated DP of Gaussian releases (Bun & Steinke 2016): a release with noise multiplier z is
    ``1 / (2 z^2)``-zCDP (Prop. 1.6), compositions add (Lemma 2.3), and rho-zCDP gives
    ``(rho + 2 sqrt(rho ln(1/delta)), delta)``-DP (Prop. 1.3). No amplification by sampling."""

    method = "zcdp"

    @property
    def rho(self) -> float:
        return math.fsum(n / (2.0 * e.noise_multiplier**2) for e, n in self._compositions)

    def _epsilon(self, delta: float) -> float:
        rho = self.rho
        return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))

    def _delta(self, epsilon: float) -> float:
        rho = self.rho
        # Prop. 1.3 solved for delta: ln(1/delta) = (eps - rho)^2 / (4 rho), for eps > rho
        return 1.0 if epsilon <= rho else math.exp(-((epsilon - rho) ** 2) / (4.0 * rho))


class BasicCompositionAccountant(GaussianAccountant):
    """The classical Gaussian mechanism per release, composed by adding (Dwork & Roth, Thm. A.1 and Thm. 3.16).

    A release with noise multiplier z is ``(sqrt(2 ln(1.25 / delta_t)) / z, delta_t)``-DP when that epsilon is < 1;
    n releases give ``(sum eps_t, n delta_t)``. This is the figure DP-FedPDM's (32) and DPQ-DSGD's Lemma 3 are built
    on; past eps_t = 1 Thm. A.1 no longer holds and :attr:`valid` turns False (the figure is still what the
    paper's formula says).

    Parameters
    ----------
    config
        Flower's privacy configuration (no amplification).
    release_delta
        delta_t of every release; None uses ``config.target_delta``.
    """

    method = "basic-composition"

    def __init__(self, config: PrivacyConfig, release_delta: float | None = None) -> None:
        super().__init__(config)
        self.release_delta = config.target_delta if release_delta is None else release_delta
        _check_delta(self.release_delta)

    def release_epsilon(self, event: GaussianPrivacyEvent) -> float:
        """eps_t of one release (Thm. A.1 solved for epsilon)."""
        return math.sqrt(2.0 * (math.log(1.25) - math.log(self.release_delta))) / event.noise_multiplier

    @property
    def valid(self) -> bool:
        """Whether every release had eps_t < 1, where Thm. A.1 holds."""
        return all(self.release_epsilon(e) < 1.0 for e, _ in self._compositions)

    def get_privacy_spent(self, delta: float | None = None) -> PrivacySpent:
        """At the formula's own delta (n delta_t) unless a delta is given: basic composition spends delta too."""
        return super().get_privacy_spent(self._totals()[1] if delta is None and self._compositions else delta)

    def _totals(self) -> tuple[float, float]:
        eps = math.fsum(n * self.release_epsilon(e) for e, n in self._compositions)
        return eps, self.num_releases * self.release_delta

    def _epsilon(self, delta: float) -> float:
        eps, spent_delta = self._totals()
        return eps if delta >= spent_delta * (1 - 1e-12) else math.inf

    def _delta(self, epsilon: float) -> float:
        eps, spent_delta = self._totals()
        return spent_delta if epsilon >= eps else 1.0


class Eq36Accountant(BasicCompositionAccountant):
    """DP-FedPDM's total privacy, Theorem 2 eq. (36): ``c0 q^2 eps_t sqrt(p T / (1 - q))``.

    eps_t is the per-release epsilon of (32) (:meth:`BasicCompositionAccountant.release_epsilon`), p the client
    sampling fraction ``sample_size / population_size`` of the events and T the number of releases. The formula
    is stated for T identical releases, so events with another z or p are refused. It states a guarantee at the
    paper's delta only (c0 "depends on delta", spec A2): epsilon at a smaller delta is inf.

    Parameters
    ----------
    config
        Flower's privacy configuration (no amplification: p enters through the formula, not the sampling model).
    data_fraction
        q in (0, 1): a client's local steps times batch over its data size (:func:`fedpdm_flower.fedapp.privacy.data_fraction`).
    c0
        The paper's unknown constant (default 1.0, as in the rest of the project).
    q_power
        Exponent of q (2 as printed; the predecessor paper's 1, spec A4).
    """

    method = "fedpdm-eq36"

    def __init__(self, config: PrivacyConfig, data_fraction: float, c0: float = 1.0, q_power: float = 2.0,
                 release_delta: float | None = None) -> None:
        super().__init__(config, release_delta)
        if not 0.0 < data_fraction < 1.0:
            raise ValueError(f"data_fraction must lie in (0, 1), got {data_fraction!r}")
        if not (math.isfinite(c0) and c0 > 0):
            raise ValueError(f"c0 must be a finite number > 0, got {c0!r}")
        self.data_fraction, self.c0, self.q_power = data_fraction, c0, q_power

    def _check_event(self, event: GaussianPrivacyEvent) -> None:
        if self._compositions:
            first = self._compositions[0][0]
            if (event.noise_multiplier, event.sample_size) != (first.noise_multiplier, first.sample_size):
                raise ValueError("eq. (36) covers T identical releases; this event's noise multiplier or sample size "
                                 "differs from the first one's (use a rigorous accountant for varying releases)")

    def _epsilon(self, delta: float) -> float:
        from fedpdm_flower.fedapp.privacy.gaussian import total_privacy_eq36

        if delta < self.release_delta * (1 - 1e-12):
            return math.inf
        event = self._compositions[0][0]
        p = event.sample_size / event.population_size
        return total_privacy_eq36(self.release_epsilon(event), self.c0, self.data_fraction, p, self.num_releases,
                                  q_power=self.q_power)

    def _delta(self, epsilon: float) -> float:
        return self.release_delta if epsilon >= self._epsilon(self.release_delta) else 1.0


@dataclass(frozen=True)
class SkellamPrivacyEvent(GaussianPrivacyEvent):
    """One Skellam release: Flower's event (``noise_multiplier`` = sqrt(variance) / l2, the std over the L2
    sensitivity, as the Gaussian's) plus the total noise variance per coordinate and the integer-unit L1 and L2
    sensitivities the bound needs."""

    variance: float = 0.0
    l1_sensitivity: float = 0.0
    l2_sensitivity: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("variance", "l1_sensitivity", "l2_sensitivity"):
            skellam._positive(name, getattr(self, name))
        if not math.isclose(self.noise_multiplier, math.sqrt(self.variance) / self.l2_sensitivity, rel_tol=1e-9):
            raise ValueError("noise_multiplier must equal sqrt(variance) / l2_sensitivity")

    @classmethod
    def of(cls, variance: float, l1: float, l2: float, population_size: int = 1) -> SkellamPrivacyEvent:
        return cls(noise_multiplier=math.sqrt(variance) / l2, sample_size=population_size,
                   population_size=population_size, variance=variance, l1_sensitivity=l1, l2_sensitivity=l2)


class SkellamAccountant(GaussianAccountant):
    """RDP accounting of Skellam releases behind Flower's protocol: the RDP vector over :data:`fedpdm_flower.fedapp.privacy.skellam.ORDERS` is kept and
    added to on each composition (O(1) per release), converted to (epsilon, delta) on demand. No amplification by
    sampling: the server knows who took part. A plain ``GaussianPrivacyEvent`` is refused (its bound is not the
    Skellam one)."""

    method = "skellam-rdp"

    def __init__(self, config: PrivacyConfig) -> None:
        super().__init__(config)
        self._rdp = np.zeros(len(skellam.ORDERS))

    def _check_event(self, event: GaussianPrivacyEvent) -> None:
        if not isinstance(event, SkellamPrivacyEvent):
            raise TypeError("SkellamAccountant composes SkellamPrivacyEvent (variance and L1 / L2 sensitivities); "
                            f"got {type(event).__name__}")

    def _composed(self, event: GaussianPrivacyEvent, count: int) -> None:
        assert isinstance(event, SkellamPrivacyEvent)
        self._rdp = self._rdp + count * skellam.skellam_rdp(event.variance, event.l1_sensitivity, event.l2_sensitivity)

    def _reset(self) -> None:
        super()._reset()
        self._rdp = np.zeros(len(skellam.ORDERS))

    @property
    def rdp(self) -> NDArray[np.float64]:
        return self._rdp.copy()

    def _epsilon(self, delta: float) -> float:
        return skellam.epsilon_of_rdp(self._rdp, delta)

    def _delta(self, epsilon: float) -> float:
        a = np.asarray(skellam.ORDERS, dtype=np.float64)
        # the same conversion solved for delta, at the best order
        log_delta = (a - 1) * (self._rdp - epsilon + np.log((a - 1) / a)) - np.log(a)
        return float(min(1.0, math.exp(min(0.0, float(np.min(log_delta))))))

    def state_dict(self) -> dict[str, object]:
        state = super().state_dict()
        comps = state["compositions"]
        assert isinstance(comps, list)
        for item, (event, _) in zip(comps, self._compositions, strict=True):
            assert isinstance(event, SkellamPrivacyEvent)
            item["event"].update({"variance": event.variance, "l1_sensitivity": event.l1_sensitivity,
                                  "l2_sensitivity": event.l2_sensitivity})
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        fresh = copy.deepcopy(self)
        fresh._reset()
        items = state.get("compositions")
        if not isinstance(items, list):
            raise ValueError("accountant state has no compositions list")
        plain = {**state, "compositions": []}
        GaussianAccountant.load_state_dict(fresh, plain)
        for item in items:
            fresh.compose(SkellamPrivacyEvent(**item["event"]), int(item["count"]))
        self.__dict__.update(fresh.__dict__)
