"""DP-IADMM with multiple local updates (ObjP / ObjPM) and the OutP baseline: the mathematics, in numpy.

Ryu & Kim, "Differentially Private Federated Learning via Inexact ADMM with Multiple Local Updates" (seed 002;
spec ``shared/specs/dp_iadmm.md``). Equation numbers are the paper's.

Everything here is a pure function of its arguments (no Flower, no run config): the Strategy (server) and the
NumPyClient (agent) call the same functions, so the server's and the agent's dual copies (4c) are computed by
identical arithmetic.

The local solve needs f_p' (the gradient of (2c), which carries the global 1/I) and, under DP, the L1 sensitivity
Delta_p of its data term (9b). A :class:`LocalObjective` supplies both:

* :class:`MultinomialObjective`: the paper's model (63), multinomial logistic regression, in closed form on
  :class:`AgentData`. Only this model has the paper's sensitivity (``"paper"``, Section IV) and the bounded one
  (``"bounded"``, spec 4.6), both derived from its gradient ``x_i (h_i - y_i)^T``. We store w^T, one row of J
  weights per class (K x J, the layout of :class:`fedpdm_flower.fedapp.models.MultinomialLogistic`); every operation except the
  gradient and the sensitivity is element-wise, so the two layouts give the same iterates;
* :class:`ModelObjective`: any model on the flat-vector interface (a torch ``nn.Module`` through
  :class:`fedpdm_flower.fedapp.models.torch_model.TorchModel`, or a numpy object with ``dim`` / ``grad`` / ``loss``), with the
  data term summed over the local data in chunks. Its DP calibration is per-sample gradient clipping
  (``"clipped"``: every sample's gradient clipped to norm C, so replacing one sample moves the sum by at most 2C),
  which needs the model's per-sample gradients.

:func:`local_objective` picks the one that fits a model and a sensitivity mode, and names what is missing.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.localdata import ArrayData, TorchData
from fedpdm_flower.fedapp.models.base import FloatArray
from fedpdm_flower.fedapp.models.multinomial import MultinomialLogistic
from fedpdm_flower.fedapp.privacy.gaussian import add_gaussian_noise, gaussian_noise_std
from fedpdm_flower.fedapp.privacy.laplace import laplace_noise, laplace_scale

#: (c1, c2, T_c) of the rho schedule (24), Section IV "Parameters"
RHO_MNIST = (2.0, 5.0, 10_000)
RHO_FEMNIST = (0.005, 0.05, 2_000)
#: the cap of (24)
RHO_CAP = 1e9
#: eta^t schedules: (19) the default, a constant, (15) and (22)
ETA_KINDS = ("inv-sqrt", "const", "smooth", "strong")
#: Delta of the Laplace algorithms: the paper's formula, the bounded-feature bound (both model (63) only), and
#: per-sample gradient clipping (any model with per-sample gradients)
SENSITIVITY_MODES = ("paper", "bounded", "clipped")
#: L2 sensitivity of OutP's Gaussian output noise: the reference code's constant (model (63)) or clipping
OUTP_SENSITIVITY_MODES = ("reference", "clipped")
#: where the torch softmax-regression gradient runs ("auto": cuda if available, else cpu)
DEVICES = ("cpu", "cuda", "auto")


def resolve_device(device: str) -> str:
    """The torch device of the gradient: ``"auto"`` is ``"cuda"`` if ``torch.cuda.is_available()``, else ``"cpu"``."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; valid: {', '.join(repr(d) for d in DEVICES)}")
    if device != "auto":
        return device
    if backend() == "numpy":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


#: environment variable choosing the backend of the softmax-regression products ("numpy" or "torch")
BACKEND_VAR = "FEDAPP_IADMM_BACKEND"


def backend() -> str:
    """``"torch"`` when torch is installed (its float64 products measured 1.45x faster here), else ``"numpy"``; the
    environment variable ``FEDAPP_IADMM_BACKEND=numpy`` forces numpy, e.g. on a small device that has torch but not
    the memory for it (about 300 MB more resident, docs/deployment.md "Device guide"). Both compute the same float64 math; their
    results differ by rounding only (different BLAS reductions)."""
    import importlib.util
    import os

    choice = os.environ.get(BACKEND_VAR, "").strip().lower()
    if choice not in ("", "numpy", "torch"):
        raise ValueError(f"{BACKEND_VAR} must be 'numpy' or 'torch', got {choice!r}")
    if choice:
        return choice
    try:
        return "torch" if importlib.util.find_spec("torch") is not None else "numpy"
    except (ImportError, ValueError):  # a finder that refuses torch: it is not there
        return "numpy"


#: environment variable choosing the precision of the softmax-regression products ("float64" or "float32")
DTYPE_VAR = "FEDAPP_IADMM_DTYPE"
#: the precisions :class:`AgentData` computes its products in
DTYPES = ("float64", "float32")


def products_dtype(features: FloatArray | NDArray[np.float32], dtype: str | None = None) -> type[np.floating[Any]]:
    """The floating type of X_p's products: ``dtype`` if given, else ``FEDAPP_IADMM_DTYPE``, else the features' own
    (float32 features stay float32, anything else is float64).

    Assumption (named): float32 products lose about 7 significant digits in the (I_p x J)(J x K) scores and the
    (K x I_p)(I_p x J) gradient; the rest of a local solve (8) (the K x J update, the duals, the noise) stays float64,
    so the rounding error enters once per product, far below the Laplace noise of any finite epsilon-bar. The
    non-private MNIST test error moves by less than 0.1 point (tests/test_iadmm_precision.py). float64 is the default
    for float64 features and the mode the exact-reference tests run in.
    """
    import os

    choice = (dtype if dtype is not None else os.environ.get(DTYPE_VAR, "")).strip().lower()
    if choice and choice not in DTYPES:
        raise ValueError(f"the IADMM product precision must be one of {', '.join(DTYPES)} ({DTYPE_VAR}), got {choice!r}")
    if choice:
        return np.float32 if choice == "float32" else np.float64
    return np.float32 if np.asarray(features).dtype == np.float32 else np.float64


# --------------------------------------------------------------------------------------------- schedules
def rho_schedule(t: int, epsilon: float, c1: float = RHO_MNIST[0], c2: float = RHO_MNIST[1],
                 period: int = RHO_MNIST[2], cap: float = RHO_CAP) -> float:
    """Penalty rho-hat^t of (24): ``min{cap, c1 1.2^floor(t / T_c) + c2 / epsilon}``.

    Parameters
    ----------
    t
        Round index, t >= 1.
    epsilon
        Per-solve budget epsilon-bar; ``math.inf`` (non-private) drops the c2 term (reference code, spec 2.5).
    c1, c2, period, cap
        Constants of (24); MNIST (2, 5, 10 000) by default, FEMNIST ``RHO_FEMNIST``.
    """
    if t < 1:
        raise ValueError(f"t must be >= 1, got {t}")
    offset = 0.0 if math.isinf(epsilon) else c2 / epsilon
    steps = t // period
    growth = math.inf if steps * math.log(1.2) > 700 else 1.2**steps  # beyond float range the cap binds anyway
    return float(min(cap, c1 * growth + offset))


