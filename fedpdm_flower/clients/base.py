"""The client side of our algorithms: a NumPyClient around the user's model and data, and its ClientApp.

A Flower user keeps their own model, data loading and ``client_fn``; an algorithm's client takes them as they are:

    def client_fn(context: Context) -> FedPDMClient:
        return FedPDMClient(Net(), load_my_partition(context.node_config), loss_fn=nn.CrossEntropyLoss())

    app = FedPDMClient.client_app(client_fn)        # a ClientApp with every action the algorithm needs

or, in an existing ClientApp, ``register(app, client_fn, FedPDMClient.actions)``.

* **Model**: a torch ``nn.Module`` (with ``loss_fn``; :class:`fedpdm_flower.fedapp.models.torch_model.TorchModel`), or a numpy
  model object with ``dim``, ``grad(x, inputs, targets)`` and ``loss(x, inputs, targets)`` (the papers' linear
  models are such objects). The algorithms work on its flat parameter vector. It stays on the user's device.
* **Buffers** (BatchNorm's running statistics and ``num_batches_tracked``, any registered buffer) are state
  *beside* the algorithm's vector: the local training's forward passes update them as the module says, no dual,
  control variate, sparsifier or noise touches them, and they travel in the message's ``"buffers"`` record
  (:data:`fedpdm_flower.fedapp.wire.BUFFERS_KEY`): the server sends its buffers, the client loads them, trains and
  replies with its own, which the server averages as Flower's FedAvg does (weighted by ``num-examples``, integer
  entries rounded back; :mod:`fedpdm_flower.strategies.base`). Under Flower's own strategies they travel inside the
  model's arrays. A round that asks for differential privacy refuses a model with floating-point buffers, as
  Opacus's validator does (:meth:`FedClient.refuse_buffers_under_dp`). FedREP keeps them in its vector instead
  (``buffers = "in-vector"``, :mod:`fedpdm_flower.clients.fedrep`).
* **Data**: ``(x, y)`` arrays, an object with ``x`` / ``y`` arrays, or a torch ``Dataset`` / ``DataLoader`` with
  ``(input, target)`` or dict samples (:mod:`fedpdm_flower.fedapp.localdata`, which also says when the loader's sampler is
  used). ``test_data`` is what :meth:`FedClient.evaluate` scores on (Flower's federated evaluation).
* **Hyperparameters** come in each message's config from the strategy (the single source of truth); the client
  reads nothing algorithmic from the run config. Every message is untrusted input: :class:`MessageConfig`
  checks each value's type and range and names the key it rejects.
* **State** (duals, control variates, error memory, privacy ledgers) lives in ``context.state``; the client
  object holds none, so Flower may rebuild it at will. :func:`register` nevertheless keeps one client per node
  and process (an LRU of ``cache_size``), so data and model load once per process, not once per message.
* **Randomness** (mini-batch order, DP noise, rand-k) is the device's: ``seed=None`` (default) draws from the OS;
  an integer seed makes a client reproducible (the reproduction app passes the run's seed). The server cannot
  choose it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from numpy.typing import NDArray

from fedpdm_flower.fedapp.layout import FloatArray
from fedpdm_flower.fedapp.localdata import ArrayData, SampledData, TorchData, as_local_data
from fedpdm_flower.fedapp.sampling import STREAM_CLIENT, rng_for
from fedpdm_flower.fedapp.wire import BUFFERS_KEY, array_record, named_record, numpy_list, reply_content

__all__ = ["FedClient", "MessageConfig", "as_flat_model", "register"]

C = TypeVar("C", bound="FedClient")
#: config keys of the strategy base (fedpdm_flower/strategies/base.py) every train message carries
LAYOUT_KEY, DIM_KEY, ROUND_KEY = "layout-crc", "dim", "server-round"


def as_flat_model(model: Any, loss_fn: Any = None, *, buffers: str = "beside") -> Any:
    """The user's model behind the flat-vector interface (``dim``, ``grad``, ``loss``, ``accuracy``).

    A numpy model object (with ``dim``, ``grad`` and ``loss``) is used as it is and must not get a ``loss_fn``; a
    torch ``nn.Module`` is wrapped in :class:`fedpdm_flower.fedapp.models.torch_model.TorchModel` with ``loss_fn`` (default
    cross-entropy) and ``buffers`` (where its floating-point buffers live: ``"beside"`` the vector, or
    ``"in-vector"``). torch is imported only for a torch model, so a numpy client never loads it.
    """
    if all(hasattr(model, a) for a in ("dim", "grad", "loss")):
        if loss_fn is not None:
            raise ValueError(f"{type(model).__name__} is a numpy model with its own loss; do not pass loss_fn")
        return model
    try:
        from torch import nn
    except ImportError:
        nn = None  # type: ignore[assignment]
    if nn is not None and isinstance(model, nn.Module):
        from fedpdm_flower.fedapp.models.torch_model import TorchModel

        return TorchModel(model, loss_fn, buffers=buffers)
    raise TypeError(f"cannot train {type(model).__name__}: pass a torch nn.Module (and a loss_fn), or a numpy model "
                    "object with dim, grad(x, inputs, targets) and loss(x, inputs, targets)")


class MessageConfig:
    """Typed, range-checked reads of a message's config (the server is not trusted to send sane values).

    Each getter raises ValueError naming the key, so the client answers with a clear error reply.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)

    def __contains__(self, key: str) -> bool:
        return key in self.config

    def _get(self, key: str, default: Any) -> Any:
        if key in self.config:
            return self.config[key]
        if default is _REQUIRED:
            raise ValueError(f"message config lacks {key!r}")
        return default

    def number(self, key: str, default: Any = None, *, lo: float = -math.inf, hi: float = math.inf,
               lo_open: bool = False, hi_open: bool = False) -> float:
        """A finite float in [lo, hi] (open ends with ``lo_open`` / ``hi_open``)."""
        v = self._get(key, _REQUIRED if default is None else default)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"message config {key!r} must be a finite number, got {v!r}")
        v = float(v)
        if v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
            left, right = "(" if lo_open else "[", ")" if hi_open else "]"
            raise ValueError(f"message config {key!r} = {v!r} lies outside {left}{lo}, {hi}{right}")
        return v

    def integer(self, key: str, default: Any = None, *, lo: int = 0, hi: int | None = None) -> int:
        """An integer in [lo, hi]."""
        v = self._get(key, _REQUIRED if default is None else default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"message config {key!r} must be an integer, got {v!r}")
        if v < lo or (hi is not None and v > hi):
            raise ValueError(f"message config {key!r} = {v} lies outside [{lo}, {'inf' if hi is None else hi}]")
        return int(v)

    def flag(self, key: str, default: bool | None = None) -> bool:
        """A bool."""
        v = self._get(key, _REQUIRED if default is None else default)
        if not isinstance(v, bool):
            raise ValueError(f"message config {key!r} must be true or false, got {v!r}")
        return v

    def choice(self, key: str, choices: Sequence[str], default: str | None = None) -> str:
        """One of ``choices``."""
        v = self._get(key, _REQUIRED if default is None else default)
        if v not in choices:
            raise ValueError(f"message config {key!r} = {v!r} is not one of {list(choices)}")
        return str(v)


