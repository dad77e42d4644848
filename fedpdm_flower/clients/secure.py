"""The device side of the threshold secure aggregation (:mod:`fedpdm_flower.fedapp.secagg`), shared by every client that uses it.

One implementation, two users: :func:`fedpdm_flower.clients.mods.secure_buffers_mod` (a user's ClientApp under
:class:`fedpdm_flower.strategies.wrappers.SecureBuffers`) and :class:`fedpdm_flower.clients.fedrep.FedREPClient` in secure mode (FedREP's
buffers). Each step reads an untrusted message and the device's own state (``context.state``) and either answers or
raises ValueError naming what it refuses; the caller turns that into a Flower error reply.

A device in secure mode (:class:`SecureDevice`) holds its long-term identity, its trust store and the smallest buffer
it accepts. Per round (the protocol of :mod:`fedpdm_flower.fedapp.secagg`):

* :func:`key_reply`: a fresh key pair for the round, the public part signed with the identity; refused for a round
  not after the last one this device masked in (a replay);
* :func:`accept_mask`: the buffer (this device among at least ``min_buffer`` members, a majority threshold >= 2)
  and every mate's key (signed for this run and round by an identity in the trust store, a valid SECP384R1 key)
  are checked, and this round's own key must be the one the device made -- before anything is trained or sent;
* :func:`mask_reply`: the vector masked (pairwise masks + a Shamir-shared self-mask), the sealed shares and the
  commitment; the round becomes the last masked one and its key is used up;
* :func:`unmask_reply`: once per round, per mate, the share of its self-mask seed (it survived) or the pairwise
  seed (it dropped) -- never both -- optionally with the next round's signed key (SecureBuffers' steady rounds).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from numpy.typing import NDArray

from fedpdm_flower.fedapp import secagg
from fedpdm_flower.fedapp.secagg import (
    S_BUFFER,
    S_CLIP,
    S_COUNT,
    S_DROPPED,
    S_INFO,
    S_LEVELS,
    S_MEMBERS,
    S_RECORD,
    S_ROUND,
    S_RUN,
    S_SURVIVORS,
    S_THRESHOLD,
    NodeIdentity,
    TrustStore,
)

__all__ = ["MaskRequest", "SecureDevice", "accept_mask", "key_reply", "mask_reply", "unmask_reply"]

#: context.state: the key for the next round, the round in progress, the last round this node masked
NEXT_KEY, PENDING, LAST = "secure.next-key", "secure.pending", "secure.last-round"


def _record(arrays: Mapping[str, NDArray[Any]]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.require(v, requirements="C")) for k, v in arrays.items()})


def _bytes_array(data: bytes) -> NDArray[np.uint8]:
    return np.frombuffer(data, np.uint8).copy()


class SecureDevice:
    """A device in secure mode: it never sends an update in the clear, whatever a message says.

    Parameters
    ----------
    identity
        The node's :class:`fedpdm_flower.fedapp.secagg.NodeIdentity`, or a callable ``(context) -> NodeIdentity``; None reads the
        PEM file named by node config ``secure-identity``.
    trust_store
        The device's :class:`fedpdm_flower.fedapp.secagg.TrustStore` (client id -> Ed25519 key of the peers it accepts), or a
        callable ``(context) -> TrustStore``; None reads the JSON file named by node config ``secure-trust-store``.
        Whoever writes the trust store decides who the peers are.
    min_buffer
        The smallest buffer this device accepts (default 3: in a buffer of 2, one colluding mate learns the other's
        update from the buffer sum; FedREP's paper setting s = 2 needs 2, the weaker setting).
    """

    def __init__(self, identity: Any = None, trust_store: Any = None, *, min_buffer: int = 3) -> None:
        if isinstance(min_buffer, bool) or not isinstance(min_buffer, int) or min_buffer < 2:
            raise ValueError(f"min_buffer must be an integer >= 2, got {min_buffer!r}")
        for name, value, kind in (("identity", identity, "sign"), ("trust_store", trust_store, "verify")):
            if value is not None and not callable(value) and not hasattr(value, kind):
                raise TypeError(f"{name} must be a {'NodeIdentity' if kind == 'sign' else 'TrustStore'}, a callable "
                                f"(context) -> one, or None (node config), got {type(value).__name__}")
        self.identity, self.trust_store, self.min_buffer = identity, trust_store, min_buffer

    def resolve(self, context: Context) -> tuple[NodeIdentity, TrustStore]:
        """This node's identity and trust store (from the arguments, or the files its node config names)."""
        return (_load(self.identity, context, "secure-identity", NodeIdentity.load, "sign"),
                _load(self.trust_store, context, "secure-trust-store", TrustStore.load, "verify"))

    @staticmethod
    def client_id(context: Context) -> int:
        """The node's id in its peers' trust stores: its ``partition-id``."""
        me = context.node_config.get("partition-id")
        if isinstance(me, bool) or not isinstance(me, int):
            raise ValueError("secure mode needs the node's partition-id (its id in the peers' trust stores)")
        return me

    def __repr__(self) -> str:
        return f"SecureDevice(min_buffer={self.min_buffer})"


def _load(value: Any, context: Context, key: str, loader: Callable[[str], Any], kind: str) -> Any:
    if value is None:
        path = context.node_config.get(key)
        if not isinstance(path, str) or not path:
            raise ValueError(f"secure mode needs node config {key!r} (a file path) or the device's argument")
        return loader(path)
    return value(context) if callable(value) and not hasattr(value, kind) else value


def config_int(cfg: Mapping[str, Any], key: str) -> int:
    """An integer of an untrusted message config (ValueError naming the key otherwise)."""
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"message config {key!r} must be an integer, got {v!r}")
    return v


