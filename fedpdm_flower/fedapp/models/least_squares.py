"""Least squares f_i(x) = (1/2|D_i|) ||A_i x - c_i||^2: the convex toy of the sanity tests (spec 10.14, lasso), and
with C target columns (``outputs=C``) the multi-output least squares of DP-RECAL's experiments (spec dp_recal.md
5.1, A6: one-hot +-1 targets, x of shape (q, C) flattened row-major)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.models.base import FloatArray


class LeastSquares:
    """Smooth part of a lasso problem; targets are real numbers (or rows of C reals), x is flat in R^dim.

    Parameters
    ----------
    dim
        Number of features (columns of A_i).
    outputs
        None (default): one target per record, x in R^dim. C: a row of C targets per record, x is the (dim, C)
        matrix flattened row-major (numpy's C order), so the flat vector has ``dim * C`` entries; record j's loss is
        ``1/2 ||x^T a_j - c_j||^2``.
    """

    name = "least-squares"

    def __init__(self, dim: int, outputs: int | None = None) -> None:
        if outputs is not None and (isinstance(outputs, bool) or not isinstance(outputs, int) or outputs < 1):
            raise ValueError(f"outputs must be None or an integer >= 1, got {outputs!r}")
        self.features = dim
        self.outputs = outputs
        self.dim = dim if outputs is None else dim * outputs

    def _x(self, x: FloatArray) -> FloatArray:
        xa = np.asarray(x, dtype=np.float64)
        return xa if self.outputs is None else xa.reshape(self.features, self.outputs)

    def _residuals(self, x: FloatArray, features: FloatArray, targets: NDArray[np.floating]) -> FloatArray:
        return np.asarray(features @ self._x(x) - targets, dtype=np.float64)

    def loss(self, x: FloatArray, features: FloatArray, targets: NDArray[np.floating]) -> float:
        r = self._residuals(x, features, targets)
        return float(0.5 * np.sum(r * r) / len(targets))

    def grad(self, x: FloatArray, features: FloatArray, targets: NDArray[np.floating]) -> FloatArray:
        g = features.T @ self._residuals(x, features, targets) / len(targets)
        return np.asarray(g, dtype=np.float64).reshape(-1)

    def smoothness(self, features: FloatArray) -> float:
        """L = lambda_max(A^T A / n) (the same for every output column)."""
        return float(np.linalg.eigvalsh(features.T @ features / len(features))[-1])

    def per_sample_grads(self, x: FloatArray, features: FloatArray, targets: NDArray[np.floating]) -> FloatArray:
        """Row j: (a_j^T x - c_j) a_j, the gradient of record j's (1/2)(a_j^T x - c_j)^2 (with C outputs the outer
        product a_j (x^T a_j - c_j)^T, flattened row-major)."""
        r = self._residuals(x, features, targets)
        if self.outputs is None:
            return np.asarray(r[:, None] * features, dtype=np.float64)
        return np.asarray(np.einsum("jf,jc->jfc", features, r).reshape(len(r), -1), dtype=np.float64)

    def clipped_grad_sum(self, x: FloatArray, features: FloatArray, targets: NDArray[np.floating], clip: float) -> FloatArray:
        """A^T (f * r), f_j = min(1, C / (||r_j|| ||a_j||)): the clipped rows summed without forming them (record
        j's gradient is the outer product a_j r_j^T, whose norm is ||a_j|| ||r_j||)."""
        r = self._residuals(x, features, targets)
        rn = np.abs(r) if self.outputs is None else np.linalg.norm(r, axis=1)
        norms = rn * np.linalg.norm(features, axis=1)
        f = np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))
        scaled = f * r if self.outputs is None else f[:, None] * r
        return np.asarray(features.T @ scaled, dtype=np.float64).reshape(-1)
