"""Device state that outlives a Flower run: snapshots of ``context.state`` that a restarted server's devices resume from.

Flower gives every run fresh Contexts, so a ServerApp that was killed and started again -- a new Flower run, resumed
from its checkpoint by :class:`fedpdm_flower.strategies.checkpointed.Checkpointed` or by the reproduction app's
``resume=true`` -- would meet devices without their duals, error memories, control variates and privacy ledgers.
A device that keeps a state directory carries them over:

* after every message that carries the run's token and round (config keys ``run-token`` and ``server-round``, which
  Checkpointed and our strategies put into every message they send), the device writes its ``context.state`` as
  the snapshot of that round, ``<dir>/run-<token>/node-<partition-id>/round-<r>.state`` (Flower's RecordDict
  protobuf behind a SHA-256, written atomically: temporary file, fsync, ``os.replace``); the two latest are kept;
* the first such message on a fresh Context (the first message of the resumed run) restores everything from the
  latest snapshot of a round **before** the message's round -- the server's checkpoint may be one round behind the
  device (the server died after the device answered, before its checkpoint), and that round is then done again
  from the state before it -- **except** the records named in ``keep_latest``, which come from the newest
  snapshot whatever its round. Those are the records that must never go back: a privacy ledger (a release the
  device made in the round that is done again was seen by the server and stays spent, so a redone round costs a
  second release) and the secure aggregation's last masked round (a device never masks the same round twice, which
  would give the server two sums of one update over different buffers).

The token is the server's label of the run (hex only: it names a directory), the same in the crashed and the
resumed run and fresh for a new run, so a new run never starts from an old run's state. It is the server's choice:
a bound on a device's total privacy spend across runs needs the device's own ledger file (``privacy-ledger`` of
the FedPDM family, ``DeviceDPSGD(ledger_path=...)``), not these snapshots.

Use it in any ClientApp as a mod (first in the list, so that it restores before the others read the state)::

    app = ClientApp(mods=[persistent_state_mod()])          # node config state-dir=/var/lib/fl/state

or as a call inside a handler: ``snapshots.restore(msg.content, context)`` before the work and
``snapshots.persist(msg.content, context)`` after it, with ``snapshots = StateSnapshots(directory)``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

__all__ = ["KEEP_LATEST", "SNAPSHOTS_KEPT", "StateSnapshots", "persist_state", "persistent_state_mod", "restore_state",
           "snapshot_folder"]

#: config keys the server labels its messages with (fedpdm_flower.strategies.base; literal: a device imports no server code)
RUN_TOKEN_KEY, ROUND_KEY = "run-token", "server-round"
#: context.state records that are never rolled back: the privacy ledgers of our clients (FedPDM family, the
#: distributed-DP share, DP-SGD, DPQ-DSGD, DP-RECAL) and the secure aggregation's last masked round
KEEP_LATEST = ("privacy", "ddp.ledger", "dpsgd", "dpq-ledger", "dprecal-ledger", "secure.last-round")
#: snapshots kept per node: the latest round's and the one before it
SNAPSHOTS_KEPT = 2
#: context.state record naming the run the state belongs to (restore once per fresh Context)
MARK = "state.run"
_TOKEN = re.compile(r"[0-9a-f]{8,64}")
_MAGIC = b"fedpdm-state/1\n"


def _config(content: RecordDict) -> ConfigRecord | None:
    records = content.config_records
    if "config" in records:
        return records["config"]
    return next(iter(records.values())) if len(records) == 1 else None


def snapshot_folder(directory: str | Path, content: RecordDict, context: Context) -> tuple[Path, int] | None:
    """(this node's snapshot folder for the message's run token, the message's round) under ``directory``, or None
    when the message carries no (valid) token or round."""
    cfg = _config(content)
    token = cfg.get(RUN_TOKEN_KEY) if cfg is not None else None
    rnd = cfg.get(ROUND_KEY) if cfg is not None else None
    if not isinstance(token, str) or not _TOKEN.fullmatch(token) or isinstance(rnd, bool) or not isinstance(rnd, int):
        return None
    pid = context.node_config.get("partition-id")
    node = pid if isinstance(pid, int) and not isinstance(pid, bool) else int(context.node_id)
    return Path(str(directory)).expanduser() / f"run-{token}" / f"node-{node}", rnd


def _snapshots(folder: Path) -> dict[int, Path]:
    out = {}
    for path in folder.glob("round-*.state") if folder.is_dir() else ():
        try:
            out[int(path.stem.split("-", 1)[1])] = path
        except ValueError:
            continue
    return out


def _read(path: Path) -> RecordDict:
    """A snapshot's RecordDict; ValueError naming the file when it fails its SHA-256."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    raw = path.read_bytes()
    head, digest, blob = raw[:len(_MAGIC)], raw[len(_MAGIC):len(_MAGIC) + 32], raw[len(_MAGIC) + 32:]
    if head != _MAGIC or hashlib.sha256(blob).digest() != digest:
        raise ValueError(f"the state snapshot {path} is damaged (it does not match its SHA-256)")
    proto = ProtoRecordDict()
    proto.ParseFromString(blob)
    return recorddict_from_proto(proto)


def restore_state(context: Context, folder: Path, server_round: int,
                  keep_latest: Iterable[str] = KEEP_LATEST) -> int | None:
    """Fill context.state from ``folder``: the latest snapshot of a round before ``server_round``, then the
    ``keep_latest`` records of the newest snapshot (module docstring). Returns the round restored from (None: no
    snapshot before ``server_round``)."""
    snaps = _snapshots(folder)
    earlier = [r for r in snaps if r < server_round]
    base = max(earlier) if earlier else None
    if base is not None:
        for key, record in _read(snaps[base]).items():
            context.state[key] = record
        log(INFO, "node %s: state of round %d restored from %s", context.node_id, base, snaps[base])
    newest = max(snaps) if snaps else None
    if newest is not None and newest != base:
        latest = _read(snaps[newest])
        kept = [k for k in keep_latest if k in latest]
        for key in kept:
            context.state[key] = latest[key]
        if kept:
            log(INFO, "node %s: %s kept from round %d (never rolled back)", context.node_id, kept, newest)
    return base


def persist_state(context: Context, folder: Path, server_round: int, keep: int = SNAPSHOTS_KEPT) -> None:
    """Write context.state as this round's snapshot (atomically), then drop all but the ``keep`` latest."""
    from flwr.common.serde import recorddict_to_proto

    from fedpdm_flower.fedapp.checkpoint import atomic_write

    folder.mkdir(parents=True, exist_ok=True)
    blob = recorddict_to_proto(context.state).SerializeToString()
    atomic_write(folder / f"round-{server_round:06d}.state", _MAGIC + hashlib.sha256(blob).digest() + blob)
    for rnd in sorted(_snapshots(folder))[:-keep]:
        (folder / f"round-{rnd:06d}.state").unlink(missing_ok=True)


class StateSnapshots:
    """A device's snapshot store (module docstring).

    Parameters
    ----------
    directory
        Where the snapshots go: a path, a callable ``(context) -> path or None``, or None (default): the node
        config's ``state-dir`` (the device's own setting). No directory: nothing is restored or written.
    keep_latest
        The context.state records never rolled back (default :data:`KEEP_LATEST`); add a ledger of your own here.
    """

    def __init__(self, directory: str | Path | Callable[[Context], Any] | None = None, *,
                 keep_latest: Iterable[str] = KEEP_LATEST) -> None:
        if directory is not None and not callable(directory) and not isinstance(directory, str | Path):
            raise TypeError(f"directory must be a path, a callable (context) -> path, or None (node config "
                            f"'state-dir'), got {type(directory).__name__}")
        self.directory = directory
        self.keep_latest = tuple(keep_latest)

    def where(self, content: RecordDict, context: Context) -> tuple[Path, int] | None:
        """(this node's folder for the message's run, its round), or None (no directory, no token or no round)."""
        root: Any = (context.node_config.get("state-dir") if self.directory is None
                     else self.directory(context) if callable(self.directory) else self.directory)
        if not root:
            return None
        return snapshot_folder(str(root), content, context)

    def restore(self, content: RecordDict, context: Context) -> int | None:
        """On the first labelled message of a run on a fresh Context, restore this node's state (returns the round
        restored from); otherwise nothing."""
        return self.restore_at(self.where(content, context), context)

    def restore_at(self, found: tuple[Path, int] | None, context: Context) -> int | None:
        """:meth:`restore` for the (folder, round) of :meth:`where`."""
        if found is None:
            return None
        folder, rnd = found
        token = folder.parent.name.removeprefix("run-")
        mark = context.state.config_records.get(MARK)
        if mark is not None and mark.get("token") == token:
            return None
        base = restore_state(context, folder, rnd, self.keep_latest)
        context.state[MARK] = ConfigRecord({"token": token})
        return base

    def persist(self, content: RecordDict, context: Context) -> None:
        """Write this node's state as the snapshot of the message's round (nothing for an unlabelled message)."""
        self.persist_at(self.where(content, context), context)

    def persist_at(self, found: tuple[Path, int] | None, context: Context) -> None:
        """:meth:`persist` for the (folder, round) of :meth:`where`."""
        if found is not None:
            persist_state(context, *found)


def persistent_state_mod(directory: str | Path | Callable[[Context], Any] | None = None, *,
                         keep_latest: Iterable[str] = KEEP_LATEST) -> Mod:
    """A client mod carrying the node's ``context.state`` over a restarted server (:class:`StateSnapshots`).

    Put it first in ``ClientApp(mods=[...])``. A snapshot that cannot be read (damaged) or written (disk full)
    turns the message into an error reply naming why: a reply whose state change (a ledger entry) is not on disk
    is withheld, so that nothing is released that a restart would forget.
    """
    store = StateSnapshots(directory, keep_latest=keep_latest)

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        try:  # where, before the mods after this one rewrite the message
            found = store.where(msg.content, context)
            store.restore_at(found, context)
        except (OSError, ValueError) as err:
            return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION,
                                 reason=f"persistent_state_mod: cannot restore the device state: {err}"), reply_to=msg)
        reply = call_next(msg, context)
        try:
            store.persist_at(found, context)
        except OSError as err:
            return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION,
                                 reason=f"persistent_state_mod: the device state could not be written ({err}); the "
                                        "reply is withheld"), reply_to=msg)
        return reply

    return mod
