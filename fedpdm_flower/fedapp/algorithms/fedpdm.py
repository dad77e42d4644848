"""DP-FedPDM (Alg. 1) and BSDP-FedPDM (Alg. 2) math.

Li, Huang, Wang, Chi, Quek, "Privacy-preserving Federated Primal-dual Learning for Non-convex and Non-smooth
Problems with Model Sparsification", arXiv 2310.19558. Equation numbers are the paper's.

Client, round t, starting from the (possibly sparsified) global model x_0^t:

    x^{t,r+1} = x^{t,r} - eta^t (grad f_i(x^{t,r}; B^{t,r}) - lambda_i^t + rho (x^{t,r} - x_0^t))    (8a)
    stop at the first r with ||direction||^2 <= nu; Q_i^t = r + 1                                  (10)
    lambda_i^{t+1} = lambda_i^t + rho (x_0^t - x_i^{t+1})                                          (8c)
    y_i^{t+1} = x_i^{t+1} - lambda_i^{t+1} / rho                                                   (8d)

Server: x_0^{t+1} = prox_{h/rho}(element-wise mean of the received y's)                            (12)/(20)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.aggregation import elementwise_mean, prox_l1
from fedpdm_flower.fedapp.compression.codec import SparseVector
from fedpdm_flower.fedapp.localdata import LocalData
from fedpdm_flower.fedapp.models.base import FloatArray, SmoothObjective


def step_size(eta0: float, t: int) -> float:
    """eta^t = eta0 / sqrt(1 + t), t the 0-based round index (Section V-C)."""
    return eta0 / float(np.sqrt(1.0 + t))


def clip_by_norm(g: FloatArray, clip: float | None) -> FloatArray:
    """g * min(1, clip/||g||): enforces Assumption 3 (||grad|| <= G) that the sensitivity (35) relies on."""
    if clip is None:
        return g
    norm = float(np.linalg.norm(g))
    return g * (clip / norm) if norm > clip else g


def max_steps_for(n_local: int, batch_size: int, max_steps: int) -> int:
    """Cap Q so that Q*b < |D_i| (spec A6): batches are drawn without replacement within a round and q < 1.

    A batch size >= |D_i| means full-batch gradients (the convex sanity tests, spec 10.14): no cap then.
    """
    if batch_size >= n_local:
        return max_steps
    cap = (n_local - 1) // batch_size
    if cap < 1:
        raise ValueError(f"client holds {n_local} samples: batch-size={batch_size} leaves no room for one step")
    return min(max_steps, cap)


@dataclass(frozen=True)
class LocalResult:
    """Outcome of one client's round: x_i^{t+1}, lambda_i^{t+1}, y_i^{t+1} and the stopping diagnostics."""

    x: FloatArray
    dual: FloatArray
    y: FloatArray
    steps: int
    stopped_by_nu: bool
    final_dir_sqnorm: float


def local_update(
    x0: FloatArray,
    dual: FloatArray,
    data: LocalData,
    model: SmoothObjective,
    *,
    eta: float,
    rho: float,
    nu: float,
    batch_size: int,
    max_steps: int,
    clip: float | None,
    rng: np.random.Generator,
    gradient: Callable[[FloatArray], FloatArray] | None = None,
) -> LocalResult:
    """Alg. 1 lines 4-10: local primal steps (8a) with the stopping rule (10), then (8c) and (8d).

    Mini-batches are consecutive slices of one permutation of D_i (sampling without replacement within the
    round, as in Thm. 2's proof, spec A8). The tested quantity in (10) is the squared norm of the same direction
    used in the step, tested after the step, so Q >= 1 (spec A7). ``data`` is the client's D_i
    (:mod:`fedpdm_flower.fedapp.localdata`): numpy arrays or a torch dataset, read by index.

    ``gradient`` replaces the mini-batch gradient of (8a) by an oracle called once per step at x: record-level
    DP-SGD (:class:`fedpdm_flower.fedapp.privacy.dpsgd.DPSGDStep`, which Poisson-samples the records itself, so
    neither the permutation nor the cap Q b < |D_i| applies and ``batch_size`` / ``clip`` are unused). Everything
    else -- the dual term, the proximal pull, the stopping rule (10), (8c), (8d) -- is post-processing of its
    releases.
    """
    n = len(data)
    q_max = max_steps if gradient is not None else max_steps_for(n, batch_size, max_steps)
    perm = rng.permutation(n) if gradient is None else np.arange(0)
    x = x0.copy()
    sq = float("nan")
    steps, stopped = q_max, False
    full_batch = batch_size >= n
    for r in range(q_max):
        if gradient is not None:
            g = gradient(x)
        else:
            batch = perm if full_batch else perm[r * batch_size : (r + 1) * batch_size]
            g = clip_by_norm(model.grad(x, *data.batch(batch)), clip)
        direction = g - dual + rho * (x - x0)
        x = x - eta * direction  # (8a)
        sq = float(direction @ direction)
        if sq <= nu:  # (10)
            steps, stopped = r + 1, True
            break
    new_dual = dual + rho * (x0 - x)  # (8c)
    y = x - new_dual / rho  # (8d)
    return LocalResult(x=x, dual=new_dual, y=y, steps=steps, stopped_by_nu=stopped, final_dir_sqnorm=sq)


def server_update(uploads: list[SparseVector], dim: int, gamma: float, rho: float) -> tuple[FloatArray, NDArray[np.int64]]:
    """x_0^{t+1} = prox_{h/rho}(u) with u the element-wise mean (20)/(23); (12) when every upload is dense.

    Returns the new dense global model and the per-coordinate sender counts w_j.
    """
    mean, counts = elementwise_mean(uploads, dim)
    return prox_l1(mean, gamma, rho), counts
