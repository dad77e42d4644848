"""The user's model, data and training loop (nothing here comes from fedpdm-flower)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

FEATURES, CLASSES = 20, 4


class Net(nn.Module):
    """A small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _blobs(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four Gaussian classes around fixed centres (the centres are the same for every node and the test set)."""
    centres = np.random.default_rng(1234).normal(scale=0.35, size=(CLASSES, FEATURES))
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=n)
    x = centres[y] + rng.normal(size=(n, FEATURES))
    return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))


def load_partition(pid: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _blobs(100 + pid, n)


def load_test() -> tuple[torch.Tensor, torch.Tensor]:
    return _blobs(99, 1000)


def train(net: nn.Module, data: tuple[torch.Tensor, torch.Tensor], lr: float, seed: int) -> float:
    """One epoch of SGD in mini-batches of 20, the order drawn from ``seed`` (the same round redone trains the same)."""
    x, y = data
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    total = 0.0
    for i in range(0, len(y), 20):
        idx = order[i:i + 20]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
        loss.backward()
        opt.step()
        total += loss.item() * len(idx)
    return total / len(y)


def evaluate(net: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    x, y = data
    with torch.no_grad():
        out = net(x)
        return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())
