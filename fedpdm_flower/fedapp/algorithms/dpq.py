"""DPQ-DSGD (Algorithm 1 of seed 004), framework-free: numpy, plus torch only for a torch model's gradient.

J. Chen, J. Wang, J.-F. Zhang, "Differentially Private Distributed Nonconvex Stochastic Optimization with Quantized
Communications" (arXiv 2403.18254, the supplied text ``shared/seeds/004_f18e82f0bffe69cb.txt``; later arXiv versions
with "two-time-scale step-sizes" differ and are not followed). Spec ``shared/specs/dp_quantized.md`` sections 1-2, 5,
6.3, 7.2-7.6, 9, 10. The DP accountant (spec 4) lives in :mod:`fedpdm_flower.fedapp.privacy.dpq`, not here.

What is here
------------
* Schedules (spec 2.1; Theorem 1, Assumption 4, Corollary 1): :func:`alpha_hat` ``a1 (ln K)^2 / K^alpha``,
  :func:`beta_hat` ``a2 / K^beta``, :func:`gamma_hat` ``floor(a3 K^gamma) + 1`` (the minibatch size, constant
  within a run and growing with the horizon K), :func:`sigma_k` ``scale (k + offset)^sigma`` (the noise *standard
  deviation*; offset 1 = theory, 5 = the paper's experiments). :data:`PAPER_MNIST` holds the paper's constants.
* Run constants :class:`DPQParams`, built from a schedule by :func:`schedule_params` / :func:`paper_mnist_params`;
  the ablations of spec 2.5 by :func:`ablation` (``"dpq"``, ``"dp-only"``, ``"quant-only"``, ``"dsgd"``).
* The quantizer of eq. (3) on ``q_step * Z`` is :func:`fedpdm_flower.fedapp.compression.quantize.quantize_levels` (levels) and
  :func:`~fedpdm_flower.fedapp.compression.quantize.dequantize`, called in one place (:func:`node_message`).
* Noise std sigma_k comes from :func:`fedpdm_flower.fedapp.privacy.dpq.sigma_k` (the accountant's own function), and
  :func:`params_from_schedule` turns the accountant's :class:`fedpdm_flower.fedapp.privacy.dpq.DPQSchedule` into run constants,
  so the noise drawn and the epsilon charged use the same numbers.
* Algorithm 1 per node (spec 2.3, 7.2), what a Flower client calls: :func:`node_message` (line 2: noise with std
  sigma_k, quantize, return the integer levels), :func:`node_update` (lines 4-5: eqs. (5)-(6) from the neighbours'
  received levels), :func:`node_round` (STEP(k) of spec 7.2: update, then the message of iteration k + 1).
* :func:`simulate`: every node in one process, with ``engine="vectorised"`` (the network form, equal to the per-node
  functions bit for bit with ``form="mixing"``; ``form="compact"`` evaluates eqs. (31)-(32) literally, equal up to
  rounding) or ``engine="per_node"`` (a loop over :func:`node_round` with a mailbox, the arithmetic of a Flower run).
* Local objectives: :class:`QuadraticObjective` (the spec 10 A1 toy ``1/2 ||x - b_i||^2``),
  :class:`LeastSquaresObjective` (a minibatch least-squares toy), their closed forms :func:`quadratic_fixed_point`
  (the noise- and quantization-free fixed point of (6) with constant steps) and :func:`quadratic_optimum` (x* of F),
  and the user's model on the user's data, :func:`local_objective`: :class:`TorchObjective` (a buffer-free torch
  module behind :class:`fedpdm_flower.fedapp.models.torch_model.TorchModel`) or :class:`ModelObjective` (a numpy model with
  ``dim`` / ``grad`` / ``loss``), each over :class:`fedpdm_flower.fedapp.localdata.LocalData` read by index. The MNIST setup of
  spec 6.3 (datasets, model zoo) belongs to the reproduction app (:mod:`fedpdm_flower.fedapp.apps.dpq`).
* Theory helpers of spec 5 that spec 10 tests (T1): :func:`rate_exponent`, :func:`corollary1_holds`,
  :func:`assumption4_check` (with :func:`gamma_constant`, the paper's Gamma).

Interpretations (spec 9 and ours)
---------------------------------
* **Self term** (spec 1.2, 9.3): node i mixes its *own quantized noisy* ``z_i = q_step m_i`` with weight ``a_ii``,
  as (31) puts A (with its diagonal) on ``e_k + n_k``; ``self_term="x"`` (uses ``x_i``) is the non-default variant.
* **Mixing order**: ``a_ii z_i`` first, then ``+ a_ij z_j`` for the neighbours in the order given (ascending j in
  the simulators, the order of :class:`fedpdm_flower.fedapp.topology.Graph` neighbour tuples). Both engines evaluate
  ``(1 - beta_hat) * x + beta_hat * mix - alpha_hat * g`` with these element-wise operations, so they agree bit
  for bit; the literal compact form (matrix products with ``I - beta_hat L`` and ``A``) agrees only up to rounding.
* **Iterations**: the loop runs ``k = 0..K`` (K + 1 updates, spec 9.18); ``simulate(num_iters=None)`` runs K + 1.
* **RNG** (spec 7.6, with stream tags as elsewhere in fedapp): noise ``default_rng([seed, 50, node, k])``, quantizer
  uniforms ``[seed, 51, node, k]``, minibatch ``[seed, 52, node, k]`` (``choice(D, batch, replace=False)``), common
  init ``[seed, 53]`` (the reproduction app's). Stateless, so a re-created Flower client draws the same numbers as
  the simulator. ``seed=None`` (a device without a seed) draws every one from fresh OS entropy instead. The message
  of iteration k uses sigma_k; the message sent after update k is iteration k + 1's, with sigma_{k+1} (spec 7.2, 9.6).
* **Noise** is absolute (not scaled to the weights, spec 9.5); ``noise=False`` draws nothing (sigma_k = 0).
* **Quantizer** (spec 2.2 [REC]): ``s = v / q_step``, ``l = floor(s)``, ``m = l + (U < s - l)``, U ~ U[0, 1) in
  float64; levels are int64 (a transport may narrow them, decoding casts back); ``q_step = 0`` means no
  quantization, and the message is ``x + n`` itself: float64 by default (so the noise- and quantization-free run is
  exactly float64 DSGD, spec 10 A1 / F6), or float32 with ``float_messages="float32"`` (spec 2.2's float32 wire
  format, :func:`fedpdm_flower.fedapp.compression.quantize.encode_float32`; then the simulator rounds the same way).
* **Minibatch** (spec 1.4, 9.20): ``batch_size`` indices without replacement, independent across iterations, mean
  of the per-sample gradients (5); ``batch_size=None`` or a deterministic objective uses the full local gradient;
  ``batch_size >= D`` uses all D samples. No per-sample clipping (the paper has none; spec 2.3's optional
  ``clip`` is not implemented here).
* **States** are float64 vectors; a :class:`TorchObjective` evaluates its gradient at x cast to the module's
  parameter dtype (float32 for most networks) and returns it in float64.
* **Initial state**: data-independent and common to all nodes (spec 2.3 [REC]); on Flower the strategy sends it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.compression.quantize import dequantize, quantize_levels
from fedpdm_flower.fedapp.privacy import dpq as accountant
from fedpdm_flower.fedapp.sampling import rng_for

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.localdata import LocalData
    from fedpdm_flower.fedapp.models.torch_model import TorchModel

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
#: what node i sends: int64 quantizer levels m (z = q_step * m), or the float64 x + n when q_step = 0
Message = NDArray[Any]
#: ``callback(k, x_{k+1}, messages_k)`` of :func:`simulate`
IterationCallback = Callable[[int, FloatArray, list[Message]], None]

__all__ = [
    "ABLATIONS",
    "PAPER_MNIST",
    "STREAM_DPQ_BATCH",
    "STREAM_DPQ_INIT",
    "STREAM_DPQ_NOISE",
    "STREAM_DPQ_QUANT",
    "Assumption4Report",
    "DPQParams",
    "DPQTrace",
    "IterationCallback",
    "LeastSquaresObjective",
    "LocalObjective",
    "ModelObjective",
    "QuadraticObjective",
    "TorchObjective",
    "ablation",
    "alpha_hat",
    "assumption4_check",
    "beta_hat",
    "corollary1_holds",
    "decode_message",
    "dequantize",
    "gamma_constant",
    "gamma_hat",
    "local_gradient",
    "local_objective",
    "minibatch_indices",
    "node_message",
    "node_round",
    "node_update",
    "paper_mnist_params",
    "params_from_schedule",
    "privacy_noise",
    "quadratic_fixed_point",
    "quadratic_optimum",
    "quadratic_toy",
    "quantize_levels",
    "rate_exponent",
    "schedule_params",
    "sigma_k",
    "simulate",
]

# Stream tags (1-4 fedpdm_flower.fedapp.sampling, 30-32 fedpdm_flower.fedapp.topology, 40-42 recal_baselines, 101 attacks).
STREAM_DPQ_NOISE = 50  # privacy noise n_{i,k}
STREAM_DPQ_QUANT = 51  # quantizer uniforms of z_{i,k}
STREAM_DPQ_BATCH = 52  # minibatch B_{i,k}
STREAM_DPQ_INIT = 53  # common initial model x_0

#: The paper's MNIST constants (Section 4; spec 2.1, 6.1). q_step in {1, 5, 10}, sigma_exp in {-0.1, 0.1, 0.2}.
PAPER_MNIST: Mapping[str, float] = {
    "K": 2000, "a1": 0.35, "alpha": 1.0, "a2": 0.3, "beta": 0.75, "a3": 0.24, "gamma": 0.7,
    "delta": 3.0, "C": 0.2, "sigma_offset": 5.0,
}  # fmt: skip

ABLATIONS = ("dpq", "dp-only", "quant-only", "dsgd")


# ----------------------------------------------------------------------------------------------------------------
# Schedules (spec 2.1)


def _check_horizon(K: int) -> None:
    if isinstance(K, bool) or int(K) != K or K < 2:
        raise ValueError(f"the horizon K must be an integer >= 2, got {K!r}")


def alpha_hat(K: int, a1: float, alpha: float) -> float:
    """Gradient step ``a1 (ln K)^2 / K^alpha`` (Assumption 4), constant over the run's iterations 0..K."""
    _check_horizon(K)
    if a1 <= 0:
        raise ValueError(f"a1 must be > 0, got {a1}")
    return a1 * math.log(K) ** 2 / math.pow(K, alpha)