def eta_schedule(t: int, kind: str = "inv-sqrt", scale: float = 1.0, *, lipschitz: float = 0.0,
                 epsilon: float = math.inf, alpha: float = 0.0) -> float:
    """Proximity parameter eta^t (the paper does not state its experimental choice; spec A3).

    Parameters
    ----------
    t
        Round index, t >= 1; the same eta^t serves all E local solves of round t.
    kind
        ``"inv-sqrt"``: ``scale / sqrt(t)``, schedule (19) (reference code, scale a = 1; the default);
        ``"const"``: ``scale``; ``"smooth"``: ``1 / (L + sqrt(t) / epsilon)``, (15);
        ``"strong"``: ``2 / (alpha (t + 2))``, (22).
    scale, lipschitz, epsilon, alpha
        a of ``inv-sqrt``/``const``; L and epsilon-bar of (15); the strong-convexity modulus of (22).
    """
    if t < 1:
        raise ValueError(f"t must be >= 1, got {t}")
    if kind == "inv-sqrt":
        return scale / math.sqrt(t)
    if kind == "const":
        return scale
    if kind == "smooth":
        return 1.0 / (lipschitz + math.sqrt(t) / epsilon)
    if kind == "strong":
        if alpha <= 0:
            raise ValueError("the 'strong' schedule (22) needs alpha > 0")
        return 2.0 / (alpha * (t + 2))
    raise ValueError(f"unknown eta schedule {kind!r}; valid: 'inv-sqrt', 'const', 'smooth', 'strong'")


@dataclass(frozen=True)
class RhoSchedule:
    """The penalty schedule (24): ``rho^t = min{cap, c1 1.2^floor(t / T_c) + c2 / epsilon-bar}``.

    Nondecreasing and bounded, as Assumption 1(i) requires. Without privacy (epsilon-bar = inf) the c2 term is 0.

    Parameters
    ----------
    c1, c2
        Constants of (24): MNIST 2 and 5 (the defaults), FEMNIST 0.005 and 0.05 (:meth:`femnist`).
    period
        T_c of (24): MNIST 10 000 (default), FEMNIST 2 000.
    cap
        The cap of (24), 1e9 (never binds in the paper's T = 20 000 rounds).
    """

    c1: float = RHO_MNIST[0]
    c2: float = RHO_MNIST[1]
    period: int = RHO_MNIST[2]
    cap: float = RHO_CAP

    def __post_init__(self) -> None:
        for name, v, ok in (("c1", self.c1, self.c1 > 0), ("c2", self.c2, self.c2 >= 0), ("cap", self.cap, self.cap > 0)):
            if not (ok and math.isfinite(v)):
                raise ValueError(f"RhoSchedule {name} must be a finite number {'>=' if name == 'c2' else '>'} 0, got {v!r}")
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"RhoSchedule period must be an integer >= 1, got {self.period!r}")

    @classmethod
    def mnist(cls) -> RhoSchedule:
        """(24) with the paper's MNIST constants (2, 5, 10 000)."""
        return cls(*RHO_MNIST)

    @classmethod
    def femnist(cls) -> RhoSchedule:
        """(24) with the paper's FEMNIST constants (0.005, 0.05, 2 000)."""
        return cls(*RHO_FEMNIST)

    def __call__(self, t: int, epsilon: float) -> float:
        """rho^t of round t at per-solve budget ``epsilon`` (``math.inf``: non-private)."""
        return rho_schedule(t, epsilon, self.c1, self.c2, self.period, self.cap)


