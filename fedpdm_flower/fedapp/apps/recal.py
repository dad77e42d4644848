"""Seed 001 family (DP-RECAL and its Table V baselines DP-PG-EXTRA, DP-NIDS, DP-RW-ADMM): run-config keys -> the
public constructors of :mod:`fedpdm_flower.strategies.recal` / :mod:`fedpdm_flower.strategies.recal_baselines` and :mod:`fedpdm_flower.clients.recal` /
:mod:`fedpdm_flower.clients.recal_baselines`.

What only the reproduction knows lives here: the elastic-net problem of the experiments built from the dataset
registry (:func:`recal_problem`: MNIST offline, covtype online; spec 5.1-5.2), each node's agent = its partition of
it (the paper's least squares :class:`fedpdm_flower.fedapp.algorithms.recal.LocalLeastSquares`, which brings its own L_i), the
start x^1 (:func:`initial_model`, spec A9), the central x* of the whole data and the relative error to it as the
run's ``evaluate_fn`` (spec 5.7), and the run-config rules of the four keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, Context, MetricRecord

from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.algorithms.recal import (
    MNIST_SCALINGS,
    ElasticNetProblem,
    LocalLeastSquares,
    encode_targets,
    load_covtype_problem,
    minmax_scale,
    relative_error,
    solve_elastic_net,
    split_agents,
)
from fedpdm_flower.fedapp.algorithms.recal_baselines import baseline_sigma1, data_free_sensitivity
from fedpdm_flower.fedapp.apps.common import federation, node_of
from fedpdm_flower.fedapp.config import ConfigError, RunConfig
from fedpdm_flower.fedapp.layout import ArrayLayout
from fedpdm_flower.fedapp.privacy import zcdp
from fedpdm_flower.fedapp.privacy.target import PrivacyTarget
from fedpdm_flower.fedapp.privacy.zcdp import Theorem3Calibration
from fedpdm_flower.fedapp.sampling import rng_for

if TYPE_CHECKING:
    from fedpdm_flower.clients.recal import LocalProblemAgent
    from fedpdm_flower.strategies.recal import RecalFamily

#: stream of x^1 (spec A9: a seeded N(0, I) start), shared with simulations/recal_table.py and the DLG demo
STREAM_X1 = 40
_PROBLEMS: dict[tuple[Any, ...], ElasticNetProblem] = {}
_SOLUTIONS: dict[tuple[Any, ...], np.ndarray] = {}

__all__ = [
    "STREAM_X1",
    "evaluate_fn",
    "initial_model",
    "load_mnist_problem",
    "local_agent",
    "recal_client",
    "recal_privacy",
    "recal_problem",
    "recal_strategy",
    "reference_solution",
    "start_point",
    "validate_config",
    "validate_rw_admm_config",
    "validate_sync_config",
]


# ---------------------------------------------------------------------------------------------- the problem
def load_mnist_problem(
    n_agents: int = 8,
    *,
    seed: int = 0,
    label_mode: str = "onehot_pm1",
    num_samples: int | None = None,
    nu1: float = 0.5,
    nu2: float = 0.5,
    scaling: str = "pixel255",
    source: str = "offline",
    root: str | None = None,
) -> ElasticNetProblem:
    """The MNIST problem of the experiments (5.1, 5.2) from :func:`fedpdm_flower.fedapp.data.load_dataset` ("mnist", train split).

    * features: the 784 pixels in [0, 1]. ``scaling="pixel255"`` (default, spec 5.2 [interp]): pixels / 255 as the
      loader gives them; ``"minmax"``: per-pixel min-max (always-zero pixels -> 0). The loader's bias column is
      dropped, as the paper's q = 784 has none. No missing values (checked: all finite).
    * targets (A6): ``"onehot_pm1"`` -> b_ij in {-1, +1}^10, x of shape (784, 10); ``"binary_pm1"`` -> even digit
      +1, odd -1, x of shape (784,) (x* = 0 for nu1 = 1/2, spec A9).
    * split: seeded permutation, first ``num_samples`` rows (all 60,000 by default), ``np.array_split`` into
      ``n_agents`` parts (7,500 each for n = 8).
    """
    from fedpdm_flower.fedapp.data import sources  # lazy: patchable in tests

    if scaling not in MNIST_SCALINGS:
        raise ValueError(f"unknown scaling {scaling!r}; valid: {', '.join(MNIST_SCALINGS)}")
    train, _, info = sources.load_dataset("mnist", source, root)
    feats = np.asarray(train.x[:, :-1], dtype=np.float64)  # drop the bias column
    if not np.isfinite(feats).all():
        raise ValueError("MNIST features contain non-finite values")
    if scaling == "minmax":
        feats = minmax_scale(feats)
    targets = encode_targets(train.y, label_mode, info.num_classes, positive=(0, 2, 4, 6, 8))
    b_parts, t_parts = split_agents(feats, targets, n_agents, seed, num_samples)
    return ElasticNetProblem.from_arrays(b_parts, t_parts, nu1, nu2)


def _problem_key(cfg: RunConfig) -> tuple[Any, ...]:
    return (cfg.dataset, cfg.data_source, cfg.num_clients, cfg.seed, cfg.label_mode, cfg.recal_samples,
            cfg.recal_nu1, cfg.recal_nu2)


def recal_problem(cfg: RunConfig) -> ElasticNetProblem:
    """The elastic-net problem of the run (spec 5.1-5.2), all agents' partitions; cached per process.

    MNIST (offline): pixels / 255, one-hot +-1 (or parity) targets, seeded equal split over num-clients agents.
    covtype (online, scikit-learn's loader): per-feature min-max, seeded 55,500-sample subset.
    """
    key = _problem_key(cfg)
    if key not in _PROBLEMS:
        if len(_PROBLEMS) >= 8:
            _PROBLEMS.clear()
        if cfg.dataset == "covtype":
            _PROBLEMS[key] = load_covtype_problem(
                cfg.num_clients, seed=cfg.seed, label_mode=cfg.label_mode, nu1=cfg.recal_nu1, nu2=cfg.recal_nu2,
                num_samples=cfg.recal_samples or 55_500,
            )
        else:
            _PROBLEMS[key] = load_mnist_problem(
                cfg.num_clients, seed=cfg.seed, label_mode=cfg.label_mode, nu1=cfg.recal_nu1, nu2=cfg.recal_nu2,
                num_samples=cfg.recal_samples or None, source=cfg.data_source,
            )
    return _PROBLEMS[key]


def reference_solution(cfg: RunConfig) -> np.ndarray:
    """x* of the whole problem (:func:`fedpdm_flower.fedapp.algorithms.recal.solve_elastic_net`, spec 5.7), shape of x; cached."""
    key = _problem_key(cfg)
    if key not in _SOLUTIONS:
        if len(_SOLUTIONS) >= 8:
            _SOLUTIONS.clear()
        _SOLUTIONS[key] = solve_elastic_net(recal_problem(cfg)).x
    return _SOLUTIONS[key]


def start_point(cfg: RunConfig) -> np.ndarray:
    """x^1 (DP-RECAL) = x^0 (the baselines): zeros, or a seeded N(0, I) (``x1-init``; spec A9: on MNIST x* is nearly
    0, so a zero start makes the relative error's denominator tiny)."""
    shape = recal_problem(cfg).x_shape
    if cfg.x1_init == "zero":
        return np.zeros(shape)
    return rng_for(cfg.seed, STREAM_X1).standard_normal(shape)


def initial_model(cfg: RunConfig) -> ArrayRecord:
    """The strategies' ``initial_arrays``: x^1 in the problem's shape ((q,) or (q, C)), float64."""
    return ArrayRecord([start_point(cfg)])


def evaluate_fn(cfg: RunConfig) -> Callable[[int, ArrayRecord], MetricRecord]:
    """Relative error ``||x - x*|| / ||x^1 - x*||`` of the strategy's model (spec 5.7) as Flower's ``evaluate_fn``;
    the strategies record it as the round's objective gap."""
    x_star = reference_solution(cfg).ravel()
    x1 = start_point(cfg).ravel()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        named = {k: v.numpy() for k, v in arrays.items()}
        x = ArrayLayout.of(named).flatten(named)
        return MetricRecord({"relative_error": relative_error(x, x_star, x1)})

    return evaluate


# ---------------------------------------------------------------------------------------------- builders
def recal_privacy(cfg: RunConfig) -> PrivacyTarget | Theorem3Calibration | None:
    """The strategies' ``privacy=`` from the run config: record-level DP-SGD with ``dp-calibration = dpsgd``
    (``epsilon-total``, ``delta``, ``clip-norm``, ``dp-sample-rate`` -- 0: batch-size over the records of one agent
    --, ``privacy-horizon``: the keys every family shares); otherwise the paper's mechanism (the reproduction
    setting) -- ``recal-epsilon`` > 0 calibrates sigma_1 to it (Theorem 3, ``recal-delta``, ``recal-r``), else
    ``recal-sigma1`` > 0 is used as given -- or None (both 0, or ``dp = false``: the non-private algorithm)."""
    if not cfg.dp:
        return None
    if cfg.dp_calibration == "dpsgd":
        from fedpdm_flower.fedapp.apps.common import calibration

        target = calibration(cfg)
        assert isinstance(target, PrivacyTarget)
        return target
    if cfg.recal_epsilon > 0:
        return Theorem3Calibration(epsilon=cfg.recal_epsilon, delta=cfg.recal_delta, R=cfg.recal_r)
    if cfg.recal_sigma1 > 0:
        return Theorem3Calibration(sigma1=cfg.recal_sigma1, delta=cfg.recal_delta, R=cfg.recal_r)
    return None


def recal_strategy(cfg: RunConfig) -> RecalFamily:
    """DP-RECAL (``dp-recal``) or a Table V baseline (``dp-pg-extra``, ``dp-nids``, ``dp-rw-admm``)."""
    from fedpdm_flower.strategies.recal import DPRECAL
    from fedpdm_flower.strategies.recal_baselines import DPNids, DPPGExtra, DPRWAdmm

    common: dict[str, Any] = {**federation(cfg), "privacy": recal_privacy(cfg), "graph": cfg.graph,
                              "nu1": cfg.recal_nu1, "nu2": cfg.recal_nu2}
    walk = {"walk": cfg.walk, "walk_start": cfg.walk_start, "xi_plan": cfg.xi_plan,
            "stop_on_budget": cfg.stop_on_budget}
    alg = cfg.algorithm
    if alg == "dp-recal":
        return DPRECAL(mode=cfg.recal_mode, alpha_scale=cfg.alpha_scale, **walk, **common)
    if alg == "dp-pg-extra":
        return DPPGExtra(alpha_scale=cfg.alpha_scale, **common)
    if alg == "dp-nids":
        return DPNids(alpha_scale=cfg.alpha_scale, **common)
    if alg == "dp-rw-admm":
        return DPRWAdmm(beta_scale=cfg.rw_beta_scale, activation_prob=cfg.rw_activation_prob, **walk, **common)
    raise KeyError(f"no DP-RECAL-family strategy for algorithm {alg!r}")


def recal_client(cfg: RunConfig, context: Context) -> LocalProblemAgent:
    """The node's agent: its partition of the run's problem (least squares, L_i from its data), the noise seed."""
    from fedpdm_flower.clients.recal import RecalClient
    from fedpdm_flower.clients.recal_baselines import NidsClient, PGExtraClient, RWAdmmClient
    from fedpdm_flower.fedapp.task import data_path_of

    pid, parts = node_of(context)
    cls: type[LocalProblemAgent] = {"dp-recal": RecalClient, "dp-pg-extra": PGExtraClient, "dp-nids": NidsClient,
                                    "dp-rw-admm": RWAdmmClient}[cfg.algorithm]
    path = data_path_of(context.node_config)
    if path is not None:  # the device's own rows (python -m simulations partition --partitioner recal writes them)
        return cls(local_agent(cfg, path), seed=cfg.noise_seed, context=context)
    problem = recal_problem(cfg)
    if parts != problem.n or not 0 <= pid < problem.n:
        raise ValueError(f"node partition-id={pid} num-partitions={parts} does not fit the run's {problem.n} agents "
                         "(num-clients)")
    return cls(problem.agents[pid], seed=cfg.noise_seed, context=context)


def local_agent(cfg: RunConfig, path: str) -> LocalLeastSquares:
    """A data-path node's least squares (B_i, b_i) from its own files, built as :func:`load_mnist_problem` builds
    every agent's (pixels / 255 without the bias column, spec A6 targets): rows in the files' order, so the
    partition command's recal split gives agent i exactly its rows of the shared problem."""
    from fedpdm_flower.fedapp.task import local_files

    if cfg.dataset != "mnist":
        raise ConfigError(f"node config data-path applies to {cfg.algorithm} on dataset 'mnist' only, not "
                          f"{cfg.dataset!r}")
    lf = local_files(cfg, path)
    feats = np.asarray(lf.train.x[:, :-1], dtype=np.float64)  # drop the bias column, as load_mnist_problem does
    targets = encode_targets(lf.train.y, cfg.label_mode, lf.num_classes, positive=(0, 2, 4, 6, 8))
    return LocalLeastSquares(feats, targets)


# ---------------------------------------------------------------------------------------------- run-config rules
def validate_config(cfg: RunConfig) -> None:
    """DP-RECAL's run-config rules (raise ConfigError naming the key), checked before any round."""
    if cfg.dataset not in ("mnist", "covtype"):
        raise ConfigError(f"run config key 'dataset' is {cfg.dataset!r}; {cfg.algorithm} solves the paper's elastic net "
                          "on 'mnist' (offline) or 'covtype' (data-source=online, scikit-learn's loader)")
    if cfg.dataset == "covtype" and cfg.data_source != "online":
        raise ConfigError("run config key 'data-source' must be 'online' for dataset 'covtype' (it is downloaded by "
                          "scikit-learn's fetch_covtype, so it needs a network)")
    if cfg.num_clients < 2:
        raise ConfigError("run config key 'num-clients' must be >= 2 for a graph of agents")
    try:
        topology.parse_graph(cfg.graph, cfg.num_clients, cfg.seed)
    except ValueError as err:
        raise ConfigError(f"run config key 'graph' is invalid: {err}") from None
    start = cfg.walk_start
    if start not in ("stationary", "uniform") and not (start.startswith("fixed:") and start[6:].isdigit()
                                                       and int(start[6:]) < cfg.num_clients):
        raise ConfigError(f"run config key 'walk-start' is {start!r}; use 'stationary', 'uniform' or 'fixed:<id>' with "
                          f"id < num-clients ({cfg.num_clients})")
    # recal-epsilon = 0 with recal-sigma1 = 0 is RECAL without noise (allowed, not private)
    if cfg.dp and cfg.dp_calibration == "eq36":
        raise ConfigError("run config key 'dp-calibration' = 'eq36' is DP-FedPDM's formula; the DP-RECAL family takes "
                          "'dpsgd' (record-level DP-SGD in the agents' gradient steps) or its own Theorem-3 noise "
                          "(recal-epsilon / recal-sigma1, any other value)")
    if cfg.dp and cfg.dp_calibration == "dpsgd":
        from fedpdm_flower.fedapp.apps.common import calibration

        target = calibration(cfg)
        assert isinstance(target, PrivacyTarget)
        graph = topology.parse_graph(cfg.graph, cfg.num_clients, cfg.seed)
        if cfg.algorithm in ("dp-recal", "dp-rw-admm"):
            steps = cfg.privacy_horizon or topology.plan_xi(cfg.num_server_rounds, graph, cfg.walk, rule=cfg.xi_plan)
        else:  # the synchronous baselines: one step per round (NIDS's first round two)
            steps = cfg.num_server_rounds + (1 if cfg.algorithm == "dp-nids" else 0)
        try:
            target.mechanism(1, steps, owner=cfg.algorithm)
        except ValueError as err:
            raise ConfigError(f"run config key 'epsilon-total' ({cfg.epsilon_total:g}): {err}") from None


def _validate_baseline(cfg: RunConfig, algorithm: str, xi: Callable[[topology.Graph], int]) -> None:
    validate_config(cfg)  # dataset, data-source, num-clients >= 2, graph, walk-start, DP-SGD target
    if not isinstance(recal_privacy(cfg), Theorem3Calibration) or cfg.recal_epsilon <= 0:
        return  # DP-SGD (checked), sigma_1 = recal-sigma1 as given, or the non-private algorithm
    graph = topology.parse_graph(cfg.graph, cfg.num_clients, cfg.seed)
    delta_s = data_free_sensitivity(algorithm, graph, cfg.alpha_scale, cfg.rw_beta_scale)
    try:
        baseline_sigma1(cfg.recal_epsilon, cfg.recal_delta, cfg.recal_r, xi(graph), delta_s)
    except zcdp.CalibrationOverflowError as err:
        raise ConfigError(f"run config key 'recal-r' = {cfg.recal_r} makes sigma_1 unrepresentable for "
                          f"{cfg.algorithm} (recal-epsilon={cfg.recal_epsilon}): {err}") from None


def validate_sync_config(cfg: RunConfig) -> None:
    """dp-pg-extra / dp-nids run-config rules (ConfigError naming the key): DP-RECAL's
    :func:`validate_config`, and a representable sigma_1 at ``xi = num-server-rounds``."""
    algorithm = "nids" if cfg.algorithm == "dp-nids" else "pg-extra"
    _validate_baseline(cfg, algorithm, lambda _g: cfg.num_server_rounds)


def validate_rw_admm_config(cfg: RunConfig) -> None:
    """dp-rw-admm run-config rules: DP-RECAL's, and a representable sigma_1 at the planned LCI
    (:func:`fedpdm_flower.fedapp.topology.plan_xi` of num-server-rounds token hops, rule ``xi-plan``)."""
    _validate_baseline(cfg, "rw-admm", lambda g: topology.plan_xi(cfg.num_server_rounds, g, cfg.walk, rule=cfg.xi_plan))
