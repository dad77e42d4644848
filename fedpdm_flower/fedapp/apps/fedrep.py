"""Seed 003 family: FedREP, SHARE, dense FedAvg and SparseSecAgg, and Flower's Krum / FedMedian / FedTrimmedAvg on
the same clients -- run-config keys -> the public constructors (:mod:`fedpdm_flower.strategies.fedrep`,
:mod:`fedpdm_flower.strategies.flower_robust`, :mod:`fedpdm_flower.clients.fedrep`).

What only the reproduction knows lives here: the zoo network and the node's partition, the run's w^0 (torch's
default initialisation seeded with the run seed, built identically on the server and on every client, hence
``clients_hold_initial=True``), the Byzantine clients of a simulation (:func:`fedpdm_flower.fedapp.attacks.byzantine_ids` of the
run seed, built with an explicit simulation-only attack), the devices' secure mode for masked buffers, and the
run-config rules checked before any round.

**Secure mode and its trust assumption.** With ``secagg-mode=masked`` (fedrep, share) every device is in secure mode
(:class:`fedpdm_flower.clients.secure.SecureDevice`): it signs its per-round keys with a long-term Ed25519 identity and accepts only
buffer-mates whose keys verify against its trust store. Whoever writes the trust store decides who the peers are.
A node whose node config names ``secure-identity`` (its private key, PEM) and ``secure-trust-store`` (JSON: client id
-> public key) uses those files -- a deployment, provisioned by its operator. Otherwise (a simulation) the identities
are generated per node from the run seed (:func:`simulation_identity`) and every node gets the same trust store of
all m identities: this exercises the protocol and every device check, but whoever knows the run config (the server
included) could derive the identities, so it is no protection against the server -- a simulation's stand-in. The
devices accept buffers of 2 (``min_buffer = 2``), the paper's setting s = 2, which is weaker than the library's
default of 3: in a buffer of 2, one colluding buffer-mate learns the other's update from the buffer sum.
"""

from __future__ import annotations

import math
from functools import lru_cache
from logging import WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.common.logger import log
from numpy.typing import NDArray

from fedpdm_flower.fedapp.apps.common import node_of
from fedpdm_flower.fedapp.config import ConfigError, RunConfig
from fedpdm_flower.fedapp.sampling import STREAM_INIT, rng_for
from fedpdm_flower.fedapp.task import build_net, node_dataset

if TYPE_CHECKING:
    from fedpdm_flower.clients.fedrep import FedREPClient, MomentumSGDClient
    from fedpdm_flower.clients.secure import SecureDevice
    from fedpdm_flower.fedapp.attacks import ClientAttack, OmniscientOracle
    from fedpdm_flower.fedapp.data.sources import DatasetInfo
    from fedpdm_flower.fedapp.models.torch_net import TorchNet
    from fedpdm_flower.fedapp.robust import Aggregator
    from fedpdm_flower.fedapp.secagg import NodeIdentity, TrustStore
    from fedpdm_flower.strategies.fedrep import FedREP
    from fedpdm_flower.strategies.flower_robust import FedREPLocalMixin

__all__ = [
    "fedrep_client",
    "fedrep_initial",
    "fedrep_strategy",
    "flower_robust_client",
    "flower_robust_strategy",
    "initial_weights",
    "secure_device",
    "simulation_identity",
    "validate_config",
    "validate_flower_robust",
]


# ---------------------------------------------------------------------------------------------- w^0 and the model
def initial_weights(cfg: RunConfig, net: TorchNet) -> NDArray[np.float32]:
    """w^0: torch's default initialisation seeded with the run seed (``net`` now holds it, as float32)."""
    return net.init(rng_for(cfg.seed, STREAM_INIT)).astype(np.float32)


def _net_at_w0(cfg: RunConfig, info: DatasetInfo | None = None) -> TorchNet:
    net = build_net(cfg, info)
    initial_weights(cfg, net)
    return net


