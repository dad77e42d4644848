"""DPQ-DSGD from a run config: validation, run constants, the nodes' data and model (seed 004, spec dp_quantized.md).

The one place where the ``dpq-*`` run-config keys become the framework-free objects of
:mod:`fedapp.algorithms.dpq` and :mod:`fedapp.privacy.dpq`; the Flower strategy (strategies/dpq.py), its agents
(clients/dpq.py), the experiment script (simulations/dpq_table.py) and the tests all call it, so a Flower run and
:func:`fedapp.algorithms.dpq.simulate` on :func:`network` use the same numbers.

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
    Evaluate on the first N test samples (and the first N samples of each node's shard for the train accuracy);
    0 = all (MNIST: the 10k test set, 12k per shard).
``dpq-eval-average``
    In evaluation rounds every node also uploads its exact x_i so the server can evaluate the node-average model.
    Evaluation only and **outside the DP guarantee** (spec 7.7's ``debug_leak_state``), hence off by default.

Shared keys: ``graph`` (Metropolis-Hastings weights on it, spec 6.3; default the ring), ``num-clients`` (n),
``dataset`` (mnist / fashion-mnist), ``model`` (a buffer-free torch net; ``lenet5-valid`` is spec 6.3's d = 44,426),
``partitioner`` (``paper`` = the paper's "uniformly divided" IID split, spec 9.22; or iid / dirichlet / label-k),
``samples-per-client`` (keep the first N samples of each node's shard; 0 = all), ``seed`` (data split, x_0 and
every stream of :mod:`fedapp.algorithms.dpq`), ``eval-every``.

Wire format of unquantized messages (dp-only, dsgd): float32 (``{"dense": float32[d]}``, spec 3's 32 d bits), and
:class:`~fedapp.algorithms.dpq.DPQParams` has ``float_messages="float32"``, so the simulator rounds the messages the
same way and stays bit-equal to the Flower run; the states x are float64 everywhere.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from fedapp import topology
from fedapp.algorithms import dpq
from fedapp.config import ConfigError, RunConfig
from fedapp.privacy.dpq import DPQSchedule

if TYPE_CHECKING:
    from fedapp.data.sources import ArrayDataset
    from fedapp.models.torch_net import TorchNet

#: buffer-free torch networks on 28x28 grey images (x is exactly the trainable weights)
DPQ_MODELS = ("lenet5-valid", "lenet5", "cnn")
DPQ_DATASETS = ("mnist", "fashion-mnist")

__all__ = [
    "DPQ_DATASETS",
    "DPQ_MODELS",
    "build_net",
    "eval_data",
    "evaluate",
    "horizon",
    "initial_model",
    "network",
    "node_data",
    "node_objective",
    "params",
    "schedule",
    "validate_config",
]


def horizon(cfg: RunConfig) -> int:
    """K: ``dpq-horizon``, or ``num-server-rounds - 2`` when it is 0 (bootstrap round + k = 0..K)."""
    return cfg.dpq_horizon or cfg.num_server_rounds - 2


def schedule(cfg: RunConfig) -> DPQSchedule:
    """The accountant's :class:`~fedapp.privacy.dpq.DPQSchedule` (steps, batch, noise and delta schedules)."""
    return DPQSchedule(
        K=horizon(cfg), a1=cfg.dpq_a1, alpha=cfg.dpq_alpha, a2=cfg.dpq_a2, beta=cfg.dpq_beta, a3=cfg.dpq_a3,
        gamma=cfg.dpq_gamma, dp_C=cfg.dpq_c, delta_exp=cfg.dpq_delta_exp, sigma_exp=cfg.dpq_sigma_exp,
        sigma_offset=cfg.dpq_sigma_offset, sigma_scale=cfg.dpq_sigma_scale,
    )


def params(cfg: RunConfig) -> dpq.DPQParams:
    """Run constants of the configured variant (float32 unquantized messages, module docstring)."""
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
    if cfg.dpq_variant in ("dpq", "dp-only"):
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


# ---------------------------------------------------------------------------------------------- data and model


def _scheme(cfg: RunConfig) -> str:
    # the paper's split is "uniformly divided": a seeded IID split (spec 6.3, 9.22)
    return "iid" if cfg.partitioner == "paper" else cfg.partitioner


