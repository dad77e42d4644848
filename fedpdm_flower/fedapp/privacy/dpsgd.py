"""Record-level DP-SGD on a device: one noisy gradient step any local solver can call, and the device's accountant.

The mechanism is DP-SGD (Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang, "Deep Learning with Differential
Privacy", CCS 2016, Alg. 1), the form Opacus implements. At every local step a device with n records

1. draws a Poisson sample B of its records: each record independently with probability q (the sample rate),
   from the device's own randomness (:func:`poisson_sample`);
2. computes the gradient g_j of every sampled record's loss and clips it to L2 norm C: ``g_j min(1, C / ||g_j||)``
   (:func:`clipped_gradient_sum`);
3. adds Gaussian noise N(0, z^2 C^2 I) to the clipped sum and divides by the *expected* batch size q n
   (:func:`noisy_gradient`): ``g~ = (sum_{j in B} clip_C(g_j) + N(0, z^2 C^2 I)) / (q n)``.

An empty Poisson sample still steps (noise only): the analysis of the subsampled Gaussian assumes every step
releases, and skipping one would tell that the batch was empty. The fixed denominator q n (not |B|) keeps the
sensitivity of the released sum at C for add-or-remove-one neighbours.

Everything a solver does with g~ (proximal terms, duals, momentum, sparsification, quantization, relaying) is
post-processing. A term of the gradient that does not depend on the data (a regulariser such as FedPDM's
beta sum x^2 / (1 + x^2), an l2 penalty) is added after the noise without clipping: its value is a function of x,
which is itself post-processing of earlier releases (:func:`data_independent_grad`).

**Unit and adversary.** One record of this device's data, add-or-remove-one neighbours; against everyone who sees
anything the device sends, the server included: the release is private when it leaves the device. Amplification by
subsampling is claimed because the sample is drawn on the device, from randomness nobody else knows.

**Accountant: Renyi DP of the Poisson-subsampled Gaussian** (Mironov, Talwar & Zhang 2019, "Renyi Differential
Privacy of the Sampled Gaussian Mechanism"), composed over every step the device ever took and converted to
(epsilon, delta) as Opacus's ``RDPAccountant`` does (Balle et al. 2020's conversion), with Opacus's analysis module
(:func:`fedpdm_flower.fedapp.privacy.accountants.opacus_rdp`, numpy only) at Opacus's default orders. Why RDP rather
than PLD: the device's state is one RDP vector (151 floats) that composes by addition, so the ledger fits in
``context.state``, every check of the device floor is O(1) whatever the history, and a numpy-only device needs no
PLD grid; the price is epsilon about 8-11 % above the PLD figure for the same noise. A second, independent
implementation of the same accountant (dp-accounting's ``RdpAccountant``) recomputes it in the tests and in the
quick start's summary (:func:`recompute_epsilon`).

**Randomness.** The functions here take a ``numpy.random.Generator``; :func:`device_rng` gives one seeded from the
operating system's entropy. A seed anybody else knows (the reproduction app's run seed is the server's) would let
them recompute the sample and subtract the noise, so clients draw DP-SGD randomness from :func:`device_rng`.
``secure=True`` in :func:`gaussian_noise` draws the noise from ``os.urandom`` (a CSPRNG) instead of PCG64.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.privacy.accountants import RDP_ORDERS, opacus_rdp
from fedpdm_flower.fedapp.privacy.calibration_cache import calibrated

__all__ = [
    "DPSGDLedger",
    "DPSGDMechanism",
    "DPSGDStep",
    "PerSampleGradients",
    "clip_rows",
    "clipped_gradient_sum",
    "data_independent_grad",
    "device_rng",
    "dpsgd_epsilon",
    "gaussian_noise",
    "noise_multiplier_for",
    "noisy_gradient",
    "poisson_sample",
    "recompute_epsilon",
]

FloatArray = NDArray[np.float64]

#: the range a calibration searches for z: below 0.01 the RDP bound of any realistic run is astronomically large,
#: above 1e4 the noise swamps every gradient (and RDP at Opacus's orders cannot go lower anyway)
Z_RANGE = (0.01, 1.0e4)


# ---------------------------------------------------------------------------------------------------- checks
def _check_number(name: str, value: Any, *, lo: float = 0.0, hi: float = math.inf, lo_open: bool = True,
                  hi_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
        left, right = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"{name} must lie in {left}{lo:g}, {hi:g}{right}, got {value!r}")
    return v


def _check_steps(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_sample_rate(q: Any, name: str = "sample_rate") -> float:
    """q in (0, 1]: the Poisson sampling rate of the device's records (ValueError naming ``name``)."""
    return _check_number(name, q, lo=0.0, hi=1.0)