def fedrep_initial(cfg: RunConfig) -> ArrayRecord:
    """The initial ArrayRecord: the zoo network's state dict at w^0 (float32; integer buffers as they are)."""
    from fedpdm_flower.strategies.base import record_of

    return record_of(_net_at_w0(cfg).state_arrays())


# ---------------------------------------------------------------------------------------------- simulation only
def byzantine(cfg: RunConfig) -> set[int]:
    """The Byzantine partition ids of the run (drawn from the run seed; empty without byzantine-clients)."""
    from fedpdm_flower.fedapp.attacks import byzantine_ids

    return set(byzantine_ids(cfg.num_clients, cfg.byzantine_clients, cfg.seed))


def oracle(cfg: RunConfig) -> OmniscientOracle | None:
    """SIMULATION ONLY: the server-side oracle of attack = alie / foe and coord-attack = same, or None."""
    values = cfg.attack if cfg.attack in ("alie", "foe") else "none"
    coordinates = "same" if cfg.coord_attack == "same" else "none"
    if not cfg.byzantine_clients or (values, coordinates) == ("none", "none"):
        return None
    from fedpdm_flower.fedapp.attacks import OmniscientOracle, alie_z

    z = alie_z(cfg.num_clients, cfg.byzantine_clients, cfg.alie_z) if values == "alie" else None
    return OmniscientOracle(byzantine=frozenset(byzantine(cfg)), values=values, coordinates=coordinates, z=z,
                            eps=cfg.foe_eps)


def client_attack(cfg: RunConfig, partition_id: int) -> ClientAttack | None:
    """SIMULATION ONLY: the attack of a Byzantine client (bit-flip, min / rand proposals), None for the others."""
    values = "bit-flip" if cfg.attack == "bit-flip" else "none"
    coordinates = cfg.coord_attack if cfg.coord_attack in ("min", "rand") else "none"
    if (values, coordinates) == ("none", "none") or partition_id not in byzantine(cfg):
        return None
    from fedpdm_flower.fedapp.attacks import ClientAttack

    return ClientAttack(values=values, coordinates=coordinates)


# ---------------------------------------------------------------------------------------------- builders
def local_algorithm(cfg: RunConfig) -> dict[str, Any]:
    """Eq. (180) and its schedule: lr, lr-decay-round (0 = never), momentum, local-steps, batch-size."""
    return {"eta0": cfg.lr, "eta0_decay_round": cfg.lr_decay_round or None, "momentum": cfg.momentum,
            "local_steps": cfg.local_steps, "batch_size": cfg.batch_size}


def aggregator(cfg: RunConfig) -> Aggregator:
    """The robust aggregator of the aggregator key with its geomed-iters / tmean-fraction / cclip-* settings."""
    from fedpdm_flower.fedapp.robust import CenteredClipping, GeometricMedian, Mean, TrimmedMean

    if cfg.aggregator == "geomed":
        return GeometricMedian(iters=cfg.geomed_iters)
    if cfg.aggregator == "tmean":
        return TrimmedMean(trim_fraction=cfg.tmean_fraction)
    if cfg.aggregator == "cclip":
        return CenteredClipping(tau=cfg.cclip_tau, iters=cfg.cclip_iters)
    return Mean()


