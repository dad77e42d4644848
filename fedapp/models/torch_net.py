"""A torch network behind the flat-vector interface of the numpy models.

Federated algorithms here move one flat parameter vector w in R^d (ConSpar sparsifies it coordinate-wise, the
robust aggregators and the secure sum treat it as a vector). :class:`TorchNet` packs a torch module's state into
such a vector and back, so the server's central evaluation (:class:`fedapp.task.Evaluator`) and the clients use
it exactly like a :class:`fedapp.models.base.LinearModel`.

What is in w [spec fedrep.md 11.2, our reading]: every trainable parameter, then every floating-point buffer
(BatchNorm running mean / variance; ``num_batches_tracked`` is an integer and stays local). BN statistics thus
travel through the same pipeline as weights (update = difference, sparsified, securely and robustly aggregated),
which keeps them private and robust too; ConSpar's budget K is computed from the trainable count (``num_trainable``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from fedapp.models.base import FloatArray

#: model key -> (constructor(num_classes) -> module, expected input shape without the batch dimension)
TORCH_MODELS: dict[str, tuple[str, tuple[int, ...]]] = {
    "lenet5": ("fedapp.models.cnn:LeNet5", (1, 28, 28)),
    "lenet5-valid": ("fedapp.models.cnn:LeNet5Valid", (1, 28, 28)),
    "cnn": ("fedapp.models.cnn:SmallCNN", (1, 28, 28)),
    "resnet20": ("fedapp.models.resnet:ResNet20", (3, 32, 32)),
}


def _constructor(path: str) -> Callable[..., nn.Module]:
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


class TorchNet:
    """A torch classifier seen as a flat vector w (float32 values held in float64 arrays).

    Parameters
    ----------
    name
        Key of :data:`TORCH_MODELS` ("lenet5", "cnn", "resnet20").
    num_classes
        Output classes.
    num_features
        Columns of the dataset's feature matrix (pixels, plus the bias column the loaders append, which is
        dropped): must hold the model's input shape.
    eval_batch
        Batch size of :meth:`accuracy` / :meth:`loss` (default 1000).
    """

    def __init__(self, name: str, num_classes: int, num_features: int, *, eval_batch: int = 1000) -> None:
        if name not in TORCH_MODELS:
            raise ValueError(f"unknown torch model {name!r}; valid: {', '.join(TORCH_MODELS)}")
        path, shape = TORCH_MODELS[name]
        pixels = int(np.prod(shape))
        if num_features not in (pixels, pixels + 1):
            raise ValueError(f"model {name!r} takes {pixels} input features (+1 bias column), the data has {num_features}")
        self.name = name
        self.num_classes = num_classes
        self.input_shape = shape
        self.eval_batch = eval_batch
        self.module = _constructor(path)(num_classes=num_classes)
        self._tensors = list(self.module.parameters()) + [
            b for b in self.module.buffers() if torch.is_floating_point(b)
        ]
        self.num_trainable = sum(p.numel() for p in self.module.parameters())
        self._dim = sum(t.numel() for t in self._tensors)

    @property
    def dim(self) -> int:
        """d: trainable parameters plus floating-point buffers."""
        return self._dim

    # ------------------------------------------------------------------ flat vector <-> module
    def get_flat(self) -> FloatArray:
        """The module's current state as w (float64 copy of the float32 values)."""
        with torch.no_grad():
            return torch.cat([t.detach().reshape(-1) for t in self._tensors]).double().numpy()

    def set_flat(self, w: NDArray[Any]) -> None:
        """Load w into the module (cast to float32)."""
        if w.shape != (self.dim,):
            raise ValueError(f"parameter vector has shape {w.shape}, expected ({self.dim},)")
        src = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        with torch.no_grad():
            off = 0
            for t in self._tensors:
                n = t.numel()
                t.copy_(src[off:off + n].view_as(t))
                off += n

    def trainable_slice(self) -> slice:
        """Where the trainable parameters sit in w (first), the buffers follow."""
        return slice(0, self.num_trainable)

    def init(self, rng: np.random.Generator, std: float = 0.0) -> FloatArray:
        """torch's default initialisation of the module, seeded from ``rng`` (``std`` is unused)."""
        torch.manual_seed(int(rng.integers(0, 2**31 - 1)))
        for m in self.module.modules():
            reset = getattr(m, "reset_parameters", None)
            if m is not self.module and callable(reset):
                reset()
        return self.get_flat()

    # ------------------------------------------------------------------ data
    def inputs(self, features: NDArray[Any]) -> torch.Tensor:
        """(B, C, H, W) float32 tensor from loader features (bias column dropped)."""
        pixels = int(np.prod(self.input_shape))
        x = np.ascontiguousarray(features[:, :pixels], dtype=np.float32)
        return torch.from_numpy(x).view(-1, *self.input_shape)

    # ------------------------------------------------------------------ training primitives
    def batch_gradient(self, features: NDArray[Any], labels: NDArray[Any]) -> tuple[torch.Tensor, float]:
        """Flat gradient of the mean cross-entropy over the trainable parameters at the module's current weights
        (train mode: BN uses batch statistics and updates its running buffers), and the batch loss."""
        self.module.train()
        self.module.zero_grad(set_to_none=True)
        out = self.module(self.inputs(features))
        loss = nn.functional.cross_entropy(out, torch.from_numpy(np.array(labels, dtype=np.int64)))
        loss.backward()  # type: ignore[no-untyped-call]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.module.parameters()]
        return torch.cat([g.reshape(-1) for g in grads]), float(loss.item())

    def add_to_trainable(self, delta: torch.Tensor) -> None:
        """w_trainable += delta (in place, float32)."""
        with torch.no_grad():
            off = 0
            for p in self.module.parameters():
                n = p.numel()
                p.add_(delta[off:off + n].view_as(p))
                off += n

    # ------------------------------------------------------------------ evaluation (LinearModel interface)
    def _logits(self, w: FloatArray, features: NDArray[Any]) -> torch.Tensor:
        self.set_flat(w)
        self.module.eval()
        with torch.no_grad():
            x = self.inputs(features)
            return torch.cat([self.module(x[i:i + self.eval_batch]) for i in range(0, len(x), self.eval_batch)])

    def accuracy(self, w: FloatArray, features: NDArray[Any], labels: NDArray[Any]) -> float:
        """Top-1 accuracy of w (eval mode: BN uses the running statistics carried in w)."""
        pred = self._logits(w, features).argmax(dim=1).numpy()
        return float(np.mean(pred == labels))

    def loss(self, w: FloatArray, features: NDArray[Any], labels: NDArray[Any]) -> float:
        """Mean cross-entropy of w."""
        logits = self._logits(w, features)
        return float(nn.functional.cross_entropy(logits, torch.from_numpy(np.array(labels, dtype=np.int64))))

    def evaluate(self, w: FloatArray, features: NDArray[Any], labels: NDArray[Any]) -> tuple[float, float]:
        """(accuracy, loss) with one forward pass."""
        logits = self._logits(w, features)
        y = torch.from_numpy(np.array(labels, dtype=np.int64))
        return float((logits.argmax(dim=1) == y).double().mean()), float(nn.functional.cross_entropy(logits, y))
