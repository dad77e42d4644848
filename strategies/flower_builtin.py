"""Flower's own FedAvg / FedProx (``flwr.serverapp.strategy``) adapted to our server app: keys ``flwr-fedavg``,
``flwr-fedprox``.

The aggregation, the sampling and the messages are Flower's, untouched; :class:`FlowerBuiltinMixin` only adds
what fedapp/server_app.py and fedapp/runner.py read from a strategy: the seeded initial model ``x`` (the same
x_0^0 as our strategies), per-round ``history`` (:class:`fedapp.results.RoundRecord`, written by
``evaluate_fn``), ``privacy_summary()``, ``rejected_total`` and ``global_model()``. Bytes are counted with
:func:`fedapp.wire.recorddict_nbytes` by wrapping ``configure_train`` (downlink) and ``aggregate_train``
(uplink). Our :class:`clients.fedavg.FedAvgClient` answers them: no "payload-format" means a dense model, and
FedProx's mu arrives as "proximal-mu".

How these differ from our ``fedavg`` / ``fedprox`` keys (all Flower's behaviour, kept on purpose):

* sampling is Flower's ``sample_nodes`` (Python's unseeded ``random.sample``) with fraction_train = K/N,
  min_train_nodes = K (so float rounding of K/N * N can never sample fewer than K) and min_available_nodes = N;
  no all-clients first round (first-round-all is ignored) and no partition-id mapping (no ``query.whoami``);
* the mean is weighted by "num-examples" (= |D_i|; the same as ours for equal partitions);
* dense only (no sparse variants); federated evaluation is off (fraction_evaluate = 0), the server evaluates
  the global model centrally like ours;
* under ``dp`` the clients add their noise as in ``fedavg`` / ``fedprox``; the privacy metrics are collected per
  node id. A reply with an error counts as rejected, and a round without a reply that is not an error stops the
  run (:class:`fedapp.strategy_base.RoundFailed`, as for ours); malformed content is Flower's to handle (it raises).

They need a Flower Grid: the in-process driver (simulations/inprocess.py) cannot run them, and ``attach`` /
``train_contents`` raise :class:`FlowerOnlyError` there.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx

from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.sampling import STREAM_INIT, rng_for
from fedapp.strategy_base import RoundBookkeeping, client_error_text
from fedapp.task import Evaluator, build_model
from fedapp.wire import recorddict_nbytes

#: client metrics reported as the round's mean (Flower's num-examples weighted mean), under "mean_<key>"
_MEANS = ("Q", "train_loss", "sigma", "eps_round")


class FlowerOnlyError(RuntimeError):
    """A Flower built-in strategy was asked to run without Flower (e.g. on the in-process driver)."""


class FlowerBuiltinMixin(RoundBookkeeping, FedAvg):
    """The members our server app needs, around a Flower built-in strategy (FedAvg or a subclass).

    Put it first in the bases (``class X(FlowerBuiltinMixin, FedProx)``) so that its ``configure_train`` /
    ``aggregate_train`` wrap the built-in's.

    Parameters
    ----------
    cfg
        Run config: num-clients N, clients-per-round K, num-server-rounds, seed, init-std, eval-every, dp, delta.
    evaluator
        Central test-set evaluation; None skips it (default None).
    """

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None) -> None:
        self.cfg = cfg
        self.evaluator = evaluator
        self.x: FloatArray = self.initial_x()
        self.init_bookkeeping()  # privacy is keyed by node id here (no partition map)
        super().__init__(**self.flower_kwargs())

    def initial_x(self) -> FloatArray:
        """The initial global model: x_0^0 of our linear-model strategies (a subclass may start elsewhere)."""
        return rng_for(self.cfg.seed, STREAM_INIT).normal(0.0, self.cfg.init_std, size=build_model(self.cfg).dim)

    def flower_kwargs(self) -> dict[str, Any]:
        """Constructor arguments of the Flower strategy (a subclass adds its own)."""
        c = self.cfg
        return {
            "fraction_train": c.clients_per_round / c.num_clients, "min_train_nodes": c.clients_per_round,
            "min_available_nodes": c.num_clients, "fraction_evaluate": 0.0,
        }

    # ------------------------------------------------------------------ what our server app reads
    def global_model(self) -> FloatArray:
        """The last aggregated model (float64), evaluated centrally and saved by the runner."""
        return self.x

    def summary(self) -> None:
        """Log our run settings, then Flower's own summary."""
        c = self.cfg
        log(INFO, "%s (Flower built-in): N=%d K=%d rounds=%d dataset=%s dp=%s", type(self).__name__,
            c.num_clients, c.clients_per_round, c.num_server_rounds, c.dataset, c.dp)
        super().summary()

    # ------------------------------------------------------------------ byte counting around Flower's methods
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Flower's messages, unchanged; counts their serialized size as the round's downlink bytes."""
        self._acc = {"t0": time.perf_counter(), "up": 0, "down": 0, "round": server_round}
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._acc["down"] = sum(recorddict_nbytes(m.content) for m in messages)
        self._acc["sent"] = len(messages)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's aggregation, unchanged; counts uplink bytes, rejected replies and privacy, and keeps ``x``."""
        replies = list(replies)
        ok = [r for r in replies if not r.has_error()]
        self.rejected_total += len(replies) - len(ok)
        for r in replies:
            if r.has_error():
                self.round_errors()[client_error_text(str(r.error.reason))] += 1
        self.check_round_accepted(server_round, len(ok), self._acc["sent"], max(self._acc["sent"] - len(replies), 0))
        self._acc["up"] = sum(recorddict_nbytes(r.content) for r in ok)
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            self.x = np.asarray(arrays.to_numpy_ndarrays()[0], dtype=np.float64).reshape(-1)
        for r in ok:
            for rec in r.content.metric_records.values():
                self.record_privacy(r.metadata.src_node_id, rec)
        diag = {"clients": float(len(ok)), "rejected": float(len(replies) - len(ok))}
        if metrics is not None:
            diag.update({f"mean_{k}": float(v) for k in _MEANS if isinstance(v := metrics.get(k), int | float)})
        self._acc["diag"] = diag
        return arrays, metrics

    # ------------------------------------------------------------------ the in-process driver
    def attach(self, node_of: dict[int, int]) -> None:
        """Raise :class:`FlowerOnlyError`: Flower samples nodes itself, there is no partition map to attach."""
        raise FlowerOnlyError(self._flower_only())

    def train_contents(self, server_round: int) -> list[tuple[int, RecordDict]]:
        """Raise :class:`FlowerOnlyError`: Flower builds the messages in ``configure_train`` from a Grid."""
        raise FlowerOnlyError(self._flower_only())

    def _flower_only(self) -> str:
        return (f"algorithm {self.cfg.algorithm!r} ({type(self).__name__}) is a Flower built-in strategy and needs a "
                "Flower Grid: run it with `flwr run` (simulation or deployment), not on the in-process driver")


class FlwrFedAvg(FlowerBuiltinMixin):
    """Flower's ``FedAvg`` (McMahan et al. 2017) with our server-app members; key ``flwr-fedavg``."""


class FlwrFedProx(FlowerBuiltinMixin, FedProx):
    """Flower's ``FedProx`` (Li et al. 2020), proximal_mu = the run config's ``mu``; key ``flwr-fedprox``."""

    def flower_kwargs(self) -> dict[str, Any]:
        return {**super().flower_kwargs(), "proximal_mu": self.cfg.mu}
