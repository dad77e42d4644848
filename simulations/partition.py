"""``python -m simulations partition``: one file per device for a real deployment, plus a manifest.

    python -m simulations partition --dataset mnist --num-partitions 4 --out parts/ [--partitioner iid] [--seed 0]

writes ``parts/partition_<i>.npz`` (i = 0..N-1) and ``parts/partitions.json``. Partition i holds exactly the rows
that ``partition-id = i`` of ``num-partitions = N`` gives under a run config with the same ``dataset``,
``partitioner``, ``seed``, ``labels-per-client``, ``samples-per-client`` and ``dirichlet-alpha``
(:func:`fedpdm_flower.fedapp.data.partition_indices` on the same labels), and ``--partitioner recal`` gives DP-RECAL's split
(:func:`fedpdm_flower.fedapp.algorithms.recal.split_agents`: seeded permutation, first ``--num-samples`` rows = run-config key
``recal-samples``, ``np.array_split``), rows kept in that order. For dpq-dsgd use ``--partitioner iid`` (its
``paper`` split is the seeded IID one).

File format (:mod:`fedpdm_flower.fedapp.data.local_files`): ``x`` = the raw uint8 images for MNIST / Fashion-MNIST ((n, 28, 28),
read from the same IDX files the loader reads; the device applies the loader's feature map, so its features equal
the loader's bit for bit), float64 features for the other datasets; ``y`` int64 labels; ``num_classes``;
``x_test`` / ``y_test`` = the first ``--test-samples`` rows of the test split when asked (for clients that evaluate
locally, e.g. DPQ-DSGD). The manifest records the arguments, each file's size, label counts and SHA-256, and the
``--node-config`` string of each device.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.config import ConfigError, RunConfig

__all__ = ["PARTITIONERS", "build_parser", "main", "partition_rows", "write_partitions"]

#: the run config's partitioners, plus DP-RECAL's split
PARTITIONERS = ("iid", "dirichlet", "label-k", "paper", "recal")
MANIFEST = "partitions.json"


def partition_rows(y: NDArray[np.int64], partitioner: str, num_partitions: int, seed: int, *,
                   labels_per_client: int, samples_per_client: int, dirichlet_alpha: float,
                   num_samples: int) -> list[NDArray[np.int64]]:
    """Row indices of each device: the run's partitioner (as :func:`fedpdm_flower.fedapp.task.client_dataset` calls it), or
    DP-RECAL's split (``recal``, in its row order)."""
    if partitioner == "recal":
        total = num_samples or y.shape[0]
        if not num_partitions <= total <= y.shape[0]:
            raise ConfigError(f"--num-samples must lie in [{num_partitions}, {y.shape[0]}] (0 = all), got {num_samples}")
        idx = np.random.default_rng(seed).permutation(y.shape[0])[:total]
        return [np.asarray(p, dtype=np.int64) for p in np.array_split(idx, num_partitions)]
    from fedpdm_flower.fedapp.data.partition import partition_indices

    return partition_indices(y, partitioner, num_partitions, seed, labels_per_client=labels_per_client,
                             samples_per_client=samples_per_client or None, dirichlet_alpha=dirichlet_alpha)


def _raw_images(dataset: str) -> tuple[NDArray[np.uint8], NDArray[np.uint8]] | None:
    """The train and test images as stored (uint8), for the datasets whose loader reads IDX files offline."""
    from fedpdm_flower.fedapp.data import sources

    if dataset == "mnist":
        folder = sources.mnist_offline_dir()
    elif dataset == "fashion-mnist":
        folder = sources.FASHION_MNIST_DIR
    else:
        return None
    return sources.read_idx(folder / sources.IDX_FILES[0]), sources.read_idx(folder / sources.IDX_FILES[2])


