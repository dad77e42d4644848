"""CIFAR-10 (online only) on a fake torchvision download: feature layout, offline errors, partitions, a FedREP round.

Nothing is downloaded: ``torchvision.datasets.CIFAR10`` is replaced by a class that returns a tiny made-up dataset
with the real class's attributes (``data``: uint8 (n, 32, 32, 3), channels last; ``targets``: list of int).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpdm_flower.fedapp.config import ConfigError, parse_run_config
from fedpdm_flower.fedapp.data import clear_dataset_cache, clear_partition_cache, load_dataset, load_partition
from fedpdm_flower.fedapp.data import sources as src

N_TRAIN, N_TEST = 20, 10
MEAN = np.array([0.4914, 0.4822, 0.4465])
STD = np.array([0.2023, 0.1994, 0.2010])


def _fake_split(train: bool, seed: int) -> tuple[np.ndarray[Any, np.dtype[np.uint8]], list[int]]:
    rng = np.random.default_rng([seed, int(train)])
    n = N_TRAIN if train else N_TEST
    images = rng.integers(0, 256, size=(n, 32, 32, 3)).astype(np.uint8)
    images[0] = 0  # the extremes of the normalisation
    images[1] = 255
    return images, [int(c) for c in np.arange(n) % 10]  # every class, as torchvision's plain int list


@pytest.fixture
def fake_cifar(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Replace only torchvision's CIFAR10 class (the download); the conversion and everything after is real.

    The dataset memo and the partition cache are cleared before and after, so the fake cannot reach another test.
    """
    from torchvision import datasets as tvd

    state: dict[str, Any] = {"calls": [], "seed": 0}

    class FakeCIFAR10:
        def __init__(self, root: str, train: bool = True, download: bool = False) -> None:
            state["calls"].append((root, train, download))
            self.data, self.targets = _fake_split(train, state["seed"])

    monkeypatch.setattr(tvd, "CIFAR10", FakeCIFAR10)
    clear_dataset_cache()
    clear_partition_cache()
    yield state
    clear_dataset_cache()
    clear_partition_cache()


def test_cifar10_feature_layout_is_channel_major(fake_cifar: dict[str, Any], tmp_path: Path) -> None:
    train, test, info = load_dataset("cifar10", source="online", root=str(tmp_path))
    assert fake_cifar["calls"] == [(str(tmp_path), True, True), (str(tmp_path), False, True)]
    assert info.name == "cifar10" and info.num_classes == 10 and info.num_features == 3073
    assert "torchvision.datasets.CIFAR10" in info.source and "no augmentation" in info.source
    assert train.x.shape == (N_TRAIN, 3073) and test.x.shape == (N_TEST, 3073)
    assert train.x.dtype == np.float64 and train.y.dtype == np.int64 and train.groups is None
    assert np.all(train.x[:, -1] == 1.0) and np.all(test.x[:, -1] == 1.0)
    np.testing.assert_array_equal(train.y, np.arange(N_TRAIN) % 10)
    np.testing.assert_array_equal(test.y, np.arange(N_TEST) % 10)
    for split, x in ((True, train.x), (False, test.x)):
        raw, _ = _fake_split(split, 0)
        # pixel (channel c, row i, col j) of image k lands at column c*1024 + i*32 + j, normalised per channel
        k, c, i, j = np.meshgrid(np.arange(len(raw)), np.arange(3), np.arange(32), np.arange(32), indexing="ij")
        expected = (raw[k, i, j, c] / 255.0 - MEAN[c]) / STD[c]
        np.testing.assert_allclose(x[k, c * 1024 + i * 32 + j], expected, rtol=0, atol=1e-12)
    # spot check one pixel by hand, and the range: all-black and all-white images give (0 - m) / s and (1 - m) / s
    raw, _ = _fake_split(True, 0)
    assert train.x[5, 2 * 1024 + 7 * 32 + 30] == pytest.approx((raw[5, 7, 30, 2] / 255 - 0.4465) / 0.2010)
    np.testing.assert_allclose(train.x[0, :3072].reshape(3, -1), np.repeat((-MEAN / STD)[:, None], 1024, axis=1))
    np.testing.assert_allclose(train.x[1, :3072].reshape(3, -1), np.repeat(((1 - MEAN) / STD)[:, None], 1024, axis=1))
    assert train.x.min() > -2.43 and train.x.max() < 2.76
    # the model reads the same order: TorchNet(resnet20) reshapes the first 3072 columns to (3, 32, 32)
    from fedpdm_flower.fedapp.models.torch_net import TorchNet

    inputs = TorchNet("resnet20", info.num_classes, info.num_features).inputs(train.x).numpy()
    assert inputs.shape == (N_TRAIN, 3, 32, 32)
    np.testing.assert_allclose(inputs, (raw.transpose(0, 3, 1, 2) / 255.0 - MEAN[:, None, None]) / STD[:, None, None],
                               rtol=1e-6, atol=1e-6)
    # memoised and read-only: a second call does not download again
    assert load_dataset("cifar10", source="online", root=str(tmp_path))[0] is train and len(fake_cifar["calls"]) == 2
    assert not train.x.flags.writeable


