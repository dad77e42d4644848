"""Common interface of the numpy models: a flat parameter vector x = vec_row_major(X), X in R^{m x n}."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]


class SmoothObjective(Protocol):
    """Anything with a mini-batch gradient of the smooth local loss f_i: what the local solvers need."""

    def grad(self, x: FloatArray, features: FloatArray, targets: NDArray[Any]) -> FloatArray:
        """Gradient of f_i at x on the given samples."""
        ...


class LinearModel(ABC):
    """A linear classifier X in R^{m x n} (one row per class) stored flat, row-major, d = m*n.

    Parameters
    ----------
    num_classes
        m, the number of classes (rows of X).
    num_features
        n, the number of input features including the bias column the data loaders append.
    """

    name: str = "linear"

    def __init__(self, num_classes: int, num_features: int) -> None:
        if num_classes < 2 or num_features < 1:
            raise ValueError(f"need num_classes >= 2 and num_features >= 1, got {num_classes}, {num_features}")
        self.num_classes = num_classes
        self.num_features = num_features

    @property
    def dim(self) -> int:
        """d = m*n, the length of the flat parameter vector."""
        return self.num_classes * self.num_features

    def matrix(self, x: FloatArray) -> FloatArray:
        """View the flat vector x as X (m x n), row-major."""
        if x.shape != (self.dim,):
            raise ValueError(f"parameter vector has shape {x.shape}, expected ({self.dim},)")
        return x.reshape(self.num_classes, self.num_features)

    def scores(self, x: FloatArray, features: FloatArray) -> FloatArray:
        """Class scores X a for every sample (rows of `features`)."""
        return features @ self.matrix(x).T

    def predict(self, x: FloatArray, features: FloatArray) -> NDArray[np.int64]:
        """argmax_k x_k^T a (eq. 42: the softmax is monotone, so its argmax is the score argmax)."""
        return np.asarray(np.argmax(self.scores(x, features), axis=1), dtype=np.int64)

    def accuracy(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> float:
        """Fraction of samples whose predicted class equals the label."""
        return float(np.mean(self.predict(x, features) == labels))

    @abstractmethod
    def loss(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> float:
        """Smooth part of the local objective f_i on the given samples."""

    @abstractmethod
    def grad(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> FloatArray:
        """Gradient of `loss` with respect to the flat x."""

    @abstractmethod
    def per_sample_grads(self, x: FloatArray, features: FloatArray, labels: NDArray[np.int64]) -> FloatArray:
        """(B, d): row j is the gradient of record j's data term at x (record-level DP-SGD clips each row;
        :mod:`fedpdm_flower.fedapp.privacy.dpsgd`). ``grad`` is their mean plus ``regularizer_grad(x)``."""

    def regularizer_grad(self, x: FloatArray) -> FloatArray:
        """The gradient of the part of `loss` that does not depend on the data (none by default)."""
        return np.zeros_like(x)

    def init(self, rng: np.random.Generator, std: float) -> FloatArray:
        """Random initial point, i.i.d. N(0, std^2) per entry (spec A9)."""
        return rng.normal(0.0, std, size=self.dim)


#: the torch model zoo: model key -> (constructor(num_classes) -> module, expected input shape without the batch
#: dimension). Here, not in :mod:`fedpdm_flower.fedapp.models.torch_net`, so that asking whether a run trains a torch
#: network does not import torch (a numpy run's server and devices never do)
TORCH_MODELS: dict[str, tuple[str, tuple[int, ...]]] = {
    "tiny-cnn": ("fedpdm_flower.fedapp.models.cnn:TinyCNN", (1, 28, 28)),
    "lenet5": ("fedpdm_flower.fedapp.models.cnn:LeNet5", (1, 28, 28)),
    "lenet5-valid": ("fedpdm_flower.fedapp.models.cnn:LeNet5Valid", (1, 28, 28)),
    "cnn": ("fedpdm_flower.fedapp.models.cnn:SmallCNN", (1, 28, 28)),
    "resnet20": ("fedpdm_flower.fedapp.models.resnet:ResNet20", (3, 32, 32)),
    "softmax-nobias": ("fedpdm_flower.fedapp.models.cnn:SoftmaxRegression", (1, 28, 28)),
}


def make_model(name: str, num_classes: int, num_features: int, *, beta: float = 0.0) -> LinearModel:
    """Build a numpy model by name: "l1-logistic" (eqs. 40-42), "multinomial" (softmax regression) or
    "multinomial-nobias" (seed 002's eq. (63): softmax regression without the bias column; ``num_features`` counts
    the loaded columns, bias included, and the model uses ``num_features - 1`` of them)."""
    from fedpdm_flower.fedapp.models.l1_logistic import NonconvexL1Logistic
    from fedpdm_flower.fedapp.models.multinomial import MultinomialLogistic

    if name == "l1-logistic":
        return NonconvexL1Logistic(num_classes, num_features, beta=beta)
    if name == "multinomial":
        return MultinomialLogistic(num_classes, num_features, l2=beta)
    if name == "multinomial-nobias":
        return MultinomialLogistic(num_classes, num_features - 1, l2=beta, bias=False)
    raise ValueError(f"unknown model {name!r}; valid: 'l1-logistic', 'multinomial', 'multinomial-nobias'")
