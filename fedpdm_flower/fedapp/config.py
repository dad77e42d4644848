"""Run configuration: one flat, typed home for every run-config key, with the bad-input rules of DESIGN.md.

The same keys work for `flwr run . -c "key=value ..."` (defaults in pyproject.toml) and for
`python -m simulations run --set key=value`. An unknown key or an out-of-range value raises ConfigError naming
the key, before any round runs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

Scalar = int | float | bool | str
# kept literal (not imported from fedpdm_flower.fedapp.data) so that parsing a config never imports the data stack
MODELS = ("l1-logistic", "multinomial", "multinomial-nobias", "tiny-cnn", "lenet5", "lenet5-valid", "cnn", "resnet20",
          "softmax-nobias")
DATASETS = ("mnist", "fashion-mnist", "adult", "femnist", "cifar10", "covtype", "synthetic", "synthetic-10class", "synthetic-binary")


class ConfigError(ValueError):
    """A run-config key is unknown or its value is invalid; the message names the key."""


#: environment variable that asks for tracebacks (ServerApp, ClientApp, the simulations CLI also has --debug)
DEBUG_ENV = "FEDAPP_DEBUG"


def debug_enabled() -> bool:
    """True when FEDAPP_DEBUG is set to anything but "", "0" or "false": failures then log their traceback too.

    Under `flwr run` the variable must be in the environment of the process that runs the app: for the local
    simulation SuperLink that is the daemon's, so set it before the daemon starts (docs/running.md, "When a run fails").
    """
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false")


def _positive(v: float) -> bool:
    return v > 0


def _nonneg(v: float) -> bool:
    return v >= 0


def _ratio(v: float) -> bool:
    return 0 < v <= 1


def _prob(v: float) -> bool:
    return 0 < v < 1


def _choice(*allowed: str) -> Callable[[str], bool]:
    def check(v: str) -> bool:
        return v in allowed

    check.__doc__ = "one of " + ", ".join(repr(a) for a in allowed)
    return check


def _key(name: str, check: Callable[[Any], bool] | None = None, doc: str = "") -> Any:
    return {"check": check, "doc": doc, "name": name}


@dataclass
class RunConfig:
    """Every hyperparameter a registered algorithm reads. Defaults are the paper's (seed 000, Section V-C)."""

    algorithm: str = field(default="bsdp-fedpdm", metadata=_key("algorithm", None, "registry key"))
    dataset: str = field(default="mnist", metadata=_key("dataset", _choice(*DATASETS)))
    data_source: str = field(default="offline", metadata=_key("data-source", _choice("offline", "online")))
    partitioner: str = field(default="paper", metadata=_key("partitioner", _choice("paper", "iid", "dirichlet", "label-k", "writer")))
    model: str = field(default="l1-logistic", metadata=_key("model", _choice(*MODELS)))
    num_clients: int = field(default=100, metadata=_key("num-clients", lambda v: v >= 1))
    clients_per_round: int = field(default=30, metadata=_key("clients-per-round", lambda v: v >= 1))
    first_round_all: bool = field(default=True, metadata=_key("first-round-all", None, "S_0 = [N] (Alg. 1 line 2)"))
    num_server_rounds: int = field(default=30, metadata=_key("num-server-rounds", lambda v: v >= 1))
    seed: int = field(default=0, metadata=_key("seed", _nonneg))
    out_dir: str = field(default="", metadata=_key("out-dir", None, "where results.json and the plot go"))
    plot: bool = field(default=True, metadata=_key(
        "plot", None, "draw out-dir/accuracy.png at the end (false: results.json and model.npy only, e.g. for sweeps "
        "on a machine without a display; matplotlib then is not even imported)"))
    # ---- checkpoints and resume (fedpdm_flower/fedapp/checkpoint.py, docs/deployment.md "Checkpoints and resume")
    checkpoint: bool = field(default=True, metadata=_key("checkpoint", None, "write out-dir/checkpoint after every round"))
    resume: bool = field(default=False, metadata=_key("resume", None, "continue the run whose checkpoint is in out-dir"))
    client_state_dir: str = field(default="", metadata=_key(
        "client-state-dir", None, "where clients persist context.state per run token (a node's own node config "
        "'state-dir' wins); '' = not persisted"))
    crash_after_round: int = field(default=0, metadata=_key(
        "crash-after-round", _nonneg, "testing only: stop the run with an error after this round's checkpoint"))
    batch_size: int = field(default=10, metadata=_key("batch-size", lambda v: v >= 1))
    rho: float = field(default=10.0, metadata=_key("rho", _positive))
    eta0: float = field(default=0.04, metadata=_key("eta0", _positive))
    nu: float = field(default=1e-2, metadata=_key("nu", _nonneg))
    beta: float = field(default=0.5, metadata=_key("beta", _nonneg))
    # Paper: gamma = 0.5. With pixel features in [0, 1] that makes X = 0 the stationary point (the data term's
    # gradient per coordinate is < 0.05 < gamma; measured: an all-zero model, 9.8 % accuracy), so we default to
    # 0.005 and scale the gamma grid of Fig. 6 by 1/100 (docs/fedpdm.md, "Deviations").
    gamma: float = field(default=0.005, metadata=_key("gamma", _nonneg))
    max_local_steps: int = field(default=10, metadata=_key("max-local-steps", lambda v: v >= 1))
    init_std: float = field(default=0.01, metadata=_key("init-std", _nonneg))
    dp: bool = field(default=True, metadata=_key("dp"))
    # "dpsgd": record-level DP-SGD on every device, (epsilon-total, delta) for one record under the RDP accountant
    # (PrivacyTarget; docs/private-learning.md); "gdp": the paper's noise on the upload at an exact GDP target for one
    # record, over every round, no amplification (GaussianTarget); "eq36": the paper's calibration (36), whose figure
    # a rigorous accountant does not confirm (docs/fedpdm.md)
    dp_calibration: str = field(default="gdp", metadata=_key("dp-calibration", _choice("gdp", "eq36", "dpsgd")))
    dp_sample_rate: float = field(default=0.0, metadata=_key(
        "dp-sample-rate", lambda v: 0 <= v <= 1, "q of DP-SGD's Poisson sampling; 0 = batch-size / records per client"))
    epsilon_total: float = field(default=8.0, metadata=_key("epsilon-total", _positive))
    delta: float = field(default=1e-5, metadata=_key("delta", _prob))
    clip_norm: float = field(default=1.0, metadata=_key("clip-norm", _positive))
    c0: float = field(default=1.0, metadata=_key("c0", _positive))
    privacy_q_power: float = field(default=2.0, metadata=_key("privacy-q-power", _positive))
    privacy_horizon: int = field(default=0, metadata=_key("privacy-horizon", _nonneg, "T of (36); 0 = num-server-rounds"))
    alpha_up: float = field(default=0.5, metadata=_key("alpha-up", _ratio))
    alpha_down: float = field(default=0.75, metadata=_key("alpha-down", _ratio))
    uplink_sparsifier: str = field(default="topk", metadata=_key("uplink-sparsifier", _choice("topk", "randk")))
    mu: float = field(default=0.01, metadata=_key("mu", _nonneg, "FedProx proximal weight"))
    feddyn_alpha: float = field(default=10.0, metadata=_key("feddyn-alpha", _positive))
    dirichlet_alpha: float = field(default=0.5, metadata=_key("dirichlet-alpha", _positive))
    labels_per_client: int = field(default=4, metadata=_key("labels-per-client", lambda v: v >= 1))
    samples_per_client: int = field(default=0, metadata=_key("samples-per-client", _nonneg, "0 = all data / N"))
    eval_every: int = field(default=1, metadata=_key("eval-every", lambda v: v >= 1))
    node_wait_s: float = field(default=120.0, metadata=_key("node-wait-s", _positive))
    # "ask": each node's partition-id by a query before round 1 (client ids = partitions, as the in-process driver);
    # "node-order": no query, clients numbered in node-id order, as Flower's FedAvg (FederatedStrategy's docstring)
    identify_nodes: str = field(default="ask", metadata=_key("identify-nodes", _choice("ask", "node-order"),
                                                             "how the server learns each node's client id"))
    # ---- DP-IADMM family (seed 002: dp-iadmm, objp, objpm, outp); defaults are the paper's MNIST settings
    local_updates: int = field(default=1, metadata=_key("local-updates", lambda v: v >= 1, "E of Alg. 1 (dp-iadmm)"))
    iadmm_epsilon: float = field(default=0.05, metadata=_key("iadmm-epsilon", _positive, "epsilon-bar per local solve"))
    iadmm_beta: float = field(default=1e-6, metadata=_key("iadmm-beta", _nonneg, "beta of (1): (beta/P)||z||^2 in f_p"))
    rho_schedule: str = field(default="paper24", metadata=_key("rho-schedule", _choice("paper24", "const")))
    rho_c1: float = field(default=2.0, metadata=_key("rho-c1", _positive, "c1 of (24)"))
    rho_c2: float = field(default=5.0, metadata=_key("rho-c2", _nonneg, "c2 of (24)"))
    rho_period: int = field(default=10000, metadata=_key("rho-period", lambda v: v >= 1, "T_c of (24)"))
    rho_max: float = field(default=1e9, metadata=_key("rho-max", _positive, "cap of (24)"))
    eta_schedule: str = field(default="inv-sqrt", metadata=_key("eta-schedule", _choice("inv-sqrt", "const")))
    eta_scale: float = field(default=1.0, metadata=_key("eta-scale", _positive, "a in eta^t = a/sqrt(t)"))
    sensitivity_mode: str = field(default="paper", metadata=_key("sensitivity-mode", _choice("paper", "bounded")))
    clip_l1: float = field(default=784.0, metadata=_key("clip-l1", _positive, "C1 of the bounded sensitivity"))
    outp_delta: float = field(default=1e-6, metadata=_key("outp-delta", _prob, "delta-bar of OutP"))
    outp_noise_std: str = field(default="sigma", metadata=_key("outp-noise-std", _choice("sigma", "sigma-squared")))
    outp_order: str = field(default="huang", metadata=_key("outp-order", _choice("huang", "alg1")))
    outp_grad_scale: str = field(default="local", metadata=_key("outp-grad-scale", _choice("local", "global")))
    noise_seed: int = field(default=0, metadata=_key("noise-seed", _nonneg, "varies only the DP noise"))
    total_samples: int = field(default=0, metadata=_key("total-samples", _nonneg, "I; 0 = from the partition"))
    device: str = field(default="cpu", metadata=_key("device", _choice("cpu", "cuda", "auto"), "torch device of the gradient"))
    # ---- FedREP family (seed 003: fedrep, share, fedrep-fedavg); defaults are the paper's Section 5 settings
    conspar_fraction: float = field(default=0.05, metadata=_key("conspar-fraction", _positive, "K/d of ConSpar"))
    conspar_alpha: float = field(default=0.0, metadata=_key("conspar-alpha", lambda v: 0 <= v <= 1, "alpha of ConSpar"))
    buffer_size: int = field(default=2, metadata=_key("buffer-size", lambda v: v >= 1, "s: clients per secure buffer"))
    sparse_downlink: bool = field(default=True, metadata=_key("sparse-downlink", None, "send (I, G~) not w"))
    secagg_mode: str = field(default="masked", metadata=_key("secagg-mode", _choice("masked", "plain")))
    aggregator: str = field(default="cclip", metadata=_key("aggregator", _choice("mean", "geomed", "tmean", "cclip")))
    geomed_iters: int = field(default=5, metadata=_key("geomed-iters", lambda v: v >= 1))
    tmean_fraction: float = field(default=0.4375, metadata=_key("tmean-fraction", lambda v: 0 <= v < 0.5))
    cclip_tau: float = field(default=0.5, metadata=_key("cclip-tau", _positive))
    cclip_iters: int = field(default=5, metadata=_key("cclip-iters", lambda v: v >= 1))
    local_steps: int = field(default=1, metadata=_key("local-steps", lambda v: v >= 1, "I of Eq. (180)"))
    lr: float = field(default=0.5, metadata=_key("lr", _positive, "local learning rate eta of Eq. (180)"))
    momentum: float = field(default=0.9, metadata=_key("momentum", lambda v: 0 <= v < 1, "beta of Eq. (180)"))
    lr_decay_round: int = field(default=0, metadata=_key("lr-decay-round", _nonneg, "round of the x0.1 decay; 0 = none"))
    byzantine_clients: int = field(default=0, metadata=_key("byzantine-clients", _nonneg))
    attack: str = field(default="none", metadata=_key("attack", _choice("none", "bit-flip", "alie", "foe")))
    coord_attack: str = field(default="none", metadata=_key("coord-attack", _choice("none", "min", "rand", "same")))
    alie_z: str = field(default="epfml", metadata=_key("alie-z", _choice("epfml", "baruch")))
    foe_eps: float = field(default=0.5, metadata=_key("foe-eps", _positive))
    sparsesecagg_scale: str = field(default="sum/N", metadata=_key("sparsesecagg-scale", _choice("sum/N", "sum/(N*Gamma)")))
    # ---- decentralized (seed 001: dp-recal and its baselines); defaults are the paper's Section VII settings
    graph: str = field(default="ring", metadata=_key("graph", None, "ring | complete | star | path | er:<p> | "
                                                     "geometric:<radius> | edges:<file>"))
    walk: str = field(default="markov", metadata=_key("walk", _choice("markov", "cyclic", "iid")))
    walk_start: str = field(default="stationary", metadata=_key("walk-start", None, "stationary | uniform | fixed:<id>"))
    recal_mode: str = field(default="private", metadata=_key("recal-mode", _choice("private", "exact")))
    recal_epsilon: float = field(default=10.0, metadata=_key("recal-epsilon", _nonneg, "target eps; 0 = recal-sigma1"))
    recal_sigma1: float = field(default=0.0, metadata=_key("recal-sigma1", _nonneg, "sigma_1 when recal-epsilon = 0"))
    recal_r: float = field(default=1.01, metadata=_key("recal-r", lambda v: v >= 1, "R: variance decay per activation"))
    recal_delta: float = field(default=1e-3, metadata=_key("recal-delta", _prob))
    xi_plan: str = field(default="walk", metadata=_key("xi-plan", _choice("walk", "K"), "planned LCI for calibration"))
    stop_on_budget: bool = field(default=False, metadata=_key("stop-on-budget"))
    alpha_scale: float = field(default=0.5, metadata=_key("alpha-scale", _prob, "alpha_i = scale * 2/(L_i + 1); "
                                                                      "dp-pg-extra / dp-nids: scale * stepsize bound"))
    recal_nu1: float = field(default=0.5, metadata=_key("recal-nu1", _nonneg, "l1 weight of the elastic net"))
    recal_nu2: float = field(default=0.5, metadata=_key("recal-nu2", _nonneg, "l2 weight of the elastic net"))
    label_mode: str = field(default="onehot_pm1", metadata=_key("label-mode", _choice("onehot_pm1", "binary_pm1")))
    recal_samples: int = field(default=0, metadata=_key("recal-samples", _nonneg, "0 = all (MNIST 60,000)"))
    x1_init: str = field(default="normal", metadata=_key("x1-init", _choice("normal", "zero")))
    # ---- DP-RW-ADMM (seed 001's random-walk baseline, fedpdm_flower/fedapp/algorithms/recal_baselines.py)
    rw_beta_scale: float = field(default=2.0, metadata=_key("rw-beta-scale", _positive, "ADMM penalty beta = scale * L_max"))
    rw_activation_prob: float = field(default=0.5, metadata=_key("rw-activation-prob", _ratio, "P: one paper iteration "
                                                                 "= P n token hops (Table V comm. count only)"))
    # ---- DPQ-DSGD (seed 004, spec shared/specs/dp_quantized.md); defaults are the paper's MNIST settings (spec 2.1, 6.1)
    dpq_variant: str = field(default="dpq", metadata=_key("dpq-variant", _choice("dpq", "dp-only", "quant-only", "dsgd"),
                                                          "spec 2.5 ablation: noise and/or quantization"))
    dpq_q_step: float = field(default=1.0, metadata=_key("dpq-q-step", _positive, "quantizer step Delta of eq. (3)"))
    dpq_sigma_exp: float = field(default=0.1, metadata=_key("dpq-sigma-exp", None, "sigma: noise std (k + offset)^sigma"))
    dpq_sigma_offset: float = field(default=5.0, metadata=_key("dpq-sigma-offset", _positive, "5 = paper, 1 = theory"))
    dpq_sigma_scale: float = field(default=1.0, metadata=_key("dpq-sigma-scale", _positive, "noise std multiplier"))
    dpq_a1: float = field(default=0.35, metadata=_key("dpq-a1", _positive, "alpha_hat = a1 (ln K)^2 / K^alpha"))
    dpq_alpha: float = field(default=1.0, metadata=_key("dpq-alpha", _positive, "exponent of alpha_hat"))
    dpq_a2: float = field(default=0.3, metadata=_key("dpq-a2", _positive, "beta_hat = a2 / K^beta (< 1)"))
    dpq_beta: float = field(default=0.75, metadata=_key("dpq-beta", _positive, "exponent of beta_hat"))
    dpq_a3: float = field(default=0.24, metadata=_key("dpq-a3", _positive, "batch gamma_hat = floor(a3 K^gamma) + 1"))
    dpq_gamma: float = field(default=0.7, metadata=_key("dpq-gamma", _nonneg, "exponent of the batch size"))
    dpq_delta_exp: float = field(default=3.0, metadata=_key("dpq-delta-exp", _positive, "delta_k = (k + 1)^-delta"))
    dpq_c: float = field(default=0.2, metadata=_key("dpq-c", _positive, "C of Definition 1 (accountant only)"))
    dpq_horizon: int = field(default=0, metadata=_key("dpq-horizon", _nonneg, "K; 0 = num-server-rounds - 2"))
    dpq_eval_limit: int = field(default=0, metadata=_key("dpq-eval-limit", _nonneg, "evaluation samples; 0 = all"))
    dpq_eval_average: bool = field(default=False, metadata=_key("dpq-eval-average", None, "upload x_i in evaluation "
                                                                "rounds for the node-average model (not private)"))

    @property
    def horizon(self) -> int:
        """T used by the privacy formula (36)."""
        return self.privacy_horizon or self.num_server_rounds

    def to_run_config(self) -> dict[str, Scalar]:
        """The kebab-case mapping flwr's run config uses (echoed under "config" in results.json)."""
        return {f.metadata["name"]: getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes: Any) -> RunConfig:
        """A validated copy with some fields changed (snake_case names)."""
        return parse_run_config({**self.to_run_config(), **{_KEBAB[k]: v for k, v in changes.items()}})