@dataclass(frozen=True)
class EtaSchedule:
    """The proximity parameter eta^t of the local solves (the same for all E solves of a round).

    The paper does not state its experimental choice (spec A3); the reference code uses (19) with a = 1.

    Parameters
    ----------
    kind
        ``"inv-sqrt"``: ``scale / sqrt(t)``, schedule (19) (default); ``"const"``: ``scale``;
        ``"smooth"``: ``1 / (L + sqrt(t) / epsilon-bar)``, (15); ``"strong"``: ``2 / (alpha (t + 2))``, (22).
    scale
        a of ``"inv-sqrt"`` / ``"const"`` (default 1).
    lipschitz
        L of (15) (``"smooth"`` only, > 0).
    alpha
        The strong-convexity modulus of (22) (``"strong"`` only, > 0).
    """

    kind: str = "inv-sqrt"
    scale: float = 1.0
    lipschitz: float = 0.0
    alpha: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ETA_KINDS:
            raise ValueError(f"EtaSchedule kind must be one of {list(ETA_KINDS)}, got {self.kind!r}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"EtaSchedule scale must be a finite number > 0, got {self.scale!r}")
        if self.kind == "smooth" and not self.lipschitz > 0:
            raise ValueError(f"EtaSchedule('smooth') needs lipschitz = L > 0 of (15), got {self.lipschitz!r}")
        if self.kind == "strong" and not self.alpha > 0:
            raise ValueError(f"EtaSchedule('strong') needs alpha > 0 of (22), got {self.alpha!r}")

    def __call__(self, t: int, epsilon: float) -> float:
        """eta^t of round t (``epsilon`` is used by (15) only)."""
        return eta_schedule(t, self.kind, self.scale, lipschitz=self.lipschitz, epsilon=epsilon, alpha=self.alpha)


# --------------------------------------------------------------------------------------------- local data
def row_l1(inputs: FloatArray) -> FloatArray:
    """||x_i||_1 of every row."""
    return np.asarray(np.abs(inputs).sum(axis=1), dtype=np.float64)


def clip_rows_l1(inputs: FloatArray, bound: float) -> FloatArray:
    """Scale every row with ||x_i||_1 > bound down to ||x_i||_1 = bound (the optional clipping of spec 4.6)."""
    if bound <= 0:
        raise ValueError(f"bound must be > 0, got {bound}")
    norms = row_l1(inputs)
    factor = np.minimum(1.0, bound / np.maximum(norms, np.finfo(np.float64).tiny))
    return np.asarray(inputs * factor[:, None], dtype=np.float64)


@dataclass(frozen=True)
class AgentData:
    """Agent p's share of objective (2c): its samples and the public constants that scale f_p.

    Parameters
    ----------
    inputs
        X_p, shape (I_p, J): the features the model reads (bias column already dropped for model (63)).
    labels
        Integer labels, shape (I_p,).
    num_classes
        K.
    total
        I, the global number of training samples (f_p carries 1/I; every agent must know it).
    beta
        beta of (1): f_p carries (beta / P) ||z||^2.
    num_agents
        P.
    input_l1
        ||x_i||_1 per sample (computed when not given).
    device
        Torch device of :func:`residual` and :func:`gradient` (:data:`DEVICES`; ``"auto"`` is resolved here, so the
        attribute holds ``"cpu"`` or ``"cuda"``). On ``"cuda"`` the agent's X_p is copied to the GPU when the
        AgentData is built (once per run in the client) and each residual and gradient is copied back, the rest of
        the step (element-wise) stays in numpy.
    dtype
        Precision of the products with X_p (:data:`DTYPES`; None: :func:`products_dtype`, float64 unless the
        features are float32 or ``FEDAPP_IADMM_DTYPE=float32``). X_p is converted once, here; every residual and
        gradient then runs in that precision without converting X_p again, and the gradient (K x J) is returned
        in float64.
    """

    inputs: FloatArray
    labels: NDArray[np.int64]
    num_classes: int
    total: int
    beta: float
    num_agents: int
    input_l1: FloatArray | None = field(default=None, repr=False)
    device: str = "cpu"
    dtype: Any = None
    onehot: FloatArray = field(init=False, repr=False)
    #: torch views (no copy on the cpu) of inputs / onehot: the softmax-regression gradient runs on torch, measured
    #: 1.45x faster than numpy here (float64, one thread, 6000 x 784 agent: 8.2 ms vs 11.8-12.5 ms)
    _inputs_t: Any = field(init=False, repr=False, compare=False)
    _onehot_t: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.inputs.ndim != 2 or self.inputs.shape[0] != self.labels.shape[0]:
            raise ValueError(f"inputs {self.inputs.shape} and labels {self.labels.shape} do not match")
        if self.total < self.inputs.shape[0]:
            raise ValueError(f"total I={self.total} is smaller than the agent's I_p={self.inputs.shape[0]}")
        dt = products_dtype(self.inputs, None if self.dtype is None else str(np.dtype(self.dtype)))
        object.__setattr__(self, "dtype", dt)
        if self.input_l1 is None:  # ||x_i||_1 per sample (float64, from the given features; it is data-fixed)
            object.__setattr__(self, "input_l1", row_l1(self.inputs))
        if self.inputs.dtype != dt:  # once per agent: a float64 view of the user's features is kept as it is
            object.__setattr__(self, "inputs", np.ascontiguousarray(self.inputs, dtype=dt))
        object.__setattr__(self, "onehot", np.eye(self.num_classes, dtype=dt)[self.labels])
        dev = resolve_device(self.device)
        object.__setattr__(self, "device", dev)
        if dev == "cpu" and backend() == "numpy":  # no torch on this device: residual / gradient run in numpy
            object.__setattr__(self, "_inputs_t", None)
            object.__setattr__(self, "_onehot_t", None)
        else:
            import torch

            inputs = torch.from_numpy(np.ascontiguousarray(self.inputs))
            object.__setattr__(self, "_inputs_t", inputs.to(dev))  # .to("cpu") returns the same tensor
            object.__setattr__(self, "_onehot_t", torch.from_numpy(self.onehot).to(dev))

    @property
    def size(self) -> int:
        """I_p."""
        return int(self.inputs.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        """Shape (K, J) of z in our layout (w^T)."""
        return self.num_classes, int(self.inputs.shape[1])


def residual(data: AgentData, z: FloatArray) -> FloatArray:
    """H_p(z) - Y_p, shape (I_p, K): row-wise softmax of the scores (max-subtracted) minus the one-hot labels, in
    the agent's product precision (``data.dtype``): one (I_p x J)(J x K) product, the rest in place."""
    if data._inputs_t is None:  # numpy backend
        s = data.inputs @ np.asarray(z, dtype=data.dtype).T
        s -= s.max(axis=1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=1, keepdims=True)
        s -= data.onehot
        return s
    import torch

    zt = torch.from_numpy(np.ascontiguousarray(z, dtype=data.dtype)).to(data.device)
    s = data._inputs_t @ zt.T
    out: FloatArray = (torch.softmax(s, dim=1) - data._onehot_t).cpu().numpy()  # softmax subtracts the max
    return out


def gradient(data: AgentData, z: FloatArray, res: FloatArray, normaliser: float | None = None) -> FloatArray:
    """f_p'(z) of (63): ``(1/I) X_p^T (H_p(z) - Y_p) + (2 beta / P) z`` (transposed to K x J).

    ``normaliser`` replaces I (OutP's reference code scales by the local count I_p, spec 5.2).
    """
    n = data.total if normaliser is None else normaliser
    r = np.asarray(res, dtype=data.dtype)  # no copy when res came from :func:`residual`
    if data._inputs_t is None:  # numpy backend: one (K x I_p)(I_p x J) product in data.dtype
        xr = r.T @ data.inputs
    else:
        import torch

        xr = (torch.from_numpy(np.ascontiguousarray(r)).to(data.device).T @ data._inputs_t).cpu().numpy()
    return np.asarray(xr, dtype=np.float64) / n + (2.0 * data.beta / data.num_agents) * np.asarray(z, dtype=np.float64)


#: rows of X_p per block of :func:`residual_gradient` (float32): a 512 x 784 block is 1.6 MB, so the gradient's
#: product reads it again from the 8 MB L3 cache right after the scores' product, not from memory. Measured here,
#: one thread, 6,000 x 784 float32: 9.8 ms for both products blocked against 11.9 ms unblocked (256: 10.1 ms,
#: 1,024: 10.3 ms).
FUSED_ROWS = 512


def residual_gradient(data: AgentData, z: FloatArray, normaliser: float | None = None,
                      adjust: Any = None) -> tuple[FloatArray, FloatArray]:
    """:func:`residual` and then :func:`gradient` at the same z: ``(H_p(z) - Y_p, f_p'(z))``.

    ``adjust(res_rows, rows)`` (optional) rescales rows of the residual before the gradient reads them (the
    per-sample clipping of ``"clipped"``); the returned residual is the adjusted one. With float32 products on the
    numpy backend both products run block by block over :data:`FUSED_ROWS` rows of X_p, the same arithmetic
    summed in another order (the gradient's rounding moves at float32's 1e-7). The float64 mode and the torch
    backend call :func:`residual` and :func:`gradient` as they are, so the float64 references stay exact.
    """
    if data._inputs_t is not None or data.dtype != np.float32:
        res = residual(data, z)
        if adjust is not None:
            res = adjust(res, slice(None))
        return res, gradient(data, z, res, normaliser)
    x, n = data.inputs, data.total if normaliser is None else normaliser
    zt = np.asarray(z, dtype=np.float32).T
    res = np.empty((x.shape[0], zt.shape[1]), dtype=np.float32)
    xr = np.zeros((zt.shape[1], x.shape[1]), dtype=np.float32)
    for lo in range(0, x.shape[0], FUSED_ROWS):
        rows = slice(lo, lo + FUSED_ROWS)
        s = res[rows]
        np.matmul(x[rows], zt, out=s)
        s -= s.max(axis=1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=1, keepdims=True)
        s -= data.onehot[rows]
        if adjust is not None:
            s[...] = adjust(s, rows)
        xr += s.T @ x[rows]
    g = np.asarray(xr, dtype=np.float64) / n + (2.0 * data.beta / data.num_agents) * np.asarray(z, dtype=np.float64)
    return res, g


def objective(data: AgentData, z: FloatArray) -> float:
    """f_p(z) of (2c)/(63): ``-(1/I) sum_i ln h_{y_i}(z; x_i) + (beta / P) ||z||^2``; sum over p gives (1)."""
    s = np.asarray(data.inputs @ np.asarray(z, dtype=data.dtype).T, dtype=np.float64)  # I_p x K scores, then float64
    s -= s.max(axis=1, keepdims=True)
    logp = s - np.log(np.exp(s).sum(axis=1, keepdims=True))
    ce = -float(logp[np.arange(data.size), data.labels].sum())
    return ce / data.total + data.beta / data.num_agents * float(np.sum(z * z))


# --------------------------------------------------------------------------------------------- sensitivity
def sensitivity_paper(data: AgentData, res: FloatArray) -> float:
    """Delta_p^{t,e} as Section IV evaluates (9b) for logistic regression, with the paper's "1/T" read as 1/I.

    ``(1/I) max_i ||x_i||_1 ||h(z; x_i) - y_i||_1`` at the current local iterate (spec 4.3, A1: the reference
    code divides by the global count, 1/I is the scaling of f_p, and the authors' logged iteration-0 noise on
    MNIST matches 1/I). Not a rigorous sensitivity (data-dependent, max over observed samples; spec A2).
    """
    assert data.input_l1 is not None
    return float(np.max(data.input_l1 * np.abs(res).sum(axis=1))) / data.total


def sensitivity_bounded(clip_l1: float, total: int, adjacency: str = "replace") -> float:
    """Data-independent L1 sensitivity of the gradient when every ||x||_1 <= C1 (spec 4.6).

    ``||x (h - y)^T||_1 <= 2 C1``; replacing one sample changes the sum by at most twice that:
    ``4 C1 / I`` (replace-one), ``2 C1 / I`` (add/remove with I public and fixed).
    """
    if adjacency not in ("replace", "add-remove"):
        raise ValueError(f"adjacency must be 'replace' or 'add-remove', got {adjacency!r}")
    return (4.0 if adjacency == "replace" else 2.0) * clip_l1 / total


def sensitivity_clipped(clip: float, normaliser: float) -> float:
    """Replace-one sensitivity of ``(1/n) sum_i clip_C(g_i)`` in the clipping norm: ``2 C / n``.

    Every clipped per-sample gradient has norm <= C, so replacing one sample moves the sum by at most 2C. Data
    independent and rigorous for any model (I = n public and fixed).
    """
    if not clip > 0:
        raise ValueError(f"the clipping bound C must be > 0, got {clip}")
    return 2.0 * clip / normaliser


def clip_factors(norms: FloatArray, clip: float) -> FloatArray:
    """``min(1, C / ||g_i||)``: the factors that scale every per-sample gradient to norm <= C."""
    return np.asarray(np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny)), dtype=np.float64)


