"""FEMNIST for seed 002 (Ryu & Kim, Section IV): one agent per LEAF writer, a 5 % sample of the writers.

Online only: :func:`load_femnist` downloads ``flwrlabs/femnist`` through flwr-datasets
(``FederatedDataset`` + ``NaturalIdPartitioner(partition_by="writer_id")``) and loads only the sampled writers.
It cannot run on an offline machine; :func:`femnist_split` (the conversion, testable on any small arrays) is
what turns the raw records into agents and a test set:

* LEAF ``preprocess.sh -s niid --sf 0.05 -k 0 -t sample`` semantics (spec 6.2): sample ``user_fraction`` of the
  writers (seeded; LEAF's own seed is not reproducible, so P and I differ from the paper's 195 / 36 708, spec
  A17), then split every sampled writer's samples ``train_fraction`` : rest into train and test (the test set is
  the union of the writers' test parts);
* pixels to [0, 1] with ink high: the reference code uses ``x = 1 - x_leaf`` because LEAF stores white
  backgrounds (spec A18). ``invert="auto"`` inverts when the mean pixel is above mid-grey (background dominates
  every handwriting image, so this detects the white-background encoding whatever the source), then the
  loaders' bias column is appended as for MNIST (the no-bias model (63) drops it);
* labels 0..61 (10 digits, 26 upper, 26 lower case), K = 62.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from fedapp.data.sources import ArrayDataset, images_to_features

FEMNIST_HF = "flwrlabs/femnist"
FEMNIST_CLASSES = 62


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


def load_femnist(*, user_fraction: float = 0.05, train_fraction: float = 0.9, seed: int = 0,
                 cache_dir: str | None = None) -> FemnistSplit:  # pragma: no cover - needs the network
    """Download ``flwrlabs/femnist`` with flwr-datasets and build the seed-002 split (needs a network).

    Only the sampled writers' partitions are decoded (the full set has 805 263 images in ~3 600 writers).
    """
    os.environ.pop("HF_DATASETS_OFFLINE", None)
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
    return femnist_split(np.stack(images), np.asarray(labels), writers, user_fraction=1.0,
                         train_fraction=train_fraction, seed=seed)