def node_data(cfg: RunConfig, partition_id: int) -> ArrayDataset:
    """Node ``partition_id``'s shard (:func:`fedapp.data.load_partition`, the first ``samples-per-client`` if set);
    for mnist / paper this is :func:`fedapp.algorithms.dpq.mnist_setup`'s shard."""
    from fedapp.data import load_partition

    shard = load_partition(cfg.dataset, _scheme(cfg), partition_id, cfg.num_clients, cfg.seed, cfg.data_source,
                           labels_per_client=cfg.labels_per_client, dirichlet_alpha=cfg.dirichlet_alpha)
    if cfg.samples_per_client:
        shard = shard.subset(np.arange(min(cfg.samples_per_client, len(shard))))
    return shard


def build_net(cfg: RunConfig) -> TorchNet:
    """A fresh :class:`~fedapp.models.torch_net.TorchNet` of the configured model."""
    from fedapp.data import load_dataset
    from fedapp.models.torch_net import TorchNet

    info = load_dataset(cfg.dataset, cfg.data_source)[2]
    return TorchNet(cfg.model, info.num_classes, info.num_features)


def initial_model(cfg: RunConfig, net: TorchNet | None = None) -> dpq.FloatArray:
    """The common, data-independent x_0: torch's default init seeded from ``default_rng([seed, 53])`` (spec 2.3),
    the same as :func:`fedapp.algorithms.dpq.mnist_setup`'s; every node computes it itself (no download)."""
    return (net or build_net(cfg)).init(np.random.default_rng([cfg.seed, dpq.STREAM_DPQ_INIT]))


_OBJECTIVES: dict[tuple[Any, ...], dpq.TorchObjective] = {}


def _data_key(cfg: RunConfig) -> tuple[Any, ...]:
    return (cfg.dataset, cfg.data_source, _scheme(cfg), cfg.num_clients, cfg.seed, cfg.samples_per_client,
            cfg.labels_per_client, cfg.dirichlet_alpha, cfg.model)


def node_objective(cfg: RunConfig, partition_id: int) -> dpq.TorchObjective:
    """Node ``partition_id``'s f_i (mean cross-entropy of its own net on its shard), cached per process."""
    key = (*_data_key(cfg), partition_id)
    if key not in _OBJECTIVES:
        if len(_OBJECTIVES) >= 16:
            _OBJECTIVES.clear()
        _OBJECTIVES[key] = dpq.TorchObjective(build_net(cfg), node_data(cfg, partition_id))
    return _OBJECTIVES[key]


_TESTS: dict[tuple[str, str, int], ArrayDataset] = {}


def eval_data(cfg: RunConfig) -> ArrayDataset:
    """The test set, its first ``dpq-eval-limit`` samples if set (cached per process)."""
    from fedapp.data import load_dataset

    key = (cfg.dataset, cfg.data_source, cfg.dpq_eval_limit)
    if key not in _TESTS:
        test = load_dataset(cfg.dataset, cfg.data_source)[1]
        if cfg.dpq_eval_limit:
            test = test.subset(np.arange(min(cfg.dpq_eval_limit, len(test))))
        _TESTS.clear()
        _TESTS[key] = test
    return _TESTS[key]


def evaluate(net: TorchNet, x: dpq.FloatArray, data: ArrayDataset, limit: int = 0) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of the flat model x on ``data`` (its first ``limit`` samples if > 0)."""
    if limit and limit < len(data):
        data = data.subset(np.arange(limit))
    return net.evaluate(x, data.x, data.y)


def network(cfg: RunConfig) -> dpq.MnistSetup:
    """Every node of the run in one process (for :func:`fedapp.algorithms.dpq.simulate`): Metropolis A on the
    graph, the nodes' objectives (one shared net), the common x_0 and the (limited) test set."""
    g = topology.parse_graph(cfg.graph, cfg.num_clients, cfg.seed)
    w = topology.metropolis_weights(g)
    topology.validate_mixing(w, g)
    net = build_net(cfg)
    x0 = initial_model(cfg, net)
    objectives = [dpq.TorchObjective(net, node_data(cfg, i)) for i in range(cfg.num_clients)]
    return dpq.MnistSetup(A=w, graph=g, objectives=objectives, x0=x0, test=eval_data(cfg), net=net)
