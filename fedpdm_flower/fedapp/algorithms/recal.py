"""DP-RECAL (seed 001): the framework-free mathematics, in numpy.

L. Wang, L. Guo, S. Yang, X. Shi, "Differentially Private Decentralized Optimization with Relay Communication"
(spec ``shared/specs/dp_recal.md``). Equation numbers in brackets are the paper's, section numbers the spec's.

What is here (no Flower, no graph module; the Strategy, the NumPyClient and the reference simulator all call the
same functions, so their arithmetic is identical):

* the experiments' problem (5.1): agent i holds ``f_i(y) = (1/m_i) sum_j 1/2 ||B_ij^T y - b_ij||^2``
  (:class:`LocalLeastSquares`) and the global regulariser is the elastic net ``r(x) = nu1 ||x||_1 + nu2 ||x||^2``
  (``nu1 = nu2 = 0`` is r = 0, ``nu2 = 0`` pure l1), so problem (1) is ``F(x) = sum_i f_i(x) + n r(x)``
  (:class:`ElasticNetProblem`). Targets may be one column (``b_i`` of shape (m_i,), ``x`` of shape (q,)) or C
  columns (one-hot +-1 labels, spec A6: ``b_i`` of shape (m_i, C), ``x`` of shape (q, C)); every operation except
  the gradient is element-wise and norms are Frobenius norms, so the two layouts need no separate code;
* ``prox_{n r}`` (2.5), the stepsizes beta and alpha_i (2.6), the noise schedule ``sigma_t = sigma_1 R^{-(t-1)/2}``
  with the stateless noise RNG of 7.3;
* :func:`dprecal_step`: one activation, S1-S8 of the pseudocode (2.3), in both u-tracking modes (2.4);
* :func:`solve_elastic_net`: the centralised reference x* (5.7): FISTA with adaptive restart on F, then a
  support-restricted Newton polish (verified against the fixed-point residual), or the closed form when nu1 = 0;
* :func:`sklearn_elastic_net_params`: scikit-learn's ``ElasticNet`` parameters that minimise the same objective
  (used by the tests as an independent check of x*);
* :func:`simulate_dprecal`: the in-process reference loop (7.5) for long sweeps, the next holder given by a callable;
* :func:`load_covtype_problem` and the helpers of the MNIST problem (:func:`encode_targets`, :func:`split_agents`,
  :func:`minmax_scale`): the data of the experiments (5.2); MNIST itself comes from the app's dataset registry
  (:func:`fedpdm_flower.fedapp.apps.recal.load_mnist_problem`).

Data and target choice (5.2, A6, A7): MNIST's 60,000 training images, pixels divided by 255 (the min-max scaling
of the pixel range; per-pixel min-max is offered as ``scaling="minmax"`` but the spec advises against it), the
bias column of the app's MNIST loader dropped (q = 784), labels one-hot +-1 (C = 10, x is 784 x 10)
or even-vs-odd +-1, shuffled with a seeded permutation and cut into n = 8 parts of 7,500 with
``np.array_split``. covtype (needs a network): per-feature min-max with constant columns set to 0, a seeded
55,500-row subsample, labels one-hot +-1 (C = 7) or Lodgepole Pine (class 2) vs rest; 55,500 / 8 is not an
integer, so the parts have 6,938 / 6,937 rows, which the per-agent 1/m_i of f_i absorbs.

Known limitation kept on purpose (spec A1): only u is privatised; x is sent in the clear and lets an eavesdropper
recover y_i wherever the prox is invertible. Nothing here "fixes" that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedpdm_flower.fedapp.localdata import ArrayData
from fedpdm_flower.fedapp.models.least_squares import LeastSquares

FloatArray = NDArray[np.float64]
Mode = Literal["exact", "private"]
#: u-tracking modes of 2.4: "exact" carries the clean u on the baton (paper-faithful, NOT private against whoever
#: routes the baton); "private" carries only u-tilde, into which the receiving agent accumulates (deployable)
MODES: tuple[str, ...] = ("exact", "private")
#: target encodings of spec A6
LABEL_MODES: tuple[str, ...] = ("onehot_pm1", "binary_pm1")
#: MNIST feature scalings: "pixel255" divides by 255 (spec 5.2 [interp]); "minmax" is per-feature min-max
MNIST_SCALINGS: tuple[str, ...] = ("pixel255", "minmax")
#: samples of covtype the paper used (spec A7)
COVTYPE_SAMPLES = 55_500
#: covtype's Lodgepole Pine, the positive class of ``label_mode="binary_pm1"`` (labels 1..7 in the source)
COVTYPE_POSITIVE_CLASS = 2

#: largest q for which the centralised solver forms sum_i G_i (q x q) even when some agent has q > m_i
MAX_DENSE_Q = 4096

_TINY = np.finfo(np.float64).tiny


def _as_float(a: ArrayLike) -> FloatArray:
    return np.asarray(a, dtype=np.float64)


# --------------------------------------------------------------------------------------------- prox, r
def soft_threshold(v: ArrayLike, t: float) -> FloatArray:
    """``sign(v) max(|v| - t, 0)``, element-wise (the prox of ``t ||.||_1``)."""
    va = _as_float(v)
    return np.asarray(np.sign(va) * np.maximum(np.abs(va) - t, 0.0), dtype=np.float64)


def prox_nr(v: ArrayLike, n: int | float, nu1: float, nu2: float) -> FloatArray:
    """``prox_{n r}(v) = argmin_z n r(z) + 1/2 ||z - v||^2`` for ``r = nu1 ||.||_1 + nu2 ||.||^2`` (spec 2.5).

    Unit step, identity metric: ``soft(v, n nu1) / (1 + 2 n nu2)``. ``nu1 = nu2 = 0`` is the identity (r = 0),
    ``nu2 = 0`` the soft threshold (pure l1). Pass ``n * t`` for the prox of ``t n r``.
    """
    if nu1 < 0 or nu2 < 0:
        raise ValueError(f"nu1 and nu2 must be >= 0, got {nu1}, {nu2}")
    va = _as_float(v)
    out = soft_threshold(va, n * nu1) if nu1 > 0 else va.copy()
    if nu2 > 0:
        out = out / (1.0 + 2.0 * n * nu2)
    return np.asarray(out, dtype=np.float64)


def elastic_net(x: ArrayLike, nu1: float, nu2: float) -> float:
    """``r(x) = nu1 ||x||_1 + nu2 ||x||^2`` (entries summed over every axis)."""
    xa = _as_float(x)
    return float(nu1 * np.abs(xa).sum() + nu2 * np.vdot(xa, xa))


def relative_error(x: ArrayLike, x_star: ArrayLike, x_ref: ArrayLike | None = None) -> float:
    """``||x - x*|| / ||x_ref - x*||`` (Frobenius), ``x_ref = 0`` by default, i.e. ``||x - x*|| / ||x*||``.

    Spec 5.7 divides by the initial baton's distance (``x_ref = x^1``); the two agree for ``x^1 = 0``.

    Raises
    ------
    ValueError
        If the denominator is 0 (spec A9: x* = x_ref; start from a seeded N(0, I) x^1 instead).
    """
    xs = _as_float(x_star)
    ref = np.zeros_like(xs) if x_ref is None else _as_float(x_ref)
    den = float(np.linalg.norm(ref - xs))
    if den == 0.0:
        raise ValueError("relative error undefined: ||x_ref - x*|| = 0 (spec A9: use a seeded N(0, I) x^1)")
    return float(np.linalg.norm(_as_float(x) - xs)) / den


# --------------------------------------------------------------------------------------------- stepsizes
def beta_for(n: int) -> float:
    """``beta = 1 / (2 (n + 1))``, fixed by the paper (spec 2.6); 1/18 for n = 8."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 1.0 / (2.0 * (n + 1))


