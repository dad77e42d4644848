"""Gaussian mechanism of DP-FedPDM / BSDP-FedPDM: sensitivity, noise level and the paper's budget formula.

Li, Huang, Wang, Chi, Quek, "Privacy-preserving Federated Primal-dual Learning for Non-convex and Non-smooth
Problems with Model Sparsification", arXiv 2310.19558. Equation numbers are the paper's; the code follows the
reference implementation in section 4.6 of ``shared/specs/dp_fedpdm.md``.

* (B.2)  sensitivity of the local model after Q clipped SGD steps      -> :func:`local_sgd_sensitivity`
* (35)   sensitivity of the uploaded y_i = 2 x_i^{t+1} - x_0^t - ...    -> :func:`fedpdm_sensitivity`
* (4)/(32) noise standard deviation of the Gaussian mechanism           -> :func:`gaussian_noise_std`
* (36)   total privacy loss over T rounds, and its inverse              -> :func:`total_privacy_eq36`,
  :func:`per_round_epsilon_eq36`

Caveats the paper ignores (spec 4.6): (32) is Dwork & Roth's Theorem 3.22, valid only for epsilon < 1; (36) has an
unknown constant c0 and treats the data-dependent q as fixed. The formulas are implemented as printed; an
established accountant is in :mod:`fedpdm_flower.fedapp.privacy.accountants`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "Eq36Calibration",
    "GaussianTarget",
    "add_gaussian_noise",
    "data_fraction",
    "fedpdm_sensitivity",
    "gaussian_noise_std",
    "local_sgd_sensitivity",
    "per_round_epsilon_eq36",
    "total_privacy_eq36",
]

# |1 - contraction*eta| this close to 1 uses the Q-term sum instead of the geometric closed form (spec 4.6).
_UNIT_RATE_TOL = 1e-12


def _require_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _require_positive_numbers(obj: Any, *names: str) -> None:
    """A dataclass's fields ``names``: each a finite number > 0, never a bool (``True`` as an epsilon is a bug)."""
    for name in names:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def _require_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _require_positive_int(name: str, value: int) -> None:
    # bool is an int subclass; True as a step count is a caller bug.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _require_open_unit(name: str, value: float) -> None:
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must lie in the open interval (0, 1), got {value!r}")


def local_sgd_sensitivity(eta: float, steps: int, clip: float, contraction: float = 0.0) -> float:
    """L2 sensitivity of a model after ``steps`` local SGD steps with gradients clipped to ``clip`` (B.2).

    The step is ``x <- x - eta * (g + contraction * (x - anchor) + c)`` with ``||g|| <= clip`` and ``anchor``, ``c``
    identical on neighbouring datasets. Each step contracts the gap between the two runs by
    ``a = |1 - contraction * eta|`` and widens it by at most ``2 * eta * clip``, so

    ``s = 2 * eta * clip * sum_{r < Q} a^r = 2 * eta * clip * (1 - a^Q) / (1 - a)``,

    and ``s = 2 * eta * Q * clip`` when a = 1.

    With ``contraction = 0`` this is ``2 * eta * Q * G``, the sensitivity of baselines that upload the local model
    itself (spec 6.4).

    Parameters
    ----------
    eta
        Local step size eta^t (> 0), constant within the round.
    steps
        Number of local steps Q actually taken (>= 1).
    clip
        Gradient-norm bound G of Assumption 3 (31), enforced by clipping (> 0).
    contraction
        Coefficient of the proximal pull ``x - anchor``; rho for FedPDM's (8a), mu for FedProx, 0 for plain SGD.

    Returns
    -------
    float
        The L2 sensitivity ``max ||x_D - x_D'||``.
    """
    _require_positive("eta", eta)
    _require_positive_int("steps", steps)
    _require_positive("clip", clip)
    _require_non_negative("contraction", contraction)
    a = abs(1.0 - contraction * eta)
    if math.isclose(a, 1.0, rel_tol=0.0, abs_tol=_UNIT_RATE_TOL):
        return 2.0 * eta * steps * clip
    # Same operation order as the spec's reference code, so the test vectors match bit for bit after the x2.
    return 2.0 * eta * clip * (1.0 - a**steps) / (1.0 - a)


