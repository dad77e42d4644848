"""The round engine of our Message-API strategies: keyword-constructed, model-agnostic, Flower's vocabulary.

A subclass supplies the algorithm's server side (per-client payload, decoding, aggregation); this base does what
every algorithm needs the same way:

* **the model**: :meth:`FederatedStrategy.initialize` takes the user's ``ArrayRecord`` (any torch state dict or
  list of numpy arrays) and keeps one float64 vector x of its floating-point entries
  (:class:`fedapp.layout.ArrayLayout`); :meth:`current_arrays` gives the user's layout back (names, shapes and
  dtypes as given; integer entries carried unchanged). No model name or dimension is needed up front;
* **the federation**: waiting for ``min_available_nodes``, learning which node is which client (a
  ``query.whoami`` that our client apps answer with the node's ``partition-id``; nodes that cannot answer get ids
  by the order of their node ids), and seeded sampling of ``fraction_train`` of them per round;
* **the messages**: the config each client receives carries every algorithmic value it needs (the strategy is
  the single source of truth); the user's ``train_config`` is merged in;
* **untrusted replies**: each reply is validated before it touches state (arrays and metrics present, metric
  values typed and finite, then the algorithm's own decoding); a bad reply is logged with the node id and costs
  only that reply, and a round in which no reply is accepted stops the run with :class:`RoundFailed`, quoting
  the clients' errors;
* **bookkeeping**: bytes counted from the serialized records both ways, per-client privacy figures, central
  evaluation through Flower's ``evaluate_fn``, and a per-round history (:class:`fedapp.results.RoundRecord`).

The in-process driver (``simulations/inprocess.py``) calls :meth:`train_contents` / :meth:`consume_replies` /
:meth:`evaluate_round` with the same RecordDicts, so both drivers run the same code.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from numpy.typing import NDArray

from fedapp.compression.codec import MalformedPayload
from fedapp.layout import ArrayLayout, FloatArray, LayoutMismatch
from fedapp.results import RoundRecord
from fedapp.sampling import rng_for, select_clients
from fedapp.wire import recorddict_nbytes, train_content

Scalar = int | float | str | bool
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
WHOAMI = "query.whoami"
#: config keys every train message carries (a user's train_config may not use them)
LAYOUT_KEY, DIM_KEY, ROUND_KEY = "layout-crc", "dim", "server-round"

__all__ = [
    "DIM_KEY",
    "LAYOUT_KEY",
    "ROUND_KEY",
    "WHOAMI",
    "FederatedStrategy",
    "FederationError",
    "RoundBookkeeping",
    "RoundFailed",
    "arrays_of",
    "concise_error",
    "record_of",
]


class FederationError(RuntimeError):
    """The connected nodes do not form the federation the strategy needs."""


class RoundFailed(FederationError):
    """No reply of a round was accepted; the message quotes the clients' distinct errors with counts.

    Attributes
    ----------
    server_round
        The round that failed.
    errors
        ``{error text: number of clients}`` of the rejected replies.
    """

    def __init__(self, server_round: int, errors: Counter[str], sent: int) -> None:
        self.server_round = server_round
        self.errors = errors
        quoted = "; ".join(f'{n}x "{why}"' for why, n in errors.most_common(3))
        more = f"; and {len(errors) - 3} other error(s)" if len(errors) > 3 else ""
        got = sum(errors.values())
        super().__init__(f"round {server_round}: no reply accepted ({got} rejected, {sent - got} missing of "
                         f"{sent} sent){': ' + quoted if quoted else ''}{more}")


_CLASS_WRAPPED = re.compile(r"^<class '[^']*'>:<'(.*)'>$", re.DOTALL)


def concise_error(reason: str, limit: int = 300) -> str:
    """The client's own error message from a Flower error reply (which may wrap a whole remote traceback)."""
    text = reason.strip()
    if "Message: " in text:  # ClientAppException in the simulation engine: "... Message: <the client's text>'>"
        text = text.rsplit("Message: ", 1)[1]
    match = _CLASS_WRAPPED.match(text)
    if match:
        text = match.group(1)
    text = text.strip().rstrip(">").rstrip("'\"").strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."


