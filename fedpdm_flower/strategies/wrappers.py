"""Building blocks for any Flower strategy: wrappers shaped like Flower's own DP wrappers.

Each wrapper takes an inner strategy -- Flower's ``FedAvg`` / ``FedProx`` / ``FedAdam`` / ..., or one of ours with
the same message convention -- changes what crosses the wire or how replies are combined, and hands the inner
strategy replies of Flower's FedAvg convention: a train message carries the global model as its one ArrayRecord,
a reply carries the trained model in the same layout and one MetricRecord with the inner strategy's weighting key
(``num-examples``).

Every wrapper first **screens** the replies, train and evaluate alike (:meth:`StrategyWrapper.screen`,
:meth:`StrategyWrapper.screen_evaluate`): a reply is untrusted input, and one malformed reply makes Flower's own
FedAvg fail the whole round (``InconsistentMessageReplies``) or, with 1e300 in an array, poison the model
(notes/flower-1.42.md section 9). A reply whose records, names, shapes or dtypes differ from what was sent, whose
values are not finite, whose weight is not a positive finite number, or whose metric keys differ from the round's
is dropped with a warning naming the node, and the round goes on with the others; the counts go into the wrapper's
:attr:`StrategyWrapper.diagnostics` ("screen.rejected", "screen.evaluate_rejected").

**Flower's Result is untouched.** ``start`` returns what the inner strategy's aggregation gives: the model and
the clients' aggregated train / evaluate metrics, with the user's keys only. What a wrapper measures itself (bytes
both ways, buffers, rejections, privacy) goes to ``wrapper.diagnostics`` -- round -> MetricRecord, the keys of
every wrapper of the chain together, each namespaced by its wrapper ("compress.", "secure.", "robust.", ...).
A wrapper's protocol keys in the train config are namespaced the same way; a user ``train_config`` key with such a
prefix is refused (ValueError naming it) before anything is sent.

Every wrapper also hands back the aggregate in the dtypes that were sent (Flower's FedAvg turns an integer entry such
as BatchNorm's ``num_batches_tracked`` into a float64 mean; it is rounded back to the integer dtype).

* :class:`Compressed` (client side: :func:`fedpdm_flower.clients.mods.compress_mod`): codecs on the uplink (each client's update,
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

import json
import math
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from numpy.typing import NDArray

from fedpdm_flower.fedapp import secagg
from fedpdm_flower.fedapp.compression.codec import MalformedPayload
from fedpdm_flower.fedapp.compression.codecs import Codec, codec_from_spec
from fedpdm_flower.fedapp.layout import ArrayLayout, FloatArray, LayoutMismatch, norm_buffer_names
from fedpdm_flower.fedapp.secagg import (  # the protocol's names, importable from here as before
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
from fedpdm_flower.fedapp.wire import recorddict_nbytes
from fedpdm_flower.strategies.base import (
    aggregate_metric_replies,
    arrays_of,
    client_error_text,
    consistent_metric_replies,
)
from fedpdm_flower.strategies.secure import BufferSecAgg, SignedKey, Upload

__all__ = ["Compressed", "Robust", "SecureBuffers", "StrategyWrapper", "vector_crc"]

#: config keys of the compression protocol, downlink (fedpdm_flower/clients/mods.py reads and writes the same)
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


def generator_state(rng: np.random.Generator) -> dict[str, Any]:
    """A numpy Generator's state as data (checkpoints): its bit generator's name and state."""
    return dict(rng.bit_generator.state)


def set_generator_state(rng: np.random.Generator, state: Mapping[str, Any], what: str) -> None:
    """Put ``state`` (of :func:`generator_state`) into ``rng``; ValueError naming ``what`` if the kinds differ."""
    kind = type(rng.bit_generator).__name__
    if state.get("bit_generator") != kind:
        raise ValueError(f"{what}: the checkpoint holds a {state.get('bit_generator')!r} generator, this one is {kind}")
    rng.bit_generator.state = dict(state)


def wrapped_chain(strategy: Strategy) -> list[Strategy]:
    """The strategies ``strategy`` wraps, outermost first (itself included), down to the innermost one."""
    chain = [strategy]
    while isinstance(chain[-1], StrategyWrapper):
        chain.append(chain[-1].inner)
    return chain


#: (outer, inner) pairs that cannot work, anywhere in a chain, and why (docs/wrappers.md's composition table)
_INVALID: list[tuple[str, str, str]] = [
    ("Robust", "SecureBuffers", "outside the buffers the updates are masked, and no robust rule can compare masked "
                                "vectors; use SecureBuffers(Robust(...)) to aggregate the buffer means robustly"),
    ("Robust", "Compressed", "the replies Robust would compare are still encoded; use Compressed(Robust(...)), which "
                             "decodes them first"),
    ("SecureBuffers", "Compressed", "a masked upload is uniform noise in Z_2^32, which no codec can shrink, and "
                                    "sparse uploads with different supports cannot be summed under masks"),
    ("Compressed", "SecureBuffers", "the same: masked uploads do not compress, and a compressed downlink would give "
                                    "the devices a reference model other than the one SecureBuffers takes updates "
                                    "against"),
]


def _check_composition(outer: Strategy) -> None:
    kinds = [{c.__name__ for c in type(s).__mro__} for s in wrapped_chain(outer)]
    for a, b, why in _INVALID:
        if a in kinds[0] and any(b in k for k in kinds[1:]):
            raise TypeError(f"{a}(... {b}(...) ...) cannot work: {why}")


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

    #: prefix of the ``<prefix>.down_bytes`` / ``<prefix>.up_bytes`` round metrics this wrapper records itself
    #: (None: a subclass that changes the messages counts its own bytes). They are the serialized sizes of what
    #: this wrapper sends and receives; under another wrapper that is the outer layer's traffic (a buffer mean
    #: under SecureBuffers), so the outermost wrapper's figures are the wire's.
    bytes_prefix: str | None = "wrapper"
    #: prefixes of the config keys this wrapper's protocol puts into train messages (a user key may not use them)
    reserved_prefixes: tuple[str, ...] = ()
    #: keep the model's normalisation buffers (BatchNorm statistics, :func:`fedpdm_flower.fedapp.layout.norm_buffer_names`)
    #: beside the flat vector, as they are, instead of in it (Compressed: no codec or error memory may touch them)
    BUFFERS_BESIDE = False

    def __init__(self, inner: Strategy, *, max_weight: float | None = None) -> None:
        if not isinstance(inner, Strategy):
            raise TypeError(f"inner must be a Flower Message-API Strategy, got {type(inner).__name__}")
        if max_weight is not None and not (math.isfinite(max_weight) and max_weight > 0):
            raise ValueError(f"max_weight must be a finite number > 0 or None, got {max_weight!r}")
        if type(inner).__name__ == "Checkpointed":
            raise TypeError(f"{type(self).__name__}(Checkpointed(...)) cannot checkpoint: Checkpointed runs the rounds "
                            "and must be the outermost strategy, e.g. Checkpointed(SecureBuffers(Robust(FedAvg())), dir)")
        self.inner = inner
        _check_composition(self)
        self.max_weight = max_weight
        self.layout: ArrayLayout | None = None  # of the model sent this round
        self.weight_key = str(getattr(inner, "weighted_by_key", "num-examples"))
        self._round_stats: dict[str, float] = {}
        self._own_diagnostics: dict[int, dict[str, float]] = {}
        #: seconds each exchange of a round may take: the ``timeout`` of :meth:`start` (Flower's default before it)
        self.run_timeout = 3600.0

    def __getattr__(self, name: str) -> Any:
        # the inner strategy's own members (privacy_spent, history, ...) stay reachable through the wrapper
        if name in ("inner", "__setstate__", "_own_diagnostics"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def diagnostics(self) -> dict[int, MetricRecord]:
        """Round -> this wrapper's figures and those of every strategy it wraps (module docstring): bytes, buffers,
        rejected replies, privacy. Never in the Result, which holds the clients' metrics only. The screens' counts
        ("screen.rejected", "screen.evaluate_rejected") are summed over the chain."""
        out: dict[int, dict[str, float]] = {}
        for strategy in reversed(wrapped_chain(self)):  # innermost first: an outer wrapper's figure wins
            if isinstance(strategy, StrategyWrapper):
                own: Mapping[int, Mapping[str, Any]] = strategy._own_diagnostics
            else:
                own = getattr(strategy, "diagnostics", None) or {}
            for rnd, figures in own.items():
                merged = out.setdefault(rnd, {})
                for k, v in figures.items():
                    if not isinstance(v, int | float) or isinstance(v, bool):
                        continue
                    merged[k] = merged.get(k, 0.0) + float(v) if k.startswith("screen.") else float(v)
        return {rnd: MetricRecord(dict(figures)) for rnd, figures in sorted(out.items())}

    def record_diagnostics(self, server_round: int, figures: Mapping[str, float]) -> None:
        """Add ``figures`` to this wrapper's diagnostics of ``server_round``."""
        mine = self._own_diagnostics.setdefault(server_round, {})
        for k, v in figures.items():
            mine[k] = float(v)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Any = None) -> Result:
        """Flower's ``Strategy.start`` on the wrapper; ``timeout`` also bounds the wrappers' own exchanges (keys,
        unmask) and the user's ``train_config`` is checked against the wrappers' reserved keys before round 1."""
        for strategy in wrapped_chain(self):
            if isinstance(strategy, StrategyWrapper):
                strategy.run_timeout = float(timeout)
                strategy.check_user_config(train_config or {})
        return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn)

    def check_user_config(self, config: Mapping[str, Any]) -> None:
        """Raise ValueError for a user config key in this wrapper's namespace (it would be read as, or stripped
        with, the wrapper's protocol)."""
        bad = sorted(k for k in config if k.startswith(self.reserved_prefixes))
        if bad:
            raise ValueError(f"train_config key(s) {bad} use the prefix(es) {list(self.reserved_prefixes)} that "
                             f"{type(self).__name__} reserves for its protocol: rename them")

    # ------------------------------------------------------------------ Strategy API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self.check_user_config(config or {})
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        self._round_stats = {}
        if messages:
            self.learn_layout(messages[0])
        if self.bytes_prefix is not None:  # the serialized size of what this wrapper sends and receives
            self._round_stats[f"{self.bytes_prefix}.down_bytes"] = float(sum(recorddict_nbytes(m.content)
                                                                             for m in messages))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        kept = self.screen(server_round, replies)
        arrays, metrics = self.inner.aggregate_train(server_round, kept)
        self.record_diagnostics(server_round, self._round_stats)
        return self.restore_dtypes(arrays), metrics

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
        """The inner strategy's evaluate messages (the global model, dense, as Flower's FedAvg sends it)."""
        messages = list(self.inner.configure_evaluate(server_round, arrays, config, grid))
        if messages and self.bytes_prefix is not None:
            self.record_diagnostics(server_round, {f"{self.bytes_prefix}.evaluate_down_bytes": float(
                sum(recorddict_nbytes(m.content) for m in messages))})
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The inner strategy's aggregation of the evaluate replies that pass :meth:`screen_evaluate`."""
        return self.inner.aggregate_evaluate(server_round, self.screen_evaluate(server_round, replies))

    def screen_evaluate(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The evaluate replies the inner strategy may see: error replies (Flower logs them) and those whose metrics
        Flower's FedAvg can aggregate (one MetricRecord with a positive finite weight, at most ``max_weight``,
        finite values, the round's keys; :func:`~fedpdm_flower.strategies.base.consistent_metric_replies`). The
        others are dropped with a warning naming the node: in Flower's FedAvg one of them fails the whole run."""
        replies = list(replies)
        errors = [r for r in replies if r.has_error()]
        items = [(i, r.content) for i, r in enumerate(replies) if not r.has_error()]
        keep, bad = consistent_metric_replies(items, self.weight_key)
        kept = {i for i, _ in keep}
        if self.max_weight is not None:
            for i, content in keep:
                w = next(iter(content.metric_records.values()))[self.weight_key]
                if float(w) > self.max_weight:  # type: ignore[arg-type]
                    kept.discard(i)
                    bad.append((i, f"metric {self.weight_key!r} = {w} exceeds max_weight = {self.max_weight:g}"))
        for i, why in sorted(bad):
            log(WARNING, "round %d: %s dropped the evaluate reply of node %s: %s", server_round, type(self).__name__,
                replies[i].metadata.src_node_id, why)
        if bad:
            self.record_diagnostics(server_round, {"screen.evaluate_rejected": float(len(bad))})
        if items and self.bytes_prefix is not None:
            self.record_diagnostics(server_round, {f"{self.bytes_prefix}.evaluate_up_bytes": float(
                sum(recorddict_nbytes(c) for _, c in items))})
        return errors + [replies[i] for i in sorted(kept)]

    def summary(self) -> None:
        log(INFO, "%s around %s", type(self).__name__, type(self.inner).__name__)
        self.inner.summary()

    # ------------------------------------------------------------------ checkpoints (strategies/checkpointed.py)
    def state_dict(self) -> dict[str, Any]:
        """This layer's state between rounds, as data :mod:`fedpdm_flower.fedapp.checkpoint` can write -- not the inner
        strategy's: :class:`fedpdm_flower.strategies.checkpointed.Checkpointed` walks the chain and saves each layer.

        The screen keeps only its figures of the rounds done (:attr:`diagnostics`, so that a resumed run reports
        every round as the uninterrupted one does): the layout is learnt again from each round's messages, the
        round statistics start afresh. A subclass adds what it carries from one round to the next.
        """
        return {"diagnostics": [[rnd, dict(figures)] for rnd, figures in sorted(self._own_diagnostics.items())]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the state of :meth:`state_dict` (before the first resumed round)."""
        self._own_diagnostics = {int(rnd): {str(k): float(v) for k, v in figures.items()}
                                 for rnd, figures in state.get("diagnostics", [])}

    # ------------------------------------------------------------------ the model and the replies
    def learn_layout(self, message: Message) -> None:
        """The layout of the model a train message carries (its one ArrayRecord)."""
        if len(message.content.array_records) != 1:
            raise ValueError(f"{type(self).__name__} wraps strategies whose train messages carry one ArrayRecord "
                             f"(Flower's FedAvg convention); got {len(message.content.array_records)}")
        named = arrays_of(next(iter(message.content.array_records.values())))
        if self.layout is None or [(e.name, e.shape, e.dtype) for e in self.layout.entries] != [
                (k, v.shape, v.dtype) for k, v in named.items()]:
            self.layout = ArrayLayout.of(named, beside=norm_buffer_names(named) if self.BUFFERS_BESIDE else ())

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
        """The replies the inner strategy may see: error replies (Flower logs them) and well-formed ones
        (:meth:`check_reply`), whose metrics have the round's keys (the most common key set; Flower's FedAvg
        raises ``InconsistentMessageReplies`` when one reply's keys differ)."""
        errors: list[Message] = []
        good: list[Message] = []
        rejected = 0
        replies = list(replies)
        if self.bytes_prefix is not None:
            self._round_stats[f"{self.bytes_prefix}.up_bytes"] = float(sum(recorddict_nbytes(r.content)
                                                                           for r in replies if not r.has_error()))
        for reply in replies:
            if reply.has_error():
                errors.append(reply)
                continue
            try:
                self.check_reply(reply)
            except (MalformedPayload, LayoutMismatch, ValueError, TypeError) as err:
                rejected += 1
                log(WARNING, "round %d: %s rejected the reply of node %s: %s", server_round, type(self).__name__,
                    reply.metadata.src_node_id, err)
                continue
            good.append(reply)
        keep, bad = consistent_metric_replies(list(enumerate(r.content for r in good)), self.weight_key)
        for i, why in bad:
            rejected += 1
            log(WARNING, "round %d: %s rejected the reply of node %s: %s", server_round, type(self).__name__,
                good[i].metadata.src_node_id, why)
        self._round_stats["screen.rejected"] = self._round_stats.get("screen.rejected", 0.0) + rejected
        return errors + [good[i] for i, _ in keep]


class Compressed(StrategyWrapper):
    """Compress the model traffic of any strategy: codecs on the uplink and the downlink, with error feedback.

    Uplink: the client (:func:`fedpdm_flower.clients.mods.compress_mod`) sends ``code(update + e)``, its error memory e kept in
    ``context.state`` (what the codec drops this round is sent later); the wrapper decodes each reply back into the
    model ``reference + update`` in the user's layout before the inner strategy sees it.

    Downlink: with a codec, the wrapper keeps the reference model r that every synchronised client holds and sends
    ``code(w - r)`` (the change of the global model; what the codec drops stays in ``w - r`` and goes out in a later
    round: error feedback on the server) with the CRCs of r before and after; a client that is not known to hold r
    gets the new r densely. Without a downlink codec the model goes out dense. Either way every client trains from
    the same r, and its update is taken against it.

    The model's normalisation buffers (BatchNorm running statistics, recognised by torch's names) and integer
    entries are never coded: they travel as they are both ways, and the inner strategy averages them as it always
    does. (Error feedback on a running statistic would re-send its change round after round and overshoot.)

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

    bytes_prefix = None  # counts its own bytes (compress.* / secure.*)
    reserved_prefixes = ("compress.",)
    #: a running statistic's change is not a step: error feedback would sum it round after round and overshoot
    #: (a negative running variance; the FedREP + BatchNorm collapse of issue 23), so buffers travel as they are
    BUFFERS_BESIDE = True

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

    def state_dict(self) -> dict[str, Any]:
        """The reference model r every synchronised client holds (with its layout and carried entries) and the
        codec randomness. Which node holds r (``held``) is not kept: a resumed run cannot know which devices still
        hold it (a device without its old ``context.state`` does not), so its first round sends every node the
        dense model -- the same r, more bytes -- and compressed changes resume from the round after."""
        return {**super().state_dict(), "rng": generator_state(self.rng), "reference": self.reference,
                "carried": dict(self._carried), "layout": None if self.layout is None else self.layout.spec()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        set_generator_state(self.rng, state["rng"], "Compressed's codec randomness")
        self.layout = None if state["layout"] is None else ArrayLayout.from_spec(state["layout"])
        self.reference = None if state["reference"] is None else np.asarray(state["reference"], dtype=np.float64)
        self._carried = dict(state["carried"])
        self.held = {}

    def _as_sent(self, x: FloatArray) -> FloatArray:
        """x as a client reconstructs it: cast to the user's dtypes and back (both ends keep this one)."""
        assert self.layout is not None
        return self.layout.flatten(self.layout.unflatten(x, self._carried))

    # ------------------------------------------------------------------ downlink
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self.check_user_config(config or {})
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


# ------------------------------------------------------------------------------------------------ SecureBuffers
# The protocol's config keys and record names are fedpdm_flower.fedapp.secagg's (fedpdm_flower/clients/secure.py reads the same). Every message
# of the protocol is a TRAIN message, so a user's ClientApp needs no extra action registered: its secure_buffers_mod
# answers the key and unmask phases.
SECURE_PROTOCOL_NAMES = (S_PHASE, S_RUN, S_ROUND, S_BUFFER, S_MEMBERS, S_THRESHOLD, S_CLIP, S_LEVELS, S_SURVIVORS,
                         S_DROPPED, S_RECORD, S_INFO)
class SecureBuffers(StrategyWrapper):
    """Secure aggregation for any strategy: the server learns only the mean update of each buffer of clients.

    Each round the sampled clients are split into random buffers of ``buffer_size`` (drawn from the OS CSPRNG, or
    from ``seed`` when given: reproducible, and weaker, since a buffer assignment is then predictable). Inside a
    buffer every member masks its update ``w_k - w`` with pairwise masks and a self-mask (the threshold protocol of
    :mod:`fedpdm_flower.fedapp.secagg`: Bonawitz et al. 2017 / SecAgg+ run per buffer, keys signed by the nodes' long-term
    identities and checked against each device's own trust store). The inner strategy then sees one reply per
    buffer: the model ``w + mean update of the buffer's survivors``, weighted by their number. A buffer keeps its
    sum while at least ``threshold`` members survive; a survivor is never unmasked alone.

    Exchanges per round: the masked train exchange and the unmask exchange (each survivor reveals, per peer, a
    share of its self-mask seed or its pairwise seed, never both). The key exchange before them is needed in a
    node's first round only: every unmask reply carries the node's signed key for the next round.

    Client side: :func:`fedpdm_flower.clients.mods.secure_buffers_mod` in the user's ClientApp (the user's train function is
    unchanged; the mod answers the key and unmask phases itself, and in secure mode never sends an update in the
    clear, whatever a message says). The protocol's server steps are :class:`fedpdm_flower.strategies.secure.BufferSecAgg`'s, the
    same FedREP's buffers use.

    Parameters
    ----------
    inner
        The wrapped strategy (Flower's FedAvg convention), e.g. ``Robust(FedAvg(...), GeometricMedian())``:
        robust aggregation over buffer means is FedREP's idea made general.
    buffer_size
        s, clients per buffer (default 4); the clients of a round are spread over floor(n / s) buffers of s or s + 1.
        Devices refuse buffers below their own minimum (default 3).
    threshold
        t, survivors a buffer needs to be unmasked (default s // 2 + 1); 2t > s and t >= 2 (devices refuse less).
    clip, levels
        The fixed-point code of the masked updates (default: [-8, 8] in 2^22 levels, step 3.8e-6): a (weighted)
        update coordinate beyond +-clip is clipped; the devices count such coordinates and the round's total is
        reported ("secure.clipped_coordinates" in :attr:`diagnostics`, and a warning), never silently.
    max_weight
        W, the weight (``num-examples``) the devices scale their updates by (Flower's SecAgg+ ``max_weight``, same
        default 1000): a device masks ``(n_k / W)(w_k - w)``, so a buffer's sum divided by the sum of the ratios is the
        weighted mean FedAvg takes. An update of a device with n_k > W loses fixed-point range (its coordinates
        clip at ``+-clip W / n_k``, counted); a W far above the devices' weights costs precision (the step
        ``3.8e-6 W / n_k``). Set it to the largest local dataset you expect.
    seed
        None (default): buffers from the OS CSPRNG. An integer: a reproducible, predictable assignment (weaker;
        logged).
    timeout
        Seconds each of the wrapper's own exchanges (keys, unmask) may take; None (default): ``start``'s timeout.

    Notes
    -----
    **Weights and metrics stay FedAvg's, inside the masks.** Each device appends to its masked update, in an exact
    fixed-point code (:func:`fedpdm_flower.fedapp.secagg.encode_exact`), its weight n_k and its weighted train
    metrics n_k m_k (the metric names travel in the clear). A buffer's unmasked sum then gives its total weight, its
    weighted mean update and its weighted mean metrics, and the inner strategy gets one reply per buffer carrying
    those, with the buffer's total weight. Flower's FedAvg over the buffers is therefore FedAvg over the clients,
    model and ``Result.train_metrics_clientapp`` alike (up to the quantization step); the server never sees one
    client's weight or metrics. Evaluate messages and replies are Flower's, in the clear (as under Flower's SecAgg+,
    which secures only the fit exchange).

    A device states its own weight, and inside the masks nobody can check it: one device claiming a huge
    ``num-examples`` dominates its buffer's mean and, under a weighted inner strategy, the buffer's weight. Against
    Byzantine devices put :class:`Robust` inside (``SecureBuffers(Robust(FedAvg(...)), ...)``): it aggregates the
    buffer means unweighted and robustly.
    """

    bytes_prefix = None  # counts its own bytes (compress.* / secure.*)
    reserved_prefixes = ("secure.", "ddp.")
    #: the model mean is weighted by the devices' weights (False: unweighted, DistributedDP's clipped updates)
    weighted_model = True

    def __init__(self, inner: Strategy, buffer_size: int = 4, *, threshold: int | None = None, clip: float = 8.0,
                 levels: int = 2**22, seed: int | None = None, timeout: float | None = None,
                 max_weight: float = 1000.0) -> None:
        from fedpdm_flower.fedapp import secagg

        super().__init__(inner)
        if isinstance(max_weight, bool) or not isinstance(max_weight, int | float) or not (
                math.isfinite(max_weight) and max_weight > 0):
            raise ValueError(f"max_weight must be a finite number > 0, got {max_weight!r}")
        self.weight_scale = float(max_weight)
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 2:
            raise ValueError(f"buffer_size must be an integer >= 2, got {buffer_size!r}")
        t = buffer_size // 2 + 1 if threshold is None else threshold
        if isinstance(t, bool) or not isinstance(t, int) or not (2 <= t <= buffer_size and 2 * t > buffer_size):
            raise ValueError(f"threshold must be an integer with 2 <= t <= s and 2t > s (s = {buffer_size}), got {t!r}")
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"clip must be a finite number > 0, got {clip!r}")
        secagg._check_capacity(2 * buffer_size, levels)
        self.buffer_size, self.threshold, self.clip, self.levels = buffer_size, t, float(clip), int(levels)
        if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        self.timeout = None if timeout is None else float(timeout)
        if seed is not None:
            log(WARNING, "SecureBuffers(seed=%d): buffers are reproducible and predictable from the seed (weaker than "
                "the default OS CSPRNG)", seed)
        import secrets

        self._buffer_rng = np.random.default_rng(seed if seed is not None else secrets.randbits(128))
        # the tail (encode_exact) carries the clipped-coordinate count: no encode_counted entry as well
        self.secure = BufferSecAgg(threshold=t, clip=clip, levels=levels, count_clipped=False)
        self._grid: Grid | None = None
        self._round: dict[str, Any] = {}

    @property
    def run_label(self) -> str:
        """This run's label (signed into every key, mixed into every mask)."""
        return self.secure.run_label

    @property
    def keys(self) -> dict[int, SignedKey]:
        """node id -> its latest signed key (client id, round, public key, signature)."""
        return self.secure.keys

    def summary(self) -> None:
        log(INFO, "SecureBuffers: s=%d t=%d clip=%g levels=%d max_weight=%g", self.buffer_size, self.threshold,
            self.clip, self.levels, self.weight_scale)
        super().summary()

    def state_dict(self) -> dict[str, Any]:
        """The buffers' randomness (so the checkpoint, like a seed, lets whoever reads it predict the next buffers:
        it belongs in the server operator's own directory). What cannot resume is not kept: a round whose buffers
        were in flight is lost (its masked uploads are useless without the unmask step, and a device that already
        masked in that round refuses to mask it again), and the nodes' signed keys belong to the crashed run's
        label -- a resumed run has a fresh label (:attr:`run_label`) and asks every node for a new key in its first
        round."""
        return {**super().state_dict(), "buffer_rng": generator_state(self._buffer_rng)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        set_generator_state(self._buffer_rng, state["buffer_rng"], "SecureBuffers' buffer randomness")

    @property
    def exchange_timeout(self) -> float:
        """Seconds each key / unmask exchange may take (``timeout``, else ``start``'s)."""
        return self.timeout if self.timeout is not None else self.run_timeout

    # ------------------------------------------------------------------ round: keys, buffers, masked train
    def _exchange(self, server_round: int, contents: Mapping[int, RecordDict]) -> dict[int, Message]:
        """Send ``contents`` (node -> content) as train messages; the non-error replies by node."""
        assert self._grid is not None
        msgs = [Message(c, dst_node_id=node, message_type="train", group_id=f"{server_round}-secure")
                for node, c in contents.items()]
        self._round_stats["secure.down_bytes"] = self._round_stats.get("secure.down_bytes", 0.0) + sum(
            recorddict_nbytes(c) for c in contents.values())
        got: dict[int, Message] = {}
        for reply in self._grid.send_and_receive(msgs, timeout=self.exchange_timeout):
            if not reply.has_error():
                self._round_stats["secure.up_bytes"] = (self._round_stats.get("secure.up_bytes", 0.0)
                                                        + recorddict_nbytes(reply.content))
            got[reply.metadata.src_node_id] = reply
        return got

    def _keys_of(self, server_round: int, replies: Mapping[int, Message]) -> None:
        """Keep each node's signed key for ``server_round`` (a malformed one is dropped with a warning)."""
        for node, reply in replies.items():
            if reply.has_error():
                log(WARNING, "round %d: node %s gave no secure key: %s", server_round, node,
                    client_error_text(str(reply.error.reason)))
                continue
            try:
                self.secure.accept_key(server_round, node, reply.content)
            except (KeyError, ValueError, TypeError) as err:
                log(WARNING, "round %d: node %s sent a malformed secure key: %s", server_round, node, err)

    def _buffers(self, nodes: list[int]) -> list[list[int]]:
        """floor(n / s) buffers of s or s + 1 nodes, from a fresh random permutation."""
        order = [nodes[i] for i in self._buffer_rng.permutation(len(nodes))]
        count = len(order) // self.buffer_size
        return [order[i::count] for i in range(count)] if count else []

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        messages = {m.metadata.dst_node_id: m for m in super().configure_train(server_round, arrays, config, grid)}
        self._grid = grid
        self._round = {"round": server_round}
        if not messages:
            return []
        first = next(iter(messages.values()))
        key, record = next(iter(first.content.array_records.items()))
        self._round.update({"key": key, "sent": self.layout.flatten(arrays_of(record)), "carried": {  # type: ignore[union-attr]
            e.name: arrays_of(record)[e.name] for e in self.layout.entries if not e.in_vector}})  # type: ignore[union-attr]
        stale = [n for n in messages if not self.secure.has_key(n, server_round)]
        if stale:
            ask = RecordDict({"config": ConfigRecord({S_PHASE: "keys", S_RUN: self.run_label, S_ROUND: server_round})})
            self._keys_of(server_round, self._exchange(server_round, dict.fromkeys(stale, ask)))
        ready = sorted(n for n in messages if self.secure.has_key(n, server_round))
        buffers = self._buffers(ready)
        if len(ready) < self.buffer_size:
            log(WARNING, "round %d: %d node(s) with a key, fewer than one buffer of %d: nothing to aggregate",
                server_round, len(ready), self.buffer_size)
        self._round["buffers"] = buffers
        out = []
        for b, members in enumerate(buffers):
            try:
                extra, peers = self.secure.mask_config(server_round, b, members)
                extra[S_WEIGHT_KEY] = self.weight_key
                if self.weighted_model:
                    extra[S_MAX_WEIGHT] = self.weight_scale
                extra.update(self.mask_extra(server_round, members))
            except ValueError as err:
                log(WARNING, "round %d: buffer %d is skipped: %s", server_round, b, err)
                continue
            for n in members:
                msg = messages[n]
                cfg = dict(msg.content.config_records.get("config", ConfigRecord()))
                content = RecordDict({**dict(msg.content.items()), "config": ConfigRecord({**cfg, **extra}),
                                      S_RECORD: peers})
                self._round_stats["secure.down_bytes"] = (self._round_stats.get("secure.down_bytes", 0.0)
                                                          + recorddict_nbytes(content))
                out.append(Message(content, dst_node_id=n, message_type=msg.metadata.message_type,
                                   group_id=msg.metadata.group_id))
        return out

    # ------------------------------------------------------------------ hooks of a subclass (DistributedDP)
    def mask_extra(self, server_round: int, members: list[int]) -> dict[str, Any]:
        """Config entries added to every mask request of a buffer (none here)."""
        return {}

    def decode_sum(self, total: NDArray[np.uint32], count: int) -> FloatArray:
        """The mean update of a buffer from its survivors' exact sum mod 2^32 (ValueError: discard the buffer)."""
        from fedpdm_flower.fedapp import secagg

        return secagg.dequantize(total, count, self.clip, self.levels)

    # ------------------------------------------------------------------ masked uploads -> buffer means
    def _declaration(self, reply: Message) -> tuple[tuple[str, int], ...]:
        """The metric names and list lengths a masked upload declares it carries (record ``secure-tail``)."""
        raw = reply.content.config_records[S_TAIL]["metrics"]
        items = json.loads(str(raw))
        if not isinstance(items, list) or len(items) > 4096:
            raise MalformedPayload("the tail declaration must be a JSON list of [name, length] pairs")
        out = []
        for item in items:
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                    or isinstance(item[1], bool) or not isinstance(item[1], int) or not -1 <= item[1] <= 4096
                    or item[1] == 0):
                raise MalformedPayload(f"malformed tail declaration entry {item!r}")
            out.append((item[0], int(item[1])))
        if [n for n, _ in out] != sorted({n for n, _ in out}) or self.weight_key in {n for n, _ in out}:
            raise MalformedPayload("the tail declaration must name distinct metrics, sorted, without the weight")
        return tuple(out)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Unmask each buffer's sum, decode its weighted mean update and metrics, hand the inner strategy one reply
        per buffer (class notes)."""
        by_node = {r.metadata.src_node_id: r for r in replies}
        assert self.layout is not None
        dim = self.layout.dim
        uploads: dict[int, Upload] = {}
        buffers: dict[int, list[int]] = {}
        declared: dict[int, tuple[tuple[str, int], ...]] = {}
        for b, members in enumerate(self._round.get("buffers", [])):
            buffers[b] = members
            parsed: dict[int, tuple[Upload, tuple[tuple[str, int], ...]]] = {}
            for n in members:
                reply = by_node.get(n)
                if reply is None or reply.has_error():
                    continue
                self._round_stats["secure.up_bytes"] = (self._round_stats.get("secure.up_bytes", 0.0)
                                                        + recorddict_nbytes(reply.content))
                try:
                    decl = self._declaration(reply)
                    parsed[n] = (self.secure.parse_upload(reply.content, n, members, dim + secagg.tail_size(decl)),
                                 decl)
                except (MalformedPayload, KeyError, ValueError, TypeError) as err:
                    log(WARNING, "round %d: buffer %d: node %s sent a malformed upload: %s", server_round, b, n, err)
            if not parsed:
                continue
            # the buffer's uploads must carry the same metrics to be summed: the most common declaration wins (ties:
            # the smallest node id's); a member declaring others is left out as if it had dropped (its update stays
            # behind its self-mask)
            counts = Counter(d for _, d in parsed.values())
            top = max(counts.values())
            majority = next(parsed[n][1] for n in sorted(parsed) if counts[parsed[n][1]] == top)
            for n, (upload, decl) in parsed.items():
                if decl == majority:
                    uploads[n] = upload
                else:
                    self._round_stats["screen.rejected"] = self._round_stats.get("screen.rejected", 0.0) + 1
                    log(WARNING, "round %d: buffer %d: node %s carries metrics %s, its buffer-mates %s: left out",
                        server_round, b, n, [k for k, _ in decl], [k for k, _ in majority])
            declared[b] = majority
        plan = self.secure.plan_unmask(server_round, buffers, uploads)
        for b, why in plan.discarded.items():
            log(WARNING, "round %d: buffer %d has %s: discarded", server_round, b, why)
        answers = self._exchange(server_round, plan.messages) if plan.messages else {}
        self._keys_of(server_round + 1, {n: r for n, r in answers.items()
                                         if not r.has_error() and "pk" in r.content.array_records.get(S_RECORD, {})})
        sums, failed = self.secure.unmask(plan, {n: client_error_text(str(r.error.reason)) if r.has_error()
                                                 else r.content for n, r in answers.items()})
        for b, why in failed.items():
            log(WARNING, "round %d: buffer %d could not be unmasked and is discarded: %s", server_round, b, why)
        decoded: list[Message] = []
        clipped = 0.0
        for buffer in plan.buffers:
            if buffer.buffer_id not in sums:
                continue
            total, count = sums[buffer.buffer_id]
            try:
                weight, means, clip_count = secagg.read_tail(secagg.decode_exact(total[dim:], count),
                                                             declared[buffer.buffer_id])
                mean = self.decode_update(total[:dim], count, weight)
            except ValueError as err:
                log(WARNING, "round %d: buffer %d is discarded: %s", server_round, buffer.buffer_id, err)
                failed[buffer.buffer_id] = str(err)
                continue
            clipped += clip_count
            model = self.layout.unflatten(self._round["sent"] + mean, self._round["carried"])
            reply = by_node[buffer.survivors[0]]
            reply.content = RecordDict({self._round["key"]: _record(model),
                                        "metrics": MetricRecord(self.buffer_metrics(means, weight, count))})
            decoded.append(reply)
        if clipped:
            log(WARNING, "round %d: %d update coordinate(s) fell outside the fixed-point range +-%g and were clipped "
                "(raise SecureBuffers' clip, or max_weight if devices hold more than %g examples)", server_round,
                int(clipped), self.clip, self.weight_scale)
        self._round_stats.update({"secure.buffers": float(len(decoded)),
                                  "secure.buffers_discarded": float(len(plan.discarded) + len(failed)),
                                  "secure.dropped": float(plan.dropped), "secure.clipped_coordinates": clipped})
        core: Any = self.inner
        while isinstance(getattr(core, "inner", None), Strategy):  # the strategy under any other wrapper
            core = core.inner
        expect = getattr(core, "expect_replies_from", None)
        if callable(expect):  # one reply per buffer: our strategies must not count the other members as silent
            expect(server_round, [r.metadata.src_node_id for r in decoded])
        arrays, metrics = super().aggregate_train(server_round, decoded)
        if not self.weighted_model and decoded:  # the model mean is unweighted; the metrics stay FedAvg's
            metrics = aggregate_metric_replies([_reweighted(r.content, self.weight_key) for r in decoded
                                                if not r.has_error()], self.weight_key,
                                               getattr(self.inner, "train_metrics_aggr_fn", None))
        return arrays, metrics

    def buffer_metrics(self, means: Mapping[str, Any], weight: float, count: int) -> dict[str, Any]:
        """The metrics of a buffer's reply to the inner strategy: the weighted means and the buffer's total weight
        (FedAvg then weighs the buffer by it). DistributedDP weighs the model by the survivors' count instead."""
        return {**means, self.weight_key: _weight_value(weight)}

    def decode_update(self, total: NDArray[np.uint32], count: int, weight: float) -> FloatArray:
        """The buffer's mean update from its survivors' sum: weighted, ``sum_k (n_k / W) u_k / sum_k (n_k / W)``
        (:meth:`decode_sum` gives the mean of the scaled updates)."""
        return self.decode_sum(total, count) * count * self.weight_scale / weight


def _weight_value(weight: float) -> int | float:
    """A decoded total weight as the clients gave theirs: an integer when it is one (``num-examples``)."""
    return round(weight) if abs(weight - round(weight)) < 1e-6 and abs(weight) < 2**53 else float(weight)


def _reweighted(content: RecordDict, weight_key: str) -> RecordDict:
    """A buffer reply whose metrics are weighted by the buffer's total weight (kept under ``weight_key`` beside the
    survivors' count that DistributedDP's unweighted model mean uses)."""
    m = dict(next(iter(content.metric_records.values())))
    m[weight_key] = m.pop(_TOTAL_WEIGHT, m.get(weight_key, 1))
    return RecordDict({"metrics": MetricRecord(m)})


#: metric of a DistributedDP buffer reply holding the buffer's total weight (its weight key holds the survivors)
_TOTAL_WEIGHT = "secure.total-weight"


# ------------------------------------------------------------------------------------------------------ Robust
class Robust(StrategyWrapper):
    """Byzantine-robust aggregation for any strategy: the inner strategy gets the robust aggregate, not the mean.

    Each reply's update ``w_k - w`` (against the model that was sent) becomes a row; an optional pre-aggregator
    (:class:`fedpdm_flower.fedapp.robust.NearestNeighborMixing`, :class:`fedpdm_flower.fedapp.robust.Bucketing`) mixes the rows, and the
    aggregator (:class:`fedpdm_flower.fedapp.robust.GeometricMedian`, :class:`~fedpdm_flower.fedapp.robust.CoordinateMedian`,
    :class:`~fedpdm_flower.fedapp.robust.TrimmedMean`, :class:`~fedpdm_flower.fedapp.robust.Krum`, :class:`~fedpdm_flower.fedapp.robust.CenteredClipping`,
    or any callable ``(n, d) -> (d,)``) combines them into one update U. Every accepted reply then carries the
    model ``w + U`` (the user's layout) and the inner strategy aggregates as it always does -- FedAvg's weighted
    mean of identical models is that model, FedAdam / FedYogi take ``U`` as their pseudo-gradient -- so any
    strategy's server optimizer stays in force. The rows are unweighted: a client's ``num-examples`` cannot be
    checked, and weighting by it would let one client dominate.

    Under :class:`SecureBuffers` (``SecureBuffers(Robust(inner, ...))``) the rows are the buffer means: robust
    aggregation over secure buffer means, FedREP's idea made general. ``Robust(SecureBuffers(...))`` is refused:
    outside the buffers there are only masked vectors, which no robust rule can compare.

    Parameters
    ----------
    inner
        The wrapped strategy (Flower's FedAvg convention).
    aggregator
        The robust rule, a callable ``rows -> aggregate``.
    pre
        An optional pre-aggregator, a callable ``(rows, rng) -> rows``.
    seed
        Seed of the pre-aggregator's randomness (bucketing); None draws from the OS.
    """

    bytes_prefix = "robust"

    def __init__(self, inner: Strategy, aggregator: Any, pre: Any = None, *, seed: int | None = None,
                 max_weight: float | None = None) -> None:
        if not callable(aggregator):
            raise TypeError(f"aggregator must be a callable rows -> aggregate, got {type(aggregator).__name__}")
        if pre is not None and not callable(pre):
            raise TypeError(f"pre must be a callable (rows, rng) -> rows, got {type(pre).__name__}")
        super().__init__(inner, max_weight=max_weight)
        self.aggregator, self.pre = aggregator, pre
        self.rng = np.random.default_rng(seed)
        self._sent: FloatArray | None = None  # the flat model of this round's train messages

    def summary(self) -> None:
        log(INFO, "Robust: aggregator=%s pre=%s", self.aggregator, self.pre)
        super().summary()

    def state_dict(self) -> dict[str, Any]:
        """The pre-aggregator's randomness (bucketing); the aggregators are stateless (fedapp.robust)."""
        return {**super().state_dict(), "rng": generator_state(self.rng)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        set_generator_state(self.rng, state["rng"], "Robust's pre-aggregator randomness")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if messages:
            assert self.layout is not None
            self._sent = self.layout.flatten(arrays_of(next(iter(messages[0].content.array_records.values()))))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        kept = self.screen(server_round, replies)
        # rows in node order: the replies arrive in any order, and a seeded pre-aggregator must see the same rows
        ok = sorted((r for r in kept if not r.has_error()), key=lambda r: r.metadata.src_node_id)
        if ok and self.layout is not None and self._sent is not None:
            named = [arrays_of(next(iter(r.content.array_records.values()))) for r in ok]
            rows = np.stack([self.layout.flatten(a) - self._sent for a in named])
            mixed = self.pre(rows, self.rng) if self.pre is not None else rows
            update = np.asarray(self.aggregator(mixed), dtype=np.float64)
            if update.shape != (self.layout.dim,) or not np.all(np.isfinite(update)):
                raise ValueError(f"the aggregator returned {update.shape}, expected a finite ({self.layout.dim},)")
            # entries outside the vector (integer counters such as BatchNorm's num_batches_tracked): their
            # element-wise median over the replies, which a minority cannot move out of the honest range
            carried = {e.name: np.rint(np.median(np.stack([a[e.name] for a in named]).astype(np.float64), axis=0))
                       for e in self.layout.entries if not e.in_vector}
            model = _record(self.layout.unflatten(self._sent + update, carried))
            for r in ok:  # the same robust model in every reply; the metrics stay the clients'
                key = next(iter(r.content.array_records))
                r.content = RecordDict({**{k: v for k, v in r.content.items() if k != key}, key: model})
            self._round_stats.update({"robust.inputs": float(len(ok)), "robust.update_norm": float(np.linalg.norm(update)),
                                      "robust.mean_update_norm": float(np.linalg.norm(rows.mean(axis=0)))})
        arrays, metrics = self.inner.aggregate_train(server_round, kept)
        self.record_diagnostics(server_round, self._round_stats)
        return self.restore_dtypes(arrays), metrics
