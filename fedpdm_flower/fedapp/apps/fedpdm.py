"""Seed 000 family (DP-FedPDM / BSDP-FedPDM and the FedAvg-family baselines): run-config keys -> constructors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, Context

from fedpdm_flower.fedapp.apps.common import calibration, codecs, federation, local_loop
from fedpdm_flower.fedapp.config import RunConfig
from fedpdm_flower.fedapp.task import build_model, build_net, is_torch_model, node_dataset

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
    from fedpdm_flower.fedapp.config import ConfigError
    from fedpdm_flower.fedapp.privacy.target import PrivacyTarget
    from fedpdm_flower.strategies.flower_builtin import FlwrFedAvg, FlwrFedProx

    if isinstance(calibration(cfg), PrivacyTarget):
        raise ConfigError(f"run config key 'dp-calibration' = 'dpsgd' is not offered for {cfg.algorithm} (Flower's own "
                          "strategy sends no DP-SGD mechanism): use algorithm 'fedavg' (ours, same local loop), or "
                          "DeviceDPSGD in your own ClientApp under Flower's FedAvg")
    kw: dict[str, Any] = {
        **local_loop(cfg), "gamma": cfg.gamma, "privacy": calibration(cfg), "eval_every": cfg.eval_every,
        "fraction_train": cfg.clients_per_round / cfg.num_clients, "min_train_nodes": cfg.clients_per_round,
        "min_available_nodes": cfg.num_clients,
    }
    if cfg.algorithm == "flwr-fedprox":
        return FlwrFedProx(proximal_mu=cfg.mu, **kw)
    return FlwrFedAvg(**kw)


def broadcast_client(cfg: RunConfig, context: Context) -> FedClient:
    """The client of a seed-000 key: the run's model (a numpy linear model, or a network of the torch zoo) on the
    node's data (its ``data-path`` files, else its partition), the run seed (which DP-SGD's sampling and noise never
    use: they come from the device's own entropy)."""
    from fedpdm_flower.clients.fedavg import FedAvgClient
    from fedpdm_flower.clients.feddyn import FedDynClient
    from fedpdm_flower.clients.fedpdm import FedPDMClient
    from fedpdm_flower.clients.scaffold import ScaffoldClient

    data, info = node_dataset(cfg, context.node_config)
    base = cfg.algorithm.removesuffix("-sparse").removeprefix("flwr-")
    cls: type[FedClient] = {"dp-fedpdm": FedPDMClient, "bsdp-fedpdm": FedPDMClient, "fedavg": FedAvgClient,
                            "fedprox": FedAvgClient, "scaffold": ScaffoldClient, "feddyn": FedDynClient}[base]
    model: Any = build_net(cfg, info) if is_torch_model(cfg) else build_model(cfg, info)
    return cls(model, data, context=context, seed=cfg.seed)


def broadcast_initial(cfg: RunConfig) -> ArrayRecord:
    """x_0^0: N(0, init-std^2) i.i.d. for a numpy model (spec A9); for a torch network its state dict after torch's
    default initialisation seeded with the run seed (float32)."""
    from fedpdm_flower.fedapp.apps.common import numpy_initial_model

    if not is_torch_model(cfg):
        return numpy_initial_model(cfg)
    from fedpdm_flower.fedapp.apps.fedrep import fedrep_initial

    return fedrep_initial(cfg)



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


__all__ = ["broadcast_client", "broadcast_initial", "broadcast_strategy", "flower_builtin_strategy", "validate_config"]