def beta_hat(K: int, a2: float, beta: float) -> float:
    """Consensus step ``a2 / K^beta`` (Assumption 4); ``ValueError`` unless ``0 < a2 < K^beta`` (0 < beta_hat < 1)."""
    _check_horizon(K)
    value = a2 / math.pow(K, beta)
    if not 0.0 < value < 1.0:
        raise ValueError(f"beta_hat = a2 / K^beta = {value} must lie in (0, 1) (Theorem 1: 0 < a2 < K^beta)")
    return value


def gamma_hat(K: int, a3: float, gamma: float) -> int:
    """Minibatch size ``floor(a3 K^gamma) + 1`` (Assumption 4): constant within a run, grows with the horizon K."""
    _check_horizon(K)
    if a3 <= 0:
        raise ValueError(f"a3 must be > 0, got {a3}")
    return math.floor(a3 * math.pow(K, gamma)) + 1


def sigma_k(k: int, sigma_exp: float, *, scale: float = 1.0, offset: float = 1.0) -> float:
    """Noise standard deviation ``scale (k + offset)^sigma_exp`` (spec 2.1 [REC]; theory offset 1, paper offset 5).

    Evaluated by :func:`fedpdm_flower.fedapp.privacy.dpq.sigma_k`, so the noise drawn is exactly the sigma the accountant charges.
    """
    return accountant.sigma_k(k, sigma_exp, offset, scale)