def fedpdm_sensitivity(eta: float, rho: float, steps: int, clip: float) -> float:
    """Sensitivity ``s_{i,t}`` of the uploaded vector y_i^{t+1} (Theorem 1, eq. 35).

    ``y = 2 x^{t+1} - x_0^t - lambda^t / rho`` and only ``x^{t+1}`` depends on the data (B.1), so the sensitivity is
    twice that of the local model (B.2) with contraction ``rho``:

    ``s = 4 * eta * G * (1 - a^Q) / (1 - a)``, ``a = |1 - rho * eta|``; ``s = 4 * eta * Q * G`` when ``a = 1``
    (``rho * eta = 2``).

    The paper uses the same s for BSDP's sparsified upload; that is sound for rand_k but not for top_k, whose index
    set depends on the data (spec 4.3).

    Parameters
    ----------
    eta
        Local step size eta^t (> 0).
    rho
        Penalty parameter of the augmented Lagrangian (> 0).
    steps
        Number of local steps Q_i^t (>= 1).
    clip
        Gradient-norm bound G (> 0).

    Returns
    -------
    float
        ``s_{i,t}`` of (35).
    """
    _require_positive("rho", rho)
    return 2.0 * local_sgd_sensitivity(eta, steps, clip, contraction=rho)


def gaussian_noise_std(sensitivity: float, epsilon: float, delta: float) -> float:
    """Per-coordinate noise standard deviation of the Gaussian mechanism (Lemma 1, eqs. 4 and 32).

    ``sigma = s * sqrt(2 * ln(1.25 / delta)) / epsilon``. The lemma (Dwork & Roth, Thm. 3.22) only guarantees
    (epsilon, delta)-DP for ``epsilon < 1``; larger values are accepted because the paper's budgets produce them,
    and callers should flag them (spec 4.6, caveat 1).

    Parameters
    ----------
    sensitivity
        L2 sensitivity s of the released vector (>= 0).
    epsilon
        Per-round epsilon (> 0).
    delta
        Per-round delta, in (0, 1).

    Returns
    -------
    float
        sigma_{i,t}.
    """
    _require_non_negative("sensitivity", sensitivity)
    _require_positive("epsilon", epsilon)
    _require_open_unit("delta", delta)
    ratio = 1.25 / delta
    # A subnormal delta (1e-320) overflows 1.25 / delta, but its log is finite; elsewhere keep the printed form.
    log_term = math.log(ratio) if math.isfinite(ratio) else math.log(1.25) - math.log(delta)
    return sensitivity * math.sqrt(2.0 * log_term) / epsilon


def data_fraction(steps: int, batch: int, n_local: int) -> float:
    """Fraction of local data touched in a round, ``q_i = Q_i^t * b / |D_i|`` (Theorem 2).

    Parameters
    ----------
    steps
        Local steps Q (>= 1).
    batch
        Mini-batch size b (>= 1).
    n_local
        Local dataset size |D_i| (>= 1).

    Returns
    -------
    float
        q in (0, 1).

    Raises
    ------
    ValueError
        If q is not in (0, 1): (36) divides by ``1 - q``; cap Q so that ``Q * b < |D_i|``.
    """
    _require_positive_int("steps", steps)
    _require_positive_int("batch", batch)
    _require_positive_int("n_local", n_local)
    q = steps * batch / n_local
    if not (0.0 < q < 1.0):
        raise ValueError(
            f"q = steps*batch/n_local = {steps}*{batch}/{n_local} = {q} must lie in (0, 1); "
            "cap the local steps so that steps*batch < n_local"
        )
    return q


def _eq36_factor(c0: float, q: float, p: float, rounds: int, q_power: float) -> float:
    # The factor c0 * q^power * sqrt(p T / (1 - q)) that multiplies the per-round epsilon in (36).
    _require_positive("c0", c0)
    _require_open_unit("q", q)
    if not (0.0 < p <= 1.0):
        raise ValueError(f"p must lie in (0, 1], got {p!r}")
    _require_positive_int("rounds", rounds)
    _require_non_negative("q_power", q_power)
    # float(): typeshed types float ** float as Any (it can be complex for a negative base; q > 0 here).
    return c0 * float(q**q_power) * math.sqrt(p * rounds / (1.0 - q))