# --------------------------------------------------------------------------------------------- local objectives
class LocalObjective(Protocol):
    """f_p of (2c) on one agent's data, as a local solve needs it."""

    @property
    def size(self) -> int:
        """I_p, the agent's sample count."""
        ...

    def terms(self, z: FloatArray) -> tuple[FloatArray, float]:
        """f_p'(z) (same shape as z) and the sensitivity Delta_p of its data term at z (0 without a DP mode)."""
        ...


class MultinomialObjective:
    """f_p of (2c) for the paper's model (63), multinomial logistic regression, in closed form.

    Parameters
    ----------
    data
        The agent's samples and the constants I, beta, P (:class:`AgentData`). For ``"bounded"`` its rows must
        already be L1-clipped to ``clip`` (:func:`clip_rows_l1`; :func:`local_objective` does it).
    sensitivity
        ``"paper"`` (default): Section IV's Delta at every iterate (:func:`sensitivity_paper`; data-dependent, not a
        rigorous bound, spec A2); ``"bounded"``: ``4 C1 / I`` (:func:`sensitivity_bounded`, spec 4.6);
        ``"clipped"``: every per-sample gradient ``x_i (h_i - y_i)^T`` scaled to norm <= C (its L1 norm is
        ``||x_i||_1 ||h_i - y_i||_1``, its L2 norm ``||x_i||_2 ||h_i - y_i||_2``), Delta = ``2 C / n``;
        None: no sensitivity (0).
    clip
        C1 of ``"bounded"``, C of ``"clipped"``.
    norm
        The clipping norm of ``"clipped"``: 1 (the Laplace mechanism's, default) or 2 (OutP's Gaussian mechanism).
    normaliser
        n of the data term: None is I, objective (2c); OutP's reference code uses the local count I_p.
    """

    def __init__(self, data: AgentData, sensitivity: str | None = "paper", clip: float = 0.0, *, norm: int = 1,
                 normaliser: float | None = None) -> None:
        if sensitivity not in (*SENSITIVITY_MODES, None):
            raise ValueError(f"sensitivity must be one of {list(SENSITIVITY_MODES)} or None, got {sensitivity!r}")
        if sensitivity in ("bounded", "clipped") and not clip > 0:
            raise ValueError(f"sensitivity {sensitivity!r} needs a clipping bound > 0, got {clip!r}")
        if norm not in (1, 2):
            raise ValueError(f"norm must be 1 or 2, got {norm!r}")
        self.data, self.sensitivity, self.clip, self.norm, self.normaliser = data, sensitivity, clip, norm, normaliser
        self._input_norm: FloatArray | None = None
        if sensitivity == "clipped":  # ||x_i|| in the clipping norm, fixed by the data
            self._input_norm = data.input_l1 if norm == 1 else np.sqrt(np.einsum("ij,ij->i", data.inputs, data.inputs))

    @property
    def size(self) -> int:
        return self.data.size

    def _clip_rows(self, res: FloatArray, rows: slice) -> FloatArray:
        """Residual rows scaled so that every per-sample gradient x_i (h_i - y_i)^T has norm <= clip."""
        assert self._input_norm is not None
        rnorm = np.abs(res).sum(axis=1) if self.norm == 1 else np.sqrt(np.einsum("ik,ik->i", res, res))
        return res * clip_factors(self._input_norm[rows] * rnorm, self.clip).astype(res.dtype)[:, None]

    def terms(self, z: FloatArray) -> tuple[FloatArray, float]:
        data, zs = self.data, z.reshape(self.data.shape)
        res, g = residual_gradient(data, zs, self.normaliser, self._clip_rows if self.sensitivity == "clipped" else None)
        if self.sensitivity == "paper":
            delta = sensitivity_paper(data, res)
        elif self.sensitivity == "bounded":
            delta = sensitivity_bounded(self.clip, data.total)
        elif self.sensitivity == "clipped":
            delta = sensitivity_clipped(self.clip, data.total if self.normaliser is None else self.normaliser)
        else:
            delta = 0.0
        return g.reshape(z.shape), delta