# ----------------------------------------------------------------------------------------------------------------
# Theory helpers (spec 5, tested as spec 10 T1)


def rate_exponent(alpha: float, beta: float, sigma: float) -> float:
    """Theorem 2's r in ``E[F(x_{i,K+1}) - F*] = O(K^-r)``: ``min{2 beta - 2 max{sigma, 0} - 1, 2 alpha - beta - 1}``."""
    return min(2.0 * beta - 2.0 * max(sigma, 0.0) - 1.0, 2.0 * alpha - beta - 1.0)


def _exponents_converge(alpha: float, beta: float, sigma: float) -> bool:
    # Assumption 4's exponent conditions: 2 alpha - beta > 1 and max{sigma + 1/2, 0} < beta < alpha <= 1
    return 2.0 * alpha - beta > 1.0 and max(sigma + 0.5, 0.0) < beta < alpha <= 1.0


def corollary1_holds(alpha: float, beta: float, sigma: float, gamma: float, delta: float) -> bool:
    """Corollary 1 (spec 5.2): Assumption 4's exponent conditions plus Theorem 1's finite-privacy ones,
    ``delta > 1`` and ``alpha + gamma - beta > max{1 - sigma, 0}``."""
    return _exponents_converge(alpha, beta, sigma) and delta > 1.0 and alpha + gamma - beta > max(1.0 - sigma, 0.0)


def gamma_constant(K: int, a2: float, beta: float, rho_L: float) -> float:
    """Assumption 4's ``Gamma = (2 rho a2 K^beta - rho^2 a2^2 - K^(2 beta - 1) ln K) / (K^beta - rho a2)^2``."""
    _check_horizon(K)
    kb = math.pow(K, beta)
    return (2 * rho_L * a2 * kb - rho_L**2 * a2**2 - math.pow(K, 2 * beta - 1) * math.log(K)) / (kb - rho_L * a2) ** 2


@dataclass(frozen=True)
class Assumption4Report:
    """Each condition of Assumption 4 (spec 5.3); ``None`` where L, mu or n were not given.

    ``holds`` is False if any checked condition fails, True if all hold, None if undecided.
    """

    constants_positive: bool  # a1, a2, a3 > 0
    exponents: bool  # 2 alpha - beta > 1, max{sigma + 1/2, 0} < beta < alpha <= 1
    a2_condition: bool  # 2 a2 K^beta - a2^2 - K^(2 beta - 1) ln K > 0
    gamma: float  # Gamma (must be > 0)
    theta_consensus: bool | None  # 0 < 1 - ln K / K + 2 (1 + Gamma) alpha_hat^2 L^2 / Gamma < 1
    theta_optimality: bool | None  # 0 < 1 - mu alpha_hat + 2 alpha_hat^2 L^2 + 4 n (1 + Gamma) alpha_hat^2 L / Gamma < 1

    @property
    def holds(self) -> bool | None:
        """All conditions together (None when the constant-dependent ones were not checked but the rest hold)."""
        known = [self.constants_positive, self.exponents, self.a2_condition, self.gamma > 0]
        optional = [self.theta_consensus, self.theta_optimality]
        if not all(known) or any(c is False for c in optional):
            return False
        return None if any(c is None for c in optional) else True


def assumption4_check(K: int, a1: float, alpha: float, a2: float, beta: float, a3: float, sigma: float,
                      rho_L: float, *, L: float | None = None, mu: float | None = None,
                      n: int | None = None) -> Assumption4Report:
    """Check Assumption 4 as printed (spec 5.3). The paper's MNIST constants fail it on every 5-node graph."""
    _check_horizon(K)
    lnk = math.log(K)
    gam = gamma_constant(K, a2, beta, rho_L)
    a_hat = a1 * lnk**2 / math.pow(K, alpha)
    theta_c: bool | None = None
    theta_o: bool | None = None
    if L is not None:
        theta_c = gam > 0 and 0.0 < 1.0 - lnk / K + 2.0 * (1.0 + gam) * a_hat**2 * L**2 / gam < 1.0
        if mu is not None and n is not None:
            val = 1.0 - mu * a_hat + 2.0 * a_hat**2 * L**2 + 4.0 * n * (1.0 + gam) * a_hat**2 * L / gam if gam > 0 else 0.0
            theta_o = gam > 0 and 0.0 < val < 1.0
    return Assumption4Report(
        constants_positive=a1 > 0 and a2 > 0 and a3 > 0,
        exponents=_exponents_converge(alpha, beta, sigma),
        a2_condition=2.0 * a2 * math.pow(K, beta) - a2**2 - math.pow(K, 2.0 * beta - 1.0) * lnk > 0,
        gamma=gam,
        theta_consensus=theta_c,
        theta_optimality=theta_o,
    )


# ----------------------------------------------------------------------------------------------------------------
# Run constants and ablations (spec 2.1, 2.5)


