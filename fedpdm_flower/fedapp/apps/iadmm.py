"""Seed 002 family (DP-IADMM / ObjP / ObjPM and the OutP baseline): run-config keys -> the public constructors.

The keys ``dp-iadmm`` (E = ``local-updates``), ``objp`` (E = 1), ``objpm`` (E = 10) and ``outp`` build
:class:`fedpdm_flower.strategies.iadmm.DPIADMM` / :class:`fedpdm_flower.strategies.iadmm.OutP` and :class:`fedpdm_flower.clients.iadmm.IADMMClient` /
:class:`fedpdm_flower.clients.iadmm.OutPClient` with the paper's numpy multinomial model (63) on the run's partitions. I comes
from the partition sizes (``total-samples`` = 0) so that the run needs no extra exchange before round 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, Context

from fedpdm_flower.fedapp.config import ConfigError, RunConfig
from fedpdm_flower.fedapp.task import build_model, node_dataset, total_train_samples

if TYPE_CHECKING:
    from fedpdm_flower.clients.iadmm import IADMMClient
    from fedpdm_flower.fedapp.algorithms.iadmm import EtaSchedule, RhoSchedule
    from fedpdm_flower.strategies.iadmm import ConsensusADMM

#: E of the convenience keys: ObjP is Algorithm 1 with E = 1, ObjPM with E = 10 (Section IV); OutP has one step
FIXED_LOCAL_UPDATES = {"objp": 1, "objpm": 10, "outp": 1}
IADMM_ALGORITHMS = ("dp-iadmm", "objp", "objpm", "outp")
IADMM_MODELS = ("multinomial-nobias", "multinomial")


# ---------------------------------------------------------------------------------------------- cfg -> arguments
def local_updates_of(cfg: RunConfig) -> int:
    """E: fixed by the convenience keys (objp 1, objpm 10, outp 1), else the run config's ``local-updates``."""
    return FIXED_LOCAL_UPDATES.get(cfg.algorithm, cfg.local_updates)


def epsilon_of(cfg: RunConfig) -> float | None:
    """epsilon-bar per local solve of the paper's mechanism; None (non-private IADMM) when ``dp`` is false."""
    return cfg.iadmm_epsilon if cfg.dp else None


def privacy_of(cfg: RunConfig) -> Any:
    """The ``privacy=`` of the run: None without ``dp``; with ``dp-calibration = dpsgd`` record-level DP-SGD in the
    local solves (``PrivacyTarget`` of ``epsilon-total``, ``delta``, ``clip-norm``, ``dp-sample-rate``,
    ``privacy-horizon``); else the paper's mechanism (the reproduction setting): :class:`ObjectivePerturbation`
    (``iadmm-epsilon`` per solve, ``sensitivity-mode``, ``clip-l1``) for DP-IADMM, :class:`OutputPerturbation`
    (``iadmm-epsilon``, ``outp-delta`` per step, ``outp-noise-std``) for OutP; the devices report the rigorous
    composition at ``delta``."""
    from fedpdm_flower.fedapp.algorithms.iadmm import ObjectivePerturbation, OutputPerturbation

    if not cfg.dp:
        return None
    if cfg.dp_calibration == "dpsgd":
        from fedpdm_flower.fedapp.apps.common import calibration

        return calibration(cfg)
    if cfg.algorithm == "outp":
        return OutputPerturbation(cfg.iadmm_epsilon, delta_bar=cfg.outp_delta, noise_std=cfg.outp_noise_std,
                                  delta=cfg.delta)
    bounded = cfg.sensitivity_mode == "bounded"
    return ObjectivePerturbation(cfg.iadmm_epsilon, sensitivity_mode=cfg.sensitivity_mode,
                                 clip_norm=cfg.clip_l1 if bounded else None, delta=cfg.delta)


def rho_of(cfg: RunConfig) -> float | RhoSchedule:
    """rho^t: schedule (24) with the run's constants, or the constant ``rho``."""
    from fedpdm_flower.fedapp.algorithms.iadmm import RhoSchedule

    if cfg.rho_schedule == "const":
        return cfg.rho
    return RhoSchedule(cfg.rho_c1, cfg.rho_c2, cfg.rho_period, cfg.rho_max)


def eta_of(cfg: RunConfig) -> EtaSchedule:
    """eta^t of ObjP / ObjPM: ``eta-scale / sqrt(t)`` (default) or the constant ``eta-scale``."""
    from fedpdm_flower.fedapp.algorithms.iadmm import EtaSchedule

    return EtaSchedule(cfg.eta_schedule, cfg.eta_scale)


