"""ClientApp of the reproduction app: the run config picks the algorithm, the public client answers.

The node's client is built once per (run, node, run config) and process by the algorithm's client builder
(:mod:`fedpdm_flower.fedapp.apps`: the run's model zoo entry, the node's partition, the run seed as the device seed) and then
answers every message itself (:meth:`fedpdm_flower.clients.base.FedClient.handle`: train, evaluate, query.whoami and the
algorithm's query phases such as FedREP's propose). `handle` is the whole client side of one message; the
in-process driver calls it with the same RecordDicts. An exception becomes an error reply whose reason is
``"<Type>: <message>"`` (see `answer`), which the server quotes when it stops a run (fedpdm_flower.strategies.base.RoundFailed).
"""

from __future__ import annotations

import re
import traceback
from functools import lru_cache
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from fedpdm_flower.fedapp.config import RunConfig, debug_enabled, parse_run_config
from fedpdm_flower.fedapp.registry import ALGORITHMS

#: the config keys of fedpdm_flower.strategies.base (RUN_TOKEN_KEY, ROUND_KEY), literal: a node imports no server code
RUN_TOKEN_KEY, ROUND_KEY = "run-token", "server-round"

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
    """Answer one message's content with the node's client (its state restored / persisted by :func:`state_files`
    when the node keeps it on disk)."""
    files = state_files(content, context)
    if files is not None and len(context.state) == 0:  # a fresh Context: this process's first message of the run
        restore_state(context, files[0], files[1])
    reply = make_client(context).handle(message_type, content)
    if files is not None:
        persist_state(context, files[0], files[1])
    return reply  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------------------------
# Client state that survives the run (docs/deployment.md "Checkpoints and resume"). Flower gives each run fresh Contexts, so a
# ServerApp that crashes and is resumed as a new run would meet clients without their duals, control variates and
# ledgers. A node that keeps a state directory (node config ``state-dir``, else the run config's
# ``client-state-dir``) writes its context.state there after every message that carries the run's token, as one
# snapshot per round (the two latest kept), and a fresh Context of a run with the same token (a resumed run) starts
# from the latest snapshot of a round before the one asked for: the server's checkpoint may be one round behind the
# clients (a crash after the replies, before the checkpoint), and that round is then re-done from the state before it.
_TOKEN = re.compile(r"[0-9a-f]{8,64}")
#: snapshots kept per node: the latest round's, and the one before it
KEEP_SNAPSHOTS = 2


def state_files(content: RecordDict, context: Context) -> tuple[Path, int] | None:
    """(this node's state directory for the message's run token, the message's round), or None when the node does
    not persist its state or the message has no run token / round."""
    where = context.node_config.get("state-dir") or context.run_config.get("client-state-dir")
    cfg = content.config_records.get("config")
    token = cfg.get(RUN_TOKEN_KEY) if cfg is not None else None
    rnd = cfg.get(ROUND_KEY) if cfg is not None else None
    if not where or not isinstance(token, str) or not _TOKEN.fullmatch(token) or not isinstance(rnd, int):
        return None
    pid = context.node_config.get("partition-id", context.node_id)
    return Path(str(where)).expanduser() / f"run-{token}" / f"node-{int(pid)}", int(rnd)


def _snapshots(folder: Path) -> dict[int, Path]:
    out = {}
    for path in folder.glob("round-*.state") if folder.is_dir() else ():
        try:
            out[int(path.stem.split("-", 1)[1])] = path
        except ValueError:
            continue
    return out


def restore_state(context: Context, folder: Path, server_round: int) -> None:
    """Fill an empty context.state with the latest snapshot of a round before ``server_round`` (if any)."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    earlier = {r: p for r, p in _snapshots(folder).items() if r < server_round}
    if not earlier:
        return
    path = earlier[max(earlier)]
    proto = ProtoRecordDict()
    proto.ParseFromString(path.read_bytes())
    for key, record in recorddict_from_proto(proto).items():
        context.state[key] = record
    log(INFO, "node %s: state of round %d restored from %s", context.node_id, max(earlier), path)


def persist_state(context: Context, folder: Path, server_round: int) -> None:
    """Write context.state as this round's snapshot (temporary file + os.replace), then drop older snapshots."""
    from flwr.common.serde import recorddict_to_proto

    from fedpdm_flower.fedapp.checkpoint import atomic_write

    folder.mkdir(parents=True, exist_ok=True)
    blob = recorddict_to_proto(context.state).SerializeToString()
    target = folder / f"round-{server_round:06d}.state"
    atomic_write(target, blob)
    for rnd in sorted(_snapshots(folder))[:-KEEP_SNAPSHOTS]:
        (folder / f"round-{rnd:06d}.state").unlink(missing_ok=True)


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
