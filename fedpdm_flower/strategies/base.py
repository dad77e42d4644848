"""The round engine of our Message-API strategies: keyword-constructed, model-agnostic, Flower's vocabulary.

A subclass supplies the algorithm's server side (per-client payload, decoding, aggregation); this base does what
every algorithm needs the same way:

* **the model**: :meth:`FederatedStrategy.initialize` takes the user's ``ArrayRecord`` (any torch state dict or
  list of numpy arrays) and keeps one float64 vector x of its floating-point entries
  (:class:`fedpdm_flower.fedapp.layout.ArrayLayout`); :meth:`current_arrays` gives the user's layout back (names, shapes and
  dtypes as given). No model name or dimension is needed up front;
* **buffers**: the entries beside x -- integer entries such as BatchNorm's ``num_batches_tracked`` and, with
  ``BUFFERS = "beside"`` (every algorithm but FedREP), the normalisation layers' running statistics
  (:func:`fedpdm_flower.fedapp.layout.norm_buffer_names`) -- never enter the algorithm's vector (no prox, dual, control
  variate, sparsifier or noise moves them). Each train message carries them in a ``"buffers"`` record, the clients
  reply with theirs after training, and the server takes their mean weighted by ``num-examples``, as Flower's
  FedAvg does, casting integer entries back to integers (rounded to the nearest; :meth:`aggregate_buffers`);
* **the federation**: waiting for ``min_available_nodes``, learning which node is which client (a
  ``query.whoami`` that our client apps answer with the node's ``partition-id``; nodes that cannot answer get ids
  by the order of their node ids), seeded sampling of ``fraction_train`` of them per round, and giving a client
  whose node went offline to a new node reporting its partition-id (a restarted SuperNode, :meth:`readmit`);
* **the messages**: the config each client receives carries every algorithmic value it needs (the strategy is
  the single source of truth); the user's ``train_config`` is merged in;
* **untrusted replies**: each reply is validated before it touches state (arrays and metrics present, metric
  values typed and finite, then the algorithm's own decoding); a bad reply is logged with the node and client id
  (the SuperLink's own "Node Unavailable" reply for a dead node included, :meth:`reply_items`) and costs
  only that reply, and a round in which no reply is accepted stops the run with :class:`RoundFailed`, quoting
  the clients' errors;
* **bookkeeping**: bytes counted from the serialized records both ways, per-client privacy figures, central
  evaluation through Flower's ``evaluate_fn``, and a per-round history (:class:`fedpdm_flower.fedapp.results.RoundRecord`);
* **checkpoints**: :meth:`FederatedStrategy.state_dict` / :meth:`FederatedStrategy.load_state_dict` hold everything
  a round carries to the next (the model, the bookkeeping, and the attributes a subclass lists in
  ``CHECKPOINT_ATTRS``), so a run can stop after any round and resume bit for bit (:mod:`fedpdm_flower.fedapp.checkpoint`).

A round is the train exchange, optionally preceded by a pre-train exchange (:meth:`pre_train_contents` /
:meth:`consume_pre_train`: FedREP's proposals) and followed by a post-train exchange (:meth:`post_train_contents` /
:meth:`consume_post_train`: the unmask step of FedREP's secure buffers). Flower's path sends them through the Grid
from :meth:`configure_train` and :meth:`aggregate_train`; the in-process drivers (``simulations/inprocess.py``)
call the same methods with the same RecordDicts, so every driver runs the same code.
"""

from __future__ import annotations

import dataclasses
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
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from numpy.typing import NDArray

from fedpdm_flower.fedapp.compression.codec import MalformedPayload
from fedpdm_flower.fedapp.layout import ArrayLayout, FloatArray, LayoutMismatch, norm_buffer_names
from fedpdm_flower.fedapp.results import RoundRecord
from fedpdm_flower.fedapp.sampling import STREAM_EVALUATE, rng_for, select_clients
from fedpdm_flower.fedapp.wire import (
    BUFFERS_KEY,
    named_record,
    numpy_list,
    recorddict_nbytes,
    to_numpy,
    train_content,
)

Scalar = int | float | str | bool
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
#: Flower's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``: (reply contents, weighting key) -> aggregate
MetricsAggrFn = Callable[[list[RecordDict], str], MetricRecord]
WHOAMI = "query.whoami"
#: how a strategy learns the client id of each node (FederatedStrategy's ``identify_nodes``)
IDENTIFY_NODES = ("ask", "node-order")
#: from this many nodes on, connect() says before the query what it costs and how to skip it
ASK_HINT_NODES = 1_000
#: config keys every train message carries (a user's train_config may not use them)
LAYOUT_KEY, DIM_KEY, ROUND_KEY = "layout-crc", "dim", "server-round"
#: config key of the run's token: clients that persist their state file it under it (fedpdm_flower/fedapp/client_app.py)
RUN_TOKEN_KEY = "run-token"

__all__ = [
    "DIM_KEY",
    "LAYOUT_KEY",
    "ROUND_KEY",
    "RUN_TOKEN_KEY",
    "WHOAMI",
    "FederatedStrategy",
    "FederationError",
    "MetricsAggrFn",
    "RoundBookkeeping",
    "RoundFailed",
    "aggregate_metric_replies",
    "arrays_of",
    "client_error_text",
    "consistent_metric_replies",
    "metrics_problem",
    "quote_errors",
    "record_of",
    "wait_for_nodes",
]


class FederationError(RuntimeError):
    """The federation cannot go on: the connected nodes do not form the one the run config asks for, or a round
    got none of the replies it needs."""


#: distinct client errors quoted in a RoundFailed message (the rest are counted, not quoted)
QUOTED_ERRORS = 3
#: longest client error quoted verbatim
QUOTED_ERROR_CHARS = 300


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def quote_errors(errors: Mapping[str, int], limit: int = QUOTED_ERRORS) -> str:
    """``30x "q = ..."; 2x "..."``: the most frequent distinct errors, then how many others were left out.

    Errors that differ only in their numbers (each client's own step count or norm) count as one, quoted by its
    most frequent text, so that 100 clients failing the same way make one quote, not 100.
    """
    if not errors:
        return "no reply arrived"
    groups: dict[str, list[tuple[str, int]]] = {}
    for text, count in errors.items():
        groups.setdefault(_NUMBER.sub("#", text), []).append((text, count))
    ranked = sorted(groups.values(), key=lambda g: (-sum(c for _, c in g), min(t for t, _ in g)))
    parts = []
    for group in ranked[:limit]:
        text = max(group, key=lambda tc: (tc[1], tc[0]))[0]
        short = text if len(text) <= QUOTED_ERROR_CHARS else text[: QUOTED_ERROR_CHARS - 3] + "..."
        variants = f" ({len(group)} variants differing in numbers)" if len(group) > 1 else ""
        parts.append(f'{sum(c for _, c in group)}x "{short}"{variants}')
    rest = ranked[limit:]
    if rest:
        parts.append(f"and {len(rest)} other distinct error(s) ({sum(c for g in rest for _, c in g)}x)")
    return "; ".join(parts)


class RoundFailed(FederationError):
    """A round ended without the replies the algorithm needs, so the run stops; the rounds before it are kept.

    Parameters
    ----------
    server_round
        The round that failed.
    cause
        What went wrong, e.g. "no reply accepted (30 of 30 rejected)".
    errors
        Why the replies were rejected: distinct reason -> count (quoted, most frequent first).
    """

    def __init__(self, server_round: int, cause: str, errors: Mapping[str, int]) -> None:
        self.server_round = server_round
        self.cause = cause
        self.errors = dict(errors)
        super().__init__(f"round {server_round}: {cause}: {quote_errors(self.errors)}")


_FLOWER_REASON = re.compile(r"^<class '(?P<type>[^']+)'>:<'(?P<msg>.*)'>$", re.DOTALL)
_FLOWER_WRAPPER = "Exception ClientAppException occurred. Message: "


def client_error_text(reason: str) -> str:
    """A client's error reply as ``Type: message``, whichever engine carried it.

    Our ClientApp replies with that text already. A ClientApp exception that Flower caught itself arrives as
    ``<class 'ValueError'>:<'message'>`` (deployment), or, in the simulation, wrapped in Flower's
    ClientAppException and Ray's RayTaskError with the whole traceback in the text: the message is then the text
    after Flower's last "Message: " marker, and its type the traceback line that states it.
    """
    text = reason.strip()
    if _FLOWER_WRAPPER in text:
        msg = text.rsplit(_FLOWER_WRAPPER, 1)[1].strip()
        msg = msg[:-2].rstrip() if msg.endswith("'>") else msg
        first = msg.splitlines()[0] if msg else ""
        stated = re.search(r"^([A-Za-z_][\w.]*): " + re.escape(first), text, re.MULTILINE) if first else None
        return f"{stated.group(1).rsplit('.', 1)[-1]}: {msg}" if stated else msg
    m = _FLOWER_REASON.match(text)
    if m is None:
        return text
    return f"{m.group('type').rsplit('.', 1)[-1]}: {m.group('msg').strip()}"


def arrays_of(record: ArrayRecord) -> dict[str, NDArray[Any]]:
    """The named numpy arrays of an ArrayRecord, in its order."""
    return {k: to_numpy(v) for k, v in record.items()}


def record_of(arrays: Mapping[str, NDArray[Any]]) -> ArrayRecord:
    """An ArrayRecord holding ``arrays`` under their names, in order (0-d arrays stay 0-d)."""
    return named_record(arrays)


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


def metrics_problem(content: RecordDict, weight_key: str) -> str | None:
    """Why a reply's metrics cannot enter Flower's weighted aggregation (None: they can).

    Flower's ``FedAvg`` checks the same (``validate_message_reply_consistency``) and raises
    ``InconsistentMessageReplies`` for the whole round; here the one reply is dropped instead. A reply must carry
    exactly one MetricRecord, its weight ``weight_key`` a finite number > 0 (one reply claiming 0 or NaN would
    make the weighted mean undefined), and every value a finite number or a list of them.
    """
    if len(content.metric_records) != 1:
        return f"a reply needs exactly one MetricRecord, got {len(content.metric_records)}"
    m = next(iter(content.metric_records.values()))
    w = m.get(weight_key)
    if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
        return f"metric {weight_key!r} (the weight) must be a finite number > 0, got {w!r}"
    bad = sorted(k for k, v in m.items() if not _metric_ok(v))
    if bad:
        return f"non-finite or non-numeric metric(s) {bad}"
    return None


