"""Flower's own Byzantine-robust strategies on the FedREP experiment setup: keys ``flwr-krum``, ``flwr-fedmedian``,
``flwr-fedtrimmedavg`` (``flwr.serverapp.strategy.Krum`` / ``FedMedian`` / ``FedTrimmedAvg``, untouched).

Comparison baselines for FedREP (seed 003, spec shared/specs/fedrep.md): the same torch network, initial model w^0
(:func:`clients.fedrep.initial_weights`), data, local algorithm (I steps of momentum SGD, Eq. (180), momentum and
data cursor persisting on each client: :class:`clients.fedrep.FlowerDenseClient`), learning-rate schedule and
Byzantine clients (:func:`fedapp.attacks.byzantine_ids`) -- but one plain Flower ``train`` exchange per round, every
client's dense model in the clear, no buffers, no masking, no sparsification. All m = num-clients clients train
every round (fraction_train = 1, min_train_nodes = min_available_nodes = m; clients-per-round is ignored, as for
``fedrep``); federated evaluation is off, the server evaluates the torch model centrally.

How Flower's parameters map to the paper's
------------------------------------------
Flower aggregates the returned *models* w_k^{t+1}, FedREP its robust aggregator the *updates* w^t - w_k^{t+1}
with the server step w^{t+1} = w^t - Agg(updates) (Alg. 1). The three rules below are translation-equivariant
(Krum's pairwise distances, the coordinate-wise median and trimmed mean all commute with subtracting w^t), so
aggregating models *is* w^t - Agg(updates): the same server step, applied to individual clients (buffer size 1).

* ``flwr-krum``: Krum (Blanchard et al. 2017), ``num_malicious_nodes`` = byzantine-clients f; Flower scores each
  model by its squared distances to its n - f - 2 nearest others (at least 1) and takes the single best model.
  Krum's guarantee needs n > 2f + 2 (a warning otherwise). Flower computes the distances in float32 from the
  models through ||a||^2 + ||b||^2 - 2 a.b, so very close models may be ranked with some rounding noise.
* ``flwr-fedmedian``: coordinate-wise median (Yin et al. 2018, np.median: mean of the middle two for even n).
* ``flwr-fedtrimmedavg``: coordinate-wise trimmed mean (Yin et al. 2018); Flower's ``beta`` is the fraction cut
  from *each* side -- int(beta * n) smallest and as many largest values per coordinate -- exactly the meaning of
  our tmean-fraction (fedapp.robust.trimmed_mean, the paper's 7/16), so beta = tmean-fraction. Two differences:
  FedREP trims the m/s buffer means, this trims the m individual models; and Flower floors beta * n without our
  1e-9 guard (beta = 1/3, n = 3 trims 0 here, 1 in fedapp.robust). Flower requires beta in [0, 0.5), the range
  the run config already enforces; beta = 0 is the plain mean (= ``fedrep-fedavg``).

The metric records are Flower's num-examples weighted means (equal partitions: plain means).

Attacks
-------
bit-flip is applied by the Byzantine client itself (it returns w^t + (w^t - w_k)). ALIE and FoE are omniscient:
**SIMULATION ONLY**, :func:`forge_byzantine_replies` -- an oracle inside the server, which no real server would
run -- replaces the Byzantine clients' replies by w^t - forged_update, forged from every reply's update w^t - w_k
(:func:`fedapp.attacks.apply_value_attack`, the same vectors FedREP's plain-mode oracle uses), before Flower
aggregates. Replies are matched to partition ids by the "partition-id" the client reports in its metrics.

Like ``flwr-fedavg`` these need a Flower Grid (``flwr run``): the in-process driver raises FlowerOnlyError.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Krum

from clients.fedrep import initial_weights
from fedapp import attacks
from fedapp.algorithms.fedrep import learning_rate
from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.sampling import STREAM_INIT, rng_for
from fedapp.strategy_base import RoundBookkeeping
from fedapp.task import Evaluator, build_model, build_net
from fedapp.wire import recorddict_nbytes
from strategies.flower_builtin import FlowerOnlyError

#: the value attacks that need every client's vector: forged by the server-side simulation oracle
OMNISCIENT = ("alie", "foe")


def _partition_id(content: RecordDict) -> int | None:
    for rec in content.metric_records.values():
        pid = rec.get("partition-id")
        if isinstance(pid, int | float):
            return int(pid)
    return None


def forge_byzantine_replies(
    contents: Sequence[RecordDict], w: FloatArray, attack: str, byzantine: AbstractSet[int], *, eps: float,
    z: float | None,
) -> list[RecordDict]:
    """SIMULATION ONLY: the replies after the Byzantine clients' models were replaced by ALIE / FoE forgeries.

    Each reply's update is w^t - w_k (its first ArrayRecord, flattened, against ``w`` = w^t);
    :func:`fedapp.attacks.apply_value_attack` forges the Byzantine updates from the honest ones, and a Byzantine
    reply becomes a new RecordDict whose model is w^t - forged_update (float32, same array keys and shapes; its
    metrics unchanged). Honest replies are returned as the same objects, untouched. A reply without a
    "partition-id" metric cannot be identified: it is left out of the attack's statistics and kept as it is.

    Parameters
    ----------
    contents
        The reply contents (each an ArrayRecord with the client's model and a MetricRecord with "partition-id").
    w
        The global model w^t the clients started from (flat).
    attack
        "alie" or "foe" (any other value of :data:`fedapp.attacks.VALUE_ATTACKS` is passed on as well).
    byzantine
        Partition ids of the Byzantine clients.
    eps, z
        FoE magnitude and ALIE multiplier (None: :func:`fedapp.attacks.alie_z` of the replies present).

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
    updates: dict[int, FloatArray] = {}
    for i, content in enumerate(contents):
        pid = _partition_id(content)
        if pid is None:
            log(WARNING, "simulation oracle: a reply without 'partition-id' is left out of the %s attack", attack)
            continue
        if pid in where:
            raise ValueError(f"simulation oracle: two replies report partition-id {pid}")
        arrays = next(iter(content.array_records.values())).to_numpy_ndarrays()
        flat = np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])
        if flat.size != w64.size:
            raise ValueError(f"simulation oracle: partition {pid} sent {flat.size} parameters, expected {w64.size}")
        where[pid] = i
        updates[pid] = w64 - flat
    forged = attacks.apply_value_attack(attack, updates, set(byzantine) & set(updates), eps=eps, z=z)
    out = list(contents)
    for pid in sorted(set(byzantine) & set(updates)):
        i = where[pid]
        key, record = next(iter(out[i].array_records.items()))
        model = (w64 - forged[pid]).astype(np.float32)
        parts: dict[str, Array] = {}
        start = 0
        for name, arr in record.items():
            size = int(np.prod(arr.shape))
            parts[name] = Array(np.ascontiguousarray(model[start:start + size].reshape(arr.shape)))
            start += size
        new = RecordDict(dict(out[i].items()))
        new[key] = ArrayRecord(array_dict=parts)
        out[i] = new
    return out


