"""ClientApp: the user's MLP and MNIST partition, trained by our DP-IADMM client."""

from __future__ import annotations

import torch
from flwr.app import Context
from torch import nn

from fedpdm_flower.clients.iadmm import IADMMClient
from iadmm_mlp.task import Net, load_partition

torch.set_num_threads(1)


def client_fn(context: Context) -> IADMMClient:
    """One node: the user's MLP on its own MNIST slice, with the device owner's privacy floor."""
    rc, nc = context.run_config, context.node_config
    loader = load_partition(int(nc["partition-id"]), int(nc["num-partitions"]), int(rc["samples-per-node"]))
    return IADMMClient(Net(), loader, loss_fn=nn.CrossEntropyLoss(), max_epsilon=float(rc["max-epsilon"]))


app = IADMMClient.client_app(client_fn)
