"""Seed 004 family (DPQ-DSGD and its ablations): run-config keys -> the public constructors, and the MNIST setup.

The one place where the ``dpq-*`` run-config keys become :class:`fedpdm_flower.strategies.dpq.DPQDSGD` /
:class:`fedpdm_flower.clients.dpq.DPQClient` (:func:`dpq_strategy`, :func:`dpq_client`) and the framework-free objects of
:mod:`fedpdm_flower.fedapp.algorithms.dpq` and :mod:`fedpdm_flower.fedapp.privacy.dpq` (:func:`params`, :func:`schedule`, :func:`network`). The
Flower run, the in-process driver, :func:`fedpdm_flower.fedapp.algorithms.dpq.simulate` on :func:`network` (the experiment script
simulations/dpq_table.py) and the tests use the same numbers, data and x_0.

Keys (spec 2.1 defaults = the paper's MNIST preset, spec 6.1)
--------------------------------------------------------------
``dpq-variant``
    ``dpq`` (noise + quantization, the paper), ``dp-only`` (noise, float messages), ``quant-only`` (quantization, no
    noise), ``dsgd`` (neither: plain DSGD with the lazy mixing matrix ``(1 - beta_hat) I + beta_hat A``); spec 2.5.
``dpq-q-step``
    Delta of eq. (3) (1, 5, 10 in the paper); read only by the quantizing variants.
``dpq-sigma-exp``, ``dpq-sigma-offset``, ``dpq-sigma-scale``
    Noise std ``sigma_k = scale (k + offset)^sigma`` (paper: sigma in {-0.1, 0.1, 0.2}, offset 5; theory offset 1).
``dpq-a1``, ``dpq-alpha``, ``dpq-a2``, ``dpq-beta``, ``dpq-a3``, ``dpq-gamma``
    ``alpha_hat = a1 (ln K)^2 / K^alpha``, ``beta_hat = a2 / K^beta`` (must be < 1), batch
    ``gamma_hat = floor(a3 K^gamma) + 1``; named ``dpq-*`` because ``beta`` / ``gamma`` are seed 000's keys.
``dpq-delta-exp``, ``dpq-c``
    The accountant's ``delta_k = (k + 1)^-delta`` and Definition 1's C (no clipping: C is an accountant parameter
    only, as in the paper; spec 2.3, 9.11).
``dpq-horizon``
    The horizon K of the schedule. 0 (default) means ``K = num-server-rounds - 2``: round 1 is the bootstrap (every
    node publishes m_{i,0}, spec 7.2) and rounds 2..K+2 are the iterations k = 0..K, so the run is Algorithm 1 with
    its K + 1 updates (the paper's K = 2000 is ``num-server-rounds = 2002``). A positive value runs the first
    ``num-server-rounds`` rounds of the horizon-K schedule (e.g. a few rounds with the paper's batch of 50); a run
    cannot go past its horizon (spec 9.19), so ``num-server-rounds <= dpq-horizon + 2``.
``dpq-eval-limit``
    The nodes evaluate their own models on the first N test samples (and the first N samples of their shard for the
    train accuracy); 0 = all (MNIST: the 10k test set, 12k per shard).
``dpq-eval-average``
    In evaluation rounds every node also uploads its exact x_i and the server evaluates the node-average model on
    the whole test set (the app's central evaluation). Evaluation only and **outside the DP guarantee** (spec 7.7's
    ``debug_leak_state``), hence off by default; the app's nodes allow it (``share_model``) exactly when it is on.

Shared keys: ``graph`` (Metropolis-Hastings weights on it, spec 6.3; default the ring), ``num-clients`` (n),
``dataset`` (mnist / fashion-mnist), ``model`` (a buffer-free torch net; ``lenet5-valid`` is spec 6.3's d = 44,426),
``partitioner`` (``paper`` = the paper's "uniformly divided" IID split, spec 9.22; or iid / dirichlet / label-k),
``samples-per-client`` (keep the first N samples of each node's shard; 0 = all), ``seed`` (data split, x_0 and,
as every node's device seed, every stream of :mod:`fedpdm_flower.fedapp.algorithms.dpq`), ``eval-every``.

Wire format of unquantized messages (dp-only, dsgd): float32 (``{"dense": float32[d]}``, spec 3's 32 d bits), and
:func:`params` has ``float_messages="float32"``, so the simulator rounds the messages the same way and stays bit-equal
to the Flower run; the states x are float64 everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord, Context

from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.algorithms import dpq
from fedpdm_flower.fedapp.apps.common import federation, node_of
from fedpdm_flower.fedapp.config import ConfigError, RunConfig, parse_run_config
from fedpdm_flower.fedapp.localdata import ArrayData
from fedpdm_flower.fedapp.privacy.dpq import DPQSchedule, TimeVaryingNoise
from fedpdm_flower.fedapp.privacy.target import PrivacyTarget

if TYPE_CHECKING:
    from fedpdm_flower.clients.dpq import DPQClient
    from fedpdm_flower.fedapp.data.sources import ArrayDataset
    from fedpdm_flower.fedapp.models.torch_net import TorchNet
    from fedpdm_flower.strategies.dpq import DPQDSGD

#: buffer-free torch networks on 28x28 grey images (x is exactly the trainable weights)
DPQ_MODELS = ("lenet5-valid", "lenet5", "cnn", "tiny-cnn")
DPQ_DATASETS = ("mnist", "fashion-mnist")

__all__ = [
    "DPQ_DATASETS",
    "DPQ_MODELS",
    "DPQNetwork",
    "build_net",
    "dpq_client",
    "dpq_strategy",
    "eval_data",
    "evaluate",
    "horizon",
    "initial_arrays",
    "initial_model",
    "mnist_setup",
    "network",
    "node_accuracies",
    "node_data",
    "params",
    "schedule",
    "validate_config",
]


# ---------------------------------------------------------------------------------------------- the public classes
def dpq_strategy(cfg: RunConfig) -> DPQDSGD:
    """The run's :class:`fedpdm_flower.strategies.dpq.DPQDSGD`: the ``dpq-*`` keys as its keyword arguments."""
    from fedpdm_flower.strategies.dpq import DPQDSGD

    quantized = cfg.dpq_variant in ("dpq", "quant-only")
    return DPQDSGD(
        privacy=dpq_privacy(cfg), q_step=cfg.dpq_q_step if quantized else 0.0, horizon=cfg.dpq_horizon or None,
        a1=cfg.dpq_a1, alpha=cfg.dpq_alpha, a2=cfg.dpq_a2, beta=cfg.dpq_beta, a3=cfg.dpq_a3, gamma=cfg.dpq_gamma,
        evaluate_average=cfg.dpq_eval_average, graph=cfg.graph, **federation(cfg),
    )