_MEANS = ("Q", "train_loss", "sigma", "eps_round")


class CfgFlowerMixin(RoundBookkeeping, FedAvg):
    """TRANSITIONAL (until the FedREP family moves to the public layer): the run-config form of
    :class:`strategies.flower_builtin.FlowerBuiltinMixin`.

    The members our server app needs, around a Flower built-in strategy (FedAvg or a subclass).

    Put it first in the bases (``class X(CfgFlowerMixin, FedProx)``) so that its ``configure_train`` /
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
        self._acc = {"t0": time.perf_counter(), "up": 0, "down": 0}
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._acc["down"] = sum(recorddict_nbytes(m.content) for m in messages)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's aggregation, unchanged; counts uplink bytes, rejected replies and privacy, and keeps ``x``."""
        replies = list(replies)
        ok = [r for r in replies if not r.has_error()]
        self.rejected_total += len(replies) - len(ok)
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


class FedREPSetupMixin(CfgFlowerMixin):
    """:class:`CfgFlowerMixin` on the FedREP setup: w^0 of the torch network, all clients every round, the
    round's learning rate in the train config, and the simulation-only ALIE / FoE oracle around Flower's
    aggregation. Put it first in the bases (``class X(FedREPSetupMixin, Krum)``)."""

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None) -> None:
        self.byzantine = frozenset(attacks.byzantine_ids(cfg.num_clients, cfg.byzantine_clients, cfg.seed))
        super().__init__(cfg, evaluator)

    def initial_x(self) -> FloatArray:
        """w^0: the FedREP initialisation of the torch network (the same float32 values, as float64)."""
        return initial_weights(self.cfg, build_net(self.cfg)).astype(np.float64)

    def flower_kwargs(self) -> dict[str, Any]:
        m = self.cfg.num_clients
        return {"fraction_train": 1.0, "min_train_nodes": m, "min_available_nodes": m, "fraction_evaluate": 0.0}

    def summary(self) -> None:
        c = self.cfg
        log(INFO, "%s on the FedREP setup: m=%d model=%s lr=%g (x0.1 from round %d) momentum=%g I=%d B=%d "
            "byzantine=%s attack=%s", type(self).__name__, c.num_clients, c.model, c.lr, c.lr_decay_round,
            c.momentum, c.local_steps, c.batch_size, sorted(self.byzantine), c.attack)
        super().summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        """Flower's messages, with this round's eta_t (lr-decay-round applied) as "lr" in their config."""
        c = self.cfg
        config = ConfigRecord({**dict(config), "lr": learning_rate(c.lr, server_round, c.lr_decay_round)})
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """SIMULATION ONLY for ALIE / FoE: forge the Byzantine replies first; then Flower's aggregation."""
        replies = list(replies)
        c = self.cfg
        n_forged = 0
        ok = [r for r in replies if not r.has_error()]
        if c.attack in OMNISCIENT and self.byzantine and ok:  # no reply to forge from: the base stops the run
            z = attacks.alie_z(c.num_clients, c.byzantine_clients, c.alie_z) if c.attack == "alie" else None
            forged = forge_byzantine_replies([r.content for r in ok], self.x, c.attack, self.byzantine, eps=c.foe_eps, z=z)
            for msg, content in zip(ok, forged, strict=True):
                if content is not msg.content:
                    msg.content = content
                    n_forged += 1
        arrays, metrics = super().aggregate_train(server_round, replies)
        self._acc["diag"]["forged"] = float(n_forged)
        return arrays, metrics