class ModelObjective:
    """f_p of (2c) for any model on the flat-vector interface: ``(1/n) sum_i grad l(z; x_i, y_i) + (2 beta / P) z``.

    The data term is summed over the agent's whole data set (full batch, as the paper) in chunks of ``chunk``
    samples.

    Parameters
    ----------
    model
        ``dim`` and ``grad(x, inputs, targets)``, the gradient of the mean loss of a batch (a torch ``nn.Module``
        through :class:`fedpdm_flower.fedapp.models.torch_model.TorchModel`, or a numpy model object); with ``clip`` also
        ``per_sample_grads(x, inputs, targets)`` of shape (n, d).
    data
        The agent's samples (:class:`fedpdm_flower.fedapp.localdata.ArrayData` or :class:`fedpdm_flower.fedapp.localdata.TorchData`).
    total, beta, num_agents
        I, beta and P of (2c).
    clip
        None: the plain gradient (no DP calibration: non-private runs and OutP's reference constant); C > 0: every
        per-sample gradient scaled to norm <= C, Delta = ``2 C / n`` (:func:`sensitivity_clipped`).
    norm
        The clipping norm: 1 (Laplace, default) or 2 (Gaussian).
    normaliser
        n of the data term: None is I.
    chunk
        Samples per gradient evaluation (per-sample gradients hold chunk x d floats).
    """

    def __init__(self, model: Any, data: ArrayData | TorchData, total: int, beta: float, num_agents: int, *,
                 clip: float | None = None, norm: int = 1, normaliser: float | None = None, chunk: int = 256) -> None:
        if total < len(data):
            raise ValueError(f"total I={total} is smaller than the agent's I_p={len(data)}")
        if clip is not None and not callable(getattr(model, "per_sample_grads", None)):
            raise TypeError(f"gradient clipping needs per-sample gradients: {type(model).__name__} has no "
                            "per_sample_grads(x, inputs, targets) (a torch nn.Module gets them through TorchModel)")
        if clip is not None and not clip > 0:
            raise ValueError(f"the clipping bound C must be > 0, got {clip!r}")
        if norm not in (1, 2):
            raise ValueError(f"norm must be 1 or 2, got {norm!r}")
        self.model, self.data, self.total, self.beta, self.num_agents = model, data, total, beta, num_agents
        self.clip, self.norm, self.chunk = clip, norm, int(chunk)
        self.normaliser = float(total) if normaliser is None else float(normaliser)

    @property
    def size(self) -> int:
        return len(self.data)

    def data_gradient_sum(self, z: FloatArray) -> FloatArray:
        """``sum_i grad l(z; x_i, y_i)``, every term clipped to norm C when ``clip`` is set."""
        out = np.zeros(self.model.dim)
        for inputs, targets in self.data.chunks(self.chunk):
            if self.clip is None:
                out += len(targets) * np.asarray(self.model.grad(z, inputs, targets), dtype=np.float64)
                continue
            g = np.asarray(self.model.per_sample_grads(z, inputs, targets), dtype=np.float64)
            norms = np.abs(g).sum(axis=1) if self.norm == 1 else np.sqrt(np.einsum("ij,ij->i", g, g))
            out += clip_factors(norms, self.clip) @ g
        return out

    def terms(self, z: FloatArray) -> tuple[FloatArray, float]:
        flat = z.reshape(-1)
        g = self.data_gradient_sum(flat) / self.normaliser + (2.0 * self.beta / self.num_agents) * flat
        delta = 0.0 if self.clip is None else sensitivity_clipped(self.clip, self.normaliser)
        return g.reshape(z.shape), delta


def local_objective(model: Any, data: ArrayData | TorchData, *, total: int, beta: float, num_agents: int,
                    sensitivity: str | None, clip: float = 0.0, norm: int = 1, normaliser: float | None = None,
                    device: str = "cpu", chunk: int = 256, dtype: str | None = None) -> LocalObjective:
    """The :class:`LocalObjective` of a model under a sensitivity mode; a TypeError names what the model lacks.

    * ``"paper"`` and ``"bounded"`` are closed forms of the paper's multinomial logistic model (63): they need a
      :class:`fedpdm_flower.fedapp.models.MultinomialLogistic` (it is solved by :class:`MultinomialObjective` on ``device``);
    * ``"clipped"`` needs per-sample gradients: a torch ``nn.Module`` (:class:`fedpdm_flower.fedapp.models.torch_model.TorchModel`),
      the multinomial model (closed form), or a numpy model with ``per_sample_grads(x, inputs, targets)``;
    * None (no calibration: epsilon-bar = inf, or OutP's reference constant) works for every model.
    """
    if sensitivity not in (*SENSITIVITY_MODES, None):
        raise ValueError(f"sensitivity must be one of {list(SENSITIVITY_MODES)} or None, got {sensitivity!r}")
    if isinstance(model, MultinomialLogistic):
        x, y = (data.x, data.y) if isinstance(data, ArrayData) else data.all()
        inputs = model.inputs(np.asarray(x))  # a view of the user's features: BLAS reads the strided rows
        if sensitivity == "bounded":
            inputs = clip_rows_l1(inputs, clip)
        agent = AgentData(inputs, np.asarray(y), model.num_classes, total, beta, num_agents, device=device, dtype=dtype)
        return MultinomialObjective(agent, sensitivity, clip, norm=norm, normaliser=normaliser)
    if sensitivity in ("paper", "bounded"):
        raise TypeError(
            f"sensitivity mode {sensitivity!r} is a closed form of the paper's multinomial logistic model (63) "
            f"(fedpdm_flower.fedapp.models.MultinomialLogistic); for {type(model).__name__} use sensitivity_mode='clipped' with a "
            "per-sample gradient clipping bound clip=C")
    return ModelObjective(model, data, total, beta, num_agents, clip=clip if sensitivity == "clipped" else None,
                          norm=norm, normaliser=normaliser, chunk=chunk)


