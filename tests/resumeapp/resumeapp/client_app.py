"""ClientApp: the user's train function (fedavg, secure-robust) or our FedPDM client (fedpdm), behind the mod that
carries the device's context.state over a restarted server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, TensorDataset

from fedpdm_flower.clients.fedpdm import FedPDMClient
from fedpdm_flower.clients.mods import secure_buffers_mod
from fedpdm_flower.clients.state import persistent_state_mod
from fedpdm_flower.fedapp.secagg import NodeIdentity, TrustStore
from resumeapp.task import Net, load_partition, train

torch.set_num_threads(1)


def _state_dir(context: Context) -> Any:
    """The device's own snapshot directory (node config), else the run config's (a simulation stands in)."""
    return context.node_config.get("state-dir") or context.run_config.get("state-dir")


_MODS: dict[str, list[Any]] = {}


def _mods(context: Context) -> list[Any]:
    mode, keys = str(context.run_config["mode"]), str(context.run_config["keys-dir"])
    if mode not in _MODS:
        mods: list[Any] = [persistent_state_mod(_state_dir)]  # first: it restores before the others read the state
        if mode == "secure-robust":
            mods.append(secure_buffers_mod(
                identity=lambda ctx: NodeIdentity.load(Path(keys) / f"node-{ctx.node_config['partition-id']}.pem"),
                trust_store=lambda ctx: TrustStore.load(Path(keys) / "trust.json")))
        _MODS[mode] = mods
    return _MODS[mode]


def chain(msg: Message, context: Context, call_next: Any) -> Message:
    mods = _mods(context)

    def call(i: int, m: Message, c: Context) -> Message:
        return call_next(m, c) if i == len(mods) else mods[i](m, c, lambda m2, c2: call(i + 1, m2, c2))

    return call(0, msg, context)


app = ClientApp(mods=[chain])
plain = ClientApp()


@plain.train()
def plain_train(msg: Message, context: Context) -> Message:
    rc, pid = context.run_config, int(context.node_config["partition-id"])
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    rnd = int(msg.content["config"]["server-round"])
    loss = train(net, load_partition(pid, int(rc["samples-per-node"])), float(rc["lr"]),
                 seed=int(rc["seed"]) * 1000 + 10 * rnd + pid)
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()),
                               "metrics": MetricRecord({"train_loss": loss, "num-examples": 100 + 10 * pid})}),
                   reply_to=msg)


def client_fn(context: Context) -> FedPDMClient:
    x, y = load_partition(int(context.node_config["partition-id"]), int(context.run_config["samples-per-node"]))
    return FedPDMClient(Net(), DataLoader(TensorDataset(x, y), batch_size=20), seed=int(context.run_config["seed"]))


fedpdm = FedPDMClient.client_app(client_fn)


def _route(msg: Message, context: Context) -> Message:
    target = fedpdm if str(context.run_config["mode"]) == "fedpdm" else plain
    return target(msg, context)


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    return _route(msg, context)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    return _route(msg, context)


@app.query("whoami")
def whoami(msg: Message, context: Context) -> Message:
    return _route(msg, context)
