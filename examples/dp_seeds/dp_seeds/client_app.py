"""ClientApp: the user's CNN and MNIST partition, trained by the client of the run config's DP seed algorithm.

Each message goes to the ClientApp of that algorithm's client class (``<Client>.client_app(client_fn)``), built once
per process; an algorithm whose client answers more actions (``query.<phase>``) registers them below as well.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from torch import nn

from dp_seeds.algorithms import pick
from dp_seeds.task import Net, load_partition

torch.set_num_threads(1)

_APPS: dict[str, Any] = {}


def _client_app(context: Context) -> Any:
    _, cls = pick(context.run_config)
    if cls.__name__ not in _APPS:

        def client_fn(ctx: Context) -> Any:
            rc, nc = ctx.run_config, ctx.node_config
            loader = load_partition(int(nc["partition-id"]), int(nc["num-partitions"]), int(rc["samples-per-node"]),
                                    int(rc["batch-size"]))
            return cls(Net(), loader, loss_fn=nn.CrossEntropyLoss())

        _APPS[cls.__name__] = cls.client_app(client_fn)
    return _APPS[cls.__name__]


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _client_app(context)(msg, context)  # type: ignore[no-any-return]


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _client_app(context)(msg, context)  # type: ignore[no-any-return]


@app.query("whoami")
def whoami(msg: Message, context: Context) -> Message:
    """The strategy asks each node its partition id (and a DP client's floor) before round 1."""
    return _client_app(context)(msg, context)  # type: ignore[no-any-return]
