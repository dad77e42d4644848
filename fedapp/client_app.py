"""ClientApp: route each Flower Message to the configured algorithm's NumPyClient.

    train            -> client.fit(parameters, config)
    evaluate         -> client.evaluate(parameters, config)
    query.whoami     -> client.get_properties(config)   (the server learns node id -> partition id)
    query.<phase>    -> client.<phase>(parameters, config) -> (arrays, metrics)   (extra phases, e.g. FedREP's propose)

`handle` is the whole client side of one message; the in-process driver calls it with the same RecordDicts.
An exception in `handle` becomes an error reply whose reason is ``"<Type>: <message>"`` (see `answer`), which the
server quotes when it stops a run (fedapp/strategy_base.py, RoundFailed).
"""

from __future__ import annotations

import traceback
from functools import lru_cache
from logging import ERROR
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from fedapp.config import RunConfig, debug_enabled, parse_run_config
from fedapp.registry import ALGORITHMS
from fedapp.wire import reply_content

app = ClientApp()


@lru_cache(maxsize=8)
def _parse(items: tuple[tuple[str, object], ...]) -> RunConfig:
    return parse_run_config(dict(items))


#: clients of the public layer, one per (run, node, run config) and process: data and model load once
_CLIENTS: dict[tuple[int, int, tuple[tuple[str, object], ...]], Any] = {}


def make_client(context: Context) -> Any:
    """The algorithm's NumPyClient for this node, built from the run config and the node's context."""
    items = tuple(sorted(context.run_config.items()))
    cfg = _parse(items)
    spec = ALGORITHMS[cfg.algorithm]
    if not spec.public:
        return spec.make_client(cfg, context)
    key = (int(context.run_id), int(context.node_id), items)
    client = _CLIENTS.get(key)
    if client is None:
        if len(_CLIENTS) >= 256:
            _CLIENTS.clear()
        client = _CLIENTS[key] = spec.make_client(cfg, context)
    client.bind(context)
    return client


def handle(message_type: str, content: RecordDict, context: Context) -> RecordDict:
    """Answer one message's content; exceptions become Flower error replies (the server logs them)."""
    if message_type == "query.whoami":  # answered from node_config alone: no need to load data
        nc = context.node_config
        info: dict[str, Any] = {"partition-id": int(nc["partition-id"]), "num-partitions": int(nc["num-partitions"])}
        return RecordDict({"info": ConfigRecord(info)})
    client = make_client(context)
    if hasattr(client, "handle"):  # a client of the public layer answers the whole message itself
        return client.handle(message_type, content)  # type: ignore[no-any-return]
    config: dict[str, Any] = dict(content.config_records["config"]) if "config" in content.config_records else {}
    params = content.array_records["arrays"].to_numpy_ndarrays()
    if message_type == "train":
        arrays, n, metrics = client.fit(params, config)
        return reply_content(arrays, n, metrics)
    if message_type == "evaluate":
        loss, n, eval_metrics = client.evaluate(params, config)
        return RecordDict({"metrics": MetricRecord({**eval_metrics, "loss": loss, "num-examples": n})})
    if message_type.startswith("query."):  # an algorithm's extra phase, e.g. FedREP's query.propose
        method = getattr(client, message_type.removeprefix("query."), None)
        if not callable(method):
            raise ValueError(f"algorithm {cfg_name(client)!r} does not answer {message_type!r}")
        arrays, metrics = method(params, config)
        return reply_content(arrays, 0, metrics)
    raise ValueError(f"unsupported message type {message_type!r}")


def answer(message_type: str, content: RecordDict, context: Context) -> RecordDict | str:
    """`handle`, or the text of its exception: ``"<Type>: <message>"``.

    Every driver builds the error reason here, so the server quotes the same text from the in-process driver, the
    simulation and a deployment. The node logs the traceback only with FEDAPP_DEBUG=1: otherwise a bad run config
    would print one traceback per client per round, while the server's one line already names the cause.
    """
    try:
        return handle(message_type, content, context)
    except Exception as err:  # any client failure is this message's failure, reported to the server
        if debug_enabled():
            log(ERROR, "node %s: %s failed:\n%s", context.node_id, message_type, traceback.format_exc())
        return f"{type(err).__name__}: {err}"


def _reply(message_type: str, msg: Message, context: Context) -> Message:
    out = answer(message_type, msg.content, context)
    if isinstance(out, str):
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=out), reply_to=msg)
    return Message(out, reply_to=msg)


def cfg_name(client: Any) -> str:
    """The algorithm key a client was built for (for error messages)."""
    return str(client.cfg.algorithm)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training round."""
    return _reply("train", msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Federated evaluation of a dense model on the local partition."""
    return _reply("evaluate", msg, context)


@app.query("propose")
def propose(msg: Message, context: Context) -> Message:
    """FedREP phase 1: local training, ConSpar coordinate proposal and a fresh secure-aggregation key."""
    return _reply("query.propose", msg, context)


@app.query("register")
def register(msg: Message, context: Context) -> Message:
    """DP-RECAL's registration before iteration 1: initialise the agent's state, report L_i, alpha_i, m_i."""
    return _reply("query.register", msg, context)


@app.query("whoami")
def whoami(msg: Message, context: Context) -> Message:
    """Report partition-id / num-partitions."""
    return _reply("query.whoami", msg, context)
