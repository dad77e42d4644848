"""Datasets and client partitions as plain numpy arrays (no Flower imports on the load path).

* :mod:`fedpdm_flower.fedapp.data.sources`: MNIST, Fashion-MNIST and UCI Adult, offline from installed packages; CIFAR-10
  (online only, torchvision).
* :mod:`fedpdm_flower.fedapp.data.partition`: IID / Dirichlet / label-k (flwr-datasets' partitioners, in numpy), the
  paper's split and one writer per client, each computed once per dataset (:class:`Split`) and sliced per node.
* :mod:`fedpdm_flower.fedapp.data.synthetic`: small seeded datasets for tests and fast runs.
* :mod:`fedpdm_flower.fedapp.data.femnist`: FEMNIST (online only), one LEAF writer per client.
* :mod:`fedpdm_flower.fedapp.data.local_files`: a device's own files (node config ``data-path``): npz, IDX, images, flwr-datasets.
"""

from typing import TYPE_CHECKING

from fedpdm_flower.fedapp.lazy import lazy_exports

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.data.local_files import (
        LocalDataError as LocalDataError,
    )
    from fedpdm_flower.fedapp.data.local_files import (
        load_local_files as load_local_files,
    )
    from fedpdm_flower.fedapp.data.partition import (
        SCHEMES as SCHEMES,
    )
    from fedpdm_flower.fedapp.data.partition import (
        Split as Split,
    )
    from fedpdm_flower.fedapp.data.partition import (
        clear_partition_cache as clear_partition_cache,
    )
    from fedpdm_flower.fedapp.data.partition import (
        largest_remainder as largest_remainder,
    )
    from fedpdm_flower.fedapp.data.partition import (
        load_partition as load_partition,
    )
    from fedpdm_flower.fedapp.data.partition import (
        paper_partition as paper_partition,
    )
    from fedpdm_flower.fedapp.data.partition import (
        partition_indices as partition_indices,
    )
    from fedpdm_flower.fedapp.data.partition import (
        split_dataset as split_dataset,
    )
    from fedpdm_flower.fedapp.data.sources import (
        REAL_DATASETS as REAL_DATASETS,
    )
    from fedpdm_flower.fedapp.data.sources import (
        SOURCES as SOURCES,
    )
    from fedpdm_flower.fedapp.data.sources import (
        ArrayDataset as ArrayDataset,
    )
    from fedpdm_flower.fedapp.data.sources import (
        DatasetInfo as DatasetInfo,
    )
    from fedpdm_flower.fedapp.data.sources import (
        clear_dataset_cache as clear_dataset_cache,
    )
    from fedpdm_flower.fedapp.data.sources import (
        dataset_names as dataset_names,
    )
    from fedpdm_flower.fedapp.data.sources import (
        images_to_features as images_to_features,
    )
    from fedpdm_flower.fedapp.data.sources import (
        load_dataset as load_dataset,
    )
    from fedpdm_flower.fedapp.data.sources import (
        read_idx as read_idx,
    )
    from fedpdm_flower.fedapp.data.synthetic import (
        SYNTHETIC_PRESETS as SYNTHETIC_PRESETS,
    )
    from fedpdm_flower.fedapp.data.synthetic import (
        load_synthetic as load_synthetic,
    )
    from fedpdm_flower.fedapp.data.synthetic import (
        make_classification as make_classification,
    )
    from fedpdm_flower.fedapp.data.synthetic import (
        make_lasso_problem as make_lasso_problem,
    )

__getattr__, __all__ = lazy_exports(__name__, {
    "local_files": ["LocalDataError", "load_local_files"],
    "partition": ["SCHEMES", "Split", "clear_partition_cache", "largest_remainder", "load_partition",
                  "paper_partition", "partition_indices", "split_dataset"],
    "sources": ["REAL_DATASETS", "SOURCES", "ArrayDataset", "DatasetInfo", "clear_dataset_cache", "dataset_names",
                "images_to_features", "load_dataset", "read_idx"],
    "synthetic": ["SYNTHETIC_PRESETS", "load_synthetic", "make_classification", "make_lasso_problem"],
})