def total_privacy_eq36(
    eps_round: float, c0: float, q: float, p: float, rounds: int, q_power: float = 2.0
) -> float:
    """Total privacy loss over T rounds as printed in Theorem 2, eq. (36).

    ``epsbar_i^T = c0 * q_i^2 * epsilon * sqrt(p_i * T / (1 - q_i))``. c0 is "a constant dependent upon delta" whose
    value the paper does not give (spec A2); the exponent of q is exposed because the predecessor paper has
    ``q / sqrt(1 - q)`` instead (spec A4).

    Parameters
    ----------
    eps_round
        Per-round epsilon (> 0).
    c0
        The unknown constant of (36) (> 0); 1.0 by default elsewhere in the project.
    q
        Data fraction q_i in (0, 1), see :func:`data_fraction`.
    p
        Client sampling fraction p_i = K/N in (0, 1].
    rounds
        Number of rounds T (>= 1).
    q_power
        Exponent of q (2 as printed).

    Returns
    -------
    float
        epsbar_i^T.
    """
    _require_positive("eps_round", eps_round)
    return _eq36_factor(c0, q, p, rounds, q_power) * eps_round


def per_round_epsilon_eq36(
    eps_total: float, c0: float, q: float, p: float, rounds: int, q_power: float = 2.0
) -> float:
    """Per-round epsilon that spends ``eps_total`` over T rounds: eq. (36) solved for epsilon.

    ``epsilon_{i,t} = epsbar / (c0 * q^2 * sqrt(p * T / (1 - q)))``; the inverse of :func:`total_privacy_eq36`.

    Parameters
    ----------
    eps_total
        Total budget epsbar (> 0).
    c0, q, p, rounds, q_power
        As in :func:`total_privacy_eq36`.

    Returns
    -------
    float
        epsilon_{i,t}.
    """
    _require_positive("eps_total", eps_total)
    return eps_total / _eq36_factor(c0, q, p, rounds, q_power)


def add_gaussian_noise(
    values: NDArray[Any], std: float, rng: np.random.Generator
) -> NDArray[np.float64]:
    """Gaussian mechanism, eq. (3)/(11)/(19): ``values + xi`` with ``xi ~ N(0, std^2 I)`` i.i.d. per entry.

    Noise is drawn in the order of ``values`` (C order), so a top-k upload whose indices are ascending receives the
    same draws as the dense upload when k = d (spec 10.12).

    Parameters
    ----------
    values
        The released vector (any real dtype; computed in float64).
    std
        Noise standard deviation sigma (>= 0). With 0 no random numbers are drawn, so the RNG stream is left
        untouched and DP-off runs stay comparable.
    rng
        Source of the noise.

    Returns
    -------
    NDArray[np.float64]
        A new array; ``values`` is not modified.
    """
    _require_non_negative("std", std)
    out = np.array(values, dtype=np.float64, copy=True)
    if std == 0.0:
        return out
    out += rng.normal(0.0, std, size=out.shape)
    return out


