"""Run-config keys -> the public constructors: the reproduction app is a thin user of the public layer.

Every algorithm key of :mod:`fedapp.registry` builds its strategy and its client here, with the same keyword
constructors a Flower user calls (``strategies.*`` / ``clients.*``), the model zoo and dataset registry of
:mod:`fedapp.task`, and the run config's seed as the devices' seed (so that runs repeat bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, Context, MetricRecord

from fedapp.config import RunConfig
from fedapp.layout import ArrayLayout
from fedapp.sampling import STREAM_INIT, rng_for
from fedapp.task import Evaluator, build_model, client_dataset

if TYPE_CHECKING:
    from clients.base import FedClient
    from fedapp.compression.sparsify import TopK
    from fedapp.privacy.gaussian import Eq36Calibration
    from strategies.base import FederatedStrategy

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


# ---------------------------------------------------------------------------------------------- shared pieces
def federation(cfg: RunConfig) -> dict[str, Any]:
    """The federation of the run config: N = num-clients nodes with partition ids 0..N-1, K sampled per round."""
    return {
        "fraction_train": cfg.clients_per_round / cfg.num_clients, "min_train_nodes": cfg.clients_per_round,
        "min_available_nodes": cfg.num_clients, "first_round_all": cfg.first_round_all, "seed": cfg.seed,
        "require_partition_ids": True, "node_wait_s": cfg.node_wait_s, "eval_every": cfg.eval_every,
    }


def eq36(cfg: RunConfig) -> Eq36Calibration | None:
    """The paper's calibration (36) from the dp / epsilon-total / delta / clip-norm / c0 keys, or None."""
    from fedapp.privacy.gaussian import Eq36Calibration

    if not cfg.dp:
        return None
    return Eq36Calibration(epsilon=cfg.epsilon_total, delta=cfg.delta, clip_norm=cfg.clip_norm, c0=cfg.c0,
                           q_power=cfg.privacy_q_power, horizon=cfg.privacy_horizon or None)


def codecs(cfg: RunConfig, sparse: bool) -> dict[str, TopK | None]:
    """uplink / downlink sparsifiers of the "-sparse" keys (alpha-up with uplink-sparsifier, alpha-down)."""
    from fedapp.compression.sparsify import RandK, TopK

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


def _node(context: Context) -> tuple[int, int]:
    nc = context.node_config
    return int(nc["partition-id"]), int(nc["num-partitions"])


# ---------------------------------------------------------------------------------------------- seed 000 family
def broadcast_strategy(cfg: RunConfig) -> FederatedStrategy:
    """DP-FedPDM / BSDP-FedPDM and the FedAvg-family baselines (dense and "-sparse" keys)."""
    from strategies.fedavg import FedAvg, FedProx
    from strategies.feddyn import FedDyn
    from strategies.fedpdm import DPFedPDM
    from strategies.scaffold import Scaffold

    alg = cfg.algorithm
    common: dict[str, Any] = {**federation(cfg), **local_loop(cfg), "privacy": eq36(cfg),
                              **codecs(cfg, alg.endswith("-sparse") or alg == "bsdp-fedpdm")}
    base = alg.removesuffix("-sparse")
    if base in ("dp-fedpdm", "bsdp-fedpdm"):
        return DPFedPDM(rho=cfg.rho, gamma=cfg.gamma, nu=cfg.nu, **common)
    if base == "fedavg":
        return FedAvg(gamma=cfg.gamma, **common)
    if base == "fedprox":
        return FedProx(gamma=cfg.gamma, mu=cfg.mu, **common)
    if base == "scaffold":
        return Scaffold(gamma=cfg.gamma, **common)
    if base == "feddyn":
        return FedDyn(gamma=cfg.gamma, alpha=cfg.feddyn_alpha, **common)
    raise KeyError(f"no broadcast strategy for algorithm {alg!r}")


def flower_builtin_strategy(cfg: RunConfig) -> Any:
    """Flower's own FedAvg / FedProx with our local-SGD client (keys flwr-fedavg, flwr-fedprox)."""
    from strategies.flower_builtin import FlwrFedAvg, FlwrFedProx

    kw: dict[str, Any] = {
        **local_loop(cfg), "gamma": cfg.gamma, "privacy": eq36(cfg), "eval_every": cfg.eval_every,
        "fraction_train": cfg.clients_per_round / cfg.num_clients, "min_train_nodes": cfg.clients_per_round,
        "min_available_nodes": cfg.num_clients,
    }
    if cfg.algorithm == "flwr-fedprox":
        return FlwrFedProx(proximal_mu=cfg.mu, **kw)
    return FlwrFedAvg(**kw)


def broadcast_client(cfg: RunConfig, context: Context) -> FedClient:
    """The client of a seed-000 key: the run's numpy model on the node's partition, the run seed."""
    from clients.fedavg import FedAvgClient
    from clients.feddyn import FedDynClient
    from clients.fedpdm import FedPDMClient
    from clients.scaffold import ScaffoldClient

    pid, parts = _node(context)
    base = cfg.algorithm.removesuffix("-sparse").removeprefix("flwr-")
    cls: type[FedClient] = {"dp-fedpdm": FedPDMClient, "bsdp-fedpdm": FedPDMClient, "fedavg": FedAvgClient,
                            "fedprox": FedAvgClient, "scaffold": ScaffoldClient, "feddyn": FedDynClient}[base]
    return cls(build_model(cfg), client_dataset(cfg, pid, parts), context=context, seed=cfg.seed)


__all__ = [
    "broadcast_client",
    "broadcast_strategy",
    "codecs",
    "eq36",
    "evaluate_fn",
    "federation",
    "flower_builtin_strategy",
    "local_loop",
    "numpy_initial_model",
]