def test_cifar10_features_bad_input() -> None:
    with pytest.raises(ValueError, match=r"\(n, 32, 32, 3\)"):
        src.cifar10_features(np.zeros((2, 3, 32, 32), dtype=np.uint8))  # channels first is not what torchvision gives
    with pytest.raises(ValueError, match="uint8"):
        src.cifar10_features(np.zeros((2, 32, 32, 3), dtype=np.float32))


def test_cifar10_offline_names_the_key_and_the_network(fake_cifar: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="needs a network; use data-source='online'"):
        load_dataset("cifar10")
    with pytest.raises(ConfigError, match=r"'data-source'.*'cifar10'.*needs a network"):
        parse_run_config({"dataset": "cifar10", "model": "resnet20"})
    assert fake_cifar["calls"] == []  # neither reached torchvision
    cfg = parse_run_config({"algorithm": "fedrep", "dataset": "cifar10", "data-source": "online", "model": "resnet20"})
    assert cfg.dataset == "cifar10" and cfg.data_source == "online"


@pytest.mark.filterwarnings("ignore:Classes.*will NOT be used:UserWarning")  # label-k, 2 clients x 2 of 10 classes
@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "label-k"])
def test_cifar10_partitioners(fake_cifar: dict[str, Any], scheme: str) -> None:
    train, _, _ = load_dataset("cifar10", source="online")
    kw: dict[str, Any] = {"labels_per_client": 2} if scheme == "label-k" else {}
    shards = [load_partition("cifar10", scheme, i, 2, seed=3, source="online", **kw) for i in range(2)]
    rows = [tuple(r) for s in shards for r in s.x]
    assert len(set(rows)) == len(rows) and all(len(s) > 0 for s in shards)  # disjoint, none empty
    every = {tuple(r) for r in train.x}
    assert set(rows) <= every
    if scheme == "iid":
        assert [len(s) for s in shards] == [N_TRAIN // 2] * 2
    if scheme == "label-k":
        assert all(np.unique(s.y).size <= 2 for s in shards)
    for s in shards:
        assert s.x.shape[1] == 3073 and s.x.flags.writeable


def test_cifar10_cache_does_not_outlive_a_clear(fake_cifar: dict[str, Any]) -> None:
    first, _, _ = load_dataset("cifar10", source="online")
    clear_dataset_cache()
    fake_cifar["seed"] = 1
    second, _, _ = load_dataset("cifar10", source="online")
    assert len(fake_cifar["calls"]) == 4 and not np.array_equal(first.x, second.x)


def test_cifar10_fedrep_resnet20_one_round_inprocess(fake_cifar: dict[str, Any]) -> None:
    from simulations.inprocess import run_inprocess

    cfg = parse_run_config({
        "algorithm": "fedrep", "model": "resnet20", "dataset": "cifar10", "data-source": "online",
        "num-clients": 2, "clients-per-round": 2, "buffer-size": 2, "partitioner": "iid", "batch-size": 4,
        "local-steps": 1, "eval-every": 1, "num-server-rounds": 1,
    })
    strategy, contexts, _ = run_inprocess(cfg)
    assert len(fake_cifar["calls"]) == 2  # server and both clients share one (fake) download
    assert set(contexts) == {0, 1}
    assert [r.round for r in strategy.history] == [1]
    rec = strategy.history[0]
    assert rec.test_accuracy is not None and 0.0 <= rec.test_accuracy <= 1.0
    assert rec.test_loss is not None and np.isfinite(rec.test_loss)
