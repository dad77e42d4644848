"""Server-side aggregation of FedPDM: (element-wise) means of uploads and the l1 proximal step.

Li, Huang, Wang, Chi, Quek, arXiv 2310.19558. The server computes

``x_0^{t+1} = prox_{h/rho}(u)``                                               (12), (20)

where u is the plain mean of the received vectors (12) or, with sparse uploads, the element-wise mean over the
clients that sent each coordinate (20)/(23). For ``h = gamma * ||.||_1`` the prox is soft-thresholding at
``gamma / rho`` (9), (15). Aggregation is unweighted: the paper does not weight by |D_i|.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.compression.codec import SparseVector

__all__ = ["elementwise_mean", "plain_mean", "prox_l1", "soft_threshold"]


def soft_threshold(u: NDArray[Any], threshold: float) -> NDArray[np.float64]:
    """Element-wise soft-thresholding, ``sign(u_j) * max(|u_j| - threshold, 0)`` (eq. 15).

    Parameters
    ----------
    u
        Input vector.
    threshold
        Threshold (>= 0); gamma/rho for the l1 prox (spec A18).

    Returns
    -------
    NDArray[np.float64]
        A new array; with threshold 0 an exact copy of ``u``.
    """
    if not (math.isfinite(threshold) and threshold >= 0.0):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
    arr = np.array(u, dtype=np.float64, copy=True)
    if threshold == 0.0:
        return arr
    return np.sign(arr) * np.maximum(np.abs(arr) - threshold, 0.0)


def prox_l1(u: NDArray[Any], gamma: float, rho: float) -> NDArray[np.float64]:
    """``prox_{h/rho}(u)`` for ``h = gamma * ||.||_1`` (eqs. 9 and 12/20 with 15): soft-threshold at gamma/rho.

    Parameters
    ----------
    u
        The aggregated vector.
    gamma
        l1 weight (>= 0); 0 makes the prox the identity.
    rho
        Penalty parameter (> 0).

    Returns
    -------
    NDArray[np.float64]
        The proximal point.
    """
    if not (math.isfinite(gamma) and gamma >= 0.0):
        raise ValueError(f"gamma must be a finite number >= 0, got {gamma!r}")
    if not (math.isfinite(rho) and rho > 0.0):
        raise ValueError(f"rho must be a finite number > 0, got {rho!r}")
    return soft_threshold(u, gamma / rho)


def elementwise_mean(
    vectors: Sequence[SparseVector], dim: int
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Element-wise mean of sparse uploads over the clients that sent each coordinate (eqs. 20 and 23).

    ``S_j = sum_i [yhat''_i]_j`` (zero-padded), ``w_j = #{i : j in I_i}`` (1 if nobody sent j), ``u = S ./ w``.
    A transmitted value that is exactly 0.0 still counts as sent (spec A10); coordinates nobody sent are 0
    (spec A11). When every vector carries all ``dim`` indices this is the plain mean (12), bit for bit equal to
    :func:`plain_mean` of the dense vectors in the same order.

    Parameters
    ----------
    vectors
        The decoded uploads, each of dimension ``dim``.
    dim
        Model dimension d.

    Returns
    -------
    mean : NDArray[np.float64]
        u, the element-wise mean.
    counts : NDArray[np.int64]
        Number of senders per coordinate (0 where nobody sent; w_j = max(counts_j, 1)).
    """
    if not vectors:
        raise ValueError("elementwise_mean needs at least one vector")
    total = np.zeros(dim, dtype=np.float64)
    counts = np.zeros(dim, dtype=np.int64)
    for i, v in enumerate(vectors):
        if v.dim != dim:
            raise ValueError(f"vector {i} has dim {v.dim}, expected {dim}")
        # Indices are unique within a SparseVector, so fancy-index += is exact (no need for np.add.at).
        total[v.indices] += v.values
        counts[v.indices] += 1
    return total / np.maximum(counts, 1), counts


def plain_mean(vectors: Sequence[NDArray[Any]]) -> NDArray[np.float64]:
    """Unweighted mean ``(1/|S_t|) sum_i ytilde_i`` of dense uploads (eq. 12).

    Summed one vector at a time in the given order (not ``np.mean``, whose pairwise summation would differ in the
    last bits), so it matches :func:`elementwise_mean` with full index sets exactly (spec 10.12).

    Parameters
    ----------
    vectors
        Dense vectors of equal shape.

    Returns
    -------
    NDArray[np.float64]
        Their mean, in float64.
    """
    if not vectors:
        raise ValueError("plain_mean needs at least one vector")
    first = np.asarray(vectors[0])
    total = np.zeros(first.shape, dtype=np.float64)
    for i, v in enumerate(vectors):
        arr = np.asarray(v)
        if arr.shape != first.shape:
            raise ValueError(f"vector {i} has shape {arr.shape}, expected {first.shape}")
        total += arr
    return total / len(vectors)