def _metric_signature(content: RecordDict) -> tuple[tuple[str, int], ...]:
    """The keys of a reply's MetricRecord with their list lengths (-1: a scalar): what must agree to aggregate."""
    m = next(iter(content.metric_records.values()))
    return tuple(sorted((k, len(v) if isinstance(v, list) else -1) for k, v in m.items()))


def consistent_metric_replies(items: Sequence[tuple[int, RecordDict]], weight_key: str
                              ) -> tuple[list[tuple[int, RecordDict]], list[tuple[int, str]]]:
    """Split replies into those Flower's aggregation can combine and (node, why) for the others.

    Each reply must pass :func:`metrics_problem`; then all must have the same metric keys (and list lengths). The
    round's keys are the most common key set among the well-formed replies (a tie goes to the smallest node id's),
    so one node that adds, drops or renames a metric is dropped alone -- Flower's ``FedAvg`` raises
    ``InconsistentMessageReplies`` and fails the run.
    """
    well: list[tuple[int, RecordDict]] = []
    bad: list[tuple[int, str]] = []
    for node, content in items:
        why = metrics_problem(content, weight_key)
        if why is None:
            well.append((node, content))
        else:
            bad.append((node, why))
    if not well:
        return [], bad
    sigs = {node: _metric_signature(content) for node, content in well}
    counts = Counter(sigs.values())
    top = max(counts.values())
    majority = next(sigs[node] for node, _ in sorted(well, key=lambda nc: nc[0]) if counts[sigs[node]] == top)
    keep = [(node, content) for node, content in well if sigs[node] == majority]
    for node, _ in well:
        if sigs[node] != majority:
            mine, theirs = {k for k, _ in sigs[node]}, {k for k, _ in majority}
            bad.append((node, f"metric keys differ from the round's: extra {sorted(mine - theirs)}, missing "
                              f"{sorted(theirs - mine)} (or list lengths differ)"))
    return keep, bad


def aggregate_metric_replies(contents: Sequence[RecordDict], weight_key: str,
                             aggr_fn: MetricsAggrFn | None = None) -> MetricRecord | None:
    """Flower's aggregation of the replies' MetricRecords (``aggr_fn``, default Flower's own
    ``aggregate_metricrecords``: the mean weighted by ``weight_key``, which it leaves out); None without replies.
    The replies must have passed :func:`consistent_metric_replies`."""
    if not contents:
        return None
    return (aggr_fn or aggregate_metricrecords)(list(contents), weight_key)


class PromptGrid(Grid):
    """A deployment's Grid whose ``send_and_receive`` collects replies soon after they reach the SuperLink.

    Flower's deployment Grid pushes the messages, then pulls the replies every 3 s: an exchange ends on average
    1.5 s after its last reply arrived, and a round of a deployment has two to four exchanges. This one pulls
    after 0.1 s, then at intervals growing by half up to 1 s (3 s, Flower's, with 1,000 or more replies pending:
    each pull names every pending message). The messages, the replies and the ``timeout`` are those of Flower's
    ``send_and_receive``; only the waits between pulls differ. Everything else is the Grid's own.

    ``strategy.start(grid=PromptGrid(grid), ...)`` in a ServerApp's ``main``; the reproduction app does it on
    deployments (a simulation's in-memory Grid already pulls every 0.1 s).
    """

    first_wait_s, max_wait_s, many = 0.1, 1.0, 1000

    def __init__(self, grid: Grid) -> None:
        self._grid = grid

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        pending = dict.fromkeys(self._grid.push_messages(messages))  # in push order
        end = time.time() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        wait = self.first_wait_s
        while timeout is None or time.time() < end:
            got = list(self._grid.pull_messages(list(pending)))
            replies.extend(got)
            for reply in got:
                pending.pop(reply.metadata.reply_to_message_id, None)
            if not pending:
                break
            cap = self.max_wait_s if len(pending) < self.many else 3.0
            time.sleep(min(wait, cap) if timeout is None else max(0.0, min(wait, cap, end - time.time())))
            wait *= 1.5
        return replies

    # the rest is the wrapped Grid's
    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self._grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def __getattr__(self, name: str) -> Any:  # anything a Grid subclass adds
        if name == "_grid":
            raise AttributeError(name)
        return getattr(self._grid, name)


def wait_for_nodes(grid: Grid, need: int, *, limit_s: float | None) -> list[int]:
    """The connected node ids once at least ``need`` are connected: Flower's wait (``sample_nodes``, the same log
    line every second), bounded by ``limit_s`` seconds when it is not None (:class:`FederationError` after it).

    A simulation's federation is fixed when it starts (its SuperNodes are registered before the ServerApp runs),
    so there waiting cannot help: it gives up after 5 s with a hint, where Flower would wait forever.
    """
    fixed = type(grid).__name__ == "InMemoryGrid" or bool(getattr(grid, "fixed_federation", False))
    limit = 5.0 if fixed else limit_s
    t0 = time.time()
    while len(ids := list(grid.get_node_ids())) < need:
        if limit is not None and time.time() - t0 > limit:
            hint = (f'pass --federation-config "num-supernodes={need}" to flwr run' if fixed else
                    f"start {need} SuperNodes (each with --node-config \"partition-id=<i> num-partitions=<N>\"), or "
                    "leave node_wait_s unset to wait as Flower does")
            raise FederationError(f"min_available_nodes = {need} but only {len(ids)} node(s) are connected: {hint}")
        log(INFO, "Waiting for nodes to connect: %d connected (minimum required: %d).", len(ids), need)
        time.sleep(1.0)
    return ids


def diagnostics_record(rec: RoundRecord) -> MetricRecord:
    """A round's record as a MetricRecord (its numbers only; booleans as 0 / 1): :attr:`RoundBookkeeping.diagnostics`."""
    flat = {k: v for k, v in rec.to_json().items() if k != "round"}
    out = MetricRecord()
    for key, value in flat.items():
        if isinstance(value, bool | np.bool_ | int | np.integer):  # booleans as 0 / 1
            out[key] = int(value)
        elif isinstance(value, float | np.floating):
            out[key] = float(value)
    return out


