"""The Table V baselines of DP-RECAL: DP-PG-EXTRA, DP-NIDS and DP-RW-ADMM, framework-free (numpy).

Wang, Guo, Yang, Shi, "Differentially Private Decentralized Optimization with Relay Communication" (seed 001), spec
``shared/specs/dp_recal.md`` sections 5.6 (baselines), 5.7 (metrics), 6.1 (Table V), 7.7 (Flower mapping) and 8 A13
(the paper gives no DP details, W, stepsizes or communication constants for its baselines: every choice below is ours
and is stated here). All of them solve the experiments' problem (5.1) of :mod:`fedpdm_flower.fedapp.algorithms.recal`,
``F(x) = sum_i f_i(x) + n r(x)`` with the elastic net ``r = nu1 ||.||_1 + nu2 ||.||^2``, i.e. each agent's share of
the regulariser is ``r_i = r`` (spec 5.6: "one prox per agent").

What is here
------------
* **PG-EXTRA** (Shi, Ling, Wu, Yin 2015), exactly as spec 5.6 writes it, ``W~ = (I + W)/2``::

      x^{1/2} = W x^0 - alpha grad f(x^0),                x^1 = prox_{alpha r}(x^{1/2})
      x^{k+1/2} = W x^k + x^{k-1/2} - W~ x^{k-1} - alpha [grad f(x^k) - grad f(x^{k-1})],
      x^{k+1} = prox_{alpha r}(x^{k+1/2})                                                   (k >= 1)

  Agent i publishes ``x_i^k``. Per agent: :func:`pg_extra_init`, :func:`pg_extra_publish`, :func:`pg_extra_step`.
* **NIDS** (Li, Shi, Yan 2019), exactly as spec 5.6 writes it, uniform alpha, ``W~ = (I + W)/2``::

      z^1 = x^0 - alpha grad f(x^0),  x^1 = prox_{alpha r}(z^1)
      z^{k+1} = z^k - x^k + W~ (2 x^k - x^{k-1} - alpha grad f(x^k) + alpha grad f(x^{k-1})),
      x^{k+1} = prox_{alpha r}(z^{k+1})                                                     (k >= 1)

  Agent i publishes ``v_i^k = 2 x_i^k - x_i^{k-1} - alpha grad f_i(x_i^k) + alpha grad f_i(x_i^{k-1})`` (the only
  quantity ``W~`` mixes). Per agent: :func:`nids_init`, :func:`nids_publish`, :func:`nids_step`.
* **RW-ADMM**: a random-walk incremental ADMM of the Walkman / I-ADMM family (below); per agent
  :func:`rw_admm_step` and :func:`rw_admm_publish`.
* In-process simulators :func:`simulate_pg_extra`, :func:`simulate_nids` (vectorised over agents, or
  ``engine="per_agent"``: a loop over the per-agent functions with dict messages, the arithmetic a Flower client
  performs) and :func:`simulate_rw_admm` (a loop over :func:`rw_admm_step`).
* The paper's communication constants (spec 5.6 table): :func:`messages_per_iteration`, :func:`paper_communication`.
* DP calibration with the section-4.5 formulas of :mod:`fedpdm_flower.fedapp.privacy.zcdp`: :func:`gradient_message_sensitivity`,
  :func:`rw_admm_sensitivity`, :func:`baseline_sigma1`, and the noise of a publication, :func:`publication_noise`.

Synchronous rounds (PG-EXTRA, NIDS; spec 5.6 [interp], 7.7)
-----------------------------------------------------------
Metropolis-Hastings weights ``W_ij = 1/(1 + max(d_i, d_j))`` (:func:`fedpdm_flower.fedapp.topology.metropolis_weights`) unless a
W is given. ``x^0`` is a public common start (zeros by default), so ``W x^0 = x^0`` and the initial step is local (no
message). Iteration ``k = 1..T`` is one round: every agent publishes one vector (``x_i^k`` resp. ``v_i^k``), every
agent receives its neighbours' published vectors, and computes ``x_i^{k+1}``. T rounds = T publications per agent,
so the LCI is T (spec 1.5); the output is the agent average ``x-bar^{T+1}`` (spec 5.7 [interp]), and
``max_i ||x_i^{T+1} - x*||`` is reported alongside. A Flower client's round is "step with the neighbours' round-k
messages, then publish its round-(k+1) message" (PG-EXTRA) or "publish ``v_i^k``, then step" (NIDS: ``v_i^k``
needs nothing from the neighbours, so a client can also publish in the previous round's reply).

**Own vs received values [interp]:** an agent mixes its *own exact* vector with its neighbours' *published (noisy)*
ones (``W_ii x_i + sum_j W_ij x~_j``): it knows its own value, and noise only protects what leaves the agent.
Mixing order is ``W_ii * own`` then ``+ W_ij * msg_j`` for j in increasing order, in both engines, which is what
makes the vectorised simulator equal to the per-agent functions bit for bit (the gradients are evaluated per agent,
on fresh arrays, in both).

DP (spec 5.6 [interp])
----------------------
Agent i adds ``N(0, sigma_t^2 I)`` to its t-th published vector, ``sigma_t = sigma_1 R^{-(t-1)/2}``
(:func:`fedpdm_flower.fedapp.privacy.zcdp.sigma_at`), drawn from the stateless stream ``default_rng([noise_seed, STREAM, i, t])``
with one stream tag per algorithm (:data:`STREAM_PG_EXTRA`, :data:`STREAM_NIDS`, :data:`STREAM_RW_ADMM`), so a
Flower client re-created every round draws the same numbers as the simulators. ``sigma_1`` is calibrated with
Theorem 3's formulas for a general sensitivity (:func:`fedpdm_flower.fedapp.privacy.zcdp.sigma1_for_budget`) at ``xi = LCI``:

* PG-EXTRA, NIDS: ``Delta = 2 alpha L`` (``L = max_i L_i``), the spec's convention for a message of the form
  ``... - alpha grad f_i(.)``: alpha times the paper's 2L gradient-difference bound (the prox is non-expansive).
  Applied to NIDS as the brief and the spec say, although ``v_i`` holds ``alpha (grad f_i(x^k) - grad f_i(x^{k-1}))``;
  like Lemma 4 (spec A3) it ignores the divergence that earlier rounds accumulate, so it is *the paper-style
  accounting*, not a privacy proof. ``xi = T``: every agent publishes every round.
* RW-ADMM: :func:`rw_admm_sensitivity` (``4 L / (n beta)``, same convention), ``xi = xi_plan``.

The noise accumulates in each algorithm's recursion (there is no clean side channel as in DP-RECAL's exact mode).

RW-ADMM (Shah & Avrachenkov 2018, arXiv:1810.05067; spec 5.6) [interp]
-----------------------------------------------------------------------
The spec describes it only as "asynchronous ADMM in which the updating node is selected by simulating a Markov
chain", run in Table V with "activation probability P = 0.5 and T = 1200, so its LCI is 600", 16 messages per
iteration on ring-8. Its update equations are not in the spec or the paper, so we implement a documented member of
the same family, Walkman-style (Mao, Gu, Yuan, Yin 2020) with a linearised local step. Splitting
``min n r(x) + sum_i f_i(y_i)  s.t.  y_i = x`` with the augmented Lagrangian
``n r(x) + sum_i [f_i(y_i) + <z_i, y_i - x> + beta/2 ||y_i - x||^2]``, one token
``t = (1/n) sum_i (y_i + z_i / beta)`` travels along the simple random walk (:func:`fedpdm_flower.fedapp.topology.walk_path`).
The holder i of hop h:

    x   = prox_{r/beta}(t)                                 (exact x-minimisation: argmin n r + n beta/2 ||x - t||^2)
    y_i' = x - (grad f_i(y_i) + z_i) / beta                (linearised y_i-minimisation)
    z_i' = z_i + beta (y_i' - x)                           (dual ascent)
    t'   = t + ((y_i' + z_i'/beta) - (y_i + z_i/beta)) / n (incremental token update)

and publishes ``t' + N(0, sigma_tau^2 I)`` to one uniformly chosen neighbour. The next holder uses the received
(noisy) token, so noise accumulates in t. Fixed points satisfy ``y_i = x``, ``z_i = -grad f_i(x)`` and
``0 in n d r(x) + sum_i grad f_i(x)``, i.e. x = x*. The reported model is ``prox_{r/beta}(t)`` (what the next holder
would compute), plus ``max_i ||y_i - x*||``. ``beta = beta_scale L_max`` with ``beta_scale = 2`` by default, an
empirical choice (the linearised step, like Walkman's analysis of it, needs beta large relative to L): on the
synthetic ring-8 test problem (q = 20) 4,800 hops gave relative errors 0.49 / 4e-4 / 1e-13 / 6e-14 / 3e-12 / 2e-10
for beta_scale = 1.6 / 1.7 / 1.8 / 2 / 2.5 / 3, and 1.5 diverged (also on complete-8, C = 3 outputs, unequal m_i).

**Mapping "activation probability P = 0.5, T = 1200" (LCI 600):** a single token activates one agent per hop, so
the privacy-relevant rate is matched instead of the literal mechanism: one paper iteration is ``P n`` token hops
(4 on ring-8), so each agent is active in a paper iteration with expected rate ``P n g_i = P d_i / d-bar`` (= P on
a regular graph), and T paper iterations are ``K = round(P n T)`` hops (:func:`rw_admm_hops`; 4,800 on ring-8,
the same K as DP-RECAL) with expected LCI ``P T`` = 600 (the realised LCI is larger, like DP-RECAL's 644 of spec
3.4). The paper's communication count 16/iteration (x 1,200 = 19,200) is reproduced by
:func:`messages_per_iteration` as the paper's constant; the token itself sends one message per hop, reported
separately as ``messages_sent`` (4,800).

Communication (spec 5.6 table, derived from Table V on ring-8, m = 8)
---------------------------------------------------------------------
NIDS 16/iteration (= 2m), PG-EXTRA 32 (= 4m), IC-ADMM 32 (= 4m), RW-ADMM 16 (= 2m), DP-RECAL 1. The spec asks for
per-algorithm constants, not a generic formula; we express them as multiples of 2m so that ring-8 reproduces the
paper, and their values on other graphs are an extrapolation the paper does not state. ``messages_sent`` in the
results is what this implementation actually sends (2m per synchronous round: each agent one vector to each
neighbour; PG-EXTRA caches ``W~ x^{k-1}`` instead of re-sending it; 1 per RW-ADMM hop).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.algorithms.recal import ElasticNetProblem, FloatArray, prox_nr, solve_elastic_net
from fedpdm_flower.fedapp.privacy import zcdp

__all__ = [
    "ALGORITHMS",
    "ENGINES",
    "RW_ADMM_ACTIVATION_PROB",
    "STREAM_NIDS",
    "STREAM_PG_EXTRA",
    "STREAM_RW_ADMM",
    "TABLE_V_COMM_RING8",
    "TABLE_V_ITERATIONS",
    "BaselineResult",
    "NidsState",
    "NoiseConfig",
    "PGExtraState",
    "RWAdmmState",
    "baseline_sigma1",
    "canonical_algorithm",
    "data_free_sensitivity",
    "elastic_net_prox",
    "gradient_message_sensitivity",
    "messages_per_iteration",
    "mixing_row",
    "nids_alpha_bound",
    "nids_init",
    "nids_publish",
    "nids_step",
    "paper_communication",
    "pg_extra_alpha_bound",
    "pg_extra_init",
    "pg_extra_publish",
    "pg_extra_step",
    "publication_noise",
    "rw_admm_hops",
    "rw_admm_initial_token",
    "rw_admm_paper_iterations",
    "rw_admm_publish",
    "rw_admm_sensitivity",
    "rw_admm_step",
    "simulate_nids",
    "simulate_pg_extra",
    "simulate_rw_admm",
]

GradFn = Callable[[FloatArray], FloatArray]
ProxFn = Callable[[FloatArray], FloatArray]

#: noise stream tags: ``default_rng([noise_seed, STREAM_*, agent, t])`` (30-32 are topology's, 1-4 sampling's)
STREAM_PG_EXTRA = 40
STREAM_NIDS = 41
STREAM_RW_ADMM = 42

#: canonical names (a "dp-" prefix, case and underscores are ignored by :func:`canonical_algorithm`)
ALGORITHMS: tuple[str, ...] = ("dp-recal", "nids", "pg-extra", "ic-admm", "rw-admm")
#: iteration counts of Table V (spec 5.4 E3, 6.1): T = 600 for the synchronous methods, T = 1200 (P = 0.5) for
#: RW-ADMM, and DP-RECAL's K = 4800 inferred from its Comm. = 4800
TABLE_V_ITERATIONS: dict[str, int] = {"dp-recal": 4800, "nids": 600, "pg-extra": 600, "ic-admm": 600, "rw-admm": 1200}
#: Table V's "Comm." column on the 8-agent ring (spec 6.1)
TABLE_V_COMM_RING8: dict[str, int] = {"dp-recal": 4800, "nids": 9600, "pg-extra": 19200, "ic-admm": 19200,
                                      "rw-admm": 19200}
#: RW-ADMM's activation probability in Table V (spec 5.4 E3)
RW_ADMM_ACTIVATION_PROB = 0.5
#: simulator engines: numpy over all agents at once, or a loop over the per-agent functions
ENGINES: tuple[str, ...] = ("vectorised", "per_agent")

# messages per iteration in units of 2m (spec 5.6 table on ring-8, m = 8: 16 = 2m, 32 = 4m)
_PER_TWO_M: dict[str, int] = {"nids": 1, "pg-extra": 2, "ic-admm": 2, "rw-admm": 1}
_CANONICAL: dict[str, str] = {"recal": "dp-recal", "nids": "nids", "pgextra": "pg-extra", "icadmm": "ic-admm",
                              "rwadmm": "rw-admm"}


# --------------------------------------------------------------------------------------------- communication
def canonical_algorithm(name: str) -> str:
    """The canonical name of ``name`` (one of :data:`ALGORITHMS`): case, ``_`` vs ``-`` and a ``dp-`` prefix ignored.

    ``"DP-NIDS"``, ``"nids"`` -> ``"nids"``; ``"PG_EXTRA"`` -> ``"pg-extra"``; ``"recal"`` -> ``"dp-recal"``.
    """
    compact = name.strip().lower().replace("_", "").replace("-", "")
    if compact.startswith("dp"):
        compact = compact[2:]
    key = _CANONICAL.get(compact)
    if key is None:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(ALGORITHMS)} (optionally 'dp-' prefixed)")
    return key


def messages_per_iteration(algorithm: str, graph: topology.Graph) -> int:
    """Logical graph messages per iteration as the paper counts them (spec 5.6 table), reproducing Table V.

    DP-RECAL: 1 (one baton hop). NIDS and RW-ADMM: ``2m`` (16 on ring-8); PG-EXTRA and IC-ADMM: ``4m`` (32 on
    ring-8). The ring-8 values are the paper's (Comm. / iterations of Table V); the spec asks for per-algorithm
    constants, and writing them as multiples of ``2m = sum_i d_i`` is our extrapolation to other graphs (the paper
    gives no counts for them). For RW-ADMM, "iteration" is the paper's (T = 1200), not a token hop
    (:func:`rw_admm_hops`).
    """
    algo = canonical_algorithm(algorithm)
    if algo == "dp-recal":
        return 1
    return _PER_TWO_M[algo] * 2 * graph.num_edges


def paper_communication(algorithm: str, graph: topology.Graph, iterations: int | None = None) -> int:
    """Total messages ``messages_per_iteration * iterations``; ``iterations`` defaults to Table V's count.

    On ring-8 with the defaults: DP-RECAL 4800, NIDS 9600, PG-EXTRA 19200, IC-ADMM 19200, RW-ADMM 19200 (spec 6.1).
    """
    algo = canonical_algorithm(algorithm)
    its = TABLE_V_ITERATIONS[algo] if iterations is None else iterations
    if its < 0:
        raise ValueError(f"iterations must be >= 0, got {its}")
    return messages_per_iteration(algo, graph) * its


def rw_admm_hops(T: int, activation_prob: float, n: int) -> int:
    """Token hops of T paper iterations of RW-ADMM: ``round(activation_prob * n * T)`` (module docstring).

    One paper iteration is ``P n`` hops, so each agent's expected activation rate per paper iteration is
    ``P n g_i`` (= P on a regular graph) and the expected LCI is ``P T``; ring-8, P = 0.5, T = 1200: 4800 hops.
    """
    if T < 0 or n < 1:
        raise ValueError(f"need T >= 0 and n >= 1, got T={T}, n={n}")
    if not 0.0 < activation_prob <= 1.0:
        raise ValueError(f"activation_prob must lie in (0, 1], got {activation_prob}")
    return _hop_boundary(T, activation_prob, n)


def rw_admm_paper_iterations(hops: int, activation_prob: float, n: int) -> int:
    """Paper iterations completed after ``hops`` token hops: the largest k with ``rw_admm_hops(k, P, n) <= hops``.

    The inverse of :func:`rw_admm_hops` (what :func:`simulate_rw_admm` reports as ``iterations``); the Flower
    DP-RW-ADMM counts the paper's messages as ``messages_per_iteration * rw_admm_paper_iterations(hops)``.
    """
    if hops < 0 or n < 1:
        raise ValueError(f"need hops >= 0 and n >= 1, got hops={hops}, n={n}")
    if not 0.0 < activation_prob <= 1.0:
        raise ValueError(f"activation_prob must lie in (0, 1], got {activation_prob}")
    k = int((hops + 0.5) / (activation_prob * n)) + 2
    while k > 0 and _hop_boundary(k, activation_prob, n) > hops:
        k -= 1
    return k


def _hop_boundary(k: int, activation_prob: float, n: int) -> int:
    # hops performed by the end of paper iteration k (round half up, monotone in k)
    return math.floor(k * activation_prob * n + 0.5)


# --------------------------------------------------------------------------------------------- DP
@dataclass(frozen=True)
class NoiseConfig:
    """Publication noise: agent i's t-th published vector gets ``N(0, sigma_t^2 I)``, ``sigma_t = sigma1 R^{-(t-1)/2}``.

    ``sigma1 = 0`` is the non-private algorithm (no draw at all). ``noise_seed`` seeds the stateless stream
    ``default_rng([noise_seed, stream, agent, t])``.
    """

    sigma1: float = 0.0
    R: float = 1.0
    noise_seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sigma1) and self.sigma1 >= 0):
            raise ValueError(f"sigma1 must be finite and >= 0, got {self.sigma1}")
        if not (math.isfinite(self.R) and self.R >= 1):
            raise ValueError(f"R must be finite and >= 1, got {self.R}")
        if self.noise_seed < 0:
            raise ValueError(f"noise_seed must be >= 0, got {self.noise_seed}")


def publication_noise(
    shape: tuple[int, ...], t: int, agent_id: int, noise: NoiseConfig | None, stream: int
) -> FloatArray | None:
    """The noise of agent ``agent_id``'s t-th publication (t = 1, 2, ...), or ``None`` when ``sigma1 = 0``.

    ``zcdp.sigma_at(t, sigma1, R) * default_rng([noise_seed, stream, agent_id, t]).standard_normal(shape)``.
    """
    if t < 1:
        raise ValueError(f"publications are counted from 1, got t = {t}")
    if noise is None or noise.sigma1 == 0.0:
        return None
    sigma = zcdp.sigma_at(int(t), noise.sigma1, noise.R)
    rng = np.random.default_rng([noise.noise_seed, stream, int(agent_id), int(t)])
    return np.asarray(sigma * rng.standard_normal(shape), dtype=np.float64)


def _privatise(vec: FloatArray, t: int, agent_id: int, noise: NoiseConfig | None, stream: int) -> FloatArray:
    eps = publication_noise(vec.shape, t, agent_id, noise, stream)
    return vec.copy() if eps is None else vec + eps


def gradient_message_sensitivity(alpha: float, L_max: float) -> float:
    """``Delta = 2 alpha L``: the spec-5.6 convention for PG-EXTRA's and NIDS's published vectors.

    alpha times the paper's gradient-difference bound 2L (Lemma 4's convention, with its looseness, spec A3).
    """
    if not (alpha > 0 and L_max > 0):
        raise ValueError(f"alpha and L_max must be > 0, got {alpha}, {L_max}")
    return 2.0 * alpha * L_max


def rw_admm_sensitivity(beta: float, L_max: float, n: int) -> float:
    """``Delta = 4 L / (n beta)`` for the RW-ADMM token, by the same convention as :func:`gradient_message_sensitivity`.

    With the other variables held fixed (the paper's convention), one activation changes the token by
    ``(y' + z'/beta - y - z/beta) / n = (x - (2 grad f_i(y) + z)/beta - y - z/beta) / n``, whose data-dependent part
    is ``-(2 / (n beta)) grad f_i(y)``; times the 2L gradient-difference bound.
    """
    if not (beta > 0 and L_max > 0 and n >= 1):
        raise ValueError(f"need beta > 0, L_max > 0, n >= 1, got {beta}, {L_max}, {n}")
    return 4.0 * L_max / (n * beta)


def baseline_sigma1(eps: float, delta: float, R: float, xi: int, Delta: float) -> float:
    """sigma_1 meeting (eps, delta) after ``xi`` publications with sensitivity Delta (spec 4.5 formulas).

    :func:`fedpdm_flower.fedapp.privacy.zcdp.sigma1_for_budget`: ``sigma_1 = Delta sqrt(geom_sum(R, xi) / (2 rho(eps, delta)))``.
    For PG-EXTRA / NIDS ``xi = T``; for RW-ADMM the planned LCI.
    """
    return zcdp.sigma1_for_budget(eps, delta, Delta, R, xi)


# --------------------------------------------------------------------------------------------- helpers
def elastic_net_prox(step: float, nu1: float, nu2: float) -> ProxFn:
    """``v -> prox_{step r}(v) = soft(v, step nu1) / (1 + 2 step nu2)`` (:func:`fedpdm_flower.fedapp.algorithms.recal.prox_nr`)."""
    if not step > 0:
        raise ValueError(f"prox step must be > 0, got {step}")

    def prox(v: FloatArray) -> FloatArray:
        return prox_nr(v, step, nu1, nu2)

    return prox


def mixing_row(weights: NDArray[np.float64], graph: topology.Graph, i: int) -> tuple[float, dict[int, float]]:
    """Agent i's row of W as ``(W_ii, {j: W_ij for j in N_i})`` (what a Flower client receives, spec 7.7)."""
    return float(weights[i, i]), {j: float(weights[i, j]) for j in graph.neighbours[i]}


def _mix(own: FloatArray, msgs: Mapping[int, FloatArray], w_self: float, w_nbrs: Mapping[int, float]) -> FloatArray:
    """``W_ii own + sum_{j in N_i} W_ij msg_j``, accumulated in increasing j."""
    if set(msgs) != set(w_nbrs):
        raise ValueError(f"messages from {sorted(msgs)} but weights for neighbours {sorted(w_nbrs)}")
    out = w_self * own
    for j in sorted(w_nbrs):
        msg = msgs[j]
        if msg.shape != own.shape:
            raise ValueError(f"message from {j} has shape {msg.shape}, expected {own.shape}")
        out = out + w_nbrs[j] * msg
    return np.asarray(out, dtype=np.float64)


def pg_extra_alpha_bound(weights: NDArray[np.float64], L_max: float) -> float:
    """PG-EXTRA's stepsize bound ``2 lambda_min(W~) / L`` (Shi et al. 2015), ``W~ = (I + W)/2``."""
    wt = 0.5 * (np.eye(weights.shape[0]) + weights)
    return float(2.0 * np.linalg.eigvalsh(0.5 * (wt + wt.T))[0] / L_max)


def nids_alpha_bound(L_max: float) -> float:
    """NIDS's stepsize bound ``2 / L`` (spec 5.6; with ``W~ = (I + W)/2``)."""
    return 2.0 / L_max


# --------------------------------------------------------------------------------------------- PG-EXTRA per agent
@dataclass(frozen=True)
class PGExtraState:
    """Agent i's PG-EXTRA state after computing ``x_i^k``.

    Attributes
    ----------
    x
        ``x_i^k`` (exact; neighbours only ever see its published copy).
    x_half
        ``x_i^{k-1/2}``.
    wt_prev
        ``[W~ x^{k-1}]_i`` as agent i formed it in the previous round (``x^0`` for k = 1, as ``W~ x^0 = x^0``).
    grad_prev
        ``grad f_i(x_i^{k-1})``.
    k
        Index of ``x`` (1 after :func:`pg_extra_init`).
    t
        Publications so far.
    """

    x: FloatArray
    x_half: FloatArray
    wt_prev: FloatArray
    grad_prev: FloatArray
    k: int = 1
    t: int = 0


def pg_extra_init(x0: ArrayLike, grad_fi: GradFn, alpha: float, prox: ProxFn) -> PGExtraState:
    """``x_i^{1/2} = x^0 - alpha grad f_i(x^0)`` (``W x^0 = x^0`` for the common public start), ``x_i^1 = prox``."""
    x0a = np.array(x0, dtype=np.float64)
    g0 = grad_fi(x0a)
    x_half = x0a - alpha * g0
    return PGExtraState(prox(x_half), x_half, x0a, g0, 1, 0)


def pg_extra_publish(
    state: PGExtraState, agent_id: int, noise: NoiseConfig | None = None
) -> tuple[PGExtraState, FloatArray]:
    """Publish ``x_i^k`` (plus the noise of publication ``t + 1``); returns the state with ``t + 1`` and the message."""
    t = state.t + 1
    return replace(state, t=t), _privatise(state.x, t, agent_id, noise, STREAM_PG_EXTRA)


def pg_extra_step(
    state: PGExtraState,
    neighbour_msgs: Mapping[int, FloatArray],
    w_self: float,
    w_nbrs: Mapping[int, float],
    grad_fi: GradFn,
    alpha: float,
    prox: ProxFn,
) -> PGExtraState:
    """One PG-EXTRA round at agent i: from ``x_i^k`` and the neighbours' published ``x_j^k`` to ``x_i^{k+1}``.

    ``x_i^{k+1/2} = [W x^k]_i + x_i^{k-1/2} - [W~ x^{k-1}]_i - alpha (grad f_i(x_i^k) - grad f_i(x_i^{k-1}))``,
    ``x_i^{k+1} = prox(x_i^{k+1/2})``, with ``[W x^k]_i = W_ii x_i^k + sum_j W_ij msg_j`` and
    ``[W~ x^k]_i = (x_i^k + [W x^k]_i) / 2`` cached for the next round.

    Parameters
    ----------
    neighbour_msgs
        ``{j: published x_j^k}`` for exactly the keys of ``w_nbrs``.
    w_self, w_nbrs
        ``W_ii`` and ``{j: W_ij}`` (:func:`mixing_row`).
    grad_fi, alpha, prox
        ``grad f_i``, the common stepsize, and ``prox_{alpha r}`` (:func:`elastic_net_prox`).
    """
    mix = _mix(state.x, neighbour_msgs, w_self, w_nbrs)
    wt = 0.5 * (state.x + mix)
    g = grad_fi(state.x)
    x_half = mix + state.x_half - state.wt_prev - alpha * (g - state.grad_prev)
    return PGExtraState(prox(x_half), x_half, wt, g, state.k + 1, state.t)


# --------------------------------------------------------------------------------------------- NIDS per agent
@dataclass(frozen=True)
class NidsState:
    """Agent i's NIDS state after computing ``x_i^k``.

    Attributes
    ----------
    x, x_prev
        ``x_i^k`` and ``x_i^{k-1}`` (``x^0`` for k = 1).
    z
        ``z_i^k``.
    grad_prev
        ``grad f_i(x_i^{k-1})``.
    v, grad
        After :func:`nids_publish` in this round: the exact ``v_i^k`` and ``grad f_i(x_i^k)``; else ``None``.
    k, t
        Index of ``x`` and publications so far.
    """

    x: FloatArray
    x_prev: FloatArray
    z: FloatArray
    grad_prev: FloatArray
    v: FloatArray | None = None
    grad: FloatArray | None = None
    k: int = 1
    t: int = 0


def nids_init(x0: ArrayLike, grad_fi: GradFn, alpha: float, prox: ProxFn) -> NidsState:
    """``z_i^1 = x^0 - alpha grad f_i(x^0)``, ``x_i^1 = prox(z_i^1)`` (local: ``x^0`` is public)."""
    x0a = np.array(x0, dtype=np.float64)
    g0 = grad_fi(x0a)
    z1 = x0a - alpha * g0
    return NidsState(prox(z1), x0a, z1, g0, None, None, 1, 0)


def nids_publish(
    state: NidsState, grad_fi: GradFn, alpha: float, agent_id: int, noise: NoiseConfig | None = None
) -> tuple[NidsState, FloatArray]:
    """Compute and publish ``v_i^k = 2 x_i^k - x_i^{k-1} - alpha grad f_i(x_i^k) + alpha grad f_i(x_i^{k-1})``.

    Returns the state holding the exact ``v_i^k`` (for :func:`nids_step`) with ``t + 1``, and the published copy.
    """
    if state.v is not None:
        raise ValueError(f"v_i^{state.k} was already published in this round")
    g = grad_fi(state.x)
    v = 2.0 * state.x - state.x_prev - alpha * g + alpha * state.grad_prev
    t = state.t + 1
    return replace(state, v=v, grad=g, t=t), _privatise(v, t, agent_id, noise, STREAM_NIDS)


def nids_step(
    state: NidsState,
    neighbour_msgs: Mapping[int, FloatArray],
    w_self: float,
    w_nbrs: Mapping[int, float],
    prox: ProxFn,
) -> NidsState:
    """One NIDS round at agent i: ``z_i^{k+1} = z_i^k - x_i^k + [W~ v^k]_i``, ``x_i^{k+1} = prox(z_i^{k+1})``.

    ``[W~ v^k]_i = (v_i^k + W_ii v_i^k + sum_j W_ij msg_j) / 2`` with the neighbours' published ``v_j^k``; needs
    :func:`nids_publish` of this round first.
    """
    if state.v is None or state.grad is None:
        raise ValueError("nids_step needs this round's v_i (call nids_publish first)")
    mix = _mix(state.v, neighbour_msgs, w_self, w_nbrs)
    z = state.z - state.x + 0.5 * (state.v + mix)
    return NidsState(prox(z), state.x, z, state.grad, None, None, state.k + 1, state.t)


# --------------------------------------------------------------------------------------------- RW-ADMM per agent
@dataclass(frozen=True)
class RWAdmmState:
    """Agent i's RW-ADMM state: local primal copy ``y_i``, dual ``z_i`` and its publication count ``t``."""

    y: FloatArray
    z: FloatArray
    t: int = 0

    @classmethod
    def initial(cls, x0: ArrayLike) -> RWAdmmState:
        """``y_i = x^0``, ``z_i = 0``."""
        xa = np.array(x0, dtype=np.float64)
        return cls(xa, np.zeros_like(xa), 0)


def rw_admm_initial_token(x0: ArrayLike) -> FloatArray:
    """``t^1 = (1/n) sum_i (y_i + z_i / beta) = x^0`` for ``y_i = x^0``, ``z_i = 0``."""
    return np.array(x0, dtype=np.float64)


def rw_admm_step(
    token: FloatArray, state: RWAdmmState, grad_fi: GradFn, beta: float, n: int, prox: ProxFn
) -> tuple[RWAdmmState, FloatArray, FloatArray]:
    """One RW-ADMM activation at the token holder i (module docstring).

    Parameters
    ----------
    token
        The received token t (the previous holder's published, possibly noisy, copy).
    state
        ``(y_i, z_i, t_i)``.
    grad_fi, beta, n
        ``grad f_i``, the penalty beta and the number of agents.
    prox
        ``prox_{r/beta}`` (:func:`elastic_net_prox` with step ``1/beta``).

    Returns
    -------
    tuple
        ``(new state, new token (clean, before noise), x = prox_{r/beta}(token))``.
    """
    x = prox(token)
    y = x - (grad_fi(state.y) + state.z) / beta
    z = state.z + beta * (y - x)
    new_token = token + ((y + z / beta) - (state.y + state.z / beta)) / n
    return RWAdmmState(y, z, state.t), new_token, x


def rw_admm_publish(
    token: FloatArray, state: RWAdmmState, agent_id: int, noise: NoiseConfig | None = None
) -> tuple[RWAdmmState, FloatArray]:
    """Publish the token (plus the noise of the holder's publication ``t + 1``) to the next holder."""
    t = state.t + 1
    return replace(state, t=t), _privatise(token, t, agent_id, noise, STREAM_RW_ADMM)


# --------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class BaselineResult:
    """Output of :func:`simulate_pg_extra`, :func:`simulate_nids` and :func:`simulate_rw_admm`.

    Attributes
    ----------
    algorithm
        Canonical name (:func:`canonical_algorithm`).
    x
        Final model: the agent average ``x-bar^{T+1}`` (synchronous) or ``prox_{r/beta}(token)`` (RW-ADMM).
    agent_x
        Shape ``(n, *x_shape)``: final ``x_i`` (synchronous) or ``y_i`` (RW-ADMM).
    eval_iters
        Iterations at which errors were recorded (0, every ``eval_every``-th, the last); paper iterations for RW-ADMM.
    rel_errors
        ``||x - x*|| / ||x^0 - x*||`` at ``eval_iters`` (spec 5.7).
    max_rel_errors
        ``max_i ||x_i - x*|| / ||x^0 - x*||`` (``y_i`` for RW-ADMM) at ``eval_iters``.
    x_star
        The reference minimiser.
    iterations
        Iterations performed (T unless RW-ADMM stopped on budget; then the paper iterations begun).
    tau
        Publications per agent (all T for the synchronous methods).
    messages_sent
        Graph messages this implementation sent (2m per synchronous round; 1 per RW-ADMM hop).
    paper_messages
        ``messages_per_iteration(algorithm, graph) * iterations`` (the paper's count, spec 5.6).
    sigma1, R, sensitivity
        Noise scale, attenuation, and the Delta used for accounting.
    step
        alpha (PG-EXTRA, NIDS) or beta (RW-ADMM).
    hops, holders
        RW-ADMM only: token hops performed and the holder of each hop.
    """

    algorithm: str
    x: FloatArray
    agent_x: FloatArray
    eval_iters: NDArray[np.int64]
    rel_errors: FloatArray
    max_rel_errors: FloatArray
    x_star: FloatArray
    iterations: int
    tau: NDArray[np.int64]
    messages_sent: int
    paper_messages: int
    sigma1: float
    R: float
    sensitivity: float
    step: float
    hops: int | None = None
    holders: NDArray[np.int64] | None = None

    @property
    def lci(self) -> int:
        """Local communication involvement ``max_i tau_i`` (spec 1.5)."""
        return topology.lci(self.tau)

    def epsilon(self, delta: float) -> float:
        """Realised epsilon (Theorem 3's formulas with this run's Delta and realised LCI; inf when sigma1 = 0)."""
        return zcdp.epsilon_from_noise(self.sigma1, self.sensitivity, self.R, self.lci, delta)


@dataclass
class _Tracker:
    x_star: FloatArray
    den: float
    iters: list[int]
    errs: list[float]
    max_errs: list[float]

    @classmethod
    def start(cls, x0: FloatArray, x_star: FloatArray) -> _Tracker:
        den = float(np.linalg.norm(x0 - x_star))
        if den < 1e-12:
            raise ValueError("||x^0 - x*|| < 1e-12: the relative error is 0/0 (spec A9); start from a seeded N(0, I)")
        return cls(x_star, den, [0], [1.0], [1.0])

    def record(self, k: int, x: FloatArray, agents: FloatArray) -> None:
        self.iters.append(k)
        self.errs.append(float(np.linalg.norm(x - self.x_star)) / self.den)
        diffs = (agents - self.x_star).reshape(agents.shape[0], -1)
        self.max_errs.append(float(np.linalg.norm(diffs, axis=1).max()) / self.den)


# --------------------------------------------------------------------------------------------- simulators
@dataclass(frozen=True)
class _Sync:
    """Shared set-up of the synchronous simulators."""

    problem: ElasticNetProblem
    graph: topology.Graph
    weights: NDArray[np.float64]
    alpha: float
    x0: FloatArray
    x_star: FloatArray
    noise: NoiseConfig
    sensitivity: float
    grads: tuple[GradFn, ...]

    @property
    def n(self) -> int:
        return self.problem.n

    def rows(self) -> list[tuple[float, dict[int, float]]]:
        return [mixing_row(self.weights, self.graph, i) for i in range(self.n)]

    def slots(self) -> tuple[NDArray[np.float64], NDArray[np.int64], NDArray[np.float64]]:
        """``W_ii`` (n,), neighbour indices (n, d_max) in increasing order (padded with i) and weights (padded 0)."""
        n, dmax = self.n, int(self.graph.degrees.max())
        idx = np.tile(np.arange(n, dtype=np.int64)[:, None], (1, dmax))
        wts = np.zeros((n, dmax))
        for i in range(n):
            for s, j in enumerate(self.graph.neighbours[i]):  # sorted, as in _mix
                idx[i, s], wts[i, s] = j, self.weights[i, j]
        return np.diag(self.weights).copy(), idx, wts

    def grad_all(self, xs: FloatArray) -> FloatArray:
        # per agent on fresh arrays, like the per-agent functions (keeps BLAS inputs identical)
        return np.stack([self.grads[i](xs[i].copy()) for i in range(self.n)])

    def privatise_all(self, vecs: FloatArray, t: int, stream: int) -> FloatArray:
        return np.stack([_privatise(vecs[i], t, i, self.noise, stream) for i in range(self.n)])


def _bshape(arr: NDArray[np.float64], ndim: int) -> NDArray[np.float64]:
    """Reshape an (n,) / (n, d) weight array to broadcast against (n, *x_shape) / (n, d, *x_shape)."""
    return arr.reshape(arr.shape + (1,) * ndim)


def _vector_mix(own: FloatArray, msgs: FloatArray, w_self: FloatArray, idx: NDArray[np.int64],
                wts: FloatArray) -> FloatArray:
    """Vectorised :func:`_mix` for all agents, same operation order (padding adds exactly ``0 * msg``)."""
    nd = own.ndim - 1
    out = _bshape(w_self, nd) * own
    for s in range(idx.shape[1]):
        out = out + _bshape(wts[:, s], nd) * msgs[idx[:, s]]
    return np.asarray(out, dtype=np.float64)


def _setup_sync(
    algorithm: str,
    problem: ElasticNetProblem,
    graph: topology.Graph,
    T: int,
    alpha: float | None,
    alpha_scale: float,
    bound: Callable[[NDArray[np.float64], float], float],
    weights: ArrayLike | None,
    x0: ArrayLike | None,
    x_star: ArrayLike | None,
    sigma1: float,
    R: float,
    noise_seed: int,
    epsilon: float | None,
    delta: float,
    allow_large_alpha: bool,
    eval_every: int,
    engine: str,
) -> _Sync:
    if graph.n != problem.n:
        raise ValueError(f"graph has {graph.n} agents, the problem {problem.n}")
    if T < 0 or eval_every < 1:
        raise ValueError(f"need T >= 0 and eval_every >= 1, got T={T}, eval_every={eval_every}")
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid: {', '.join(ENGINES)}")
    w = topology.metropolis_weights(graph) if weights is None else np.asarray(weights, dtype=np.float64)
    topology.validate_mixing(w, graph)
    L_max = float(problem.lipschitz.max())
    limit = bound(w, L_max)
    if alpha is None:
        if not 0.0 < alpha_scale < 1.0:
            raise ValueError(f"alpha_scale must lie in (0, 1), got {alpha_scale}")
        alpha = alpha_scale * limit
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if alpha >= limit and not allow_large_alpha:
        raise ValueError(f"{algorithm}: alpha = {alpha} is not below its bound {limit}; pass allow_large_alpha=True")
    x0a = np.zeros(problem.x_shape) if x0 is None else np.array(x0, dtype=np.float64)
    if x0a.shape != problem.x_shape:
        raise ValueError(f"x0 has shape {x0a.shape}, the problem needs {problem.x_shape}")
    xs = solve_elastic_net(problem).x if x_star is None else np.asarray(x_star, dtype=np.float64)
    delta_s = gradient_message_sensitivity(alpha, L_max)
    if epsilon is not None:
        if sigma1 != 0.0:
            raise ValueError("give either sigma1 or epsilon, not both")
        sigma1 = baseline_sigma1(epsilon, delta, R, T, delta_s)  # xi = T: every agent publishes every round
    noise = NoiseConfig(sigma1, R, noise_seed)
    return _Sync(problem, graph, w, float(alpha), x0a, xs, noise, delta_s, tuple(a.grad for a in problem.agents))


def _sync_result(algorithm: str, s: _Sync, T: int, xs_final: FloatArray, tr: _Tracker) -> BaselineResult:
    return BaselineResult(
        algorithm=algorithm,
        x=np.asarray(xs_final.mean(axis=0), dtype=np.float64),
        agent_x=xs_final,
        eval_iters=np.array(tr.iters, dtype=np.int64),
        rel_errors=np.array(tr.errs),
        max_rel_errors=np.array(tr.max_errs),
        x_star=s.x_star,
        iterations=T,
        tau=np.full(s.n, T, dtype=np.int64),
        messages_sent=2 * s.graph.num_edges * T,
        paper_messages=messages_per_iteration(algorithm, s.graph) * T,
        sigma1=s.noise.sigma1,
        R=s.noise.R,
        sensitivity=s.sensitivity,
        step=s.alpha,
    )


def _want_eval(k: int, T: int, eval_every: int) -> bool:
    return k % eval_every == 0 or k == T


def simulate_pg_extra(
    problem: ElasticNetProblem,
    graph: topology.Graph,
    T: int,
    *,
    alpha: float | None = None,
    alpha_scale: float = 0.5,
    weights: ArrayLike | None = None,
    x0: ArrayLike | None = None,
    x_star: ArrayLike | None = None,
    sigma1: float = 0.0,
    R: float = 1.0,
    noise_seed: int = 0,
    epsilon: float | None = None,
    delta: float = 1e-3,
    allow_large_alpha: bool = False,
    eval_every: int = 1,
    engine: str = "vectorised",
) -> BaselineResult:
    """(DP-)PG-EXTRA for T rounds on ``graph`` (module docstring; spec 5.6).

    Parameters
    ----------
    problem, graph
        Agent i holds ``problem.agents[i]``; ``graph.n == problem.n``.
    T
        Rounds (= publications per agent = LCI); Table V: 600.
    alpha, alpha_scale, allow_large_alpha
        Common stepsize; default ``alpha_scale * 2 lambda_min(W~) / L_max`` (:func:`pg_extra_alpha_bound`), and an
        alpha at or above the bound raises unless ``allow_large_alpha``.
    weights
        Mixing matrix W (validated against the graph); Metropolis-Hastings by default.
    x0
        Common public start (zeros by default).
    x_star
        Reference minimiser (:func:`fedpdm_flower.fedapp.algorithms.recal.solve_elastic_net` if omitted).
    sigma1, R, noise_seed
        Publication noise (:class:`NoiseConfig`); ``sigma1 = 0`` is non-private PG-EXTRA.
    epsilon, delta
        Instead of sigma1: calibrate it for (epsilon, delta) with ``Delta = 2 alpha L_max`` and ``xi = T``.
    eval_every
        Record errors every ``eval_every`` rounds (and at 0 and T).
    engine
        ``"vectorised"`` (numpy over agents) or ``"per_agent"`` (loop over :func:`pg_extra_publish` /
        :func:`pg_extra_step` with dict messages); identical results bit for bit.
    """
    s = _setup_sync("pg-extra", problem, graph, T, alpha, alpha_scale, pg_extra_alpha_bound, weights, x0, x_star,
                    sigma1, R, noise_seed, epsilon, delta, allow_large_alpha, eval_every, engine)
    tr = _Tracker.start(s.x0, s.x_star)
    prox = elastic_net_prox(s.alpha, problem.nu1, problem.nu2)
    if engine == "per_agent":
        rows = s.rows()
        states = [pg_extra_init(s.x0, s.grads[i], s.alpha, prox) for i in range(s.n)]
        for k in range(1, T + 1):
            msgs: dict[int, FloatArray] = {}
            for i in range(s.n):
                states[i], msgs[i] = pg_extra_publish(states[i], i, s.noise)
            states = [
                pg_extra_step(st, {j: msgs[j] for j in rows[i][1]}, rows[i][0], rows[i][1], s.grads[i], s.alpha, prox)
                for i, st in enumerate(states)
            ]
            if _want_eval(k, T, eval_every):
                xs_all = np.stack([st.x for st in states])
                tr.record(k, xs_all.mean(axis=0), xs_all)
        final = np.stack([st.x for st in states])
        return _sync_result("pg-extra", s, T, final, tr)

    w_self, idx, wts = s.slots()
    x0s = np.stack([s.x0.copy() for _ in range(s.n)])
    g_prev = s.grad_all(x0s)
    x_half = x0s - s.alpha * g_prev
    x = prox_nr(x_half, s.alpha, problem.nu1, problem.nu2)
    wt_prev = x0s
    for k in range(1, T + 1):
        msgs_arr = s.privatise_all(x, k, STREAM_PG_EXTRA)
        mix = _vector_mix(x, msgs_arr, w_self, idx, wts)
        wt = 0.5 * (x + mix)
        g = s.grad_all(x)
        x_half = mix + x_half - wt_prev - s.alpha * (g - g_prev)
        x = prox_nr(x_half, s.alpha, problem.nu1, problem.nu2)
        wt_prev, g_prev = wt, g
        if _want_eval(k, T, eval_every):
            tr.record(k, x.mean(axis=0), x)
    return _sync_result("pg-extra", s, T, x, tr)


def simulate_nids(
    problem: ElasticNetProblem,
    graph: topology.Graph,
    T: int,
    *,
    alpha: float | None = None,
    alpha_scale: float = 0.5,
    weights: ArrayLike | None = None,
    x0: ArrayLike | None = None,
    x_star: ArrayLike | None = None,
    sigma1: float = 0.0,
    R: float = 1.0,
    noise_seed: int = 0,
    epsilon: float | None = None,
    delta: float = 1e-3,
    allow_large_alpha: bool = False,
    eval_every: int = 1,
    engine: str = "vectorised",
) -> BaselineResult:
    """(DP-)NIDS for T rounds on ``graph`` (module docstring; spec 5.6).

    Same parameters as :func:`simulate_pg_extra`, except the default stepsize ``alpha_scale * 2 / L_max``
    (:func:`nids_alpha_bound`; 0.5 gives ``1 / L_max``) and the published vector ``v_i^k``.
    """
    s = _setup_sync("nids", problem, graph, T, alpha, alpha_scale, lambda _w, lm: nids_alpha_bound(lm), weights, x0,
                    x_star, sigma1, R, noise_seed, epsilon, delta, allow_large_alpha, eval_every, engine)
    tr = _Tracker.start(s.x0, s.x_star)
    prox = elastic_net_prox(s.alpha, problem.nu1, problem.nu2)
    if engine == "per_agent":
        rows = s.rows()
        states = [nids_init(s.x0, s.grads[i], s.alpha, prox) for i in range(s.n)]
        for k in range(1, T + 1):
            msgs: dict[int, FloatArray] = {}
            for i in range(s.n):
                states[i], msgs[i] = nids_publish(states[i], s.grads[i], s.alpha, i, s.noise)
            states = [
                nids_step(st, {j: msgs[j] for j in rows[i][1]}, rows[i][0], rows[i][1], prox)
                for i, st in enumerate(states)
            ]
            if _want_eval(k, T, eval_every):
                xs_all = np.stack([st.x for st in states])
                tr.record(k, xs_all.mean(axis=0), xs_all)
        final = np.stack([st.x for st in states])
        return _sync_result("nids", s, T, final, tr)

    w_self, idx, wts = s.slots()
    x_prev = np.stack([s.x0.copy() for _ in range(s.n)])
    g_prev = s.grad_all(x_prev)
    z = x_prev - s.alpha * g_prev
    x = prox_nr(z, s.alpha, problem.nu1, problem.nu2)
    for k in range(1, T + 1):
        g = s.grad_all(x)
        v = 2.0 * x - x_prev - s.alpha * g + s.alpha * g_prev
        msgs_arr = s.privatise_all(v, k, STREAM_NIDS)
        mix = _vector_mix(v, msgs_arr, w_self, idx, wts)
        z = z - x + 0.5 * (v + mix)
        x_prev, g_prev = x, g
        x = prox_nr(z, s.alpha, problem.nu1, problem.nu2)
        if _want_eval(k, T, eval_every):
            tr.record(k, x.mean(axis=0), x)
    return _sync_result("nids", s, T, x, tr)


def simulate_rw_admm(
    problem: ElasticNetProblem,
    graph: topology.Graph,
    T: int,
    *,
    activation_prob: float = RW_ADMM_ACTIVATION_PROB,
    beta: float | None = None,
    beta_scale: float = 2.0,
    x0: ArrayLike | None = None,
    x_star: ArrayLike | None = None,
    sigma1: float = 0.0,
    R: float = 1.0,
    noise_seed: int = 0,
    epsilon: float | None = None,
    delta: float = 1e-3,
    xi_plan: int | None = None,
    stop_on_budget: bool = False,
    walk: str = "markov",
    start: str | int = "stationary",
    walk_seed: int = 0,
    eval_every: int = 1,
) -> BaselineResult:
    """(DP-)RW-ADMM for T paper iterations = :func:`rw_admm_hops` token hops (module docstring; spec 5.6).

    Parameters
    ----------
    problem, graph
        As in :func:`simulate_pg_extra`.
    T, activation_prob
        Paper iterations and activation probability P (Table V: 1200 and 0.5, i.e. 4800 hops on ring-8).
    beta, beta_scale
        ADMM penalty; default ``beta_scale * L_max``.
    x0, x_star
        Common start (zeros) and reference minimiser.
    sigma1, R, noise_seed
        Token noise (:class:`NoiseConfig`).
    epsilon, delta
        Instead of sigma1: calibrate for (epsilon, delta) with :func:`rw_admm_sensitivity` at ``xi = xi_plan``.
    xi_plan, stop_on_budget
        Planned LCI (default :func:`fedpdm_flower.fedapp.topology.plan_xi` of the hops: ``ceil(1.15 K max g)``, 690 on ring-8 at
        K = 4800); with ``stop_on_budget`` the run stops before any holder would publish more than ``xi_plan``
        times (spec 4.5), so the realised epsilon stays within the target.
    walk, start, walk_seed
        The token's walk (:func:`fedpdm_flower.fedapp.topology.walk_path`; ``"markov"`` = Assumption 3's simple random walk).
    eval_every
        Record errors every ``eval_every`` paper iterations (and at 0 and the end).
    """
    n = problem.n
    if graph.n != n:
        raise ValueError(f"graph has {graph.n} agents, the problem {n}")
    if T < 0 or eval_every < 1:
        raise ValueError(f"need T >= 0 and eval_every >= 1, got T={T}, eval_every={eval_every}")
    K = rw_admm_hops(T, activation_prob, n)
    L_max = float(problem.lipschitz.max())
    if beta is None:
        if not beta_scale > 0:
            raise ValueError(f"beta_scale must be > 0, got {beta_scale}")
        beta = beta_scale * L_max
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    plan = topology.plan_xi(K, graph, walk) if xi_plan is None else int(xi_plan)
    if plan < 1 and K > 0:
        raise ValueError(f"xi_plan must be >= 1, got {plan}")
    delta_s = rw_admm_sensitivity(beta, L_max, n)
    if epsilon is not None:
        if sigma1 != 0.0:
            raise ValueError("give either sigma1 or epsilon, not both")
        sigma1 = baseline_sigma1(epsilon, delta, R, plan, delta_s)
    noise = NoiseConfig(sigma1, R, noise_seed)
    x0a = np.zeros(problem.x_shape) if x0 is None else np.array(x0, dtype=np.float64)
    if x0a.shape != problem.x_shape:
        raise ValueError(f"x0 has shape {x0a.shape}, the problem needs {problem.x_shape}")
    xs = solve_elastic_net(problem).x if x_star is None else np.asarray(x_star, dtype=np.float64)
    tr = _Tracker.start(x0a, xs)
    prox = elastic_net_prox(1.0 / beta, problem.nu1, problem.nu2)
    grads = [a.grad for a in problem.agents]
    holders = topology.walk_path(graph, K, walk, start, walk_seed)

    states = [RWAdmmState.initial(x0a) for _ in range(n)]
    token = rw_admm_initial_token(x0a)
    tau = np.zeros(n, dtype=np.int64)
    hops = 0
    it = 0
    stopped = False
    for k in range(1, T + 1):
        end = _hop_boundary(k, activation_prob, n)
        while hops < end:
            i = int(holders[hops])
            if stop_on_budget and tau[i] + 1 > plan:
                stopped = True
                break
            st, clean, _ = rw_admm_step(token, states[i], grads[i], beta, n, prox)
            states[i], token = rw_admm_publish(clean, st, i, noise)
            tau[i] += 1
            hops += 1
        it = k
        if stopped or _want_eval(k, T, eval_every):
            tr.record(k, prox(token), np.stack([st.y for st in states]))
        if stopped:
            break
    return BaselineResult(
        algorithm="rw-admm",
        x=prox(token),
        agent_x=np.stack([st.y for st in states]),
        eval_iters=np.array(tr.iters, dtype=np.int64),
        rel_errors=np.array(tr.errs),
        max_rel_errors=np.array(tr.max_errs),
        x_star=xs,
        iterations=it,
        tau=tau,
        messages_sent=hops,
        paper_messages=messages_per_iteration("rw-admm", graph) * it,
        sigma1=sigma1,
        R=R,
        sensitivity=delta_s,
        step=float(beta),
        hops=hops,
        holders=np.asarray(holders[:hops], dtype=np.int64),
    )


# --------------------------------------------------------------------------------------------- run-config rules
def data_free_sensitivity(algorithm: str, graph: topology.Graph, alpha_scale: float, beta_scale: float) -> float:
    """The baselines' Delta with the default stepsize / penalty, which does not depend on the data.

    PG-EXTRA ``2 alpha L`` with ``alpha = alpha_scale * 2 lambda_min(W~) / L``: ``4 alpha_scale lambda_min(W~)``;
    NIDS ``alpha = alpha_scale * 2 / L``: ``4 alpha_scale``; RW-ADMM ``4 L / (n beta)`` with ``beta = beta_scale L``:
    ``4 / (n beta_scale)``. Equal (up to rounding) to what the Flower strategies compute after registration; used
    to reject an unrepresentable sigma_1 before round 1.
    """
    algo = canonical_algorithm(algorithm)
    if algo == "pg-extra":
        return gradient_message_sensitivity(alpha_scale * pg_extra_alpha_bound(topology.metropolis_weights(graph), 1.0), 1.0)
    if algo == "nids":
        return gradient_message_sensitivity(alpha_scale * nids_alpha_bound(1.0), 1.0)
    if algo == "rw-admm":
        return rw_admm_sensitivity(beta_scale, 1.0, graph.n)
    raise ValueError(f"{algorithm!r} is not a Table V baseline with a data-free sensitivity")
