"""Datasets and client partitions as plain numpy arrays (no Flower imports on the load path).

* :mod:`fedapp.data.sources`: MNIST, Fashion-MNIST and UCI Adult, offline from installed packages.
* :mod:`fedapp.data.partition`: IID / Dirichlet / label-k (flwr-datasets) and the paper's split.
* :mod:`fedapp.data.synthetic`: small seeded datasets for tests and fast runs.
"""

from fedapp.data.partition import (
    SCHEMES,
    clear_partition_cache,
    largest_remainder,
    load_partition,
    paper_partition,
    partition_indices,
)
from fedapp.data.sources import (
    REAL_DATASETS,
    SOURCES,
    ArrayDataset,
    DatasetInfo,
    dataset_names,
    images_to_features,
    load_dataset,
    read_idx,
)
from fedapp.data.synthetic import (
    SYNTHETIC_PRESETS,
    load_synthetic,
    make_classification,
    make_lasso_problem,
)

__all__ = [
    "REAL_DATASETS",
    "SCHEMES",
    "SOURCES",
    "SYNTHETIC_PRESETS",
    "ArrayDataset",
    "DatasetInfo",
    "clear_partition_cache",
    "dataset_names",
    "images_to_features",
    "largest_remainder",
    "load_dataset",
    "load_partition",
    "load_synthetic",
    "make_classification",
    "make_lasso_problem",
    "paper_partition",
    "partition_indices",
    "read_idx",
]