def _ids(cfg: Mapping[str, Any], key: str) -> list[int]:
    try:
        raw = json.loads(str(cfg.get(key, "null")))
    except ValueError:
        raw = None
    if not isinstance(raw, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in raw):
        raise ValueError(f"message config {key!r} must be a JSON list of client ids")
    if len(set(raw)) != len(raw):
        raise ValueError(f"message config {key!r} repeats a client id")
    return list(raw)


def _last_round(state: RecordDict) -> int | None:
    last = state.config_records.get(LAST)
    return None if last is None else int(last["round"])  # type: ignore[arg-type]


def check_new_round(state: RecordDict, server_round: int) -> None:
    """Refuse a round that is not after the last one this device masked in (a replayed or rewound round)."""
    last = _last_round(state)
    if last is not None and server_round <= last:
        raise ValueError(f"round {server_round} is not after round {last}, which this node already masked")


def key_reply(state: RecordDict, ident: NodeIdentity, me: int, run: str, server_round: int) -> RecordDict:
    """A fresh key pair for ``server_round`` of run ``run``: the private part kept in ``state``, the public part
    signed. Reply records: ``secure`` {pk, sig} and ``secure-info`` {client-id, round}."""
    check_new_round(state, server_round)
    sk, pk = secagg.new_keypair()
    state[NEXT_KEY] = ConfigRecord({"round": server_round, "run": run, "sk": sk})
    sig = ident.sign(secagg.signing_statement(run.encode(), server_round, me, pk))
    return RecordDict({S_RECORD: _record({"pk": _bytes_array(pk), "sig": _bytes_array(sig)}),
                       S_INFO: ConfigRecord({"client-id": me, "round": server_round})})


@dataclass(frozen=True)
class MaskRequest:
    """A mask request this device accepted: where it masks, with whom (verified keys by client id) and its key."""

    run: str
    server_round: int
    buffer_id: int
    members: list[int]
    threshold: int
    clip: float
    levels: int
    peers: dict[int, bytes]
    private_key: bytes
    count_clipped: bool = False

    @property
    def label(self) -> bytes:
        return secagg.round_label(self.run, self.server_round, self.buffer_id)


def accept_mask(state: RecordDict, cfg: Mapping[str, Any], peers_record: ArrayRecord | None, me: int,
                trust: TrustStore, min_buffer: int) -> MaskRequest:
    """Check a mask request before anything is trained or sent (ValueError names what is refused): the buffer, the
    fixed-point code, this round's own key, the round not replayed, every mate's key signed by its trusted identity
    for this run and round."""
    run, rnd, buffer_id = str(cfg.get(S_RUN, "")), config_int(cfg, S_ROUND), config_int(cfg, S_BUFFER)
    if not run:
        raise ValueError(f"message config {S_RUN!r} (the run label) is missing")
    members, t = _ids(cfg, S_MEMBERS), config_int(cfg, S_THRESHOLD)
    clip, levels = cfg.get(S_CLIP), config_int(cfg, S_LEVELS)
    secagg.check_buffer(me, members, t, min_buffer)
    if isinstance(clip, bool) or not isinstance(clip, int | float) or not 0 < clip < float("inf"):
        raise ValueError(f"message config {S_CLIP!r} = {clip!r} must be a finite number > 0")
    secagg._check_capacity(len(members), levels)
    key = state.config_records.get(NEXT_KEY)
    if key is None or int(key["round"]) != rnd or str(key["run"]) != run:  # type: ignore[arg-type]
        raise ValueError(f"this node holds no key of run {run!r} round {rnd} (keys are fresh for every round)")
    check_new_round(state, rnd)
    if peers_record is None:
        raise ValueError("the message carries no buffer-mate keys")
    peers: dict[int, bytes] = {}
    for cid in members:
        if cid == me:
            continue
        if f"pk.{cid}" not in peers_record or f"sig.{cid}" not in peers_record:
            raise ValueError(f"the message lacks the signed key of buffer-mate {cid}")
        pk, sig = peers_record[f"pk.{cid}"].numpy().tobytes(), peers_record[f"sig.{cid}"].numpy().tobytes()
        trust.verify(cid, secagg.signing_statement(run.encode(), rnd, cid, pk), sig)
        secagg.check_public_key(pk)
        peers[cid] = pk
    return MaskRequest(run, rnd, buffer_id, sorted(members), t, float(clip), levels, peers,
                       bytes(key["sk"]), cfg.get(S_COUNT) is True)  # type: ignore[arg-type]


