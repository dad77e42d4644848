"""Seed 000 family (DP-FedPDM / BSDP-FedPDM and the FedAvg-family baselines): run-config keys -> constructors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flwr.app import Context

from fedpdm_flower.fedapp.apps.common import calibration, codecs, federation, local_loop
from fedpdm_flower.fedapp.config import RunConfig
from fedpdm_flower.fedapp.task import build_model, node_dataset

if TYPE_CHECKING:
    from fedpdm_flower.clients.base import FedClient
    from fedpdm_flower.strategies.base import FederatedStrategy


def broadcast_strategy(cfg: RunConfig) -> FederatedStrategy:
    """DP-FedPDM / BSDP-FedPDM and the FedAvg-family baselines (dense and "-sparse" keys)."""
    from fedpdm_flower.strategies.fedavg import FedAvg, FedProx
    from fedpdm_flower.strategies.feddyn import FedDyn
    from fedpdm_flower.strategies.fedpdm import DPFedPDM
    from fedpdm_flower.strategies.scaffold import Scaffold

    alg = cfg.algorithm
    common: dict[str, Any] = {**federation(cfg), **local_loop(cfg), "privacy": calibration(cfg),
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
    from fedpdm_flower.strategies.flower_builtin import FlwrFedAvg, FlwrFedProx

    kw: dict[str, Any] = {
        **local_loop(cfg), "gamma": cfg.gamma, "privacy": calibration(cfg), "eval_every": cfg.eval_every,
        "fraction_train": cfg.clients_per_round / cfg.num_clients, "min_train_nodes": cfg.clients_per_round,
        "min_available_nodes": cfg.num_clients,
    }
    if cfg.algorithm == "flwr-fedprox":
        return FlwrFedProx(proximal_mu=cfg.mu, **kw)
    return FlwrFedAvg(**kw)


def broadcast_client(cfg: RunConfig, context: Context) -> FedClient:
    """The client of a seed-000 key: the run's numpy model on the node's data (its ``data-path`` files, else its
    partition), the run seed."""
    from fedpdm_flower.clients.fedavg import FedAvgClient
    from fedpdm_flower.clients.feddyn import FedDynClient
    from fedpdm_flower.clients.fedpdm import FedPDMClient
    from fedpdm_flower.clients.scaffold import ScaffoldClient

    data, info = node_dataset(cfg, context.node_config)
    base = cfg.algorithm.removesuffix("-sparse").removeprefix("flwr-")
    cls: type[FedClient] = {"dp-fedpdm": FedPDMClient, "bsdp-fedpdm": FedPDMClient, "fedavg": FedAvgClient,
                            "fedprox": FedAvgClient, "scaffold": ScaffoldClient, "feddyn": FedDynClient}[base]
    return cls(build_model(cfg, info), data, context=context, seed=cfg.seed)



def validate_config(cfg: RunConfig) -> None:
    """DP-FedPDM / BSDP-FedPDM run-config rules (raise ConfigError naming the key), checked before any round.

    The server's prox (12) soft-thresholds the mean of the uploads at gamma/rho. The uploads are float32 on the
    wire, so their mean is at most FLOAT32_MAX in magnitude: a threshold at or beyond it (or one that overflows,
    e.g. rho = 1e-300 with a large gamma) sets every coordinate to 0 in every round, and the model never moves.
    """
    from fedpdm_flower.fedapp.compression.codec import FLOAT32_MAX
    from fedpdm_flower.fedapp.config import ConfigError

    if cfg.gamma > 0 and not cfg.gamma / cfg.rho < FLOAT32_MAX:
        raise ConfigError(
            f"run config key 'rho' ({cfg.rho:g}) with 'gamma' ({cfg.gamma:g}) makes the l1 prox threshold gamma/rho = "
            f"{cfg.gamma / cfg.rho:.3g}, beyond the float32 range of the uploads ({FLOAT32_MAX:.3g}): the prox (12) "
            "would set every coordinate to 0 in every round; raise rho or lower gamma"
        )


__all__ = ["broadcast_client", "broadcast_strategy", "flower_builtin_strategy", "validate_config"]
