"""The user's own `clients` package: it builds the library's client (a name the library must not shadow)."""

from __future__ import annotations

from flwr.app import Context
from task import Net, load_data
from torch import nn
from torch.utils.data import DataLoader

from fedpdm_flower.clients.fedpdm import FedPDMClient


def make_client(context: Context) -> FedPDMClient:
    loader = DataLoader(load_data(int(context.node_config["partition-id"])), batch_size=16)
    return FedPDMClient(Net(), loader, loss_fn=nn.CrossEntropyLoss())
