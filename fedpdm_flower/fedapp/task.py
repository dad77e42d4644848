"""What a run trains on: the client's data partition, the model, and the server's central evaluation."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedpdm_flower.fedapp.config import ConfigError, RunConfig
from fedpdm_flower.fedapp.data import sources
from fedpdm_flower.fedapp.data.local_files import DATA_PATH_KEY
from fedpdm_flower.fedapp.data.partition import cached_split, load_partition
from fedpdm_flower.fedapp.data.sources import ArrayDataset, DatasetInfo, load_test_split
from fedpdm_flower.fedapp.models.base import TORCH_MODELS, FloatArray, LinearModel, make_model

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.data.local_files import LocalFiles
    from fedpdm_flower.fedapp.models.torch_net import TorchNet


def dataset_info(cfg: RunConfig) -> DatasetInfo:
    """Shape information (classes, features) of the configured dataset (for MNIST, from the files' shape)."""
    return sources.dataset_info(cfg.dataset, source=cfg.data_source)


def client_dataset(cfg: RunConfig, partition_id: int, num_partitions: int) -> ArrayDataset:
    """The partition a client trains on, rebuilt deterministically from (dataset, partitioner, seed)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
    return load_partition(
        cfg.dataset,
        cfg.partitioner,
        partition_id,
        num_partitions,
        cfg.seed,
        source=cfg.data_source,
        labels_per_client=cfg.labels_per_client,
        samples_per_client=cfg.samples_per_client or None,
        dirichlet_alpha=cfg.dirichlet_alpha,
    )


_LOCAL: dict[tuple[str, int, int, str], LocalFiles] = {}


def data_path_of(node_config: Mapping[str, Any]) -> str | None:
    """The node config's ``data-path`` (None when absent or empty: the node cuts its partition by partition-id)."""
    value = node_config.get(DATA_PATH_KEY)
    return str(value) if value not in (None, "") else None


def local_files(cfg: RunConfig, path: str) -> LocalFiles:
    """The device's own files at ``path`` as dataset ``cfg.dataset``, read once per process (keyed by the file's
    size and mtime, so that replaced files are read again). Nothing else is read: no dataset package, no other rows."""
    from fedpdm_flower.fedapp.data.local_files import load_local_files

    try:
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_mtime_ns, st.st_size, cfg.dataset)
    except OSError:
        key = (path, -1, -1, cfg.dataset)  # load_local_files names the missing path
    if key not in _LOCAL:
        if len(_LOCAL) >= 4:
            _LOCAL.clear()
        _LOCAL[key] = lf = load_local_files(path, cfg.dataset)
        logging.getLogger("flwr").info("data-path %s: %d samples", path, len(lf.train))
    return _LOCAL[key]


def node_dataset(cfg: RunConfig, node_config: Mapping[str, Any]) -> tuple[ArrayDataset, DatasetInfo]:
    """The node's training data and the dataset's shape for its model.

    With ``data-path`` in the node config: the device's own files only (:mod:`fedpdm_flower.fedapp.data.local_files`; the
    partition keys of the run config do not apply, they shaped the files). Otherwise partition ``partition-id`` of
    ``num-partitions``, cut from the whole dataset (:func:`client_dataset`).
    """
    path = data_path_of(node_config)
    if path is not None:
        lf = local_files(cfg, path)
        return lf.train, DatasetInfo(name=cfg.dataset, num_classes=lf.num_classes, num_features=lf.num_features,
                                     source=f"node config data-path {path}")
    pid, parts = int(node_config["partition-id"]), int(node_config["num-partitions"])
    return client_dataset(cfg, pid, parts), dataset_info(cfg)


def total_train_samples(cfg: RunConfig) -> int:
    """I = sum of the num-clients partition sizes (every DP-IADMM agent scales its loss by 1/I, spec 9.3)."""
    split = cached_split(
        cfg.dataset, cfg.partitioner, cfg.num_clients, cfg.seed, cfg.data_source,
        labels_per_client=cfg.labels_per_client, samples_per_client=cfg.samples_per_client or None,
        dirichlet_alpha=cfg.dirichlet_alpha,
    )
    return int(split.sizes().sum())


def build_model(cfg: RunConfig, info: DatasetInfo | None = None) -> LinearModel:
    """The numpy model of the run; beta is the non-convexity weight of (41) (or the l2 weight of softmax).

    For the DP-IADMM family the l2 weight is 2 * iadmm-beta, so that the model's loss (mean cross-entropy +
    (l2/2)||w||^2) is the paper's objective (1) on the data it is given.
    """
    from fedpdm_flower.fedapp.apps.iadmm import IADMM_ALGORITHMS

    info = info or dataset_info(cfg)
    beta = 2.0 * cfg.iadmm_beta if cfg.algorithm in IADMM_ALGORITHMS else cfg.beta
    try:
        return make_model(cfg.model, info.num_classes, info.num_features, beta=beta)
    except ValueError as err:  # e.g. a torch network for an algorithm that trains a numpy model
        raise _model_error(cfg, err) from None


def _model_error(cfg: RunConfig, err: ValueError) -> ConfigError:
    return ConfigError(f"run config key 'model' ({cfg.model!r}) does not fit algorithm {cfg.algorithm!r} on dataset "
                       f"{cfg.dataset!r}: {err}")


def build_net(cfg: RunConfig, info: DatasetInfo | None = None) -> TorchNet:
    """The torch network of the run (``model`` is one of :data:`fedpdm_flower.fedapp.models.torch_net.TORCH_MODELS`)."""
    from fedpdm_flower.fedapp.models.torch_net import TorchNet

    info = info or dataset_info(cfg)
    try:
        return TorchNet(cfg.model, info.num_classes, info.num_features)
    except ValueError as err:  # e.g. LeNet-5 (28x28 images) on a dataset of 21 features
        raise _model_error(cfg, err) from None


def is_torch_model(cfg: RunConfig) -> bool:
    """True when the run trains a torch network rather than a numpy linear model."""
    return cfg.model in TORCH_MODELS  # the zoo's names, without importing torch


@dataclass(frozen=True)
class Evaluation:
    """Central evaluation of one global model on the test set."""

    accuracy: float
    loss: float
    nnz: int


class Evaluator:
    """Central test-set evaluation on the server (spec 6.5: accuracy of the global model, test loss, nnz)."""

    def __init__(self, cfg: RunConfig) -> None:
        test, info = load_test_split(cfg.dataset, source=cfg.data_source), dataset_info(cfg)
        self.test = test
        self.model: LinearModel | TorchNet = build_net(cfg, info) if is_torch_model(cfg) else build_model(cfg, info)

    def __call__(self, x: FloatArray) -> Evaluation:
        if isinstance(self.model, LinearModel):
            acc = self.model.accuracy(x, self.test.x, self.test.y)
            loss = self.model.loss(x, self.test.x, self.test.y)
        else:  # one forward pass of the network for both
            acc, loss = self.model.evaluate(x, self.test.x, self.test.y)
        return Evaluation(accuracy=acc, loss=loss, nnz=int(np.count_nonzero(x)))
