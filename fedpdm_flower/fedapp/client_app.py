"""ClientApp of the reproduction app: the run config picks the algorithm, the public client answers.

The node's client is built once per (run, node, run config) and process by the algorithm's client builder
(:mod:`fedpdm_flower.fedapp.apps`: the run's model zoo entry, the node's partition, the run seed as the device seed) and then
answers every message itself (:meth:`fedpdm_flower.clients.base.FedClient.handle`: train, evaluate, query.whoami and the
algorithm's query phases such as FedREP's propose). `handle` is the whole client side of one message; the
in-process driver calls it with the same RecordDicts. An exception becomes an error reply whose reason is
``"<Type>: <message>"`` (see `answer`), which the server quotes when it stops a run (fedpdm_flower.strategies.base.RoundFailed).
"""

from __future__ import annotations

import traceback
from functools import lru_cache
from logging import ERROR
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from fedpdm_flower.clients.state import SNAPSHOTS_KEPT, StateSnapshots, persist_state, restore_state
from fedpdm_flower.fedapp.config import RunConfig, debug_enabled, parse_run_config
from fedpdm_flower.fedapp.registry import ALGORITHMS

__all__ = ["KEEP_SNAPSHOTS", "SNAPSHOTS", "answer", "app", "handle", "make_client", "persist_state", "restore_state",
           "state_files"]

app = ClientApp()


@lru_cache(maxsize=8)
def _parse(items: tuple[tuple[str, object], ...]) -> RunConfig:
    return parse_run_config(dict(items))


#: one client per (run, node, run config) and process: data and model load once, not once per message
_CLIENTS: dict[tuple[int, int, tuple[tuple[str, object], ...]], Any] = {}


def make_client(context: Context) -> Any:
    """The algorithm's client for this node (built once, then re-bound to each message's Context)."""
    items = tuple(sorted(context.run_config.items()))
    cfg = _parse(items)
    key = (int(context.run_id), int(context.node_id), items)
    client = _CLIENTS.get(key)
    if client is None:
        if len(_CLIENTS) >= 256:
            _CLIENTS.clear()
        client = _CLIENTS[key] = ALGORITHMS[cfg.algorithm].make_client(cfg, context)
    client.bind(context)
    return client


def handle(message_type: str, content: RecordDict, context: Context) -> RecordDict:
    """Answer one message's content with the node's client (its state restored / persisted by :data:`SNAPSHOTS`
    when the node keeps it on disk)."""
    found = SNAPSHOTS.where(content, context)
    SNAPSHOTS.restore_at(found, context)  # once per fresh Context: this process's first message of the run
    reply = make_client(context).handle(message_type, content)
    SNAPSHOTS.persist_at(found, context)
    return reply  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------------------------
# Client state that survives the run (docs/resume.md). Flower gives each run fresh Contexts, so a ServerApp that
# crashes and is resumed as a new run would meet clients without their duals, control variates and ledgers. A node
# that keeps a state directory (node config ``state-dir``, else the run config's ``client-state-dir``) keeps
# snapshots of its context.state per run token (fedpdm_flower.clients.state: the round before the one asked for is
# restored, the privacy ledgers never go back).
def _state_dir(context: Context) -> Any:
    return context.node_config.get("state-dir") or context.run_config.get("client-state-dir")


SNAPSHOTS = StateSnapshots(_state_dir)
#: snapshots kept per node: the latest round's, and the one before it
KEEP_SNAPSHOTS = SNAPSHOTS_KEPT


def state_files(content: RecordDict, context: Context) -> tuple[Path, int] | None:
    """(this node's state directory for the message's run token, the message's round), or None when the node does
    not persist its state or the message has no run token / round."""
    return SNAPSHOTS.where(content, context)


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
    """FedREP phase 1: local training, ConSpar coordinate proposal and (masked) this round's signed key."""
    return _reply("query.propose", msg, context)


@app.query("unmask")
def unmask(msg: Message, context: Context) -> Message:
    """FedREP phase 3 with masked buffers: reveal, once, the parts that unmask the buffer's survivors' sum."""
    return _reply("query.unmask", msg, context)


@app.query("register")
def register(msg: Message, context: Context) -> Message:
    """DP-RECAL's registration before iteration 1: initialise the agent's state, report L_i, alpha_i, m_i."""
    return _reply("query.register", msg, context)


@app.query("whoami")
def whoami(msg: Message, context: Context) -> Message:
    """Report partition-id / num-partitions."""
    return _reply("query.whoami", msg, context)
