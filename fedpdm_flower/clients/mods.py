"""Client mods for the wrappers of :mod:`fedpdm_flower.strategies.wrappers`, usable in any ClientApp.

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
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from numpy.typing import NDArray

from fedpdm_flower.clients.distributed_dp import DDP_Z, DeviceSkellam
from fedpdm_flower.clients.secure import (
    LAST,
    NEXT_KEY,
    PENDING,
    SecureDevice,
    accept_mask,
    config_int,
    key_reply,
    mask_reply,
    unmask_reply,
)
from fedpdm_flower.fedapp import secagg
from fedpdm_flower.fedapp.compression.codecs import Codec, codec_from_spec
from fedpdm_flower.fedapp.layout import ArrayLayout, norm_buffer_names
from fedpdm_flower.fedapp.secagg import (
    S_BUFFER,
    S_CLIP,
    S_DROPPED,
    S_INFO,
    S_LEVELS,
    S_MAX_WEIGHT,
    S_MEMBERS,
    S_PHASE,
    S_RECORD,
    S_ROUND,
    S_RUN,
    S_SURVIVORS,
    S_TAIL,
    S_THRESHOLD,
    S_WEIGHT_KEY,
)
from fedpdm_flower.fedapp.wire import numpy_list

__all__ = ["compress_mod", "secure_buffers_mod"]

#: the protocol keys of fedpdm_flower/strategies/wrappers.py Compressed (duplicated: a client does not import server code)
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
    """The client side of :class:`fedpdm_flower.strategies.wrappers.Compressed`.

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
        layout = _layout(held)
        old = layout.flatten(held)
        if cfg.get(BASE_CRC) != _crc(old):
            raise ValueError("the model change is against another reference than this device's (CRC differs)")
        code = {k[len(CODE):]: v for k, v in named.items() if k.startswith(CODE)}
        carried = {k[len(CARRIED):]: v for k, v in named.items() if k.startswith(CARRIED)}
        change = codec_from_spec(str(cfg[DOWNLINK])).decode(code, layout.dim)
        reference = layout.flatten(layout.unflatten(old + change, carried))
    else:
        layout = _layout(named)
        reference = layout.flatten(named)
    if cfg.get(NEW_CRC) != _crc(reference):
        raise ValueError("the rebuilt model does not match the server's CRC")
    return reference, layout


def _layout(named: Mapping[str, NDArray[Any]]) -> ArrayLayout:
    """The flat vector the codec compresses: the model's entries but its normalisation buffers (BatchNorm statistics),
    which travel as they are: error feedback would sum a statistic's change round after round and overshoot."""
    return ArrayLayout.of(named, beside=norm_buffer_names(named))


def _uplink(reply: Message, layout: ArrayLayout, reference: Any, codec: Any, state: RecordDict, error_feedback: bool,
            rng: np.random.Generator) -> Message:
    if len(reply.content.array_records) != 1:
        raise ValueError("the ClientApp's reply must carry one ArrayRecord")
    rkey, rrec = next(iter(reply.content.array_records.items()))
    model = _named(rrec)
    layout.check(model, what="the ClientApp's reply")
    update = layout.flatten(model) - reference
    memory = state.array_records.get(MEMORY)
    e = numpy_list(memory)[0] if memory is not None and error_feedback else None
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
#: the protocol's config keys and record names (fedpdm_flower.fedapp.secagg's) and the device's state records (fedpdm_flower.clients.secure's),
#: importable from here as before the device steps moved to fedpdm_flower/clients/secure.py
SECURE_PROTOCOL_NAMES = (S_PHASE, S_RUN, S_ROUND, S_BUFFER, S_MEMBERS, S_THRESHOLD, S_CLIP, S_LEVELS, S_SURVIVORS,
                         S_DROPPED, S_RECORD, S_INFO, NEXT_KEY, PENDING, LAST)


def secure_buffers_mod(identity: Any = None, trust_store: Any = None, *, min_buffer: int = 3,
                       distributed_dp: DeviceSkellam | None = None) -> Mod:
    """The client side of :class:`fedpdm_flower.strategies.wrappers.SecureBuffers`: puts the node in secure mode.

    In secure mode the node never sends an update in the clear, whatever a message says: a train message that is
    not part of the protocol is refused. It answers the protocol's three phases itself (the user's train function
    only ever sees a plain train message), with the device side shared with FedREP's clients
    (:mod:`fedpdm_flower.clients.secure`):

    * keys: a fresh key pair for the round, signed with the node's long-term identity;
    * mask: checks the buffer (at least ``min_buffer`` members, a threshold t >= 2 with 2t > s, this node among
      them, the round not earlier than one it already masked) and every buffer-mate's key against the device's
      trust store; runs the user's train function; uploads its update masked (pairwise masks plus a self-mask),
      the Shamir shares of its self-mask seed encrypted for their holders, and a commitment to the seed;
    * unmask: once per round, for each buffer-mate, reveals either its share of the mate's self-mask seed (the
      mate survived) or their pairwise seed (the mate dropped) -- never both -- and signs its next round's key.

    Parameters are those of :class:`fedpdm_flower.clients.secure.SecureDevice` (identity, trust store, min_buffer, default 3:
    with 2, one colluding mate learns the other's update), and ``distributed_dp``: the device's
    :class:`fedpdm_flower.clients.distributed_dp.DeviceSkellam` policy. With it the device adds its share of Skellam noise to every
    upload (:class:`fedpdm_flower.strategies.distributed_dp.DistributedDP`) and refuses a request that asks for no noise or for
    less than its floor. Without it, a request that names a Skellam mechanism is followed as asked (a floor of 0).
    """
    device = SecureDevice(identity, trust_store, min_buffer=min_buffer)
    if distributed_dp is not None and not isinstance(distributed_dp, DeviceSkellam):
        raise TypeError(f"distributed_dp must be a DeviceSkellam policy or None, got {type(distributed_dp).__name__}")

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, context)
        _, cfg = _config(msg)
        phase = cfg.get(S_PHASE)
        try:
            me = device.client_id(context)
            ident, trust = device.resolve(context)
            if phase == "keys":
                return Message(key_reply(context.state, ident, me, str(cfg[S_RUN]), config_int(cfg, S_ROUND)),
                               reply_to=msg)
            if phase == "mask":
                return _mask(msg, context, call_next, cfg, me, trust, device.min_buffer, distributed_dp)
            if phase == "unmask":
                return Message(unmask_reply(context.state, ident, cfg, msg.content.array_records.get(S_RECORD), me,
                                            next_key=True), reply_to=msg)
        except (ValueError, KeyError, TypeError) as err:
            return mod_error(msg, f"secure_buffers_mod refused: {err}")
        return mod_error(msg, "secure_buffers_mod refused: this node is in secure mode and sends updates only inside "
                              "secure buffers (the message is not part of the protocol)")

    return mod


