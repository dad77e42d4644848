"""Checkpoint and resume for any strategy in a user's own Flower app: a run that survives its ServerApp.

Flower has no resume: ``Strategy.start`` always begins at round 1, and a ServerApp that dies (the machine restarts,
the process is killed) loses the run. :class:`Checkpointed` wraps any Message-API strategy -- Flower's own
(``FedAvg``, ``FedAdam``, ``FedAvgM``, the DP wrappers, ...), ours (``BSDPFedPDM``, ``DPIADMM``, ...) and our
wrappers (``SecureBuffers``, ``Robust``, ``Compressed``, ``CentralDP``, ``DistributedDP``) -- and runs Flower's
round loop itself:

    strategy = Checkpointed(SecureBuffers(Robust(FedAvg(...), GeometricMedian())), "/var/lib/fl/ckpt",
                            config=context.run_config)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=50,
                            evaluate_fn=central_eval)

* **After every round** (train exchange, evaluate exchange, central evaluation) it writes the global model, the
  history (the ``Result`` so far), the state of every layer of the chain (each wrapper's and the innermost
  strategy's, privacy accountants included) and the run's token into ``directory``, atomically and self-checking
  (:mod:`fedpdm_flower.fedapp.checkpoint`: npz + JSON, each with its SHA-256, no pickle).
* **On start** it reads the checkpoint when there is one and continues from the round after it: the same
  ``start`` call resumes a run whose ServerApp was killed, so a supervisor that restarts the ServerApp (or an
  operator who runs ``flwr run`` again) needs nothing else. A checkpoint of another configuration -- another chain
  of strategies, other settings, another model layout, another ``train_config`` or user ``config`` -- or a damaged
  one is refused with a :class:`~fedpdm_flower.fedapp.checkpoint.CheckpointError` naming what differs, before
  anything is sent or written. A checkpoint of the last round returns the saved Result without running anything.
* **Privacy ledgers continue**: the server's accountants are part of the saved state (our strategies' per-client
  accountants, CentralDP's PLD and DistributedDP's Skellam accountants, Flower's DP wrappers' ``accountant``), and
  every message carries the run's token (config ``run-token``, with ``server-round``), by which the devices'
  :func:`fedpdm_flower.clients.state.persistent_state_mod` restores their ``context.state`` -- duals, error memories,
  ledgers -- in the resumed run, a new Flower run with fresh Contexts.

**How each layer's state is taken.** A layer with its own ``state_dict()`` / ``load_state_dict()`` (our
strategies, through ``CHECKPOINT_ATTRS``; our wrappers) gives it. Any other layer -- Flower's strategies -- is taken
by its public instance attributes, the assumption being that Flower keeps what a round carries to the next there
(read from flwr 1.42: FedOpt's ``m_t`` / ``v_t``, FedAvgM's ``momentum_vector`` / ``current_arrays``, the adaptive
clipping wrappers' ``clipping_norm``, the fixed clipping wrappers' ``accountant``; FedAvg, FedProx, Krum, Bulyan,
FedMedian, FedTrimmedAvg, QFedAvg carry nothing): numbers, strings, numpy arrays, ``ArrayRecord``s, numpy
Generators and objects with ``state_dict()`` (accountants); callables (aggregation functions) are settings and are
skipped; an attribute of any other kind is refused at the first checkpoint, naming it. Private attributes
(``_pending_events``) are taken to be scratch of one round.

**What does not resume exactly** (docs/resume.md has the table per family): randomness that is never written down
(CentralDP's secret sample and noise, the secure aggregation's masks and stochastic rounding, a device without a
seed) is drawn afresh; a round that was in flight when the ServerApp died is done again from the checkpoint (the
devices roll their state back to before it, except their ledgers, which keep the release); a secure buffer in
flight is lost with its round (a device never masks a round twice) and the resumed run asks every node for a new
key under a new run label; Compressed sends every node the dense model in the first resumed round (it cannot know
which devices still hold the reference). FedREP and the DP-RECAL family refuse to be checkpointed, with the reason.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedpdm_flower.fedapp.checkpoint import (
    STATE_FILE,
    CheckpointError,
    Journal,
    config_differences,
    read_checkpoint,
    write_checkpoint,
)
from fedpdm_flower.strategies.base import ROUND_KEY, RUN_TOKEN_KEY, EvaluateFn, FederatedStrategy, RoundBookkeeping
from fedpdm_flower.strategies.wrappers import StrategyWrapper

__all__ = ["Checkpointed", "layer_state", "load_layer_state", "strategy_chain"]

#: the checkpoint document's ``kind``: a Checkpointed checkpoint, not the reproduction app's
KIND = "fedpdm-flower/Checkpointed"
#: settings that may differ between the killed and the resumed run: how long to wait, which changes no result
FREE_SETTINGS = ("node_wait_s", "timeout")
_SKIP = object()


# ------------------------------------------------------------------------------------------------ the chain
def strategy_chain(strategy: Strategy) -> list[Strategy]:
    """``strategy`` and the strategies it wraps, outermost first: a layer wraps the one strategy held in its
    instance attributes (``inner`` for ours, ``strategy`` for Flower's DP wrappers)."""
    chain = [strategy]
    while True:
        inner = [v for v in vars(chain[-1]).values() if isinstance(v, Strategy) and v is not chain[-1]]
        if not inner:
            return chain
        if len(inner) > 1:
            raise TypeError(f"{type(chain[-1]).__name__} holds {len(inner)} strategies: cannot tell which one it wraps")
        if any(inner[0] is s for s in chain):
            raise TypeError(f"{type(chain[-1]).__name__} wraps a strategy of its own chain")
        chain.append(inner[0])


def _labels(chain: list[Strategy]) -> list[str]:
    """Class names of the chain, ``#2``, ``#3`` for a class that comes again."""
    seen: dict[str, int] = {}
    out = []
    for layer in chain:
        name = type(layer).__name__
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def _own(layer: Any, method: str) -> bool:
    """The layer's class defines ``method`` (not reached through a wrapper's delegation to its inner strategy)."""
    return callable(getattr(type(layer), method, None))


# ------------------------------------------------------------------------------------------------ settings
def _setting(value: Any) -> Any:
    """A constructor-time setting as JSON data: scalars, lists of scalars, dataclass objects (codecs, aggregators,
    privacy targets) by their repr; _SKIP for anything else."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, list | tuple) and all(v is None or isinstance(v, bool | int | float | str) for v in value):
        return [_setting(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return repr(value)
    return _SKIP


def layer_settings(layer: Strategy) -> dict[str, Any]:
    """A layer's settings as constructed: its scalar attributes (public and private) and its dataclass-valued ones.

    Taken when the layer is wrapped, before round 1, when what a run changes (counters, clipping norms) still holds
    its initial value. Left out: a FederatedStrategy's OS-drawn seed (the resumed run adopts the checkpoint's) and
    the waiting times of :data:`FREE_SETTINGS`.
    """
    out = {}
    for name, value in vars(layer).items():
        if isinstance(value, Strategy) or name in ("run_token", "resume_round", *FREE_SETTINGS):
            continue
        if name == "seed" and isinstance(layer, FederatedStrategy) and not layer.seed_was_given:
            continue
        v = _setting(value)
        if v is not _SKIP:
            out[name] = v
    return out


# ------------------------------------------------------------------------------------------------ layer state
def _to_data(value: Any, where: str) -> Any:
    """An attribute's value as checkpoint data (ArrayRecords, Generators and stateful objects tagged)."""
    from fedpdm_flower.fedapp.checkpoint import encode_state

    if isinstance(value, ArrayRecord):
        return {"__arrayrecord__": {k: v.numpy() for k, v in value.items()}}
    if isinstance(value, np.random.Generator):
        return {"__generator__": dict(value.bit_generator.state)}
    if _own(value, "state_dict") and _own(value, "load_state_dict"):
        return {"__stateful__": value.state_dict()}
    if isinstance(value, Mapping):
        return {k: _to_data(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list | tuple):
        out = [_to_data(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if isinstance(value, tuple) else out
    try:
        encode_state(value, {})
    except CheckpointError:
        raise CheckpointError(f"cannot checkpoint {where}, a {type(value).__name__}: give its class state_dict() and "
                              "load_state_dict(), or keep per-round scratch in a private attribute") from None
    return value


def _from_data(saved: Any, current: Any, where: str) -> Any:
    """The inverse of :func:`_to_data`; a Generator or stateful object is loaded into the current one."""
    if isinstance(saved, dict) and len(saved) == 1:
        tag, body = next(iter(saved.items()))
        if tag == "__arrayrecord__":
            return ArrayRecord({k: Array(np.require(v, requirements="C")) for k, v in body.items()})
        if tag == "__generator__":
            rng = current if isinstance(current, np.random.Generator) else np.random.default_rng()
            if body.get("bit_generator") != type(rng.bit_generator).__name__:
                raise CheckpointError(f"{where}: the checkpoint holds a {body.get('bit_generator')} generator, this "
                                      f"strategy a {type(rng.bit_generator).__name__}")
            rng.bit_generator.state = dict(body)
            return rng
        if tag == "__stateful__":
            if not _own(current, "load_state_dict"):
                raise CheckpointError(f"{where}: the checkpoint holds its state, but this strategy has "
                                      f"{type(current).__name__} there (construct it as the checkpointed run did)")
            try:
                current.load_state_dict(body)
            except (ValueError, TypeError, KeyError) as err:
                raise CheckpointError(f"{where}: {err}") from None
            return current
    if isinstance(saved, dict):
        cur = current if isinstance(current, Mapping) else {}
        return {k: _from_data(v, cur.get(k), f"{where}[{k!r}]") for k, v in saved.items()}
    if isinstance(saved, list | tuple):
        cur_seq = current if isinstance(current, list | tuple) and len(current) == len(saved) else [None] * len(saved)
        out = [_from_data(v, c, f"{where}[{i}]") for i, (v, c) in enumerate(zip(saved, cur_seq, strict=True))]
        return tuple(out) if isinstance(saved, tuple) else out
    return saved


def layer_state(layer: Strategy) -> Any:
    """What ``layer`` carries from one round to the next (module docstring: its own state_dict, else its public
    data attributes)."""
    if _own(layer, "state_dict"):
        return layer.state_dict()  # type: ignore[attr-defined]
    name = type(layer).__name__
    return {attr: _to_data(value, f"{name}.{attr}") for attr, value in vars(layer).items()
            if not attr.startswith("_") and not isinstance(value, Strategy)
            and not (callable(value) and not _own(value, "state_dict"))}


def load_layer_state(layer: Strategy, state: Any) -> None:
    """Put :func:`layer_state`'s ``state`` back into ``layer`` (a freshly constructed one)."""
    name = type(layer).__name__
    if _own(layer, "load_state_dict"):
        try:
            layer.load_state_dict(state)  # type: ignore[attr-defined]
        except (ValueError, TypeError, KeyError) as err:
            raise CheckpointError(f"{name} cannot take the checkpoint's state: {err}") from None
        return
    for attr, saved in state.items():
        setattr(layer, attr, _from_data(saved, getattr(layer, attr, None), f"{name}.{attr}"))


# ------------------------------------------------------------------------------------------------ records
def _arrays_data(record: ArrayRecord) -> dict[str, Any]:
    return {k: v.numpy() for k, v in record.items()}


def _arrays_record(data: Mapping[str, Any]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.require(v, requirements="C")) for k, v in data.items()})


def _round_metrics(item: tuple[int, MetricRecord]) -> list[Any]:
    return [int(item[0]), dict(item[1])]


def _metrics_data(history: Mapping[int, MetricRecord]) -> Journal:
    """A Result's {round: MetricRecord} as a journal of [round, metrics] entries: each round's written once, not in
    every checkpoint (a long run's state.json would grow with the round)."""
    return Journal(sorted(history.items()), convert=_round_metrics)


def _metrics_history(data: Any) -> dict[int, MetricRecord]:
    """The inverse of :func:`_metrics_data` (also the {round: metrics} dict of checkpoints written before journals)."""
    pairs = data.items() if isinstance(data, Mapping) else data
    return {int(r): MetricRecord(dict(m)) for r, m in pairs}


def _layout_text(record: ArrayRecord) -> str:
    return "; ".join(f"{k}:{list(np.shape(v.numpy()))}:{v.numpy().dtype}" for k, v in record.items())


class _LabelledGrid:
    """The Grid, with the run's token and the round put into the config of every message that leaves: the devices
    key their state snapshots by them. Used by reference inside one round; everything else is the Grid's."""

    def __init__(self, grid: Grid, token: str, server_round: int) -> None:
        self._grid, self._token, self._round = grid, token, server_round

    def label(self, messages: Iterable[Message]) -> list[Message]:
        """The messages, each with a copy of its config record holding the labels (a strategy may share one
        ConfigRecord among its messages and rounds: it is not changed)."""
        out = list(messages)
        for msg in out:
            records = msg.content.config_records
            key = "config" if "config" in records else (next(iter(records)) if len(records) == 1 else None)
            if key is None:
                continue
            cfg = dict(records[key])
            cfg[RUN_TOKEN_KEY] = self._token
            cfg.setdefault(ROUND_KEY, self._round)
            msg.content[key] = ConfigRecord(cfg)
        return out

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(self.label(messages))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self._grid.send_and_receive(self.label(messages), timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        if name == "_grid":
            raise AttributeError(name)
        return getattr(self._grid, name)


# ------------------------------------------------------------------------------------------------ the wrapper
class Checkpointed(Strategy):
    """Any strategy, checkpointed after every round and resumed by ``start`` (module docstring).

    Parameters
    ----------
    strategy
        The strategy to run: Flower's, ours, or a chain of our wrappers around either. Checkpointed must be the
        outermost layer.
    directory
        The checkpoint's directory, absolute (a ServerApp's working directory is the SuperLink's, not the app's):
        ``state.json`` and ``arrays-<round>.npz`` go there. One run per directory: a new run needs a new (or
        emptied) directory, since a checkpoint found there is resumed.
    config
        The user's settings that identify the run (e.g. ``context.run_config`` without the keys that may change
        between the crashed and the resumed run): a checkpoint whose config differs is refused, naming the keys.
        Values must be numbers, strings or booleans.
    """

    def __init__(self, strategy: Strategy, directory: str | Path, *, config: Mapping[str, Any] | None = None) -> None:
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a Flower Message-API Strategy, got {type(strategy).__name__}")
        if isinstance(strategy, Checkpointed):
            raise TypeError("the strategy is Checkpointed already")
        self.chain = strategy_chain(strategy)
        for layer in self.chain:
            if isinstance(layer, Checkpointed):
                raise TypeError("Checkpointed must be the outermost strategy: it runs the rounds")
            why = getattr(layer, "resume_unsupported", None) if isinstance(layer, FederatedStrategy) else None
            if isinstance(layer, RoundBookkeeping) and not isinstance(layer, FederatedStrategy):
                why = ("the reproduction app's baselines around Flower's strategies keep their round records outside "
                       "any state_dict; checkpoint Flower's own strategy (flwr.serverapp.strategy.FedAvg, FedProx, "
                       "Krum, ...) instead")
            if why:
                raise ValueError(f"{type(layer).__name__} cannot resume from a checkpoint: {why}")
        path = Path(directory).expanduser()
        if not path.is_absolute():
            raise ValueError(f"directory must be an absolute path, got {str(directory)!r} (a ServerApp runs in the "
                             "SuperLink's working directory, not the app's)")
        user = dict(config or {})
        bad = sorted(k for k, v in user.items() if not isinstance(v, bool | int | float | str))
        if bad:
            raise TypeError(f"config values must be numbers, strings or booleans; {bad} are not")
        self.strategy = strategy
        self.directory = path
        self.config = user
        #: each layer's settings as constructed (what a checkpoint must agree with)
        self.settings = [layer_settings(layer) for layer in self.chain]
        #: the run's token (the devices key their snapshots by it): drawn by a fresh run, the checkpoint's on resume
        self.token: str | None = None
        #: the round of the checkpoint the last start resumed from (0: a fresh run)
        self.resumed_from = 0

    def __getattr__(self, name: str) -> Any:
        # the wrapped strategy's members (privacy_spent, history, ...) stay reachable through the wrapper
        if name in ("strategy", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.strategy, name)

    @property
    def innermost(self) -> Strategy:
        """The strategy at the bottom of the chain."""
        return self.chain[-1]

    # ------------------------------------------------------------------ Strategy API: the wrapped strategy's
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        log(INFO, "Checkpointed: after every round into %s", self.directory)
        self.strategy.summary()

    # ------------------------------------------------------------------ what identifies the run
    def fingerprint(self, initial_arrays: ArrayRecord, train_config: ConfigRecord | None,
                    evaluate_config: ConfigRecord | None) -> dict[str, Any]:
        """The run's configuration as flat ``key -> value`` data: the chain, each layer's settings, the model's
        layout, the train / evaluate configs and the user's config. Taken before round 1."""
        labels = _labels(self.chain)
        out: dict[str, Any] = {"chain": " > ".join(labels), "model": _layout_text(initial_arrays)}
        for label, settings in zip(labels, self.settings, strict=True):
            out.update({f"{label}.{k}": v for k, v in settings.items()})
        for prefix, record in (("train_config", train_config), ("evaluate_config", evaluate_config)):
            for k, v in dict(record or {}).items():
                if k == ROUND_KEY:  # Flower's configure_train writes the round into the user's record itself
                    continue
                out[f"{prefix}.{k}"] = _setting(v) if _setting(v) is not _SKIP else repr(v)
        out.update({f"config.{k}": _setting(v) for k, v in self.config.items()})
        return out

    # ------------------------------------------------------------------ the run
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
        """Flower's ``Strategy.start`` -- the rounds, each one's train exchange, evaluate exchange and central
        evaluation -- from the round after the checkpoint in ``directory`` (round 1 without one), writing a
        checkpoint after every round. Returns the whole run's Result (the resumed rounds' and the saved ones).

        Raises
        ------
        CheckpointError
            Before anything is sent or written: the checkpoint in ``directory`` is damaged, of another
            configuration (the message names the differing settings), or of a round beyond ``num_rounds``.
        """
        if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 1:
            raise ValueError(f"num_rounds must be an integer >= 1, got {num_rounds!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if not isinstance(initial_arrays, ArrayRecord):
            raise TypeError(f"initial_arrays must be a flwr ArrayRecord, got {type(initial_arrays).__name__}")
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        for layer in self.chain:  # what each layer's own start would set: StrategyWrapper.start, FederatedStrategy.start
            if isinstance(layer, StrategyWrapper):
                layer.run_timeout = float(timeout)
                layer.check_user_config(train_config)
            if isinstance(layer, FederatedStrategy):
                layer.timeout = float(timeout)
                layer.evaluate_config = dict(evaluate_config)
        fingerprint = self.fingerprint(initial_arrays, train_config, evaluate_config)
        saved = self._read(fingerprint, num_rounds)
        ours = self.innermost if isinstance(self.innermost, FederatedStrategy) else None
        arrays = initial_arrays
        if saved is None:  # a fresh run
            self.token = (ours.run_token if ours is not None and ours.run_token else None) or secrets.token_hex(16)
            self.resumed_from, first, result = 0, 1, Result()
            if ours is not None:
                ours.initialize(initial_arrays)
                ours.run_token = self.token
                arrays = ours.current_arrays()  # the user's layout, as FederatedStrategy.start sends it
                if not ours.seed_was_given:
                    log(INFO, "%s: seed=%d (drawn from the OS; a resumed run takes it from the checkpoint)",
                        type(ours).__name__, ours.seed)
        else:
            doc, state = saved
            self.token, self.resumed_from = str(state["token"]), int(doc["round"])
            if ours is not None:
                ours.initialize(initial_arrays)  # the layout; the model itself is the checkpoint's
                if not ours.seed_was_given:
                    ours.seed = int(state["layers"][-1]["seed"])
            for layer, layer_saved in zip(self.chain, state["layers"], strict=True):
                load_layer_state(layer, layer_saved)
            if ours is not None:
                ours.run_token = self.token
            first, arrays, result = self.resumed_from + 1, _arrays_record(state["model"]), self._result(state)
        if ours is not None:
            ours.prepare(num_rounds, train_config=train_config, evaluate_fn=evaluate_fn)
            evaluate_fn = ours._evaluate_hook  # the history, the privacy figures, then the user's evaluate_fn
        return self._rounds(grid, first, num_rounds, arrays, result, timeout=timeout, train_config=train_config,
                            evaluate_config=evaluate_config, evaluate_fn=evaluate_fn, fingerprint=fingerprint)

    def _read(self, fingerprint: Mapping[str, Any], num_rounds: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The checkpoint in ``directory`` if there is one and it is this run's; CheckpointError otherwise."""
        if not (self.directory / STATE_FILE).is_file():
            return None
        where = f"the checkpoint in {self.directory}"
        try:
            doc, state = read_checkpoint(self.directory, subdir="")
        except CheckpointError as err:
            raise CheckpointError(f"{where} cannot be resumed: {err}; nothing was changed (remove the directory "
                                  "to start afresh)") from None
        if doc.get("kind") != KIND:
            raise CheckpointError(f"{where} is not a Checkpointed checkpoint (kind {doc.get('kind')!r}); nothing was "
                                  "changed")
        saved = doc["run_config"]
        if saved.get("chain") != fingerprint["chain"]:
            diff = [f"chain: {saved.get('chain')!r} -> {fingerprint['chain']!r}"]
        else:
            diff = config_differences(saved, fingerprint)
        if diff:
            raise CheckpointError(f"{where} is of another configuration; differing: {'; '.join(diff)}. Nothing was "
                                  "changed: resume with the same configuration, or use another directory")
        if int(doc["round"]) > num_rounds:
            raise CheckpointError(f"{where} is of round {doc['round']}, beyond num_rounds = {num_rounds}")
        if len(state["layers"]) != len(self.chain):
            raise CheckpointError(f"{where} holds {len(state['layers'])} layers, the chain has {len(self.chain)}")
        log(INFO, "Checkpointed: resuming after round %d of %d from %s", doc["round"], num_rounds, self.directory)
        return doc, state

    @staticmethod
    def _result(state: Mapping[str, Any]) -> Result:
        saved = state["result"]
        out = Result(train_metrics_clientapp=_metrics_history(saved["train"]),
                     evaluate_metrics_clientapp=_metrics_history(saved["evaluate"]),
                     evaluate_metrics_serverapp=_metrics_history(saved["server"]))
        if saved["arrays"] == "model":
            out.arrays = _arrays_record(state["model"])
        elif saved["arrays"] is not None:
            out.arrays = _arrays_record(saved["arrays"])
        return out

    def _write(self, server_round: int, num_rounds: int, arrays: ArrayRecord, result: Result,
               fingerprint: Mapping[str, Any]) -> None:
        """The checkpoint of ``server_round``: the model, the Result so far, every layer's state, the token."""
        assert self.token is not None
        res_arrays: Any = None
        if result.arrays is arrays:
            res_arrays = "model"
        elif len(result.arrays):
            res_arrays = _arrays_data(result.arrays)
        state = {
            "token": self.token,
            "model": _arrays_data(arrays),
            "result": {"arrays": res_arrays, "train": _metrics_data(result.train_metrics_clientapp),
                       "evaluate": _metrics_data(result.evaluate_metrics_clientapp),
                       "server": _metrics_data(result.evaluate_metrics_serverapp)},
            "layers": [layer_state(layer) for layer in self.chain],
        }
        write_checkpoint(self.directory, server_round, fingerprint, state,
                         extra={"kind": KIND, "num_rounds": num_rounds, "written_at": time.time()}, subdir="")

    def _rounds(self, grid: Grid, first: int, num_rounds: int, arrays: ArrayRecord, result: Result, *,
                timeout: float, train_config: ConfigRecord, evaluate_config: ConfigRecord,
                evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
                fingerprint: Mapping[str, Any]) -> Result:
        """Flower 1.42's ``Strategy.start`` loop from round ``first``, with a checkpoint after every round."""
        from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info

        log(INFO, "Starting %s strategy:", type(self.strategy).__name__)
        log_strategy_start_info(num_rounds, arrays, train_config, evaluate_config)
        self.summary()
        log(INFO, "")
        t_start = time.time()
        if first == 1 and evaluate_fn:
            res = evaluate_fn(0, arrays)
            log(INFO, "Initial global evaluation results: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        elif first > num_rounds:
            log(WARNING, "Checkpointed: the checkpoint is of the last round (%d): nothing left to run", num_rounds)
        # a lone strategy of ours labels its messages itself and reads the Grid's class (simulation or not)
        labelled = not (len(self.chain) == 1 and isinstance(self.strategy, FederatedStrategy))
        for rnd in range(first, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", rnd, num_rounds)
            g: Any = _LabelledGrid(grid, str(self.token), rnd) if labelled else grid
            replies = g.send_and_receive(self.strategy.configure_train(rnd, arrays, train_config, g), timeout=timeout)
            agg_arrays, agg_metrics = self.strategy.aggregate_train(rnd, replies)
            if agg_arrays is not None:
                result.arrays = agg_arrays
                arrays = agg_arrays
            if agg_metrics is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_metrics)
                result.train_metrics_clientapp[rnd] = agg_metrics
            replies = g.send_and_receive(self.strategy.configure_evaluate(rnd, arrays, evaluate_config, g),
                                         timeout=timeout)
            agg_eval = self.strategy.aggregate_evaluate(rnd, replies)
            if agg_eval is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_eval)
                result.evaluate_metrics_clientapp[rnd] = agg_eval
            if evaluate_fn:
                log(INFO, "Global evaluation")
                res = evaluate_fn(rnd, arrays)
                log(INFO, "\t└──> MetricRecord: %s", res)
                if res is not None:
                    result.evaluate_metrics_serverapp[rnd] = res
            self._write(rnd, num_rounds, arrays, result, fingerprint)
        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        return result

