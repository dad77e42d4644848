"""Seed 003 family: FedREP, SHARE, dense FedAvg and SparseSecAgg, and Flower's Krum / FedMedian / FedTrimmedAvg on
the same clients -- run-config keys -> the public constructors (:mod:`strategies.fedrep`,
:mod:`strategies.flower_robust`, :mod:`clients.fedrep`).

What only the reproduction knows lives here: the zoo network and the node's partition, the run's w^0 (torch's
default initialisation seeded with the run seed, built identically on the server and on every client, hence
``clients_hold_initial=True``), the Byzantine clients of a simulation (:func:`fedapp.attacks.byzantine_ids` of the
run seed, built with an explicit simulation-only attack) and the run-config rules checked before any round.
"""

from __future__ import annotations

import math
from logging import WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.common.logger import log
from numpy.typing import NDArray

from fedapp.apps.common import node_of
from fedapp.config import ConfigError, RunConfig
from fedapp.sampling import STREAM_INIT, rng_for
from fedapp.task import build_net, client_dataset

if TYPE_CHECKING:
    from clients.fedrep import FedREPClient, MomentumSGDClient
    from fedapp.attacks import ClientAttack, OmniscientOracle
    from fedapp.models.torch_net import TorchNet
    from fedapp.robust import Aggregator
    from strategies.fedrep import FedREP
    from strategies.flower_robust import FedREPLocalMixin

__all__ = [
    "fedrep_client",
    "fedrep_initial",
    "fedrep_strategy",
    "flower_robust_client",
    "flower_robust_strategy",
    "initial_weights",
    "validate_config",
    "validate_flower_robust",
]


# ---------------------------------------------------------------------------------------------- w^0 and the model
def initial_weights(cfg: RunConfig, net: TorchNet) -> NDArray[np.float32]:
    """w^0: torch's default initialisation seeded with the run seed (``net`` now holds it, as float32)."""
    return net.init(rng_for(cfg.seed, STREAM_INIT)).astype(np.float32)


def _net_at_w0(cfg: RunConfig) -> TorchNet:
    net = build_net(cfg)
    initial_weights(cfg, net)
    return net


def fedrep_initial(cfg: RunConfig) -> ArrayRecord:
    """The initial ArrayRecord: the zoo network's state dict at w^0 (float32; integer buffers as they are)."""
    from strategies.base import record_of

    return record_of(_net_at_w0(cfg).state_arrays())


# ---------------------------------------------------------------------------------------------- simulation only
def byzantine(cfg: RunConfig) -> set[int]:
    """The Byzantine partition ids of the run (drawn from the run seed; empty without byzantine-clients)."""
    from fedapp.attacks import byzantine_ids

    return set(byzantine_ids(cfg.num_clients, cfg.byzantine_clients, cfg.seed))


def oracle(cfg: RunConfig) -> OmniscientOracle | None:
    """SIMULATION ONLY: the server-side oracle of attack = alie / foe and coord-attack = same, or None."""
    values = cfg.attack if cfg.attack in ("alie", "foe") else "none"
    coordinates = "same" if cfg.coord_attack == "same" else "none"
    if not cfg.byzantine_clients or (values, coordinates) == ("none", "none"):
        return None
    from fedapp.attacks import OmniscientOracle, alie_z

    z = alie_z(cfg.num_clients, cfg.byzantine_clients, cfg.alie_z) if values == "alie" else None
    return OmniscientOracle(byzantine=frozenset(byzantine(cfg)), values=values, coordinates=coordinates, z=z,
                            eps=cfg.foe_eps)


def client_attack(cfg: RunConfig, partition_id: int) -> ClientAttack | None:
    """SIMULATION ONLY: the attack of a Byzantine client (bit-flip, min / rand proposals), None for the others."""
    values = "bit-flip" if cfg.attack == "bit-flip" else "none"
    coordinates = cfg.coord_attack if cfg.coord_attack in ("min", "rand") else "none"
    if (values, coordinates) == ("none", "none") or partition_id not in byzantine(cfg):
        return None
    from fedapp.attacks import ClientAttack

    return ClientAttack(values=values, coordinates=coordinates)


