"""Multinomial logistic (softmax) regression over the same flat X in R^{m x n}, with optional l2."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from fedapp.models.base import FloatArray, LinearModel


class MultinomialLogistic(LinearModel):
    """Cross-entropy of softmax(X a) plus (l2/2)||x||^2.

    Parameters
    ----------
    num_classes, num_features
        m and n (bias column included in the features).
    l2
        Ridge weight; 0 gives plain softmax regression.
    """

    name = "multinomial"

    def __init__(self, num_classes: int, num_features: int, l2: float = 0.0) -> None:
        super().__init__(num_classes, num_features)
        if l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {l2}")
        self.l2 = l2

    def _probs(self, x: FloatArray, features: FloatArray) -> FloatArray:
        z = self.scores(x, features)
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return np.asarray(e / e.sum(axis=1, keepdims=True), dtype=np.float64)

    def loss(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> float:
        p = self._probs(x, features)
        ce = -np.mean(np.log(np.clip(p[np.arange(len(labels)), labels], 1e-300, None)))
        return float(ce + 0.5 * self.l2 * np.dot(x, x))

    def grad(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> FloatArray:
        p = self._probs(x, features)
        p[np.arange(len(labels)), labels] -= 1.0
        g = (p.T @ features) / len(labels)
        return np.asarray(g.ravel() + self.l2 * x, dtype=np.float64)