class FlwrKrum(FedREPSetupMixin, Krum):
    """Flower's ``Krum`` (Blanchard et al. 2017), num_malicious_nodes = byzantine-clients; key ``flwr-krum``."""

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None) -> None:
        super().__init__(cfg, evaluator)
        m, f = cfg.num_clients, cfg.byzantine_clients
        if f and m <= 2 * f + 2:
            log(WARNING, "Krum with %d clients and %d Byzantine: its guarantee needs n > 2f + 2", m, f)

    def flower_kwargs(self) -> dict[str, Any]:
        return {**super().flower_kwargs(), "num_malicious_nodes": self.cfg.byzantine_clients}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's Krum; records the partition id of the selected model ("krum_selected" in the round's record:
        Krum's metrics are those of the single reply it selected)."""
        arrays, metrics = super().aggregate_train(server_round, replies)
        pid = None if metrics is None else metrics.get("partition-id")
        if isinstance(pid, int | float):
            self._acc["diag"]["krum_selected"] = float(pid)
        return arrays, metrics


class FlwrFedMedian(FedREPSetupMixin, FedMedian):
    """Flower's ``FedMedian`` (coordinate-wise median, Yin et al. 2018); key ``flwr-fedmedian``."""


class FlwrFedTrimmedAvg(FedREPSetupMixin, FedTrimmedAvg):
    """Flower's ``FedTrimmedAvg`` (coordinate-wise trimmed mean, Yin et al. 2018), beta = tmean-fraction (the
    fraction cut from each side); key ``flwr-fedtrimmedavg``."""

    def flower_kwargs(self) -> dict[str, Any]:
        return {**super().flower_kwargs(), "beta": self.cfg.tmean_fraction}
