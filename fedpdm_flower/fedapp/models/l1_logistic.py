"""The non-convex "logistic" model of DP-FedPDM's experiments (Li et al., arXiv 2310.19558, eqs. 40-42).

f_i(X) = (1/|D_i|) sum_j ln(1 + exp(-Tr(X Y_ij))) + beta * sum_{jk} X_jk^2 / (1 + X_jk^2)      (41)

with Y_ij = a_ij b_ij^T and b_ij one-hot, so Tr(X Y_ij) = x_c^T a_ij for the true class c: the data term only
touches the true-class row and pulls it towards the class centroid (spec A19). The l1 term gamma*||X||_1 of (40)
is not part of f_i: it is h, handled by the server's prox (12).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.models.base import FloatArray, LinearModel


def softplus(z: FloatArray) -> FloatArray:
    """ln(1 + e^z), computed stably as max(z, 0) + log1p(e^{-|z|})."""
    return np.asarray(np.maximum(z, 0.0) + np.log1p(np.exp(-np.abs(z))), dtype=np.float64)


class NonconvexL1Logistic(LinearModel):
    """Eq. (41) loss with the non-convex smooth regulariser weighted by beta.

    Parameters
    ----------
    num_classes, num_features
        m and n of X in R^{m x n} (MNIST: 10 x 785, bias included).
    beta
        Weight of sum X^2/(1+X^2); larger beta = more non-convex (paper default 0.5).
    """

    name = "l1-logistic"

    def __init__(self, num_classes: int, num_features: int, beta: float = 0.5) -> None:
        super().__init__(num_classes, num_features)
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        self.beta = beta

    def _true_scores(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> FloatArray:
        rows = self.matrix(x)[labels]  # x_c for every sample
        return np.asarray(np.einsum("ij,ij->i", rows, features), dtype=np.float64)

    def data_loss(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> float:
        """Mean of ln(1 + exp(-x_c^T a)) over the samples: the data term of (41)."""
        return float(np.mean(softplus(-self._true_scores(x, features, labels))))

    def regulariser(self, x: FloatArray) -> float:
        """beta * sum x^2/(1+x^2), the non-convex smooth term of (41)."""
        return float(self.beta * np.sum(x * x / (1.0 + x * x)))

    def loss(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> float:
        return self.data_loss(x, features, labels) + self.regulariser(x)

    def grad(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> FloatArray:
        """coef_j = -sigmoid(-s_j) on row c_j, averaged; plus beta * 2x/(1+x^2)^2 (spec 6.1)."""
        s = self._true_scores(x, features, labels)
        coef = -0.5 * (1.0 - np.tanh(0.5 * s))  # -sigmoid(-s), overflow-free
        g = np.zeros((self.num_classes, self.num_features))
        np.add.at(g, labels, coef[:, None] * features)
        g /= len(labels)
        out = g.ravel()
        if self.beta:
            out += self.beta * 2.0 * x / (1.0 + x * x) ** 2
        return out

    # ------------------------------------------------------------------ per-record gradients (DP-SGD)
    def _coefs(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> FloatArray:
        """coef_j = -sigmoid(-s_j): record j's data gradient is coef_j a_j on row c_j, zero elsewhere."""
        return np.asarray(-0.5 * (1.0 - np.tanh(0.5 * self._true_scores(x, features, labels))), dtype=np.float64)

    def per_sample_grads(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> FloatArray:
        """Row j: the gradient of record j's term ln(1 + exp(-x_c^T a_j)) of (41): coef_j a_j on row c_j."""
        coef = self._coefs(x, features, labels)
        out = np.zeros((len(labels), self.num_classes, self.num_features))
        out[np.arange(len(labels)), labels] = coef[:, None] * features
        return out.reshape(len(labels), -1)

    def clipped_grad_sum(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64], clip: float) -> FloatArray:
        """sum_j min(1, C / ||g_j||) g_j in closed form: ||g_j|| = |coef_j| ||a_j|| (one row is non-zero)."""
        coef = self._coefs(x, features, labels)
        norms = np.abs(coef) * np.linalg.norm(features, axis=1)
        f = np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))
        g = np.zeros((self.num_classes, self.num_features))
        np.add.at(g, labels, (f * coef)[:, None] * features)
        return g.ravel()

    def regularizer_grad(self, x: FloatArray) -> FloatArray:
        """beta 2x / (1 + x^2)^2: the gradient of (41)'s data-independent regulariser."""
        return np.asarray(self.beta * 2.0 * x / (1.0 + x * x) ** 2, dtype=np.float64)
