"""Flower's own Byzantine-robust strategies driving FedREP's local algorithm: ``flwr.serverapp.strategy.Krum`` /
``FedMedian`` / ``FedTrimmedAvg``, untouched, with :class:`fedpdm_flower.clients.fedrep.MomentumSGDClient` (keys ``flwr-krum``,
``flwr-fedmedian``, ``flwr-fedtrimmedavg``).

Comparison baselines for FedREP (seed 003, spec shared/specs/fedrep.md): the same local algorithm (I steps of
momentum SGD, Eq. (180), momentum and data cursor persisting on each client) and learning-rate schedule -- but one
plain Flower ``train`` exchange per round, every client's dense model in the clear, no buffers, no masking, no
sparsification. :class:`fedpdm_flower.strategies.flower_builtin.FlowerBuiltinMixin` adds our per-round records; the local
algorithm's settings travel in each message's config (:meth:`FedREPLocalMixin.local_config`). Federated
evaluation is off, the server evaluates centrally (``evaluate_fn``).

How Flower's parameters map to the paper's
------------------------------------------
Flower aggregates the returned *models* w_k^{t+1}, FedREP its robust aggregator the *updates* w^t - w_k^{t+1}
with the server step w^{t+1} = w^t - Agg(updates) (Alg. 1). The three rules below are translation-equivariant
(Krum's pairwise distances, the coordinate-wise median and trimmed mean all commute with subtracting w^t), so
aggregating models *is* w^t - Agg(updates): the same server step, applied to individual clients (buffer size 1).

* :class:`FlwrKrum`: Krum (Blanchard et al. 2017), Flower's ``num_malicious_nodes`` = f; Flower scores each model
  by its squared distances to its n - f - 2 nearest others (at least 1) and takes the single best model. Krum's
  guarantee needs n > 2f + 2. Flower computes the distances in float32 from the models through
  ||a||^2 + ||b||^2 - 2 a.b, so very close models may be ranked with some rounding noise.
* :class:`FlwrFedMedian`: coordinate-wise median (Yin et al. 2018, np.median: mean of the middle two for even n).
* :class:`FlwrFedTrimmedAvg`: coordinate-wise trimmed mean (Yin et al. 2018); Flower's ``beta`` is the fraction
  cut from *each* side -- int(beta * n) smallest and as many largest values per coordinate -- the meaning of
  :class:`fedpdm_flower.fedapp.robust.TrimmedMean`'s trim_fraction (the paper's 7/16). Two differences: FedREP trims the m/s
  buffer means, this trims the m individual models; and Flower floors beta * n without our 1e-9 guard (beta = 1/3,
  n = 3 trims 0 here, 1 in fedpdm_flower.fedapp.robust). Flower requires beta in [0, 0.5); beta = 0 is the plain mean.

The metric records are Flower's num-examples weighted means (equal partitions: plain means).

Attacks (simulation only)
-------------------------
bit-flip is applied by a Byzantine client itself (``MomentumSGDClient(..., attack=ClientAttack("bit-flip"))``
returns w^t + (w^t - w_k)). ALIE and FoE are omniscient: an :class:`fedpdm_flower.fedapp.attacks.OmniscientOracle` given as
``oracle`` -- which no real server would run -- replaces the Byzantine clients' replies by w^t - forged_update,
forged from every reply's update w^t - w_k (:func:`forge_byzantine_replies`), before Flower aggregates. Replies
are matched to client ids by the "partition-id" the client reports in its metrics.

These need a Flower Grid (``flwr run``): the in-process driver raises FlowerOnlyError.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Krum

from fedpdm_flower.fedapp.algorithms.fedrep import learning_rate
from fedpdm_flower.fedapp.layout import ArrayLayout
from fedpdm_flower.strategies.base import arrays_of, record_of
from fedpdm_flower.strategies.flower_builtin import FlowerBuiltinMixin

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.attacks import OmniscientOracle

__all__ = ["FedREPLocalMixin", "FlwrFedMedian", "FlwrFedTrimmedAvg", "FlwrKrum", "forge_byzantine_replies"]


def _partition_id(content: RecordDict) -> int | None:
    for rec in content.metric_records.values():
        pid = rec.get("partition-id")
        if isinstance(pid, int | float):
            return int(pid)
    return None


def forge_byzantine_replies(contents: Sequence[RecordDict], w: Any, oracle: OmniscientOracle) -> list[RecordDict]:
    """SIMULATION ONLY: the replies after the oracle replaced the Byzantine clients' models (ALIE / FoE).

    Each reply's update is w^t - w_k (its first ArrayRecord, flattened by its own layout, against ``w`` = w^t);
    ``oracle.forge_values`` forges the Byzantine updates from the honest ones, and a Byzantine reply becomes a new
    RecordDict whose model is w^t - forged_update (same array keys, shapes and dtypes; integer entries and metrics
    unchanged). Honest replies are returned as the same objects, untouched. A reply without a "partition-id"
    metric cannot be identified: it is left out of the attack's statistics and kept as it is.

    Parameters
    ----------
    contents
        The reply contents (each an ArrayRecord with the client's model and a MetricRecord with "partition-id").
    w
        The global model w^t the clients started from (flat float vector in the replies' layout).
    oracle
        The simulation's :class:`fedpdm_flower.fedapp.attacks.OmniscientOracle` (its Byzantine ids, attack, z and eps).

    Returns
    -------
    list[RecordDict]
        The contents in the input order.

    Raises
    ------
    ValueError
        If two replies report the same partition id, or a model does not have ``len(w)`` parameters.
    """
    w64 = np.asarray(w, dtype=np.float64).reshape(-1)
    where: dict[int, int] = {}
    updates: dict[int, np.ndarray[Any, Any]] = {}
    named: dict[int, dict[str, np.ndarray[Any, Any]]] = {}
    for i, content in enumerate(contents):
        pid = _partition_id(content)
        if pid is None:
            log(WARNING, "simulation oracle: a reply without 'partition-id' is left out of the %s attack", oracle.values)
            continue
        if pid in where:
            raise ValueError(f"simulation oracle: two replies report partition-id {pid}")
        arrays = arrays_of(next(iter(content.array_records.values())))
        flat = ArrayLayout.of(arrays).flatten(arrays)
        if flat.size != w64.size:
            raise ValueError(f"simulation oracle: partition {pid} sent {flat.size} parameters, expected {w64.size}")
        where[pid], updates[pid], named[pid] = i, w64 - flat, arrays
    forged = oracle.forge_values(updates)
    out = list(contents)
    for pid in sorted(oracle.byzantine & set(updates)):
        i = where[pid]
        key = next(iter(out[i].array_records))
        layout = ArrayLayout.of(named[pid])
        new = RecordDict(dict(out[i].items()))
        new[key] = record_of(layout.unflatten((w64 - forged[pid]).astype(np.float32), named[pid]))
        out[i] = new
    return out


class FedREPLocalMixin(FlowerBuiltinMixin):
    """A Flower built-in strategy driving FedREP's local algorithm (:class:`fedpdm_flower.clients.fedrep.MomentumSGDClient`).

    Put it first in the bases (``class X(FedREPLocalMixin, Krum)``). Every connected client trains every round by
    default (``fraction_train=1``), as in FedREP.

    Parameters
    ----------
    eta0
        eta of Eq. (180) (default 0.5, the paper's FedREP lr, Fig. 7).
    eta0_decay_round
        Round from which eta is multiplied by ``eta0_decay_factor`` (spec 3.3); None (default) never.
    eta0_decay_factor
        Default 0.1 (spec 3.3).
    momentum
        beta of Eq. (180) (default 0.9, Sec. 5).
    local_steps
        I (default 1).
    batch_size
        B (default 25, Sec. 5); None uses each client's DataLoader batch size.
    oracle
        SIMULATION ONLY: :class:`fedpdm_flower.fedapp.attacks.OmniscientOracle` forging the Byzantine replies (ALIE / FoE)
        before Flower aggregates. Default None.
    eval_every
        Central evaluation every this many rounds (default 1).
    **flower
        The Flower strategy's own arguments (fraction_train, min_train_nodes, min_available_nodes, ...;
        num_malicious_nodes for Krum, beta for FedTrimmedAvg). fraction_evaluate defaults to 0.
    """

    def __init__(self, *, eta0: float = 0.5, eta0_decay_round: int | None = None, eta0_decay_factor: float = 0.1,
                 momentum: float = 0.9, local_steps: int = 1, batch_size: int | None = 25,
                 oracle: OmniscientOracle | None = None, eval_every: int = 1, **flower: Any) -> None:
        for name, v in (("eta0", eta0), ("eta0_decay_factor", eta0_decay_factor)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name, n in (("eta0_decay_round", eta0_decay_round), ("local_steps", local_steps), ("batch_size", batch_size)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum!r}")
        if oracle is not None and not callable(getattr(oracle, "forge_values", None)):
            raise TypeError(f"oracle must be a fedpdm_flower.fedapp.attacks.OmniscientOracle, got {type(oracle).__name__}")
        super().__init__(eval_every=eval_every, **{"fraction_train": 1.0, **flower})
        self.eta0, self.eta0_decay_round, self.eta0_decay_factor = float(eta0), eta0_decay_round, float(eta0_decay_factor)
        self.momentum, self.local_steps, self.batch_size = float(momentum), local_steps, batch_size
        self.oracle = oracle

    def summary(self) -> None:
        log(INFO, "%s (Flower built-in) with FedREP's local algorithm: eta0=%g (x%g from round %s) momentum=%g I=%d "
            "B=%s%s", type(self).__name__, self.eta0, self.eta0_decay_factor, self.eta0_decay_round, self.momentum,
            self.local_steps, self.batch_size, f" oracle (simulation only)={self.oracle}" if self.oracle else "")
        FedAvg.summary(self)

    def local_config(self, server_round: int, participation: float) -> dict[str, Any]:
        """The settings :class:`fedpdm_flower.clients.fedrep.MomentumSGDClient` reads: eta_t (spec 3.3), beta, I and B."""
        cfg: dict[str, Any] = {
            "lr": learning_rate(self.eta0, server_round, self.eta0_decay_round or 0, self.eta0_decay_factor),
            "momentum": self.momentum, "local-steps": self.local_steps,
        }
        if self.batch_size is not None:
            cfg["batch-size"] = self.batch_size
        return cfg

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """SIMULATION ONLY with an oracle: forge the Byzantine replies first; then Flower's aggregation."""
        replies = list(replies)
        n_forged = 0
        ok = [r for r in replies if not r.has_error()]
        if self.oracle is not None and self.oracle.values != "none" and ok:  # nothing to forge from: the base stops
            forged = forge_byzantine_replies([r.content for r in ok], self.x, self.oracle)
            for msg, content in zip(ok, forged, strict=True):
                if content is not msg.content:
                    msg.content = content
                    n_forged += 1
        arrays, metrics = super().aggregate_train(server_round, replies)
        self._acc["diag"]["forged"] = float(n_forged)
        return arrays, metrics


class FlwrKrum(FedREPLocalMixin, Krum):
    """Flower's ``Krum`` (Blanchard et al. 2017) with FedREP's local algorithm; key ``flwr-krum``.

    Parameters are :class:`FedREPLocalMixin`'s and Flower's ``Krum``'s (``num_malicious_nodes`` = f, default 0).
    """

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's Krum; records the partition id of the selected model ("krum_selected" in the round's record:
        Krum's metrics are those of the single reply it selected)."""
        arrays, metrics = super().aggregate_train(server_round, replies)
        pid = None if metrics is None else metrics.get("partition-id")
        if isinstance(pid, int | float):
            self._acc["diag"]["krum_selected"] = float(pid)
        return arrays, metrics


class FlwrFedMedian(FedREPLocalMixin, FedMedian):
    """Flower's ``FedMedian`` (coordinate-wise median, Yin et al. 2018) with FedREP's local algorithm; key
    ``flwr-fedmedian``. Parameters are :class:`FedREPLocalMixin`'s and Flower's."""


class FlwrFedTrimmedAvg(FedREPLocalMixin, FedTrimmedAvg):
    """Flower's ``FedTrimmedAvg`` (coordinate-wise trimmed mean, Yin et al. 2018) with FedREP's local algorithm;
    ``beta`` is Flower's fraction cut from each side (default 0.2); key ``flwr-fedtrimmedavg``. Parameters are
    :class:`FedREPLocalMixin`'s and Flower's."""
