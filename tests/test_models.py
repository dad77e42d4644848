"""The small CNN kept for the deep-learning issues: shapes, a backward pass, and one SGD step that lowers the loss."""

from __future__ import annotations

import torch

from fedapp.models.cnn import SmallCNN


def test_cnn_forward_backward_on_images_and_flat_features() -> None:
    torch.manual_seed(0)
    net = SmallCNN(num_classes=10)
    images = torch.rand(8, 1, 28, 28)
    flat = torch.cat([images.reshape(8, -1), torch.ones(8, 1)], dim=1)  # our loaders' 785 features (bias last)
    assert torch.equal(net(images), net(flat))
    labels = torch.randint(0, 10, (8,))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loss0 = torch.nn.functional.cross_entropy(net(images), labels)
    loss0.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
    opt.step()
    with torch.no_grad():
        assert torch.nn.functional.cross_entropy(net(images), labels) < loss0
    assert sum(p.numel() for p in net.parameters()) == 1_663_370
