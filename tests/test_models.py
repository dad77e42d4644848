"""The small CNN kept for the deep-learning issues: shapes, a backward pass, and one SGD step that lowers the loss."""

from __future__ import annotations

import torch

from fedpdm_flower.fedapp.models.cnn import SmallCNN


def test_cnn_forward_backward_on_images_and_flat_features() -> None:
    torch.manual_seed(0)
    net = SmallCNN(num_classes=10)
    images = torch.rand(8, 1, 28, 28)
    flat = torch.cat([images.reshape(8, -1), torch.ones(8, 1)], dim=1)  # our loaders' 785 features (bias last)
    assert torch.equal(net(images), net(flat))
    labels = torch.randint(0, 10, (8,))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loss0 = torch.nn.functional.cross_entropy(net(images), labels)
    torch.autograd.backward(loss0)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
    opt.step()
    with torch.no_grad():
        assert torch.nn.functional.cross_entropy(net(images), labels) < loss0
    assert sum(p.numel() for p in net.parameters()) == 1_663_370


def test_resnet20_parameter_count_shapes_and_gradients() -> None:
    from fedpdm_flower.fedapp.models.resnet import ResNet20

    torch.manual_seed(0)
    net = ResNet20(num_classes=10)
    # 432 + 32 (stem) + 14,016 + 51,072 + 203,520 (stages; option-A shortcuts add nothing) + 650 (linear).
    assert sum(p.numel() for p in net.parameters() if p.requires_grad) == 269_722
    # BN running mean/var (spec 11.2: they change d by 1,376).
    assert sum(b.numel() for b in net.buffers() if torch.is_floating_point(b)) == 1_376
    out = net(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    torch.autograd.backward(torch.nn.functional.cross_entropy(out, torch.tensor([3, 7])))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def test_lenet5_count_and_flat_features() -> None:
    from fedpdm_flower.fedapp.models.cnn import LeNet5

    torch.manual_seed(0)
    net = LeNet5(num_classes=10)
    assert sum(p.numel() for p in net.parameters()) == 61_706  # 156 + 2,416 + 48,120 + 10,164 + 850
    images = torch.rand(4, 1, 28, 28)
    flat = torch.cat([images.reshape(4, -1), torch.ones(4, 1)], dim=1)
    assert net(flat).shape == (4, 10)
    assert torch.equal(net(images), net(flat)) and torch.equal(net(images), net(images.reshape(4, -1)))
    torch.autograd.backward(torch.nn.functional.cross_entropy(net(flat), torch.tensor([0, 1, 2, 3])))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
