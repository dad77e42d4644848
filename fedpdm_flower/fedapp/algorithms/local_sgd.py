"""Local SGD of the paper's comparison baselines (Figs. 7-8) and their server updates. Pure numpy, no Flower.

Li, Huang, Wang, Chi, Quek, arXiv 2310.19558, Section V-B2 compares DP-FedPDM / BSDP-FedPDM with

* FedAvg   -- McMahan, Moore, Ramage, Hampson, Aguera y Arcas, "Communication-Efficient Learning of Deep Networks
  from Decentralized Data", AISTATS 2017; in the paper's DP form of Li, Chang, Chi, "Secure federated averaging
  algorithm with differential privacy", MLSP 2020 (the paper's [10]);
* FedProx  -- Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous Networks",
  MLSys 2020 ([44]);
* SCAFFOLD -- Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging for
  Federated Learning", ICML 2020 ([26]);
* FedDyn   -- Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning Based on Dynamic
  Regularization", ICLR 2021 ([46]).

The paper gives none of their hyperparameters, nor how they treat the l1 term, DP or sparsification; the choices
below are OURS (spec 6.4 / A22). Every baseline minimises the paper's objective (40), F = (1/N) sum_i f_i +
gamma ||x||_1, with the same local loop as FedPDM: round t (0-based), step size eta^t = eta0 / sqrt(1 + t)
(:func:`fedpdm_flower.fedapp.algorithms.fedpdm.step_size`), Q = min(max-local-steps, cap) steps on consecutive mini-batches of
one permutation of D_i, the cap enforcing Q b < |D_i| (:func:`fedpdm_flower.fedapp.algorithms.fedpdm.max_steps_for`). From
x^{t,0} = x_0^t, the model the client received:

    g^{t,r}   = clip_G( grad f_i(x^{t,r}; B^{t,r}) + gamma sign(x^{t,r}) )
    x^{t,r+1} = x^{t,r} - eta^t ( g^{t,r} + prox (x^{t,r} - x_0^t) + correction - linear )

=========  ==================================================================  =====  ===========  ==========
algorithm  local problem (the paper's equation)                                prox   correction   linear
=========  ==================================================================  =====  ===========  ==========
FedAvg     f_i(w) (McMahan Alg. 1, ClientUpdate)                               0      --           --
FedProx    h_k(w; w^t) = F_k(w) + (mu/2)||w - w^t||^2 (Li et al. eq. 2)        mu     --           --
SCAFFOLD   y_i <- y_i - eta_l (g_i(y_i) - c_i + c) (Karimireddy Alg. 1 l. 10)  0      c - c_i      --
FedDyn     L_k(th) - <grad L_k(th_k^{t-1}), th> + (alpha/2)||th - th^{t-1}||^2  alpha  --           grad L_k
           (Acar et al. Alg. 1), solved by the same Q SGD steps
=========  ==================================================================  =====  ===========  ==========

[OURS] gamma sign(x) is the l1 subgradient (spec 6.4), and it is clipped *together* with the data gradient: the
Gaussian-mechanism sensitivity :func:`fedpdm_flower.fedapp.privacy.gaussian.local_sgd_sensitivity` assumes that the only
data-dependent part of a step has norm <= G, and sign(x) differs between neighbouring runs because x does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.aggregation import elementwise_mean
from fedpdm_flower.fedapp.algorithms.fedpdm import clip_by_norm, max_steps_for
from fedpdm_flower.fedapp.compression.codec import SparseVector
from fedpdm_flower.fedapp.localdata import LocalData
from fedpdm_flower.fedapp.models.base import FloatArray, SmoothObjective


@dataclass(frozen=True)
class LocalSGDResult:
    """Outcome of one client's local loop: the final local model and the number of steps Q taken."""

    x: FloatArray
    steps: int


