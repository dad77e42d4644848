"""Round engine shared by our Message-API strategies.

A subclass supplies the algorithm's server side (initial model, per-client payload, decoding and
aggregation); this base does what every algorithm needs the same way: learning which node holds which partition
(`query.whoami`), seeded client sampling, message construction, rejection of malformed replies (logged with the
node id; the round goes on with the rest, and a round with none accepted stops the run: RoundFailed), byte
counting from the serialized records, central evaluation, privacy bookkeeping and the per-round history that
becomes results.json.

The in-process driver (simulations/inprocess.py) calls `train_contents` / `consume_replies` / `evaluate_round`
directly with the same RecordDicts, so both drivers run the same code.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from numpy.typing import NDArray

from fedapp.compression.codec import MalformedPayload, SparseVector, decode_vector, encode_dense, encode_sparse
from fedapp.compression.payload import FORMAT_KEY, from_arrays, to_arrays
from fedapp.compression.sparsify import resolve_k, top_k
from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.results import RoundRecord
from fedapp.sampling import STREAM_INIT, rng_for, select_clients
from fedapp.task import Evaluator, build_model
from fedapp.wire import recorddict_nbytes, train_content

Scalar = int | float | str | bool
WHOAMI = "query.whoami"


# One home for the error machinery: the public layer's (this module is the older, run-config based engine of the
# families not yet moved onto strategies.base).
from strategies.base import (  # noqa: E402
    FederationError,
    RoundFailed,
    client_error_text,
    quote_errors,
)

__all__ = ["FederationError", "RoundFailed", "client_error_text", "quote_errors"]


class RoundBookkeeping:
    """Per-round records shared by every strategy our server app runs (ours and Flower's built-ins).

    Keeps `history` (one RoundRecord per round: central evaluation, bytes, privacy, diagnostics),
    the latest cumulative privacy metrics of each client, and the count of rejected replies. Needs `cfg`,
    `evaluator` and `global_model()` from the class it is mixed into.
    """

    #: privacy metric keys a client may report, reduced as max over clients of the latest cumulative value
    PRIVACY_KEYS = ("eps_eq36", "eps_rdp", "eps_basic", "delta_basic", "eps_advanced", "delta_advanced")

    cfg: RunConfig
    evaluator: Evaluator | None
    #: name of the headline epsilon in the per-round progress line
    privacy_label = "eps(36)"

    def init_bookkeeping(self) -> None:
        """Empty history, privacy table and per-round accumulators."""
        self.history: list[RoundRecord] = []
        self.privacy: dict[int, dict[str, float]] = {}
        self.rejected_total = 0
        self._acc: dict[str, Any] = {}
        self._unanswered_rounds = 0  # consecutive rounds without an accepted reply
        self._unanswered_errors: Counter[str] = Counter()

    #: consecutive rounds without an accepted reply tolerated before the run stops (DP-RECAL retries the holder once)
    retries_without_reply = 0

    def global_model(self) -> FloatArray:
        """The model evaluated centrally."""
        raise NotImplementedError

    @property
    def current_round(self) -> int | None:
        """The round in progress (or last begun); None before round 1."""
        rnd = self._acc.get("round")
        return int(rnd) if rnd is not None else None

    def round_errors(self) -> Counter[str]:
        """This round's rejection reasons so far (distinct text -> count)."""
        errors: Counter[str] = self._acc.setdefault("errors", Counter())
        return errors

    def round_failed(self, server_round: int, cause: str) -> RoundFailed:
        """The error that stops the run in this round, quoting the round's rejection reasons."""
        return RoundFailed(server_round, cause, self.round_errors())

    def no_reply_cause(self, server_round: int, expected: int, failed: int, attempts: int) -> str:
        """How ``attempts`` consecutive rounds without an accepted reply are described (DP-RECAL names the holder)."""
        again = f" in {attempts} rounds in a row" if attempts > 1 else ""
        return f"no reply accepted ({failed} of {expected} rejected){again}"

    def check_round_accepted(self, server_round: int, accepted: int, sent: int, missing: int = 0) -> None:
        """The one stop rule of every strategy: a round in which no reply was accepted stops the run.

        Going on would repeat the round with the same model and the same clients, which fail the same way, and the
        run would end "completed" with an untrained model. ``sent`` counts the round's train messages and
        ``missing`` those that got no reply; rejections of an earlier phase (FedREP's proposals) are in
        :meth:`round_errors`. A round that sent nothing and rejected nothing (DP-RECAL after its budget stop) is not
        a failure. ``retries_without_reply`` consecutive failed rounds are tolerated; the error then quotes the
        rejection reasons of all of them.
        """
        if accepted:
            self._unanswered_rounds = 0
            self._unanswered_errors.clear()
            return
        errors = self.round_errors()
        if missing > 0:
            errors["no reply (timed out or lost)"] += missing
        if not sent and not errors:
            return
        self._unanswered_rounds += 1
        self._unanswered_errors.update(errors)
        failed = sum(errors.values())
        cause = self.no_reply_cause(server_round, max(sent, failed), failed, self._unanswered_rounds)
        if self._unanswered_rounds <= self.retries_without_reply:
            log(WARNING, "round %d: %s; retrying (%d of %d)", server_round, cause, self._unanswered_rounds,
                self.retries_without_reply)
            return
        raise RoundFailed(server_round, cause, self._unanswered_errors)

    def record_privacy(self, client: int, metrics: Mapping[str, Any]) -> None:
        """Keep a client's latest cumulative privacy figures (clients not sampled keep theirs)."""
        priv = {k: float(v) for k in self.PRIVACY_KEYS if isinstance(v := metrics.get(k), int | float)}
        if priv:
            self.privacy[client] = priv

    def privacy_summary(self) -> dict[str, float]:
        """Worst client (max) of each accountant's cumulative epsilon so far."""
        out: dict[str, float] = {}
        for key in self.PRIVACY_KEYS:
            vals = [p[key] for p in self.privacy.values() if key in p]
            if vals:
                out[key] = max(vals)
        return out

    def headline_privacy(self, priv: Mapping[str, float]) -> tuple[float | None, float | None]:
        """(epsilon, delta) of results.json's round record: the worst client's eq. (36) figure (seed 000)."""
        if "eps_eq36" in priv:
            return priv["eps_eq36"], self.cfg.delta
        return None, None

    def evaluate_round(self, server_round: int) -> RoundRecord:
        """Central evaluation + the round's record (appended to `history`) + one progress line."""
        c = self.cfg
        rec = RoundRecord(round=server_round)
        if self.evaluator is not None and (server_round % c.eval_every == 0 or server_round == c.num_server_rounds):
            ev = self.evaluator(self.global_model())
            rec.test_accuracy, rec.test_loss = ev.accuracy, ev.loss
            rec.extra["nnz"] = ev.nnz
        priv = self.privacy_summary()
        if c.dp:
            rec.epsilon, rec.delta = self.headline_privacy(priv)
        rec.uplink_bytes, rec.downlink_bytes = int(self._acc.get("up", 0)), int(self._acc.get("down", 0))
        rec.wall_s = time.perf_counter() - float(self._acc.get("t0", time.perf_counter()))
        rec.extra.update(self._acc.get("diag", {}))
        rec.extra.update({f"privacy_{k}": v for k, v in priv.items()})
        self.history.append(rec)
        acc = "n/a" if rec.test_accuracy is None else f"{rec.test_accuracy:.4f}"
        eps = "" if rec.epsilon is None else f" {self.privacy_label}={rec.epsilon:.3g}"
        log(
            INFO,
            "[round %d/%d] test_acc=%s%s clients=%d rejected=%d up=%.1fkB down=%.1fkB %.2fs",
            server_round, c.num_server_rounds, acc, eps, int(rec.extra.get("clients", 0)),
            int(rec.extra.get("rejected", 0)), rec.uplink_bytes / 1e3, rec.downlink_bytes / 1e3, rec.wall_s,
        )
        return rec

    def evaluate_fn(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """`Strategy.start(evaluate_fn=...)` hook: records every round after round 0."""
        if server_round == 0:
            return None
        rec = self.evaluate_round(server_round)
        out = {"test_accuracy": rec.test_accuracy, "test_loss": rec.test_loss}
        return MetricRecord({k: float(v) for k, v in out.items() if v is not None})


def round_diagnostics(counts: NDArray[np.int64], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
    """Coverage of the aggregated coordinates, mean Q and training loss, and mean sigma / eps_round under DP."""
    diag = {
        "coverage": float(np.mean(counts > 0)),
        "mean_Q": float(np.mean([m.get("Q", np.nan) for m in metrics.values()])),
        "mean_train_loss": float(np.mean([m.get("train_loss", np.nan) for m in metrics.values()])),
    }
    sig = [m["sigma"] for m in metrics.values() if "sigma" in m]
    if sig:
        diag["mean_sigma"] = float(np.mean(sig))
        diag["mean_eps_round"] = float(np.mean([m["eps_round"] for m in metrics.values()]))
    return diag


class FederatedStrategy(RoundBookkeeping, Strategy):
    """Base of our server-side algorithms (Flower Message API).

    Parameters
    ----------
    cfg
        The validated run config (num-clients N, clients-per-round K, seed, ...).
    evaluator
        Central test-set evaluation; None skips it.
    """

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None) -> None:
        self.cfg = cfg
        self.evaluator = evaluator
        self.node_of: dict[int, int] = {}  # partition id -> node id
        self.pid_of: dict[int, int] = {}  # node id -> partition id
        self.init_bookkeeping()
        self.x: FloatArray = self.initial_model()

    # ------------------------------------------------------------------ algorithm hooks
    @abstractmethod
    def initial_model(self) -> FloatArray:
        """x_0^0."""

    @abstractmethod
    def client_payload(self, server_round: int, partition_id: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        """Arrays and config sent to one sampled client this round."""

    @abstractmethod
    def decode_update(self, server_round: int, partition_id: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        """Validate and decode one reply; raise MalformedPayload (a ValueError) to reject it."""

    @abstractmethod
    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Update the server state from the accepted updates; return diagnostics for the round record."""

    def global_model(self) -> FloatArray:
        """The model evaluated centrally (the dense server model)."""
        return self.x

    # ------------------------------------------------------------------ federation membership
    def attach(self, node_of: dict[int, int]) -> None:
        """Set the partition-id -> node-id map (the in-process driver uses node id = partition id)."""
        n = self.cfg.num_clients
        if sorted(node_of) != list(range(n)):
            raise FederationError(f"partition ids {sorted(node_of)} are not exactly 0..{n - 1} (num-clients={n})")
        self.node_of = dict(node_of)
        self.pid_of = {v: k for k, v in node_of.items()}

    def connect(self, grid: Grid) -> None:
        """Wait for num-clients nodes, then ask each its partition id (node ids are opaque to the server)."""
        n = self.cfg.num_clients
        simulated = type(grid).__name__ == "InMemoryGrid"
        deadline = time.time() + (5.0 if simulated else self.cfg.node_wait_s)
        while len(ids := list(grid.get_node_ids())) < n:
            if time.time() > deadline:
                hint = (
                    f"pass --federation-config \"num-supernodes={n}\" to flwr run"
                    if simulated
                    else f"start {n} SuperNodes with --node-config \"partition-id=<i> num-partitions={n}\""
                )
                raise FederationError(f"run config num-clients={n} but only {len(ids)} nodes are connected: {hint}")
            time.sleep(1.0)
        msgs = [Message(RecordDict({"config": ConfigRecord()}), dst_node_id=nid, message_type=WHOAMI) for nid in ids]
        node_of: dict[int, int] = {}
        for reply in grid.send_and_receive(msgs, timeout=self.cfg.node_wait_s):
            nid = reply.metadata.src_node_id
            if reply.has_error():
                raise FederationError(f"node {nid} failed to report its partition: {reply.error.reason}")
            info: dict[str, Any] = dict(reply.content.config_records["info"])
            pid, parts = int(info["partition-id"]), int(info["num-partitions"])
            if parts != n:
                raise FederationError(f"node {nid} has num-partitions={parts} but the run config has num-clients={n}")
            if pid in node_of:
                raise FederationError(f"nodes {node_of[pid]} and {nid} both claim partition-id={pid}")
            node_of[pid] = nid
        self.attach(node_of)
        log(INFO, "%d nodes mapped to partitions 0..%d", len(node_of), n - 1)

    # ------------------------------------------------------------------ one round, engine-independent
    def participants(self, server_round: int) -> list[int]:
        """S_t for this round (seeded; identical in every driver)."""
        c = self.cfg
        return select_clients(server_round, c.num_clients, c.clients_per_round, c.seed, first_round_all=c.first_round_all)

    def begin_round(self, server_round: int) -> None:
        """Reset the round's accumulators (bytes, rejections, wall clock)."""
        self._acc = {"t0": time.perf_counter(), "down": 0, "up": 0, "rejected": 0, "sent": 0, "round": server_round}

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
        """The same content to every partition, e.g. a registration exchange (downlink counted per message)."""
        out = []
        for pid in range(self.cfg.num_clients):
            self.count_down(content)
            out.append((self.node_of[pid], message_type, content))
        return out

    def count_up(self, content: RecordDict) -> None:
        """Add a reply's serialized size to the round's uplink bytes."""
        self._acc["up"] += recorddict_nbytes(content)

    def count_down(self, content: RecordDict) -> None:
        """Add a message's serialized size to the round's downlink bytes."""
        self._acc["down"] += recorddict_nbytes(content)

    def train_contents(self, server_round: int) -> list[tuple[int, RecordDict]]:
        """(node id, content) of every train message of the round; counts downlink bytes."""
        if self._acc.get("round") != server_round:
            self.begin_round(server_round)
        out = []
        for pid in self.participants(server_round):
            arrays, config = self.client_payload(server_round, pid)
            content = train_content(arrays, {**config, "server-round": server_round})
            self._acc["down"] += recorddict_nbytes(content)
            out.append((self.node_of[pid], content))
        self._acc["sent"] = len(out)
        return out

    def _reject(self, server_round: int, node_id: int, why: str) -> None:
        self._acc["rejected"] += 1
        self.rejected_total += 1
        self.round_errors()[why] += 1
        log(WARNING, "round %d: rejected reply from node %s: %s", server_round, node_id, why)

    def consume_replies(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> MetricRecord:
        """Validate, decode and aggregate the replies; a bad reply is logged and skipped, but a round in which none
        is accepted stops the run (:meth:`check_round_accepted` raises :class:`RoundFailed`)."""
        updates: dict[int, Any] = {}
        metrics: dict[int, dict[str, Any]] = {}
        for node_id, content in replies:
            if isinstance(content, str):
                self._reject(server_round, node_id, client_error_text(content))
                continue
            pid = self.pid_of.get(node_id)
            if pid is None:
                self._reject(server_round, node_id, "unknown node")
                continue
            if pid in updates:
                self._reject(server_round, node_id, "duplicate reply")
                continue
            self._acc["up"] += recorddict_nbytes(content)
            try:
                if "arrays" not in content.array_records or "metrics" not in content.metric_records:
                    raise MalformedPayload("reply must carry an ArrayRecord 'arrays' and a MetricRecord 'metrics'")
                arrays = content.array_records["arrays"].to_numpy_ndarrays()
                m = dict(content.metric_records["metrics"])
                bad = [k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)]
                if bad:
                    raise MalformedPayload(f"non-finite metric(s) {bad}")
                updates[pid] = self.decode_update(server_round, pid, arrays, m)
                metrics[pid] = m
            except (MalformedPayload, ValueError, KeyError, TypeError) as err:
                self._reject(server_round, node_id, str(err))
        missing = self._acc["sent"] - len(replies)
        if missing > 0:
            log(WARNING, "round %d: %d sampled client(s) did not reply", server_round, missing)
        self.check_round_accepted(server_round, len(updates), self._acc["sent"], max(missing, 0))
        diag = self.aggregate(server_round, updates, metrics) if updates else {}
        for pid, m in metrics.items():
            self.record_privacy(pid, m)
        self._acc["diag"] = {**diag, "clients": float(len(updates)), "rejected": float(self._acc["rejected"])}
        return MetricRecord({k: float(v) for k, v in self._acc["diag"].items()})

    # ------------------------------------------------------------------ Flower Message API
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Send each sampled client its own payload (one exchange per round)."""
        if not self.node_of:
            self.connect(grid)
        self.begin_round(server_round)
        pre = self.pre_train_contents(server_round)
        if pre:
            msgs = [Message(content, dst_node_id=node, message_type=mtype) for node, mtype, content in pre]
            got = grid.send_and_receive(msgs, timeout=self.cfg.node_wait_s)
            self.consume_pre_train(server_round, [
                (r.metadata.src_node_id, str(r.error.reason) if r.has_error() else r.content) for r in got
            ])
        return [
            Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
            for node, content in self.train_contents(server_round)
        ]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and aggregate; the returned ArrayRecord is the float32 global model."""
        items: list[tuple[int, RecordDict | str]] = [
            (r.metadata.src_node_id, str(r.error.reason) if r.has_error() else r.content) for r in replies
        ]
        self.consume_replies(server_round, items)
        # Diagnostics go to our per-round line and results.json; returning None keeps Flower's end-of-run
        # dump short (it would repeat every round's MetricRecord).
        return ArrayRecord([self.global_model().astype(np.float32)]), None

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """No federated evaluation: the server evaluates the global model centrally (spec 6.5)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing to aggregate (see configure_evaluate)."""
        return None

    def summary(self) -> None:
        """Log the strategy's configuration."""
        c = self.cfg
        log(INFO, "%s: N=%d K=%d rounds=%d dataset=%s dp=%s", type(self).__name__, c.num_clients,
            c.clients_per_round, c.num_server_rounds, c.dataset, c.dp)


class BroadcastStrategy(FederatedStrategy):
    """A server that broadcasts its model x (dense, or top_k' for sparse variants) and decodes uploads of k entries.

    The plumbing DP-FedPDM / BSDP-FedPDM and the baselines share: x_0^0, the downlink encoded once per round,
    the k check on uploads. Subclasses implement `aggregate` (and may add config or a second downlink vector).

    Parameters
    ----------
    cfg
        Run config: num-clients N, clients-per-round K, first-round-all, seed, init-std, and for the sparse
        variants alpha-up / alpha-down.
    evaluator
        Central test-set evaluation; None skips it (default None).
    """

    #: False: dense downlink and uploads; True: top_k' downlink and k = alpha_U d uploaded entries (the "-sparse" keys)
    sparse = False

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None) -> None:
        self.dim = build_model(cfg).dim
        self._downlink: tuple[int, list[NDArray[Any]], int] | None = None
        super().__init__(cfg, evaluator)

    def initial_model(self) -> FloatArray:
        """x_0^0 ~ N(0, init_std^2) i.i.d., seeded (the same start as DP-FedPDM, spec A9)."""
        return rng_for(self.cfg.seed, STREAM_INIT).normal(0.0, self.cfg.init_std, size=self.dim)

    @property
    def upload_k(self) -> int:
        """Number of entries each client uploads: alpha_U d for the sparse variants, else d."""
        return resolve_k(self.cfg.alpha_up, self.dim) if self.sparse else self.dim

    def downlink_indices(self) -> NDArray[np.int64]:
        """All d indices, or the indices of top_k'(x) (k' = alpha_D d) for the sparse variants."""
        d = self.dim
        k = resolve_k(self.cfg.alpha_down, d) if self.sparse else d
        return top_k(self.x, k) if k < d else np.arange(d, dtype=np.int64)

    def encode_downlink(self, idx: NDArray[np.int64]) -> tuple[list[NDArray[Any]], int]:
        """Codec arrays and format code of x at ``idx`` (sparse only when fewer than d entries)."""
        v = SparseVector(indices=idx, values=self.x[idx], dim=self.dim)
        return to_arrays(encode_sparse(v) if len(idx) < self.dim else encode_dense(v.to_dense()))

    def round_config(self) -> dict[str, Scalar]:
        """Algorithm-specific config sent with the model (none for FedAvg)."""
        return {}

    def client_payload(self, server_round: int, partition_id: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        if self._downlink is None or self._downlink[0] != server_round:  # encode once per round, send to all
            arrays, code = self.encode_downlink(self.downlink_indices())
            self._downlink = (server_round, arrays, code)
        _, arrays, code = self._downlink
        return arrays, {FORMAT_KEY: code, **self.round_config()}

    def decode_update(self, server_round: int, partition_id: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        k = self.upload_k
        v = decode_vector(from_arrays(arrays, metrics.get(FORMAT_KEY)), self.dim, max_k=k)
        if v.k != k:
            raise ValueError(f"expected k={k} uploaded values, got {v.k}")
        return v