def mask_reply(state: RecordDict, request: MaskRequest, x: NDArray[Any], rng: np.random.Generator, *,
               encoded: bool = False) -> ArrayRecord:
    """The ``secure`` record of the masked upload of ``x`` (masked, share.<mate>, commit); the round becomes the last
    one masked, its key is used up, and what the unmask step needs is kept in ``state``. ``encoded``: x is already
    a uint32 vector on the ring (distributed DP's encoding). When the request asks (``secure.count-clipped``), the
    quantized vector carries the count of coordinates the fixed-point code clipped
    (:func:`fedpdm_flower.fedapp.secagg.encode_counted`)."""
    me = next(c for c in request.members if c not in request.peers)
    if request.count_clipped and not encoded:  # the fixed-point code clips nothing silently: append the count
        x, encoded = secagg.encode_counted(x, len(request.members), rng, request.clip, request.levels), True
    sealed = secagg.mask_input(x, me, request.private_key, request.peers, request.threshold, request.label, rng,
                               request.clip, request.levels, encoded=encoded)
    out: dict[str, NDArray[Any]] = {"masked": sealed.masked, "commit": _bytes_array(sealed.commit)}
    out.update({f"share.{cid}": _bytes_array(blob) for cid, blob in sealed.shares.items()})
    state[PENDING] = ConfigRecord({
        "round": request.server_round, "run": request.run, "buffer": request.buffer_id, "members": request.members,
        "t": request.threshold, "own-share": sealed.own_share, "sk": request.private_key, "answered": False,
        "peer-ids": sorted(request.peers), "peer-keys": [request.peers[c] for c in sorted(request.peers)]})
    state[LAST] = ConfigRecord({"round": request.server_round})
    del state[NEXT_KEY]
    return _record(out)


def unmask_reply(state: RecordDict, ident: NodeIdentity, cfg: Mapping[str, Any], record: ArrayRecord | None, me: int,
                 *, next_key: bool) -> RecordDict:
    """Reveal, once per round, per buffer-mate: its self-mask share (it survived) or our pairwise seed (it dropped).

    With ``next_key`` the reply also carries a signed key for the next round (SecureBuffers: no key exchange in a
    steady round); FedREP's devices sign their next key in the next proposal instead.
    """
    pending = state.config_records.get(PENDING)
    run, rnd = str(cfg.get(S_RUN, "")), config_int(cfg, S_ROUND)
    if pending is None or int(pending["round"]) != rnd or str(pending["run"]) != run:  # type: ignore[arg-type]
        raise ValueError(f"this node masked nothing in run {run!r} round {rnd}")
    if bool(pending["answered"]):
        raise ValueError(f"this node already answered the unmask request of round {rnd} (it answers once)")
    if config_int(cfg, S_BUFFER) != int(pending["buffer"]):  # type: ignore[arg-type]
        raise ValueError("the unmask request names another buffer than the one this node masked in")
    survivors, dropped = _ids(cfg, S_SURVIVORS), _ids(cfg, S_DROPPED)
    label = secagg.round_label(run, rnd, int(pending["buffer"]))  # type: ignore[arg-type]
    peer_keys = dict(zip([int(c) for c in pending["peer-ids"]],  # type: ignore[union-attr]
                         [bytes(k) for k in pending["peer-keys"]], strict=True))  # type: ignore[union-attr,arg-type]
    rec = record if record is not None else ArrayRecord()
    sealed = {int(k.removeprefix("share.")): rec[k].numpy().tobytes() for k in rec if k.startswith("share.")
              and k.removeprefix("share.").lstrip("-").isdigit()}
    # reveal's checks first: a request refused for its survivors reveals nothing and does not use up the answer
    members, t = [int(c) for c in pending["members"]], int(pending["t"])  # type: ignore[union-attr,arg-type]
    if sorted([*survivors, *dropped]) != members or set(survivors) & set(dropped):
        raise ValueError(f"survivors {survivors} and dropped {dropped} must split the buffer {members}")
    if me not in survivors:
        raise ValueError("this node is told it dropped, yet it is asked to unmask")
    if len(survivors) < t:
        raise ValueError(f"{len(survivors)} survivor(s) are below the threshold {t}: nothing is revealed")
    pending["answered"] = True  # before anything is revealed: a second request of this round is refused
    state[PENDING] = pending
    shares, seeds = secagg.reveal(me, bytes(pending["sk"]), peer_keys,  # type: ignore[arg-type]
                                  bytes(pending["own-share"]), t, survivors, dropped, sealed, label)  # type: ignore[arg-type]
    out = {f"bshare.{cid}": _bytes_array(s) for cid, s in shares.items()}
    out.update({f"pseed.{cid}": _bytes_array(s) for cid, s in seeds.items()})
    info: ConfigRecord | None = None
    if next_key:  # the next round's key rides on this reply
        nxt = key_reply(state, ident, me, run, rnd + 1)
        out.update({k: v.numpy() for k, v in nxt.array_records[S_RECORD].items()})
        info = nxt.config_records[S_INFO]
    reply = RecordDict({S_RECORD: _record(out)})
    if info is not None:
        reply[S_INFO] = info
    return reply