_REQUIRED = object()
#: context.state record of a node's own buffers (``node_local_buffers``)
NODE_BUFFERS = "model.buffers"


def _scalar(name: Any, value: Any) -> int | float:
    """A metric value as Flower's MetricRecord takes it (numpy and torch scalars cast to int / float)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}") from None


class FedClient(NumPyClient):
    """Shared client plumbing: the user's model and data, state in ``context.state``, the device's randomness.

    Parameters
    ----------
    model
        A torch ``nn.Module`` or a numpy model object (see :func:`as_flat_model`).
    data
        The local training data: ``(x, y)`` arrays, an object with ``x`` / ``y``, or a torch ``Dataset`` /
        ``DataLoader`` (:func:`fedpdm_flower.fedapp.localdata.as_local_data`). May be None for a client that only routes.
    loss_fn
        The loss of a torch model, ``loss_fn(outputs, targets)`` with mean reduction (default cross-entropy).
    context
        The node's Flower Context (state persists there across rounds); :func:`register` binds it on every
        message, so a ``client_fn`` need not pass it.
    seed
        The device's seed for its randomness (mini-batches, noise); None (default) draws from the OS.
    test_data
        The data :meth:`evaluate` scores the server's model on (Flower's federated evaluation): like ``data``,
        e.g. the template's ``valloader``. None: an evaluate message is answered with an error naming this argument
        (the training data is not a test set).
    test_fn
        The user's own evaluation, ``test_fn(module, test_data) -> {"metric": number, ...}``, called with the torch
        module loaded with the server's model (weights and buffers) and ``test_data`` as given; its keys are the
        reply's metrics. None (default): ``{"loss", "accuracy"}`` with ``loss_fn``, in eval mode.
    """

    #: message actions beyond train / evaluate / query.whoami (e.g. ("query.propose",)), registered by client_app
    actions: ClassVar[tuple[str, ...]] = ()
    #: where a torch model's floating-point buffers live: "beside" the algorithm's vector (default) or "in-vector"
    buffers: ClassVar[str] = "beside"
    #: True for a node that owns its buffers (decentralized algorithms: no server model to take them from); they
    #: persist in context.state between rounds
    node_local_buffers: ClassVar[bool] = False

    def __init__(self, model: Any, data: Any = None, loss_fn: Any = None, *, context: Context | None = None,
                 seed: int | None = None, test_data: Any = None, test_fn: Any = None) -> None:
        self.model = as_flat_model(model, loss_fn, buffers=self.buffers)
        self.data: ArrayData | TorchData | None = None if data is None else as_local_data(data)
        self._test_source = test_data
        self.test: ArrayData | TorchData | None = None if test_data is None else as_local_data(test_data)
        if test_fn is not None and not callable(test_fn):
            raise TypeError(f"test_fn must be a callable (module, test_data) -> metrics, got {type(test_fn).__name__}")
        if test_fn is not None and not hasattr(self.model, "module"):
            raise ValueError("test_fn needs a torch nn.Module (it is called with the module)")
        self.test_fn = test_fn
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be an integer >= 0 or None, got {seed!r}")
        self.seed = seed
        self.node_context: Context | None = None
        self.client_id = 0
        if context is not None:
            self.bind(context)

    # ---------------------------------------------------------------- node and state
    def bind(self, context: Context) -> None:
        """Use this message's Context (its state, and the node's identity for the RNG streams)."""
        self.node_context = context
        pid = context.node_config.get("partition-id")
        self.client_id = int(pid) if isinstance(pid, int) and not isinstance(pid, bool) else int(context.node_id)

    @property
    def state(self) -> RecordDict:
        """``context.state`` of the bound Context."""
        if self.node_context is None:
            raise RuntimeError(f"{type(self).__name__} has no Context: pass context=... or build it through register()")
        return self.node_context.state

    def load_vector(self, name: str) -> FloatArray | None:
        """A float64 vector saved by an earlier round, or None the first time."""
        rec = self.state.array_records.get(name)
        return None if rec is None else numpy_list(rec)[0].astype(np.float64)

    def save_vector(self, name: str, value: NDArray[Any]) -> None:
        """Persist a vector across rounds (float64: duals accumulate, float32 rounding would drift)."""
        self.state[name] = array_record([np.asarray(value, dtype=np.float64)])

    def rng(self, server_round: int, stream: int = 0, *extra: int) -> np.random.Generator:
        """Per-(client, round, stream[, extra]) generator: reproducible with a seed, fresh OS entropy without."""
        if self.seed is None:
            return np.random.default_rng()
        return rng_for(self.seed, STREAM_CLIENT, self.client_id, server_round, stream, *extra)

    @property
    def num_examples(self) -> int:
        """|D_i| (0 for a client without data)."""
        return 0 if self.data is None else len(self.data)

    def require_data(self) -> ArrayData | TorchData:
        """The local data (an error for a routing-only client asked to train)."""
        if self.data is None:
            raise ValueError(f"{type(self).__name__} was built without local data")
        return self.data

    # ---------------------------------------------------------------- buffers (state beside the vector)
    @property
    def beside_names(self) -> list[str]:
        """The model's state-dict entries beside the algorithm's vector (buffers, integer entries); [] for a numpy
        model."""
        return list(getattr(self.model, "beside_names", []))

    def refuse_buffers_under_dp(self, why: str = "this round asks for differential privacy") -> None:
        """Refuse a model with floating-point buffers in a private round (as Opacus's ``ModuleValidator`` does).

        A buffer such as BatchNorm's running statistics is computed from the data outside the gradient: no clipping
        bounds what it reveals, and it would leave the device outside the privacy analysis.
        """
        names = list(getattr(self.model, "buffer_names", []))
        if names:
            raise ValueError(
                f"{type(self).__name__}: {why}, and the model has floating-point buffers {names[:3]}"
                f"{' ...' if len(names) > 3 else ''} (state computed from the data outside the gradient, such as "
                "BatchNorm's running statistics), which no privacy analysis covers. Differentially private training "
                "refuses them, as Opacus's validator does; the one-line fix swaps BatchNorm for GroupNorm: "
                "model = opacus.validators.ModuleValidator.fix(model)")

    def training_data(self, private: bool) -> Any:
        """The data the local loop draws its batches from: through one pass of the loader's own sampler when the
        round is not private and the loader has one (:mod:`fedpdm_flower.fedapp.localdata`, "Sampling"), else the data
        itself (under DP the algorithm's sampling is the one its privacy analysis assumes)."""
        data = self.require_data()
        order = None if private or not isinstance(data, TorchData) else data.sample_order()
        return data if order is None else SampledData(data, order)

    def split_arrays(self, parameters: list[NDArray[Any]]) -> FloatArray | None:
        """The flat vector x of a model sent as the model's own arrays (a state dict, as Flower's strategies send
        it), with its buffers loaded into the model; None when ``parameters`` are not laid out that way."""
        layout = getattr(self.model, "layout", None)
        if layout is None or len(parameters) != len(layout.entries):
            return None
        if any(tuple(np.shape(a)) != e.shape for a, e in zip(parameters, layout.entries, strict=True)):
            return None
        parts = [np.asarray(a, dtype=np.float64).reshape(-1) for a, e in zip(parameters, layout.entries, strict=True)
                 if e.in_vector]
        if self.beside_names:
            self.model.set_buffers({e.name: np.asarray(a) for a, e in zip(parameters, layout.entries, strict=True)
                                    if not e.in_vector})
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    def model_vector(self, parameters: list[NDArray[Any]]) -> FloatArray:
        """x from a message's arrays: the model's own arrays (buffers loaded too), one flat vector of d values, or
        (a numpy model) arrays whose floating-point values concatenate to d."""
        x = self.split_arrays(parameters)
        if x is not None:
            return x
        if len(parameters) == 1 and np.asarray(parameters[0]).size == self.model.dim:
            return np.asarray(parameters[0], dtype=np.float64).ravel()
        floats = [np.asarray(a, dtype=np.float64).ravel() for a in parameters
                  if np.issubdtype(np.asarray(a).dtype, np.floating)]
        if getattr(self.model, "layout", None) is None and floats and sum(len(f) for f in floats) == self.model.dim:
            return np.concatenate(floats)
        shapes = [tuple(np.shape(a)) for a in parameters]
        raise ValueError(f"the message's arrays {shapes[:6]}{' ...' if len(shapes) > 6 else ''} are neither this "
                         f"model's state dict nor one vector of its {self.model.dim} parameters")

    def check_model(self, cfg: MessageConfig) -> None:
        """The server's model must be this model: same d, and the same layout for a torch model."""
        d = cfg.integer(DIM_KEY, lo=1)
        if d != self.model.dim:
            raise ValueError(f"the server's model has d = {d} parameters, this client's model has {self.model.dim}")
        layout = getattr(self.model, "layout", None)
        if layout is not None and LAYOUT_KEY in cfg and cfg.integer(LAYOUT_KEY) != layout.fingerprint():
            beside = layout.buffer_names
            hint = (f" (this model keeps its buffers {beside[:3]} beside the vector; the server recognises buffers by "
                    "torch's names, running_mean / running_var)" if beside else "")
            raise ValueError("the server's arrays are not laid out like this model's state_dict (names, shapes or "
                             "which entries are buffers differ): start the strategy with "
                             f"initial_arrays=ArrayRecord(net.state_dict()){hint}")

    # ---------------------------------------------------------------- NumPyClient API
    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        """Who this node is (the server asks with query.whoami): its partition-id / num-partitions, if any."""
        nc = {} if self.node_context is None else self.node_context.node_config
        return {k: int(nc[k]) for k in ("partition-id", "num-partitions") if isinstance(nc.get(k), int)}

    def evaluate(self, parameters: list[Any], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        """The server's model scored on this client's ``test_data`` (Flower's federated evaluation).

        ``parameters`` are the model's own arrays (a state dict, as Flower's strategies and ours send it: weights and
        buffers) or one flat vector. Returns (loss, |test data|, metrics): ``test_fn``'s metrics when the client has
        one, else ``{"accuracy"}`` (classification only) beside the loss of ``loss_fn``.
        """
        if self.test is None:
            raise ValueError(f"{type(self).__name__} was built without test_data: pass test_data=... (e.g. the "
                             "template's valloader) to answer evaluate messages")
        x = self.model_vector(parameters)
        n = len(self.test)
        if self.test_fn is not None:
            self.model.set_flat(x)
            self.model.module.eval()
            got = self.test_fn(self.model.module, self._test_source)
            if not isinstance(got, Mapping):
                raise TypeError(f"test_fn must return a mapping of metric names to numbers, got {type(got).__name__}")
            metrics = {str(k): _scalar(k, v) for k, v in got.items()}
            loss = metrics.get("loss", math.nan)
            return float(loss), n, metrics
        if hasattr(self.model, "evaluate_chunks"):
            acc, loss, n = self.model.evaluate_chunks(x, self.test.chunks(self.model.eval_batch))
        else:
            feats, labels = self.test.all()
            loss = float(self.model.loss(x, feats, labels))
            acc = float(self.model.accuracy(x, feats, labels)) if hasattr(self.model, "accuracy") else math.nan
        return float(loss), n, ({"accuracy": float(acc)} if math.isfinite(acc) else {})

    # ---------------------------------------------------------------- one message
    def handle(self, message_type: str, content: RecordDict) -> RecordDict:
        """Answer one message's content (train, evaluate, query.whoami, or a registered query.<phase>).

        A ``"buffers"`` record (the server's buffers, :data:`fedpdm_flower.fedapp.wire.BUFFERS_KEY`) is loaded into the
        model before training or evaluating, and a train reply to it carries the client's buffers after training.
        """
        if message_type == "query.whoami":
            return RecordDict({"info": ConfigRecord(self.get_properties({}))})
        key = _pick({k: v for k, v in content.array_records.items() if k != BUFFERS_KEY}, "arrays")
        params = numpy_list(content.array_records[key]) if key else []
        ckey = _pick(content.config_records, "config")
        config: dict[str, Any] = dict(content.config_records[ckey]) if ckey else {}
        sent = self.receive_buffers(content, message_type)
        if message_type == "train":
            arrays, n, metrics = self.fit(params, config)
            reply = reply_content(arrays, n, metrics, arrays_key=key or "arrays")
            if key and _same_layout(arrays, params):  # the model's own arrays back (Flower's strategies): its names
                reply[key] = named_record(dict(zip(content.array_records[key].keys(), arrays, strict=True)))
            share, self._share_buffers = getattr(self, "_share_buffers", False), False
            return self.reply_buffers(reply, sent, share=share)
        if message_type == "evaluate":
            loss, n, eval_metrics = self.evaluate(params, config)
            out = {str(k): _scalar(k, v) for k, v in eval_metrics.items()}
            if "loss" not in out and math.isfinite(loss):
                out["loss"] = float(loss)
            return RecordDict({"metrics": MetricRecord({**out, "num-examples": int(n)})})
        if message_type.startswith("query.") and message_type in self.actions:
            method = getattr(self, message_type.removeprefix("query."))
            arrays, metrics = method(params, config)
            return reply_content(arrays, 0, metrics, arrays_key=key or "arrays")
        raise ValueError(f"{type(self).__name__} does not answer {message_type!r} messages")

    def receive_buffers(self, content: RecordDict, message_type: str) -> bool:
        """Load the server's buffers when the message carries them (True), else, for a node that owns its buffers,
        the ones it kept in context.state (False)."""
        if not self.beside_names:
            return False
        record = content.array_records.get(BUFFERS_KEY)
        if record is not None:
            self.model.set_buffers({k: v.numpy() for k, v in record.items()})
            return True
        if self.node_local_buffers and message_type == "train" and self.node_context is not None:
            kept = self.state.array_records.get(NODE_BUFFERS)
            if kept is not None:
                self.model.set_buffers({k: v.numpy() for k, v in kept.items()})
        return False

    def reply_buffers(self, reply: RecordDict, sent: bool, *, share: bool = False) -> RecordDict:
        """A train reply with the client's buffers when the server sent its own (or ``share``); a node that owns its
        buffers keeps them in context.state."""
        if not self.beside_names:
            return reply
        buffers = self.model.get_buffers()
        if self.node_local_buffers and self.node_context is not None and not sent:
            self.state[NODE_BUFFERS] = named_record(buffers)
        if sent or share:
            reply[BUFFERS_KEY] = named_record(buffers)
        return reply

    @classmethod
    def client_app(cls: type[C], client_fn: Callable[[Context], C], *, mods: list[Any] | None = None,
                   cache_size: int = 128) -> ClientApp:
        """A ClientApp answering every action this algorithm needs, with clients built by ``client_fn``."""
        app = ClientApp(mods=mods or [])
        register(app, client_fn, cls.actions, cache_size=cache_size)
        return app


def _same_layout(out: Sequence[NDArray[Any]], received: Sequence[NDArray[Any]]) -> bool:
    """Whether a reply's arrays have the received arrays' count and shapes (the model sent back in its own layout)."""
    return len(out) == len(received) and all(np.shape(a) == np.shape(b) for a, b in zip(out, received, strict=True))


def _pick(records: Mapping[str, Any], preferred: str) -> str | None:
    """The record named ``preferred``, else the only record there is (a strategy may rename its records)."""
    if preferred in records:
        return preferred
    return next(iter(records)) if len(records) == 1 else None


class _ClientCache:
    """One client object per (run, node) and process, least recently used first out."""

    def __init__(self, client_fn: Callable[[Context], FedClient], size: int) -> None:
        self.client_fn = client_fn
        self.size = size
        self.items: OrderedDict[tuple[int, int], FedClient] = OrderedDict()

    def get(self, context: Context) -> FedClient:
        key = (int(context.run_id), int(context.node_id))
        client = self.items.get(key)
        if client is None:
            client = self.client_fn(context)
            if not isinstance(client, FedClient):
                raise TypeError(f"client_fn returned {type(client).__name__}, expected one of our FedClient classes")
            if self.size > 0:
                self.items[key] = client
                while len(self.items) > self.size:
                    self.items.popitem(last=False)
        else:
            self.items.move_to_end(key)
        client.bind(context)
        return client


def register(app: ClientApp, client_fn: Callable[[Context], FedClient], actions: Sequence[str] = (), *,
             cache_size: int = 128) -> None:
    """Register train, evaluate, query.whoami and ``actions`` (e.g. "query.propose") on ``app``.

    ``client_fn(context)`` builds the client; with ``cache_size > 0`` it is called once per node and process and
    the client is re-bound to each message's Context (all round-to-round state is in ``context.state``).
    An exception becomes a Flower error reply whose reason is ``"<Type>: <message>"`` (no remote traceback), which
    the strategy logs with the node id, counts, and quotes if the round fails.
    """
    cache = _ClientCache(client_fn, cache_size)

    def make(mtype: str) -> Callable[[Message, Context], Message]:
        def answer(msg: Message, context: Context) -> Message:
            try:
                return Message(cache.get(context).handle(mtype, msg.content), reply_to=msg)
            except Exception as err:  # the message's failure, reported to the server as "<Type>: <message>"
                return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(err).__name__}: {err}"),
                               reply_to=msg)

        answer.__name__ = mtype.replace(".", "_")
        return answer

    app.train()(make("train"))
    app.evaluate()(make("evaluate"))
    app.query("whoami")(make("query.whoami"))
    for action in actions:
        category, _, name = action.partition(".")
        if category != "query" or not name:
            raise ValueError(f"extra actions must be 'query.<name>', got {action!r}")
        app.query(name)(make(action))