@dataclass(frozen=True)
class Eq36Calibration:
    """DP-FedPDM's noise calibration as the paper states it: (36) solved for the per-round epsilon, then (32).

    Each client, each round it is sampled: ``q = Q b / |D_i|`` (its own data size and steps), ``p = K/N``,
    ``epsilon_round = per_round_epsilon_eq36(epsilon, c0, q, p, T)``, ``sigma = gaussian_noise_std(S, epsilon_round,
    delta)`` with the algorithm's L2 sensitivity S ((35) for FedPDM, (B.2) for local SGD) at clip norm G.

    This reproduces the paper; it is **not** a rigorous guarantee: (32) needs epsilon_round < 1 and the paper's
    (36) calibration typically makes epsilon_round far larger, and c0 is unknown (module docstring, spec 4.6).
    Clients report the composed RDP epsilon of the same releases beside it (:class:`PrivacyLedger`).

    Parameters
    ----------
    epsilon
        epsbar, the total budget of (36) (> 0).
    delta
        delta of (32) per round, in (0, 1).
    clip_norm
        G: every mini-batch gradient is clipped to this L2 norm (Assumption 3; default 1.0).
    c0
        The unknown constant of (36) (default 1.0).
    q_power
        Exponent of q in (36) (2 as printed).
    horizon
        T of (36); None uses the run's number of rounds.
    """

    epsilon: float
    delta: float
    clip_norm: float = 1.0
    c0: float = 1.0
    q_power: float = 2.0
    horizon: int | None = None

    def __post_init__(self) -> None:
        _require_positive_numbers(self, "epsilon", "clip_norm", "c0", "q_power")
        _require_open_unit("delta", self.delta)
        if self.horizon is not None:
            _require_positive_int("horizon", self.horizon)

    #: the name the message config carries (``dp-calibration``)
    kind = "eq36"

    def message_config(self, num_rounds: int, participation: float) -> dict[str, float | int | str | bool]:
        """The ``dp-*`` keys a client reads (:mod:`fedpdm_flower.clients.broadcast`)."""
        return {"dp": True, "dp-calibration": self.kind, "clip": self.clip_norm, "dp-epsilon": self.epsilon,
                "dp-delta": self.delta, "dp-c0": self.c0, "dp-q-power": self.q_power,
                "dp-horizon": self.horizon or num_rounds, "dp-participation": participation}


@dataclass(frozen=True)
class GaussianTarget:
    """Noise that meets a target (epsilon, delta) under the exact accountant: each client's releases over the run
    are (epsilon, delta)-DP for one record of its data.

    Each client, each round it is sampled, adds N(0, (z S)^2) to its upload, with S the algorithm's L2 sensitivity
    to one record ((35) for FedPDM, (B.2) for local SGD; clipping at ``clip_norm``) and
    ``z = sqrt(T) / mu*(epsilon, delta)`` (:func:`fedpdm_flower.fedapp.privacy.gdp.noise_multiplier_for`): T releases of that
    noise are mu*-GDP, exactly (epsilon, delta)-DP, and no fewer releases spend more. T is the horizon: a client
    may be sampled in every round, and no amplification by sampling is claimed (the server, which samples, is the
    adversary the guarantee names: it sees every upload). The devices report the GDP, RDP, basic-composition
    figures of what they released; the strategy's per-client accountants stop the run with
    ``PrivacyBudgetExhausted`` before a release would pass the target.

    Parameters
    ----------
    epsilon
        Target epsilon (> 0), e.g. 8.
    delta
        Target delta in (0, 1) (default 1e-5).
    clip_norm
        G: every mini-batch gradient is clipped to this L2 norm (default 1.0).
    horizon
        T, the most releases of a client; None uses the run's number of rounds.
    """

    epsilon: float
    delta: float = 1e-5
    clip_norm: float = 1.0
    horizon: int | None = None

    kind = "gdp"

    def __post_init__(self) -> None:
        _require_positive_numbers(self, "epsilon", "clip_norm")
        _require_open_unit("delta", self.delta)
        if self.horizon is not None:
            _require_positive_int("horizon", self.horizon)

    def noise_multiplier(self, num_rounds: int) -> float:
        """z for this run (``horizon`` or ``num_rounds`` releases)."""
        from fedpdm_flower.fedapp.privacy import gdp

        return gdp.noise_multiplier_for(self.epsilon, self.delta, self.horizon or num_rounds)

    def message_config(self, num_rounds: int, participation: float) -> dict[str, float | int | str | bool]:
        """The ``dp-*`` keys a client reads (:mod:`fedpdm_flower.clients.broadcast`)."""
        return {"dp": True, "dp-calibration": self.kind, "clip": self.clip_norm, "dp-epsilon": self.epsilon,
                "dp-delta": self.delta, "dp-horizon": self.horizon or num_rounds}


#: the calibrations the broadcast strategies accept
Calibration = Eq36Calibration | GaussianTarget
