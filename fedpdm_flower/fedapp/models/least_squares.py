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