class DPSGDObjective:
    """f_p' of (2c) replaced by its record-level DP-SGD release: the rigorous mechanism of the local solves.

    The closed form of (8) (spec 2.2) shows that a perturbed local solve is a proximal step on ``f_p'(z) + xi``:
    the data enter only through the gradient. Here that gradient is the DP-SGD release of the core
    (:class:`fedpdm_flower.fedapp.privacy.dpsgd.DPSGDStep`): a Poisson sample of the agent's records drawn from the
    device's own randomness (rate q), every record's gradient clipped to L2 norm C, Gaussian noise N(0, z^2 C^2 I)
    on the clipped sum, divided by the expected batch q n. Scaled by n / I, the weight of the agent's data term in
    (2c), the data part of the solve's gradient is

        ``(sum_{j in B} clip_C(g_j) + N(0, z^2 C^2 I)) / (q I)``,

    an unbiased estimate of the clipped ``(1/I) sum_j g_j`` whose noise is the Gaussian xi of objective perturbation
    (8) with std ``z C / (q I)`` per coordinate; ``(2 beta / P) z`` (and a model's own l2 term) does not depend on the
    data and is added after the noise. Everything a solve then does with it -- the proximal term, w^{t+1}, lambda_p,
    the average of the E iterates (line 21), the dual update (4c) -- is post-processing, so a round of E solves
    releases E steps of the Poisson-subsampled Gaussian mechanism (the device's ledger charges exactly those).

    Parameters
    ----------
    step
        The participation's DP-SGD oracle (``step(x)`` is the noisy mean-loss gradient at x; ``step.n`` the agent's
        record count), built by the client from the message's mechanism and the device's randomness.
    total
        I, or the normaliser of the data term (OutP's reference code scales by the local count I_p: then ``total``
        is n and the scale is 1).
    beta, num_agents
        beta and P of (2c).
    """

    def __init__(self, step: Any, total: float, beta: float, num_agents: int) -> None:
        if not total >= 1:
            raise ValueError(f"the data term's normaliser I must be >= 1, got {total!r}")
        self.step, self.total, self.beta, self.num_agents = step, float(total), float(beta), int(num_agents)

    @property
    def size(self) -> int:
        return int(self.step.n)

    def terms(self, z: FloatArray) -> tuple[FloatArray, float]:
        """``(n / I) g~(z) + (2 beta / P) z`` and sensitivity 0 (no Laplace noise: the Gaussian is already in g~)."""
        flat = np.asarray(z, dtype=np.float64).reshape(-1)
        g = (self.size / self.total) * np.asarray(self.step(flat), dtype=np.float64)
        g += (2.0 * self.beta / self.num_agents) * flat
        return g.reshape(np.shape(z)), 0.0

    def noise_std(self) -> float:
        """The std of the Gaussian xi per coordinate of the solve's gradient: ``z C / (q I)``."""
        m = self.step.mechanism
        return float(m.noise_multiplier * m.clip_norm / (m.sample_rate * self.total))


# --------------------------------------------------------------------------------------------- one local solve
def local_step(z: FloatArray, w: FloatArray, lam: FloatArray, grad: FloatArray, xi: FloatArray | float,
               rho: float, eta: float, box: float = 0.0) -> FloatArray:
    """Closed-form minimiser of (8) (spec 2.2).

    ``G(z) = <g, z> + ||z - z_prev||^2 / (2 eta) + (rho/2) ||w - z + (lambda - xi)/rho||^2`` is an isotropic
    quadratic with curvature 1/eta + rho, so its minimiser over W is the projection of
    ``(z_prev/eta + rho w + lambda - g - xi) / (1/eta + rho)``; ``xi = 0`` gives (5)/(6).

    Parameters
    ----------
    z, w, lam, grad
        z_p^{t,e}, w^{t+1}, lambda_p^t and f_p'(z_p^{t,e}).
    xi
        The Laplace noise xi_p^{t,e} (or 0).
    rho, eta
        rho^t and eta^t.
    box
        B > 0 projects onto W = [-B, B]^{JK} (exact for an isotropic quadratic); 0 means W = R^{JK} (spec A6).
    """
    inv_eta = 1.0 / eta
    v = (z * inv_eta + rho * w + lam - grad - xi) / (inv_eta + rho)
    return np.clip(v, -box, box) if box > 0 else np.asarray(v, dtype=np.float64)


@dataclass(frozen=True)
class AgentRound:
    """What Algorithm 1 lines 16-21 produce for one agent in one round."""

    z_avg: FloatArray  #: z_p^{t+1} = (1/E) sum_e z_p^{t,e+1} (line 21), the only thing sent
    z_last: FloatArray  #: z_p^{t,E+1}, the next round's start point (line 16; spec A14)
    sensitivities: list[float]  #: Delta_p^{t,e} per e
    scales: list[float]  #: Laplace scale b = Delta / epsilon per e
    noise_abs_mean: float  #: mean over e, j, k of |xi| (Sec. IV-B metric, averaged over e, spec A19)


def agent_round(objective: LocalObjective, z_start: FloatArray, w: FloatArray, lam: FloatArray, *, rho: float,
                eta: float, local_updates: int, epsilon: float, rng: np.random.Generator,
                box: float = 0.0) -> AgentRound:
    """Algorithm 1 lines 16-21: E perturbed inexact solves (8) around the latest iterate, then their average.

    w^{t+1} and lambda_p^t stay fixed during the E solves (6); Delta is recomputed at every iterate and fresh
    Laplace noise (9a) drawn per solve, in the order e = 1..E from ``rng``.

    Parameters
    ----------
    objective
        f_p' and Delta_p of the agent (:class:`MultinomialObjective` for model (63), :class:`ModelObjective` for any
        model; the sensitivity mode is the objective's).
    z_start
        z_p^{t,1} = z_p^{t-1,E+1} (the last local iterate of the previous round, not the sent average).
    w, lam
        w^{t+1} as received and lambda_p^t.
    rho, eta, local_updates, epsilon
        rho^t, eta^t, E and epsilon-bar (``math.inf``: no noise, plain IADMM).
    rng
        Noise source.
    box
        Box radius of W (0: unconstrained, spec A6).
    """
    if local_updates < 1:
        raise ValueError(f"local_updates must be >= 1, got {local_updates}")
    z = z_start
    acc = np.zeros_like(z_start)
    deltas: list[float] = []
    scales: list[float] = []
    noise_abs = 0.0
    for _ in range(local_updates):
        g, delta = objective.terms(z)
        b = laplace_scale(delta, epsilon)
        xi = laplace_noise(rng, b, z.shape)
        z = local_step(z, w, lam, g, xi, rho, eta, box)
        acc += z
        deltas.append(delta)
        scales.append(b)
        noise_abs += float(np.mean(np.abs(xi)))
    return AgentRound(acc / local_updates, z, deltas, scales, noise_abs / local_updates)


# --------------------------------------------------------------------------------------------- server and duals
def server_w_update(zs: FloatArray, lams: FloatArray, rho: float) -> FloatArray:
    """(4a), Algorithm 1 line 5: ``w = (1/P) sum_p (z_p - lambda_p / rho)``, unweighted (f_p carries 1/I).

    ``zs`` and ``lams`` stack the P agents on axis 0.
    """
    return np.asarray(np.mean(zs - lams / rho, axis=0), dtype=np.float64)


def consensus_term(z: FloatArray, lam: FloatArray, rho: float) -> FloatArray:
    """Agent p's summand of (4a), ``z_p - lambda_p / rho``: the server's w is the plain mean of these.

    The mean form of Algorithm 1 (:class:`fedpdm_flower.strategies.iadmm.IADMMMean`) has every agent upload this
    term, computed with its own dual, so the server's step is a mean (secure aggregation can compute it) and keeps no
    dual copy. In Algorithm 1's order the term is ``z_p^{t+1} - lambda_p^{t+1} / rho^{t+1}`` (line 5 of round t+1,
    the dual of line 23 already applied); in Huang's order (OutP) ``z~_p^{k+1} - lambda_p^k / rho_k``. Noise added to
    the mean (distributed DP) then enters w once: the agents' duals are updated against the w they receive, and the
    next mean is rebuilt from those duals, so it does not accumulate as it would in a server-side copy of
    ``sum_p lambda_p`` updated from noisy sums.
    """
    return np.asarray(z - lam / rho, dtype=np.float64)


