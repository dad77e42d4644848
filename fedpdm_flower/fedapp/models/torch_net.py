"""The reproduction's torch model zoo (LeNet-5, the FedAvg CNN, ResNet-20) behind the flat-vector interface.

Federated algorithms here move one flat parameter vector w in R^d (ConSpar sparsifies it coordinate-wise, the
robust aggregators and the secure sum treat it as a vector). :class:`TorchNet` is a
:class:`fedpdm_flower.fedapp.models.torch_model.TorchModel` (the adapter every user module gets) built from a zoo key, so the
server's central evaluation (:class:`fedpdm_flower.fedapp.task.Evaluator`) and the clients use it exactly like a
:class:`fedpdm_flower.fedapp.models.base.LinearModel`.

What is in w [spec fedrep.md 11.2, our reading]: every floating-point entry of the module's state dict, in its
order -- the trainable parameters and the floating-point buffers (BatchNorm running mean / variance;
``num_batches_tracked`` is an integer and stays local). BN statistics thus travel through the same secure and robust
pipeline as weights, which keeps them private and robust too -- but FedREP sends their coordinates every round and
keeps no error memory on them (:func:`fedpdm_flower.fedapp.algorithms.fedrep.buffer_indices`); ConSpar's budget K is
computed from the trainable count (``num_trainable``). For a network without buffers
(LeNet-5, the CNN) the state-dict order is the order of ``parameters()``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fedpdm_flower.fedapp.models.base import TORCH_MODELS
from fedpdm_flower.fedapp.models.torch_model import TorchModel

__all__ = ["TORCH_MODELS", "TorchNet"]

def _constructor(path: str) -> Callable[..., nn.Module]:
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


class TorchNet(TorchModel):
    """A network of the reproduction's model zoo behind :class:`fedpdm_flower.fedapp.models.torch_model.TorchModel`.

    The datasets of the reproduction app hold flat float64 features with a trailing bias column; the input
    transform drops the bias column and reshapes to the network's input shape. Everything else (the flat-vector
    layout in state-dict order, gradients, evaluation) is the generic adapter's, the same one a user's own
    ``nn.Module`` gets.

    Parameters
    ----------
    name
        Key of :data:`TORCH_MODELS` ("lenet5", "lenet5-valid", "cnn", "resnet20").
    num_classes
        Output classes.
    num_features
        Columns of the dataset's feature matrix (pixels, plus the bias column the loaders append, which is
        dropped): must hold the model's input shape.
    eval_batch
        Batch size of :meth:`accuracy` / :meth:`loss` (default 1000).
    buffers
        Where the floating-point buffers live (:class:`~fedpdm_flower.fedapp.models.torch_model.TorchModel`); default
        ``"in-vector"``: in w, the reproduction's reading of spec fedrep.md 11.2 (module docstring). Only ResNet-20
        has buffers, and only FedREP trains it here.
    """

    def __init__(self, name: str, num_classes: int, num_features: int, *, eval_batch: int = 1000,
                 buffers: str = "in-vector") -> None:
        if name not in TORCH_MODELS:
            raise ValueError(f"unknown torch model {name!r}; valid: {', '.join(TORCH_MODELS)}")
        path, shape = TORCH_MODELS[name]
        pixels = int(np.prod(shape))
        if num_features not in (pixels, pixels + 1):
            raise ValueError(f"model {name!r} takes {pixels} input features (+1 bias column), the data has {num_features}")
        self.name = name
        self.num_classes = num_classes
        self.input_shape = shape

        def to_images(x: torch.Tensor) -> torch.Tensor:
            return x[:, :pixels].reshape(-1, *shape)

        super().__init__(_constructor(path)(num_classes=num_classes), nn.CrossEntropyLoss(), eval_batch=eval_batch,
                         input_transform=to_images, buffers=buffers)