def check_clip_norm(c: Any, name: str = "clip_norm") -> float:
    """C > 0 (ValueError naming ``name``)."""
    return _check_number(name, c)


def check_delta(delta: Any, name: str = "delta") -> float:
    """delta in (0, 1) (ValueError naming ``name``)."""
    return _check_number(name, delta, lo=0.0, hi=1.0, hi_open=True)


# ---------------------------------------------------------------------------------------------------- the step
@dataclass(frozen=True)
class DPSGDMechanism:
    """What one participation asks of a device: ``steps`` DP-SGD steps with noise multiplier z, Poisson rate q and
    clip norm C. The strategy sends it in the message config (:meth:`message_config`); the device reads it back
    (:meth:`from_config`), checks it against its floor and charges every one of the ``steps`` to its ledger.

    Parameters
    ----------
    noise_multiplier
        z > 0: the noise std over the clip norm.
    sample_rate
        q in (0, 1]: each record is in a step's sample with probability q.
    clip_norm
        C > 0: every per-record gradient is clipped to this L2 norm.
    steps
        The most DP-SGD steps the participation may take (>= 1): what the device charges, whatever the solver's
        stopping rule then does (stopping early is post-processing of the releases, never a refund).
    """

    noise_multiplier: float
    sample_rate: float
    clip_norm: float
    steps: int

    def __post_init__(self) -> None:
        _check_number("noise_multiplier", self.noise_multiplier)
        check_sample_rate(self.sample_rate)
        check_clip_norm(self.clip_norm)
        _check_steps("steps", self.steps)

    #: the message-config keys (one name each; ``clip`` is the clip norm key every solver of the project reads)
    KEYS = ("dp-noise-multiplier", "dp-sample-rate", "clip", "dp-steps")

    def message_config(self) -> dict[str, float | int | str | bool]:
        """The keys a client reads: ``dp-mechanism = "dp-sgd"``, z, q, C and the steps charged."""
        return {"dp": True, "dp-mechanism": "dp-sgd", "dp-noise-multiplier": self.noise_multiplier,
                "dp-sample-rate": self.sample_rate, "clip": self.clip_norm, "dp-steps": self.steps}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DPSGDMechanism:
        """The mechanism of a message config (untrusted: every value is checked, the error names the key)."""
        for key in cls.KEYS:
            if key not in config:
                raise ValueError(f"message config lacks {key!r} (DP-SGD needs z, q, C and the steps)")
        try:
            return cls(noise_multiplier=config["dp-noise-multiplier"], sample_rate=config["dp-sample-rate"],
                       clip_norm=config["clip"], steps=config["dp-steps"])
        except ValueError as err:
            names = {"noise_multiplier": "dp-noise-multiplier", "sample_rate": "dp-sample-rate",
                     "clip_norm": "clip", "steps": "dp-steps"}
            text = str(err)
            for field_name, key in names.items():
                if text.startswith(field_name):
                    raise ValueError(f"message config {key!r}: {text}") from None
            raise


class PerSampleGradients(Protocol):
    """A model with per-record gradients: what the DP-SGD step needs (every model of :mod:`fedpdm_flower.fedapp.models`).

    ``per_sample_grads(x, inputs, targets)`` returns the (B, d) gradients of each record's loss term (the part of
    the objective that depends on the data); a model may add ``clipped_grad_sum(x, inputs, targets, clip)`` (the
    sum of the clipped rows, without materialising them) and ``regularizer_grad(x)`` (the gradient of the
    data-independent part of its loss, added unclipped).
    """

    def per_sample_grads(self, x: FloatArray, features: Any, targets: Any) -> FloatArray:
        """Row j: the gradient at x of record j's loss term."""
        ...


def clip_rows(grads: NDArray[Any], clip: float) -> FloatArray:
    """Each row times ``min(1, clip / ||row||)``: per-record clipping to L2 norm ``clip`` (Abadi et al., Alg. 1)."""
    g = np.asarray(grads, dtype=np.float64)
    if g.ndim != 2:
        raise ValueError(f"per-record gradients must be a (records, d) matrix, got shape {g.shape}")
    norms = np.linalg.norm(g, axis=1)
    factor = np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))
    return np.asarray(g * factor[:, None], dtype=np.float64)