# ---------------------------------------------------------------------------------------------- builders
def local_algorithm(cfg: RunConfig) -> dict[str, Any]:
    """Eq. (180) and its schedule: lr, lr-decay-round (0 = never), momentum, local-steps, batch-size."""
    return {"lr": cfg.lr, "lr_decay_round": cfg.lr_decay_round or None, "momentum": cfg.momentum,
            "local_steps": cfg.local_steps, "batch_size": cfg.batch_size}


def aggregator(cfg: RunConfig) -> Aggregator:
    """The robust aggregator of the aggregator key with its geomed-iters / tmean-fraction / cclip-* settings."""
    from fedapp.robust import CenteredClipping, GeometricMedian, Mean, TrimmedMean

    if cfg.aggregator == "geomed":
        return GeometricMedian(iters=cfg.geomed_iters)
    if cfg.aggregator == "tmean":
        return TrimmedMean(trim_fraction=cfg.tmean_fraction)
    if cfg.aggregator == "cclip":
        return CenteredClipping(tau=cfg.cclip_tau, iters=cfg.cclip_iters)
    return Mean()


def fedrep_strategy(cfg: RunConfig) -> FedREP:
    """fedrep / share / fedrep-fedavg / sparse-secagg: all m = num-clients clients every round, partition ids."""
    from fedapp.compression.conspar import ConSpar
    from strategies.fedrep import SHARE, DenseFedAvg, FedREP, SparseSecAgg

    m = cfg.num_clients
    common: dict[str, Any] = {
        "min_available_nodes": m, "min_train_nodes": m, "seed": cfg.seed, "require_partition_ids": True,
        "node_wait_s": cfg.node_wait_s, "eval_every": cfg.eval_every, "sparse_downlink": cfg.sparse_downlink,
        "clients_hold_initial": True, **local_algorithm(cfg),
    }
    if cfg.algorithm == "sparse-secagg":
        return SparseSecAgg(gamma=min(cfg.conspar_fraction, 1.0), scale=cfg.sparsesecagg_scale, **common)
    if cfg.algorithm == "fedrep-fedavg":
        return DenseFedAvg(oracle=oracle(cfg), **common)
    f, s = cfg.byzantine_clients, cfg.buffer_size
    if f and f >= math.ceil(m / (2 * s)):
        log(WARNING, "%d Byzantine clients can contaminate half of the %d buffers: no robust aggregator can hold "
            "(spec 3.1 needs f < m/(2s))", f, m // s)
    kw: dict[str, Any] = {"buffer_size": s, "masked": cfg.secagg_mode == "masked", "aggregator": aggregator(cfg),
                          "oracle": oracle(cfg), **common}
    if cfg.algorithm == "share":
        return SHARE(**kw)
    return FedREP(conspar=ConSpar(fraction=cfg.conspar_fraction, alpha=cfg.conspar_alpha), **kw)


def fedrep_client(cfg: RunConfig, context: Context) -> FedREPClient:
    """The node's FedREP client: the zoo network at w^0, the node's partition, the run seed, its attack if any."""
    from clients.fedrep import FedREPClient

    pid, parts = node_of(context)
    return FedREPClient(_net_at_w0(cfg), client_dataset(cfg, pid, parts), context=context, seed=cfg.seed,
                        attack=client_attack(cfg, pid))


def flower_robust_strategy(cfg: RunConfig) -> FedREPLocalMixin:
    """flwr-krum / flwr-fedmedian / flwr-fedtrimmedavg: Flower's rule over all m clients' models, every round."""
    from strategies.flower_robust import FlwrFedMedian, FlwrFedTrimmedAvg, FlwrKrum

    m, f = cfg.num_clients, cfg.byzantine_clients
    kw: dict[str, Any] = {"fraction_train": 1.0, "min_train_nodes": m, "min_available_nodes": m,
                          "eval_every": cfg.eval_every, "oracle": oracle(cfg), **local_algorithm(cfg)}
    if cfg.algorithm == "flwr-krum":
        if f and m <= 2 * f + 2:
            log(WARNING, "Krum with %d clients and %d Byzantine: its guarantee needs n > 2f + 2", m, f)
        return FlwrKrum(num_malicious_nodes=f, **kw)
    if cfg.algorithm == "flwr-fedtrimmedavg":
        return FlwrFedTrimmedAvg(beta=cfg.tmean_fraction, **kw)
    return FlwrFedMedian(**kw)


def flower_robust_client(cfg: RunConfig, context: Context) -> MomentumSGDClient:
    """The node's Eq. (180) client for Flower's plain train messages (its attack if it is Byzantine)."""
    from clients.fedrep import MomentumSGDClient

    pid, parts = node_of(context)
    return MomentumSGDClient(build_net(cfg), client_dataset(cfg, pid, parts), context=context, seed=cfg.seed,
                             attack=client_attack(cfg, pid))


# ---------------------------------------------------------------------------------------------- run-config rules
def _check_torch_setup(cfg: RunConfig) -> None:
    """Rules every FedREP-setup algorithm shares: a torch network, fewer Byzantine clients than clients."""
    from fedapp.models.torch_net import TORCH_MODELS

    if cfg.model not in TORCH_MODELS:
        raise ConfigError(f"run config key 'model' is {cfg.model!r}; {cfg.algorithm} trains a torch network: "
                          f"one of {', '.join(TORCH_MODELS)}")
    if cfg.byzantine_clients >= cfg.num_clients:
        raise ConfigError(f"run config key 'byzantine-clients' ({cfg.byzantine_clients}) must be below "
                          f"'num-clients' ({cfg.num_clients})")


def validate_config(cfg: RunConfig) -> None:
    """FedREP's own run-config rules (raise ConfigError naming the key), checked before any round."""
    _check_torch_setup(cfg)
    if cfg.conspar_fraction > cfg.num_clients:
        raise ConfigError(f"run config key 'conspar-fraction' ({cfg.conspar_fraction}) exceeds 'num-clients' "
                          f"({cfg.num_clients}): K = m d (every client proposes all d coordinates) is the largest")
    if cfg.algorithm in ("fedrep-fedavg", "sparse-secagg"):  # buffers / masking are fixed for these baselines
        if cfg.algorithm == "sparse-secagg" and cfg.attack in ("alie", "foe"):
            raise ConfigError(f"run config key 'attack' is {cfg.attack!r}: SparseSecAgg masks every upload, an "
                              "omniscient attack cannot see the honest ones")
        return
    if cfg.num_clients % cfg.buffer_size:
        raise ConfigError(f"run config key 'buffer-size' ({cfg.buffer_size}) must divide 'num-clients' "
                          f"({cfg.num_clients}) (spec 11.6)")
    if cfg.secagg_mode == "masked" and cfg.buffer_size < 2:
        raise ConfigError("run config key 'secagg-mode' is 'masked' but 'buffer-size' is 1: a buffer of one client "
                          "is its update in the clear; use secagg-mode=plain for s = 1")
    if cfg.secagg_mode == "masked" and cfg.attack in ("alie", "foe"):
        raise ConfigError(f"run config key 'attack' is {cfg.attack!r}, an omniscient attack that needs the honest "
                          "clients' uploads: it can run only with secagg-mode=plain (masking hides them by design)")


def validate_flower_robust(cfg: RunConfig) -> None:
    """Run-config rules of Flower's Krum / FedMedian / FedTrimmedAvg on the FedREP setup: a torch network, fewer
    Byzantine clients than clients, and no coordinate attack (there is no proposal phase to attack). Every client
    trains every round; buffers, masking and ConSpar do not exist here, so ALIE / FoE are always possible (the
    server sees each model in the clear)."""
    _check_torch_setup(cfg)
    if cfg.coord_attack != "none":
        raise ConfigError(f"run config key 'coord-attack' is {cfg.coord_attack!r}, but {cfg.algorithm} has no "
                          "coordinate proposals to attack: use coord-attack=none")
