"""ClientApp: the user's CNN and MNIST partition, trained by our FedREP client (two actions: propose, train)."""

from __future__ import annotations

import torch
from flwr.app import Context
from torch import nn

from clients.fedrep import FedREPClient
from fedrep_cnn.task import Net, load_partition

torch.set_num_threads(1)


def client_fn(context: Context) -> FedREPClient:
    """One node: the user's CNN on its own MNIST slice (its batch size is the loader's)."""
    rc, nc = context.run_config, context.node_config
    loader = load_partition(int(nc["partition-id"]), int(nc["num-partitions"]), int(rc["samples-per-node"]),
                            int(rc["batch-size"]))
    return FedREPClient(Net(), loader, loss_fn=nn.CrossEntropyLoss())


# registers train, evaluate, query.whoami and FedREP's query.propose
app = FedREPClient.client_app(client_fn)
