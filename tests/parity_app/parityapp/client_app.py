"""The user's ClientApp: the template's own train / evaluate, and the library's clients where an algorithm needs its
own local step.

* Flower's FedAvg and the wrappers around it: the user's train loop (``task.train``), unchanged; the wrappers' mods
  (``compress_mod``, ``secure_buffers_mod``) sit in front of it.
* The library's algorithms: the user's ``@app.train()`` hands the message to the algorithm's client, built from the
  user's model and data (``client.handle``), as API.md's "inside the user's own @app.train()" says; the other
  actions an algorithm needs are registered by name (``query.propose``, ``query.unmask``, ``query.register``).
* Evaluation is always the user's own ``@app.evaluate()`` on the node's validation images.

Which strategy a train message belongs to is in the user's own ``train_config`` (key "parity-strategy"): that it
arrives is part of what the test checks. Which pass (the model's norm and the samples' shape: "parity-norm",
"parity-samples") is in the train and evaluate configs. Every reply carries the user's own metric "user_lr_seen",
the value of the user's "user-lr" as received.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader

from fedpdm_flower.clients.dpq import DPQClient
from fedpdm_flower.clients.fedpdm import BSDPFedPDMClient
from fedpdm_flower.clients.fedrep import FedREPClient
from fedpdm_flower.clients.iadmm import IADMMClient
from fedpdm_flower.clients.mods import compress_mod, secure_buffers_mod
from fedpdm_flower.clients.recal import RecalClient
from fedpdm_flower.clients.secure import LAST, NEXT_KEY, PENDING, SecureDevice
from fedpdm_flower.fedapp.secagg import S_PHASE, S_RUN, NodeIdentity, TrustStore
from parityapp.task import Net, evaluate, images, train, train_data, val_data

#: the library's algorithms, whose local step is the library client's
OURS = ("bsdp-fedpdm", "fedrep", "fedrep-plain", "objp", "dp-recal", "dpq-dsgd")
#: context.state records of this app: the strategy and the secure run its messages last belonged to
TRACK = "parity.track"
SECURE_RECORDS = (NEXT_KEY, PENDING, LAST)

_MODS: dict[str, tuple[Any, Any]] = {}


def _cfg(msg: Message) -> dict[str, Any]:
    records = msg.content.config_records
    return dict(records["config"]) if "config" in records else {}


def _identity(context: Context) -> NodeIdentity:
    return NodeIdentity.load(Path(str(context.run_config["keys-dir"])) / f"node-{context.node_config['partition-id']}.pem")


def _trust(context: Context) -> TrustStore:
    return TrustStore.load(Path(str(context.run_config["keys-dir"])) / "trust.json")


def _track(msg: Message, context: Context, name: str | None = None) -> str:
    """The strategy this node now serves (``name``, else the message's "parity-strategy", else the last one). The
    node's context.state lives for the whole Flower run, and main() runs one strategy after the other: the user's
    app starts each strategy's state afresh (the secure records when a new secure run label appears, everything
    else when a new strategy name or a new pass does)."""
    cfg, rc = _cfg(msg), context.run_config
    first = ConfigRecord({"strategy": "", "run": "", "norm": str(rc["model-norm"]), "samples": str(rc["samples"])})
    track = dict(context.state.config_records.get(TRACK, first))
    name = name or str(cfg.get("parity-strategy", track["strategy"]))
    run = str(cfg.get(S_RUN, track["run"]))
    # the pass main() is in (its model norm and sample shape, in the train and evaluate configs; a query keeps the
    # last one): the same strategy in another pass starts afresh too
    norm, samples = str(cfg.get("parity-norm", track["norm"])), str(cfg.get("parity-samples", track["samples"]))
    changed = name != track["strategy"] or (norm, samples) != (track["norm"], track["samples"])
    for key in list(context.state.keys()):
        secure = key in SECURE_RECORDS
        if key != TRACK and ((secure and run != track["run"]) or (not secure and changed)):
            del context.state[key]
    context.state[TRACK] = ConfigRecord({"strategy": name, "run": run, "norm": norm, "samples": samples})
    return name


def _case(context: Context) -> tuple[str, str]:
    """(model norm, sample shape) of the pass this node serves now (``_track`` keeps it, from every message)."""
    track = context.state.config_records[TRACK]
    return str(track["norm"]), str(track["samples"])


def protocol_mods(msg: Message, context: Context, call_next: Any) -> Message:
    """The wrappers' device side in front of the user's functions: compress_mod always (it acts only on the
    Compressed wrapper's messages), secure_buffers_mod on the SecureBuffers / DistributedDP protocol's messages."""
    name = _track(msg, context)
    keys = str(context.run_config["keys-dir"])
    if keys not in _MODS:
        _MODS[keys] = (compress_mod(), secure_buffers_mod(identity=_identity, trust_store=_trust))
    compress, secure = _MODS[keys]
    chain = [compress]
    if msg.metadata.message_type == "train" and S_PHASE in _cfg(msg) and name != "fedrep":
        chain.append(secure)

    def call(i: int, m: Message, c: Context) -> Message:
        return call_next(m, c) if i == len(chain) else chain[i](m, c, lambda m2, c2: call(i + 1, m2, c2))

    return call(0, msg, context)


app = ClientApp(mods=[protocol_mods])


def library_client(name: str, context: Context) -> Any:
    """The algorithm's client on the user's model and data (built per message: its state is in context.state)."""
    rc, pid = context.run_config, int(context.node_config["partition-id"])
    norm, samples = _case(context)
    net, ce = Net(norm), nn.CrossEntropyLoss()
    data = train_data(pid, int(rc["samples-per-node"]), samples)
    loader = DataLoader(data, batch_size=int(rc["batch-size"]))
    if name == "bsdp-fedpdm":
        return BSDPFedPDMClient(net, loader, loss_fn=ce, context=context, seed=pid)
    if name in ("fedrep", "fedrep-plain"):
        secure = SecureDevice(_identity, _trust, min_buffer=2) if name == "fedrep" else None
        return FedREPClient(net, loader, loss_fn=ce, context=context, seed=pid, secure=secure)
    if name == "objp":
        return IADMMClient(net, loader, loss_fn=ce, context=context, seed=pid)
    if name == "dp-recal":  # a smooth loss with the user's bound on its gradient's Lipschitz constant
        return RecalClient(net, images(int(rc["samples-per-node"]), 100 + pid), loss_fn=ce, lipschitz=5.0,
                           context=context, seed=pid)
    if name == "dpq-dsgd":
        return DPQClient(net, data, loss_fn=ce, context=context, seed=pid, share_model=True)
    raise ValueError(f"no library client for strategy {name!r}")


def _with_user_metric(content: RecordDict, cfg: dict[str, Any]) -> RecordDict:
    if "metrics" in content.metric_records and "user-lr" in cfg:
        content.metric_records["metrics"]["user_lr_seen"] = float(cfg["user-lr"])
    return content


def _delegate(action: str, msg: Message, context: Context, name: str | None = None) -> Message:
    name = _track(msg, context, name)
    content = library_client(name, context).handle(action, msg.content)
    return Message(_with_user_metric(content, _cfg(msg)), reply_to=msg)


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    cfg, rc, pid = _cfg(msg), context.run_config, int(context.node_config["partition-id"])
    name = str(cfg["parity-strategy"])  # the user's own train_config key: a KeyError here fails the reply
    if name in OURS:
        return _delegate("train", msg, context)
    norm, samples = _case(context)
    net = Net(norm)
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = train_data(pid, int(rc["samples-per-node"]), samples)
    loss = train(net, data, lr=float(rc["lr"]), epochs=int(rc["local-epochs"]), batch_size=int(rc["batch-size"]))
    metrics = {"train_loss": loss, "num-examples": len(data), "user_lr_seen": float(cfg["user-lr"])}
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": MetricRecord(metrics)}),
                   reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    cfg, pid = _cfg(msg), int(context.node_config["partition-id"])
    net = Net(_case(context)[0])
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    val = val_data(pid)
    loss, acc = evaluate(net, val)
    metrics = {"eval_loss": loss, "eval_acc": acc, "user_eval_seen": float(cfg["user-eval-tag"]),
               "num-examples": len(val)}
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.query("whoami")
def whoami(msg: Message, context: Context) -> Message:
    nc = context.node_config
    return Message(RecordDict({"info": ConfigRecord({"partition-id": int(nc["partition-id"]),
                                                     "num-partitions": int(nc["num-partitions"])})}),
                   reply_to=msg)


@app.query("propose")
def propose(msg: Message, context: Context) -> Message:
    return _delegate("query.propose", msg, context)


@app.query("unmask")
def unmask(msg: Message, context: Context) -> Message:
    return _delegate("query.unmask", msg, context, "fedrep")  # only masked FedREP asks it


@app.query("register")
def register(msg: Message, context: Context) -> Message:
    return _delegate("query.register", msg, context, "dp-recal")  # only DP-RECAL's walk registers its agents
