"""ResNet-20 for CIFAR-10 (He, Zhang, Ren, Sun 2016, Sec. 4.2), the model of the FedREP experiments (seed 003, Sec. 5).

A 3x3 conv (16 channels), three stages of three basic blocks with 16, 32 and 64 channels (the first block of stages
2 and 3 halves the resolution), global average pooling and a linear layer: 6n + 2 = 20 weighted layers for n = 3.
Shortcuts are "option A" identities: on a stride-2 block the input is subsampled and zero-padded to the new channel
count, which adds no parameters. Convolutions have no bias (BatchNorm follows each). Trainable parameters:
269,722 for 10 classes (spec fedrep.md 8.2; 272,474 with 1x1 projection shortcuts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the (option A) shortcut, then ReLU."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride = stride
        self.pad = planes - in_planes

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """Identity, or subsample by the stride and zero-pad the new channels evenly on both sides."""
        if self.stride == 1 and self.pad == 0:
            return x
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 with option-A shortcuts for 32x32 colour images.

    Parameters
    ----------
    num_classes
        Output classes (default 10, CIFAR-10).
    in_channels
        Input channels (default 3, RGB).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        in_planes = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(_BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
        self.blocks = nn.Sequential(*blocks)
        self.linear = nn.Linear(64, num_classes)
        # He et al.'s initialisation for the weights (torch's BN defaults: weight 1, bias 0).
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch shaped (B, C, 32, 32)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.blocks(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)  # type: ignore[no-any-return]