class RoundBookkeeping:
    """Per-round records of a strategy: central evaluation, bytes, privacy, diagnostics -> ``history``.

    Mixed into :class:`FederatedStrategy` and into our wrappers of Flower's own strategies; the class it is mixed
    into provides :meth:`current_arrays` and fills ``_acc`` during a round.
    """

    #: name of the headline epsilon in the per-round progress line
    privacy_label = "eps"
    #: client metric keys holding cumulative privacy figures; reduced as max over clients of the latest value
    PRIVACY_KEYS: tuple[str, ...] = ()
    #: (client metric key, accountant name) of the rigorous cumulative epsilon the clients report, which
    #: :meth:`privacy_spent` returns when no server-side accountant is set; None: the headline figure
    RIGOROUS_PRIVACY: tuple[str, str] | None = None
    #: client metric keys kept per client beside PRIVACY_KEYS but not summarised (what a second library needs to
    #: recompute a device's figure, e.g. DP-SGD's z, q and steps); results.json's summary["privacy_per_device"]
    PRIVACY_DETAIL_KEYS: tuple[str, ...] = ()

    def init_bookkeeping(self, *, eval_every: int = 1) -> None:
        """Empty history, privacy table and per-round accumulators."""
        if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
            raise ValueError(f"eval_every must be an integer >= 1, got {eval_every!r}")
        self.eval_every = eval_every
        self.num_rounds = 0
        self.evaluate_fn: EvaluateFn | None = None
        self.history: list[RoundRecord] = []
        #: round -> the strategy's own per-round figures (bytes, clients, rejections, privacy, the algorithm's
        #: diagnostics) as a MetricRecord: the ``history`` in Flower's Result shape, apart from the Result (which
        #: holds what Flower's FedAvg puts there) so that no key of ours can clash with a user's
        self.diagnostics: dict[int, MetricRecord] = {}
        #: round -> what the user's ``evaluate_fn`` returned, as returned (``Result.evaluate_metrics_serverapp``)
        self.evaluate_fn_results: dict[int, MetricRecord] = {}
        self.client_privacy: dict[int, dict[str, float]] = {}
        self.rejected_total = 0
        self._acc: dict[str, Any] = {}
        self._unanswered_rounds = 0  # consecutive rounds without an accepted reply
        self._unanswered_errors: Counter[str] = Counter()
        self.accountant_factory: Callable[[], Any] | None = None
        self.client_accountants: dict[int, Any] = {}  # client id -> its accountant (server's mirror of its ledger)
        self._last_event: dict[int, Any] = {}  # client id -> its last release, to forecast the next one
        self._releases: dict[int, list[tuple[float, int, int]]] = {}  # client id -> its composed events (checkpoints)
        #: called with the round number once the round's record is in ``history`` (the runner writes the checkpoint)
        self.after_round: Callable[[int], None] | None = None

    def set_accountant(self, accountant: Callable[[], Any] | None) -> None:
        """Account each client's releases on the server with Flower's privacy protocol.

        ``accountant`` makes one :class:`flwr.supercore.privacy_accounting.PrivacyAccountant` per client (each
        client's data is its own privacy unit), e.g. ``lambda: GdpAccountant(no_amplification(1e-5, N, max_epsilon=8))``
        from :mod:`fedpdm_flower.fedapp.privacy.protocol`, or Flower's ``RdpAccountant``. Each accepted reply's release (its noise
        multiplier ``sigma / sensitivity``) is composed into its client's accountant; before a round is sent, a
        sampled client whose next release -- forecast as its last one -- would pass ``config.max_epsilon`` stops
        the run with Flower's ``PrivacyBudgetExhausted``. The sampling model must be no-amplification: the server
        knows who takes part. The device's own floor (``max_epsilon`` of the client) still has the last word.
        """
        if accountant is None:
            self.accountant_factory = None
            return
        if not callable(accountant):
            raise TypeError(f"accountant must be a zero-argument callable making one accountant per client, got "
                            f"{type(accountant).__name__}")
        probe = accountant()
        for attr in ("compose", "would_exceed", "get_privacy_spent", "config"):
            if not hasattr(probe, attr):
                raise TypeError(f"accountant() made a {type(probe).__name__}, which has no {attr!r}: not a Flower "
                                "PrivacyAccountant")
        from flwr.supercore.privacy_accounting import SamplingMethod

        if probe.config.sampling_method is not SamplingMethod.NO_AMPLIFICATION or probe.num_releases:
            raise ValueError("the per-client accountant must be fresh and use sampling_method='no-amplification' "
                             "(the server knows which clients take part; sampling hides nothing from it)")
        self.accountant_factory = accountant

    def account_release(self, client: int, metrics: Mapping[str, Any], sampled: int) -> None:
        """Compose one accepted release of ``client`` into its accountant (its ``sigma`` / ``sensitivity``)."""
        if self.accountant_factory is None:
            return
        sigma, sens = metrics.get("sigma"), metrics.get("sensitivity")
        if not (isinstance(sigma, int | float) and isinstance(sens, int | float) and sigma > 0 and sens > 0):
            return
        from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

        acc = self.client_accountants.get(client)
        if acc is None:
            acc = self.client_accountants[client] = self.accountant_factory()
        pop = acc.config.population_size
        event = GaussianPrivacyEvent(noise_multiplier=float(sigma) / float(sens),
                                     sample_size=max(1, min(sampled, pop)), population_size=pop)
        acc.compose(event)
        self._last_event[client] = event
        self._releases.setdefault(client, []).append((event.noise_multiplier, event.sample_size, pop))

    def check_privacy_budget(self, server_round: int, clients: Iterable[int]) -> None:
        """Raise ``PrivacyBudgetExhausted`` before sending if a sampled client's next release would pass its budget."""
        for cid in clients:
            acc, event = self.client_accountants.get(cid), self._last_event.get(cid)
            if acc is None or event is None or acc.config.max_epsilon is None or not acc.would_exceed(event):
                continue
            from flwr.serverapp.exception import PrivacyBudgetExhausted

            spent = acc.get_privacy_spent()
            raise PrivacyBudgetExhausted(
                f"round {server_round}: client {cid}'s next release would exceed max_epsilon = "
                f"{acc.config.max_epsilon} (spent: epsilon = {spent.epsilon:.6g} at delta = {spent.delta:g} after "
                f"{spent.num_releases} releases, {spent.accounting_method})")

    def privacy_spent(self) -> Any:
        """Flower's privacy protocol: the cumulative :class:`~flwr.supercore.privacy_accounting.PrivacySpent` of the
        worst client so far, or None without DP.

        From the server's per-client accountants when set (:meth:`set_accountant`); otherwise the rigorous figure
        the clients report (``RIGOROUS_PRIVACY``), else the strategy's headline figure (``privacy_label``).
        """
        from flwr.supercore.privacy_accounting import PrivacySpent

        if self.client_accountants:
            spent = [a.get_privacy_spent() for a in self.client_accountants.values()]
            worst = max(spent, key=lambda s: s.epsilon)
            return PrivacySpent(epsilon=worst.epsilon, delta=worst.delta, num_releases=worst.num_releases,
                                accounting_method=f"{worst.accounting_method}, worst client",
                                optimal_order=worst.optimal_order)
        priv = self.privacy_summary()
        eps, delta = self.headline_privacy(priv)
        method = f"{self.privacy_label}, worst client"
        if self.RIGOROUS_PRIVACY is not None and self.RIGOROUS_PRIVACY[0] in priv and delta is not None:
            eps, method = priv[self.RIGOROUS_PRIVACY[0]], f"{self.RIGOROUS_PRIVACY[1]}, worst client"
        if eps is None or delta is None:
            return None
        releases = max((int(p.get("participations", 0)) for p in self.client_privacy.values()), default=0)
        return PrivacySpent(epsilon=float(eps), delta=float(delta), num_releases=releases or len(self.history),
                            accounting_method=method)

    #: consecutive rounds without an accepted reply tolerated before the run stops (DP-RECAL retries the holder once)
    retries_without_reply = 0

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

    def current_arrays(self) -> ArrayRecord:
        """The global model in the user's layout."""
        raise NotImplementedError

    def record_privacy(self, client: int, metrics: Mapping[str, Any]) -> None:
        """Keep a client's latest cumulative privacy figures (clients not sampled keep theirs)."""
        priv = {k: float(v) for k in (*self.PRIVACY_KEYS, *self.PRIVACY_DETAIL_KEYS, "participations")
                if isinstance(v := metrics.get(k), int | float) and not isinstance(v, bool)}
        before = self.client_privacy.get(client, {}).get("participations", 0.0)
        if before and priv.get("participations", math.inf) <= before:  # its ledger restarted: a node without the
            # old context.state (each accepted release adds one participation, so the count must grow)
            log(WARNING, "client %d reports %d participation(s) after %d: its privacy ledger restarted (a new node "
                "without the old context.state), so its cumulative epsilon omits its earlier releases; give the device "
                "a ledger file (node config privacy-ledger=<path>)", client, int(priv["participations"]), int(before))
        if priv:
            self.client_privacy[client] = priv
        self.account_release(client, metrics, int(self._acc.get("sent", 1)))

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
            res = self.call_evaluate_fn(server_round)
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

    def complete_round(self, server_round: int) -> RoundRecord:
        """:meth:`evaluate_round`, then ``after_round`` (the checkpoint): what every driver calls to end a round."""
        rec = self.evaluate_round(server_round)
        rec.extra.update({k: v for k, v in self._acc.get("evaluate", {}).items() if k not in rec.extra})
        self.diagnostics[server_round] = diagnostics_record(rec)
        if self.after_round is not None:
            self.after_round(server_round)
        return rec

    def call_evaluate_fn(self, server_round: int, arrays: ArrayRecord | None = None) -> MetricRecord | None:
        """The user's ``evaluate_fn`` on ``arrays`` (default: the global model); its MetricRecord is kept as returned
        for ``Result.evaluate_metrics_serverapp`` (:attr:`evaluate_fn_results`)."""
        if self.evaluate_fn is None:
            return None
        res = self.evaluate_fn(server_round, self.current_arrays() if arrays is None else arrays)
        if res is not None:
            self.evaluate_fn_results[server_round] = res
        return res

    # ------------------------------------------------------------------ checkpoints (fedpdm_flower/fedapp/checkpoint.py)
    def bookkeeping_state(self) -> dict[str, Any]:
        """The bookkeeping a resumed run needs: the history, the clients' privacy figures, the server-side
        accountants (as the events composed into them, replayed on load), the rejection and retry counters."""
        from fedpdm_flower.fedapp.checkpoint import Journal

        return {
            # one record a round, never changed after its round: written once each, not into every checkpoint
            "history": Journal(self.history, convert=dataclasses.asdict),
            "client_privacy": self.client_privacy,
            "rejected_total": self.rejected_total,
            "releases": self._releases,
            "unanswered_rounds": self._unanswered_rounds,
            "unanswered_errors": dict(self._unanswered_errors),
        }

    def load_bookkeeping_state(self, state: Mapping[str, Any]) -> None:
        """The inverse of :meth:`bookkeeping_state` (accountants rebuilt with the factory of :meth:`set_accountant`)."""
        self.history = [RoundRecord(**r) for r in state["history"]]
        self.diagnostics = {r.round: diagnostics_record(r) for r in self.history}
        self.client_privacy = {int(k): dict(v) for k, v in state["client_privacy"].items()}
        self.rejected_total = int(state["rejected_total"])
        self._unanswered_rounds = int(state["unanswered_rounds"])
        self._unanswered_errors = Counter(state["unanswered_errors"])
        self._releases, self.client_accountants, self._last_event = {}, {}, {}
        releases = {int(k): v for k, v in state["releases"].items()}
        if releases and self.accountant_factory is None:
            raise ValueError("the checkpoint holds server-side privacy accountants but this strategy has none set")
        if releases:
            from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

            for cid, events in releases.items():
                acc = self.client_accountants[cid] = self.accountant_factory()  # type: ignore[misc]
                for z, sample, pop in events:
                    event = GaussianPrivacyEvent(noise_multiplier=float(z), sample_size=int(sample),
                                                 population_size=int(pop))
                    acc.compose(event)
                    self._last_event[cid] = event
                self._releases[cid] = [(float(z), int(s), int(p)) for z, s, p in events]

    def _evaluate_hook(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """What ``Strategy.start`` calls as ``evaluate_fn`` after each round: the round is completed (the user's
        evaluate_fn runs inside, its figures go to the history) and the user's MetricRecord is returned as the user's
        ``evaluate_fn`` returned it, so that ``Result.evaluate_metrics_serverapp`` holds exactly that (Flower's)."""
        if server_round == 0:
            return self.call_evaluate_fn(0, arrays)
        self.complete_round(server_round)
        return self.evaluate_fn_results.get(server_round)



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
        Nodes that must be connected before a round is sent (default 2); like Flower's ``FedAvg`` the strategy
        waits for them (``node_wait_s`` bounds the wait). The federation is the set of nodes connected at round 1;
        nodes joining later are taken into it when the algorithm allows (:attr:`admits_new_nodes`), else logged
        and left out.
    first_round_all
        Sample every client in round 1 (FedPDM's S_0 = [N], Alg. 1 line 2; default False).
    seed
        Seed of the server's randomness (client sampling and any algorithm draws); None draws one from the OS and
        logs it, so a run can be repeated.
    require_partition_ids
        Every node must report a ``partition-id`` in its node config, and the ids must be exactly 0..N-1 (graph
        algorithms index agents by it; the reproduction app maps partitions to clients). Default False: a node
        without one is numbered by the order of the node ids.
    identify_nodes
        How the server learns which client each node is, before round 1. ``"ask"`` (default): one ``query.whoami``
        message to every connected node, answered with its ``partition-id``; client ids are the partition ids, so
        the seeded client choice equals the in-process driver's run for run, a restarted node takes back its
        client's place, and a device can refuse a privacy plan before round 1. ``"node-order"``: no message, as
        Flower's ``FedAvg`` sends none; client ids are the connected nodes in node-id order. It saves one message
        per node before round 1 (277 s of a 328 s run at 10,000 simulated nodes with 100 per round; little when
        round 1 reaches every node anyway; docs/performance.md, "Node identification"); the cost is the three
        guarantees above (devices still enforce their own privacy floors, on the device).
        Needs ``require_partition_ids=False``.
    node_wait_s
        Longest wait, in seconds, for ``min_available_nodes`` to connect (default None: as long as it takes, as
        Flower does; in a simulation, whose federation cannot grow, 5 s). Every message exchange is bounded by the
        ``timeout`` of :meth:`start` (Flower's), the pre- and post-train exchanges and the node queries included.
    eval_every
        Run ``evaluate_fn`` every this many rounds, and always in the last (default 1).
    max_update_norm, update_norm_factor
        The norm screen of the replies (:meth:`screen_update_norms`): a reply whose update norm exceeds
        ``max_update_norm`` (default None: no absolute bound) or ``update_norm_factor`` times the round's median
        (default 10, with at least 3 replies; None: off) is rejected before it touches the model.
    arrayrecord_key, configrecord_key
        Names of the records in the messages (Flower's defaults "arrays" and "config").
    fraction_evaluate, min_evaluate_nodes
        Client-side evaluation as in Flower's ``FedAvg``: each round ``max(int(N * fraction_evaluate),
        min_evaluate_nodes)`` of the connected clients get an ``evaluate`` message (the global model in the user's
        layout, ``evaluate_config`` + "server-round"); 0 turns it off. Defaults 1.0 and 2, Flower's.
    weighted_by_key
        The metric key weighting the clients' metrics (default "num-examples", Flower's).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn
        Flower's ``(list[RecordDict], weighted_by_key) -> MetricRecord`` aggregating the clients' train / evaluate
        metrics into ``Result.train_metrics_clientapp`` / ``evaluate_metrics_clientapp``; default Flower's
        ``aggregate_metricrecords`` (the weighted mean). Only the accepted replies are aggregated, and only those
        whose metrics have the round's keys (:func:`consistent_metric_replies`).

    Notes
    -----
    ``start`` returns Flower's ``Result`` filled as Flower's ``FedAvg`` fills it: ``arrays`` the global model in the
    user's layout, ``train_metrics_clientapp`` the aggregate of the clients' train metrics,
    ``evaluate_metrics_clientapp`` the aggregate of the evaluate replies, ``evaluate_metrics_serverapp`` the user's
    ``evaluate_fn`` records as returned. The strategy's own figures per round are in :attr:`diagnostics` (and the
    richer :attr:`history`), never in the Result (docs/flower-parity.md).
    """

    #: Whether nodes that connect after round 1 join the federation (sampled like the others from the round
    #: after they connect); False for algorithms whose server state or math is sized by the round-1 federation
    #: (graphs, all-agent consensus, buffers), which log such nodes and leave them out.
    admits_new_nodes: bool = False

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        min_train_nodes: int = 2,
        min_available_nodes: int = 2,
        first_round_all: bool = False,
        seed: int | None = None,
        require_partition_ids: bool = False,
        identify_nodes: str = "ask",
        node_wait_s: float | None = None,
        eval_every: int = 1,
        max_update_norm: float | None = None,
        update_norm_factor: float | None = 10.0,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        fraction_evaluate: float = 1.0,
        min_evaluate_nodes: int = 2,
        weighted_by_key: str = "num-examples",
        train_metrics_aggr_fn: MetricsAggrFn | None = None,
        evaluate_metrics_aggr_fn: MetricsAggrFn | None = None,
    ) -> None:
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must lie in (0, 1], got {fraction_train!r}")
        for name, v in (("min_train_nodes", min_train_nodes), ("min_available_nodes", min_available_nodes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if node_wait_s is not None and (isinstance(node_wait_s, bool) or not isinstance(node_wait_s, int | float)
                                        or not node_wait_s > 0):
            raise ValueError(f"node_wait_s must be a number > 0 or None, got {node_wait_s!r}")
        if isinstance(fraction_evaluate, bool) or not isinstance(fraction_evaluate, int | float) or not (
                0.0 <= fraction_evaluate <= 1.0):
            raise ValueError(f"fraction_evaluate must lie in [0, 1], got {fraction_evaluate!r}")
        if isinstance(min_evaluate_nodes, bool) or not isinstance(min_evaluate_nodes, int) or min_evaluate_nodes < 0:
            raise ValueError(f"min_evaluate_nodes must be an integer >= 0, got {min_evaluate_nodes!r}")
        if not isinstance(weighted_by_key, str) or not weighted_by_key:
            raise ValueError(f"weighted_by_key must be a non-empty string, got {weighted_by_key!r}")
        for fn_name, fn in (("train_metrics_aggr_fn", train_metrics_aggr_fn),
                            ("evaluate_metrics_aggr_fn", evaluate_metrics_aggr_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{fn_name} must be a callable (list[RecordDict], str) -> MetricRecord or None, got "
                                f"{type(fn).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be an integer >= 0 or None, got {seed!r}")
        if identify_nodes not in IDENTIFY_NODES:
            raise ValueError(f"identify_nodes must be one of {IDENTIFY_NODES}, got {identify_nodes!r}")
        if identify_nodes == "node-order" and require_partition_ids:
            raise ValueError(f"{type(self).__name__} numbers its clients by the nodes' partition ids "
                             "(require_partition_ids), which only identify_nodes='ask' learns: use identify_nodes='ask'")
        self.fraction_train = float(fraction_train)
        self.min_train_nodes = min_train_nodes
        self.min_available_nodes = min_available_nodes
        self.first_round_all = bool(first_round_all)
        self.seed = int(seed) if seed is not None else secrets.randbits(32)
        self.seed_was_given = seed is not None
        self.require_partition_ids = bool(require_partition_ids)
        self.identify_nodes = identify_nodes
        self.node_wait_s = None if node_wait_s is None else float(node_wait_s)
        self.fraction_evaluate = float(fraction_evaluate)
        self.min_evaluate_nodes = 0 if self.fraction_evaluate == 0.0 else min_evaluate_nodes
        if self.fraction_evaluate == 0.0:
            log(INFO, "%s: fraction_evaluate = 0: no client-side evaluation", type(self).__name__)
        self.weighted_by_key = weighted_by_key
        self.train_metrics_aggr_fn = train_metrics_aggr_fn
        self.evaluate_metrics_aggr_fn = evaluate_metrics_aggr_fn
        #: seconds every message exchange may take (``start``'s ``timeout``, Flower's default until start sets it)
        self.timeout = 3600.0
        self.evaluate_config: dict[str, Any] = {}
        for norm_name, norm_value in (("max_update_norm", max_update_norm), ("update_norm_factor", update_norm_factor)):
            if norm_value is not None and (isinstance(norm_value, bool) or not isinstance(norm_value, int | float)
                                           or not 0 < norm_value < math.inf):
                raise ValueError(f"{norm_name} must be a finite number > 0 or None, got {norm_value!r}")
        if update_norm_factor is not None and update_norm_factor < 1:
            raise ValueError(f"update_norm_factor must be >= 1 (a factor below the median rejects honest replies), "
                             f"got {update_norm_factor!r}")
        self.max_update_norm = None if max_update_norm is None else float(max_update_norm)
        self.update_norm_factor = None if update_norm_factor is None else float(update_norm_factor)
        self.arrayrecord_key = arrayrecord_key
        self.configrecord_key = configrecord_key
        self.node_of: dict[int, int] = {}  # client id -> node id
        self.pid_of: dict[int, int] = {}  # node id -> client id
        self.num_clients = 0
        self.layout: ArrayLayout | None = None
        self._carried: dict[str, NDArray[Any]] = {}
        self.x: FloatArray = np.zeros(0)
        self.user_config: dict[str, Any] = {}
        self._grid: Grid | None = None
        self._train_msgs: list[Message] = []  # the round's train messages (their ids name the node of a reply)
        self._eval_msgs: list[Message] = []  # the round's evaluate messages
        self._asked: set[int] = set()  # unknown nodes already asked who they are (readmit)
        self.init_bookkeeping(eval_every=eval_every)
        #: label of this run sent in every train message when set, kept by a resumed run (clients key their
        #: persisted state by it, so a new run never picks up an old run's state); None: not sent
        self.run_token: str | None = None
        self.resume_round = 0  # the last round of the checkpoint this run resumed from (0: a fresh run)
        self._pending_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ checkpoints (fedpdm_flower/fedapp/checkpoint.py)
    #: Names of the attributes that hold this algorithm's server state between rounds (numpy arrays, numbers,
    #: strings, None, and lists / tuples / sets / dicts of them). A strategy author lists here every attribute that
    #: :meth:`aggregate` (or a pre/post-train exchange) carries from one round to the next -- control variates, duals,
    #: the last broadcast -- and overrides :meth:`state_dict` / :meth:`load_state_dict` only for state that is
    #: not such data. Values recomputed each round from these, from ``seed`` or from the round number (the sampled
    #: clients, step sizes, a cached encoding of this round's downlink) need not be listed.
    CHECKPOINT_ATTRS: tuple[str, ...] = ()
    #: where the model's floating-point buffers (BatchNorm statistics) live: "beside" the algorithm's vector,
    #: aggregated as FedAvg does (every algorithm but FedREP), or "in-vector" (FedREP's w, spec 11.2)
    BUFFERS: str = "beside"
    #: whether train messages carry the server's buffers (a decentralized algorithm's nodes own theirs)
    SEND_BUFFERS: bool = True
    #: Why this strategy cannot resume from a checkpoint (None: it can). Set by a family whose server state is not
    #: (yet) in CHECKPOINT_ATTRS or depends on secrets that are never written down.
    resume_unsupported: str | None = None

    def state_dict(self) -> dict[str, Any]:
        """Everything the server carries from one round to the next, as data :mod:`fedpdm_flower.fedapp.checkpoint` can write: the
        model x, the bookkeeping (history, privacy figures, accountants) and the algorithm's ``CHECKPOINT_ATTRS``.

        Randomness needs no state: every server draw comes from :meth:`rng` with (seed, round, ...) as its stream,
        so a resumed run draws what the uninterrupted run would have drawn.
        """
        return {
            "strategy": type(self).__name__,
            "round": self.history[-1].round if self.history else 0,
            "seed": self.seed,
            "dim": self.dim,
            "x": self.x,
            "buffers": dict(self._carried),
            "run_token": self.run_token,
            "identify_nodes": self.identify_nodes,
            "bookkeeping": self.bookkeeping_state(),
            "algorithm": {name: getattr(self, name) for name in self.CHECKPOINT_ATTRS},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the state of :meth:`state_dict` (after :meth:`initialize`): the model and bookkeeping now, the
        algorithm's attributes when the first resumed round begins (after the federation is attached, which
        allocates per-client state such as a graph's counters)."""
        if self.resume_unsupported is not None:
            raise ValueError(f"{type(self).__name__} cannot resume from a checkpoint: {self.resume_unsupported}")
        if "node-order" in (self.identify_nodes, state.get("identify_nodes", "ask")):
            # the checkpoint's per-client state would go to whichever node sorts there now
            raise ValueError("a run with identify_nodes='node-order' cannot resume from a checkpoint: its client ids "
                             "are the node-id order of the run that wrote it; resume with identify_nodes='ask'")
        if state.get("strategy") != type(self).__name__:
            raise ValueError(f"the checkpoint is of strategy {state.get('strategy')!r}, not {type(self).__name__}")
        if int(state["seed"]) != self.seed:
            raise ValueError(f"the checkpoint's seed is {state['seed']}, this strategy's is {self.seed}")
        x = np.asarray(state["x"], dtype=np.float64)
        if int(state["dim"]) != self.dim or x.shape != (self.dim,):
            raise ValueError(f"the checkpoint's model has {x.shape[0]} parameters, this strategy's {self.dim}")
        missing = sorted(set(self.CHECKPOINT_ATTRS) - set(state["algorithm"]))
        if missing:
            raise ValueError(f"the checkpoint lacks {type(self).__name__}'s state {missing}")
        self.x = x
        if "buffers" in state:  # the entries beside x as the last round left them
            self._carried = self.checked_buffers({str(k): np.asarray(v) for k, v in state["buffers"].items()})
        self.load_bookkeeping_state(state["bookkeeping"])
        self.run_token = state["run_token"]
        self.resume_round = int(state["round"])
        self._pending_state = dict(state["algorithm"])

    def apply_pending_state(self) -> None:
        """Set the algorithm's attributes from the checkpoint (called when the first resumed round begins)."""
        if self._pending_state is None:
            return
        for name, value in self._pending_state.items():
            setattr(self, name, value)
        self._pending_state = None

    # ------------------------------------------------------------------ the model
    def initialize(self, initial_arrays: ArrayRecord) -> None:
        """Take the user's initial model: its layout, x = its floating-point entries, then :meth:`on_initialize`."""
        if not isinstance(initial_arrays, ArrayRecord):
            raise TypeError(f"initial_arrays must be a flwr ArrayRecord, got {type(initial_arrays).__name__}")
        arrays = arrays_of(initial_arrays)
        self.layout = ArrayLayout.of(arrays, beside=norm_buffer_names(arrays) if self.BUFFERS == "beside" else ())
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

    # ------------------------------------------------------------------ buffers (entries beside x)
    def sends_buffers(self) -> bool:
        """Whether train messages carry the server's buffers: ``SEND_BUFFERS`` and a model with entries beside x,
        buffers kept beside the algorithm's vector (``BUFFERS = "beside"``)."""
        return self.SEND_BUFFERS and self.BUFFERS == "beside" and bool(self._carried)

    def checked_buffers(self, arrays: Mapping[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
        """``arrays`` as the model's entries beside x: exactly their names, their shapes, finite numbers (a reply is
        untrusted input; MalformedPayload names what is wrong)."""
        assert self.layout is not None
        want = {e.name: e for e in self.layout.entries if not e.in_vector}
        if sorted(arrays) != sorted(want):
            raise MalformedPayload(f"buffers record has entries {sorted(arrays)[:6]}, the model's are "
                                   f"{sorted(want)[:6]}")
        out = {}
        for name, e in want.items():
            a = np.asarray(arrays[name])
            if tuple(a.shape) != e.shape:
                raise MalformedPayload(f"buffer {name!r} has shape {tuple(a.shape)}, expected {e.shape}")
            if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
                raise MalformedPayload(f"buffer {name!r} has dtype {a.dtype}: not numeric")
            if not np.all(np.isfinite(a)):
                raise MalformedPayload(f"buffer {name!r} holds non-finite values")
            out[name] = a
        return out

    def decode_buffers(self, content: RecordDict) -> dict[str, NDArray[Any]] | None:
        """A reply's buffers (the record :data:`~fedpdm_flower.fedapp.wire.BUFFERS_KEY`), checked; None when it carries
        none (a numpy model; a decentralized node that does not share them) or the model has no entries beside x."""
        record = content.array_records.get(BUFFERS_KEY)
        if record is None or self.BUFFERS != "beside" or not self._carried:
            return None
        return self.checked_buffers(arrays_of(record))

    def aggregate_buffers(self, buffers: Mapping[int, Mapping[str, NDArray[Any]]],
                          metrics: Mapping[int, Mapping[str, Any]]) -> None:
        """The entries beside x after the round: FedAvg's mean of the accepted replies' buffers weighted by their
        ``num-examples`` (equal weights unless every weight is a positive number), each entry cast back to its
        dtype -- integer entries rounded to the nearest integer, booleans by majority. Unchanged without replies
        that carry buffers."""
        if not buffers:
            return
        clients = sorted(buffers)
        w = [metrics.get(c, {}).get("num-examples") for c in clients]
        weights = (np.asarray(w, dtype=np.float64) if all(isinstance(v, int | float) and not isinstance(v, bool)
                                                          and v > 0 for v in w) else np.ones(len(clients)))
        weights = weights / weights.sum()
        assert self.layout is not None
        out: dict[str, NDArray[Any]] = {}
        for e in self.layout.entries:
            if e.in_vector:
                continue
            mean = np.tensordot(weights, np.stack([np.asarray(buffers[c][e.name], dtype=np.float64)
                                                   for c in clients]), axes=1)
            if np.issubdtype(e.dtype, np.floating):
                out[e.name] = mean.astype(e.dtype)
            elif e.dtype == np.bool_:
                out[e.name] = mean >= 0.5
            else:
                out[e.name] = np.rint(mean).astype(e.dtype)
        self._carried = out

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
        """Wait for ``min_available_nodes``, then learn each node's client id (``query.whoami``), or number the
        nodes in node-id order without a message (``identify_nodes="node-order"``)."""
        ids = sorted(wait_for_nodes(grid, self.min_available_nodes, limit_s=self.node_wait_s))
        if self.identify_nodes == "node-order":
            self.attach(dict(enumerate(ids)))
            log(INFO, "%d nodes numbered as clients 0..%d in node-id order (identify_nodes='node-order': no query "
                "before round 1)", len(ids), len(ids) - 1)
            return
        if len(ids) >= ASK_HINT_NODES:  # in a simulation here: 23 s at 1,000 nodes, 277 s at 10,000
            log(INFO, "asking %d nodes who they are (%s, one message each) before round 1; identify_nodes="
                "'node-order' sends none (docs/performance.md, \"Node identification\")", len(ids), WHOAMI)
        msgs = [Message(RecordDict({"config": ConfigRecord()}), dst_node_id=nid, message_type=WHOAMI) for nid in ids]
        reported: dict[int, tuple[int, int | None]] = {}
        failed: dict[int, str] = {}
        infos: dict[int, dict[str, Any]] = {}
        for reply in grid.send_and_receive(msgs, timeout=self.timeout):
            nid = reply.metadata.src_node_id
            info = {} if reply.has_error() else dict(reply.content.config_records.get("info", ConfigRecord()))
            infos[nid] = info
            pid, parts = info.get("partition-id"), info.get("num-partitions")
            if isinstance(pid, int) and not isinstance(pid, bool) and pid >= 0:
                reported[nid] = (pid, parts if isinstance(parts, int) else None)
            else:
                failed[nid] = str(reply.error.reason) if reply.has_error() else "no partition-id in its node config"
        node_of = self._number_nodes(ids, reported, failed)
        self.attach(node_of)
        log(INFO, "%d nodes mapped to clients 0..%d", len(node_of), len(node_of) - 1)
        self.check_nodes({cid: infos.get(nid, {}) for cid, nid in node_of.items()})

    def check_nodes(self, infos: Mapping[int, Mapping[str, Any]]) -> None:
        """What the nodes said of themselves in their whoami replies (client id -> info), before round 1: a strategy
        refuses to start a run a node has already said it will refuse (e.g. a privacy floor below the target)."""

    def _number_nodes(self, ids: list[int], reported: dict[int, tuple[int, int | None]], failed: dict[int, str]) -> dict[int, int]:
        """client id -> node id from the whoami replies (partition ids if every node gave a distinct one)."""
        pids = [p for p, _ in reported.values()]
        usable = len(reported) == len(ids) and sorted(pids) == list(range(len(ids)))  # the sampler draws from 0..N-1
        if self.require_partition_ids:
            if failed or len(reported) != len(ids):
                nid, why = next(iter(failed.items())) if failed else (next(i for i in ids if i not in reported), "no reply")
                raise FederationError(f"node {nid} did not report its partition-id ({why}); this strategy needs every "
                                      "node's partition-id (node config \"partition-id=<i> num-partitions=<N>\")")
            if not usable:
                dup = [p for p, c in Counter(pids).items() if c > 1]
                if dup:
                    raise FederationError(f"two nodes claim partition-id {dup[0]}")
                raise FederationError(f"partition ids {sorted(pids)} are not exactly 0..{len(ids) - 1}")
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
        """Reset the round's accumulators (bytes, rejections, wall clock); the first round of a resumed run also
        takes the algorithm's state from the checkpoint (:meth:`apply_pending_state`)."""
        self.apply_pending_state()
        self._acc = {"t0": time.perf_counter(), "down": 0, "up": 0, "rejected": 0, "sent": 0, "round": server_round,
                     "errors": Counter()}

    def pre_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        """(node id, message type, content) of an exchange that must precede the train messages of the round.

        Most algorithms have none (one exchange per round). FedREP sends its propose phase here (ConSpar's
        coordinate proposals and, masked, the devices' signed keys), the same in every driver.
        """
        return []

    def consume_pre_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> None:
        """Digest the replies of :meth:`pre_train_contents` (a subclass that sends any must override this)."""
        raise NotImplementedError(f"{type(self).__name__} sent pre-train messages but does not consume them")

    def post_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        """(node id, message type, content) of an exchange that must follow the train replies before the round is
        complete; asked once per round, after :meth:`consume_replies`.

        Most algorithms have none (the round is complete after :meth:`consume_replies`). FedREP with masked buffers
        sends the unmask requests here: the buffer sums exist only once the survivors reveal their parts.
        """
        return []

    def consume_post_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> MetricRecord:
        """Digest the replies of :meth:`post_train_contents`, complete the round and return its metrics (a subclass
        that sends any must override this)."""
        raise NotImplementedError(f"{type(self).__name__} sent post-train messages but does not consume them")

    def round_metrics(self) -> MetricRecord:
        """The round's diagnostics so far as Flower's MetricRecord (numbers only)."""
        return MetricRecord({k: float(v) for k, v in self._acc.get("diag", {}).items() if isinstance(v, int | float)})

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
        """The config of one train message: the user's train_config and ours (:meth:`with_user_config`)."""
        token = {RUN_TOKEN_KEY: self.run_token} if self.run_token is not None else {}
        return self.with_user_config({**self.common_config(), **config, ROUND_KEY: server_round, **token})

    def with_user_config(self, ours: Mapping[str, Any]) -> dict[str, Any]:
        """The user's ``train_config`` beside the algorithm's own keys ``ours``, which reach the client unchanged.

        A user key that is also one of ours raises ValueError naming it (before anything is sent): silently
        overriding either would change the algorithm or the user's client code. "server-round" is the exception, as
        in Flower: the strategy sets it.
        """
        clash = sorted((set(self.user_config) & set(ours)) - {ROUND_KEY})
        if clash:
            raise ValueError(f"train_config key(s) {clash} are also set by {type(self).__name__} itself in its train "
                             "messages: rename them in your train_config")
        return {**self.user_config, **ours}

    def train_contents(self, server_round: int) -> list[tuple[int, RecordDict]]:
        """(node id, content) of every train message of the round; counts downlink bytes."""
        if self._acc.get("round") != server_round:
            self.begin_round(server_round)
        out = []
        for cid in self.participants(server_round):
            arrays, config = self.client_payload(server_round, cid)
            content = train_content(arrays, self.message_config(server_round, config),
                                    arrays_key=self.arrayrecord_key, config_key=self.configrecord_key)
            for name, record in self.client_records(server_round, cid).items():
                content[name] = record
            if self.sends_buffers():
                content[BUFFERS_KEY] = record_of(self._carried)
            self._acc["down"] += recorddict_nbytes(content)
            out.append((self.node_of[cid], content))
        self._acc["sent"] = len(out)
        return out

    def client_records(self, server_round: int, client: int) -> dict[str, ArrayRecord]:
        """Records a client's train message carries beside the arrays and the config (default none; FedREP's masked
        buffers add the buffer-mates' signed keys)."""
        return {}

    def reject(self, server_round: int, node_id: int, why: str) -> None:
        """Count and log a rejected reply (its reason goes into the round's error tally)."""
        self._acc["rejected"] = self._acc.get("rejected", 0) + 1
        self.round_errors()[why] += 1
        self.rejected_total += 1
        cid = self.pid_of.get(node_id)
        who = f"node {node_id}" if cid is None else f"node {node_id} (client {cid})"
        log(WARNING, "round %d: rejected reply from %s: %s", server_round, who, why)

    def validate_reply(self, content: RecordDict) -> tuple[list[NDArray[Any]], dict[str, Any]]:
        """The generic checks every reply passes before the algorithm decodes it (DESIGN.md, trust boundaries)."""
        if self.arrayrecord_key not in content.array_records or "metrics" not in content.metric_records:
            raise MalformedPayload(f"reply must carry an ArrayRecord {self.arrayrecord_key!r} and a MetricRecord "
                                   "'metrics'")
        arrays = numpy_list(content.array_records[self.arrayrecord_key])
        return arrays, self.validate_metrics(content)

    @staticmethod
    def validate_metrics(content: RecordDict) -> dict[str, Any]:
        """A reply's MetricRecord 'metrics', every value a finite number (or list of them)."""
        if "metrics" not in content.metric_records:
            raise MalformedPayload("reply must carry a MetricRecord 'metrics'")
        m = dict(content.metric_records["metrics"])
        bad = sorted(k for k, v in m.items() if not _metric_ok(v))
        if bad:
            raise MalformedPayload(f"non-finite metric(s) {bad}")
        bad = sorted(k for k, v in m.items() if "accuracy" in k and not (isinstance(v, int | float) and 0 <= v <= 1))
        if bad:
            raise MalformedPayload(f"accuracy metric(s) {bad} outside [0, 1]")
        return m

    def update_vector(self, server_round: int, client: int, update: Any) -> FloatArray | None:
        """The change a decoded reply asks of the model (for the norm screen); None: nothing to screen (masked)."""
        return None

    def screen_update_norms(self, server_round: int, updates: dict[int, Any]) -> None:
        """Reject the replies whose update norm exceeds the bound, before any of them touches the state.

        The bound is ``max_update_norm`` when set, and ``update_norm_factor`` times the median norm of the round's
        replies when there are at least 3 (a median of fewer is not robust; then only ``max_update_norm``
        applies). One huge but finite reply (3e38 in float32) would otherwise move every coordinate of the model.
        """
        norms = {cid: float(np.linalg.norm(v)) for cid, upd in updates.items()
                 if (v := self.update_vector(server_round, cid, upd)) is not None}
        bound = math.inf if self.max_update_norm is None else self.max_update_norm
        why = f"max_update_norm = {self.max_update_norm:g}" if self.max_update_norm is not None else ""
        if self.update_norm_factor is not None and len(norms) >= 3:
            relative = self.update_norm_factor * float(np.median(list(norms.values())))
            if relative < bound:
                bound, why = relative, f"{self.update_norm_factor:g} x the round's median update norm"
        for cid, norm in norms.items():
            if not norm <= bound:
                self.reject(server_round, self.node_of.get(cid, cid), f"update norm {norm:.4g} exceeds {bound:.4g} "
                            f"({why})")
                del updates[cid]

    def consume_replies(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> MetricRecord:
        """Validate, decode and aggregate the replies; a bad reply is logged and skipped.

        Raises
        ------
        RoundFailed
            When replies were expected and none was accepted (:meth:`check_round_accepted`, quoting the errors).
        """
        updates: dict[int, Any] = {}
        metrics: dict[int, dict[str, Any]] = {}
        contents: dict[int, RecordDict] = {}
        buffers: dict[int, dict[str, NDArray[Any]]] = {}
        for node_id, content in replies:
            if isinstance(content, str):
                self.reject(server_round, node_id, client_error_text(content))
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
                update, m = self.decode_reply(server_round, cid, content)
                state = self.decode_buffers(content)
            except (MalformedPayload, LayoutMismatch, ValueError, KeyError, TypeError) as err:
                self.reject(server_round, node_id, str(err))
                continue
            updates[cid], metrics[cid] = update, m
            if state is not None:
                buffers[cid] = state
            contents[cid] = content
        self.screen_update_norms(server_round, updates)
        metrics = {cid: m for cid, m in metrics.items() if cid in updates}
        self._acc["train_replies"] = {cid: (self.node_of.get(cid, cid), c) for cid, c in contents.items()
                                      if cid in updates}
        missing = self._acc.get("expected", self._acc["sent"]) - len(replies)
        if missing > 0:
            log(WARNING, "round %d: %d sampled client(s) did not reply", server_round, missing)
        self.check_round_accepted(server_round, len(updates), self._acc["sent"], max(missing, 0))
        diag = self.aggregate(server_round, updates, metrics) if updates else {}
        self.aggregate_buffers({cid: b for cid, b in buffers.items() if cid in updates}, metrics)
        for cid, m in metrics.items():
            self.record_privacy(cid, m)
        self._acc["diag"] = {**diag, "clients": float(len(updates)), "rejected": float(self._acc["rejected"])}
        return self.round_metrics()

    def decode_reply(self, server_round: int, client: int, content: RecordDict) -> tuple[Any, dict[str, Any]]:
        """One train reply -> (the algorithm's update, its metrics): the generic checks (:meth:`validate_reply`),
        then :meth:`decode_update`. A subclass whose replies carry other records overrides this."""
        arrays, m = self.validate_reply(content)
        return self.decode_update(server_round, client, arrays, m), m

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
        """Run ``num_rounds`` rounds: Flower's ``Strategy.start``, and its ``Result`` filled as ``FedAvg`` fills it.

        ``Result.arrays`` is the global model in the user's layout; ``train_metrics_clientapp`` /
        ``evaluate_metrics_clientapp`` the aggregated metrics of the clients' train / evaluate replies;
        ``evaluate_metrics_serverapp`` what ``evaluate_fn(server_round, arrays) -> MetricRecord | None`` (Flower's
        signature) returned, as returned (round 0 included). Its "accuracy" / "loss" (or "test_accuracy" /
        "test_loss") also go into :attr:`history`. ``timeout`` bounds every message exchange of a round (pre-train,
        train, post-train, evaluate and the node queries), each separately, as Flower's does the train and evaluate
        exchanges.
        """
        if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1:
            raise ValueError(f"num_rounds must be an integer >= 1, got {num_rounds!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.timeout = float(timeout)
        self.evaluate_config = dict(evaluate_config or {})
        if self.resume_round:  # load_state_dict ran: the model and state are the checkpoint's, not initial_arrays
            self.prepare(num_rounds, train_config=train_config, evaluate_fn=evaluate_fn)
            return self.continue_rounds(grid, num_rounds, timeout=timeout)
        self.initialize(initial_arrays)
        self.prepare(num_rounds, train_config=train_config, evaluate_fn=evaluate_fn)
        if not self.seed_was_given:
            log(INFO, "%s: seed=%d (drawn from the OS; pass seed=... to repeat this run)", type(self).__name__, self.seed)
        return super().start(grid=grid, initial_arrays=self.current_arrays(), num_rounds=num_rounds, timeout=timeout,
                             train_config=train_config, evaluate_config=evaluate_config, evaluate_fn=self._evaluate_hook)

    def continue_rounds(self, grid: Grid, num_rounds: int, *, timeout: float = 3600) -> Result:
        """Rounds ``resume_round + 1 .. num_rounds`` of a resumed run: Flower's ``Strategy.start`` loop (train
        exchange, aggregation, client-side evaluation, central evaluation) from the round after the checkpoint's."""
        if self.resume_round >= num_rounds:
            raise ValueError(f"the checkpoint is of round {self.resume_round}: nothing is left of {num_rounds} rounds")
        log(INFO, "%s: resuming after round %d of %d", type(self).__name__, self.resume_round, num_rounds)
        self.timeout = float(timeout)
        result = Result()
        for rnd in range(self.resume_round + 1, num_rounds + 1):
            replies = grid.send_and_receive(
                messages=self.configure_train(rnd, self.current_arrays(), ConfigRecord(dict(self.user_config)), grid),
                timeout=timeout)
            arrays, metrics = self.aggregate_train(rnd, replies)
            if arrays is not None:
                result.arrays = arrays
            if metrics is not None:
                result.train_metrics_clientapp[rnd] = metrics
            evaluated = grid.send_and_receive(
                messages=self.configure_evaluate(rnd, self.current_arrays(), ConfigRecord(dict(self.evaluate_config)),
                                                 grid), timeout=timeout)
            agg = self.aggregate_evaluate(rnd, evaluated)
            if agg is not None:
                result.evaluate_metrics_clientapp[rnd] = agg
            res = self._evaluate_hook(rnd, self.current_arrays())
            if res is not None:
                result.evaluate_metrics_serverapp[rnd] = res
        return result

    def prepare(self, num_rounds: int, *, train_config: ConfigRecord | Mapping[str, Any] | None = None,
                evaluate_fn: EvaluateFn | None = None) -> None:
        """Set the run's length, the user's train config and central evaluation (both drivers call this).

        A ``train_config`` key that the algorithm sets in every message raises ValueError here, before round 1; one
        that it sets for some clients only raises when the first such message is built (:meth:`with_user_config`).
        """
        self.num_rounds = num_rounds
        self.evaluate_fn = evaluate_fn
        self.adopt_config(train_config or {})
        if self.layout is not None:
            self.with_user_config({**self.common_config(), RUN_TOKEN_KEY: ""})

    def adopt_config(self, config: Mapping[str, Any]) -> None:
        """The user's train config: every key but "server-round", which Flower and we set ourselves (as
        ``FedAvg.configure_train`` overwrites it)."""
        self.user_config = {k: v for k, v in dict(config).items() if k != ROUND_KEY}

    def adopt_arrays(self, arrays: ArrayRecord) -> None:
        """Start the round from ``arrays`` when they differ from the strategy's global model (Flower's
        ``configure_train`` sends the ``arrays`` it is given).

        ``Strategy.start`` passes what :meth:`aggregate_train` returned, which is the global model: nothing changes.
        Arrays that differ (a user's loop that edits the model between rounds) must have the initial names and
        shapes; cast to the initial dtypes, they become the global model through :meth:`set_global_model`.
        """
        if self.layout is None or not isinstance(arrays, ArrayRecord) or not len(arrays):
            return
        raw = arrays_of(arrays)
        what = "the arrays passed to configure_train"
        if list(raw) != self.layout.names:
            self.layout.check(raw, what=what)  # raises, naming the missing / unexpected entries
        given = {e.name: np.asarray(raw[e.name]).astype(e.dtype, copy=False) for e in self.layout.entries}
        self.layout.check(given, what=what)  # the shapes
        ours = arrays_of(self.current_arrays())
        if all(np.array_equal(given[k], ours[k]) for k in ours):
            return
        log(INFO, "%s: the arrays passed to configure_train differ from the global model: the round starts from them",
            type(self).__name__)
        self._carried = {e.name: given[e.name] for e in self.layout.entries if not e.in_vector}
        self.set_global_model(self.layout.flatten(given))

    def set_global_model(self, x: FloatArray) -> None:
        """Replace the global model by ``x`` (flat, float64) between rounds. The base sets x; a strategy whose global
        model is not ``self.x`` (a decentralized one, FedREP's float32 w) overrides this or refuses."""
        if type(self).global_model is not FederatedStrategy.global_model:
            raise ValueError(f"{type(self).__name__} keeps its own model state between rounds: it cannot start a round "
                             "from other arrays than the ones its last round returned")
        if not np.all(np.isfinite(x)):
            raise ValueError("the arrays passed to configure_train hold NaN or Inf values")
        self.x = np.asarray(x, dtype=np.float64)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Send each sampled client its own payload (after a pre-train exchange if the algorithm has one).

        As Flower's ``FedAvg``: waits for ``min_available_nodes``, sends the ``arrays`` it is given (the global model,
        :meth:`adopt_arrays`) and the user's ``config`` beside the algorithm's keys (:meth:`with_user_config`), and
        logs ``configure_train: Sampled N nodes (out of M)``.
        """
        self._grid = grid  # aggregate_train sends the post-train exchange, if any, through it
        online = wait_for_nodes(grid, self.min_available_nodes, limit_s=self.node_wait_s)
        if not self.node_of:
            self.connect(grid)
        else:
            self.readmit(grid, server_round)
        if config is not None:
            self.adopt_config(config)
        self.adopt_arrays(arrays)
        self.begin_round(server_round)
        pre = self.pre_train_contents(server_round)
        if pre:
            msgs = [Message(content, dst_node_id=node, message_type=mtype) for node, mtype, content in pre]
            got = grid.send_and_receive(msgs, timeout=self.timeout)
            self.consume_pre_train(server_round, self.reply_items(server_round, msgs, got, pre[0][1]))
        self._train_msgs = [Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
                            for node, content in self.checked_train_contents(server_round)]
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(self._train_msgs), len(online))
        return list(self._train_msgs)

    def checked_train_contents(self, server_round: int) -> list[tuple[int, RecordDict]]:
        """:meth:`train_contents` after the privacy budget check (both drivers send these)."""
        contents = list(self.train_contents(server_round))
        self.check_privacy_budget(server_round, [self.pid_of[node] for node, _ in contents if node in self.pid_of])
        return contents

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and aggregate (after a post-train exchange if the algorithm has one); returns the global model in
        the user's layout and the aggregate of the accepted replies' metrics (:meth:`client_train_metrics`), as
        Flower's ``FedAvg`` does. The strategy's own figures of the round go to :attr:`diagnostics`."""
        replies = list(replies)
        failures = sum(1 for r in replies if r.has_error())
        log(INFO, "aggregate_train: Received %s results and %s failures", len(replies) - failures, failures)
        items = self.reply_items(server_round, self._train_msgs, replies, MessageType.TRAIN)
        self._train_msgs = []
        self.consume_replies(server_round, items)
        post = self.post_train_contents(server_round)
        if post:
            if self._grid is None:
                raise RuntimeError("a post-train exchange needs the Grid of configure_train")
            msgs = [Message(content, dst_node_id=node, message_type=mtype) for node, mtype, content in post]
            got = self._grid.send_and_receive(msgs, timeout=self.timeout)
            self.consume_post_train(server_round, self.reply_items(server_round, msgs, got, post[0][1]))
        return self.current_arrays(), self.client_train_metrics(server_round)

    def client_train_metrics(self, server_round: int) -> MetricRecord | None:
        """``Result.train_metrics_clientapp[server_round]``: the clients' train metrics aggregated as Flower's FedAvg
        aggregates them (``train_metrics_aggr_fn``, weighted by ``weighted_by_key``), over the replies the algorithm
        accepted whose metrics have the round's keys (:func:`consistent_metric_replies`; the others are logged).
        An empty MetricRecord when replies were accepted but none carries aggregatable metrics; None without any.
        """
        replies: dict[int, tuple[int, RecordDict]] = self._acc.get("train_replies", {})
        if not replies:
            return None
        keep, bad = consistent_metric_replies(list(replies.values()), self.weighted_by_key)
        if bad:  # one line a round: the update of such a reply still counts, only its metrics are left out
            log(WARNING, "round %d: the train metrics of %d accepted reply(ies) are left out of the aggregate (%s: %s)",
                server_round, len(bad), self.describe_nodes([bad[0][0]]), bad[0][1])
        return aggregate_metric_replies([c for _, c in keep], self.weighted_by_key,
                                        self.train_metrics_aggr_fn) or MetricRecord()

    def reply_items(self, server_round: int, sent: Sequence[Message], replies: Iterable[Message],
                    exchange: str) -> list[tuple[int, RecordDict | str]]:
        """(node id, content or error text) of an exchange's replies, each attributed to the node it answers.

        An error reply that the SuperLink generates itself -- "Node Unavailable" when a SuperNode missed its
        heartbeats (it died), "Message Unavailable" when the message expired -- comes from the SuperLink's own node
        id (flwr's SUPERLINK_NODE_ID), not from the node that was asked: it is attributed to the destination of
        the message it answers (``reply_to_message_id``; the Grid sets the sent messages' ids when it pushes them),
        so the rejection and a RoundFailed name the dead node and its client. Sent messages that got no reply at
        all (the exchange timed out) are logged with their nodes and clients.
        """
        dst_of = {m.metadata.message_id: m.metadata.dst_node_id for m in sent if m.metadata.message_id}
        asked = {m.metadata.dst_node_id for m in sent}
        items: list[tuple[int, RecordDict | str]] = []
        for r in replies:
            node = r.metadata.src_node_id
            if node not in asked and r.metadata.reply_to_message_id in dst_of:
                node = dst_of[r.metadata.reply_to_message_id]
            items.append((node, str(r.error.reason) if r.has_error() else r.content))
        silent = sorted(asked - {node for node, _ in items})
        if silent and len(items) < len(sent):
            log(WARNING, "round %d: no %s reply from %s", server_round, exchange, self.describe_nodes(silent))
        return items

    def expect_replies_from(self, server_round: int, nodes: Iterable[int]) -> None:
        """This round's replies come from ``nodes`` only: a transport wrapper (SecureBuffers, DistributedDP) hands
        over one reply per buffer, the buffer's mean in its first survivor's reply, so the other members are not
        silent and must not be logged or counted as such."""
        keep = set(nodes)
        self._train_msgs = [m for m in self._train_msgs if m.metadata.dst_node_id in keep]
        self._acc["expected"] = len(self._train_msgs)  # "sent" stays the number of train messages sent

    def describe_nodes(self, nodes: Iterable[int]) -> str:
        """``node 123 (client 1), node 456 (client 2)``: node ids with the client (partition) ids they serve."""
        return ", ".join(f"node {n}" + (f" (client {self.pid_of[n]})" if n in self.pid_of else "") for n in nodes)

    def readmit(self, grid: Grid, server_round: int) -> None:
        """Take in the nodes that connected after round 1: a restarted client's new node, or a new client.

        A SuperNode that crashed and was started again with the same node config registers as a new node id
        (without SuperNode authentication; with it, the registered id comes back online and nothing changes
        here). Before each round the server asks the online nodes it does not know (``query.whoami``, once per
        node) for their partition-id; a node reporting the partition of a client whose node is offline takes that
        client's place from this round on (:meth:`on_readmit` lets the algorithm reset what it assumed about the
        client). The new node starts with an empty ``context.state``: whatever the client kept there is lost.

        Any other new node joins the federation as a new client when the algorithm allows it
        (:attr:`admits_new_nodes`; it gets the next client id, N, whatever its partition-id, and is sampled from this
        round on, as Flower's ``FedAvg`` samples every connected node); otherwise it is logged once and left out.
        With ``identify_nodes="node-order"`` no node is asked: every new node is such a newcomer.
        """
        online = set(grid.get_node_ids())
        gone = {cid for cid, nid in self.node_of.items() if nid not in online}
        strangers = sorted(online - set(self.pid_of) - self._asked)
        if not strangers:
            return
        self._asked.update(strangers)
        replies: Iterable[Message] = []  # identify_nodes="node-order" asks no node who it is: all are newcomers
        if self.identify_nodes == "ask":
            replies = grid.send_and_receive([Message(RecordDict({"config": ConfigRecord()}), dst_node_id=nid,
                                                     message_type=WHOAMI) for nid in strangers], timeout=self.timeout)
        for reply in replies:
            nid = reply.metadata.src_node_id
            info = {} if reply.has_error() else dict(reply.content.config_records.get("info", ConfigRecord()))
            pid, parts = info.get("partition-id"), info.get("num-partitions")
            if (not isinstance(pid, int) or isinstance(pid, bool) or pid not in gone or nid not in strangers
                    or (isinstance(parts, int) and parts != self.num_clients)):
                continue
            old = self.node_of[pid]
            self.node_of[pid] = nid
            del self.pid_of[old]
            self.pid_of[nid] = pid
            gone.discard(pid)
            log(WARNING, "round %d: client %d rejoined as node %d (its node %d went offline); its context.state "
                "starts empty", server_round, pid, nid, old)
            self.on_readmit(pid, old, nid)
        newcomers = sorted(n for n in strangers if n not in self.pid_of)
        if not newcomers:
            return
        if not self.admits_new_nodes or self.require_partition_ids:
            log(WARNING, "round %d: %s connected after round 1; %s keeps the federation of round 1 (its server state "
                "is sized by it) and leaves them out", server_round, self.describe_nodes(newcomers), type(self).__name__)
            return
        joined = []
        for nid in newcomers:  # client ids stay 0..N-1 (the sampler draws from range(N))
            cid = len(self.node_of)
            self.node_of[cid], self.pid_of[nid] = nid, cid
            joined.append(cid)
        self.num_clients = len(self.node_of)
        log(INFO, "round %d: %s joined the federation (now %d clients)", server_round,
            self.describe_nodes(newcomers), self.num_clients)
        self.on_clients_joined(joined)

    def on_clients_joined(self, clients: list[int]) -> None:
        """New clients joined after round 1 (:meth:`readmit`); an algorithm that admits them may allocate per-client
        state here. Default nothing."""

    def on_readmit(self, client: int, old_node: int, new_node: int) -> None:
        """A client now answers from a new node with an empty context.state (:meth:`readmit`); default nothing."""

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Client-side evaluation as Flower's ``FedAvg`` configures it: ``max(int(N * fraction_evaluate),
        min_evaluate_nodes)`` of the federation's connected nodes (a seeded draw), each sent ``arrays`` (the global
        model in the user's layout) and ``config`` (the user's ``evaluate_config``) with "server-round" set; none
        when ``fraction_evaluate`` is 0. Logs ``configure_evaluate: Sampled N nodes (out of M)``."""
        self._eval_msgs = []
        if self.fraction_evaluate == 0.0 or not self.node_of:
            return []
        online = wait_for_nodes(grid, self.min_available_nodes, limit_s=self.node_wait_s)
        nodes = sorted(n for n in self.pid_of if n in set(online))
        size = min(len(nodes), max(int(len(nodes) * self.fraction_evaluate), self.min_evaluate_nodes))
        if size < self.min_evaluate_nodes:
            log(WARNING, "round %d: %d node(s) of the federation are connected, fewer than min_evaluate_nodes = %d: "
                "they all evaluate", server_round, len(nodes), self.min_evaluate_nodes)
        # draw positions, not ids: a node id is a uint64 that numpy would carry as a float64 and round
        picks = self.rng(STREAM_EVALUATE, server_round).choice(len(nodes), size=size, replace=False)
        chosen = [nodes[int(i)] for i in sorted(picks)]
        cfg = ConfigRecord({**dict(config if config is not None else self.evaluate_config), ROUND_KEY: server_round})
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: cfg})
        self._eval_msgs = [Message(content, dst_node_id=int(n), message_type=MessageType.EVALUATE) for n in chosen]
        down = recorddict_nbytes(content) * len(chosen)
        self._acc.setdefault("evaluate", {})["evaluate_down_bytes"] = float(down)
        log(INFO, "configure_evaluate: Sampled %s nodes (out of %s)", len(chosen), len(online))
        return list(self._eval_msgs)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """``Result.evaluate_metrics_clientapp[server_round]``: the evaluate replies' MetricRecords aggregated by
        ``evaluate_metrics_aggr_fn`` (Flower's weighted mean by default). Every reply is untrusted: an error, or
        metrics Flower's FedAvg could not aggregate (missing or bad weight, non-finite values, keys unlike the
        round's), is logged with its node and left out (:func:`consistent_metric_replies`); Flower's FedAvg raises
        ``InconsistentMessageReplies`` instead and the run fails."""
        replies = list(replies)
        failures = sum(1 for r in replies if r.has_error())
        if replies or self._eval_msgs:
            log(INFO, "aggregate_evaluate: Received %s results and %s failures", len(replies) - failures, failures)
        items = self.reply_items(server_round, self._eval_msgs, replies, MessageType.EVALUATE)
        self._eval_msgs = []
        good: list[tuple[int, RecordDict]] = []
        up = 0
        for node, content in items:
            if isinstance(content, str):
                log(WARNING, "round %d: evaluate reply of %s is an error: %s", server_round, self.describe_nodes([node]),
                    client_error_text(content))
                continue
            up += recorddict_nbytes(content)
            if node not in self.pid_of:
                log(WARNING, "round %d: evaluate reply from unknown node %s dropped", server_round, node)
                continue
            good.append((node, content))
        keep, bad = consistent_metric_replies(good, self.weighted_by_key)
        for node, why in bad:
            log(WARNING, "round %d: evaluate reply of %s dropped: %s", server_round, self.describe_nodes([node]), why)
        if items:
            self._acc.setdefault("evaluate", {}).update({
                "evaluate_up_bytes": float(up), "evaluate_replies": float(len(keep)),
                "evaluate_rejected": float(len(items) - len(keep))})
        return aggregate_metric_replies([c for _, c in keep], self.weighted_by_key, self.evaluate_metrics_aggr_fn)

    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "%s: %s", type(self).__name__, ", ".join(f"{k}={v}" for k, v in self.describe().items()))

    def describe(self) -> dict[str, Any]:
        """The settings :meth:`summary` logs (a subclass adds its hyperparameters)."""
        out: dict[str, Any] = {"fraction_train": self.fraction_train, "fraction_evaluate": self.fraction_evaluate,
                               "min_available_nodes": self.min_available_nodes, "seed": self.seed}
        if self.layout is not None:
            out["model"] = self.layout.describe()
        return out
