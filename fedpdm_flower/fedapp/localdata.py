"""A client's local data as the local solvers see it: ``len(data)`` samples and ``data.batch(indices)``.

The papers' local loops draw mini-batches by index (FedPDM: consecutive slices of one permutation of D_i per
round, so that q = Q b / |D_i| is the sampling rate the privacy analysis uses; FedREP: a cursor over shuffled
passes), so the solvers ask for the samples at given indices rather than iterating a loader. Two kinds of data
satisfy that:

* :class:`ArrayData`: numpy (or torch) arrays ``x`` and ``y`` with one row per sample; ``batch(idx)`` is
  ``(x[idx], y[idx])`` -- exactly what the numpy models of the papers consume;
* :class:`TorchData`: a map-style ``torch.utils.data.Dataset``, or the ``DataLoader`` a Flower user already has:
  its ``dataset``, ``batch_size`` and ``collate_fn`` are used, and its sampler where the algorithm leaves the
  sampling open (below). A ``TensorDataset`` with the default collate is indexed in one operation; any other
  dataset is read sample by sample and collated with the loader's ``collate_fn`` (``default_collate`` without a
  loader). A sample (or a collated batch) is an ``(input, target)`` pair, or a dict such as flwr-datasets' /
  Hugging Face's ``{"img": ..., "label": ...}`` (the keys are found by name, or given with ``keys=``).

**Sampling.** Where an algorithm prescribes how mini-batches are drawn, the loader's sampler is not used: under DP
the privacy analysis rests on the sampling (FedPDM's (36) and the local-SGD baselines' release take q = Q b / |D_i|
from batches drawn without replacement from a uniform permutation, DPQ-DSGD's Theorem 1 from minibatches drawn by
index without replacement), and FedREP keeps a cursor over seeded shuffled passes in the device's state (spec
11.13). Without DP, FedPDM and the local-SGD baselines (FedAvg, FedProx, SCAFFOLD, FedDyn) draw their batches from
one pass of the loader's sampler (:meth:`TorchData.sample_order`, :class:`SampledData`) when it is not a plain
``SequentialSampler`` / ``RandomSampler`` (a ``WeightedRandomSampler``, a ``SubsetRandomSampler``, the user's own):
the round's batches are consecutive slices of a uniform permutation of that pass. ``shuffle`` and the loader's
``num_workers`` / ``pin_memory`` play no part: the algorithm draws the order (from the device's seed), and samples
are read in this process.

No Flower and no dataset registry here: the user's objects come in as they are.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

__all__ = ["ArrayData", "LocalData", "SampledData", "TorchData", "as_local_data"]

#: dict keys tried, in order, for a sample's input and its target when ``keys`` is not given
INPUT_KEYS = ("img", "image", "pixel_values", "x", "features", "input", "inputs")
TARGET_KEYS = ("label", "labels", "target", "targets", "y", "fine_label", "character")


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
        A ``torch.utils.data.Dataset`` with ``__len__`` and ``__getitem__``, or a ``DataLoader`` over one (its
        ``batch_size`` becomes :attr:`default_batch_size`, its ``collate_fn`` collates, its sampler is kept for
        :meth:`sample_order`). A Hugging Face / flwr-datasets ``Dataset`` (``with_transform`` included) is one.
    keys
        ``(input_key, target_key)`` of dict samples, e.g. ``("img", "label")``; None (default) finds them by name
        (inputs: ``img``, ``image``, ``pixel_values``, ``x``, ...; targets: ``label``, ``labels``, ``target``, ``y``,
        ...). Ignored for ``(input, target)`` pairs.
    """

    def __init__(self, source: Any, keys: tuple[str, str] | None = None) -> None:
        from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, TensorDataset, default_collate

        if keys is not None and not (isinstance(keys, tuple | list) and len(keys) == 2
                                     and all(isinstance(k, str) for k in keys)):
            raise ValueError(f"keys must be (input_key, target_key), two strings, got {keys!r}")
        self.keys: tuple[str, str] | None = None if keys is None else (keys[0], keys[1])
        self.default_batch_size: int | None = None
        self.collate: Any = default_collate
        #: the loader's sampler when it is the user's own choice (not a plain sequential / random one), else None
        self.sampler: Any = None
        default_collate_fn = True
        if isinstance(source, DataLoader):
            self.default_batch_size = source.batch_size
            if source.collate_fn is not None and source.collate_fn is not default_collate:
                self.collate, default_collate_fn = source.collate_fn, False
            if source.batch_size is None and source.batch_sampler is not None:  # the user's own batch sampler
                self.sampler = source.batch_sampler
            elif not isinstance(source.sampler, SequentialSampler | RandomSampler):
                self.sampler = source.sampler
            source = source.dataset
        if not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
            raise TypeError(f"{type(source).__name__} is not a map-style dataset (needs __len__ and __getitem__); "
                            "an IterableDataset cannot be sampled by index: load it into arrays first")
        if len(source) == 0:
            raise ValueError("a client needs at least one local sample")
        self.dataset = source
        self._tensors = source.tensors if isinstance(source, TensorDataset) and default_collate_fn else None
        if self._tensors is not None and len(self._tensors) < 2:
            raise ValueError("a TensorDataset for training needs (inputs, targets) tensors")

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, idx: NDArray[np.int64]) -> tuple[Any, Any]:
        if self._tensors is not None:
            import torch

            ix = torch.as_tensor(np.asarray(idx, dtype=np.int64))
            return self._tensors[0][ix], self._tensors[1][ix]
        return self.split(self.collate([self.dataset[int(i)] for i in idx]))

    def split(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, targets)`` of a collated batch: a pair, or a dict read with :attr:`keys`."""
        if isinstance(batch, Mapping):
            ikey, tkey = self.keys if self.keys is not None else _find_keys(batch)
            missing = [k for k in (ikey, tkey) if k not in batch]
            if missing:
                raise ValueError(f"the samples are dicts with keys {sorted(map(str, batch))}, without {missing}: "
                                 "pass keys=(input_key, target_key), e.g. TorchData(loader, keys=('img', 'label'))")
            return batch[ikey], batch[tkey]
        if isinstance(batch, tuple | list) and len(batch) >= 2:
            return batch[0], batch[1]
        raise ValueError(f"each sample must be an (input, target) pair or a dict of them, got {type(batch).__name__}")

    def sample_order(self) -> NDArray[np.int64] | None:
        """One pass of the loader's own sampler (its indices, in its order, with its randomness), or None when the
        loader has none beyond a plain sequential / random one (module docstring, "Sampling")."""
        if self.sampler is None:
            return None
        order = [int(i) for item in self.sampler for i in (item if isinstance(item, list | tuple) else (item,))]
        idx = np.asarray(order, dtype=np.int64)
        if idx.size == 0 or idx.min() < 0 or idx.max() >= len(self):
            raise ValueError(f"the loader's sampler drew {idx.size} indices, not all in [0, {len(self)})")
        return idx

    def all(self) -> tuple[Any, Any]:
        """Every sample (for evaluation)."""
        return self.batch(np.arange(len(self), dtype=np.int64))

    def chunks(self, size: int) -> Iterator[tuple[Any, Any]]:
        """Consecutive chunks of at most ``size`` samples."""
        for start in range(0, len(self), size):
            yield self.batch(np.arange(start, min(start + size, len(self)), dtype=np.int64))


def _find_keys(sample: Mapping[Any, Any]) -> tuple[str, str]:
    """(input key, target key) of a dict sample, by name (:data:`INPUT_KEYS`, :data:`TARGET_KEYS`)."""
    target = next((k for k in TARGET_KEYS if k in sample), None)
    inputs = next((k for k in INPUT_KEYS if k in sample), None)
    if inputs is None and target is not None and len(sample) == 2:
        inputs = next(str(k) for k in sample if k != target)
    if inputs is None or target is None:
        raise ValueError(f"cannot tell the input and the target among the sample's keys {sorted(map(str, sample))}: "
                         "pass keys=(input_key, target_key), e.g. TorchData(loader, keys=('img', 'label'))")
    return inputs, target


class SampledData:
    """A client's data seen through one pass of its loader's sampler: sample j of the view is ``order[j]``.

    The local loops draw batches as consecutive slices of a uniform permutation of ``range(len(view))``, so a
    round's batches are drawn from the sampler's pass (its weights, its subset) in a random order.
    """

    def __init__(self, data: LocalData, order: NDArray[np.int64]) -> None:
        self.data, self.order = data, np.asarray(order, dtype=np.int64)
        self.default_batch_size = getattr(data, "default_batch_size", None)

    def __len__(self) -> int:
        return len(self.order)

    def batch(self, idx: NDArray[np.int64]) -> tuple[Any, Any]:
        return self.data.batch(self.order[np.asarray(idx, dtype=np.int64)])


def as_local_data(data: Any, targets: Any = None, *, keys: tuple[str, str] | None = None) -> ArrayData | TorchData:
    """The user's data as :class:`LocalData`.

    Accepts ``(x, y)`` arrays (as a pair, or ``data=x, targets=y``), any object with ``x`` and ``y`` array
    attributes, a torch ``Dataset`` or ``DataLoader`` (dict samples read with ``keys``, :class:`TorchData`), or an
    :class:`ArrayData` / :class:`TorchData` already.
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
        return TorchData(data, keys=keys)
    if (tud is not None and hasattr(data, "__getitem__") and hasattr(data, "__len__")
            and not isinstance(data, np.ndarray | list | str | bytes | Mapping)):  # map-style, e.g. a Hugging Face Dataset
        return TorchData(data, keys=keys)
    raise TypeError(f"cannot use {type(data).__name__} as local data: pass (x, y) arrays, an object with x and y "
                    "arrays, or a torch Dataset / DataLoader of (input, target) pairs or dict samples")