def local_sgd(
    x0: FloatArray,
    data: LocalData,
    model: SmoothObjective,
    *,
    eta: float,
    batch_size: int,
    max_steps: int,
    clip: float | None,
    rng: np.random.Generator,
    gamma: float = 0.0,
    prox: float = 0.0,
    correction: FloatArray | None = None,
    linear: FloatArray | None = None,
    gradient: Callable[[FloatArray], FloatArray] | None = None,
) -> LocalSGDResult:
    """Q local (sub)gradient steps from x0, the loop shared by FedAvg, FedProx, SCAFFOLD and FedDyn.

    ``x <- x - eta (clip(grad f_i(x; B) + gamma sign(x)) + prox (x - x0) + correction - linear)``, Q times, with
    Q = ``max_steps_for(|D_i|, batch_size, max_steps)`` and the batches consecutive slices of one permutation of
    D_i (no replacement within the round, spec A8); a batch size >= |D_i| means full-batch gradients.

    Parameters
    ----------
    x0
        The received global model x_0^t: the starting point and the anchor of the proximal term.
    data
        The client's data D_i (:mod:`fedpdm_flower.fedapp.localdata`), read by index.
    model
        Gives the mini-batch gradient of the smooth loss f_i.
    eta
        Step size eta^t, constant within the round.
    batch_size
        Mini-batch size b.
    max_steps
        Upper bound on Q (the run config's max-local-steps); Q b < |D_i| is enforced on top.
    clip
        Clip norm G of the (sub)gradient ``grad f_i + gamma sign(x)``; None does not clip (DP off, spec A25).
    rng
        Draws the round's permutation of D_i.
    gamma
        l1 weight; its subgradient gamma sign(x) is added to every step (default 0.0: no l1 term).
    prox
        Weight of the proximal pull ``x - x0``: mu for FedProx, alpha for FedDyn (default 0.0: FedAvg, SCAFFOLD).
    correction
        Constant vector added to every direction: SCAFFOLD's c - c_i (default None: none).
    linear
        Constant vector subtracted from every direction: FedDyn's grad L_i (default None: none).
    gradient
        Record-level DP-SGD instead of the mini-batch gradient (:class:`fedpdm_flower.fedapp.privacy.dpsgd.DPSGDStep`):
        called once per step at x, it samples the records itself, so ``max_steps`` steps run without the cap and
        ``batch_size`` / ``clip`` are unused; ``gamma sign(x)`` (data-independent) is added to its release.

    Returns
    -------
    LocalSGDResult
        The local model x_i^{t+1} = x^{t,Q} and Q.
    """
    n = len(data)
    q = max_steps if gradient is not None else max_steps_for(n, batch_size, max_steps)
    perm = rng.permutation(n) if gradient is None else np.arange(0)
    full_batch = batch_size >= n
    x = x0.copy()
    for r in range(q):
        if gradient is not None:
            g = gradient(x) + gamma * np.sign(x)
        else:
            batch = perm if full_batch else perm[r * batch_size : (r + 1) * batch_size]
            g = clip_by_norm(model.grad(x, *data.batch(batch)) + gamma * np.sign(x), clip)
        direction = g + prox * (x - x0)
        if correction is not None:
            direction = direction + correction
        if linear is not None:
            direction = direction - linear
        x = x - eta * direction
    return LocalSGDResult(x=x, steps=q)


# ---------------------------------------------------------------------------------------------- FedAvg / FedProx
def model_average(uploads: Sequence[SparseVector], dim: int) -> tuple[FloatArray, NDArray[np.int64]]:
    """FedAvg / FedProx server step: ``x^{t+1} = (1/|S_t|) sum_{i in S_t} x_i^{t+1}``, unweighted.

    McMahan et al. 2017 weight by n_k/n; the paper's comparison (spec 6.4) and FedPDM's (12) average unweighted,
    which is the same for equal |D_i| (the paper's split). [OURS] With sparse uploads the mean is element-wise over
    the clients that sent each coordinate and a coordinate nobody sent becomes 0, FedPDM's rule (20)/(23), A11.
    No proximal step at the server.

    Parameters
    ----------
    uploads
        The received (possibly sparse) local models.
    dim
        Model dimension d.

    Returns
    -------
    x : FloatArray
        The new global model.
    counts : NDArray[np.int64]
        Number of senders per coordinate.
    """
    return elementwise_mean(uploads, dim)


# ---------------------------------------------------------------------------------------------------- SCAFFOLD
def scaffold_control_delta(c: FloatArray, delta_y: FloatArray, steps: int, eta: float) -> FloatArray:
    """SCAFFOLD option II (Karimireddy et al. 2020, Alg. 1 line 12): ``Delta c_i = c_i^+ - c_i``.

    ``c_i^+ = c_i - c + (x - y_i) / (K eta_l)``, so ``Delta c_i = -c - Delta y_i / (K eta_l)`` with
    ``Delta y_i = y_i - x`` and K = Q local steps. Element-wise, so it applies to the coordinates of a sparse upload.

    Parameters
    ----------
    c
        The server control variate the client received.
    delta_y
        The uploaded model change y_i - x (the noisy one under DP: then this is post-processing).
    steps
        Number of local steps Q.
    eta
        Local step size eta^t.

    Returns
    -------
    FloatArray
        Delta c_i; the client's new control variate is c_i + Delta c_i.
    """
    return -c - delta_y / (steps * eta)


