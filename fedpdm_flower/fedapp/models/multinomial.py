"""Multinomial logistic (softmax) regression over the same flat X in R^{m x n}, with optional l2.

Two variants share this one class:

* ``"multinomial"``: the features as loaded (pixels + the appended bias column);
* ``"multinomial-nobias"``: the model of seed 002 (Ryu & Kim, App. G, eq. (63)): w in R^{J x K} with **no bias**,
  so the loaders' constant last column is dropped (J = 784 for MNIST). Our flat vector stores w^T row-major
  (one row of J weights per class); every DP-IADMM operation except the gradient is element-wise, so the layout
  does not matter there.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.models.base import FloatArray, LinearModel


class MultinomialLogistic(LinearModel):
    """Cross-entropy of softmax(X a) plus (l2/2)||x||^2.

    Parameters
    ----------
    num_classes, num_features
        m and n: n counts the inputs the model uses (the bias column included unless ``bias`` is False).
    l2
        Ridge weight; 0 gives plain softmax regression.
    bias
        False drops the loaders' constant last feature column (seed 002's model (63), "multinomial-nobias").
        Feature matrices with exactly ``num_features`` columns are used as they are.
    """

    name = "multinomial"

    def __init__(self, num_classes: int, num_features: int, l2: float = 0.0, *, bias: bool = True) -> None:
        super().__init__(num_classes, num_features)
        if l2 < 0:
            raise ValueError(f"l2 must be >= 0, got {l2}")
        self.l2 = l2
        self.bias = bias
        if not bias:
            self.name = "multinomial-nobias"

    def inputs(self, features: FloatArray) -> FloatArray:
        """The columns the model reads: all of them, or all but the bias column for the no-bias variant."""
        if not self.bias and features.shape[1] == self.num_features + 1:
            return features[:, : self.num_features]
        if features.shape[1] != self.num_features:
            raise ValueError(f"features have {features.shape[1]} columns, model {self.name} expects {self.num_features}")
        return features

    def scores(self, x: FloatArray, features: FloatArray) -> FloatArray:
        return self.inputs(features) @ self.matrix(x).T

    def probs(self, x: FloatArray, features: FloatArray) -> FloatArray:
        """Row-wise softmax h(x; a_i) of the scores (max-subtracted for stability, spec 6.1)."""
        z = self.scores(x, features)
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return np.asarray(e / e.sum(axis=1, keepdims=True), dtype=np.float64)

    def loss(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> float:
        p = self.probs(x, features)
        ce = -np.mean(np.log(np.clip(p[np.arange(len(labels)), labels], 1e-300, None)))
        return float(ce + 0.5 * self.l2 * np.dot(x, x))

    def grad(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> FloatArray:
        p = self.probs(x, features)
        p[np.arange(len(labels)), labels] -= 1.0
        g = (p.T @ self.inputs(features)) / len(labels)
        return np.asarray(g.ravel() + self.l2 * x, dtype=np.float64)

    # ------------------------------------------------------------------ per-record gradients (DP-SGD)
    def _residuals(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> tuple[FloatArray, FloatArray]:
        """(P - E, A): softmax minus one-hot, and the inputs; record j's data gradient is the outer product
        (p_j - e_{y_j}) a_j^T, whose Frobenius norm is ||p_j - e_{y_j}|| ||a_j||."""
        p = self.probs(x, features)
        p[np.arange(len(labels)), labels] -= 1.0
        return p, self.inputs(features)

    def per_sample_grads(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> FloatArray:
        """Row j: the gradient of record j's cross-entropy, vec((p_j - e_{y_j}) a_j^T) (the l2 term is not a record's)."""
        r, a = self._residuals(x, features, labels)
        return np.asarray(np.einsum("jc,jf->jcf", r, a).reshape(len(labels), -1), dtype=np.float64)

    def clipped_grad_sum(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64], clip: float) -> FloatArray:
        """sum_j min(1, C / ||g_j||) g_j in closed form: (f * (P - E))^T A, f_j = min(1, C / (||p_j - e_j|| ||a_j||))."""
        r, a = self._residuals(x, features, labels)
        norms = np.linalg.norm(r, axis=1) * np.linalg.norm(a, axis=1)
        f = np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))
        return np.asarray(((r * f[:, None]).T @ a).ravel(), dtype=np.float64)

    def regularizer_grad(self, x: FloatArray) -> FloatArray:
        """l2 x: the gradient of the data-independent (l2 / 2)||x||^2."""
        return np.asarray(self.l2 * x, dtype=np.float64)