_FIELDS = {f.metadata["name"]: f for f in fields(RunConfig)}
_KEBAB = {f.name: f.metadata["name"] for f in fields(RunConfig)}


def known_keys() -> list[str]:
    """All run-config keys, kebab-case."""
    return sorted(_FIELDS)


def _coerce(key: str, ftype: Any, value: Any) -> Scalar:
    if ftype in ("bool", bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"run config key '{key}' must be true or false, got {value!r}")
    if ftype in ("int", int):
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ConfigError(f"run config key '{key}' must be an integer, got {value!r}")
        try:
            f = float(value)
        except ValueError:
            raise ConfigError(f"run config key '{key}' must be an integer, got {value!r}") from None
        if not math.isfinite(f) or f != int(f):
            raise ConfigError(f"run config key '{key}' must be an integer, got {value!r}")
        return int(f)
    if ftype in ("float", float):
        if isinstance(value, bool):
            raise ConfigError(f"run config key '{key}' must be a number, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"run config key '{key}' must be a number, got {value!r}") from None
        if not math.isfinite(f):
            raise ConfigError(f"run config key '{key}' must be finite, got {value!r}")
        return f
    if not isinstance(value, str):
        raise ConfigError(f"run config key '{key}' must be a string, got {value!r}")
    return value


def parse_run_config(raw: Mapping[str, Any], *, algorithms: Mapping[str, Any] | None = None) -> RunConfig:
    """Validate a flat run config (kebab-case keys) into a RunConfig; missing keys take the defaults.

    Raises
    ------
    ConfigError
        For an unknown key, a value of the wrong type, or a value outside its range, naming the key.
    """
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown run config key(s) {', '.join(repr(k) for k in unknown)}; valid keys: {', '.join(known_keys())}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        f = _FIELDS[key]
        v = _coerce(key, f.type, value)
        check = f.metadata["check"]
        if check is not None and not check(v):
            what = check.__doc__ or "in range"
            raise ConfigError(f"run config key '{key}' has invalid value {v!r} (must be {_RANGES.get(key, what)})")
        values[f.name] = v
    cfg = RunConfig(**values)
    if cfg.dataset == "femnist" and cfg.data_source != "online":
        raise ConfigError(
            "run config key 'data-source' must be 'online' for dataset 'femnist': FEMNIST has no offline copy, it is "
            "downloaded from the Hugging Face hub (flwrlabs/femnist), so it needs a network"
        )
    if cfg.dataset == "cifar10" and cfg.data_source != "online":
        raise ConfigError(
            "run config key 'data-source' must be 'online' for dataset 'cifar10': CIFAR-10 has no offline copy, it is "
            "downloaded with torchvision.datasets.CIFAR10, so it needs a network"
        )
    if cfg.partitioner == "writer" and cfg.dataset != "femnist":
        raise ConfigError(
            f"run config key 'partitioner' = 'writer' needs a dataset with writer ids ('femnist'), got {cfg.dataset!r}"
        )
    if algorithms is None:
        from fedpdm_flower.fedapp.registry import ALGORITHMS

        algorithms = ALGORITHMS
    if cfg.algorithm not in algorithms:
        raise ConfigError(f"run config key 'algorithm' has unknown value {cfg.algorithm!r}; registered: {', '.join(sorted(algorithms))}")
    check = getattr(algorithms[cfg.algorithm], "validate", None)
    if callable(check):
        check(cfg)
    if cfg.clients_per_round > cfg.num_clients:
        raise ConfigError(
            f"run config key 'clients-per-round' ({cfg.clients_per_round}) exceeds 'num-clients' ({cfg.num_clients})"
        )
    return cfg


_RANGES = {
    "recal-epsilon": ">= 0",
    "recal-sigma1": ">= 0",
    "recal-r": ">= 1",
    "recal-delta": "in (0, 1)",
    "alpha-scale": "in (0, 1)",
    "recal-nu1": ">= 0",
    "recal-nu2": ">= 0",
    "recal-samples": ">= 0",
    "rw-beta-scale": "> 0",
    "rw-activation-prob": "in (0, 1]",
    "dpq-q-step": "> 0",
    "dpq-sigma-offset": "> 0",
    "dpq-sigma-scale": "> 0",
    "dpq-a1": "> 0",
    "dpq-alpha": "> 0",
    "dpq-a2": "> 0",
    "dpq-beta": "> 0",
    "dpq-a3": "> 0",
    "dpq-gamma": ">= 0",
    "dpq-delta-exp": "> 0",
    "dpq-c": "> 0",
    "dpq-horizon": ">= 0",
    "dpq-eval-limit": ">= 0",
    "conspar-fraction": "> 0",
    "conspar-alpha": "in [0, 1]",
    "buffer-size": ">= 1",
    "geomed-iters": ">= 1",
    "tmean-fraction": "in [0, 0.5)",
    "cclip-tau": "> 0",
    "cclip-iters": ">= 1",
    "local-steps": ">= 1",
    "lr": "> 0",
    "momentum": "in [0, 1)",
    "lr-decay-round": ">= 0",
    "byzantine-clients": ">= 0",
    "foe-eps": "> 0",
    "alpha-up": "in (0, 1]",
    "alpha-down": "in (0, 1]",
    "delta": "in (0, 1)",
    "epsilon-total": "> 0",
    "rho": "> 0",
    "eta0": "> 0",
    "clip-norm": "> 0",
    "dp-sample-rate": "in [0, 1] (0: batch-size / records per client)",
    "c0": "> 0",
    "privacy-q-power": "> 0",
    "feddyn-alpha": "> 0",
    "dirichlet-alpha": "> 0",
    "node-wait-s": "> 0",
    "iadmm-epsilon": "> 0",
    "rho-c1": "> 0",
    "rho-max": "> 0",
    "eta-scale": "> 0",
    "clip-l1": "> 0",
    "outp-delta": "in (0, 1)",
    "iadmm-beta": ">= 0",
    "rho-c2": ">= 0",
    "noise-seed": ">= 0",
    "total-samples": ">= 0",
    "local-updates": ">= 1",
    "rho-period": ">= 1",
    "nu": ">= 0",
    "beta": ">= 0",
    "gamma": ">= 0",
    "mu": ">= 0",
    "init-std": ">= 0",
    "seed": ">= 0",
    "crash-after-round": ">= 0",
    "privacy-horizon": ">= 0",
    "samples-per-client": ">= 0",
    "num-clients": ">= 1",
    "clients-per-round": ">= 1",
    "num-server-rounds": ">= 1",
    "batch-size": ">= 1",
    "max-local-steps": ">= 1",
    "labels-per-client": ">= 1",
    "eval-every": ">= 1",
}

__all__ = ["DEBUG_ENV", "ConfigError", "RunConfig", "debug_enabled", "known_keys", "parse_run_config"]
