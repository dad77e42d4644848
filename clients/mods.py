"""Client mods for the wrappers of :mod:`strategies.wrappers`, usable in any ClientApp.

A mod wraps the user's own ClientApp (``ClientApp(mods=[compress_mod(TopK(0.05))])``): the user's ``@app.train``
keeps receiving and returning its model in its own arrays, and the mod changes only what crosses the wire. Its
state lives in ``context.state``; every message is untrusted input, and a mod that cannot honour one answers with a
Flower error reply naming why.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from numpy.typing import NDArray

from fedapp.compression.codecs import Codec, codec_from_spec
from fedapp.layout import ArrayLayout

__all__ = ["compress_mod", "secure_buffers_mod"]

#: the protocol keys of strategies/wrappers.py Compressed (duplicated: a client does not import server code)
UPLINK, DOWNLINK, BASE_CRC, NEW_CRC = "compress.uplink", "compress.downlink", "compress.base-crc", "compress.crc"
REPLY_RECORD, CODE, CARRIED = "compress", "c.", "k."
#: context.state keys of compress_mod: the reference model (the user's layout) and the error memory
REFERENCE, MEMORY = "compress.reference", "compress.memory"


def _crc(x: NDArray[Any]) -> int:
    return zlib.crc32(np.ascontiguousarray(x, dtype=np.float64).tobytes())


def _record(arrays: Mapping[str, NDArray[Any]]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.require(v, requirements="C")) for k, v in arrays.items()})  # keeps 0-d arrays 0-d


def _named(record: ArrayRecord) -> dict[str, NDArray[Any]]:
    return {k: v.numpy() for k, v in record.items()}


def mod_error(msg: Message, reason: str) -> Message:
    """A Flower error reply from a mod (the server logs the reason with the node id)."""
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


def _config(msg: Message) -> tuple[str | None, dict[str, Any]]:
    records = msg.content.config_records
    key = "config" if "config" in records else (next(iter(records)) if len(records) == 1 else None)
    return key, ({} if key is None else dict(records[key]))


def compress_mod(codec: Codec | None = None, *, error_feedback: bool = True, seed: int | None = None) -> Mod:
    """The client side of :class:`strategies.wrappers.Compressed`.

    Downlink: rebuilds the dense model from a compressed change and the reference kept in ``context.state`` (CRC
    checked), so the user's train function gets its usual arrays. Uplink: sends ``code(update + e)``, update = the
    trained model minus that reference, keeping e = what the codec dropped in ``context.state`` (error feedback).

    Parameters
    ----------
    codec
        The device's uplink codec (``TopK``, ``RandK``, ``Quantizer``); None uses the one the server suggests, and
        sends the model uncompressed if it suggests none.
    error_feedback
        Keep and re-send what the codec drops (default True).
    seed
        Seed of the device's codec randomness (rand-k, quantizer rounding); None draws from the OS.
    """
    rng = np.random.default_rng(seed)

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        ckey, cfg = _config(msg)
        if msg.metadata.message_type != MessageType.TRAIN or NEW_CRC not in cfg:
            return call_next(msg, context)  # not a message of the Compressed wrapper
        if len(msg.content.array_records) != 1:
            return mod_error(msg, "compress_mod expects one ArrayRecord in a train message")
        key, record = next(iter(msg.content.array_records.items()))
        named = _named(record)
        try:
            reference, layout = _downlink(named, cfg, context.state)
        except (ValueError, TypeError, KeyError) as err:
            return mod_error(msg, f"compress_mod: {err}")
        dense = layout.unflatten(reference, {k[len(CARRIED):]: v for k, v in named.items() if k.startswith(CARRIED)}
                                 if DOWNLINK in cfg else named)
        context.state[REFERENCE] = _record(dense)
        inner_cfg = {k: v for k, v in cfg.items() if not k.startswith("compress.")}
        msg.content = RecordDict({**{k: v for k, v in msg.content.items() if k not in (key, ckey)},
                                  key: _record(dense), str(ckey): ConfigRecord(inner_cfg)})
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        use = codec if codec is not None else (codec_from_spec(str(cfg[UPLINK])) if UPLINK in cfg else None)
        if use is None:
            return reply
        try:
            return _uplink(reply, layout, reference, use, context.state, error_feedback, rng)
        except (ValueError, TypeError) as err:
            return mod_error(msg, f"compress_mod: {err}")

    return mod


def _downlink(named: dict[str, NDArray[Any]], cfg: dict[str, Any], state: RecordDict) -> tuple[Any, ArrayLayout]:
    """The reference model this round (flat) and its layout, from a dense or a compressed downlink."""
    if DOWNLINK in cfg:
        if REFERENCE not in state.array_records:
            raise ValueError("a compressed model change arrived but this device holds no reference model")
        held = _named(state.array_records[REFERENCE])
        layout = ArrayLayout.of(held)
        old = layout.flatten(held)
        if cfg.get(BASE_CRC) != _crc(old):
            raise ValueError("the model change is against another reference than this device's (CRC differs)")
        code = {k[len(CODE):]: v for k, v in named.items() if k.startswith(CODE)}
        carried = {k[len(CARRIED):]: v for k, v in named.items() if k.startswith(CARRIED)}
        change = codec_from_spec(str(cfg[DOWNLINK])).decode(code, layout.dim)
        reference = layout.flatten(layout.unflatten(old + change, carried))
    else:
        layout = ArrayLayout.of(named)
        reference = layout.flatten(named)
    if cfg.get(NEW_CRC) != _crc(reference):
        raise ValueError("the rebuilt model does not match the server's CRC")
    return reference, layout


def _uplink(reply: Message, layout: ArrayLayout, reference: Any, codec: Any, state: RecordDict, error_feedback: bool,
            rng: np.random.Generator) -> Message:
    if len(reply.content.array_records) != 1:
        raise ValueError("the ClientApp's reply must carry one ArrayRecord")
    rkey, rrec = next(iter(reply.content.array_records.items()))
    model = _named(rrec)
    layout.check(model, what="the ClientApp's reply")
    update = layout.flatten(model) - reference
    memory = state.array_records.get(MEMORY)
    e = memory.to_numpy_ndarrays()[0] if memory is not None and error_feedback else None
    v = update + e if e is not None and e.shape == update.shape else update
    code = codec.encode(v, rng)
    if error_feedback:
        state[MEMORY] = ArrayRecord([v - codec.decode(code, layout.dim)])
    carried = {e.name: model[e.name] for e in layout.entries if not e.in_vector}
    payload = {**{CODE + k: a for k, a in code.items()}, **{CARRIED + k: a for k, a in carried.items()}}
    reply.content = RecordDict({**{k: r for k, r in reply.content.items() if k != rkey}, rkey: _record(payload),
                                REPLY_RECORD: ConfigRecord({"format": codec.spec, "base-crc": _crc(reference)})})
    return reply


# ------------------------------------------------------------------------------------------------ secure buffers
#: the protocol keys of strategies/wrappers.py SecureBuffers (duplicated: a client does not import server code)
S_PHASE, S_RUN, S_ROUND, S_BUFFER, S_MEMBERS, S_THRESHOLD, S_CLIP, S_LEVELS, S_SURVIVORS, S_DROPPED = (
    "secure.phase", "secure.run", "secure.round", "secure.buffer", "secure.members", "secure.threshold",
    "secure.clip", "secure.levels", "secure.survivors", "secure.dropped",
)
S_RECORD, S_INFO = "secure", "secure-info"
#: context.state: the key for the next round, the round in progress, the last round this node masked
NEXT_KEY, PENDING, LAST = "secure.next-key", "secure.pending", "secure.last-round"


def _identity_of(value: Any, context: Context, key: str, loader: Any) -> Any:
    if value is None:
        path = context.node_config.get(key)
        if not isinstance(path, str) or not path:
            raise ValueError(f"secure mode needs node config {key!r} (a file path) or the mod's argument")
        return loader(path)
    return value(context) if callable(value) and not hasattr(value, "sign") and not hasattr(value, "verify") else value


def secure_buffers_mod(identity: Any = None, trust_store: Any = None, *, min_buffer: int = 3) -> Mod:
    """The client side of :class:`strategies.wrappers.SecureBuffers`: puts the node in secure mode.

    In secure mode the node never sends an update in the clear, whatever a message says: a train message that is
    not part of the protocol is refused. It answers the protocol's three phases itself (the user's train function
    only ever sees a plain train message):

    * keys: a fresh key pair for the round, signed with the node's long-term identity;
    * mask: checks the buffer (at least ``min_buffer`` members, a threshold t >= 2 with 2t > s, this node among
      them, the round not earlier than one it already masked) and every buffer-mate's key against the device's
      trust store; runs the user's train function; uploads its update masked (pairwise masks plus a self-mask),
      the Shamir shares of its self-mask seed encrypted for their holders, and a commitment to the seed;
    * unmask: once per round, for each buffer-mate, reveals either its share of the mate's self-mask seed (the
      mate survived) or their pairwise seed (the mate dropped) -- never both -- and signs its next round's key.

    Parameters
    ----------
    identity
        The node's :class:`fedapp.secagg.NodeIdentity`, or a callable ``(context) -> NodeIdentity``; None reads the
        PEM file named by node config ``secure-identity``.
    trust_store
        The device's :class:`fedapp.secagg.TrustStore` (client id -> Ed25519 key of the peers it accepts), or a
        callable ``(context) -> TrustStore``; None reads the JSON file named by node config ``secure-trust-store``.
        Whoever writes the trust store decides who the peers are.
    min_buffer
        The smallest buffer this device accepts (default 3: with 2, one colluding mate learns the other's update).
    """
    from fedapp import secagg

    if isinstance(min_buffer, bool) or not isinstance(min_buffer, int) or min_buffer < 2:
        raise ValueError(f"min_buffer must be an integer >= 2, got {min_buffer!r}")

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        _, cfg = _config(msg)
        phase = cfg.get(S_PHASE)
        try:
            me = context.node_config.get("partition-id")
            if isinstance(me, bool) or not isinstance(me, int):
                raise ValueError("secure mode needs the node's partition-id (its id in the peers' trust stores)")
            ident = _identity_of(identity, context, "secure-identity", secagg.NodeIdentity.load)
            trust = _identity_of(trust_store, context, "secure-trust-store", secagg.TrustStore.load)
            if phase == "keys":
                return Message(_key_reply(context.state, ident, me, str(cfg[S_RUN]), _int(cfg, S_ROUND)), reply_to=msg)
            if phase == "mask":
                return _mask(msg, context, call_next, cfg, me, trust, min_buffer)
            if phase == "unmask":
                return Message(_unmask(msg, context.state, ident, cfg, me), reply_to=msg)
        except (ValueError, KeyError, TypeError) as err:
            return mod_error(msg, f"secure_buffers_mod refused: {err}")
        return mod_error(msg, "secure_buffers_mod refused: this node is in secure mode and sends updates only inside "
                              "secure buffers (the message is not part of the protocol)")

    return mod


def _int(cfg: Mapping[str, Any], key: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"message config {key!r} must be an integer, got {v!r}")
    return v


def _key_reply(state: RecordDict, ident: Any, me: int, run: str, server_round: int) -> RecordDict:
    """A fresh key pair for ``server_round``: the private part kept, the public part signed."""
    from fedapp import secagg

    last = state.config_records.get(LAST)
    if last is not None and server_round <= int(last["round"]):  # type: ignore[arg-type]
        raise ValueError(f"round {server_round} is not after round {last['round']!r}, which this node already masked")
    sk, pk = secagg.new_keypair()
    state[NEXT_KEY] = ConfigRecord({"round": server_round, "run": run, "sk": sk})
    sig = ident.sign(secagg.signing_statement(run.encode(), server_round, me, pk))
    return RecordDict({
        S_RECORD: _record({"pk": np.frombuffer(pk, np.uint8).copy(), "sig": np.frombuffer(sig, np.uint8).copy()}),
        S_INFO: ConfigRecord({"client-id": me, "round": server_round})})


def _members(cfg: Mapping[str, Any], key: str) -> list[int]:
    raw = json.loads(str(cfg.get(key, "null")))
    if not isinstance(raw, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in raw):
        raise ValueError(f"message config {key!r} must be a JSON list of client ids")
    if len(set(raw)) != len(raw):
        raise ValueError(f"message config {key!r} repeats a client id")
    return list(raw)


def _mask(msg: Message, context: Context, call_next: ClientAppCallable, cfg: dict[str, Any], me: int, trust: Any,
          min_buffer: int) -> Message:
    """Check the buffer and the mates' keys, run the user's train function, upload the masked update + shares."""
    import hashlib
    import os

    from fedapp import secagg

    state = context.state
    run, rnd, buffer_id = str(cfg[S_RUN]), _int(cfg, S_ROUND), _int(cfg, S_BUFFER)
    members, t = _members(cfg, S_MEMBERS), _int(cfg, S_THRESHOLD)
    clip, levels = float(cfg[S_CLIP]), _int(cfg, S_LEVELS)
    if me not in members:
        raise ValueError(f"this node (client {me}) is not among the buffer's members {members}")
    if len(members) < min_buffer:
        raise ValueError(f"a buffer of {len(members)} is below this device's minimum of {min_buffer}")
    if not (2 <= t <= len(members) and 2 * t > len(members)):
        raise ValueError(f"threshold {t} for a buffer of {len(members)}: this device needs 2 <= t and 2t > s")
    if not (0 < clip < float("inf")):
        raise ValueError(f"clip {clip} must be a finite number > 0")
    key = state.config_records.get(NEXT_KEY)
    if key is None or int(key["round"]) != rnd or str(key["run"]) != run:  # type: ignore[arg-type]
        raise ValueError(f"this node holds no key of run {run!r} round {rnd} (keys are fresh for every round)")
    last = state.config_records.get(LAST)
    if last is not None and rnd <= int(last["round"]):  # type: ignore[arg-type]
        raise ValueError(f"round {rnd} is not after round {last['round']!r}, which this node already masked")
    peers_rec = msg.content.array_records.get(S_RECORD)
    if peers_rec is None:
        raise ValueError("the message carries no buffer-mate keys")
    peers: dict[int, bytes] = {}
    for cid in members:
        if cid == me:
            continue
        pk, sig = peers_rec[f"pk.{cid}"].numpy().tobytes(), peers_rec[f"sig.{cid}"].numpy().tobytes()
        trust.verify(cid, secagg.signing_statement(run.encode(), rnd, cid, pk), sig)
        secagg.check_public_key(pk)
        peers[cid] = pk
    # the user's train function sees a plain train message: the model and its own config
    sent = next(r for k, r in msg.content.array_records.items() if k != S_RECORD)
    ckey, _ = _config(msg)
    plain_cfg = {k: v for k, v in cfg.items() if not k.startswith("secure.")}
    msg.content = RecordDict({**{k: v for k, v in msg.content.items() if k not in (S_RECORD, ckey)},
                              str(ckey): ConfigRecord(plain_cfg)})
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    if len(reply.content.array_records) != 1:
        raise ValueError("the ClientApp's reply must carry one ArrayRecord")
    model = _named(next(iter(reply.content.array_records.values())))
    layout = ArrayLayout.of(_named(sent))
    layout.check(model, what="the ClientApp's reply")
    update = layout.flatten(model) - layout.flatten(_named(sent))
    label = secagg.round_label(run, rnd, buffer_id)
    sk = bytes(key["sk"])  # type: ignore[arg-type]
    self_seed = os.urandom(32)
    masked = secagg.threshold_masked_upload(update, me, sk, peers, label, self_seed, np.random.default_rng(),
                                            clip, levels)
    order = sorted(members)
    shares = dict(zip(order, secagg.split_secret(self_seed, t, len(order)), strict=True))
    out: dict[str, NDArray[Any]] = {"masked": masked, "commit": np.frombuffer(hashlib.sha256(self_seed).digest(),
                                                                             np.uint8).copy()}
    for cid, pk in peers.items():
        channel = secagg.derive(secagg.pairwise_key(sk, pk), label, b"channel")
        blob = secagg.encrypt_share(channel, shares[cid], label + f"|{me}->{cid}".encode())
        out[f"share.{cid}"] = np.frombuffer(blob, np.uint8).copy()
    state[PENDING] = ConfigRecord({"round": rnd, "run": run, "buffer": buffer_id, "members": order, "t": t,
                                   "own-share": shares[me], "sk": sk, "answered": False,
                                   "peer-ids": sorted(peers), "peer-keys": [peers[c] for c in sorted(peers)]})
    state[LAST] = ConfigRecord({"round": rnd})
    del state[NEXT_KEY]
    # the user's metrics stay on the device: individual train metrics would leak what the masks hide
    return Message(RecordDict({S_RECORD: _record(out), "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)


def _unmask(msg: Message, state: RecordDict, ident: Any, cfg: dict[str, Any], me: int) -> RecordDict:
    """Reveal, once, per buffer-mate: its self-mask share (it survived) or our pairwise seed (it dropped)."""
    from fedapp import secagg

    pending = state.config_records.get(PENDING)
    run, rnd = str(cfg[S_RUN]), _int(cfg, S_ROUND)
    if pending is None or int(pending["round"]) != rnd or str(pending["run"]) != run:  # type: ignore[arg-type]
        raise ValueError(f"this node masked nothing in run {run!r} round {rnd}")
    if bool(pending["answered"]):
        raise ValueError(f"this node already answered the unmask request of round {rnd} (it answers once)")
    members = [int(c) for c in pending["members"]]  # type: ignore[union-attr]
    survivors, dropped = _members(cfg, S_SURVIVORS), _members(cfg, S_DROPPED)
    if sorted(survivors + dropped) != members or set(survivors) & set(dropped):
        raise ValueError(f"survivors {survivors} and dropped {dropped} must split the buffer {members}")
    if me not in survivors:
        raise ValueError("this node is told it dropped, yet it is asked to unmask")
    if len(survivors) < int(pending["t"]):  # type: ignore[arg-type]
        raise ValueError(f"{len(survivors)} survivor(s) are below the threshold {pending['t']!r}: nothing is revealed")
    if _int(cfg, S_BUFFER) != int(pending["buffer"]):  # type: ignore[arg-type]
        raise ValueError("the unmask request names another buffer than the one this node masked in")
    label = secagg.round_label(run, rnd, int(pending["buffer"]))  # type: ignore[arg-type]
    sk = bytes(pending["sk"])  # type: ignore[arg-type]
    peer_keys = dict(zip([int(c) for c in pending["peer-ids"]],  # type: ignore[union-attr]
                         [bytes(k) for k in pending["peer-keys"]], strict=True))  # type: ignore[union-attr,arg-type]
    pending["answered"] = True  # before anything is revealed: a second request of this round is refused
    state[PENDING] = pending
    rec = msg.content.array_records.get(S_RECORD, ArrayRecord())
    out: dict[str, NDArray[Any]] = {f"bshare.{me}": np.frombuffer(bytes(pending["own-share"]), np.uint8).copy()}  # type: ignore[arg-type]
    for cid in survivors:
        if cid == me:
            continue
        channel = secagg.derive(secagg.pairwise_key(sk, peer_keys[cid]), label, b"channel")
        share = secagg.decrypt_share(channel, rec[f"share.{cid}"].numpy().tobytes(), label + f"|{cid}->{me}".encode())
        out[f"bshare.{cid}"] = np.frombuffer(share, np.uint8).copy()
    for cid in dropped:
        out[f"pseed.{cid}"] = np.frombuffer(secagg.pair_seed(sk, peer_keys[cid], label), np.uint8).copy()
    nxt = _key_reply(state, ident, me, run, rnd + 1)  # the next round's key rides on this reply
    out.update(_named(nxt.array_records[S_RECORD]))
    return RecordDict({S_RECORD: _record(out), S_INFO: nxt.config_records[S_INFO]})