@dataclass(frozen=True)
class DPQParams:
    """Run constants every node shares (public, spec 3): steps, batch size, noise schedule, quantizer step, seed.

    Parameters
    ----------
    alpha_hat, beta_hat
        Gradient and consensus steps of (6) (:func:`alpha_hat`, :func:`beta_hat`), constant within a run.
    batch_size
        gamma_hat (:func:`gamma_hat`); None = full local gradient.
    q_step
        Quantizer step Delta of eq. (3); 0 = no quantization (float messages).
    noise
        Privacy noise on/off; off forces sigma_k = 0 and draws nothing.
    sigma_exp, sigma_scale, sigma_offset
        ``sigma_k = sigma_scale (k + sigma_offset)^sigma_exp`` (offset 1 = theory, 5 = the paper's experiments).
    seed
        Seed of the stateless streams (module docstring); None draws from fresh OS entropy (a device without a seed).
    self_term
        ``"z"`` (default: a_ii multiplies the node's own quantized noisy message) or ``"x"`` (its exact state).
    K
        The horizon the schedule was built for (None if the steps were given directly); the run is k = 0..K.
    float_messages
        Dtype of unquantized messages (q_step = 0): ``"float64"`` (default) or ``"float32"`` (the float32 wire).
    """

    alpha_hat: float
    beta_hat: float
    batch_size: int | None
    q_step: float
    noise: bool
    sigma_exp: float = 0.0
    sigma_scale: float = 1.0
    sigma_offset: float = 1.0
    seed: int | None = 0
    self_term: str = "z"
    K: int | None = None
    float_messages: str = "float64"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha_hat) and self.alpha_hat >= 0):
            raise ValueError(f"alpha_hat must be finite and >= 0, got {self.alpha_hat}")
        if not 0.0 <= self.beta_hat <= 1.0:
            raise ValueError(f"beta_hat must lie in [0, 1], got {self.beta_hat}")
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or self.batch_size < 1):
            raise ValueError(f"batch_size must be None or >= 1, got {self.batch_size!r}")
        if not (math.isfinite(self.q_step) and self.q_step >= 0):
            raise ValueError(f"q_step must be finite and >= 0 (0 = no quantization), got {self.q_step}")
        if not (math.isfinite(self.sigma_scale) and self.sigma_scale >= 0):
            raise ValueError(f"sigma_scale must be finite and >= 0, got {self.sigma_scale}")
        if not self.sigma_offset > 0:
            raise ValueError(f"sigma_offset must be > 0, got {self.sigma_offset}")
        if self.self_term not in ("z", "x"):
            raise ValueError(f"self_term must be 'z' or 'x', got {self.self_term!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        if self.K is not None and self.K < 0:
            raise ValueError(f"K must be None or >= 0, got {self.K}")
        if self.float_messages not in ("float64", "float32"):
            raise ValueError(f"float_messages must be 'float64' or 'float32', got {self.float_messages!r}")

    @property
    def quantized(self) -> bool:
        """True when messages are quantizer levels (q_step > 0)."""
        return self.q_step > 0

    def sigma(self, k: int) -> float:
        """sigma_k of iteration k's message (0 when noise is off)."""
        if not self.noise:
            return 0.0
        return sigma_k(k, self.sigma_exp, scale=self.sigma_scale, offset=self.sigma_offset)


def schedule_params(K: int, *, a1: float, alpha: float, a2: float, beta: float, a3: float, gamma: float,
                    q_step: float, noise: bool = True, sigma_exp: float = 0.0, sigma_offset: float = 1.0,
                    sigma_scale: float = 1.0, seed: int = 0, self_term: str = "z") -> DPQParams:
    """:class:`DPQParams` for horizon K from the schedule constants of spec 2.1."""
    return DPQParams(
        alpha_hat=alpha_hat(K, a1, alpha), beta_hat=beta_hat(K, a2, beta), batch_size=gamma_hat(K, a3, gamma),
        q_step=q_step, noise=noise, sigma_exp=sigma_exp, sigma_scale=sigma_scale, sigma_offset=sigma_offset,
        seed=seed, self_term=self_term, K=K,
    )


def params_from_schedule(schedule: accountant.DPQSchedule, *, q_step: float, noise: bool = True, seed: int | None = 0,
                         self_term: str = "z", float_messages: str = "float64") -> DPQParams:
    """:class:`DPQParams` with the steps, batch size and noise schedule of the accountant's ``schedule``."""
    return DPQParams(
        alpha_hat=schedule.alpha_hat, beta_hat=schedule.beta_hat, batch_size=schedule.batch_size, q_step=q_step,
        noise=noise, sigma_exp=schedule.sigma_exp, sigma_scale=schedule.sigma_scale,
        sigma_offset=schedule.sigma_offset, seed=seed, self_term=self_term, K=schedule.K,
        float_messages=float_messages,
    )


def paper_mnist_params(q_step: float = 1.0, sigma_exp: float = 0.1, *, K: int = 2000, seed: int = 0,
                       noise: bool = True) -> DPQParams:
    """The paper's MNIST preset (spec 2.1, 6.1): alpha_hat ~ 0.0101, beta_hat ~ 0.0010, batch 50, offset 5."""
    p = PAPER_MNIST
    return schedule_params(
        K, a1=p["a1"], alpha=p["alpha"], a2=p["a2"], beta=p["beta"], a3=p["a3"], gamma=p["gamma"], q_step=q_step,
        noise=noise, sigma_exp=sigma_exp, sigma_offset=p["sigma_offset"], seed=seed,
    )


def ablation(params: DPQParams, name: str, q_step: float | None = None) -> DPQParams:
    """The spec 2.5 variants of ``params`` (same steps, seeds, schedule).

    ``"dpq"`` noise and quantization (q_step = ``q_step`` or params.q_step, which must then be > 0), ``"dp-only"``
    noise, float messages, ``"quant-only"`` quantization without noise, ``"dsgd"`` neither: plain DSGD with the lazy
    mixing matrix ``(1 - beta_hat) I + beta_hat A``.
    """
    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r}; valid: {', '.join(ABLATIONS)}")
    step = params.q_step if q_step is None else q_step
    quant = name in ("dpq", "quant-only")
    if quant and step <= 0:
        raise ValueError(f"ablation {name!r} quantizes: give q_step > 0")
    return replace(params, noise=name in ("dpq", "dp-only"), q_step=step if quant else 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Stateless streams (spec 7.6)


def _rng(seed: int | None, stream: int, node: int, k: int) -> np.random.Generator:
    if seed is None:  # a device without a seed: fresh OS entropy, not reproducible
        return np.random.default_rng()
    return rng_for(int(seed), stream, int(node), int(k))  # default_rng([seed, stream, node, k]), bit for bit


def privacy_noise(params: DPQParams, node: int, k: int, dim: int) -> FloatArray | None:
    """``n_{i,k} = sigma_k * N(0, I_d)`` from ``default_rng([seed, 50, node, k])``; None when noise is off."""
    if not params.noise:
        return None
    return params.sigma(k) * _rng(params.seed, STREAM_DPQ_NOISE, node, k).standard_normal(dim)


def minibatch_indices(params: DPQParams, node: int, k: int, num_samples: int | None) -> IntArray | None:
    """B_{i,k}: ``batch_size`` distinct indices of 0..D-1 from ``default_rng([seed, 52, node, k])``.

    None (full gradient) for ``batch_size=None`` or a deterministic objective (``num_samples=None``); all D indices
    when ``batch_size >= D``.
    """
    if params.batch_size is None or num_samples is None:
        return None
    if params.batch_size >= num_samples:
        return np.arange(num_samples, dtype=np.int64)
    rng = _rng(params.seed, STREAM_DPQ_BATCH, node, k)
    return rng.choice(num_samples, size=params.batch_size, replace=False).astype(np.int64)


# ----------------------------------------------------------------------------------------------------------------
# Local objectives


class LocalObjective(Protocol):
    """Node i's f_i: ``gradient(x, idx)`` is the mean per-sample gradient over samples ``idx`` (None = f_i's full
    gradient); ``num_samples`` is D, or None for a deterministic objective."""

    @property
    def num_samples(self) -> int | None:
        """D (samples held), or None when there is nothing to sample."""
        ...

    def gradient(self, x: FloatArray, idx: IntArray | None) -> FloatArray:
        """Gradient (5) at x on the samples idx (None = full)."""
        ...


@dataclass(frozen=True)
class QuadraticObjective:
    """``f_i(x) = 1/2 ||x - b||^2`` (spec 10 A1), deterministic; Hessian I, linear term b."""

    b: FloatArray

    @property
    def num_samples(self) -> int | None:
        """None: the gradient is exact."""
        return None

    def gradient(self, x: FloatArray, idx: IntArray | None) -> FloatArray:
        """``x - b``."""
        return np.asarray(x - self.b, dtype=np.float64)

    def value(self, x: FloatArray) -> float:
        """``1/2 ||x - b||^2``."""
        return 0.5 * float(np.sum((x - self.b) ** 2))

    def hessian(self) -> FloatArray:
        """I_d."""
        return np.eye(self.b.shape[0])

    def linear_term(self) -> FloatArray:
        """b (f = 1/2 x'Hx - c'x + const with c = b)."""
        return np.asarray(self.b, dtype=np.float64)


@dataclass(frozen=True)
class LeastSquaresObjective:
    """``f_i(x) = (1/D) sum_l 1/2 (a_l'x - t_l)^2`` over the node's D rows, with per-sample gradients
    ``a_l (a_l'x - t_l)`` averaged over a minibatch (5)."""

    features: FloatArray
    targets: FloatArray

    @property
    def num_samples(self) -> int | None:
        """D."""
        return int(self.features.shape[0])

    def gradient(self, x: FloatArray, idx: IntArray | None) -> FloatArray:
        """Mean of ``a_l (a_l'x - t_l)`` over l in idx (all rows if None)."""
        a = self.features if idx is None else self.features[idx]
        t = self.targets if idx is None else self.targets[idx]
        return np.asarray(a.T @ (a @ x - t) / a.shape[0], dtype=np.float64)

    def per_sample_gradients(self, x: FloatArray, idx: IntArray) -> FloatArray:
        """Rows ``a_l (a_l'x - t_l)`` for l in idx (shape (len(idx), d))."""
        a = self.features[idx]
        return np.asarray(a * (a @ x - self.targets[idx])[:, None], dtype=np.float64)

    def value(self, x: FloatArray) -> float:
        """f_i(x)."""
        r = self.features @ x - self.targets
        return 0.5 * float(r @ r) / float(self.features.shape[0])

    def hessian(self) -> FloatArray:
        """``A'A / D``."""
        return np.asarray(self.features.T @ self.features / self.features.shape[0], dtype=np.float64)

    def linear_term(self) -> FloatArray:
        """``A't / D``."""
        return np.asarray(self.features.T @ self.targets / self.features.shape[0], dtype=np.float64)


class _Quadratic(Protocol):
    def hessian(self) -> FloatArray: ...

    def linear_term(self) -> FloatArray: ...


def quadratic_toy(num_nodes: int = 5, dim: int = 3, seed: int = 0, *, identical: bool = False) -> list[QuadraticObjective]:
    """Spec 10 A1: ``f_i = 1/2 ||x - b_i||^2`` with ``b_i ~ N(0, I_dim)`` from ``default_rng([seed, 53, 1])``
    (``identical=True``: every node gets b_0)."""
    rng = np.random.default_rng([seed, STREAM_DPQ_INIT, 1])
    b = rng.standard_normal((num_nodes, dim))
    if identical:
        b[:] = b[0]
    return [QuadraticObjective(b[i].copy()) for i in range(num_nodes)]


def quadratic_fixed_point(objectives: Sequence[_Quadratic], A: ArrayLike, alpha_hat: float,
                          beta_hat: float) -> FloatArray:
    """The fixed point of (6) without noise, quantization or sampling, for quadratic f_i (shape (n, d)).

    ``x = (1 - beta_hat) x + beta_hat A x - alpha_hat (H_i x_i - c_i)`` gives
    ``(alpha_hat blockdiag(H_i) + beta_hat (I - A) (x) I_d) x = alpha_hat c``; for ``H_i = I`` this is spec 10 A1's
    ``x* = alpha_hat (alpha_hat I + beta_hat L)^-1 b``.
    """
    w = np.asarray(A, dtype=np.float64)
    n = w.shape[0]
    h = [o.hessian() for o in objectives]
    d = h[0].shape[0]
    mat = beta_hat * np.kron(np.eye(n) - w, np.eye(d))
    for i in range(n):
        mat[i * d:(i + 1) * d, i * d:(i + 1) * d] += alpha_hat * h[i]
    rhs = alpha_hat * np.concatenate([o.linear_term() for o in objectives])
    return np.asarray(np.linalg.solve(mat, rhs).reshape(n, d), dtype=np.float64)


def quadratic_optimum(objectives: Sequence[_Quadratic]) -> FloatArray:
    """x* of ``F = (1/n) sum_i f_i`` for quadratic f_i: ``(sum H_i)^-1 sum c_i``."""
    h = sum(o.hessian() for o in objectives)
    c = sum(o.linear_term() for o in objectives)
    return np.asarray(np.linalg.solve(h, c), dtype=np.float64)


class _DataObjective:
    """A local objective on node i's samples (:class:`fedpdm_flower.fedapp.localdata.LocalData`): D and minibatches by index."""

    data: LocalData

    @property
    def num_samples(self) -> int | None:
        """D."""
        return len(self.data)

    def batch(self, idx: IntArray | None) -> tuple[Any, Any]:
        """(inputs, targets) of the samples idx (all of them for None)."""
        return self.data.batch(np.arange(len(self.data), dtype=np.int64) if idx is None else idx)


class TorchObjective(_DataObjective):
    """f_i: the mean loss (5) of the user's torch module on node i's data, for DPQ-DSGD.

    Parameters
    ----------
    model
        The module behind :class:`fedpdm_flower.fedapp.models.torch_model.TorchModel` (with its loss), its buffers
        **beside** x: DPQ-DSGD noises, quantizes and mixes every coordinate of x, and its update (6) moves x by a
        gradient; a floating-point buffer (BatchNorm's running statistics) has no gradient and is data-dependent
        state outside the privacy analysis, so it must not be a coordinate of x (the node keeps it,
        :mod:`fedpdm_flower.clients.dpq`).
    data
        Node i's samples (:class:`fedpdm_flower.fedapp.localdata.LocalData`), read by index for the minibatch B_{i,k}.

    Several nodes may share one module (it is loaded with x before every gradient). ``last_loss`` is the loss of the
    last minibatch (a metric outside the DP guarantee, spec 7.4).
    """

    def __init__(self, model: TorchModel, data: LocalData) -> None:
        if model.dim != model.num_trainable:
            raise ValueError(
                f"DPQ-DSGD's x (noised, quantized and mixed every iteration) must be exactly the trainable weights, "
                f"but this model keeps floating-point buffers {model.buffer_names[:3]} in x: build the TorchModel "
                "with buffers='beside'")
        self.model = model
        self.data = data
        self.last_loss = float("nan")

    def gradient(self, x: FloatArray, idx: IntArray | None) -> FloatArray:
        """Flat gradient of the batch-mean loss at x (cast to the parameters' dtype), as float64."""
        self.model.set_flat(x)
        g, loss = self.model.batch_gradient(*self.batch(idx))
        self.last_loss = loss
        return np.asarray(g.detach().double().numpy(), dtype=np.float64)


class ModelObjective(_DataObjective):
    """f_i: the mean loss of a numpy model object (``dim``, ``grad(x, inputs, targets)``, ``loss(x, inputs,
    targets)``) on node i's data; ``grad`` must return the mean per-sample gradient over the samples given (5)."""

    def __init__(self, model: Any, data: LocalData) -> None:
        missing = [a for a in ("dim", "grad", "loss") if not hasattr(model, a)]
        if missing:
            raise TypeError(f"{type(model).__name__} lacks {missing}: a numpy model needs dim, grad and loss")
        self.model = model
        self.data = data
        self.last_loss = float("nan")

    def gradient(self, x: FloatArray, idx: IntArray | None) -> FloatArray:
        """``model.grad`` on the minibatch, as float64 (and its loss in ``last_loss``)."""
        inputs, targets = self.batch(idx)
        self.last_loss = float(self.model.loss(x, inputs, targets))
        return np.asarray(self.model.grad(x, inputs, targets), dtype=np.float64)


def local_objective(model: Any, data: LocalData) -> TorchObjective | ModelObjective:
    """f_i of a node: :class:`TorchObjective` for a :class:`fedpdm_flower.fedapp.models.torch_model.TorchModel` (buffer-free),
    :class:`ModelObjective` for a numpy model object."""
    if hasattr(model, "batch_gradient") and hasattr(model, "set_flat") and hasattr(model, "num_trainable"):
        return TorchObjective(model, data)
    return ModelObjective(model, data)


# ----------------------------------------------------------------------------------------------------------------
# Algorithm 1, per node (spec 2.3, 7.2)


def node_message(params: DPQParams, node: int, k: int, x: FloatArray) -> Message:
    """Line 2 of iteration k: ``m_{i,k}`` with ``q_step m = Q(x_{i,k} + n_{i,k})``, ``n ~ N(0, sigma_k^2 I)``.

    Returns int64 levels (q_step > 0) or the vector ``x + n`` (q_step = 0; float64, or float32 per
    ``params.float_messages``). Noise from
    ``default_rng([seed, 50, node, k])``, quantizer uniforms from ``[seed, 51, node, k]``.
    """
    state = np.asarray(x, dtype=np.float64)
    noise = privacy_noise(params, node, k, state.shape[0])
    v = state.copy() if noise is None else state + noise
    if not params.quantized:
        return v.astype(np.float32) if params.float_messages == "float32" else v
    # eq. (3): the one call of the quantizer (fedpdm_flower.fedapp.compression.quantize)
    return quantize_levels(v, params.q_step, _rng(params.seed, STREAM_DPQ_QUANT, node, k))


def decode_message(params: DPQParams, msg: Message) -> FloatArray:
    """z from a received message: ``q_step * m`` (levels) or the float vector itself (q_step = 0)."""
    if params.quantized:
        if not np.issubdtype(np.asarray(msg).dtype, np.integer):
            raise ValueError(f"q_step > 0 expects integer levels, got dtype {np.asarray(msg).dtype}")
        return dequantize(msg, params.q_step)
    return np.asarray(msg, dtype=np.float64)


def local_gradient(params: DPQParams, node: int, k: int, x: FloatArray, objective: LocalObjective) -> FloatArray:
    """g_{i,k} of (5): the mean per-sample gradient at the un-noised x over B_{i,k} (:func:`minibatch_indices`)."""
    idx = minibatch_indices(params, node, k, objective.num_samples)
    return objective.gradient(x, idx)


def node_update(params: DPQParams, node: int, k: int, x: FloatArray, own_msg: Message, self_weight: float,
                nbr_weights: Sequence[float], nbr_msgs: Sequence[Message], objective: LocalObjective,
                gradient: Callable[[FloatArray], FloatArray] | None = None) -> FloatArray:
    """Lines 4-5 of iteration k at node i: ``x_{i,k+1} = (1 - beta_hat) x + beta_hat sum_j a_ij z_j - alpha_hat g``.

    Parameters
    ----------
    x
        x_{i,k} (float64).
    own_msg
        The node's own message of iteration k (levels), used for the ``a_ii`` term (``self_term="z"``).
    self_weight, nbr_weights, nbr_msgs
        ``a_ii``; ``a_ij`` and the received messages of iteration k for the neighbours j != i, in a fixed order
        (ascending j in the simulators). Mixed as ``a_ii z_i`` then ``+ a_ij z_j`` in that order.
    objective
        f_i, for g_{i,k} (5) over the minibatch of ``default_rng([seed, 52, node, k])``.
    gradient
        Replaces (5): ``g_{i,k} = gradient(x_{i,k})``, e.g. record-level DP-SGD's noisy gradient on a Poisson sample
        (:class:`fedpdm_flower.fedapp.privacy.dpsgd.DPSGDStep`); None: the minibatch mean of (5).
    """
    if len(nbr_weights) != len(nbr_msgs):
        raise ValueError(f"{len(nbr_weights)} neighbour weights but {len(nbr_msgs)} messages")
    state = np.asarray(x, dtype=np.float64)
    own = state if params.self_term == "x" else decode_message(params, own_msg)
    mix = float(self_weight) * own
    for w, m in zip(nbr_weights, nbr_msgs, strict=True):
        mix = mix + float(w) * decode_message(params, m)
    g = local_gradient(params, node, k, state, objective) if gradient is None else np.asarray(gradient(state),
                                                                                               dtype=np.float64)
    return _step(params, state, mix, g)


def _step(params: DPQParams, x: FloatArray, mix: FloatArray, g: FloatArray) -> FloatArray:
    # eq. (6); the one expression both engines evaluate element-wise
    return np.asarray((1.0 - params.beta_hat) * x + params.beta_hat * mix - params.alpha_hat * g, dtype=np.float64)


def node_round(params: DPQParams, node: int, k: int, x: FloatArray, own_msg: Message, self_weight: float,
               nbr_weights: Sequence[float], nbr_msgs: Sequence[Message], objective: LocalObjective, *,
               send_next: bool = True,
               gradient: Callable[[FloatArray], FloatArray] | None = None) -> tuple[FloatArray, Message | None]:
    """STEP(k) of spec 7.2: :func:`node_update` to x_{i,k+1} (with ``gradient`` in place of (5) when given), then
    iteration k + 1's message (:func:`node_message` with sigma_{k+1}); ``send_next=False`` skips the message (after
    the last iteration)."""
    x_next = node_update(params, node, k, x, own_msg, self_weight, nbr_weights, nbr_msgs, objective, gradient)
    return x_next, (node_message(params, node, k + 1, x_next) if send_next else None)


# ----------------------------------------------------------------------------------------------------------------
# All nodes in one process (spec 2.4, 7.6)


@dataclass
class DPQTrace:
    """What :func:`simulate` returns.

    ``x``: final states x_T (n, d); ``states``: x_0..x_T if kept; ``consensus_error[k] = ||Y_k||^2 = sum_i ||x_{i,k} -
    x-bar_k||^2`` (k = 0..T); ``quant_error_sq[k] = ||e_k||^2`` and ``noise_sq[k] = ||n_k||^2`` summed over nodes (k =
    0..T-1; vectorised engine only); ``last_messages``: the messages of iteration T-1.
    """

    x: FloatArray
    consensus_error: FloatArray
    states: list[FloatArray] | None = None
    quant_error_sq: FloatArray | None = None
    noise_sq: FloatArray | None = None
    last_messages: list[Message] = field(default_factory=list)


def _consensus_error(x: FloatArray) -> float:
    return float(np.sum((x - x.mean(axis=0)) ** 2))


def simulate(params: DPQParams, A: ArrayLike, objectives: Sequence[LocalObjective], x0: ArrayLike,
             num_iters: int | None = None, *, engine: str = "vectorised", form: str = "mixing",
             keep_states: bool = False, callback: IterationCallback | None = None) -> DPQTrace:
    """Run Algorithm 1 on every node for ``num_iters`` iterations (default K + 1: k = 0..K).

    Parameters
    ----------
    A
        Symmetric doubly stochastic mixing matrix (validated by :func:`fedpdm_flower.fedapp.topology.validate_mixing`).
    objectives
        f_i per node.
    x0
        Common x_0 (shape (d,)) or one per node (n, d).
    engine
        ``"vectorised"``: messages per node (the per-node RNG streams), then eq. (6) for all nodes at once;
        ``"per_node"``: a loop over :func:`node_round` with a mailbox, what a Flower run computes.
    form
        Vectorised update: ``"mixing"`` ``(1 - beta_hat) X + beta_hat A Z - alpha_hat G`` with the per-node
        summation order (bit-identical to ``"per_node"``), or ``"compact"``: eqs. (31)-(32) as printed,
        ``((I - beta_hat L) (x) I) x - alpha_hat g + beta_hat (A (x) I)(e + n)`` with matrix products.
    keep_states
        Keep x_0..x_T in ``states``.
    callback
        Called after every iteration k as ``callback(k, x_{k+1}, messages_k)`` (x of shape (n, d), read-only; the
        messages of iteration k in node order), e.g. for intermediate evaluation or bit counts without keeping every
        state. It must not modify its arguments.
    """
    w = np.asarray(A, dtype=np.float64)
    topology.validate_mixing(w)
    n = w.shape[0]
    if len(objectives) != n:
        raise ValueError(f"{len(objectives)} objectives for {n} nodes")
    start = np.asarray(x0, dtype=np.float64)
    x = np.tile(start, (n, 1)) if start.ndim == 1 else start.copy()
    if x.ndim != 2 or x.shape[0] != n:
        raise ValueError(f"x0 must have shape (d,) or ({n}, d), got {start.shape}")
    if num_iters is None:
        if params.K is None:
            raise ValueError("num_iters is required when params.K is None")
        num_iters = params.K + 1
    if engine not in ("vectorised", "per_node"):
        raise ValueError(f"engine must be 'vectorised' or 'per_node', got {engine!r}")
    if form not in ("mixing", "compact"):
        raise ValueError(f"form must be 'mixing' or 'compact', got {form!r}")
    nbrs = [[j for j in range(n) if j != i and w[i, j] > 0] for i in range(n)]
    if engine == "per_node":
        return _simulate_per_node(params, w, nbrs, objectives, x, num_iters, keep_states, callback)

    states = [x.copy()] if keep_states else None
    consensus = [_consensus_error(x)]
    q_err: list[float] = []
    n_sq: list[float] = []
    msgs: list[Message] = []
    # slot t of node i: its t-th neighbour (ascending); nodes with fewer neighbours are masked out of slot t
    slots = max((len(nb) for nb in nbrs), default=0)
    slot_mask = [np.array([len(nbrs[i]) > t for i in range(n)]) for t in range(slots)]
    slot_src = [np.array([nbrs[i][t] for i in range(n) if len(nbrs[i]) > t], dtype=np.int64) for t in range(slots)]
    slot_w = [np.array([w[i, nbrs[i][t]] for i in range(n) if len(nbrs[i]) > t])[:, None] for t in range(slots)]
    diag = np.diag(w).copy()[:, None]
    lap_lazy = np.eye(n) - params.beta_hat * (np.eye(n) - w)
    w_msg = w if params.self_term == "z" else w - np.diag(np.diag(w))
    for k in range(num_iters):
        rows = [x[i].copy() for i in range(n)]  # fresh arrays, as a node holds them
        msgs = [node_message(params, i, k, rows[i]) for i in range(n)]
        z = np.stack([decode_message(params, m) for m in msgs])
        noise = np.zeros_like(x)
        for i in range(n):  # the same draws node_message made (for the diagnostics and the compact form)
            ni = privacy_noise(params, i, k, x.shape[1])
            if ni is not None:
                noise[i] = ni
        q_err.append(float(np.sum((z - (x + noise)) ** 2)))
        n_sq.append(float(np.sum(noise**2)))
        g = np.stack([local_gradient(params, i, k, rows[i], objectives[i]) for i in range(n)])
        if form == "mixing":
            mix = diag * (x if params.self_term == "x" else z)
            for t in range(slots):
                mask = slot_mask[t]
                mix[mask] = mix[mask] + slot_w[t] * z[slot_src[t]]
            x = _step(params, x, mix, g)
        else:
            # (31)-(32): ((I - beta L) (x) I) x - alpha g + beta (A (x) I)(e + n), e = z - x - n. With
            # self_term="x" only the off-diagonal of A acts on e + n (a_ii multiplies x_i itself).
            e = z - x - noise
            x = lap_lazy @ x - params.alpha_hat * g + params.beta_hat * (w_msg @ (e + noise))
        if states is not None:
            states.append(x.copy())
        consensus.append(_consensus_error(x))
        if callback is not None:
            callback(k, x, msgs)
    return DPQTrace(x=x, consensus_error=np.array(consensus), states=states, quant_error_sq=np.array(q_err),
                    noise_sq=np.array(n_sq), last_messages=msgs)


def _simulate_per_node(params: DPQParams, w: FloatArray, nbrs: list[list[int]], objectives: Sequence[LocalObjective],
                       x: FloatArray, num_iters: int, keep_states: bool,
                       callback: IterationCallback | None = None) -> DPQTrace:
    n = w.shape[0]
    xs = [x[i].copy() for i in range(n)]
    states = [x.copy()] if keep_states else None
    consensus = [_consensus_error(x)]
    mailbox: list[Message] = [node_message(params, i, 0, xs[i]) for i in range(n)]  # INIT round (spec 7.2)
    last = list(mailbox)
    for k in range(num_iters):
        new_x: list[FloatArray] = []
        new_msgs: list[Message] = []
        for i in range(n):
            xi, mi = node_round(params, i, k, xs[i], mailbox[i], float(w[i, i]), [float(w[i, j]) for j in nbrs[i]],
                                [mailbox[j] for j in nbrs[i]], objectives[i], send_next=k + 1 < num_iters)
            new_x.append(xi)
            if mi is not None:
                new_msgs.append(mi)
        last = mailbox
        xs = new_x
        mailbox = new_msgs
        stacked = np.stack(xs)
        if states is not None:
            states.append(stacked.copy())
        consensus.append(_consensus_error(stacked))
        if callback is not None:
            callback(k, stacked, last)
    return DPQTrace(x=np.stack(xs), consensus_error=np.array(consensus), states=states, last_messages=last)
