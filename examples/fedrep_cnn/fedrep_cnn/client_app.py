"""ClientApp: the user's CNN and MNIST partition, trained by our FedREP client in secure mode (three actions:
propose, train, unmask)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from flwr.app import Context
from torch import nn

from fedpdm_flower.clients.fedrep import FedREPClient
from fedpdm_flower.clients.secure import SecureDevice
from fedpdm_flower.fedapp.secagg import NodeIdentity, TrustStore
from fedrep_cnn.task import Net, load_partition

torch.set_num_threads(1)


def secure_device(rc: Any) -> SecureDevice:
    """This device's secure mode: its identity and the trust store under keys-dir (python -m fedrep_cnn.provision).

    The device never sends its update in the clear and checks its buffer-mates' signed keys itself. It accepts
    buffers of 2, the FedREP paper's setting s = 2, which is weaker than the library's default minimum of 3: in a
    buffer of 2 one colluding mate learns the other's update from the buffer sum.
    """
    keys = str(rc["keys-dir"])
    if not keys:
        raise ValueError("run config 'keys-dir' is empty: masked buffers need provisioned devices (python -m "
                         "fedrep_cnn.provision KEYS_DIR NUM_NODES, then flwr run . -c keys-dir='\"KEYS_DIR\"')")
    return SecureDevice(identity=lambda ctx: NodeIdentity.load(Path(keys) / f"node-{ctx.node_config['partition-id']}.pem"),
                        trust_store=TrustStore.load(Path(keys) / "trust.json"), min_buffer=2)


def client_fn(context: Context) -> FedREPClient:
    """One node: the user's CNN on its own MNIST slice (its batch size is the loader's)."""
    rc, nc = context.run_config, context.node_config
    loader = load_partition(int(nc["partition-id"]), int(nc["num-partitions"]), int(rc["samples-per-node"]),
                            int(rc["batch-size"]))
    return FedREPClient(Net(), loader, loss_fn=nn.CrossEntropyLoss(), secure=secure_device(rc))


# registers train, evaluate, query.whoami and FedREP's query.propose and query.unmask
app = FedREPClient.client_app(client_fn)