def clipped_gradient_sum(model: Any, x: FloatArray, features: Any, targets: Any, clip: float) -> FloatArray:
    """``sum_j clip_C(g_j)`` over the given records: the model's own ``clipped_grad_sum`` when it has one (the linear
    models' closed forms, torch's vmap), else :func:`clip_rows` of its ``per_sample_grads``."""
    fast = getattr(model, "clipped_grad_sum", None)
    if callable(fast):
        return np.asarray(fast(x, features, targets, clip), dtype=np.float64)
    per = getattr(model, "per_sample_grads", None)
    if not callable(per):
        raise TypeError(f"{type(model).__name__} has no per_sample_grads: DP-SGD clips every record's gradient "
                        "(torch modules and the numpy models of this project have them)")
    rows = np.asarray(per(x, features, targets), dtype=np.float64)
    return clip_rows(rows, clip).sum(axis=0) if len(rows) else np.zeros(len(x))


def data_independent_grad(model: Any, x: FloatArray) -> FloatArray | None:
    """The gradient of the part of the model's loss that does not depend on the data (None if it has none)."""
    reg = getattr(model, "regularizer_grad", None)
    return None if not callable(reg) else np.asarray(reg(x), dtype=np.float64)


def device_rng() -> np.random.Generator:
    """A generator seeded from the operating system's entropy (128 bits): the device's own randomness."""
    return np.random.default_rng(secrets.randbits(128))


def poisson_sample(n: int, q: float, rng: np.random.Generator) -> NDArray[np.int64]:
    """The indices of a Poisson sample of n records at rate q: each record independently with probability q."""
    check_sample_rate(q)
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"the device needs at least one record, got n = {n!r}")
    return np.flatnonzero(rng.random(int(n)) < q).astype(np.int64)


