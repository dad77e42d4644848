"""Building blocks for any Flower strategy: wrappers shaped like Flower's own DP wrappers.

Each wrapper takes an inner strategy -- Flower's ``FedAvg`` / ``FedProx`` / ``FedAdam`` / ..., or one of ours with
the same message convention -- changes what crosses the wire or how replies are combined, and hands the inner
strategy replies of Flower's FedAvg convention: a train message carries the global model as its one ArrayRecord,
a reply carries the trained model in the same layout and one MetricRecord with the inner strategy's weighting key
(``num-examples``).

Every wrapper first **screens** the replies (:meth:`StrategyWrapper.screen`): a reply is untrusted input, and one
malformed reply makes Flower's own FedAvg fail the whole round or, with 1e300 in an array, poison the model
(notes/flower-1.42.md section 9). A reply whose records, names, shapes or dtypes differ from what was sent, whose
values are not finite, or whose weight is not a positive finite number is dropped with a warning naming the node,
and the round goes on with the others; the counts go into the round's MetricRecord ("screen.rejected").

Every wrapper also hands back the aggregate in the dtypes that were sent (Flower's FedAvg turns an integer entry such
as BatchNorm's ``num_batches_tracked`` into a float64 mean; it is rounded back to the integer dtype).

* :class:`Compressed` (client side: :func:`clients.mods.compress_mod`): codecs on the uplink (each client's update,
  error feedback kept on the device) and on the downlink (the change of the global model against the reference
  every synchronised client holds). The bytes that really cross, both ways, go into the round's MetricRecord.

Composition order (the outermost wrapper sees the replies first; client mods run from the last to the first on
the way out):

* ``Compressed(inner)`` with ``ClientApp(mods=[compress_mod(...)])``: any codec.
* A secure sum can only carry codes that add up coordinate-wise (``codec.shared_support``). Top-k, rand-k with each
  client's own draw and the quantizer with each client's own step do not, so compressed uploads under masking need
  a common support (FedREP's consensus set).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from numpy.typing import NDArray

from fedapp.compression.codec import MalformedPayload
from fedapp.compression.codecs import Codec, codec_from_spec
from fedapp.layout import ArrayLayout, FloatArray, LayoutMismatch
from fedapp.wire import recorddict_nbytes
from strategies.base import arrays_of

__all__ = ["Compressed", "StrategyWrapper", "vector_crc"]

#: config keys of the compression protocol, downlink (clients/mods.py reads and writes the same)
UPLINK, DOWNLINK, BASE_CRC, NEW_CRC = "compress.uplink", "compress.downlink", "compress.base-crc", "compress.crc"
#: the reply's ConfigRecord that describes its compressed payload: {"format": codec spec, "base-crc": int}
REPLY_RECORD = "compress"
#: prefixes of the array names of a compressed payload and of the entries carried as they are
CODE, CARRIED = "c.", "k."


def vector_crc(x: NDArray[Any]) -> int:
    """CRC-32 of a float64 vector's bytes: both ends prove they hold the same reference model."""
    return zlib.crc32(np.ascontiguousarray(x, dtype=np.float64).tobytes())


def _record(arrays: Mapping[str, NDArray[Any]]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.require(v, requirements="C")) for k, v in arrays.items()})  # keeps 0-d arrays 0-d


def _merge_metrics(metrics: MetricRecord | None, extra: Mapping[str, float]) -> MetricRecord:
    out = MetricRecord(dict(metrics) if metrics is not None else {})
    for k, v in extra.items():
        out[k] = float(v)
    return out


