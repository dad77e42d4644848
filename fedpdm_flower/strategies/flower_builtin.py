"""Flower's own FedAvg / FedProx (``flwr.serverapp.strategy``) driving our local-SGD client: the ``flwr-fedavg`` /
``flwr-fedprox`` baselines of seed 000.

The aggregation, the sampling and the messages are Flower's, untouched; :class:`FlowerBuiltinMixin` adds our
per-round records (:class:`fedpdm_flower.strategies.base.RoundBookkeeping`: central evaluation, bytes counted from the serialized
records, privacy, rejected replies) and puts the local loop's settings into each message's config, because our
:class:`fedpdm_flower.clients.fedavg.FedAvgClient` reads every algorithmic value from the message (eta^t changes every round,
which a static ``train_config`` cannot express). The model travels as Flower sends it (the user's arrays, no
"payload-format"); the client replies in the same arrays. FedProx's mu arrives as Flower's "proximal-mu".

How these differ from our ``fedavg`` / ``fedprox`` keys (all Flower's behaviour, kept on purpose):

* sampling is Flower's ``sample_nodes`` (Python's unseeded ``random.sample``); no all-clients first round and no
  partition-id mapping (no ``query.whoami``);
* the mean is weighted by "num-examples" (= |D_i|; the same as ours for equal partitions);
* dense only; federated evaluation is off (fraction_evaluate = 0), the server evaluates centrally like ours;
* under DP the clients add their noise as in ``fedavg`` / ``fedprox``; privacy metrics are collected per node id.
  A reply with an error counts as rejected, and a round without a reply that is not an error stops the run
  (:class:`fedpdm_flower.strategies.base.RoundFailed`, as for ours); malformed content is Flower's to handle (it raises).

They need a Flower Grid: the in-process driver cannot run them (:class:`FlowerOnlyError`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx, Result

from fedpdm_flower.fedapp.algorithms.fedpdm import step_size
from fedpdm_flower.fedapp.layout import ArrayLayout, FloatArray
from fedpdm_flower.fedapp.privacy.gaussian import Calibration, Eq36Calibration, GaussianTarget
from fedpdm_flower.fedapp.privacy.protocol import privacy_guard
from fedpdm_flower.fedapp.wire import recorddict_nbytes
from fedpdm_flower.strategies.base import EvaluateFn, RoundBookkeeping, arrays_of, client_error_text

__all__ = ["FlowerBuiltinMixin", "FlowerOnlyError", "FlwrFedAvg", "FlwrFedProx"]

#: client metrics reported as the round's mean (Flower's num-examples weighted mean), under "mean_<key>"
_MEANS = ("Q", "train_loss", "sigma", "eps_round")


class FlowerOnlyError(RuntimeError):
    """A Flower built-in strategy was asked to run without Flower (e.g. on the in-process driver)."""


class FlowerBuiltinMixin(RoundBookkeeping, FedAvg):
    """Our records and the local loop's per-round config around a Flower built-in strategy (FedAvg or a subclass).

    Put it first in the bases (``class X(FlowerBuiltinMixin, FedProx)``) so that its ``configure_train`` /
    ``aggregate_train`` wrap the built-in's.

    Parameters
    ----------
    eta0, max_local_steps, batch_size
        The local loop of :class:`fedpdm_flower.clients.fedavg.FedAvgClient` (eta^t = eta0 / sqrt(1 + t); defaults 0.04, 10,
        None = the client's DataLoader batch size).
    gamma
        l1 subgradient weight (default 0.0).
    privacy
        The paper's Gaussian calibration (:class:`fedpdm_flower.fedapp.privacy.gaussian.Eq36Calibration`) or None.
    accountant
        Server-side accounting of each client's releases with Flower's privacy protocol and a budget
        (:meth:`~fedpdm_flower.strategies.base.RoundBookkeeping.set_accountant`); None (default) reports the clients' own figures.
    eval_every
        Central evaluation every this many rounds (default 1).
    **flower
        Flower's own constructor arguments (fraction_train, min_train_nodes, min_available_nodes, ...; and
        proximal_mu for FedProx). fraction_evaluate defaults to 0.
    """

    PRIVACY_KEYS = ("eps_eq36", "eps_gdp", "eps_rdp", "eps_basic", "delta_basic")
    RIGOROUS_PRIVACY = ("eps_gdp", "gdp (device ledgers)")

    def __init__(self, *, eta0: float = 0.04, max_local_steps: int = 10, batch_size: int | None = None,
                 gamma: float = 0.0, privacy: Calibration | None = None, eval_every: int = 1,
                 accountant: Any = None, **flower: Any) -> None:
        self.init_bookkeeping(eval_every=eval_every)
        if privacy is not None and not isinstance(privacy, Eq36Calibration | GaussianTarget):
            raise TypeError(f"privacy must be Eq36Calibration(...) or GaussianTarget(...), got {type(privacy).__name__}: "
                            "record-level DP-SGD under Flower's own strategies is DeviceDPSGD in your ClientApp "
                            "(fedpdm_flower.clients.dpsgd), or our FedAvg with privacy=PrivacyTarget(...)")
        if accountant is None and isinstance(privacy, GaussianTarget):
            accountant = privacy_guard(privacy)  # the target is also the budget the run may not pass
        self.set_accountant(accountant)
        self.eta0, self.max_local_steps, self.batch_size = float(eta0), max_local_steps, batch_size
        self.gamma, self.dp = float(gamma), privacy
        self.x: FloatArray = np.zeros(0)
        self._arrays: ArrayRecord | None = None
        super().__init__(**{"fraction_evaluate": 0.0, **flower})

    # ------------------------------------------------------------------ what our server app reads
    def global_model(self) -> FloatArray:
        """The last aggregated model (flat float64), evaluated centrally and saved by the runner."""
        return self.x

    def current_arrays(self) -> ArrayRecord:
        if self._arrays is None:
            raise RuntimeError("no model yet: call start(...)")
        return self._arrays

    def initialize(self, initial_arrays: ArrayRecord) -> None:
        """Take the initial model (``start`` does this itself)."""
        self._keep(initial_arrays)

    def prepare(self, num_rounds: int, *, train_config: Any = None, evaluate_fn: EvaluateFn | None = None) -> None:
        """Set the run's length and central evaluation (``start`` does this itself)."""
        self.num_rounds, self.evaluate_fn = num_rounds, evaluate_fn

    def _keep(self, arrays: ArrayRecord) -> None:
        self._arrays = arrays
        named = arrays_of(arrays)
        self.x = ArrayLayout.of(named).flatten(named)

    def headline_privacy(self, priv: Any) -> tuple[float | None, float | None]:
        key = "eps_gdp" if isinstance(self.dp, GaussianTarget) else "eps_eq36"
        if self.dp is not None and key in priv:
            return float(priv[key]), self.dp.delta
        return None, None

    @property
    def privacy_label(self) -> str:  # type: ignore[override]
        return "eps(gdp)" if isinstance(self.dp, GaussianTarget) else "eps(36)"

    def summary(self) -> None:
        log(INFO, "%s (Flower built-in) with our local-SGD client: eta0=%s max_local_steps=%d gamma=%s dp=%s",
            type(self).__name__, self.eta0, self.max_local_steps, self.gamma, self.dp is not None)
        super().summary()

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: EvaluateFn | None = None) -> Result:
        """Flower's ``start`` with our per-round records (``evaluate_fn`` feeds the history)."""
        self.initialize(initial_arrays)
        self.prepare(num_rounds, evaluate_fn=evaluate_fn)
        return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                             self._evaluate_hook)

    # ------------------------------------------------------------------ Flower's methods, wrapped
    def local_config(self, server_round: int, participation: float) -> dict[str, Any]:
        """The settings :class:`fedpdm_flower.clients.fedavg.FedAvgClient` reads from each message."""
        cfg: dict[str, Any] = {"eta": step_size(self.eta0, server_round - 1), "max-steps": self.max_local_steps,
                               "gamma": self.gamma, "uplink": "dense", "dp": self.dp is not None}
        if self.batch_size is not None:
            cfg["batch-size"] = self.batch_size
        if self.dp is not None:
            cfg.update(self.dp.message_config(self.num_rounds, participation))
        return cfg

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Flower's messages plus our local settings in their config; counts their size as downlink bytes."""
        self._acc = {"t0": time.perf_counter(), "up": 0, "down": 0, "round": server_round}
        messages = list(super().configure_train(server_round, arrays, config, grid))
        available = max(1, len(list(grid.get_node_ids())))
        extra = self.local_config(server_round, min(1.0, len(messages) / available))
        clash = sorted(set(config or {}) & set(extra))
        if clash:  # the user's train_config reaches the clients unchanged, or the run stops (as for our strategies)
            raise ValueError(f"train_config key(s) {clash} are also set by {type(self).__name__} itself in its train "
                             "messages: rename them in your train_config")
        for m in messages:
            m.content[self.configrecord_key] = ConfigRecord({**dict(m.content.config_records[self.configrecord_key]),
                                                             **extra})
        self._acc["down"] = sum(recorddict_nbytes(m.content) for m in messages)
        self._acc["sent"] = len(messages)
        self.check_privacy_budget(server_round, [m.metadata.dst_node_id for m in messages])
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
            self._keep(arrays)
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
        raise FlowerOnlyError(f"{type(self).__name__} is a Flower built-in strategy and needs a Flower Grid: run it "
                              "with `flwr run` (simulation or deployment), not on the in-process driver")


class FlwrFedAvg(FlowerBuiltinMixin):
    """Flower's ``FedAvg`` (McMahan et al. 2017) with our records and local-SGD client; key ``flwr-fedavg``."""


class FlwrFedProx(FlowerBuiltinMixin, FedProx):
    """Flower's ``FedProx`` (Li et al. 2020) with our records; ``proximal_mu`` is Flower's argument."""
