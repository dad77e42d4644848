"""A user's torch model and data for the public-API tests: nothing here comes from the project.

Three classes of 14x14 images that a 4-channel CNN separates in a few steps, so the tests can check that the
user's own module learns through our strategies and clients.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


class TinyCNN(nn.Module):
    """conv(1, 4, 3) -> [BatchNorm when ``norm``] -> relu -> pool -> fc(144, 3)."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm: nn.Module = nn.BatchNorm2d(4) if norm else nn.Identity()
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.max_pool2d(torch.relu(self.norm(self.conv(x))), 2).flatten(1))


def images(n: int, seed: int) -> TensorDataset:
    """Three classes of 14x14 images: a bright row band, column band or diagonal, plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = 0.3 * torch.randn(n, 1, 14, 14, generator=g)
    for i in range(n):
        if y[i] == 0:
            x[i, 0, 5:9, :] += 1.5
        elif y[i] == 1:
            x[i, 0, :, 5:9] += 1.5
        else:
            x[i, 0] += 1.5 * torch.eye(14)
    return TensorDataset(x, y)


def accuracy(net: nn.Module, data: TensorDataset) -> float:
    """The share of ``data`` that ``net`` classifies correctly (eval mode)."""
    net.eval()
    with torch.no_grad():
        return float((net(data.tensors[0]).argmax(1) == data.tensors[1]).double().mean())
