"""Least squares f_i(x) = (1/2|D_i|) ||A_i x - c_i||^2: the convex toy of the sanity tests (spec 10.14, lasso)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.models.base import FloatArray


class LeastSquares:
    """Smooth part of a lasso problem; targets are real numbers, the parameter vector is x in R^dim.

    Parameters
    ----------
    dim
        Number of features (columns of A_i).
    """

    name = "least-squares"

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def loss(self, x: FloatArray, features: FloatArray, targets: NDArray[np.floating]) -> float:
        r = features @ x - targets
        return float(0.5 * np.mean(r * r))

    def grad(self, x: FloatArray, features: FloatArray, targets: NDArray[np.floating]) -> FloatArray:
        return np.asarray(features.T @ (features @ x - targets) / len(targets), dtype=np.float64)

    def smoothness(self, features: FloatArray) -> float:
        """L = lambda_max(A^T A / n)."""
        return float(np.linalg.eigvalsh(features.T @ features / len(features))[-1])

    def per_sample_grads(self, x: FloatArray, features: FloatArray, targets: NDArray[np.floating]) -> FloatArray:
        """Row j: (a_j^T x - c_j) a_j, the gradient of record j's (1/2)(a_j^T x - c_j)^2."""
        r = features @ x - targets
        return np.asarray(r[:, None] * features, dtype=np.float64)

    def clipped_grad_sum(self, x: FloatArray, features: FloatArray, targets: NDArray[np.floating], clip: float) -> FloatArray:
        """A^T (f * r), f_j = min(1, C / (|r_j| ||a_j||)): the clipped rows summed without forming them."""
        r = features @ x - targets
        norms = np.abs(r) * np.linalg.norm(features, axis=1)
        f = np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))
        return np.asarray(features.T @ (f * r), dtype=np.float64)