class StrategyWrapper(Strategy):
    """Delegates to ``inner`` and screens the replies before the inner strategy sees them.

    Parameters
    ----------
    inner
        The wrapped strategy (Message API), e.g. ``flwr.serverapp.strategy.FedAvg(...)``.
    max_weight
        The largest weight (``num-examples``) a reply may claim; None (default) sets no bound. A client states its
        own weight and nothing can check it, so one client claiming 10^12 examples takes over a weighted mean: set
        this to the largest local dataset you expect, or aggregate unweighted (:class:`Robust`).
    """

    def __init__(self, inner: Strategy, *, max_weight: float | None = None) -> None:
        if not isinstance(inner, Strategy):
            raise TypeError(f"inner must be a Flower Message-API Strategy, got {type(inner).__name__}")
        if max_weight is not None and not (math.isfinite(max_weight) and max_weight > 0):
            raise ValueError(f"max_weight must be a finite number > 0 or None, got {max_weight!r}")
        self.inner = inner
        self.max_weight = max_weight
        self.layout: ArrayLayout | None = None  # of the model sent this round
        self.weight_key = str(getattr(inner, "weighted_by_key", "num-examples"))
        self._round_stats: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        # the inner strategy's own members (privacy_spent, history, ...) stay reachable through the wrapper
        if name in ("inner", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        self._round_stats = {}
        if messages:
            self.learn_layout(messages[0])
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        kept = self.screen(server_round, replies)
        arrays, metrics = self.inner.aggregate_train(server_round, kept)
        return self.restore_dtypes(arrays), _merge_metrics(metrics, self._round_stats)

    def restore_dtypes(self, arrays: ArrayRecord | None) -> ArrayRecord | None:
        """The aggregate in the dtypes that were sent: Flower's FedAvg averages an integer entry (BatchNorm's
        ``num_batches_tracked``) into a float64 with a fraction; it goes back to the sent integer dtype, rounded to
        the nearest integer, so the next round's model has the user's layout again."""
        if arrays is None or self.layout is None:
            return arrays
        named = arrays_of(arrays)
        sent = {e.name: e for e in self.layout.entries}
        if set(named) != set(sent):
            return arrays
        out = {}
        for k, v in named.items():
            want = sent[k].dtype
            if v.dtype != want and not np.issubdtype(want, np.floating):
                v = np.rint(v).astype(want)
            elif v.dtype != want:
                v = v.astype(want)
            out[k] = v
        return _record(out)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        log(INFO, "%s around %s", type(self).__name__, type(self.inner).__name__)
        self.inner.summary()

    # ------------------------------------------------------------------ the model and the replies
    def learn_layout(self, message: Message) -> None:
        """The layout of the model a train message carries (its one ArrayRecord)."""
        if len(message.content.array_records) != 1:
            raise ValueError(f"{type(self).__name__} wraps strategies whose train messages carry one ArrayRecord "
                             f"(Flower's FedAvg convention); got {len(message.content.array_records)}")
        named = arrays_of(next(iter(message.content.array_records.values())))
        if self.layout is None or [(e.name, e.shape, e.dtype) for e in self.layout.entries] != [
                (k, v.shape, v.dtype) for k, v in named.items()]:
            self.layout = ArrayLayout.of(named)

    def check_reply(self, reply: Message) -> None:
        """Raise MalformedPayload unless the reply follows the convention with the model's layout and sane values."""
        content = reply.content
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            raise MalformedPayload(f"a reply needs one ArrayRecord and one MetricRecord, got "
                                   f"{len(content.array_records)} and {len(content.metric_records)}")
        named = arrays_of(next(iter(content.array_records.values())))
        assert self.layout is not None
        self.layout.check(named, what="reply arrays")
        for name, a in named.items():
            if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
                raise MalformedPayload(f"reply array {name!r} holds NaN or Inf")
        metrics = next(iter(content.metric_records.values()))
        weight = metrics.get(self.weight_key)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
            raise MalformedPayload(f"metric {self.weight_key!r} must be a positive finite number, got {weight!r}")
        if self.max_weight is not None and weight > self.max_weight:
            raise MalformedPayload(f"metric {self.weight_key!r} = {weight:g} exceeds max_weight = {self.max_weight:g}")
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise MalformedPayload(f"metric {k!r} is not finite")

    def screen(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies the inner strategy may see: error replies (Flower logs them) and well-formed ones."""
        kept: list[Message] = []
        rejected = 0
        for reply in replies:
            if reply.has_error():
                kept.append(reply)
                continue
            try:
                self.check_reply(reply)
            except (MalformedPayload, LayoutMismatch, ValueError, TypeError) as err:
                rejected += 1
                log(WARNING, "round %d: %s rejected the reply of node %s: %s", server_round, type(self).__name__,
                    reply.metadata.src_node_id, err)
                continue
            kept.append(reply)
        self._round_stats["screen.rejected"] = self._round_stats.get("screen.rejected", 0.0) + rejected
        return kept


class Compressed(StrategyWrapper):
    """Compress the model traffic of any strategy: codecs on the uplink and the downlink, with error feedback.

    Uplink: the client (:func:`clients.mods.compress_mod`) sends ``code(update + e)``, its error memory e kept in
    ``context.state`` (what the codec drops this round is sent later); the wrapper decodes each reply back into the
    model ``reference + update`` in the user's layout before the inner strategy sees it.

    Downlink: with a codec, the wrapper keeps the reference model r that every synchronised client holds and sends
    ``code(w - r)`` (the change of the global model; what the codec drops stays in ``w - r`` and goes out in a later
    round: error feedback on the server) with the CRCs of r before and after; a client that is not known to hold r
    gets the new r densely. Without a downlink codec the model goes out dense. Either way every client trains from
    the same r, and its update is taken against it.

    Parameters
    ----------
    inner
        The wrapped strategy (Flower's FedAvg message convention).
    uplink
        The codec the clients should use (``TopK``, ``RandK`` or ``Quantizer``), sent as a suggestion: a device
        whose mod was built with its own codec uses that one, and its reply says which. None: no suggestion.
    downlink
        The codec of the model change on the downlink, or None (dense).
    seed
        Seed of the server's codec randomness (rand-k, quantizer rounding); None draws from the OS.
    max_weight
        As :class:`StrategyWrapper`.
    """

    def __init__(self, inner: Strategy, *, uplink: Codec | None = None, downlink: Codec | None = None,
                 seed: int | None = None, max_weight: float | None = None) -> None:
        super().__init__(inner, max_weight=max_weight)
        for name, codec in (("uplink", uplink), ("downlink", downlink)):
            if codec is not None and not all(hasattr(codec, a) for a in ("spec", "encode", "decode")):
                raise TypeError(f"{name} must be a codec (TopK, RandK, Quantizer), got {type(codec).__name__}")
        self.uplink, self.downlink = uplink, downlink
        self.rng = np.random.default_rng(seed)
        self.reference: FloatArray | None = None  # r: the model every synchronised client holds
        self._carried: dict[str, NDArray[Any]] = {}
        self.held: dict[int, int] = {}  # node id -> CRC of the reference it was last sent

    def summary(self) -> None:
        log(INFO, "Compressed: uplink=%s downlink=%s", getattr(self.uplink, "spec", None),
            getattr(self.downlink, "spec", None))
        super().summary()

    def _as_sent(self, x: FloatArray) -> FloatArray:
        """x as a client reconstructs it: cast to the user's dtypes and back (both ends keep this one)."""
        assert self.layout is not None
        return self.layout.flatten(self.layout.unflatten(x, self._carried))

    # ------------------------------------------------------------------ downlink
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        self._round_stats = {"compress.down_bytes": 0.0, "compress.down_dense_bytes": 0.0,
                             "compress.up_bytes": 0.0, "compress.up_dense_bytes": 0.0}
        if not messages:
            return messages
        old = self.layout
        self.learn_layout(messages[0])
        if self.layout is not old:
            self.reference, self.held = None, {}
        assert self.layout is not None
        key, record = next(iter(messages[0].content.array_records.items()))
        named = arrays_of(record)
        self._carried = {e.name: named[e.name] for e in self.layout.entries if not e.in_vector}
        w = self.layout.flatten(named)
        base_crc = None if self.reference is None else vector_crc(self.reference)
        code: dict[str, NDArray[Any]] | None = None
        if self.downlink is not None and self.reference is not None:
            code = self.downlink.encode(w - self.reference, self.rng)
            new_ref = self._as_sent(self.reference + self.downlink.decode(code, self.layout.dim))
        else:
            new_ref = self._as_sent(w)
        new_crc = vector_crc(new_ref)
        dense = _record(self.layout.unflatten(new_ref, self._carried))
        delta = None if code is None else _record(
            {**{CODE + k: v for k, v in code.items()}, **{CARRIED + k: v for k, v in self._carried.items()}})
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            cfg = dict(msg.content.config_records.get("config", ConfigRecord()))
            cfg[NEW_CRC] = new_crc
            if self.uplink is not None:
                cfg[UPLINK] = self.uplink.spec
            dense_content = RecordDict({key: dense, "config": ConfigRecord(cfg)})
            content = dense_content
            if delta is not None and base_crc is not None and self.downlink is not None and self.held.get(node) == base_crc:
                content = RecordDict({key: delta, "config": ConfigRecord(
                    {**cfg, DOWNLINK: self.downlink.spec, BASE_CRC: base_crc})})
            self._round_stats["compress.down_bytes"] += recorddict_nbytes(content)
            self._round_stats["compress.down_dense_bytes"] += recorddict_nbytes(dense_content)
            self.held[node] = new_crc  # assumed delivered; an error reply or a rejected one forgets it
            out.append(Message(content, dst_node_id=node, message_type=msg.metadata.message_type,
                               group_id=msg.metadata.group_id))
        self.reference = new_ref
        return out

    # ------------------------------------------------------------------ uplink
    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        decoded: list[Message] = []
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                self.held.pop(node, None)
                decoded.append(reply)
                continue
            self._round_stats["compress.up_bytes"] += recorddict_nbytes(reply.content)
            try:
                decoded.append(self.decode_reply(reply))
            except (MalformedPayload, LayoutMismatch, ValueError, KeyError, TypeError) as err:
                self.held.pop(node, None)
                self._round_stats["screen.rejected"] = self._round_stats.get("screen.rejected", 0.0) + 1
                log(WARNING, "round %d: Compressed rejected the reply of node %s: %s", server_round, node,
                    err)
        return super().aggregate_train(server_round, decoded)

    def decode_reply(self, reply: Message) -> Message:
        """The reply with its compressed update decoded into the dense model (a reply without a code passes)."""
        assert self.layout is not None and self.reference is not None
        content = reply.content
        if REPLY_RECORD not in content.config_records:  # a client without the mod sent its model as it is
            self._round_stats["compress.up_dense_bytes"] += recorddict_nbytes(content)
            return reply
        info = content.config_records[REPLY_RECORD]
        codec = codec_from_spec(str(info.get("format")))
        if info.get("base-crc") != vector_crc(self.reference):
            raise MalformedPayload("the update is not against this round's reference model (base CRC differs)")
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            raise MalformedPayload("a compressed reply needs one ArrayRecord and one MetricRecord")
        key, record = next(iter(content.array_records.items()))
        named = arrays_of(record)
        unknown = [k for k in named if not k.startswith((CODE, CARRIED))]
        if unknown:
            raise MalformedPayload(f"unexpected arrays {unknown[:3]} in a compressed reply")
        update = codec.decode({k[len(CODE):]: v for k, v in named.items() if k.startswith(CODE)}, self.layout.dim)
        carried = {k[len(CARRIED):]: v for k, v in named.items() if k.startswith(CARRIED)}
        if sorted(carried) != sorted(self._carried):
            raise MalformedPayload(f"carried entries {sorted(carried)} differ from the model's {sorted(self._carried)}")
        model = self.layout.unflatten(self.reference + update, carried)
        dense = RecordDict({key: _record(model), **dict(content.metric_records.items())})
        self._round_stats["compress.up_dense_bytes"] += recorddict_nbytes(dense)
        reply.content = dense  # the same reply (its metadata kept), now in the inner strategy's convention
        return reply
