"""ClientApp: Flower's template train function on the user's CNN, plus our mods for the wrappers the run uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedpdm_flower.clients.distributed_dp import DeviceSkellam
from fedpdm_flower.clients.dpsgd import DeviceDPSGD
from fedpdm_flower.clients.mods import compress_mod, secure_buffers_mod
from fedpdm_flower.fedapp.secagg import NodeIdentity, TrustStore
from wrapped_fedavg.task import Net, load_partition, train

torch.set_num_threads(1)

_MODS: dict[tuple[str, str], list[Any]] = {}
_DPSGD: dict[tuple[float, float, int, float], DeviceDPSGD] = {}


def _device_dp(context: Context) -> DeviceDPSGD | None:
    """The device's DP-SGD policy when ``dpsgd-epsilon`` > 0. A real device would read it from its own node config
    (the server cannot be trusted to set it); here the run config stands in for that."""
    rc = context.run_config
    eps = float(rc["dpsgd-epsilon"])
    if eps <= 0:
        return None
    key = (eps, float(rc["dp-delta"]), int(rc["num-server-rounds"]), float(rc["dpsgd-clip"]))
    if key not in _DPSGD:  # one object per policy: its noise calibration is cached
        _DPSGD[key] = DeviceDPSGD(epsilon=key[0], delta=key[1], max_rounds=key[2], clip_norm=key[3])
    return _DPSGD[key]


def _mods_for(context: Context) -> list[Any]:
    """The client side of the wrappers the server uses (the same run config tells both)."""
    wrappers, keys = str(context.run_config["wrappers"]), str(context.run_config["keys-dir"])
    if (wrappers, keys) not in _MODS:
        mods: list[Any] = []
        if "compressed" in wrappers:
            mods.append(compress_mod())  # decodes the downlink, sends top-k of (update + error memory)
        if "secure" in wrappers or "distributed-dp" in wrappers:
            pem = lambda ctx: NodeIdentity.load(Path(keys) / f"node-{ctx.node_config['partition-id']}.pem")  # noqa: E731
            # distributed DP: the device adds its share of Skellam noise and refuses less than its owner's floor. A
            # real device reads the floor from its own node config; here the run config stands in for that
            ddp = (DeviceSkellam(min_noise_multiplier=float(context.run_config["ddp-min-noise-multiplier"]))
                   if "distributed-dp" in wrappers else None)
            mods.append(secure_buffers_mod(identity=pem, trust_store=lambda ctx: TrustStore.load(Path(keys) / "trust.json"),
                                           distributed_dp=ddp))
        _MODS[(wrappers, keys)] = mods
    return _MODS[(wrappers, keys)]


def wrapper_mods(msg: Message, context: Context, call_next: Any) -> Message:
    """Run this message through the mods of the run's wrappers, in order, then the train function."""
    chain = _mods_for(context)

    def call(i: int, m: Message, c: Context) -> Message:
        return call_next(m, c) if i == len(chain) else chain[i](m, c, lambda m2, c2: call(i + 1, m2, c2))

    return call(0, msg, context)


app = ClientApp(mods=[wrapper_mods])


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    rc, pid = context.run_config, int(context.node_config["partition-id"])
    net = Net()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    loader = load_partition(pid, int(context.node_config["num-partitions"]), int(rc["samples-per-node"]),
                            int(rc["batch-size"]))
    device_dp = _device_dp(context)
    extra: dict[str, float] = {}
    if device_dp is not None:  # record-level DP-SGD through Opacus instead of the template's loop
        extra = device_dp.train(net, loader, lr=float(rc["lr"]), context=context, momentum=0.9)
        loss = float(extra.pop("train_loss", 0.0))
    else:
        loss = train(net, loader, int(rc["local-epochs"]), float(rc["lr"]))
    state = net.state_dict()
    if str(pid) in str(rc["byzantine"]).split(","):  # a compromised node: a well-formed, reversed update
        scale = float(rc["byzantine-scale"])
        state = {k: before[k] - scale * (v - before[k]) for k, v in state.items()}
    return Message(RecordDict({"arrays": ArrayRecord(state),
                               "metrics": MetricRecord({"train_loss": loss, "num-examples": len(loader.dataset),
                                                           **extra})}),
                   reply_to=msg)
