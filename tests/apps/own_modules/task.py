"""The user's model and data: three kinds of 8x8 images (chance is 1/3)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def load_data(seed: int, n: int = 200) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = 0.3 * torch.randn(n, 1, 8, 8, generator=g)
    x[y == 0, 0, 3:5, :] += 1.5
    x[y == 1, 0, :, 3:5] += 1.5
    x[y == 2, 0] += 1.5 * torch.eye(8)
    return TensorDataset(x, y)
