"""The user's model, data and loops: nothing here comes from fedpdm-flower (Flower's PyTorch template shape).

Three classes of 14x14 images (a bright row band, column band or diagonal plus noise) that a 4-channel CNN
separates in a few steps; each node draws its own training and validation images from its partition id.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)


class Net(nn.Module):
    """conv(1, 4, 3) -> [BatchNorm when ``norm == "batchnorm"``] -> relu -> pool -> fc(144, 3)."""

    def __init__(self, norm: str = "none") -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm: nn.Module = nn.BatchNorm2d(4) if norm == "batchnorm" else nn.Identity()
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.max_pool2d(torch.relu(self.norm(self.conv(x))), 2).flatten(1))


def images(n: int, seed: int) -> TensorDataset:
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


class DictSamples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """flwr-datasets' sample shape, {"img": x, "label": y} (the ``samples = "dict"`` hook)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.data[i]
        return {"img": x, "label": y}


def train_data(pid: int, n: int, samples: str = "tensors") -> Any:
    """Node ``pid``'s training images (different sizes per node, so weighting matters)."""
    data = images(n + 8 * pid, 100 + pid)
    return DictSamples(data) if samples == "dict" else data


def val_data(pid: int) -> TensorDataset:
    """Node ``pid``'s own validation images (the client-side evaluation's data)."""
    return images(24 + 4 * pid, 500 + pid)


def test_data() -> TensorDataset:
    """The server's held-out images (the central evaluation's data)."""
    return images(120, 999)


def _xy(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return (batch["img"], batch["label"]) if isinstance(batch, dict) else (batch[0], batch[1])


def train(net: nn.Module, data: Any, *, lr: float, epochs: int, batch_size: int) -> float:
    """The template's loop: SGD on cross-entropy; the mean loss of the last epoch."""
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, seen = 0.0, 0
    for _ in range(epochs):
        total, seen = 0.0, 0
        for batch in DataLoader(data, batch_size=batch_size, shuffle=True):
            x, y = _xy(batch)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            total, seen = total + float(loss) * len(y), seen + len(y)
    return total / max(seen, 1)


def evaluate(net: nn.Module, data: TensorDataset) -> tuple[float, float]:
    """(loss, accuracy) of ``net`` on ``data``."""
    net.eval()
    with torch.no_grad():
        out = net(data.tensors[0])
        return float(nn.functional.cross_entropy(out, data.tensors[1])), float(
            (out.argmax(1) == data.tensors[1]).double().mean())