def dpq_privacy(cfg: RunConfig) -> PrivacyTarget | TimeVaryingNoise | None:
    """The strategy's ``privacy=`` of the configured variant. The private variants (``dpq``, ``dp-only``) take
    record-level DP-SGD with ``dp-calibration = dpsgd`` (``epsilon-total``, ``delta``, ``clip-norm``,
    ``dp-sample-rate``, ``privacy-horizon``: the keys every family shares) and otherwise the paper's time-varying
    noise (the ``dpq-sigma-*``, ``dpq-delta-exp`` and ``dpq-c`` keys); ``dp = false`` and the noise-free variants
    (``quant-only``, ``dsgd``) have none."""
    if not cfg.dp or cfg.dpq_variant not in ("dpq", "dp-only"):
        return None
    if cfg.dp_calibration == "dpsgd":
        from fedpdm_flower.fedapp.apps.common import calibration

        target = calibration(cfg)
        assert isinstance(target, PrivacyTarget)
        return target
    return TimeVaryingNoise(sigma_exp=cfg.dpq_sigma_exp, sigma_offset=cfg.dpq_sigma_offset,
                            sigma_scale=cfg.dpq_sigma_scale, delta_exp=cfg.dpq_delta_exp, dp_C=cfg.dpq_c)


def dpq_client(cfg: RunConfig, context: Context) -> DPQClient:
    """Node ``partition-id``'s :class:`fedpdm_flower.clients.dpq.DPQClient`: the zoo network on its shard, the (limited) test set,
    the run seed as the device's seed."""
    from fedpdm_flower.clients.dpq import DPQClient
    from fedpdm_flower.fedapp.task import data_path_of, local_files

    pid, _ = node_of(context)
    path = data_path_of(context.node_config)
    test: ArrayDataset | None
    if path is None:
        shard, test, net = node_data(cfg, pid), eval_data(cfg), build_net(cfg)
    else:  # the device's own files: its shard, and its local test set if the npz holds one (else no test metrics)
        lf = local_files(cfg, path)
        shard, test, net = lf.train, lf.test, build_net(cfg, (lf.num_classes, lf.num_features))
    return DPQClient(net, ArrayData(shard.x, shard.y), context=context, seed=cfg.seed,
                     test_data=None if test is None else ArrayData(test.x, test.y),
                     eval_samples=cfg.dpq_eval_limit or None, share_model=cfg.dpq_eval_average)


