"""What every family of the reproduction app shares: the federation, calibration and codecs of the run config,
the initial model and the central evaluation (:mod:`fedpdm_flower.fedapp.apps`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, Context, MetricRecord

from fedpdm_flower.fedapp.config import RunConfig
from fedpdm_flower.fedapp.layout import ArrayLayout
from fedpdm_flower.fedapp.sampling import STREAM_INIT, rng_for
from fedpdm_flower.fedapp.task import Evaluator, build_model

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.compression.sparsify import TopK
    from fedpdm_flower.fedapp.privacy.gaussian import Eq36Calibration, GaussianTarget
    from fedpdm_flower.fedapp.privacy.target import PrivacyTarget

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


# ---------------------------------------------------------------------------------------------- shared pieces
def federation(cfg: RunConfig) -> dict[str, Any]:
    """The federation of the run config: N = num-clients nodes with partition ids 0..N-1, K sampled per round."""
    return {
        "fraction_train": cfg.clients_per_round / cfg.num_clients, "min_train_nodes": cfg.clients_per_round,
        "min_available_nodes": cfg.num_clients, "first_round_all": cfg.first_round_all, "seed": cfg.seed,
        # partition ids are required when they are asked for; "node-order" numbers the nodes instead
        "require_partition_ids": cfg.identify_nodes == "ask", "identify_nodes": cfg.identify_nodes,
        "node_wait_s": cfg.node_wait_s, "eval_every": cfg.eval_every,
    }


def calibration(cfg: RunConfig) -> PrivacyTarget | GaussianTarget | Eq36Calibration | None:
    """The privacy of the dp / dp-calibration / epsilon-total / delta / clip-norm keys: record-level DP-SGD
    (dp-sample-rate; 0 = batch-size over the records of one client), the paper's noise at an exact GDP target, or
    the paper's own (36) (c0, privacy-q-power); None without DP."""
    from fedpdm_flower.fedapp.privacy.gaussian import Eq36Calibration, GaussianTarget
    from fedpdm_flower.fedapp.privacy.target import PrivacyTarget

    if not cfg.dp:
        return None
    if cfg.dp_calibration == "dpsgd":
        return PrivacyTarget(epsilon=cfg.epsilon_total, delta=cfg.delta, clip_norm=cfg.clip_norm,
                             sample_rate=dpsgd_sample_rate(cfg), horizon=cfg.privacy_horizon or None)
    if cfg.dp_calibration == "gdp":
        return GaussianTarget(epsilon=cfg.epsilon_total, delta=cfg.delta, clip_norm=cfg.clip_norm,
                              horizon=cfg.privacy_horizon or None)
    return Eq36Calibration(epsilon=cfg.epsilon_total, delta=cfg.delta, clip_norm=cfg.clip_norm, c0=cfg.c0,
                           q_power=cfg.privacy_q_power, horizon=cfg.privacy_horizon or None)


def dpsgd_sample_rate(cfg: RunConfig) -> float:
    """q of DP-SGD: ``dp-sample-rate``, or batch-size over the records of one client (``samples-per-client``, else the
    training set split evenly: the nominal size; a node whose data-path holds other counts gets expected batches
    of q times its own count)."""
    if cfg.dp_sample_rate > 0:
        return float(cfg.dp_sample_rate)
    from fedpdm_flower.fedapp.task import total_train_samples

    per_client = cfg.samples_per_client or total_train_samples(cfg) // cfg.num_clients
    return min(1.0, cfg.batch_size / max(1, per_client))


def codecs(cfg: RunConfig, sparse: bool) -> dict[str, TopK | None]:
    """uplink / downlink sparsifiers of the "-sparse" keys (alpha-up with uplink-sparsifier, alpha-down)."""
    from fedpdm_flower.fedapp.compression.sparsify import RandK, TopK

    if not sparse:
        return {"uplink": None, "downlink": None}
    up = TopK(cfg.alpha_up) if cfg.uplink_sparsifier == "topk" else RandK(cfg.alpha_up)
    return {"uplink": up, "downlink": TopK(cfg.alpha_down)}


def local_loop(cfg: RunConfig) -> dict[str, Any]:
    """eta0, Q cap and b of the broadcast algorithms."""
    return {"eta0": cfg.eta0, "max_local_steps": cfg.max_local_steps, "batch_size": cfg.batch_size}


def numpy_initial_model(cfg: RunConfig) -> ArrayRecord:
    """x_0^0 ~ N(0, init-std^2) i.i.d., seeded (spec A9), for the numpy models; float64 so the math is exact."""
    x0 = rng_for(cfg.seed, STREAM_INIT).normal(0.0, cfg.init_std, size=build_model(cfg).dim)
    return ArrayRecord([x0])


def evaluate_fn(cfg: RunConfig) -> EvaluateFn:
    """Central test-set evaluation (spec 6.5) as Flower's ``evaluate_fn``: test accuracy, loss and nnz."""
    evaluator = Evaluator(cfg)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        named = {k: v.numpy() for k, v in arrays.items()}
        ev = evaluator(ArrayLayout.of(named).flatten(named))
        return MetricRecord({"test_accuracy": ev.accuracy, "test_loss": ev.loss, "nnz": ev.nnz})

    return evaluate


def node_of(context: Context) -> tuple[int, int]:
    """(partition-id, num-partitions) of the node."""
    nc = context.node_config
    return int(nc["partition-id"]), int(nc["num-partitions"])


__all__ = [
    "calibration",
    "codecs",
    "dpsgd_sample_rate",
    "evaluate_fn",
    "federation",
    "local_loop",
    "node_of",
    "numpy_initial_model",
]
