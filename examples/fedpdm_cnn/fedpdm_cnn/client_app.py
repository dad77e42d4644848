"""ClientApp: the user's CNN and MNIST partition, trained by our FedPDM client."""

from __future__ import annotations

import torch
from flwr.app import Context
from torch import nn

from fedpdm_cnn.task import Net, load_partition
from fedpdm_flower.clients.fedpdm import FedPDMClient

torch.set_num_threads(1)


def client_fn(context: Context) -> FedPDMClient:
    """One node: the user's CNN on its own MNIST slice."""
    rc, nc = context.run_config, context.node_config
    loader = load_partition(int(nc["partition-id"]), int(nc["num-partitions"]), int(rc["samples-per-node"]),
                            int(rc["batch-size"]))
    return FedPDMClient(Net(), loader, loss_fn=nn.CrossEntropyLoss())


app = FedPDMClient.client_app(client_fn)