def dual_update(lam: FloatArray, w: FloatArray, z: FloatArray, rho: float) -> FloatArray:
    """(4c), Algorithm 1 lines 8 and 23: ``lambda + rho (w - z)``; server and agent call this same function."""
    return np.asarray(lam + rho * (w - z), dtype=np.float64)


def dual_fingerprint(lam: FloatArray) -> int:
    """CRC-32 of the float64 bytes of a dual: equal fingerprints mean bit-identical copies (spec 9.6, 9.8)."""
    return zlib.crc32(np.ascontiguousarray(lam, dtype=np.float64).tobytes())


# --------------------------------------------------------------------------------------------- OutP (spec 5.2)
def outp_inv_eta(t: int, n_local: int, epsilon: float, delta: float, scale: float = 1.0) -> float:
    """1/eta_out^t of the reference OutP (Huang et al.'s proximity): ``(0.25 I_p + 2 sqrt(t ln(1.25/delta)) / eps) / a``.

    From ``c3 + 4 c1 sqrt(J K t ln(1.25/delta)) / (I_p eps c_w)`` with c1 = I_p, c3 = I_p / 4, c_w = sqrt(4 J K);
    non-private (eps = inf): ``0.25 I_p / a``.
    """
    base = 0.25 * n_local
    if not math.isinf(epsilon):
        base += 2.0 * math.sqrt(t * math.log(1.25 / delta)) / epsilon
    return base / scale


def outp_sigma(rho: float, inv_eta: float, epsilon: float, delta: float, sensitivity: float = 2.0) -> float:
    """Gaussian-mechanism std of OutP's output noise; 0 if eps = inf.

    The step divides the gradient by ``rho + 1/eta``, so a data term of L2 sensitivity s gives the output the
    sensitivity ``s / (rho + 1/eta)``, and ``sigma = Delta_2 sqrt(2 ln(1.25/delta)) / eps``
    (:func:`fedpdm_flower.fedapp.privacy.gaussian_noise_std`). The reference code's s = 2 c1 / I_p with c1 = I_p is 2 (the
    default); per-sample clipping to C gives ``s = 2 C / n`` (:func:`sensitivity_clipped`).
    """
    if math.isinf(epsilon):
        return 0.0
    return gaussian_noise_std(sensitivity / (rho + inv_eta), epsilon, delta)


def outp_noise_std(sigma: float, mode: str = "sigma") -> float:
    """The std actually used: ``"sigma"`` (correct, default) or ``"sigma-squared"``.

    ``"sigma-squared"`` reproduces the reference code, which passes sigma^2 as the standard deviation (spec 5.2,
    A9): for sigma < 1 it injects less noise than the (eps, delta) calibration requires.
    """
    if mode == "sigma":
        return sigma
    if mode == "sigma-squared":
        return sigma * sigma
    raise ValueError(f"unknown OutP noise mode {mode!r}; valid: 'sigma', 'sigma-squared'")


def outp_step(objective: LocalObjective, z: FloatArray, w: FloatArray, lam: FloatArray, *, rho: float,
              inv_eta: float, std: float, rng: np.random.Generator) -> tuple[FloatArray, float]:
    """One OutP local update: the noiseless inexact step (5) at z, then Gaussian output noise N(0, std^2).

    The objective's normaliser scales the data term of the gradient (I_p in the reference code, I for
    ``grad_scale="global"``). Returns the noisy iterate (kept as the agent's state and sent) and mean |noise|.
    """
    g, _ = objective.terms(z)
    clean = local_step(z, w, lam, g, 0.0, rho, 1.0 / inv_eta)
    noisy = add_gaussian_noise(clean, std, rng)
    return noisy, float(np.mean(np.abs(noisy - clean)))


# --------------------------------------------------------------------------------------------- the paper's mechanisms
@dataclass(frozen=True)
class ObjectivePerturbation:
    """The paper's own mechanism, as a ``privacy=`` setting of DP-IADMM: the reproduction setting.

    Every local solve (8) carries the random linear term <xi, z>, xi i.i.d. Laplace(0, Delta / epsilon-bar) (9a), so
    each solve is epsilon-bar-DP (Theorem 1) when Delta bounds the L1 sensitivity of the gradient's data term (9b).
    The paper states per-solve DP only (Remark 1); the devices report the composition over every solve beside it:
    basic (t E epsilon-bar) and Renyi DP (:func:`fedpdm_flower.fedapp.privacy.laplace.laplace_rdp_epsilon`, the
    rigorous figure, 12.2 for the 2 000 solves of ObjPM at 0.05 over 200 rounds, at delta = 1e-5).

    The full-batch solve claims no amplification by subsampling, and the noise does not shrink with the data: the
    record-level route that learns at an honest epsilon is ``privacy=PrivacyTarget(...)`` (DP-SGD in the solves).

    Parameters
    ----------
    epsilon_bar
        epsilon-bar, the budget of each local solve (the paper: 0.05, 0.1, 1, 5). No default.
    sensitivity_mode
        ``"paper"`` (default): Section IV's Delta = ``(1/I) max_i ||x_i||_1 ||h(z; x_i) - y_i||_1`` at every iterate,
        model (63) only; data-dependent and not a bound (spec A2), so **no guarantee holds** and the figures the
        devices report are what the run would spend if it were one. ``"bounded"``: features L1-clipped to ``clip_norm``
        = C1, Delta = 4 C1 / I (model (63) only; rigorous). ``"clipped"``: every per-record gradient clipped to L1
        norm ``clip_norm`` = C, Delta = 2 C / I (any model with per-record gradients; rigorous).
    clip_norm
        C1 of ``"bounded"`` or C of ``"clipped"`` (required there; None with ``"paper"``).
    delta
        The delta at which the devices report the Renyi-DP composition (default 1e-5, the project's one default).
    """

    epsilon_bar: float
    sensitivity_mode: str = "paper"
    clip_norm: float | None = None
    delta: float = 1e-5

    kind = "laplace-objective"

    def __post_init__(self) -> None:
        e = self.epsilon_bar
        if isinstance(e, bool) or not isinstance(e, int | float) or not (math.isfinite(e) and e > 0):
            raise ValueError(f"ObjectivePerturbation epsilon_bar must be a finite number > 0, got {e!r}")
        if self.sensitivity_mode not in SENSITIVITY_MODES:
            raise ValueError(f"ObjectivePerturbation sensitivity_mode must be one of {list(SENSITIVITY_MODES)}, "
                             f"got {self.sensitivity_mode!r}")
        if self.sensitivity_mode == "paper" and self.clip_norm is not None:
            raise ValueError("ObjectivePerturbation clip_norm applies to sensitivity_mode 'bounded' (C1) and 'clipped' (C), "
                             "not 'paper'")
        if self.sensitivity_mode != "paper":
            c = self.clip_norm
            if c is None:
                raise ValueError(f"ObjectivePerturbation sensitivity_mode {self.sensitivity_mode!r} needs its clipping "
                                 "bound: pass clip_norm=C > 0")
            if isinstance(c, bool) or not isinstance(c, int | float) or not (math.isfinite(c) and c > 0):
                raise ValueError(f"ObjectivePerturbation clip_norm must be a finite number > 0, got {c!r}")
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"ObjectivePerturbation delta must lie in (0, 1), got {self.delta!r}")

    @property
    def rigorous(self) -> bool:
        """Whether Delta bounds the sensitivity (``"bounded"`` / ``"clipped"``), so the reported figures are guarantees."""
        return self.sensitivity_mode != "paper"

    def epsilon(self, solves: int) -> float:
        """Renyi-DP composition of ``solves`` epsilon-bar-DP solves at ``delta`` (a guarantee iff :attr:`rigorous`)."""
        from fedpdm_flower.fedapp.privacy.laplace import laplace_rdp_epsilon

        return laplace_rdp_epsilon(solves, float(self.epsilon_bar), self.delta)

    def message_config(self) -> dict[str, float | int | str | bool]:
        """The keys the agents read (``dp-mechanism`` names this mechanism)."""
        cfg: dict[str, float | int | str | bool] = {
            "dp": True, "dp-mechanism": self.kind, "epsilon": float(self.epsilon_bar),
            "sensitivity-mode": self.sensitivity_mode, "dp-delta": self.delta}
        if self.clip_norm is not None:
            cfg["clip"] = float(self.clip_norm)
        return cfg


