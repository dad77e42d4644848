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
* **GDP** (Dong, Roth & Su 2022; :mod:`fedpdm_flower.fedapp.privacy.gdp`): the exact privacy of the composed Gaussian releases,
  ``mu = sqrt(sum_t 1 / z_t^2)``; no valid accountant reports less. The device's floor is checked with it.

Both rigorous figures are kept incrementally (the running ``sum 1 / z_t^2`` and the RDP vector over Opacus's
orders), so a release costs O(1) whatever the history; the lists of per-round values stay for other libraries to
recompute every figure. :meth:`PrivacyLedger.save` / :meth:`PrivacyLedger.load` keep a device's ledger in a file,
so its spend accumulates across runs.

The paper's own total, eq. (36), is :func:`fedpdm_flower.fedapp.privacy.gaussian.total_privacy_eq36`. No amplification by
subsampling is claimed by either accountant here: the server knows which clients participate, and the
sensitivity bound (35) is worst-case over mini-batches, so each participation is accounted at sample rate 1.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

__all__ = ["PrivacyLedger"]


#: Opacus's RDPAccountant.DEFAULT_ALPHAS (opacus 1.5), written out: importing opacus.accountants imports torch
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])


def _rdp_orders() -> list[float]:
    return list(RDP_ORDERS)


@functools.cache
def opacus_rdp() -> ModuleType:
    """Opacus's RDP analysis module (``opacus.accountants.analysis.rdp``: numpy and scipy only), loaded without
    running ``opacus/__init__``, which imports torch: a numpy-only device composes its ledger without torch.

    The module already imported (e.g. by a torch client) is reused; otherwise its file is executed under a private
    name, so nothing of ``opacus`` enters ``sys.modules``.
    """
    name = "opacus.accountants.analysis.rdp"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("opacus")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the privacy ledger needs opacus (its RDP analysis): pip install opacus")
    path = Path(next(iter(spec.submodule_search_locations))) / "accountants" / "analysis" / "rdp.py"
    mod_spec = importlib.util.spec_from_file_location("_fedapp_opacus_rdp", path)
    if mod_spec is None or mod_spec.loader is None:
        raise ModuleNotFoundError(f"cannot load Opacus's RDP analysis from {path}")
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=256)
def _release_rdp(z: float) -> tuple[float, ...]:
    """RDP of one Gaussian release with noise multiplier z at Opacus's default orders (sample rate 1)."""
    return tuple(float(v) for v in opacus_rdp().compute_rdp(q=1.0, noise_multiplier=z, steps=1, orders=_rdp_orders()))


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
    #: running sum of 1 / z_t^2 (inf once a release had no noise): the GDP state
    inv_sq_sum: float = 0.0
    #: running RDP vector at Opacus's default orders (empty: nothing recorded)
    rdp: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_delta(self.delta)
        if len(self.eps_rounds) != len(self.noise_multipliers):
            raise ValueError(
                f"eps_rounds and noise_multipliers must have equal length, got "
                f"{len(self.eps_rounds)} and {len(self.noise_multipliers)}"
            )
        self.eps_rounds = [float(e) for e in self.eps_rounds]
        self.noise_multipliers = [float(z) for z in self.noise_multipliers]
        if self.noise_multipliers and not self.rdp:  # a record written before the running state existed
            zs, self.noise_multipliers, self.inv_sq_sum = self.noise_multipliers, [], 0.0
            for z in zs:
                self._compose(z)
                self.noise_multipliers.append(z)
        self.rdp = [float(v) for v in self.rdp]
        self.inv_sq_sum = float(self.inv_sq_sum)

    def __len__(self) -> int:
        """Number of recorded participations."""
        return len(self.eps_rounds)

    def _compose(self, z: float) -> None:
        if z == 0.0:
            self.inv_sq_sum = math.inf
            self.rdp = [math.inf] * len(_rdp_orders())
            return
        self.inv_sq_sum += 1.0 / (z * z)
        one = _release_rdp(z)
        self.rdp = list(one) if not self.rdp else [a + b for a, b in zip(self.rdp, one, strict=True)]

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
        self._compose(float(noise_multiplier))
        self.eps_rounds.append(float(eps_round))
        self.noise_multipliers.append(float(noise_multiplier))

    def gdp_epsilon(self, delta: float | None = None) -> float:
        """The exact epsilon of the composed releases at ``delta`` (Gaussian DP; 0 with nothing recorded, inf if a
        release had no noise)."""
        from fedpdm_flower.fedapp.privacy import gdp

        target = self.delta if delta is None else delta
        _check_delta(target)
        if not math.isfinite(self.inv_sq_sum):
            return math.inf
        return gdp.epsilon_for(target, gdp.mu_of(self.inv_sq_sum))

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
        if not math.isfinite(self.inv_sq_sum):
            return math.inf
        with warnings.catch_warnings():
            # Opacus warns when the best order is at the edge of the grid; the bound is still valid, only looser.
            warnings.filterwarnings("ignore", message="Optimal order is the")
            eps, _ = opacus_rdp().get_privacy_spent(orders=_rdp_orders(), rdp=self.rdp, delta=target)
        return float(eps)

    def to_record(self) -> dict[str, list[float] | float]:
        """Plain-Python form for Flower's ``context.state`` (a ConfigRecord accepts floats and float lists)."""
        return {
            "delta": float(self.delta),
            "eps_rounds": list(self.eps_rounds),
            "noise_multipliers": list(self.noise_multipliers),
            "inv_sq_sum": float(self.inv_sq_sum),
            "rdp": list(self.rdp),
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
        running: dict[str, object] = {}
        if "inv_sq_sum" in record or "rdp" in record:  # the running state; an older record rebuilds it
            inv, rdp = record.get("inv_sq_sum"), record.get("rdp")
            if isinstance(inv, bool) or not isinstance(inv, (int, float)) or not isinstance(rdp, (list, tuple)) or \
                    not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in rdp):
                raise TypeError("privacy ledger 'inv_sq_sum' must be a float and 'rdp' a list of floats")
            running = {"inv_sq_sum": float(inv), "rdp": [float(v) for v in rdp]}
        return cls(delta=float(delta), eps_rounds=lists[0], noise_multipliers=lists[1], **running)  # type: ignore[arg-type]

    def save(self, path: str | Path) -> None:
        """Write the ledger to ``path`` (JSON), atomically: a device keeps its spend across runs."""
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.to_record()))
        tmp.replace(target)

    @classmethod
    def load(cls, path: str | Path, delta: float) -> PrivacyLedger:
        """The ledger in ``path``, or an empty one at ``delta`` when the file does not exist yet."""
        target = Path(path)
        if not target.exists():
            return cls(delta=delta)
        try:
            record = json.loads(target.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"privacy ledger {target}: unreadable ({type(err).__name__})") from None
        if not isinstance(record, dict):
            raise ValueError(f"privacy ledger {target}: not a ledger record")
        return cls.from_record(record)