def _mask(msg: Message, context: Context, call_next: ClientAppCallable, cfg: dict[str, Any], me: int, trust: Any,
          min_buffer: int, ddp: DeviceSkellam | None = None) -> Message:
    """Check the buffer and the mates' keys (and the noise), run the user's train function, upload the masked
    update, its weight and weighted metrics + the shares.

    The masked vector is the update (weighted: scaled by ``weight / W``, W the server's ``secure.max-weight``, as
    Flower's SecAgg+ does; under distributed DP unweighted, clipped and noised by the device's Skellam policy)
    followed by its tail, ``encode_exact([w, w m_1, ..., clipped])``: the buffer's sum gives the server the total
    weight and the numerators of Flower's weighted means, never one client's metrics. The metric names travel in the
    clear (record ``secure-tail``); the values only inside the masks. Update coordinates beyond the fixed-point range
    ``+-clip`` are clipped by the code and counted in the tail, so the server reports them per round.
    """
    request = accept_mask(context.state, cfg, msg.content.array_records.get(S_RECORD), me, trust, min_buffer)
    sent = next(r for k, r in msg.content.array_records.items() if k != S_RECORD)
    plan: dict[str, float] | None = None
    if ddp is None and DDP_Z in cfg:  # no policy on this device: follow the server's mechanism
        ddp = DeviceSkellam(min_noise_multiplier=0.0)
    if ddp is not None:  # before anything is trained: a refused request costs nothing and reveals nothing
        plan = ddp.plan(cfg, len(request.members), request.threshold, ArrayLayout.of(_named(sent)).dim, context.state)
    weight_key = cfg.get(S_WEIGHT_KEY)
    if not isinstance(weight_key, str) or not weight_key:
        raise ValueError(f"message config {S_WEIGHT_KEY!r} (the metric that weights this node's update) is missing")
    max_weight = cfg.get(S_MAX_WEIGHT)
    if max_weight is not None and (isinstance(max_weight, bool) or not isinstance(max_weight, int | float)
                                   or not np.isfinite(max_weight) or max_weight <= 0):
        raise ValueError(f"message config {S_MAX_WEIGHT!r} = {max_weight!r} must be a finite number > 0")
    # the user's train function sees a plain train message: the model and its own config
    ckey, _ = _config(msg)
    plain_cfg = {k: v for k, v in cfg.items() if not k.startswith(("secure.", "ddp."))}
    msg.content = RecordDict({**{k: v for k, v in msg.content.items() if k not in (S_RECORD, ckey)},
                              str(ckey): ConfigRecord(plain_cfg)})
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    if len(reply.content.array_records) != 1 or len(reply.content.metric_records) != 1:
        raise ValueError(f"the ClientApp's reply must carry one ArrayRecord and one MetricRecord, got "
                         f"{len(reply.content.array_records)} and {len(reply.content.metric_records)}")
    model = _named(next(iter(reply.content.array_records.values())))
    declaration, tail = secagg.metric_tail(dict(next(iter(reply.content.metric_records.values()))), weight_key)
    layout = ArrayLayout.of(_named(sent))
    layout.check(model, what="the ClientApp's reply")
    update = layout.flatten(model) - layout.flatten(_named(sent))
    rng = np.random.default_rng()  # the rounding is the device's own randomness
    clipped = 0
    if ddp is not None and plan is not None:
        code = ddp.encode(update, plan, context.state)
    else:
        scaled = update * (tail[0] / float(max_weight)) if max_weight is not None else update
        clipped = int(np.count_nonzero(np.abs(scaled) > request.clip))
        code = secagg.quantize(scaled, rng, request.clip, request.levels)
    vector = np.concatenate([code, secagg.encode_exact(np.append(tail, float(clipped)))])
    record = mask_reply(context.state, request, vector, rng, encoded=True)
    return Message(RecordDict({S_RECORD: record, S_TAIL: ConfigRecord({"metrics": json.dumps(declaration)})}),
                   reply_to=msg)