def arrays_of(record: ArrayRecord) -> dict[str, NDArray[Any]]:
    """The named numpy arrays of an ArrayRecord, in its order."""
    return {k: v.numpy() for k, v in record.items()}


def record_of(arrays: Mapping[str, NDArray[Any]]) -> ArrayRecord:
    """An ArrayRecord holding ``arrays`` under their names, in order (a 0-d array stays 0-d: np.ascontiguousarray
    would make it 1-d)."""
    return ArrayRecord({k: Array(np.asarray(v, order="C")) for k, v in arrays.items()})


def _metric_ok(value: Any) -> bool:
    """A metric value Flower's MetricRecord can hold, finite (a reply is untrusted input)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_metric_ok(v) for v in value)
    return False


class RoundBookkeeping:
    """Per-round records of a strategy: central evaluation, bytes, privacy, diagnostics -> ``history``.

    Mixed into :class:`FederatedStrategy` and into our wrappers of Flower's own strategies; the class it is mixed
    into provides :meth:`current_arrays` and fills ``_acc`` during a round.
    """

    #: name of the headline epsilon in the per-round progress line
    privacy_label = "eps"
    #: client metric keys holding cumulative privacy figures; reduced as max over clients of the latest value
    PRIVACY_KEYS: tuple[str, ...] = ()

    def init_bookkeeping(self, *, eval_every: int = 1) -> None:
        """Empty history, privacy table and per-round accumulators."""
        if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
            raise ValueError(f"eval_every must be an integer >= 1, got {eval_every!r}")
        self.eval_every = eval_every
        self.num_rounds = 0
        self.evaluate_fn: EvaluateFn | None = None
        self.history: list[RoundRecord] = []
        self.client_privacy: dict[int, dict[str, float]] = {}
        self.rejected_total = 0
        self._acc: dict[str, Any] = {}

    def current_arrays(self) -> ArrayRecord:
        """The global model in the user's layout."""
        raise NotImplementedError

    def record_privacy(self, client: int, metrics: Mapping[str, Any]) -> None:
        """Keep a client's latest cumulative privacy figures (clients not sampled keep theirs)."""
        priv = {k: float(v) for k in self.PRIVACY_KEYS if isinstance(v := metrics.get(k), int | float)}
        if priv:
            self.client_privacy[client] = priv

    def privacy_summary(self) -> dict[str, float]:
        """Worst client (max) of each accountant's cumulative epsilon so far."""
        out: dict[str, float] = {}
        for key in self.PRIVACY_KEYS:
            vals = [p[key] for p in self.client_privacy.values() if key in p]
            if vals:
                out[key] = max(vals)
        return out

    def headline_privacy(self, priv: Mapping[str, float]) -> tuple[float | None, float | None]:
        """(epsilon, delta) of the round record; None without DP (a DP subclass names its accountant)."""
        return None, None

    def evaluate_round(self, server_round: int) -> RoundRecord:
        """Central evaluation (``evaluate_fn``) + the round's record (appended to ``history``) + one progress line."""
        rec = RoundRecord(round=server_round)
        last = self.num_rounds and server_round == self.num_rounds
        if self.evaluate_fn is not None and (server_round % self.eval_every == 0 or last):
            res = self.evaluate_fn(server_round, self.current_arrays())
            for key, value in (dict(res) if res is not None else {}).items():
                if key in ("accuracy", "test_accuracy") and isinstance(value, int | float):
                    rec.test_accuracy = float(value)
                elif key in ("loss", "test_loss") and isinstance(value, int | float):
                    rec.test_loss = float(value)
                else:
                    rec.extra[key] = value
        priv = self.privacy_summary()
        rec.epsilon, rec.delta = self.headline_privacy(priv)
        rec.uplink_bytes, rec.downlink_bytes = int(self._acc.get("up", 0)), int(self._acc.get("down", 0))
        rec.wall_s = time.perf_counter() - float(self._acc.get("t0", time.perf_counter()))
        rec.extra.update(self._acc.get("diag", {}))
        rec.extra.update({f"privacy_{k}": v for k, v in priv.items()})
        self.history.append(rec)
        acc = "n/a" if rec.test_accuracy is None else f"{rec.test_accuracy:.4f}"
        eps = "" if rec.epsilon is None else f" {self.privacy_label}={rec.epsilon:.3g}"
        log(INFO, "[round %d/%d] test_acc=%s%s clients=%d rejected=%d up=%.1fkB down=%.1fkB %.2fs",
            server_round, self.num_rounds, acc, eps, int(rec.extra.get("clients", 0)),
            int(rec.extra.get("rejected", 0)), rec.uplink_bytes / 1e3, rec.downlink_bytes / 1e3, rec.wall_s)
        return rec

    def _evaluate_hook(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """What ``Strategy.start`` calls after each round: the user's evaluate_fn, recorded in the history."""
        if server_round == 0:
            return self.evaluate_fn(0, arrays) if self.evaluate_fn is not None else None
        rec = self.evaluate_round(server_round)
        out = {"test_accuracy": rec.test_accuracy, "test_loss": rec.test_loss}
        return MetricRecord({k: float(v) for k, v in out.items() if v is not None}) or None



class FederatedStrategy(RoundBookkeeping, Strategy):
    """Base of our server-side algorithms (Flower Message API), constructed with keywords.

    Parameters
    ----------
    fraction_train
        Fraction of the connected clients sampled for training each round (default 1.0). The sample size is
        ``max(int(N * fraction_train), min_train_nodes)``, capped at N, as in Flower's ``FedAvg``.
    min_train_nodes
        Smallest number of clients sampled per round (default 2).
    min_available_nodes
        Clients that must be connected before round 1 (default 2); the federation is the set of nodes connected
        then (nodes joining later are not used).
    first_round_all
        Sample every client in round 1 (FedPDM's S_0 = [N], Alg. 1 line 2; default False).
    seed
        Seed of the server's randomness (client sampling and any algorithm draws); None draws one from the OS and
        logs it, so a run can be repeated.
    require_partition_ids
        Every node must report a ``partition-id`` in its node config, and the ids must be exactly 0..N-1 (graph
        algorithms index agents by it; the reproduction app maps partitions to clients). Default False: a node
        without one is numbered by the order of the node ids.
    node_wait_s
        Seconds to wait for nodes and for each exchange (default 120).
    eval_every
        Run ``evaluate_fn`` every this many rounds, and always in the last (default 1).
    arrayrecord_key, configrecord_key
        Names of the records in the messages (Flower's defaults "arrays" and "config").
    """

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        first_round_all: bool = False,
        seed: int | None = None,
        require_partition_ids: bool = False,
        node_wait_s: float = 120.0,
        eval_every: int = 1,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
    ) -> None:
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must lie in (0, 1], got {fraction_train!r}")
        for name, v in (("min_train_nodes", min_train_nodes), ("min_available_nodes", min_available_nodes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not node_wait_s > 0:
            raise ValueError(f"node_wait_s must be > 0, got {node_wait_s!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be an integer >= 0 or None, got {seed!r}")
        self.fraction_train = float(fraction_train)
        self.min_train_nodes = min_train_nodes
        self.min_available_nodes = min_available_nodes
        self.first_round_all = bool(first_round_all)
        self.seed = int(seed) if seed is not None else secrets.randbits(32)
        self.seed_was_given = seed is not None
        self.require_partition_ids = bool(require_partition_ids)
        self.node_wait_s = float(node_wait_s)
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.node_of: dict[int, int] = {}  # client id -> node id
        self.pid_of: dict[int, int] = {}  # node id -> client id
        self.num_clients = 0
        self.layout: ArrayLayout | None = None
        self._carried: dict[str, NDArray[Any]] = {}
        self.x: FloatArray = np.zeros(0)
        self.user_config: dict[str, Any] = {}
        self.init_bookkeeping(eval_every=eval_every)

    # ------------------------------------------------------------------ the model
    def initialize(self, initial_arrays: ArrayRecord) -> None:
        """Take the user's initial model: its layout, x = its floating-point entries, then :meth:`on_initialize`."""
        if not isinstance(initial_arrays, ArrayRecord):
            raise TypeError(f"initial_arrays must be a flwr ArrayRecord, got {type(initial_arrays).__name__}")
        arrays = arrays_of(initial_arrays)
        self.layout = ArrayLayout.of(arrays)
        self._carried = {e.name: arrays[e.name] for e in self.layout.entries if not e.in_vector}
        x = self.layout.flatten(arrays)
        if not np.all(np.isfinite(x)):
            raise ValueError("initial_arrays hold NaN or Inf values")
        self.x = x
        self.on_initialize()

    def on_initialize(self) -> None:
        """Allocate the algorithm's server state once ``self.dim`` is known (duals, control variates, ...)."""

    @property
    def dim(self) -> int:
        """d, the number of floating-point parameters (0 before :meth:`initialize`)."""
        return 0 if self.layout is None else self.layout.dim

    def global_model(self) -> FloatArray:
        """x: the model the server evaluates and returns (flat, float64)."""
        return self.x

    def current_arrays(self) -> ArrayRecord:
        """The global model in the user's layout (the ArrayRecord ``start`` returns)."""
        if self.layout is None:
            raise RuntimeError("the strategy has no model yet: call start(...) or initialize(...) first")
        return record_of(self.layout.unflatten(self.global_model(), self._carried))

    # ------------------------------------------------------------------ algorithm hooks
    @abstractmethod
    def client_payload(self, server_round: int, client: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        """Arrays and config sent to one sampled client this round."""

    @abstractmethod
    def decode_update(self, server_round: int, client: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        """Validate and decode one reply; raise MalformedPayload (a ValueError) to reject it."""

    @abstractmethod
    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Update the server state from the accepted updates; return diagnostics for the round record."""

    def common_config(self) -> dict[str, Scalar]:
        """Config every train message carries: the layout fingerprint and d (clients check both)."""
        assert self.layout is not None
        return {LAYOUT_KEY: self.layout.fingerprint(), DIM_KEY: self.dim}

    # ------------------------------------------------------------------ federation membership
    def attach(self, node_of: Mapping[int, int]) -> None:
        """Set the client-id -> node-id map (the in-process driver uses node id = client id)."""
        ids = sorted(node_of)
        if self.require_partition_ids and ids != list(range(len(ids))):
            raise FederationError(f"partition ids {ids} are not exactly 0..{len(ids) - 1}")
        if len(ids) < self.min_available_nodes:
            raise FederationError(f"{len(ids)} clients, but min_available_nodes = {self.min_available_nodes}")
        self.node_of = dict(node_of)
        self.pid_of = {v: k for k, v in node_of.items()}
        self.num_clients = len(ids)

    def connect(self, grid: Grid) -> None:
        """Wait for ``min_available_nodes``, then learn each node's client id (``query.whoami``)."""
        n = self.min_available_nodes
        simulated = type(grid).__name__ == "InMemoryGrid"
        deadline = time.time() + (5.0 if simulated else self.node_wait_s)
        while len(ids := sorted(grid.get_node_ids())) < n:
            if time.time() > deadline:
                hint = (f'pass --federation-config "num-supernodes={n}" to flwr run' if simulated else
                        f"start {n} SuperNodes (each with --node-config \"partition-id=<i> num-partitions={n}\")")
                raise FederationError(f"min_available_nodes = {n} but only {len(ids)} node(s) are connected: {hint}")
            time.sleep(1.0)
        msgs = [Message(RecordDict({"config": ConfigRecord()}), dst_node_id=nid, message_type=WHOAMI) for nid in ids]
        reported: dict[int, tuple[int, int | None]] = {}
        failed: dict[int, str] = {}
        for reply in grid.send_and_receive(msgs, timeout=self.node_wait_s):
            nid = reply.metadata.src_node_id
            info = {} if reply.has_error() else dict(reply.content.config_records.get("info", ConfigRecord()))
            pid, parts = info.get("partition-id"), info.get("num-partitions")
            if isinstance(pid, int) and not isinstance(pid, bool) and pid >= 0:
                reported[nid] = (pid, parts if isinstance(parts, int) else None)
            else:
                failed[nid] = str(reply.error.reason) if reply.has_error() else "no partition-id in its node config"
        node_of = self._number_nodes(ids, reported, failed)
        self.attach(node_of)
        log(INFO, "%d nodes mapped to clients 0..%d", len(node_of), len(node_of) - 1)

    def _number_nodes(self, ids: list[int], reported: dict[int, tuple[int, int | None]], failed: dict[int, str]) -> dict[int, int]:
        """client id -> node id from the whoami replies (partition ids if every node gave a distinct one)."""
        pids = [p for p, _ in reported.values()]
        usable = len(reported) == len(ids) and len(set(pids)) == len(pids)
        if self.require_partition_ids:
            if failed or len(reported) != len(ids):
                nid, why = next(iter(failed.items())) if failed else (next(i for i in ids if i not in reported), "no reply")
                raise FederationError(f"node {nid} did not report its partition-id ({why}); this strategy needs every "
                                      "node's partition-id (node config \"partition-id=<i> num-partitions=<N>\")")
            if not usable:
                dup = [p for p, c in Counter(pids).items() if c > 1]
                raise FederationError(f"two nodes claim partition-id {dup[0]}")
            for nid, (_pid, parts) in reported.items():
                if parts is not None and parts != len(ids):
                    raise FederationError(f"node {nid} has num-partitions={parts} but {len(ids)} nodes are connected")
        if usable:
            return {pid: nid for nid, (pid, _) in reported.items()}
        log(WARNING, "not every node reported a distinct partition-id: clients numbered by node id order")
        return dict(enumerate(ids))

    # ------------------------------------------------------------------ one round, engine-independent
    def sample_size(self) -> int:
        """Clients per round: max(int(N * fraction_train), min_train_nodes), at most N (Flower's FedAvg rule)."""
        return min(self.num_clients, max(int(self.num_clients * self.fraction_train), self.min_train_nodes))

    def participants(self, server_round: int) -> list[int]:
        """S_t for this round (seeded from ``seed``; identical in every driver)."""
        return select_clients(server_round, self.num_clients, self.sample_size(), self.seed,
                              first_round_all=self.first_round_all)

    def rng(self, *path: int) -> np.random.Generator:
        """A server-side generator determined by (seed, *path)."""
        return rng_for(self.seed, *path)

    def begin_round(self, server_round: int) -> None:
        """Reset the round's accumulators (bytes, rejections, wall clock)."""
        self._acc = {"t0": time.perf_counter(), "down": 0, "up": 0, "rejected": 0, "sent": 0, "round": server_round,
                     "errors": Counter()}

    def pre_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        """(node id, message type, content) of an exchange that must precede the train messages of the round.

        Most algorithms have none (one exchange per round). FedREP sends its propose phase here (ConSpar's
        coordinate proposals and the secure-aggregation keys), so a round stays two exchanges in every driver.
        """
        return []

    def consume_pre_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> None:
        """Digest the replies of :meth:`pre_train_contents` (a subclass that sends any must override this)."""
        raise NotImplementedError(f"{type(self).__name__} sent pre-train messages but does not consume them")

    def to_all(self, message_type: str, content: RecordDict) -> list[tuple[int, str, RecordDict]]:
        """The same content to every client, e.g. a registration exchange (downlink counted per message)."""
        out = []
        for cid in range(self.num_clients):
            self.count_down(content)
            out.append((self.node_of[cid], message_type, content))
        return out

    def count_up(self, content: RecordDict) -> None:
        """Add a reply's serialized size to the round's uplink bytes."""
        self._acc["up"] += recorddict_nbytes(content)

    def count_down(self, content: RecordDict) -> None:
        """Add a message's serialized size to the round's downlink bytes."""
        self._acc["down"] += recorddict_nbytes(content)

    def message_config(self, server_round: int, config: Mapping[str, Scalar]) -> dict[str, Any]:
        """The config of one train message: the user's train_config, then ours (ours may not be overridden)."""
        return {**self.user_config, **self.common_config(), **config, ROUND_KEY: server_round}

    def train_contents(self, server_round: int) -> list[tuple[int, RecordDict]]:
        """(node id, content) of every train message of the round; counts downlink bytes."""
        if self._acc.get("round") != server_round:
            self.begin_round(server_round)
        out = []
        for cid in self.participants(server_round):
            arrays, config = self.client_payload(server_round, cid)
            content = train_content(arrays, self.message_config(server_round, config),
                                    arrays_key=self.arrayrecord_key, config_key=self.configrecord_key)
            self._acc["down"] += recorddict_nbytes(content)
            out.append((self.node_of[cid], content))
        self._acc["sent"] = len(out)
        return out

    def reject(self, server_round: int, node_id: int, why: str) -> None:
        """Count and log a rejected reply (its reason goes into the round's error tally)."""
        self._acc["rejected"] += 1
        self._acc.setdefault("errors", Counter())[why] += 1
        self.rejected_total += 1
        log(WARNING, "round %d: rejected reply from node %s: %s", server_round, node_id, why)

    def validate_reply(self, content: RecordDict) -> tuple[list[NDArray[Any]], dict[str, Any]]:
        """The generic checks every reply passes before the algorithm decodes it (DESIGN.md, trust boundaries)."""
        if self.arrayrecord_key not in content.array_records or "metrics" not in content.metric_records:
            raise MalformedPayload(f"reply must carry an ArrayRecord {self.arrayrecord_key!r} and a MetricRecord "
                                   "'metrics'")
        arrays = content.array_records[self.arrayrecord_key].to_numpy_ndarrays()
        m = dict(content.metric_records["metrics"])
        bad = sorted(k for k, v in m.items() if not _metric_ok(v))
        if bad:
            raise MalformedPayload(f"metric(s) {bad} are not finite numbers")
        return arrays, m

    def consume_replies(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> MetricRecord:
        """Validate, decode and aggregate the replies; a bad reply is logged and skipped.

        Raises
        ------
        RoundFailed
            When replies were expected and none was accepted (quoting the clients' errors).
        """
        updates: dict[int, Any] = {}
        metrics: dict[int, dict[str, Any]] = {}
        for node_id, content in replies:
            if isinstance(content, str):
                self.reject(server_round, node_id, f"client error: {concise_error(content)}")
                continue
            cid = self.pid_of.get(node_id)
            if cid is None:
                self.reject(server_round, node_id, "unknown node")
                continue
            if cid in updates:
                self.reject(server_round, node_id, "duplicate reply")
                continue
            self._acc["up"] += recorddict_nbytes(content)
            try:
                arrays, m = self.validate_reply(content)
                updates[cid] = self.decode_update(server_round, cid, arrays, m)
                metrics[cid] = m
            except (MalformedPayload, LayoutMismatch, ValueError, KeyError, TypeError) as err:
                self.reject(server_round, node_id, str(err))
        missing = self._acc["sent"] - len(replies)
        if missing > 0:
            log(WARNING, "round %d: %d sampled client(s) did not reply", server_round, missing)
        if not updates and self._acc["sent"] > 0:
            raise RoundFailed(server_round, self._acc["errors"], self._acc["sent"])
        diag = self.aggregate(server_round, updates, metrics) if updates else {}
        for cid, m in metrics.items():
            self.record_privacy(cid, m)
        self._acc["diag"] = {**diag, "clients": float(len(updates)), "rejected": float(self._acc["rejected"])}
        return MetricRecord({k: float(v) for k, v in self._acc["diag"].items() if isinstance(v, int | float)})

    # ------------------------------------------------------------------ Flower Message API
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """Run ``num_rounds`` rounds (Flower's ``Strategy.start``); ``Result.arrays`` is in the user's layout.

        ``evaluate_fn(server_round, arrays) -> MetricRecord | None`` is the user's central evaluation (Flower's
        signature); its "accuracy" / "loss" (or "test_accuracy" / "test_loss") go into the round history.
        """
        if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1:
            raise ValueError(f"num_rounds must be an integer >= 1, got {num_rounds!r}")
        self.initialize(initial_arrays)
        self.prepare(num_rounds, train_config=train_config, evaluate_fn=evaluate_fn)
        if not self.seed_was_given:
            log(INFO, "%s: seed=%d (drawn from the OS; pass seed=... to repeat this run)", type(self).__name__, self.seed)
        return super().start(grid=grid, initial_arrays=self.current_arrays(), num_rounds=num_rounds, timeout=timeout,
                             train_config=train_config, evaluate_config=evaluate_config, evaluate_fn=self._evaluate_hook)

    def prepare(self, num_rounds: int, *, train_config: ConfigRecord | Mapping[str, Any] | None = None,
                evaluate_fn: EvaluateFn | None = None) -> None:
        """Set the run's length, the user's extra train config and central evaluation (both drivers call this)."""
        self.num_rounds = num_rounds
        self.evaluate_fn = evaluate_fn
        self.user_config = dict(train_config or {})
        ours = set(self.common_config()) | {ROUND_KEY}
        clash = sorted(ours & set(self.user_config))
        if clash:
            raise ValueError(f"train_config keys {clash} are set by {type(self).__name__} itself")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Send each sampled client its own payload (after a pre-train exchange if the algorithm has one)."""
        if not self.node_of:
            self.connect(grid)
        self.begin_round(server_round)
        pre = self.pre_train_contents(server_round)
        if pre:
            msgs = [Message(content, dst_node_id=node, message_type=mtype) for node, mtype, content in pre]
            got = grid.send_and_receive(msgs, timeout=self.node_wait_s)
            self.consume_pre_train(server_round, [
                (r.metadata.src_node_id, str(r.error.reason) if r.has_error() else r.content) for r in got
            ])
        return [
            Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
            for node, content in self.train_contents(server_round)
        ]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and aggregate; returns the global model in the user's layout and the round's diagnostics."""
        items: list[tuple[int, RecordDict | str]] = [
            (r.metadata.src_node_id, str(r.error.reason) if r.has_error() else r.content) for r in replies
        ]
        diag = self.consume_replies(server_round, items)
        return self.current_arrays(), diag

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """No federated evaluation: the server evaluates the global model centrally (``evaluate_fn``)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing to aggregate (see configure_evaluate)."""
        return None

    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "%s: %s", type(self).__name__, ", ".join(f"{k}={v}" for k, v in self.describe().items()))

    def describe(self) -> dict[str, Any]:
        """The settings :meth:`summary` logs (a subclass adds its hyperparameters)."""
        out: dict[str, Any] = {"fraction_train": self.fraction_train, "min_available_nodes": self.min_available_nodes,
                               "seed": self.seed}
        if self.layout is not None:
            out["model"] = self.layout.describe()
        return out