def initial_arrays(cfg: RunConfig) -> ArrayRecord:
    """x_0 as the strategy's ``initial_arrays``: the zoo network's state dict (float32) after :func:`initial_model`."""
    net = build_net(cfg)
    initial_model(cfg, net)
    return ArrayRecord(net.module.state_dict())


# ---------------------------------------------------------------------------------------------- run config
def horizon(cfg: RunConfig) -> int:
    """K: ``dpq-horizon``, or ``num-server-rounds - 2`` when it is 0 (bootstrap round + k = 0..K)."""
    return cfg.dpq_horizon or cfg.num_server_rounds - 2


def schedule(cfg: RunConfig) -> DPQSchedule:
    """The accountant's :class:`~fedpdm_flower.fedapp.privacy.dpq.DPQSchedule` (steps, batch, noise and delta schedules)."""
    return DPQSchedule(
        K=horizon(cfg), a1=cfg.dpq_a1, alpha=cfg.dpq_alpha, a2=cfg.dpq_a2, beta=cfg.dpq_beta, a3=cfg.dpq_a3,
        gamma=cfg.dpq_gamma, dp_C=cfg.dpq_c, delta_exp=cfg.dpq_delta_exp, sigma_exp=cfg.dpq_sigma_exp,
        sigma_offset=cfg.dpq_sigma_offset, sigma_scale=cfg.dpq_sigma_scale,
    )


def params(cfg: RunConfig) -> dpq.DPQParams:
    """The simulator's run constants of the configured variant: what every node of the Flower run uses (its seed is
    the run seed; float32 unquantized messages, module docstring)."""
    base = dpq.params_from_schedule(schedule(cfg), q_step=cfg.dpq_q_step, seed=cfg.seed, float_messages="float32")
    return dpq.ablation(base, cfg.dpq_variant)


def validate_config(cfg: RunConfig) -> None:
    """dpq-dsgd run-config rules (ConfigError naming the key), checked before any round."""
    if cfg.dataset not in DPQ_DATASETS:
        raise ConfigError(f"run config key 'dataset' is {cfg.dataset!r}; dpq-dsgd trains a CNN on 28x28 images: "
                          f"{', '.join(DPQ_DATASETS)}")
    if cfg.model not in DPQ_MODELS:
        raise ConfigError(f"run config key 'model' is {cfg.model!r}; dpq-dsgd noises and quantizes every weight of a "
                          f"buffer-free torch net: {', '.join(DPQ_MODELS)} (spec 6.3: 'lenet5-valid', d = 44,426)")
    if cfg.num_clients < 2:
        raise ConfigError("run config key 'num-clients' must be >= 2 for a graph of nodes")
    try:
        graph = topology.parse_graph(cfg.graph, cfg.num_clients, cfg.seed)
        topology.validate_mixing(topology.metropolis_weights(graph), graph)
    except ValueError as err:
        raise ConfigError(f"run config key 'graph' is invalid: {err}") from None
    if cfg.dpq_horizon == 1:
        raise ConfigError("run config key 'dpq-horizon' must be 0 (= num-server-rounds - 2) or a horizon K >= 2")
    if cfg.dpq_horizon == 0 and cfg.num_server_rounds < 4:
        raise ConfigError(f"run config key 'num-server-rounds' is {cfg.num_server_rounds}; with dpq-horizon = 0 the "
                          "horizon is K = num-server-rounds - 2 (bootstrap round + k = 0..K) and must be >= 2")
    K = horizon(cfg)
    if cfg.num_server_rounds > K + 2:
        raise ConfigError(f"run config key 'num-server-rounds' ({cfg.num_server_rounds}) exceeds dpq-horizon + 2 "
                          f"({K + 2}): the schedule is built for k = 0..K and a run cannot be extended (spec 9.19)")
    if not cfg.dpq_a2 < math.pow(K, cfg.dpq_beta):
        raise ConfigError(f"run config key 'dpq-a2' ({cfg.dpq_a2}) must be < K^beta = {math.pow(K, cfg.dpq_beta):.6g} "
                          f"(beta_hat = a2 / K^beta < 1, Theorem 1; K = {K})")
    if cfg.dp and cfg.dpq_variant in ("dpq", "dp-only") and cfg.dp_calibration == "eq36":
        raise ConfigError("run config key 'dp-calibration' = 'eq36' is DP-FedPDM's formula; dpq-dsgd takes 'dpsgd' "
                          "(record-level DP-SGD in the gradient) or its own time-varying noise (any other value)")
    if cfg.dp and cfg.dpq_variant in ("dpq", "dp-only") and cfg.dp_calibration == "dpsgd":
        _check_dpsgd_target(cfg)
    elif isinstance(dpq_privacy(cfg), TimeVaryingNoise):
        for k in (0, K + 1):  # sigma_k is monotone in k: the ends bound it
            sig = dpq.sigma_k(k, cfg.dpq_sigma_exp, scale=cfg.dpq_sigma_scale, offset=cfg.dpq_sigma_offset)
            if not (math.isfinite(sig) and sig > 0):
                raise ConfigError(f"run config key 'dpq-sigma-exp' ({cfg.dpq_sigma_exp}) gives sigma_{k} = {sig}, "
                                  "which is not a usable noise std")
            # The levels of eq. (3) are int64. With sigma_k >= 2^63 steps, some of the d coordinates' noise exceeds
            # that range in practice every time (P(|N(0,1)| > 1) = 0.32 per coordinate), so every node fails.
            if cfg.dpq_variant == "dpq" and not sig / cfg.dpq_q_step < 2.0**63:
                raise ConfigError(
                    f"run config keys 'dpq-sigma-exp' ({cfg.dpq_sigma_exp:g}), 'dpq-sigma-scale' "
                    f"({cfg.dpq_sigma_scale:g}) and 'dpq-q-step' ({cfg.dpq_q_step:g}) give a noise std sigma_{k} = "
                    f"{sig:.3g}, that is {sig / cfg.dpq_q_step:.3g} quantizer steps, beyond the int64 levels of the "
                    "wire format (2^63 = 9.2e+18): every message would fail to quantize; lower the noise or raise "
                    "dpq-q-step"
                )
    try:
        params(cfg)
    except ValueError as err:
        raise ConfigError(f"run config keys 'dpq-*' are inconsistent: {err}") from None