def write_partitions(dataset: str, num_partitions: int, out: Path, *, partitioner: str = "iid", seed: int = 0,
                     labels_per_client: int = 4, samples_per_client: int = 0, dirichlet_alpha: float = 0.5,
                     num_samples: int = 0, test_samples: int = 0, source: str = "offline") -> dict[str, Any]:
    """Write ``partition_<i>.npz`` for i < num_partitions and the manifest into ``out``; return the manifest."""
    from fedpdm_flower.fedapp.data import load_dataset

    if partitioner not in PARTITIONERS:
        raise ConfigError(f"--partitioner must be one of {', '.join(PARTITIONERS)}, got {partitioner!r}")
    if num_partitions < 1:
        raise ConfigError(f"--num-partitions must be >= 1, got {num_partitions}")
    if partitioner == "recal" and dataset != "mnist":
        raise ConfigError("--partitioner recal is DP-RECAL's split of MNIST; use --dataset mnist")
    if test_samples < 0:
        raise ConfigError(f"--test-samples must be >= 0, got {test_samples}")
    train, test, info = load_dataset(dataset, source)
    raw = _raw_images(dataset) if source == "offline" else None
    if raw is not None and raw[0].shape[0] != len(train):
        raise RuntimeError(f"{dataset}: {raw[0].shape[0]} raw images but the loader has {len(train)} rows")
    parts = partition_rows(train.y, partitioner, num_partitions, seed, labels_per_client=labels_per_client,
                           samples_per_client=samples_per_client, dirichlet_alpha=dirichlet_alpha,
                           num_samples=num_samples)
    out.mkdir(parents=True, exist_ok=True)
    extra: dict[str, NDArray[Any]] = {}
    if test_samples:
        k = min(test_samples, len(test))
        extra = {"x_test": raw[1][:k] if raw is not None else np.asarray(test.x[:k]), "y_test": np.asarray(test.y[:k])}
    files = []
    for i, rows in enumerate(parts):
        x = raw[0][rows] if raw is not None else np.asarray(train.x[rows])
        path = out / f"partition_{i}.npz"
        arrays: dict[str, Any] = {"x": x, "y": np.asarray(train.y[rows], dtype=np.int64),
                                  "num_classes": np.int64(info.num_classes), **extra}
        np.savez_compressed(path, **arrays)
        files.append({
            "partition-id": i, "file": path.name, "samples": int(rows.size),
            "label-counts": np.bincount(train.y[rows], minlength=info.num_classes).tolist(),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "node-config": f'partition-id={i} num-partitions={num_partitions} data-path="{path.resolve()}"',
        })
    manifest = {
        "dataset": dataset, "data-source": source, "partitioner": partitioner, "seed": seed,
        "num-partitions": num_partitions, "labels-per-client": labels_per_client,
        "samples-per-client": samples_per_client, "dirichlet-alpha": dirichlet_alpha,
        "recal-samples": num_samples, "test-samples": min(test_samples, len(test)),
        "num-classes": info.num_classes, "num-features": info.num_features,
        "x": "uint8 images (the device applies the loader's feature map)" if raw is not None else "float64 features",
        "partitions": files,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The arguments of the ``partition`` subcommand (defaults = the run config's)."""
    d = RunConfig()
    p = p or argparse.ArgumentParser(prog="python -m simulations partition", description=__doc__)
    p.add_argument("--dataset", default="mnist", help="run-config dataset (default mnist)")
    p.add_argument("--num-partitions", type=int, required=True, help="devices N (the run's num-clients)")
    p.add_argument("--out", required=True, help="directory for partition_<i>.npz and partitions.json")
    p.add_argument("--partitioner", default="iid", choices=PARTITIONERS,
                   help="the run config's partitioner, or recal (DP-RECAL's split); default iid")
    p.add_argument("--seed", type=int, default=d.seed, help="the run config's seed (partition seed)")
    p.add_argument("--labels-per-client", type=int, default=d.labels_per_client)
    p.add_argument("--samples-per-client", type=int, default=d.samples_per_client)
    p.add_argument("--dirichlet-alpha", type=float, default=d.dirichlet_alpha)
    p.add_argument("--num-samples", type=int, default=0, help="--partitioner recal: recal-samples (0 = all)")
    p.add_argument("--test-samples", type=int, default=0,
                   help="also store the first K test samples in every file (x_test/y_test; for DPQ-DSGD)")
    p.add_argument("--data-source", default=d.data_source, choices=("offline", "online"))
    return p


def main(args: argparse.Namespace) -> int:
    """Write the files and print one line per device (its node config)."""
    out = Path(args.out)
    manifest = write_partitions(
        args.dataset, args.num_partitions, out, partitioner=args.partitioner, seed=args.seed,
        labels_per_client=args.labels_per_client, samples_per_client=args.samples_per_client,
        dirichlet_alpha=args.dirichlet_alpha, num_samples=args.num_samples, test_samples=args.test_samples,
        source=args.data_source,
    )
    for f in manifest["partitions"]:
        print(f"{out / f['file']}: {f['samples']} samples; --node-config '{f['node-config']}'")
    print(f"manifest: {out / MANIFEST}")
    return 0
