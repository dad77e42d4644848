"""A client's local data as the local solvers see it: ``len(data)`` samples and ``data.batch(indices)``.

The papers' local loops draw mini-batches by index (FedPDM: consecutive slices of one permutation of D_i per
round, so that q = Q b / |D_i| is the sampling rate the privacy analysis uses; FedREP: a cursor over shuffled
passes), so the solvers ask for the samples at given indices rather than iterating a loader. Two kinds of data
satisfy that:

* :class:`ArrayData`: numpy (or torch) arrays ``x`` and ``y`` with one row per sample; ``batch(idx)`` is
  ``(x[idx], y[idx])`` -- exactly what the numpy models of the papers consume;
* :class:`TorchData`: a map-style ``torch.utils.data.Dataset`` (or the ``DataLoader`` a Flower user already has,
  whose ``dataset`` and ``batch_size`` are taken; its own sampler is not used, because the algorithm defines the
  sampling). A ``TensorDataset`` is indexed in one operation; any other dataset is read sample by sample and
  collated with ``torch.utils.data.default_collate``. Each sample must be an ``(input, target)`` pair.

No Flower and no dataset registry here: the user's objects come in as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

__all__ = ["ArrayData", "LocalData", "TorchData", "as_local_data"]


@runtime_checkable
class LocalData(Protocol):
    """What the local solvers read: the sample count and the samples at given indices."""

    def __len__(self) -> int:
        """Number of local samples |D_i|."""
        ...

    def batch(self, idx: NDArray[np.int64]) -> tuple[Any, Any]:
        """``(inputs, targets)`` of the samples at ``idx``, in that order."""
        ...


class ArrayData:
    """Samples held as two arrays with one row per sample.

    Parameters
    ----------
    x
        Inputs, shape (n, ...): a numpy array (float features, images) or a torch tensor.
    y
        Targets, shape (n, ...): class labels or regression targets.
    """

    def __init__(self, x: Any, y: Any) -> None:
        if len(x) != len(y):
            raise ValueError(f"inputs have {len(x)} rows but targets have {len(y)}")
        if len(x) == 0:
            raise ValueError("a client needs at least one local sample")
        self.x = x
        self.y = y
        #: the batch size of the user's loader, when there is one (None for arrays)
        self.default_batch_size: int | None = None

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, idx: NDArray[np.int64]) -> tuple[Any, Any]:
        return self.x[idx], self.y[idx]

    def all(self) -> tuple[Any, Any]:
        """Every sample (for evaluation)."""
        return self.x, self.y

    def chunks(self, size: int) -> Iterator[tuple[Any, Any]]:
        """Consecutive chunks of at most ``size`` samples (evaluation without holding every batch at once)."""
        for start in range(0, len(self), size):
            yield self.x[start:start + size], self.y[start:start + size]


class TorchData:
    """A map-style torch ``Dataset`` (or a ``DataLoader``'s dataset) read by index.

    Parameters
    ----------
    source
        A ``torch.utils.data.Dataset`` with ``__len__`` and ``__getitem__`` returning ``(input, target)``, or a
        ``DataLoader`` over one (its ``batch_size`` becomes :attr:`default_batch_size`).
    """

    def __init__(self, source: Any) -> None:
        from torch.utils.data import DataLoader, TensorDataset

        self.default_batch_size: int | None = None
        if isinstance(source, DataLoader):
            self.default_batch_size = source.batch_size
            source = source.dataset
        if not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
            raise TypeError(f"{type(source).__name__} is not a map-style dataset (needs __len__ and __getitem__); "
                            "an IterableDataset cannot be sampled by index: load it into arrays first")
        if len(source) == 0:
            raise ValueError("a client needs at least one local sample")
        self.dataset = source
        self._tensors = source.tensors if isinstance(source, TensorDataset) else None
        if self._tensors is not None and len(self._tensors) < 2:
            raise ValueError("a TensorDataset for training needs (inputs, targets) tensors")

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, idx: NDArray[np.int64]) -> tuple[Any, Any]:
        import torch
        from torch.utils.data import default_collate

        if self._tensors is not None:
            ix = torch.as_tensor(np.asarray(idx, dtype=np.int64))
            return self._tensors[0][ix], self._tensors[1][ix]
        items = [self.dataset[int(i)] for i in idx]
        if not all(isinstance(it, tuple | list) and len(it) >= 2 for it in items):
            raise ValueError("each sample of the dataset must be an (input, target) pair")
        inputs, targets = default_collate([(it[0], it[1]) for it in items])
        return inputs, targets

    def all(self) -> tuple[Any, Any]:
        """Every sample (for evaluation)."""
        return self.batch(np.arange(len(self), dtype=np.int64))

    def chunks(self, size: int) -> Iterator[tuple[Any, Any]]:
        """Consecutive chunks of at most ``size`` samples."""
        for start in range(0, len(self), size):
            yield self.batch(np.arange(start, min(start + size, len(self)), dtype=np.int64))


def as_local_data(data: Any, targets: Any = None) -> ArrayData | TorchData:
    """The user's data as :class:`LocalData`.

    Accepts ``(x, y)`` arrays (as a pair, or ``data=x, targets=y``), any object with ``x`` and ``y`` array
    attributes, a torch ``Dataset`` or ``DataLoader``, or an :class:`ArrayData` / :class:`TorchData` already.
    """
    if isinstance(data, ArrayData | TorchData):
        return data
    if targets is not None:
        return ArrayData(data, targets)
    if isinstance(data, tuple) and len(data) == 2:
        return ArrayData(*data)
    if hasattr(data, "x") and hasattr(data, "y") and not hasattr(data, "__getitem__"):
        return ArrayData(data.x, data.y)
    try:
        import torch.utils.data as tud
    except ImportError:  # a numpy-only device
        tud = None  # type: ignore[assignment]
    if tud is not None and isinstance(data, tud.DataLoader | tud.Dataset):
        return TorchData(data)
    raise TypeError(f"cannot use {type(data).__name__} as local data: pass (x, y) arrays, an object with x and y "
                    "arrays, or a torch Dataset / DataLoader of (input, target) pairs")
