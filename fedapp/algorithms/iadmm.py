"""DP-IADMM with multiple local updates (ObjP / ObjPM) and the OutP baseline: the mathematics, in numpy.

Ryu & Kim, "Differentially Private Federated Learning via Inexact ADMM with Multiple Local Updates" (seed 002;
spec ``shared/specs/dp_iadmm.md``). Equation numbers are the paper's.

Arrays: the model of App. G (63) is w in R^{J x K}; we store its transpose, one row of J weights per class
(K x J, the layout of :class:`fedapp.models.MultinomialLogistic`). Every operation below except the gradient and
the sensitivity is element-wise, so the two layouts give the same iterates.

Everything here is a pure function of its arguments (no Flower, no state): the Strategy (server) and the
NumPyClient (agent) call the same functions, so the server's and the agent's dual copies (4c) are computed by
identical arithmetic.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from fedapp.models.base import FloatArray
from fedapp.privacy.gaussian import add_gaussian_noise, gaussian_noise_std
from fedapp.privacy.laplace import laplace_noise, laplace_scale

if TYPE_CHECKING:
    from fedapp.config import RunConfig

#: (c1, c2, T_c) of the rho schedule (24), Section IV "Parameters"
RHO_MNIST = (2.0, 5.0, 10_000)
RHO_FEMNIST = (0.005, 0.05, 2_000)
#: the cap of (24)
RHO_CAP = 1e9
#: E of the convenience keys: ObjP is Algorithm 1 with E = 1, ObjPM with E = 10 (Section IV); OutP has one step
FIXED_LOCAL_UPDATES = {"objp": 1, "objpm": 10, "outp": 1}
IADMM_ALGORITHMS = ("dp-iadmm", "objp", "objpm", "outp")
IADMM_MODELS = ("multinomial-nobias", "multinomial")
#: run-config key ``device``: where the torch softmax-regression gradient runs ("auto": cuda if available, else cpu)
DEVICES = ("cpu", "cuda", "auto")


def resolve_device(device: str) -> str:
    """The torch device of the gradient: ``"auto"`` is ``"cuda"`` if ``torch.cuda.is_available()``, else ``"cpu"``."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; valid: {', '.join(repr(d) for d in DEVICES)}")
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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
        attribute holds ``"cpu"`` or ``"cuda"``). The arithmetic is float64 on every device; on ``"cuda"`` the agent's
        X_p is copied to the GPU when the AgentData is built (once per round in the client) and each residual and
        gradient is copied back, the rest of the step (element-wise) stays in numpy.
    """

    inputs: FloatArray
    labels: NDArray[np.int64]
    num_classes: int
    total: int
    beta: float
    num_agents: int
    input_l1: FloatArray | None = field(default=None, repr=False)
    device: str = "cpu"
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
        object.__setattr__(self, "onehot", np.eye(self.num_classes)[self.labels])
        import torch

        dev = resolve_device(self.device)
        object.__setattr__(self, "device", dev)
        inputs = torch.from_numpy(np.ascontiguousarray(self.inputs, dtype=np.float64))
        object.__setattr__(self, "_inputs_t", inputs.to(dev))  # .to("cpu") returns the same tensor
        object.__setattr__(self, "_onehot_t", torch.from_numpy(self.onehot).to(dev))
        if self.input_l1 is None:  # ||x_i||_1 per sample; callers may pass it precomputed (it is data-fixed)
            object.__setattr__(self, "input_l1", row_l1(self.inputs))

    @property
    def size(self) -> int:
        """I_p."""
        return int(self.inputs.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        """Shape (K, J) of z in our layout (w^T)."""
        return self.num_classes, int(self.inputs.shape[1])


def residual(data: AgentData, z: FloatArray) -> FloatArray:
    """H_p(z) - Y_p, shape (I_p, K): row-wise softmax of the scores (max-subtracted) minus the one-hot labels."""
    import torch

    zt = torch.from_numpy(np.ascontiguousarray(z, dtype=np.float64)).to(data.device)
    s = data._inputs_t @ zt.T
    return np.asarray((torch.softmax(s, dim=1) - data._onehot_t).cpu().numpy(), dtype=np.float64)  # softmax subtracts the max


def gradient(data: AgentData, z: FloatArray, res: FloatArray, normaliser: float | None = None) -> FloatArray:
    """f_p'(z) of (63): ``(1/I) X_p^T (H_p(z) - Y_p) + (2 beta / P) z`` (transposed to K x J).

    ``normaliser`` replaces I (OutP's reference code scales by the local count I_p, spec 5.2).
    """
    import torch

    n = data.total if normaliser is None else normaliser
    rt = torch.from_numpy(np.ascontiguousarray(res, dtype=np.float64)).to(data.device)
    xr = (rt.T @ data._inputs_t).cpu().numpy()
    return np.asarray(xr / n + (2.0 * data.beta / data.num_agents) * z, dtype=np.float64)


def objective(data: AgentData, z: FloatArray) -> float:
    """f_p(z) of (2c)/(63): ``-(1/I) sum_i ln h_{y_i}(z; x_i) + (beta / P) ||z||^2``; sum over p gives (1)."""
    s = data.inputs @ z.T
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


def agent_round(data: AgentData, z_start: FloatArray, w: FloatArray, lam: FloatArray, *, rho: float, eta: float,
                local_updates: int, epsilon: float, rng: np.random.Generator, sensitivity_mode: str = "paper",
                clip_l1: float = 0.0, box: float = 0.0) -> AgentRound:
    """Algorithm 1 lines 16-21: E perturbed inexact solves (8) around the latest iterate, then their average.

    w^{t+1} and lambda_p^t stay fixed during the E solves (6); Delta is recomputed at every iterate and fresh
    Laplace noise (9a) drawn per solve, in the order e = 1..E from ``rng``.

    Parameters
    ----------
    data
        The agent's samples (for ``sensitivity_mode="bounded"``, rows already L1-clipped to ``clip_l1``).
    z_start
        z_p^{t,1} = z_p^{t-1,E+1} (the last local iterate of the previous round, not the sent average).
    w, lam
        w^{t+1} as received and lambda_p^t.
    rho, eta, local_updates, epsilon
        rho^t, eta^t, E and epsilon-bar (``math.inf``: no noise, plain IADMM).
    rng
        Noise source.
    sensitivity_mode
        ``"paper"`` (Section IV's formula, default) or ``"bounded"`` (``4 C1 / I``, spec 4.6).
    clip_l1, box
        C1 for ``"bounded"``; box radius of W (0: unconstrained).
    """
    if local_updates < 1:
        raise ValueError(f"local_updates must be >= 1, got {local_updates}")
    z = z_start
    acc = np.zeros_like(z_start)
    deltas: list[float] = []
    scales: list[float] = []
    noise_abs = 0.0
    for _ in range(local_updates):
        res = residual(data, z)
        g = gradient(data, z, res)
        delta = sensitivity_paper(data, res) if sensitivity_mode == "paper" else sensitivity_bounded(clip_l1, data.total)
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


def outp_sigma(rho: float, inv_eta: float, epsilon: float, delta: float) -> float:
    """Gaussian-mechanism std of OutP's output noise: L2 sensitivity ``2 / (rho + 1/eta)`` through
    ``sigma = Delta_2 sqrt(2 ln(1.25/delta)) / eps`` (:func:`fedapp.privacy.gaussian_noise_std`); 0 if eps = inf."""
    if math.isinf(epsilon):
        return 0.0
    return gaussian_noise_std(2.0 / (rho + inv_eta), epsilon, delta)


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


def outp_step(data: AgentData, z: FloatArray, w: FloatArray, lam: FloatArray, *, rho: float, inv_eta: float,
              std: float, rng: np.random.Generator, normaliser: float | None) -> tuple[FloatArray, float]:
    """One OutP local update: the noiseless inexact step (5) at z, then Gaussian output noise N(0, std^2).

    ``normaliser`` scales the data term of the gradient (I_p in the reference code, None for 1/I). Returns the
    noisy iterate (kept as the agent's state and sent) and mean |noise|.
    """
    g = gradient(data, z, residual(data, z), normaliser)
    clean = local_step(z, w, lam, g, 0.0, rho, 1.0 / inv_eta)
    noisy = add_gaussian_noise(clean, std, rng)
    return noisy, float(np.mean(np.abs(noisy - clean)))


# --------------------------------------------------------------------------------------------- run config
def local_updates_of(cfg: RunConfig) -> int:
    """E: fixed by the convenience keys (objp 1, objpm 10, outp 1), else the run config's ``local-updates``."""
    return FIXED_LOCAL_UPDATES.get(cfg.algorithm, cfg.local_updates)


def epsilon_of(cfg: RunConfig) -> float:
    """epsilon-bar per local solve; ``math.inf`` when ``dp`` is false (non-private IADMM)."""
    return cfg.iadmm_epsilon if cfg.dp else math.inf


def rho_of(cfg: RunConfig, t: int) -> float:
    """rho^t: schedule (24) with the run's constants, or the constant ``rho``."""
    if cfg.rho_schedule == "const":
        return cfg.rho
    return rho_schedule(t, epsilon_of(cfg), cfg.rho_c1, cfg.rho_c2, cfg.rho_period, cfg.rho_max)


def eta_of(cfg: RunConfig, t: int) -> float:
    """eta^t of ObjP / ObjPM: ``eta-scale / sqrt(t)`` (default) or the constant ``eta-scale``."""
    return eta_schedule(t, cfg.eta_schedule, cfg.eta_scale)


def validate_config(cfg: RunConfig) -> None:
    """Run-config rules of the DP-IADMM family; raises ConfigError naming the key."""
    from fedapp.config import ConfigError

    name = cfg.algorithm
    if cfg.model not in IADMM_MODELS:
        raise ConfigError(
            f"run config key 'model' must be one of {', '.join(repr(m) for m in IADMM_MODELS)} for algorithm "
            f"{name!r} (the paper's model (63) is 'multinomial-nobias'), got {cfg.model!r}"
        )
    if cfg.clients_per_round != cfg.num_clients:
        raise ConfigError(
            f"run config key 'clients-per-round' ({cfg.clients_per_round}) must equal 'num-clients' "
            f"({cfg.num_clients}) for algorithm {name!r}: Algorithm 1 uses every agent every round"
        )
    if name in FIXED_LOCAL_UPDATES and cfg.local_updates not in (1, FIXED_LOCAL_UPDATES[name]):
        raise ConfigError(
            f"run config key 'local-updates' is fixed to {FIXED_LOCAL_UPDATES[name]} for algorithm {name!r}; "
            f"use algorithm 'dp-iadmm' to choose E (got {cfg.local_updates})"
        )
    if cfg.sensitivity_mode == "bounded" and name == "outp":
        raise ConfigError("run config key 'sensitivity-mode' = 'bounded' applies to the Laplace algorithms, not 'outp'")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"run config key 'device' is 'cuda' but torch {torch.__version__} sees no CUDA device here "
                "(torch.cuda.is_available() is False); use 'cpu' or 'auto'"
            )
