"""FEMNIST for seed 002 (Ryu & Kim, Section IV): one agent per LEAF writer, a 5 % sample of the writers.

Online only (run config ``dataset=femnist data-source=online``): :func:`fetch_femnist` downloads
``flwrlabs/femnist`` through flwr-datasets (``FederatedDataset`` + ``NaturalIdPartitioner(partition_by="writer_id")``)
and decodes only the sampled writers. It cannot run on an offline machine; :func:`femnist_split` (the conversion,
testable on any small arrays) is what turns the raw records into agents and a test set:

* LEAF ``preprocess.sh -s niid --sf 0.05 -k 0 -t sample`` semantics (spec 6.2): sample ``user_fraction`` of the
  writers (seeded; LEAF's own seed is not reproducible, so P and I differ from the paper's 195 / 36 708, spec
  A17), then split every sampled writer's samples ``train_fraction`` : rest into train and test (the test set is
  the union of the writers' test parts);
* pixels to [0, 1] with ink high: the reference code uses ``x = 1 - x_leaf`` because LEAF stores white
  backgrounds (spec A18). ``invert="auto"`` inverts when the mean pixel is above mid-grey (background dominates
  every handwriting image, so this detects the white-background encoding whatever the source), then the
  loaders' bias column is appended as for MNIST (the no-bias model (63) drops it);
* labels 0..61 (10 digits, 26 upper, 26 lower case), K = 62.

As a run-config dataset (:func:`load_femnist_dataset`, called by :func:`fedpdm_flower.fedapp.data.load_dataset`) the sample is
fixed: ``FEMNIST_USER_FRACTION`` of the writers drawn with ``FEMNIST_SAMPLE_SEED`` (LEAF's ``--sf 0.05``, about
180 writers), train fraction 0.9. The train set is the union of the sampled writers' train parts with
``groups`` = the writer's index (0 .. P-1, writer ids sorted), which ``partitioner=writer`` maps onto clients
(:func:`fedpdm_flower.fedapp.data.partition.writer_partition`); the test set is the union of their test parts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.data.sources import ArrayDataset, DatasetInfo, images_to_features

FEMNIST_HF = "flwrlabs/femnist"
FEMNIST_CLASSES = 62
#: the run-config dataset: LEAF ``--sf 0.05 --tf 0.9``, writers sampled with this seed (the run's ``seed`` only
#: decides which sampled writers become clients when ``num-clients`` is smaller than the sample)
FEMNIST_USER_FRACTION = 0.05
FEMNIST_TRAIN_FRACTION = 0.9
FEMNIST_SAMPLE_SEED = 0


@dataclass(frozen=True)
class FemnistSplit:
    """Agents (one per sampled writer, in writer-id order), the pooled test set, and the writer ids."""

    agents: list[ArrayDataset]
    test: ArrayDataset
    writers: list[str]

    @property
    def total(self) -> int:
        """I, the number of training samples over all agents."""
        return sum(len(a) for a in self.agents)


def sample_writers(writers: Sequence[str], user_fraction: float, seed: int) -> list[str]:
    """The seeded ``user_fraction`` sample of the distinct writer ids (at least one), sorted."""
    if not 0 < user_fraction <= 1:
        raise ValueError(f"user_fraction must be in (0, 1], got {user_fraction}")
    ids = sorted(set(writers))
    k = max(1, round(user_fraction * len(ids)))
    pick = np.random.default_rng(seed).choice(len(ids), size=k, replace=False)
    return sorted(ids[int(i)] for i in pick)


def to_ink_high(images: NDArray[np.uint8], invert: bool | str = "auto") -> NDArray[np.uint8]:
    """Return images with ink high and background 0: ``255 - x`` when ``invert`` (or, for "auto", when the mean
    pixel is above 127.5, i.e. a white background)."""
    if invert == "auto":
        invert = bool(images.mean() > 127.5)
    return (255 - images).astype(np.uint8) if invert else images


def femnist_split(images: NDArray[np.uint8], labels: NDArray[np.integer], writers: Sequence[str], *,
                  user_fraction: float = 0.05, train_fraction: float = 0.9, seed: int = 0,
                  invert: bool | str = "auto") -> FemnistSplit:
    """Sample writers, split each writer's samples into train / test, and convert to ArrayDatasets.

    Parameters
    ----------
    images
        uint8 array (n, 28, 28).
    labels
        Class ids 0..61, shape (n,).
    writers
        Writer id of every sample.
    user_fraction, train_fraction, seed
        LEAF's ``--sf``, ``--tf`` and our sampling seed; each writer keeps ``max(1, floor(train_fraction n_w))``
        samples for training (in a seeded shuffled order) and the rest for testing.
    invert
        See :func:`to_ink_high`.
    """
    if images.dtype != np.uint8 or images.ndim != 3 or len(images) != len(labels) or len(labels) != len(writers):
        raise ValueError("need uint8 images (n, h, w) with one label and one writer id per image")
    y = np.asarray(labels, dtype=np.int64)
    if y.size and (y.min() < 0 or y.max() >= FEMNIST_CLASSES):
        raise ValueError(f"labels must be in [0, {FEMNIST_CLASSES})")
    x = images_to_features(to_ink_high(images, invert))
    rng = np.random.default_rng([seed, 1])
    w = np.asarray(writers)
    chosen = sample_writers(list(writers), user_fraction, seed)
    agents, test_idx = [], []
    for writer in chosen:
        idx = rng.permutation(np.flatnonzero(w == writer))
        n_train = max(1, math.floor(train_fraction * len(idx)))
        tr = np.sort(idx[:n_train])
        agents.append(ArrayDataset(x=x[tr], y=y[tr]))
        test_idx.append(idx[n_train:])
    te = np.sort(np.concatenate(test_idx)) if test_idx else np.zeros(0, dtype=np.int64)
    return FemnistSplit(agents=agents, test=ArrayDataset(x=x[te], y=y[te]), writers=chosen)


def _allow_network() -> None:
    """Lift the Hugging Face offline switches for this download (the project sets them so nothing else downloads).

    The environment variables are read when ``datasets`` / ``huggingface_hub`` are imported, so already imported
    modules get their flags cleared as well.
    """
    import sys

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.pop(var, None)
    for module, flags in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                          ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))):
        if module in sys.modules:
            for flag in flags:
                setattr(sys.modules[module], flag, False)


def fetch_femnist(*, user_fraction: float, seed: int, cache_dir: str | None = None
                  ) -> tuple[NDArray[np.uint8], NDArray[np.int64], list[str]]:
    """Download ``flwrlabs/femnist`` with flwr-datasets and decode the sampled writers (needs a network).

    Returns the raw records (uint8 images (n, 28, 28), labels, writer id per image) of the
    :func:`sample_writers` sample; only those writers' partitions are decoded (the full set has 805 263 images in
    ~3 600 writers).
    """
    _allow_network()
    from flwr_datasets import FederatedDataset
    from flwr_datasets.partitioner import NaturalIdPartitioner

    partitioner = NaturalIdPartitioner(partition_by="writer_id")
    fds = FederatedDataset(dataset=FEMNIST_HF, partitioners={"train": partitioner},
                           **({"cache_dir": cache_dir} if cache_dir else {}))
    fds.load_partition(0)  # assigns the dataset so that the id map exists
    pid_of = {v: k for k, v in partitioner.partition_id_to_natural_id.items()}
    chosen = sample_writers(list(pid_of), user_fraction, seed)
    images: list[NDArray[np.uint8]] = []
    labels: list[int] = []
    writers: list[str] = []
    for writer in chosen:
        part = fds.load_partition(pid_of[writer])
        images += [np.asarray(img.convert("L"), dtype=np.uint8) for img in part["image"]]
        labels += [int(c) for c in part["character"]]
        writers += [writer] * len(part)
    return np.stack(images), np.asarray(labels, dtype=np.int64), writers


def load_femnist(*, user_fraction: float = FEMNIST_USER_FRACTION, train_fraction: float = FEMNIST_TRAIN_FRACTION,
                 seed: int = FEMNIST_SAMPLE_SEED, cache_dir: str | None = None) -> FemnistSplit:
    """Download ``flwrlabs/femnist`` (:func:`fetch_femnist`, needs a network) and build the seed-002 split."""
    images, labels, writers = fetch_femnist(user_fraction=user_fraction, seed=seed, cache_dir=cache_dir)
    return femnist_split(images, labels, writers, user_fraction=1.0, train_fraction=train_fraction, seed=seed)


def femnist_arrays(split: FemnistSplit, source: str) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    """Pool the agents into one train set whose ``groups`` is the writer index (0 .. P-1, ``split.writers`` order)."""
    sizes = [len(a) for a in split.agents]
    train = ArrayDataset(
        x=np.concatenate([a.x for a in split.agents]), y=np.concatenate([a.y for a in split.agents]),
        groups=np.repeat(np.arange(len(sizes), dtype=np.int64), sizes),
    )
    info = DatasetInfo(name="femnist", num_classes=FEMNIST_CLASSES, num_features=train.x.shape[1], source=source)
    return train, split.test, info


def load_femnist_dataset(root: str | None = None) -> tuple[ArrayDataset, ArrayDataset, DatasetInfo]:
    """The run-config dataset ``femnist`` (``data-source=online``): the fixed LEAF-style 5 % writer sample.

    ``root`` is the Hugging Face cache directory (default: the ``datasets`` default).
    """
    split = load_femnist(cache_dir=root)
    source = (f"flwr-datasets FederatedDataset({FEMNIST_HF!r}) + NaturalIdPartitioner('writer_id'): "
              f"{len(split.writers)} writers ({FEMNIST_USER_FRACTION:g} sample, seed {FEMNIST_SAMPLE_SEED}), "
              f"train fraction {FEMNIST_TRAIN_FRACTION:g}")
    return femnist_arrays(split, source)