def _urandom_normal(size: int) -> FloatArray:
    """Standard normals from ``os.urandom`` (a CSPRNG) by the Box-Muller transform, 53-bit uniforms."""
    m = (size + 1) // 2
    raw = np.frombuffer(os.urandom(16 * m), dtype=np.uint64).reshape(2, m)
    u1 = ((raw[0] >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53  # in (0, 1]: log(u1) is finite
    u2 = (raw[1] >> np.uint64(11)).astype(np.float64) * 2.0**-53
    r = np.sqrt(-2.0 * np.log(u1))
    return np.concatenate([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)])[:size]


def gaussian_noise(d: int, std: float, rng: np.random.Generator, *, secure: bool = False) -> FloatArray:
    """d i.i.d. N(0, std^2) draws: from ``rng``, or with ``secure`` from ``os.urandom`` (Box-Muller).

    Floating-point Gaussian samplers are not exactly Gaussian (Jin et al., "Are We There Yet? Timing and
    Floating-Point Attacks on Differential Privacy Systems", S&P 2022); neither is Opacus's, and the accounting
    here, like Opacus's, treats the draws as exact.
    """
    _check_number("noise std", std, lo=0.0, lo_open=False)
    if secure:
        return std * _urandom_normal(d)
    return rng.normal(0.0, std, size=d)


def noisy_gradient(clipped_sum: FloatArray, mechanism: DPSGDMechanism, num_records: int, rng: np.random.Generator,
                   *, secure: bool = False) -> FloatArray:
    """``(sum + N(0, z^2 C^2 I)) / (q n)``: the release of one DP-SGD step (Abadi et al., Alg. 1, "add noise")."""
    s = np.asarray(clipped_sum, dtype=np.float64)
    noise = gaussian_noise(len(s), mechanism.noise_multiplier * mechanism.clip_norm, rng, secure=secure)
    return (s + noise) / (mechanism.sample_rate * num_records)


class DPSGDStep:
    """The noisy gradient oracle of one participation: ``step(x)`` is g~ at x (module docstring), and counts.

    Parameters
    ----------
    model
        Gives per-record gradients (:class:`PerSampleGradients`).
    data
        The device's records (:class:`fedpdm_flower.fedapp.localdata.LocalData`): ``len(data)`` and ``data.batch(idx)``.
    mechanism
        z, q, C and the steps this participation may take: a call past ``mechanism.steps`` raises (the device
        was charged for exactly that many).
    rng
        The device's generator for the Poisson samples and the noise (:func:`device_rng`).
    secure
        Draw the noise from ``os.urandom`` (:func:`gaussian_noise`).
    """

    def __init__(self, model: Any, data: Any, mechanism: DPSGDMechanism, rng: np.random.Generator, *,
                 secure: bool = False) -> None:
        if getattr(model, "has_float_buffers", False):
            raise ValueError(
                f"DP-SGD clips each record's gradient, but the model has floating-point buffers "
                f"{list(getattr(model, 'buffer_names', []))[:3]} (BatchNorm running statistics), which mix the records "
                "of a batch outside the per-record analysis: replace BatchNorm with GroupNorm (Opacus's "
                "ModuleValidator.fix does it: net = opacus.validators.ModuleValidator.fix(net))")
        self.model, self.data, self.mechanism, self.rng, self.secure = model, data, mechanism, rng, secure
        self.n = len(data)
        if self.n < 1:
            raise ValueError("DP-SGD needs at least one local record")
        self.taken = 0
        self.sampled = 0  # records used over the steps taken (sum of the Poisson batch sizes)

    def __call__(self, x: FloatArray) -> FloatArray:
        m = self.mechanism
        if self.taken >= m.steps:
            raise RuntimeError(f"DP-SGD step {self.taken + 1} asked for, but the device was charged for {m.steps}")
        idx = poisson_sample(self.n, m.sample_rate, self.rng)
        if len(idx):
            inputs, targets = self.data.batch(idx)
            total = clipped_gradient_sum(self.model, x, inputs, targets, m.clip_norm)
        else:  # an empty sample still releases: noise only
            total = np.zeros(len(x))
        g = noisy_gradient(total, m, self.n, self.rng, secure=self.secure)
        reg = data_independent_grad(self.model, x)
        self.taken += 1
        self.sampled += len(idx)
        return g if reg is None else g + reg


# ---------------------------------------------------------------------------------------------------- accounting
@functools.lru_cache(maxsize=1024)
def _step_rdp(z: float, q: float) -> tuple[float, ...]:
    """RDP of one Poisson-subsampled Gaussian step (Mironov, Talwar & Zhang 2019) at Opacus's orders."""
    return tuple(float(v) for v in opacus_rdp().compute_rdp(q=q, noise_multiplier=z, steps=1, orders=list(RDP_ORDERS)))


def _epsilon_of_rdp(rdp: NDArray[np.float64] | list[float], delta: float) -> float:
    if not np.all(np.isfinite(rdp)):
        return math.inf
    with warnings.catch_warnings():  # Opacus warns when the best order is at the grid's edge: still a valid bound
        warnings.filterwarnings("ignore", message="Optimal order is the")
        eps, _ = opacus_rdp().get_privacy_spent(orders=list(RDP_ORDERS), rdp=np.asarray(rdp), delta=delta)
    return float(eps)


def dpsgd_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """epsilon at ``delta`` of ``steps`` DP-SGD steps with z, q, under the RDP accountant (module docstring)."""
    z = _check_number("noise_multiplier", noise_multiplier)
    q = check_sample_rate(sample_rate)
    n = _check_steps("steps", steps)
    return _epsilon_of_rdp(np.asarray(_step_rdp(z, q)) * n, check_delta(delta))


@functools.lru_cache(maxsize=256)
def noise_multiplier_for(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest z (to 1e-4 relative) whose ``steps`` DP-SGD steps at rate q are (epsilon, delta)-DP under the
    RDP accountant: the calibration of :class:`fedpdm_flower.fedapp.privacy.target.PrivacyTarget`.

    Raises
    ------
    ValueError
        Naming the knob, when no z in ``Z_RANGE`` meets the target (RDP at Opacus's orders cannot certify an
        epsilon below about 0.2 at delta = 1e-5 for any noise: raise epsilon or delta, lower the steps or q).
    """
    eps = _check_number("epsilon", epsilon)
    d = check_delta(delta)
    q = check_sample_rate(sample_rate)
    n = _check_steps("steps", steps)
    lo_z = Z_RANGE[0]

    def holds(z: float) -> bool:  # what the search below guarantees, for a value read from the cache
        return (lo_z <= z <= Z_RANGE[1] and dpsgd_epsilon(z, q, n, d) <= eps
                and (z == lo_z or dpsgd_epsilon(z / (1.0 + 1e-4), q, n, d) > eps))

    return calibrated("dpsgd-rdp", (eps, d, q, n), lambda: _search_noise_multiplier(eps, d, q, n), holds)


def _search_noise_multiplier(eps: float, d: float, q: float, n: int) -> float:
    """:func:`noise_multiplier_for`'s search: Illinois regula falsi on log z, to 1e-4 relative."""
    lo_z, hi_z = Z_RANGE

    def log_excess(z: float) -> float:  # log eps(z) - log target: decreasing in z
        return math.log(max(dpsgd_epsilon(z, q, n, d), 1e-300)) - math.log(eps)

    # bracket [lo, hi] with eps(lo) > target >= eps(hi), starting from z = 1 (where realistic targets are)
    f1 = log_excess(1.0)
    if f1 > 0:
        if log_excess(hi_z) > 0:
            raise ValueError(
                f"epsilon = {eps:g} at delta = {d:g} cannot be met by any noise multiplier (z <= {hi_z:g}) over {n} "
                f"DP-SGD steps at sample_rate q = {q:g} under the RDP accountant (its floor here is "
                f"{dpsgd_epsilon(hi_z, q, n, d):.3g}): raise epsilon or delta, or lower the steps (rounds, local "
                "steps) or the sample rate")
        lo, flo, hi = 1.0, f1, 2.0
        fhi = log_excess(hi)
        while fhi > 0:
            lo, flo, hi = hi, fhi, min(2.0 * hi, hi_z)
            fhi = log_excess(hi)
    else:
        hi, fhi, lo = 1.0, f1, 0.5
        flo = log_excess(lo)
        while flo <= 0:
            if lo <= lo_z:
                return lo_z  # even the least noise searched meets the target
            hi, fhi, lo = lo, flo, max(0.5 * lo, lo_z)
            flo = log_excess(lo)
    # Illinois regula falsi on log z: the bracket keeps eps(lo) > target >= eps(hi) and shrinks superlinearly
    side = 0
    while hi / lo > 1.0 + 1e-4:
        a, b = math.log(lo), math.log(hi)
        mid = math.exp(b - fhi * (b - a) / (fhi - flo)) if flo != fhi else math.sqrt(lo * hi)
        if not lo < mid < hi:
            mid = math.sqrt(lo * hi)
        fm = log_excess(mid)
        if fm > 0:
            lo, flo = mid, fm
            if side == -1:
                fhi /= 2.0
            side = -1
        else:
            hi, fhi = mid, fm
            if side == 1:
                flo /= 2.0
            side = 1
    return hi


def recompute_epsilon(history: list[tuple[float, float, int]], delta: float, orders: list[float] | None = None) -> float:
    """The epsilon of a (z, q, steps) history by a second, independent implementation of the same accountant:
    dp-accounting's ``RdpAccountant`` (its own subsampled-Gaussian RDP and conversion), at ``orders`` (default
    Opacus's, like for like)."""
    import logging

    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    # dp-accounting logs (absl) each fractional order whose series it cannot sum and leaves that order out: the
    # figure it returns is then an upper bound over fewer orders, never below the exact one
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        acc = RdpAccountant(list(RDP_ORDERS) if orders is None else orders)
        for z, q, steps in history:
            one = dp_event.GaussianDpEvent(z)
            acc.compose(one if q >= 1.0 else dp_event.PoissonSampledDpEvent(q, one), int(steps))
        return float(acc.get_epsilon(delta))
    finally:
        absl.setLevel(level)


@dataclass
class DPSGDLedger:
    """One device's DP-SGD spend: the RDP vector of every step it ever took, and its (z, q, steps) history.

    The RDP vector composes by addition, so a check of the device floor (:meth:`epsilon_after`) is O(1) in the
    history; the history (one entry per distinct (z, q), steps summed) lets another library recompute the figure
    (:func:`recompute_epsilon`). :meth:`to_record` fits Flower's ``context.state`` (a ConfigRecord of floats and
    float lists); :meth:`save` / :meth:`load` keep it in a file so that the spend accumulates across runs.

    Parameters
    ----------
    rdp
        The running RDP vector at Opacus's orders (empty: nothing spent).
    history
        ``[(z, q, steps), ...]``, one entry per distinct (z, q).
    participations
        How many times steps were charged (one per message the device answered).
    """

    rdp: list[float] = field(default_factory=list)
    history: list[tuple[float, float, int]] = field(default_factory=list)
    participations: int = 0

    def __post_init__(self) -> None:
        self.rdp = [float(v) for v in self.rdp]
        if self.rdp and len(self.rdp) != len(RDP_ORDERS):
            raise ValueError(f"a DP-SGD ledger's RDP vector has {len(RDP_ORDERS)} orders, got {len(self.rdp)}")
        self.history = [(float(z), float(q), int(s)) for z, q, s in self.history]

    @property
    def steps(self) -> int:
        """Every DP-SGD step charged so far."""
        return sum(s for _, _, s in self.history)

    def _added(self, mechanism: DPSGDMechanism) -> NDArray[np.float64]:
        one = np.asarray(_step_rdp(mechanism.noise_multiplier, mechanism.sample_rate)) * mechanism.steps
        return one if not self.rdp else np.asarray(self.rdp) + one

    def epsilon(self, delta: float) -> float:
        """epsilon at ``delta`` of everything charged so far (0 with nothing)."""
        return 0.0 if not self.rdp else _epsilon_of_rdp(self.rdp, check_delta(delta))

    def epsilon_after(self, mechanism: DPSGDMechanism, delta: float) -> float:
        """epsilon at ``delta`` were ``mechanism`` charged too (the floor check, before training)."""
        return _epsilon_of_rdp(self._added(mechanism), check_delta(delta))

    def record(self, mechanism: DPSGDMechanism) -> None:
        """Charge ``mechanism.steps`` steps."""
        self.rdp = [float(v) for v in self._added(mechanism)]
        self.participations += 1
        key = (float(mechanism.noise_multiplier), float(mechanism.sample_rate))
        for i, (z, q, s) in enumerate(self.history):
            if (z, q) == key:
                self.history[i] = (z, q, s + mechanism.steps)
                break
        else:
            self.history.append((*key, mechanism.steps))

    def recompute(self, delta: float) -> float:
        """The same figure by dp-accounting's RdpAccountant (:func:`recompute_epsilon`)."""
        return 0.0 if not self.history else recompute_epsilon(self.history, delta)

    def to_record(self) -> dict[str, list[float]]:
        """Plain lists for a ConfigRecord: the RDP vector, the flattened history and the participation count."""
        return {"rdp": list(self.rdp), "history": [float(v) for h in self.history for v in h],
                "participations": [float(self.participations)]}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> DPSGDLedger:
        """The inverse of :meth:`to_record` (a stored record is checked, not trusted). A record with a history and
        no RDP vector (what ``DeviceDPSGD`` stored before this ledger existed) is composed again from its history."""
        rdp, flat = record.get("rdp", None), record.get("history")
        if not isinstance(flat, list | tuple) or len(flat) % 3 or (rdp is not None and not isinstance(rdp, list | tuple)):
            raise ValueError("not a DP-SGD ledger record (needs 'rdp' and a flat 'history' of (z, q, steps) triples)")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (*(rdp or ()), *flat)):
            raise ValueError("a DP-SGD ledger record holds numbers only")
        hist = [(float(flat[i]), float(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)]
        if rdp is None:
            ledger = cls()
            for z, q, steps in hist:
                ledger.record(DPSGDMechanism(noise_multiplier=z, sample_rate=q, clip_norm=1.0, steps=steps))
            return ledger
        part = record.get("participations", [0.0])
        count = part[0] if isinstance(part, list | tuple) and len(part) == 1 else part
        if isinstance(count, bool) or not isinstance(count, int | float) or count < 0:
            raise ValueError("a DP-SGD ledger record's 'participations' must be a number >= 0")
        return cls(rdp=[float(v) for v in rdp], history=hist, participations=int(count))

    def save(self, path: str | Path) -> None:
        """Write the ledger to ``path`` (JSON) atomically."""
        from fedpdm_flower.fedapp.checkpoint import atomic_write

        atomic_write(Path(path), json.dumps(self.to_record()).encode())

    @classmethod
    def load(cls, path: str | Path) -> DPSGDLedger:
        """The ledger in ``path``, or an empty one when the file does not exist yet."""
        target = Path(path)
        if not target.exists():
            return cls()
        try:
            record = json.loads(target.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"DP-SGD ledger {target}: unreadable ({type(err).__name__})") from None
        if not isinstance(record, dict):
            raise ValueError(f"DP-SGD ledger {target}: not a ledger record")
        return cls.from_record(record)