def _check_dpsgd_target(cfg: RunConfig) -> None:
    """DP-SGD: the target must be reachable over the run's updates (num-server-rounds - 1, or privacy-horizon)."""
    from fedpdm_flower.fedapp.apps.common import calibration

    target = calibration(cfg)
    assert isinstance(target, PrivacyTarget)
    updates = cfg.num_server_rounds - 1
    if cfg.privacy_horizon and cfg.privacy_horizon < updates:
        raise ConfigError(f"run config key 'privacy-horizon' ({cfg.privacy_horizon}) covers fewer DP-SGD steps than the "
                          f"{updates} updates of num-server-rounds = {cfg.num_server_rounds}")
    try:
        target.mechanism(1, updates, owner="dpq-dsgd")
    except ValueError as err:
        raise ConfigError(f"run config key 'epsilon-total' ({cfg.epsilon_total:g}): {err}") from None


# ---------------------------------------------------------------------------------------------- data and model
def _scheme(cfg: RunConfig) -> str:
    # the paper's split is "uniformly divided": a seeded IID split (spec 6.3, 9.22)
    return "iid" if cfg.partitioner == "paper" else cfg.partitioner


def node_data(cfg: RunConfig, partition_id: int) -> ArrayDataset:
    """Node ``partition_id``'s shard (:func:`fedpdm_flower.fedapp.data.load_partition`, the first ``samples-per-client`` if set)."""
    from fedpdm_flower.fedapp.data import load_partition

    shard = load_partition(cfg.dataset, _scheme(cfg), partition_id, cfg.num_clients, cfg.seed, cfg.data_source,
                           labels_per_client=cfg.labels_per_client, dirichlet_alpha=cfg.dirichlet_alpha)
    if cfg.samples_per_client:
        shard = shard.subset(np.arange(min(cfg.samples_per_client, len(shard))))
    return shard


def build_net(cfg: RunConfig, shape: tuple[int, int] | None = None) -> TorchNet:
    """A fresh :class:`~fedpdm_flower.fedapp.models.torch_net.TorchNet` of the configured model; ``shape`` = (classes, features)
    when known (a data-path node), else read from the dataset."""
    from fedpdm_flower.fedapp.data import load_dataset
    from fedpdm_flower.fedapp.models.torch_net import TorchNet

    if shape is None:
        info = load_dataset(cfg.dataset, cfg.data_source)[2]
        shape = (info.num_classes, info.num_features)
    return TorchNet(cfg.model, *shape)