@dataclass(frozen=True)
class OutputPerturbation:
    """The OutP baseline's own mechanism (the paper's reference code, spec 5.2), as a ``privacy=`` setting of OutP.

    Each step's output gets N(0, sigma^2) with the classical Gaussian-mechanism calibration for (epsilon-bar,
    delta-bar) per step, ``sigma = Delta_2 sqrt(2 ln(1.25 / delta-bar)) / epsilon-bar`` (:func:`outp_sigma`), on the
    L2 sensitivity ``Delta_2`` of the step's output. Its noise multiplier ``sigma / Delta_2`` is the same every step,
    so the run's rigorous figure is the Renyi-DP composition of those Gaussian releases without amplification
    (full batch): :meth:`epsilon`.

    Parameters
    ----------
    epsilon_bar, delta_bar
        (epsilon-bar, delta-bar) of each step (the paper: delta-bar = 1e-6). No default for epsilon_bar.
    sensitivity_mode
        ``"reference"`` (default): the reference code's ``Delta_2 = 2 / (rho + 1/eta)``, Huang's bound c1 = I_p on
        a record's gradient. It holds whenever every record's gradient norm is at most I_p: for softmax regression
        on pixels in [0, 1] that norm is ``||x||_2 ||h - y||_2 <= 28 sqrt(2) = 39.6`` on MNIST, far below
        I_p = 6 000, so the bound is valid there (and about 150 times looser than needed). ``"clipped"``: every
        record's gradient clipped to L2 norm ``clip_norm`` = C, ``Delta_2 = 2 C / (n (rho + 1/eta))``.
    clip_norm
        C of ``"clipped"`` (required there; None with ``"reference"``).
    noise_std
        ``"sigma"`` (default) or ``"sigma-squared"``: the reference code's bug, sigma^2 used as the std (spec A9);
        with it the reported figures are not guarantees.
    delta
        The delta at which the devices report the composition (default 1e-5).
    """

    epsilon_bar: float
    delta_bar: float = 1e-6
    sensitivity_mode: str = "reference"
    clip_norm: float | None = None
    noise_std: str = "sigma"
    delta: float = 1e-5

    kind = "gaussian-output"

    def __post_init__(self) -> None:
        e = self.epsilon_bar
        if isinstance(e, bool) or not isinstance(e, int | float) or not (math.isfinite(e) and e > 0):
            raise ValueError(f"OutputPerturbation epsilon_bar must be a finite number > 0, got {e!r}")
        for name, v in (("delta_bar", self.delta_bar), ("delta", self.delta)):
            if isinstance(v, bool) or not isinstance(v, float) or not 0.0 < v < 1.0:
                raise ValueError(f"OutputPerturbation {name} must be a float in (0, 1), got {v!r}")
        if self.sensitivity_mode not in OUTP_SENSITIVITY_MODES:
            raise ValueError(f"OutputPerturbation sensitivity_mode must be one of {list(OUTP_SENSITIVITY_MODES)}, "
                             f"got {self.sensitivity_mode!r}")
        if self.noise_std not in ("sigma", "sigma-squared"):
            raise ValueError(f"OutputPerturbation noise_std must be 'sigma' or 'sigma-squared', got {self.noise_std!r}")
        if self.sensitivity_mode == "reference" and self.clip_norm is not None:
            raise ValueError("OutputPerturbation clip_norm applies to sensitivity_mode 'clipped', not 'reference'")
        if self.sensitivity_mode == "clipped":
            c = self.clip_norm
            if c is None:
                raise ValueError("OutputPerturbation sensitivity_mode 'clipped' needs its clipping bound: pass clip_norm=C")
            if isinstance(c, bool) or not isinstance(c, int | float) or not (math.isfinite(c) and c > 0):
                raise ValueError(f"OutputPerturbation clip_norm must be a finite number > 0, got {c!r}")

    @property
    def noise_multiplier(self) -> float:
        """sigma / Delta_2 of every step: ``sqrt(2 ln(1.25 / delta-bar)) / epsilon-bar``."""
        return math.sqrt(2.0 * math.log(1.25 / self.delta_bar)) / float(self.epsilon_bar)

    def epsilon(self, steps: int) -> float:
        """Renyi-DP composition (Opacus's accountant, sample rate 1) of ``steps`` releases at :attr:`noise_multiplier`."""
        from fedpdm_flower.fedapp.privacy.dpsgd import dpsgd_epsilon

        return 0.0 if steps == 0 else dpsgd_epsilon(self.noise_multiplier, 1.0, steps, self.delta)

    def message_config(self) -> dict[str, float | int | str | bool]:
        """The keys the agents read."""
        cfg: dict[str, float | int | str | bool] = {
            "dp": True, "dp-mechanism": self.kind, "epsilon": float(self.epsilon_bar), "delta": self.delta_bar,
            "sensitivity-mode": self.sensitivity_mode, "noise-std": self.noise_std, "dp-delta": self.delta}
        if self.clip_norm is not None:
            cfg["clip"] = float(self.clip_norm)
        return cfg
