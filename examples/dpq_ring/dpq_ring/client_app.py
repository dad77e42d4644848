"""ClientApp: the user's CNN on its MNIST slice, one DPQ-DSGD node of the ring."""

from __future__ import annotations

import torch
from flwr.app import Context
from torch import nn

from dpq_ring.task import Net, load_partition, load_test
from fedpdm_flower.clients.dpq import DPQClient

torch.set_num_threads(1)


def client_fn(context: Context) -> DPQClient:
    """One node: the user's CNN on its own MNIST slice; it evaluates its own model on 500 held-out images."""
    rc, nc = context.run_config, context.node_config
    data = load_partition(int(nc["partition-id"]), int(nc["num-partitions"]), int(rc["samples-per-node"]))
    # share_model=True is this device's consent to upload its exact weights in evaluation rounds, so the server can
    # evaluate the node-average model (outside the DP guarantee; without it the node refuses such a request)
    return DPQClient(Net(), data, loss_fn=nn.CrossEntropyLoss(), test_data=load_test(500).dataset, share_model=True)


app = DPQClient.client_app(client_fn)