def initial_model(cfg: RunConfig, net: TorchNet | None = None) -> dpq.FloatArray:
    """The common, data-independent x_0: torch's default init seeded from ``default_rng([seed, 53])`` (spec 2.3)."""
    return (net or build_net(cfg)).init(np.random.default_rng([cfg.seed, dpq.STREAM_DPQ_INIT]))


_TESTS: dict[tuple[str, str, int], ArrayDataset] = {}


def eval_data(cfg: RunConfig) -> ArrayDataset:
    """The test set, its first ``dpq-eval-limit`` samples if set (cached per process)."""
    from fedpdm_flower.fedapp.data import load_dataset

    key = (cfg.dataset, cfg.data_source, cfg.dpq_eval_limit)
    if key not in _TESTS:
        test = load_dataset(cfg.dataset, cfg.data_source)[1]
        if cfg.dpq_eval_limit:
            test = test.subset(np.arange(min(cfg.dpq_eval_limit, len(test))))
        _TESTS.clear()
        _TESTS[key] = test
    return _TESTS[key]


def evaluate(net: TorchNet, x: dpq.FloatArray, data: ArrayDataset | ArrayData, limit: int = 0) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of the flat model x on ``data`` (its first ``limit`` samples if > 0)."""
    n = min(limit, len(data)) if limit else len(data)
    return net.evaluate(x, data.x[:n], data.y[:n])


# ---------------------------------------------------------------------------------------------- every node in one process
@dataclass
class DPQNetwork:
    """Every node of a run (spec 6.3): mixing matrix ``A`` on ``graph``, the nodes' objectives (one shared net) on
    their ``shards``, the common x_0, the (limited) test set and the net."""

    A: dpq.FloatArray
    graph: topology.Graph
    objectives: list[dpq.TorchObjective]
    shards: list[ArrayData]
    x0: dpq.FloatArray
    test: ArrayDataset
    net: TorchNet


def network(cfg: RunConfig) -> DPQNetwork:
    """The run in one process, for :func:`fedpdm_flower.fedapp.algorithms.dpq.simulate`: the same graph, shards, x_0 and test set
    as the Flower run of ``cfg``."""
    g = topology.parse_graph(cfg.graph, cfg.num_clients, cfg.seed)
    w = topology.metropolis_weights(g)
    topology.validate_mixing(w, g)
    net = build_net(cfg)
    x0 = initial_model(cfg, net)
    shards = [ArrayData(s.x, s.y) for s in (node_data(cfg, i) for i in range(cfg.num_clients))]
    objectives = [dpq.TorchObjective(net, shard) for shard in shards]
    return DPQNetwork(A=w, graph=g, objectives=objectives, shards=shards, x0=x0, test=eval_data(cfg), net=net)


def mnist_setup(num_nodes: int = 5, *, graph: str = "ring", seed: int = 0, model: str = "lenet5-valid",
                source: str = "offline", samples_per_node: int | None = None) -> DPQNetwork:
    """Spec 6.3: MNIST split IID (seeded shuffle, equal shards: 12,000 each for 5 nodes), Metropolis weights on
    ``graph`` (ring: 1/3 everywhere, rho_L = 0.4607 for 5 nodes), the unpadded LeNet-5 (d = 44,426) with torch's
    default init seeded from ``default_rng([seed, 53])``, shared by all nodes; the full 10k test set.
    ``samples_per_node`` keeps only the first that many samples of each shard (for tests)."""
    return network(parse_run_config({
        "algorithm": "dpq-dsgd", "dataset": "mnist", "data-source": source, "partitioner": "iid", "model": model,
        "num-clients": num_nodes, "clients-per-round": num_nodes, "graph": graph, "seed": seed,
        "samples-per-client": samples_per_node or 0, "num-server-rounds": 4,
    }))


def node_accuracies(setup: DPQNetwork, x: dpq.FloatArray, *, test_limit: int | None = None) -> dict[str, dpq.FloatArray]:
    """Spec 6.3 / 9.17: each node's own x_i on its shard (``train``) and on the test set (``test``, the first
    ``test_limit`` samples if given); arrays of length n (report mean, min, max)."""
    xs = np.asarray(x, dtype=np.float64)
    train = [evaluate(setup.net, xs[i], shard)[0] for i, shard in enumerate(setup.shards)]
    test = [evaluate(setup.net, xs[i], setup.test, test_limit or 0)[0] for i in range(len(setup.shards))]
    return {"train": np.array(train), "test": np.array(test)}
