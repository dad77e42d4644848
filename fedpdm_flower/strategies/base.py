"""The round engine of our Message-API strategies: keyword-constructed, model-agnostic, Flower's vocabulary.

A subclass supplies the algorithm's server side (per-client payload, decoding, aggregation); this base does what
every algorithm needs the same way:

* **the model**: :meth:`FederatedStrategy.initialize` takes the user's ``ArrayRecord`` (any torch state dict or
  list of numpy arrays) and keeps one float64 vector x of its floating-point entries
  (:class:`fedpdm_flower.fedapp.layout.ArrayLayout`); :meth:`current_arrays` gives the user's layout back (names, shapes and
  dtypes as given; integer entries carried unchanged). No model name or dimension is needed up front;
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
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from numpy.typing import NDArray

from fedpdm_flower.fedapp.compression.codec import MalformedPayload
from fedpdm_flower.fedapp.layout import ArrayLayout, FloatArray, LayoutMismatch
from fedpdm_flower.fedapp.results import RoundRecord
from fedpdm_flower.fedapp.sampling import rng_for, select_clients
from fedpdm_flower.fedapp.wire import recorddict_nbytes, train_content

Scalar = int | float | str | bool
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
WHOAMI = "query.whoami"
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
    "RoundBookkeeping",
    "RoundFailed",
    "arrays_of",
    "client_error_text",
    "quote_errors",
    "record_of",
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
    return {k: v.numpy() for k, v in record.items()}


def record_of(arrays: Mapping[str, NDArray[Any]]) -> ArrayRecord:
    """An ArrayRecord holding ``arrays`` under their names, in order."""
    return ArrayRecord({k: Array(np.require(v, requirements="C")) for k, v in arrays.items()})  # keeps 0-d arrays 0-d


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

    def complete_round(self, server_round: int) -> RoundRecord:
        """:meth:`evaluate_round`, then ``after_round`` (the checkpoint): what every driver calls to end a round."""
        rec = self.evaluate_round(server_round)
        if self.after_round is not None:
            self.after_round(server_round)
        return rec

    # ------------------------------------------------------------------ checkpoints (fedpdm_flower/fedapp/checkpoint.py)
    def bookkeeping_state(self) -> dict[str, Any]:
        """The bookkeeping a resumed run needs: the history, the clients' privacy figures, the server-side
        accountants (as the events composed into them, replayed on load), the rejection and retry counters."""
        return {
            "history": [dataclasses.asdict(r) for r in self.history],
            "client_privacy": self.client_privacy,
            "rejected_total": self.rejected_total,
            "releases": self._releases,
            "unanswered_rounds": self._unanswered_rounds,
            "unanswered_errors": dict(self._unanswered_errors),
        }

    def load_bookkeeping_state(self, state: Mapping[str, Any]) -> None:
        """The inverse of :meth:`bookkeeping_state` (accountants rebuilt with the factory of :meth:`set_accountant`)."""
        self.history = [RoundRecord(**r) for r in state["history"]]
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
        """What ``Strategy.start`` calls after each round: the user's evaluate_fn, recorded in the history."""
        if server_round == 0:
            return self.evaluate_fn(0, arrays) if self.evaluate_fn is not None else None
        rec = self.complete_round(server_round)
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
    max_update_norm, update_norm_factor
        The norm screen of the replies (:meth:`screen_update_norms`): a reply whose update norm exceeds
        ``max_update_norm`` (default None: no absolute bound) or ``update_norm_factor`` times the round's median
        (default 10, with at least 3 replies; None: off) is rejected before it touches the model.
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
        max_update_norm: float | None = None,
        update_norm_factor: float | None = 10.0,
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
            "run_token": self.run_token,
            "bookkeeping": self.bookkeeping_state(),
            "algorithm": {name: getattr(self, name) for name in self.CHECKPOINT_ATTRS},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the state of :meth:`state_dict` (after :meth:`initialize`): the model and bookkeeping now, the
        algorithm's attributes when the first resumed round begins (after the federation is attached, which
        allocates per-client state such as a graph's counters)."""
        if self.resume_unsupported is not None:
            raise ValueError(f"{type(self).__name__} cannot resume from a checkpoint: {self.resume_unsupported}")
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
        infos: dict[int, dict[str, Any]] = {}
        for reply in grid.send_and_receive(msgs, timeout=self.node_wait_s):
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
        """The config of one train message: the user's train_config, then ours (ours may not be overridden)."""
        token = {RUN_TOKEN_KEY: self.run_token} if self.run_token is not None else {}
        return {**self.user_config, **self.common_config(), **config, ROUND_KEY: server_round, **token}

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
        arrays = content.array_records[self.arrayrecord_key].to_numpy_ndarrays()
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
                updates[cid], metrics[cid] = self.decode_reply(server_round, cid, content)
            except (MalformedPayload, LayoutMismatch, ValueError, KeyError, TypeError) as err:
                self.reject(server_round, node_id, str(err))
        self.screen_update_norms(server_round, updates)
        metrics = {cid: m for cid, m in metrics.items() if cid in updates}
        missing = self._acc["sent"] - len(replies)
        if missing > 0:
            log(WARNING, "round %d: %d sampled client(s) did not reply", server_round, missing)
        self.check_round_accepted(server_round, len(updates), self._acc["sent"], max(missing, 0))
        diag = self.aggregate(server_round, updates, metrics) if updates else {}
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
        """Run ``num_rounds`` rounds (Flower's ``Strategy.start``); ``Result.arrays`` is in the user's layout.

        ``evaluate_fn(server_round, arrays) -> MetricRecord | None`` is the user's central evaluation (Flower's
        signature); its "accuracy" / "loss" (or "test_accuracy" / "test_loss") go into the round history.
        """
        if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1:
            raise ValueError(f"num_rounds must be an integer >= 1, got {num_rounds!r}")
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
        exchange, aggregation, central evaluation) from the round after the checkpoint's."""
        if self.resume_round >= num_rounds:
            raise ValueError(f"the checkpoint is of round {self.resume_round}: nothing is left of {num_rounds} rounds")
        log(INFO, "%s: resuming after round %d of %d", type(self).__name__, self.resume_round, num_rounds)
        result = Result()
        for rnd in range(self.resume_round + 1, num_rounds + 1):
            replies = grid.send_and_receive(messages=self.configure_train(rnd, self.current_arrays(), ConfigRecord(), grid),
                                            timeout=timeout)
            arrays, metrics = self.aggregate_train(rnd, replies)
            if arrays is not None:
                result.arrays = arrays
            if metrics is not None:
                result.train_metrics_clientapp[rnd] = metrics
            res = self._evaluate_hook(rnd, self.current_arrays())
            if res is not None:
                result.evaluate_metrics_serverapp[rnd] = res
        return result

    def prepare(self, num_rounds: int, *, train_config: ConfigRecord | Mapping[str, Any] | None = None,
                evaluate_fn: EvaluateFn | None = None) -> None:
        """Set the run's length, the user's extra train config and central evaluation (both drivers call this)."""
        self.num_rounds = num_rounds
        self.evaluate_fn = evaluate_fn
        self.user_config = dict(train_config or {})
        ours = set(self.common_config()) | {ROUND_KEY, RUN_TOKEN_KEY}
        clash = sorted(ours & set(self.user_config))
        if clash:
            raise ValueError(f"train_config keys {clash} are set by {type(self).__name__} itself")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Send each sampled client its own payload (after a pre-train exchange if the algorithm has one)."""
        if not self.node_of:
            self.connect(grid)
        else:
            self.readmit(grid, server_round)
        self._grid = grid  # aggregate_train sends the post-train exchange, if any, through it
        self.begin_round(server_round)
        pre = self.pre_train_contents(server_round)
        if pre:
            msgs = [Message(content, dst_node_id=node, message_type=mtype) for node, mtype, content in pre]
            got = grid.send_and_receive(msgs, timeout=self.node_wait_s)
            self.consume_pre_train(server_round, self.reply_items(server_round, msgs, got, pre[0][1]))
        self._train_msgs = [Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
                            for node, content in self.checked_train_contents(server_round)]
        return list(self._train_msgs)

    def checked_train_contents(self, server_round: int) -> list[tuple[int, RecordDict]]:
        """:meth:`train_contents` after the privacy budget check (both drivers send these)."""
        contents = list(self.train_contents(server_round))
        self.check_privacy_budget(server_round, [self.pid_of[node] for node, _ in contents if node in self.pid_of])
        return contents

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and aggregate (after a post-train exchange if the algorithm has one); returns the global model in
        the user's layout and the round's diagnostics."""
        items = self.reply_items(server_round, self._train_msgs, replies, MessageType.TRAIN)
        self._train_msgs = []
        self.consume_replies(server_round, items)
        post = self.post_train_contents(server_round)
        if post:
            if self._grid is None:
                raise RuntimeError("a post-train exchange needs the Grid of configure_train")
            msgs = [Message(content, dst_node_id=node, message_type=mtype) for node, mtype, content in post]
            got = self._grid.send_and_receive(msgs, timeout=self.node_wait_s)
            self.consume_post_train(server_round, self.reply_items(server_round, msgs, got, post[0][1]))
        return self.current_arrays(), self.round_metrics()

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

    def describe_nodes(self, nodes: Iterable[int]) -> str:
        """``node 123 (client 1), node 456 (client 2)``: node ids with the client (partition) ids they serve."""
        return ", ".join(f"node {n}" + (f" (client {self.pid_of[n]})" if n in self.pid_of else "") for n in nodes)

    def readmit(self, grid: Grid, server_round: int) -> None:
        """Give a client whose node has gone offline to a new node that reports the same partition-id.

        A SuperNode that crashed and was started again with the same node config registers as a new node id
        (without SuperNode authentication; with it, the registered id comes back online and nothing changes
        here). Before each round the server asks the online nodes it does not know (``query.whoami``, once per
        node) for their partition-id; a node reporting the partition of a client whose node is offline takes that
        client's place from this round on (:meth:`on_readmit` lets the algorithm reset what it assumed about the
        client). The new node starts with an empty ``context.state``: whatever the client kept there is lost.
        """
        online = set(grid.get_node_ids())
        gone = {cid for cid, nid in self.node_of.items() if nid not in online}
        strangers = sorted(online - set(self.pid_of) - self._asked)
        if not gone or not strangers:
            return
        self._asked.update(strangers)
        msgs = [Message(RecordDict({"config": ConfigRecord()}), dst_node_id=nid, message_type=WHOAMI)
                for nid in strangers]
        for reply in grid.send_and_receive(msgs, timeout=self.node_wait_s):
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

    def on_readmit(self, client: int, old_node: int, new_node: int) -> None:
        """A client now answers from a new node with an empty context.state (:meth:`readmit`); default nothing."""

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