def alpha_bound(lipschitz: float) -> float:
    """``2 / (L_i + 1)``: Assumption 2 asks ``alpha_i`` strictly below it."""
    return 2.0 / (lipschitz + 1.0)


def alpha_for(lipschitz: float, alpha_scale: float = 0.5) -> float:
    """``alpha_i = alpha_scale * 2 / (L_i + 1)`` (spec 2.6 [interp]; 0.5 gives ``1 / (L_i + 1)``).

    Raises
    ------
    ValueError
        Unless ``0 < alpha_scale < 1`` and ``L_i >= 0``.
    """
    if not 0.0 < alpha_scale < 1.0:
        raise ValueError(f"alpha_scale must lie in (0, 1), got {alpha_scale}")
    if lipschitz < 0:
        raise ValueError(f"L_i must be >= 0, got {lipschitz}")
    return alpha_scale * alpha_bound(lipschitz)


def check_alpha(alpha: float, lipschitz: float, allow_large_alpha: bool = False) -> None:
    """Raise ``ValueError`` unless ``0 < alpha < 2 / (L + 1)`` (the upper end waived by ``allow_large_alpha``)."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if alpha >= alpha_bound(lipschitz) and not allow_large_alpha:
        raise ValueError(
            f"alpha = {alpha} violates Assumption 2 (alpha < 2/(L+1) = {alpha_bound(lipschitz)}); "
            "pass allow_large_alpha=True to run it anyway"
        )


# --------------------------------------------------------------------------------------------- least squares
@dataclass(frozen=True, eq=False)
class LocalLeastSquares:
    """Agent i's loss ``f_i(y) = (1/m_i) sum_j 1/2 ||B_ij^T y - b_ij||^2 = ||B_i y - b_i||^2 / (2 m_i)`` (5.1).

    Parameters
    ----------
    features
        ``B_i``, shape (m_i, q): one sample per row.
    targets
        ``b_i``, shape (m_i,) (then y has shape (q,)) or (m_i, C) (then y has shape (q, C)).

    The gradient ``(1/m_i) B_i^T (B_i y - b_i)`` is evaluated as ``G_i y - h_i`` with the cached Gram matrix
    ``G_i = B_i^T B_i / m_i`` and moment ``h_i = B_i^T b_i / m_i`` when ``q <= m_i`` (cheaper per step), and
    directly otherwise; :meth:`grad_direct` is always the direct formula.
    """

    features: FloatArray
    targets: FloatArray

    def __post_init__(self) -> None:
        b_mat = np.ascontiguousarray(self.features, dtype=np.float64)
        b_vec = np.ascontiguousarray(self.targets, dtype=np.float64)
        if b_mat.ndim != 2 or b_mat.shape[0] < 1 or b_mat.shape[1] < 1:
            raise ValueError(f"features must be a non-empty 2-D array (m_i, q), got shape {b_mat.shape}")
        if b_vec.ndim not in (1, 2) or b_vec.shape[0] != b_mat.shape[0]:
            raise ValueError(
                f"targets must have shape (m_i,) or (m_i, C) with m_i = {b_mat.shape[0]}, got {b_vec.shape}"
            )
        if not (np.isfinite(b_mat).all() and np.isfinite(b_vec).all()):
            raise ValueError("features and targets must be finite")
        object.__setattr__(self, "features", b_mat)
        object.__setattr__(self, "targets", b_vec)

    @property
    def m(self) -> int:
        """m_i, the number of samples."""
        return int(self.features.shape[0])

    @property
    def q(self) -> int:
        """Number of features."""
        return int(self.features.shape[1])

    @property
    def x_shape(self) -> tuple[int, ...]:
        """Shape of y (and of x, u, lambda): (q,) or (q, C)."""
        return (self.q,) if self.targets.ndim == 1 else (self.q, int(self.targets.shape[1]))

    @property
    def dim(self) -> int:
        """Number of entries of y (q or q C): the length of the flat vector a Flower message carries."""
        return int(np.prod(self.x_shape))

    def _shaped(self, y: ArrayLike) -> FloatArray:
        """y as an array of ``x_shape``: a flat vector of ``dim`` entries is read row-major (numpy's C order, the
        order :class:`fedpdm_flower.fedapp.layout.ArrayLayout` flattens a (q, C) array in)."""
        ya = _as_float(y)
        if ya.ndim == 1 and len(self.x_shape) == 2 and ya.size == self.dim:
            return ya.reshape(self.x_shape)
        return ya

    @property
    def uses_gram(self) -> bool:
        """Whether :meth:`grad` goes through the cached q x q Gram matrix (``q <= m_i``)."""
        return self.q <= self.m

    @cached_property
    def gram(self) -> FloatArray:
        """``G_i = B_i^T B_i / m_i``, shape (q, q) (computed on first use)."""
        g = self.features.T @ self.features / self.m
        return np.asarray(0.5 * (g + g.T), dtype=np.float64)  # exactly symmetric

    @cached_property
    def moment(self) -> FloatArray:
        """``h_i = B_i^T b_i / m_i``, shape (q,) or (q, C)."""
        return np.asarray(self.features.T @ self.targets / self.m, dtype=np.float64)

    @cached_property
    def lipschitz(self) -> float:
        """``L_i = lambda_max(B_i^T B_i) / m_i`` by ``eigvalsh`` (of the smaller of ``B^T B``, ``B B^T``)."""
        if self.uses_gram:
            small = self.gram
        else:
            g = self.features @ self.features.T / self.m
            small = 0.5 * (g + g.T)
        return float(max(np.linalg.eigvalsh(small)[-1], 0.0))

    def value(self, y: ArrayLike) -> float:
        """``f_i(y) = ||B_i y - b_i||^2 / (2 m_i)`` (direct formula); y of ``x_shape`` or flat."""
        res = self.features @ self._shaped(y) - self.targets
        return 0.5 * float(np.vdot(res, res)) / self.m

    def grad(self, y: ArrayLike) -> FloatArray:
        """``grad f_i(y) = (1/m_i) B_i^T (B_i y - b_i)``, shape of y (``x_shape`` or flat)."""
        ya = _as_float(y)
        if not self.uses_gram:
            return self.grad_direct(ya)
        return np.asarray(self.gram @ self._shaped(ya) - self.moment, dtype=np.float64).reshape(ya.shape)

    def grad_direct(self, y: ArrayLike) -> FloatArray:
        """The gradient by the direct formula ``B_i^T (B_i y - b_i) / m_i``, shape of y."""
        ya = _as_float(y)
        g = self.features.T @ (self.features @ self._shaped(ya) - self.targets) / self.m
        return np.asarray(g, dtype=np.float64).reshape(ya.shape)

    def records(self) -> tuple[LeastSquares, ArrayData]:
        """f_i as record-level DP-SGD sees it: the loss of one record (B_ij, b_ij),
        ``1/2 ||B_ij^T y - b_ij||^2`` on the flat y (:class:`fedpdm_flower.fedapp.models.least_squares.LeastSquares`,
        with its per-record gradients), and the m_i records themselves. f_i is their mean."""
        outputs = None if self.targets.ndim == 1 else int(self.targets.shape[1])
        return LeastSquares(self.q, outputs), ArrayData(self.features, self.targets)


def lipschitz_power_iteration(features: ArrayLike, iters: int = 1000, tol: float = 1e-13, seed: int = 0) -> float:
    """``lambda_max(B^T B) / m`` by power iteration on ``v -> B^T (B v) / m`` (for q too large for ``eigvalsh``).

    Stops when the Rayleigh quotient changes by at most ``tol`` (relative) or after ``iters`` products.
    """
    b_mat = _as_float(features)
    m = b_mat.shape[0]
    v = np.random.default_rng(seed).standard_normal(b_mat.shape[1])
    v = v / float(np.linalg.norm(v))
    lam = 0.0
    for _ in range(iters):
        w = b_mat.T @ (b_mat @ v) / m
        lam_new = float(v @ w)
        nw = float(np.linalg.norm(w))
        if nw == 0.0:
            return 0.0
        v = w / nw
        if abs(lam_new - lam) <= tol * abs(lam_new):
            return lam_new
        lam = lam_new
    return lam


@dataclass(frozen=True, eq=False)
class ElasticNetProblem:
    """Problem (1) of the experiments: ``F(x) = sum_i f_i(x) + n r(x)``, ``r = nu1 ||.||_1 + nu2 ||.||^2`` (5.1).

    The paper's displayed objective is ``F / n``: ``(1/n) sum_i f_i(x) + r(x)``; both have the same minimiser.

    Parameters
    ----------
    agents
        One :class:`LocalLeastSquares` per agent, all with the same ``x_shape``.
    nu1, nu2
        Elastic-net weights (the paper: 1/2 and 1/2).
    """

    agents: tuple[LocalLeastSquares, ...]
    nu1: float = 0.5
    nu2: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "agents", tuple(self.agents))
        if not self.agents:
            raise ValueError("a problem needs at least one agent")
        shapes = {a.x_shape for a in self.agents}
        if len(shapes) != 1:
            raise ValueError(f"agents disagree on the shape of x: {sorted(shapes)}")
        if self.nu1 < 0 or self.nu2 < 0:
            raise ValueError(f"nu1 and nu2 must be >= 0, got {self.nu1}, {self.nu2}")

    @classmethod
    def from_arrays(
        cls, features: Sequence[ArrayLike], targets: Sequence[ArrayLike], nu1: float = 0.5, nu2: float = 0.5
    ) -> ElasticNetProblem:
        """Build from per-agent ``B_i`` (m_i, q) and ``b_i`` (m_i,) or (m_i, C)."""
        if len(features) != len(targets):
            raise ValueError(f"{len(features)} feature blocks but {len(targets)} target blocks")
        agents = tuple(LocalLeastSquares(_as_float(f), _as_float(t)) for f, t in zip(features, targets, strict=True))
        return cls(agents, nu1, nu2)

    @property
    def n(self) -> int:
        """Number of agents."""
        return len(self.agents)

    @property
    def x_shape(self) -> tuple[int, ...]:
        """Shape of x: (q,) or (q, C)."""
        return self.agents[0].x_shape

    @property
    def sizes(self) -> NDArray[np.int64]:
        """m_i per agent."""
        return np.array([a.m for a in self.agents], dtype=np.int64)

    @property
    def lipschitz(self) -> FloatArray:
        """L_i per agent."""
        return np.array([a.lipschitz for a in self.agents], dtype=np.float64)

    def regularizer(self, x: ArrayLike) -> float:
        """``r(x)``."""
        return elastic_net(x, self.nu1, self.nu2)

    def prox(self, v: ArrayLike) -> FloatArray:
        """``prox_{n r}(v)`` (unit step)."""
        return prox_nr(v, self.n, self.nu1, self.nu2)

    def smooth_value(self, x: ArrayLike) -> float:
        """``sum_i f_i(x)``."""
        return float(sum(a.value(x) for a in self.agents))

    def smooth_grad(self, x: ArrayLike) -> FloatArray:
        """``sum_i grad f_i(x)``."""
        xa = _as_float(x)
        if self._total_gram is not None:
            return np.asarray(self._total_gram @ xa - self._total_moment, dtype=np.float64)
        return np.asarray(sum(a.grad(xa) for a in self.agents), dtype=np.float64)

    def objective(self, x: ArrayLike) -> float:
        """``F(x) = sum_i f_i(x) + n r(x)``, problem (1)."""
        return self.smooth_value(x) + self.n * self.regularizer(x)

    def prox_residual(self, x: ArrayLike) -> float:
        """``||x - prox_{n r}(x - sum_i grad f_i(x))||``: 0 exactly at the minimiser (unit-step KKT residual)."""
        xa = _as_float(x)
        return float(np.linalg.norm(xa - self.prox(xa - self.smooth_grad(xa))))

    @cached_property
    def _total_gram(self) -> FloatArray | None:
        # sum_i G_i for the centralised solver; skipped only when q x q would be large and no agent has one anyway
        if not all(a.uses_gram for a in self.agents) and self.x_shape[0] > MAX_DENSE_Q:
            return None
        total = np.zeros((self.x_shape[0], self.x_shape[0]))
        for a in self.agents:  # an agent without a cached Gram matrix gets a temporary one, not cached
            total += a.gram if a.uses_gram else a.features.T @ a.features / a.m
        return np.asarray(0.5 * (total + total.T), dtype=np.float64)

    @cached_property
    def _total_moment(self) -> FloatArray:
        return np.asarray(sum(a.moment for a in self.agents), dtype=np.float64)

    @cached_property
    def smooth_lipschitz(self) -> float:
        """Lipschitz constant of ``sum_i grad f_i``: ``lambda_max(sum_i G_i)``, or ``sum_i L_i`` without Gram matrices."""
        if self._total_gram is not None:
            return float(max(np.linalg.eigvalsh(self._total_gram)[-1], 0.0))
        return float(self.lipschitz.sum())


# --------------------------------------------------------------------------------------------- reference x*
@dataclass(frozen=True)
class ReferenceSolution:
    """Output of :func:`solve_elastic_net`.

    Attributes
    ----------
    x
        The minimiser x* of F.
    method
        ``"closed_form"``, ``"fista"`` or ``"fista+polish"``.
    iterations
        FISTA iterations (0 for the closed form).
    residual
        :meth:`ElasticNetProblem.prox_residual` at x (unit step).
    converged
        Whether the stopping rule was met within ``max_iter``.
    """

    x: FloatArray
    method: str
    iterations: int
    residual: float
    converged: bool


def solve_elastic_net(
    problem: ElasticNetProblem,
    *,
    tol: float = 1e-12,
    max_iter: int = 100_000,
    method: str = "auto",
    polish: bool = True,
) -> ReferenceSolution:
    """The centralised minimiser x* of ``F = sum_i f_i + n r`` (spec 5.7), independent of RECAL.

    * ``method="closed_form"`` (``"auto"`` picks it when ``nu1 = 0`` and ``sum_i G_i`` is formed, i.e.
      ``q <= MAX_DENSE_Q`` or ``q <= m_i`` for every agent):
      ``x* = (sum_i G_i + 2 n nu2 I)^{-1} sum_i h_i`` (least-norm ``lstsq`` when singular).
    * ``method="fista"``: FISTA (Beck & Teboulle) with step ``t = 1 / lambda_max(sum_i G_i)`` and the prox of
      ``t n r`` (``soft(., t n nu1) / (1 + 2 t n nu2)``), momentum reset whenever the step goes uphill
      (O'Donoghue & Candes' gradient restart), from x = 0, until the unit-step KKT residual ``||x - prox_{n r}(x - sum_i grad f_i(x))|| <= tol max(||x||, tiny)``. With
      ``polish`` the result is then refined by a Newton solve on its support and sign pattern, per target column:
      ``x_S = (G_SS + 2 n nu2 I)^{-1} (h_S - n nu1 sign(x_S))``, coordinates whose sign flips leave S and S is
      solved again; the polished point is kept only if its KKT residual is not larger (typically ~1e-15).
    """
    n, nu1, nu2 = problem.n, problem.nu1, problem.nu2
    gram = problem._total_gram
    if method == "auto":
        method = "closed_form" if (nu1 == 0 and gram is not None) else "fista"
    if method == "closed_form":
        if nu1 != 0 or gram is None:
            raise ValueError(f"the closed form needs nu1 = 0 and sum_i G_i (q <= {MAX_DENSE_Q} or q <= every m_i)")
        x = _ridge_solve(gram + 2.0 * n * nu2 * np.eye(gram.shape[0]), problem._total_moment)
        return ReferenceSolution(x, "closed_form", 0, problem.prox_residual(x), True)
    if method != "fista":
        raise ValueError(f"unknown method {method!r}; valid: 'auto', 'fista', 'closed_form'")

    lf = problem.smooth_lipschitz
    t = 1.0 / lf if lf > 0 else 1.0

    def step(v: FloatArray) -> FloatArray:
        return prox_nr(v - t * problem.smooth_grad(v), n * t, nu1, nu2)

    x = np.zeros(problem.x_shape)
    z = x.copy()
    theta = 1.0
    converged = False
    it = 0
    while it < max_iter:
        it += 1
        x_new = step(z)
        if np.vdot(z - x_new, x_new - x) > 0:  # uphill: drop the momentum (gradient restart)
            theta = 1.0
        theta_new = 0.5 * (1.0 + math.sqrt(1.0 + 4.0 * theta * theta))
        z = x_new + ((theta - 1.0) / theta_new) * (x_new - x)
        step_len = float(np.linalg.norm(x_new - x))
        x, theta = x_new, theta_new
        scale = max(float(np.linalg.norm(x)), _TINY)
        if (step_len <= tol * scale or it % 25 == 0) and problem.prox_residual(x) <= tol * scale:
            converged = True
            break
    label = "fista"
    if polish and gram is not None:
        polished = _polish(problem, gram, x)
        if polished is not None:
            x, label = polished, "fista+polish"
    return ReferenceSolution(x, label, it, problem.prox_residual(x), converged)


def _ridge_solve(mat: FloatArray, rhs: FloatArray) -> FloatArray:
    try:
        return np.asarray(np.linalg.solve(mat, rhs), dtype=np.float64)
    except np.linalg.LinAlgError:
        return np.asarray(np.linalg.lstsq(mat, rhs, rcond=None)[0], dtype=np.float64)


def _polish(problem: ElasticNetProblem, gram: FloatArray, x: FloatArray) -> FloatArray | None:
    n, nu1, nu2 = problem.n, problem.nu1, problem.nu2
    h = problem._total_moment
    cols_x = x.reshape(x.shape[0], -1)
    cols_h = h.reshape(h.shape[0], -1)
    out = np.zeros_like(cols_x)
    for c in range(cols_x.shape[1]):
        s = np.flatnonzero(cols_x[:, c])
        for _ in range(10):  # active-set refinement: drop the coordinates whose sign flips
            if s.size == 0:
                break
            sign = np.sign(cols_x[s, c])
            mat = gram[np.ix_(s, s)] + 2.0 * n * nu2 * np.eye(s.size)
            try:
                xs = np.linalg.solve(mat, cols_h[s, c] - n * nu1 * sign)
            except np.linalg.LinAlgError:
                return None
            keep = np.sign(xs) == sign
            if keep.all():
                out[s, c] = xs
                break
            s = s[keep]
        else:
            return None
    cand = out.reshape(x.shape)
    return cand if problem.prox_residual(cand) <= problem.prox_residual(x) else None


def sklearn_elastic_net_params(problem: ElasticNetProblem) -> tuple[float, float, FloatArray]:
    """``(alpha, l1_ratio, sample_weight)`` with which scikit-learn's ElasticNet minimises ``F / n``.

    scikit-learn minimises ``1/(2 N) sum_k s_k (y_k - X_k w)^2 + a l1 ||w||_1 + a (1 - l1)/2 ||w||^2`` over the
    stacked rows (N = sum_i m_i, weights rescaled to sum to N). Dividing (1) by n gives
    ``sum_i 1/(2 n m_i) sum_j (b_ij - B_ij w)^2 + nu1 ||w||_1 + nu2 ||w||^2``, so
    ``a l1 = nu1``, ``a (1 - l1) = 2 nu2``, i.e. ``a = nu1 + 2 nu2``, ``l1 = nu1 / (nu1 + 2 nu2)``, and the row
    weights are ``s_ij = N / (n m_i)`` (they already sum to N). With equal m_i every weight is 1 and the data term
    is the plain mean over all rows; unequal m_i need the weights (each agent's rows count 1/m_i, not 1/N).
    Use ``ElasticNet(alpha=a, l1_ratio=l1, fit_intercept=False).fit(vstack(B_i), vstack(b_i), sample_weight=s)``;
    for C target columns scikit-learn solves the C separable problems, which is what F is.

    Raises
    ------
    ValueError
        If ``nu1 + 2 nu2 = 0`` (r = 0: scikit-learn's alpha = 0 is plain least squares; use ``lstsq``).
    """
    a = problem.nu1 + 2.0 * problem.nu2
    if a == 0:
        raise ValueError("r = 0 has no ElasticNet equivalent (alpha = 0); use least squares")
    sizes = problem.sizes
    total = float(sizes.sum())
    weights = np.concatenate([np.full(m, total / (problem.n * m)) for m in sizes])
    return a, problem.nu1 / a, weights


# --------------------------------------------------------------------------------------------- DP-RECAL step
@dataclass(frozen=True)
class AgentState:
    """Agent i's private state: ``y_i``, ``lambda_i`` and its activation count ``tau_i`` (spec 2.2)."""

    y: FloatArray
    lam: FloatArray
    tau: int = 0

    @classmethod
    def initial(cls, x1: ArrayLike) -> AgentState:
        """I1: ``y_i = x^1``, ``lambda_i = 0``, ``tau_i = 0``."""
        xa = _as_float(x1)
        return cls(xa.copy(), np.zeros_like(xa), 0)


@dataclass(frozen=True)
class Baton:
    """The travelling message: ``x``, the noisy dual sum ``ut`` (u-tilde) and, in exact mode only, the clean ``u``."""

    x: FloatArray
    ut: FloatArray
    u: FloatArray | None = None

    @classmethod
    def initial(cls, x1: ArrayLike, mode: str) -> Baton:
        """I2: ``x = x^1``, ``ut = 0`` and (exact mode) ``u = 0``."""
        _check_mode(mode)
        xa = _as_float(x1).copy()
        return cls(xa, np.zeros_like(xa), np.zeros_like(xa) if mode == "exact" else None)


@dataclass(frozen=True)
class RecalConfig:
    """Global constants of a run.

    Parameters
    ----------
    n
        Number of agents (enters ``prox_{n r}`` and the default beta).
    nu1, nu2
        Elastic-net weights of r.
    sigma1, R
        Noise std of an agent's first activation and the attenuation factor (``R >= 1``; Theorem 1 wants R > 1).
        ``sigma1 = 0`` is non-private RECAL: no draw at all, both modes coincide.
    mode
        ``"exact"`` or ``"private"`` (:data:`MODES`, spec 2.4); default ``"private"``.
    noise_seed
        Seed of the stateless noise RNG ``default_rng([noise_seed, agent_id, tau_i])`` (spec 7.3).
    beta
        Dual stepsize; ``None`` is ``1 / (2 (n + 1))``.
    """

    n: int
    nu1: float = 0.5
    nu2: float = 0.5
    sigma1: float = 0.0
    R: float = 1.0
    mode: str = "private"
    noise_seed: int = 0
    beta: float | None = field(default=None)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.nu1 < 0 or self.nu2 < 0:
            raise ValueError(f"nu1 and nu2 must be >= 0, got {self.nu1}, {self.nu2}")
        if not (self.sigma1 >= 0 and math.isfinite(self.sigma1)):
            raise ValueError(f"sigma1 must be finite and >= 0, got {self.sigma1}")
        if not self.R >= 1:
            raise ValueError(f"R must be >= 1, got {self.R}")
        _check_mode(self.mode)
        if self.noise_seed < 0:
            raise ValueError(f"noise_seed must be >= 0, got {self.noise_seed}")
        if self.beta is None:
            object.__setattr__(self, "beta", beta_for(self.n))
        elif not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")

    @property
    def beta_value(self) -> float:
        """beta as a float (set in ``__post_init__``)."""
        assert self.beta is not None
        return self.beta


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(repr(m) for m in MODES)}")


def noise_sigma(tau: int, sigma1: float, R: float) -> float:
    """``sigma_tau = sigma1 R^{-(tau - 1)/2}``: std of an agent's ``tau``-th activation (tau = 1, 2, ...)."""
    if tau < 1:
        raise ValueError(f"tau counts activations from 1, got {tau}")
    if sigma1 == 0:
        return 0.0
    # in logs: a calibrated sigma1 can be ~e^436 while R^{-(tau-1)/2} underflows
    return math.exp(math.log(sigma1) - 0.5 * (tau - 1) * math.log(R))


def noise_rng(noise_seed: int, agent_id: int, tau: int) -> np.random.Generator:
    """The noise stream of agent ``agent_id``'s ``tau``-th activation: ``default_rng([noise_seed, agent_id, tau])``.

    Stateless (spec 7.3): independent of object re-creation, one distinct stream per activation. ``tau`` is the
    activation's 1-based index, i.e. the agent's count after S6.
    """
    return np.random.default_rng([noise_seed, agent_id, tau])


def activation_noise(shape: tuple[int, ...], tau: int, agent_id: int, cfg: RecalConfig) -> FloatArray:
    """``epsilon = sigma_tau * N(0, I)`` of S6 (all zeros, and no draw, when ``sigma1 = 0``)."""
    sigma = noise_sigma(tau, cfg.sigma1, cfg.R)
    if cfg.sigma1 == 0:
        return np.zeros(shape)
    return sigma * noise_rng(cfg.noise_seed, agent_id, tau).standard_normal(shape)


@dataclass(frozen=True)
class StepResult:
    """Output of :func:`dprecal_step`: the outgoing baton, the agent's committed state, and the noise it drew."""

    baton: Baton
    state: AgentState
    noise: FloatArray
    sigma: float


def dprecal_step(
    baton: Baton,
    state: AgentState,
    grad_fi: Callable[[FloatArray], FloatArray],
    alpha: float,
    cfg: RecalConfig,
    agent_id: int,
) -> StepResult:
    """One DP-RECAL activation of agent ``agent_id``: S1-S8 of the spec's pseudocode (2.3), float64.

    ::

        S1  lam_half = lam + beta (x - y)                                  (12a)
        S2  x_new    = prox_{n r}(x - (ut + lam_half - lam))               (12b) with u-tilde
        S3  y_new    = y - alpha (grad f_i(y) - lam_half)                  (12c) gradient at the OLD y
        S4  lam_new  = lam_half + beta ((x_new - x) - (y_new - y))          (12d)
        S5  u_new    = (u if exact else ut) + (lam_new - lam)               (12e)
        S6  tau += 1; sigma = sigma1 R^{-(tau-1)/2}; eps = sigma N(0, I)    rng = default_rng([seed, i, tau])
        S7  ut_new   = u_new - eps                                          (Algorithm 1)
        S8  commit (y, lam) = (y_new, lam_new)

    Parameters
    ----------
    baton
        The incoming ``(x^k, ut^k[, u^k])``; ``u`` must be present in exact mode and absent in private mode.
    state
        The agent's ``(y_i, lambda_i, tau_i)``.
    grad_fi
        ``y -> grad f_i(y)`` (e.g. :meth:`LocalLeastSquares.grad`).
    alpha
        The agent's stepsize alpha_i (not checked here; see :func:`check_alpha`).
    cfg
        Run constants (n, r, beta, sigma1, R, mode, noise seed).
    agent_id
        i, 0-based; selects the noise stream.

    Returns
    -------
    StepResult
        Outgoing baton ``(x^{k+1}, ut^{k+1}[, u^{k+1}])``, new state ``(y_new, lam_new, tau + 1)``, the noise
        ``eps`` (zeros when ``sigma1 = 0``) and its std.
    """
    x, ut, y, lam = baton.x, baton.ut, state.y, state.lam
    if cfg.mode == "exact" and baton.u is None:
        raise ValueError("exact mode needs the clean u on the baton")
    if cfg.mode == "private" and baton.u is not None:
        raise ValueError("private mode must not carry the clean u (it would be sent in the clear)")
    if not (x.shape == ut.shape == y.shape == lam.shape):
        raise ValueError(f"shape mismatch: x {x.shape}, ut {ut.shape}, y {y.shape}, lam {lam.shape}")
    beta = cfg.beta_value
    lam_half = lam + beta * (x - y)  # S1 (12a)
    x_new = prox_nr(x - (ut + lam_half - lam), cfg.n, cfg.nu1, cfg.nu2)  # S2 (12b)
    y_new = y - alpha * (grad_fi(y) - lam_half)  # S3 (12c)
    lam_new = lam_half + beta * ((x_new - x) - (y_new - y))  # S4 (12d)
    base = baton.u if cfg.mode == "exact" else ut
    assert base is not None
    u_new = base + (lam_new - lam)  # S5 (12e)
    tau = state.tau + 1  # S6
    sigma = noise_sigma(tau, cfg.sigma1, cfg.R)
    eps = activation_noise(x.shape, tau, agent_id, cfg)
    ut_new = u_new - eps  # S7
    out = Baton(x_new, ut_new, u_new if cfg.mode == "exact" else None)
    return StepResult(out, AgentState(y_new, lam_new, tau), eps, sigma)  # S8


# --------------------------------------------------------------------------------------------- simulator
@dataclass(frozen=True)
class SimulationResult:
    """Output of :func:`simulate_dprecal`.

    Attributes
    ----------
    x
        Final baton x (``x^{K+1}``, or where the run stopped on budget).
    baton
        Final baton.
    states
        Final ``(y_i, lambda_i, tau_i)`` per agent.
    tau
        Activation counts per agent (``sum(tau) == iterations``).
    holders
        ``i_1 .. i_K``: the active agent of every iteration performed.
    eval_iters
        Iterations at which the error was recorded: 0 (``x^1``), every ``eval_every``-th, and the last.
    rel_errors
        ``||x^{k+1} - x*|| / ||x^1 - x*||`` at ``eval_iters`` (spec 5.7; equals ``/ ||x*||`` for ``x^1 = 0``).
    x_star
        The reference minimiser used.
    iterations
        Iterations performed (``K`` unless stopped by ``xi_plan``).
    alphas
        alpha_i per agent.
    """

    x: FloatArray
    baton: Baton
    states: tuple[AgentState, ...]
    tau: NDArray[np.int64]
    holders: NDArray[np.int64]
    eval_iters: NDArray[np.int64]
    rel_errors: FloatArray
    x_star: FloatArray
    iterations: int
    alphas: FloatArray

    @property
    def lci(self) -> int:
        """Local communication involvement ``max_i tau_i`` (spec 1.5)."""
        return int(self.tau.max()) if self.tau.size else 0


def markov_next(neighbours: Sequence[Sequence[int]], rng: np.random.Generator) -> Callable[[int, int], int]:
    """A ``next_agent`` for :func:`simulate_dprecal`: the simple random walk, ``P_ij = 1 / d_i`` (Assumption 3).

    Draws ``neighbours[cur][rng.integers(d_cur)]``; pass the graph module's walk instead where its stream must match
    a Flower run.
    """
    nbrs = [list(nb) for nb in neighbours]

    def nxt(cur: int, k: int) -> int:
        return int(nbrs[cur][int(rng.integers(len(nbrs[cur])))])

    return nxt


def simulate_dprecal(
    problem: ElasticNetProblem,
    neighbours: Sequence[Sequence[int]],
    K: int,
    next_agent: Callable[[int, int], int],
    start: int,
    *,
    mode: str = "private",
    sigma1: float = 0.0,
    R: float = 1.0,
    noise_seed: int = 0,
    alpha_scale: float = 0.5,
    alphas: Sequence[float] | None = None,
    allow_large_alpha: bool = False,
    beta: float | None = None,
    x1: ArrayLike | None = None,
    x_star: ArrayLike | None = None,
    eval_every: int = 1,
    xi_plan: int | None = None,
    check_edges: bool = True,
) -> SimulationResult:
    """DP-RECAL in-process (spec 7.5): K activations of :func:`dprecal_step` along the walk, same seeds as Flower.

    Parameters
    ----------
    problem
        The elastic-net problem (agent i's data = ``problem.agents[i]``).
    neighbours
        ``neighbours[i]``: agent i's neighbours (0-based). Every hop is checked against it unless
        ``check_edges=False`` (the ``iid`` ablation walk).
    K
        Number of iterations (= activations = hops).
    next_agent
        ``next_agent(cur, k) -> j``: the holder of iteration k + 1, given the holder ``cur`` of iteration k
        (k = 1 .. K - 1; not called after the last iteration). E.g. :func:`markov_next` or the graph module's walk.
    start
        ``i_1``.
    mode, sigma1, R, noise_seed, beta
        As in :class:`RecalConfig` (nu1, nu2 and n come from ``problem``).
    alpha_scale, alphas, allow_large_alpha
        ``alpha_i = alpha_scale * 2 / (L_i + 1)`` unless ``alphas`` is given; each is checked against
        Assumption 2 (:func:`check_alpha`).
    x1
        Initial x (and y_i); zeros by default. For MNIST spec A9 recommends a seeded N(0, I).
    x_star
        Reference minimiser; :func:`solve_elastic_net` when omitted.
    eval_every
        Record the relative error every ``eval_every`` iterations (and at 0 and at the end).
    xi_plan
        ``stop_on_budget``: stop before any agent's ``tau_i`` would exceed ``xi_plan`` (spec 4.5).

    Raises
    ------
    ValueError
        On inconsistent sizes, a hop off the graph, an invalid alpha, or ``||x^1 - x*|| = 0`` (spec A9).
    """
    n = problem.n
    if len(neighbours) != n:
        raise ValueError(f"{len(neighbours)} neighbour lists for {n} agents")
    if not 0 <= start < n:
        raise ValueError(f"start agent {start} out of range 0..{n - 1}")
    if K < 0 or eval_every < 1:
        raise ValueError(f"need K >= 0 and eval_every >= 1, got K={K}, eval_every={eval_every}")
    cfg = RecalConfig(n, problem.nu1, problem.nu2, sigma1, R, mode, noise_seed, beta)
    lips = problem.lipschitz
    alpha_arr = (
        np.array([alpha_for(float(li), alpha_scale) for li in lips])
        if alphas is None
        else np.asarray(alphas, dtype=np.float64)
    )
    if alpha_arr.shape != (n,):
        raise ValueError(f"need one alpha per agent ({n}), got shape {alpha_arr.shape}")
    for a, li in zip(alpha_arr, lips, strict=True):
        check_alpha(float(a), float(li), allow_large_alpha)
    x_init = np.zeros(problem.x_shape) if x1 is None else _as_float(x1).copy()
    if x_init.shape != problem.x_shape:
        raise ValueError(f"x1 has shape {x_init.shape}, the problem needs {problem.x_shape}")
    xs = solve_elastic_net(problem).x if x_star is None else _as_float(x_star)
    den = float(np.linalg.norm(x_init - xs))
    if den < 1e-12:
        raise ValueError("||x^1 - x*|| < 1e-12: the relative error is 0/0 (spec A9); start from a seeded N(0, I) x1")
    nbr_sets = [frozenset(int(j) for j in nb) for nb in neighbours]
    grads = [a.grad for a in problem.agents]

    baton = Baton.initial(x_init, mode)
    states = [AgentState.initial(x_init) for _ in range(n)]
    tau = np.zeros(n, dtype=np.int64)
    holders: list[int] = []
    eval_iters: list[int] = [0]
    errors: list[float] = [1.0]
    cur = start
    done = 0
    for k in range(1, K + 1):
        if xi_plan is not None and tau[cur] + 1 > xi_plan:
            break
        res = dprecal_step(baton, states[cur], grads[cur], float(alpha_arr[cur]), cfg, cur)
        baton, states[cur] = res.baton, res.state
        tau[cur] += 1
        holders.append(cur)
        done = k
        if k % eval_every == 0 or k == K:
            eval_iters.append(k)
            errors.append(float(np.linalg.norm(baton.x - xs)) / den)
        if k < K:
            nxt = int(next_agent(cur, k))
            if not 0 <= nxt < n:
                raise ValueError(f"next_agent returned {nxt}, outside 0..{n - 1}")
            if check_edges and nxt not in nbr_sets[cur]:
                raise ValueError(f"hop {cur} -> {nxt} at iteration {k} is not a graph edge")
            cur = nxt
    if eval_iters[-1] != done:
        eval_iters.append(done)
        errors.append(float(np.linalg.norm(baton.x - xs)) / den)
    return SimulationResult(
        x=baton.x,
        baton=baton,
        states=tuple(states),
        tau=tau,
        holders=np.array(holders, dtype=np.int64),
        eval_iters=np.array(eval_iters, dtype=np.int64),
        rel_errors=np.array(errors, dtype=np.float64),
        x_star=xs,
        iterations=done,
        alphas=alpha_arr,
    )


# --------------------------------------------------------------------------------------------- data (5.2)
def synthetic_problem(
    n: int = 8,
    q: int = 20,
    sizes: Sequence[int] | None = None,
    seed: int = 0,
    nu1: float = 0.05,
    nu2: float = 0.1,
    outputs: int | None = None,
) -> ElasticNetProblem:
    """A small heterogeneous Gaussian least-squares problem with a half-sparse truth, so x* has zeros and non-zeros
    (n agents of ``sizes`` rows, default 60 each; ``outputs`` columns of targets, or one vector): for tests and quick
    checks without data."""
    rng = np.random.default_rng(seed)
    sizes = list(sizes or [60] * n)
    shape = (q,) if outputs is None else (q, outputs)
    truth = np.zeros(shape)
    truth[: q // 2] = 2.0 * rng.standard_normal((q // 2, *shape[1:]))
    feats, targets = [], []
    for m in sizes:
        b_mat = rng.normal(rng.uniform(-0.5, 0.5), 1.0, (m, q))
        feats.append(b_mat)
        targets.append(b_mat @ truth + 0.5 * rng.standard_normal((m, *shape[1:])))
    return ElasticNetProblem.from_arrays(feats, targets, nu1, nu2)


def minmax_scale(features: ArrayLike) -> FloatArray:
    """Per-feature min-max to [0, 1]; constant columns become 0 (spec 5.2 [interp])."""
    xa = _as_float(features)
    lo = xa.min(axis=0)
    span = xa.max(axis=0) - lo
    safe = np.where(span > 0, span, 1.0)
    return np.asarray(np.where(span > 0, (xa - lo) / safe, 0.0), dtype=np.float64)


def encode_targets(labels: ArrayLike, label_mode: str, num_classes: int, positive: Sequence[int] = (0,)) -> FloatArray:
    """Targets b of spec A6 from integer labels ``0 .. num_classes - 1``.

    ``"onehot_pm1"``: shape (N, C), +1 at the true class and -1 elsewhere. ``"binary_pm1"``: shape (N,), +1 for
    labels in ``positive`` and -1 otherwise.
    """
    lab = np.asarray(labels, dtype=np.int64)
    if lab.ndim != 1 or (lab.size and (lab.min() < 0 or lab.max() >= num_classes)):
        raise ValueError(f"labels must be 1-D in 0..{num_classes - 1}")
    if label_mode == "onehot_pm1":
        out = -np.ones((lab.size, num_classes))
        out[np.arange(lab.size), lab] = 1.0
        return out
    if label_mode == "binary_pm1":
        return np.where(np.isin(lab, np.asarray(positive, dtype=np.int64)), 1.0, -1.0)
    raise ValueError(f"unknown label_mode {label_mode!r}; valid: {', '.join(LABEL_MODES)}")


def split_agents(
    features: ArrayLike,
    targets: ArrayLike,
    n_agents: int,
    seed: int,
    num_samples: int | None = None,
) -> tuple[list[FloatArray], list[FloatArray]]:
    """Shuffle the rows with ``default_rng(seed).permutation``, keep the first ``num_samples`` (a seeded uniform
    subsample; all rows by default) and cut them into ``n_agents`` contiguous parts with ``np.array_split``
    (sizes differ by at most one; equal when ``n_agents`` divides the count)."""
    xa, ta = _as_float(features), _as_float(targets)
    if xa.shape[0] != ta.shape[0]:
        raise ValueError(f"{xa.shape[0]} feature rows but {ta.shape[0]} target rows")
    total = xa.shape[0] if num_samples is None else num_samples
    if not n_agents <= total <= xa.shape[0]:
        raise ValueError(f"need n_agents ({n_agents}) <= num_samples ({total}) <= rows ({xa.shape[0]})")
    idx = np.random.default_rng(seed).permutation(xa.shape[0])[:total]
    parts = np.array_split(idx, n_agents)
    return [xa[p] for p in parts], [ta[p] for p in parts]


def load_covtype_problem(
    n_agents: int = 8,
    *,
    seed: int = 0,
    label_mode: str = "onehot_pm1",
    num_samples: int = COVTYPE_SAMPLES,
    nu1: float = 0.5,
    nu2: float = 0.5,
    data_home: str | None = None,
    fetch: Callable[..., Any] | None = None,
) -> ElasticNetProblem:
    """The covtype problem (5.2) through scikit-learn's ``fetch_covtype`` (**downloads**: needs a network).

    Rows with missing values dropped (none in the source), per-feature min-max over all 581,012 rows (constant
    columns -> 0), a seeded uniform subsample of ``num_samples`` = 55,500 rows (spec A7), targets per A6
    (``"onehot_pm1"``: C = 7; ``"binary_pm1"``: Lodgepole Pine (class 2) +1, rest -1), ``np.array_split`` into
    ``n_agents`` parts (6,938 / 6,937 rows for n = 8). ``fetch`` replaces ``fetch_covtype`` (tests).
    """
    if fetch is None:
        from sklearn.datasets import fetch_covtype  # lazy: scikit-learn is a dev dependency

        fetch = fetch_covtype
    bunch = fetch(data_home=data_home, download_if_missing=True)
    feats = np.asarray(bunch.data, dtype=np.float64)
    labels = np.asarray(bunch.target, dtype=np.int64)
    keep = np.isfinite(feats).all(axis=1)
    feats, labels = minmax_scale(feats[keep]), labels[keep] - 1  # classes 1..7 -> 0..6
    targets = encode_targets(labels, label_mode, 7, positive=(COVTYPE_POSITIVE_CLASS - 1,))
    b_parts, t_parts = split_agents(feats, targets, n_agents, seed, min(num_samples, feats.shape[0]))
    return ElasticNetProblem.from_arrays(b_parts, t_parts, nu1, nu2)