def agents(cfg: RunConfig) -> dict[str, Any]:
    """The federation: num-clients agents with partition ids 0..N-1, all of them every round, and I."""
    return {"min_available_nodes": cfg.num_clients, "seed": cfg.seed, "require_partition_ids": True,
            "identify_nodes": cfg.identify_nodes,  # anything but "ask" is refused: I_p comes with the whoami reply
            "node_wait_s": cfg.node_wait_s, "eval_every": cfg.eval_every,
            "total_samples": cfg.total_samples or total_train_samples(cfg)}


# ---------------------------------------------------------------------------------------------- builders
def iadmm_strategy(cfg: RunConfig) -> ConsensusADMM:
    """DPIADMM (dp-iadmm / objp / objpm) or OutP (outp) from the run config."""
    from fedpdm_flower.strategies.iadmm import DPIADMM, OutP

    common: dict[str, Any] = {**agents(cfg), "privacy": privacy_of(cfg), "rho": rho_of(cfg), "beta": cfg.iadmm_beta}
    if cfg.algorithm == "outp":
        return OutP(order=cfg.outp_order, grad_scale=cfg.outp_grad_scale, **common)
    return DPIADMM(local_updates=local_updates_of(cfg), eta=eta_of(cfg), **common)


def iadmm_client(cfg: RunConfig, context: Context) -> IADMMClient:
    """The agent of a seed-002 key: the run's numpy model (63) on the node's data (its ``data-path`` files, else its
    partition), the run seed."""
    from fedpdm_flower.clients.iadmm import IADMMClient, OutPClient

    data, info = node_dataset(cfg, context.node_config)
    cls = OutPClient if cfg.algorithm == "outp" else IADMMClient
    return cls(build_model(cfg, info), data, context=context, seed=cfg.seed,
               noise_seed=cfg.noise_seed, device=cfg.device)


def zero_initial_model(cfg: RunConfig) -> ArrayRecord:
    """w = z_p^1 = 0 (spec A7, the reference code), float64: with lambda_p^1 = 0, round 1 broadcasts zeros."""
    return ArrayRecord([np.zeros(build_model(cfg).dim)])


# ---------------------------------------------------------------------------------------------- run-config rules
def validate_config(cfg: RunConfig) -> None:
    """Run-config rules of the DP-IADMM family; raises ConfigError naming the key."""
    name = cfg.algorithm
    if cfg.dp and cfg.dp_calibration == "eq36":
        raise ConfigError(
            f"run config key 'dp-calibration' = 'eq36' is DP-FedPDM's calibration; algorithm {name!r} runs its own "
            "paper mechanism (iadmm-epsilon per solve) unless dp-calibration = 'dpsgd' (record-level DP-SGD)")
    if cfg.model not in IADMM_MODELS:
        raise ConfigError(
            f"run config key 'model' must be one of {', '.join(repr(m) for m in IADMM_MODELS)} for algorithm "
            f"{name!r} (the paper's model (63) is 'multinomial-nobias'), got {cfg.model!r}"
        )
    if cfg.clients_per_round != cfg.num_clients:
        raise ConfigError(
            f"run config key 'clients-per-round' ({cfg.clients_per_round}) must equal 'num-clients' "
            f"({cfg.num_clients}) for algorithm {name!r}: Algorithm 1 uses every agent every round"
        )
    if name in FIXED_LOCAL_UPDATES and cfg.local_updates not in (1, FIXED_LOCAL_UPDATES[name]):
        raise ConfigError(
            f"run config key 'local-updates' is fixed to {FIXED_LOCAL_UPDATES[name]} for algorithm {name!r}; "
            f"use algorithm 'dp-iadmm' to choose E (got {cfg.local_updates})"
        )
    if cfg.sensitivity_mode == "bounded" and name == "outp":
        raise ConfigError("run config key 'sensitivity-mode' = 'bounded' applies to the Laplace algorithms, not 'outp'")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"run config key 'device' is 'cuda' but torch {torch.__version__} sees no CUDA device here "
                "(torch.cuda.is_available() is False); use 'cpu' or 'auto'"
            )


__all__ = [
    "FIXED_LOCAL_UPDATES",
    "IADMM_ALGORITHMS",
    "IADMM_MODELS",
    "epsilon_of",
    "eta_of",
    "iadmm_client",
    "iadmm_strategy",
    "local_updates_of",
    "privacy_of",
    "rho_of",
    "validate_config",
]
