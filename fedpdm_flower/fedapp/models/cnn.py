"""Small torch CNNs for 28x28 grey images (MNIST / Fashion-MNIST), used by the deep-learning issues.

:class:`TinyCNN`: conv(1,8,5)-pool-conv(8,16,5)-pool-fc(256,64)-fc(64,classes), 20,522 parameters for 10 classes,
no BatchNorm: the CNN of ``bench --suite dp-anchor`` and of the quick start (record-level DP-SGD clips each record's
gradient, and its noise norm grows with sqrt(d), so a small model without running statistics is the DP choice).

:class:`SmallCNN`: two 5x5 'same' conv layers (32, 64 channels) each followed by 2x2 max-pooling, a 512-unit hidden
layer and the output layer: the "CNN" of McMahan et al. (2017) that most FL papers reuse, 1,663,370 parameters as
stated there.

:class:`LeNet5`: the classic LeNet-5 layout (LeCun et al. 1998) with ReLU and max-pooling, 61,706 parameters for
10 classes; the offline default for grey images, small enough for CPU runs.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyCNN(nn.Module):
    """Conv(1->8,5) - act - pool - Conv(8->16,5) - act - pool - FC(256->64) - act - FC(64->classes).

    20,522 trainable parameters for 10 classes (208 + 3,216 + 16,448 + 650), no buffers. The input is standardised
    with MNIST's published pixel mean and std (0.1307, 0.3081; constants, not learned from anyone's records).

    Parameters
    ----------
    num_classes
        Output classes (default 10, MNIST).
    in_channels
        Input channels (default 1, grey images).
    activation
        "relu" (default) or "tanh" (Papernot et al., "Tempered Sigmoid Activations for Deep Learning with
        Differential Privacy", AAAI 2021: bounded activations keep clipped gradients informative).
    """

    #: the activation of new instances (a class default the zoo's constructor, which takes no keyword, follows)
    activation = "relu"

    def __init__(self, num_classes: int = 10, in_channels: int = 1, activation: str | None = None) -> None:
        super().__init__()
        act = activation or self.activation
        if act not in ("relu", "tanh"):
            raise ValueError(f"activation must be 'relu' or 'tanh', got {act!r}")
        f: type[nn.Module] = nn.ReLU if act == "relu" else nn.Tanh
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 8, 5), f(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 5), f(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 64), f(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch shaped (B, C, 28, 28), or (B, 784[+1]) flat features (a bias column is dropped)."""
        if x.dim() == 2:
            x = x[:, : 28 * 28].reshape(-1, 1, 28, 28)
        return self.classifier(self.features((x - 0.1307) / 0.3081))  # type: ignore[no-any-return]


class SmallCNN(nn.Module):
    """Conv(1->32,5) - pool - Conv(32->64,5) - pool - FC(3136->512) - FC(512->classes).

    Parameters
    ----------
    num_classes
        Output classes (10 for MNIST).
    in_channels
        Input channels (1 for grey images).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch shaped (B, C, 28, 28), or (B, 784[+1]) flat features (a bias column is dropped)."""
        if x.dim() == 2:
            x = x[:, : 28 * 28].reshape(-1, 1, 28, 28)
        return self.classifier(self.features(x))  # type: ignore[no-any-return]


class LeNet5(nn.Module):
    """Conv(1->6,5,pad 2) - pool - Conv(6->16,5) - pool - FC(400->120) - FC(120->84) - FC(84->classes), ReLU between.

    61,706 trainable parameters for 10 classes: 156 + 2,416 (convs) + 48,120 + 10,164 + 850 (fully connected).

    Parameters
    ----------
    num_classes
        Output classes (default 10, MNIST).
    in_channels
        Input channels (default 1, grey images).
    """

    #: zero-padding of the first convolution (2 keeps 28x28, as LeNet-5's 32x32 input did; 0 in LeNet5Valid)
    padding = 2

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        side = ((28 + 2 * self.padding - 4) // 2 - 4) // 2  # 5 with padding 2, 4 without
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=self.padding),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * side * side, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch shaped (B, C, 28, 28), or (B, 784[+1]) flat features (a bias column is dropped)."""
        if x.dim() == 2:
            x = x[:, : 28 * 28].reshape(-1, 1, 28, 28)
        return self.classifier(self.features(x))  # type: ignore[no-any-return]


class LeNet5Valid(LeNet5):
    """LeNet-5 without padding and without BatchNorm: the DPQ-DSGD MNIST model (dp_quantized.md 6.3).

    Conv(1->6,5) - ReLU - pool - Conv(6->16,5) - ReLU - pool - FC(256->120) - ReLU - FC(120->84) - ReLU -
    FC(84->classes). 'Valid' convolutions on 28x28 leave 16x4x4 = 256 features, so there are 44,426 trainable
    parameters for 10 classes (156 + 2,416 + 30,840 + 10,164 + 850) and no buffers: the flat vector that DPQ-DSGD
    noises and quantizes is exactly the trainable weights. :class:`LeNet5` pads the first conv (61,706 parameters).

    Parameters
    ----------
    num_classes
        Output classes (default 10, MNIST).
    in_channels
        Input channels (default 1, grey images).
    """

    padding = 0


class SoftmaxRegression(nn.Module):
    """Seed 002's model (63) as a torch module: softmax regression on the 784 pixels, no bias (``softmax-nobias``).

    The same model as the numpy ``multinomial-nobias`` that DP-IADMM trains; the torch form lets Flower's FedAvg
    references of ``bench --suite dp-seeds`` (DeviceDPSGD, CentralDP) train it on the same task.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.fc = nn.Linear(in_channels * 28 * 28, num_classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch shaped (B, C, 28, 28), or (B, 784[+1]) flat features (a bias column is dropped)."""
        if x.dim() == 2:
            x = x[:, : self.fc.in_features]
        return self.fc(x.flatten(1))  # type: ignore[no-any-return]
