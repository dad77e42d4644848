"""Client mods for the wrappers of :mod:`strategies.wrappers`, usable in any ClientApp.

A mod wraps the user's own ClientApp (``ClientApp(mods=[compress_mod(TopK(0.05))])``): the user's ``@app.train``
keeps receiving and returning its model in its own arrays, and the mod changes only what crosses the wire. Its
state lives in ``context.state``; every message is untrusted input, and a mod that cannot honour one answers with a
Flower error reply naming why.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from numpy.typing import NDArray

from fedapp.compression.codecs import Codec, codec_from_spec
from fedapp.layout import ArrayLayout

__all__ = ["compress_mod"]

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