def scaffold_server_update(
    x: FloatArray, c: FloatArray, delta_y: Sequence[SparseVector], delta_c: Sequence[SparseVector], num_clients: int
) -> tuple[FloatArray, FloatArray, NDArray[np.int64]]:
    """SCAFFOLD server step (Karimireddy et al. 2020, Alg. 1 lines 16-17) with global step size eta_g = 1.

    ``x <- x + (1/|S|) sum_{i in S} Delta y_i`` and ``c <- c + (|S|/N) (1/|S|) sum_{i in S} Delta c_i``.
    [OURS] With sparse uploads (Delta c_i on the indices of Delta y_i) the first mean is element-wise over the
    senders of each coordinate (a coordinate nobody sent keeps its value) and the second is
    ``c_j <- c_j + (1/N) sum_{i sent j} Delta c_ij``, which keeps c = (1/N) sum_i c_i when clients update c_i
    only on the sent coordinates.

    Parameters
    ----------
    x, c
        Server model and control variate.
    delta_y, delta_c
        Per client, on the same indices.
    num_clients
        N, the total number of clients.

    Returns
    -------
    x : FloatArray
        The new model.
    c : FloatArray
        The new control variate.
    counts : NDArray[np.int64]
        Number of senders per coordinate.
    """
    mean_dy, counts = elementwise_mean(delta_y, len(x))
    total_dc = np.zeros_like(c)
    for v in delta_c:
        total_dc[v.indices] += v.values
    return x + mean_dy, c + total_dc / num_clients, counts


# ------------------------------------------------------------------------------------------------------ FedDyn
def feddyn_linear_update(grad_l: FloatArray, theta_i: FloatArray, theta_server: FloatArray, alpha: float) -> FloatArray:
    """FedDyn client state (Acar et al. 2021, Alg. 1): ``grad L_k(th_k^t) = grad L_k(th_k^{t-1}) - alpha (th_k^t - th^{t-1})``.

    Element-wise, so it applies to the coordinates of a sparse upload.

    Parameters
    ----------
    grad_l
        The client's linear-term state grad L_i (zero before its first round).
    theta_i
        The uploaded local model (the noisy one under DP: then this is post-processing).
    theta_server
        The server model the client started from.
    alpha
        FedDyn's regularisation weight.

    Returns
    -------
    FloatArray
        The new grad L_i.
    """
    return grad_l - alpha * (theta_i - theta_server)


def feddyn_server_update(
    h: FloatArray, thetas: Sequence[SparseVector], theta_server: FloatArray, alpha: float, num_clients: int
) -> tuple[FloatArray, FloatArray, NDArray[np.int64]]:
    """FedDyn server step (Acar et al. 2021, Alg. 1).

    ``h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (th_k^t - th^{t-1})`` and
    ``th^t = (1/|P_t|) sum_{k in P_t} th_k^t - h^t / alpha``, m = N clients. [OURS] With sparse uploads the sum in h
    runs over the senders of each coordinate (so h = (1/N) sum_i grad L_i still holds when clients update grad L_i
    only on the sent coordinates) and the mean is element-wise, 0 where nobody sent (FedPDM's rule (20), A11).

    Parameters
    ----------
    h
        Server state h^{t-1} (zero initially).
    thetas
        The uploaded local models th_k^t.
    theta_server
        th^{t-1} as the clients received it (the zero-padded top_k' broadcast when the downlink is sparse).
    alpha
        FedDyn's regularisation weight (> 0).
    num_clients
        N, the total number of clients.

    Returns
    -------
    theta : FloatArray
        The new server model th^t.
    h : FloatArray
        The new server state h^t.
    counts : NDArray[np.int64]
        Number of senders per coordinate.
    """
    drift = np.zeros_like(h)
    for v in thetas:
        drift[v.indices] += v.values - theta_server[v.indices]
    h_new = h - alpha * drift / num_clients
    mean, counts = elementwise_mean(thetas, len(h))
    return mean - h_new / alpha, h_new, counts