def fedrep_strategy(cfg: RunConfig) -> FedREP:
    """fedrep / share / fedrep-fedavg / sparse-secagg: all m = num-clients clients every round, partition ids."""
    from fedpdm_flower.fedapp.compression.conspar import ConSpar
    from fedpdm_flower.strategies.fedrep import SHARE, DenseFedAvg, FedREP, SparseSecAgg

    m = cfg.num_clients
    common: dict[str, Any] = {
        "min_available_nodes": m, "min_train_nodes": m, "seed": cfg.seed, "require_partition_ids": True,
        "identify_nodes": cfg.identify_nodes,  # anything but "ask" is refused: FedREP's buffers need partition ids
        "node_wait_s": cfg.node_wait_s, "eval_every": cfg.eval_every, "sparse_downlink": cfg.sparse_downlink,
        "clients_hold_initial": True, **local_algorithm(cfg),
        # the run config's seed repeats the whole run, buffers included (logged as weaker): figures, driver equality
        "reproducible_buffers": True,
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
    """The node's FedREP client: the zoo network at w^0, the node's partition, the run seed, its attack if any, and
    secure mode for masked buffers (:func:`secure_device`)."""
    from fedpdm_flower.clients.fedrep import FedREPClient

    pid, _ = node_of(context)
    data, info = node_dataset(cfg, context.node_config)
    return FedREPClient(_net_at_w0(cfg, info), data, context=context, seed=cfg.seed,
                        attack=client_attack(cfg, pid), secure=secure_device(cfg, context))


# ---------------------------------------------------------------------------------------------- secure mode
def simulation_identity(seed: int, client: int) -> NodeIdentity:
    """SIMULATION STAND-IN: client ``client``'s Ed25519 identity, derived from the run seed (HKDF-SHA256), so that
    every simulated node -- in whichever process Flower runs it -- has its own identity and all share one trust
    store. Anyone who knows the run seed can derive it: never use it where the server must not sign for a device."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    from fedpdm_flower.fedapp.secagg import NodeIdentity

    raw = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"fedapp-simulation-identity",
               info=f"client={int(client)}".encode()).derive(int(seed).to_bytes(16, "big", signed=True))
    return NodeIdentity(Ed25519PrivateKey.from_private_bytes(raw))


@lru_cache(maxsize=4)
def _simulation_trust(seed: int, clients: int) -> TrustStore:
    from fedpdm_flower.fedapp.secagg import TrustStore

    return TrustStore({c: simulation_identity(seed, c).public_bytes() for c in range(clients)})


def secure_device(cfg: RunConfig, context: Context) -> SecureDevice | None:
    """The node's secure mode for masked fedrep / share (None otherwise): its identity and trust store from the
    files its node config names (``secure-identity``, ``secure-trust-store``), else the simulation stand-in
    (:func:`simulation_identity` for every client id 0..m-1); buffers of 2 accepted (the paper's s = 2)."""
    if cfg.algorithm not in ("fedrep", "share") or cfg.secagg_mode != "masked":
        return None
    from fedpdm_flower.clients.secure import SecureDevice

    named = [k for k in ("secure-identity", "secure-trust-store") if context.node_config.get(k)]
    if len(named) == 2:
        return SecureDevice(min_buffer=2)  # reads both files from the node config
    if named:
        raise ValueError(f"node config names {named[0]!r} but not the other of 'secure-identity' / "
                         "'secure-trust-store': a provisioned device needs both")
    pid, _ = node_of(context)
    return SecureDevice(identity=simulation_identity(cfg.seed, pid), trust_store=_simulation_trust(cfg.seed,
                        cfg.num_clients), min_buffer=2)


def flower_robust_strategy(cfg: RunConfig) -> FedREPLocalMixin:
    """flwr-krum / flwr-fedmedian / flwr-fedtrimmedavg: Flower's rule over all m clients' models, every round."""
    from fedpdm_flower.strategies.flower_robust import FlwrFedMedian, FlwrFedTrimmedAvg, FlwrKrum

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
    from fedpdm_flower.clients.fedrep import MomentumSGDClient

    pid, _ = node_of(context)
    data, info = node_dataset(cfg, context.node_config)
    return MomentumSGDClient(build_net(cfg, info), data, context=context, seed=cfg.seed,
                             attack=client_attack(cfg, pid))


# ---------------------------------------------------------------------------------------------- run-config rules
def _check_torch_setup(cfg: RunConfig) -> None:
    """Rules every FedREP-setup algorithm shares: a torch network, fewer Byzantine clients than clients."""
    from fedpdm_flower.fedapp.models.base import TORCH_MODELS

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
