"""Algorithm key -> (strategy builder, client builder, the run-config keys it reads).

`parse_run_config` rejects unknown algorithm keys against this table; the ServerApp, the ClientApp and the
in-process driver all build their objects from it, so adding an algorithm is one entry here. The builders live in
:mod:`fedpdm_flower.fedapp.apps` and call the public constructors (``strategies.*`` / ``clients.*``) a Flower user calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedpdm_flower.clients.base import FedClient
    from fedpdm_flower.fedapp.config import RunConfig
    from fedpdm_flower.strategies.base import FederatedStrategy

# keys every algorithm reads
COMMON_KEYS = (
    "algorithm", "dataset", "data-source", "partitioner", "model", "num-clients", "clients-per-round",
    "first-round-all", "num-server-rounds", "seed", "out-dir", "batch-size", "eta0", "max-local-steps", "init-std",
    "beta", "labels-per-client", "samples-per-client", "dirichlet-alpha", "eval-every", "node-wait-s", "identify-nodes",
    "dp",
)
DP_KEYS = ("dp-calibration", "dp-sample-rate", "epsilon-total", "delta", "clip-norm", "c0", "privacy-q-power",
           "privacy-horizon")
FEDPDM_KEYS = ("rho", "nu", "gamma")
FEDPDM_CHECKS = "fedpdm_flower.fedapp.apps.fedpdm:validate_config"
#: x_0^0 of the seed-000 family: the numpy model's N(0, init-std^2) point, or a torch zoo network's initial state dict
BROADCAST_INITIAL = "fedpdm_flower.fedapp.apps.fedpdm:broadcast_initial"
SPARSE_KEYS = ("alpha-up", "alpha-down", "uplink-sparsifier")
IADMM_KEYS = (
    "iadmm-epsilon", "iadmm-beta", "rho-schedule", "rho", "rho-c1", "rho-c2", "rho-period", "rho-max", "noise-seed",
    "total-samples", "device",
    # record-level DP-SGD in the local solves (dp-calibration = dpsgd), and the delta every figure is reported at
    "dp-calibration", "dp-sample-rate", "epsilon-total", "delta", "clip-norm", "privacy-horizon",
)
OBJP_KEYS = (*IADMM_KEYS, "eta-schedule", "eta-scale", "sensitivity-mode", "clip-l1")
OUTP_KEYS = (*IADMM_KEYS, "outp-delta", "outp-noise-std", "outp-order", "outp-grad-scale")


@dataclass(frozen=True)
class AlgorithmSpec:
    """How to build one algorithm: dotted paths (imported lazily) and the run-config keys it reads.

    ``strategy`` is a builder ``(cfg) -> strategy`` and ``client`` a builder ``(cfg, context) -> client`` of
    :mod:`fedpdm_flower.fedapp.apps`; ``initial`` builds the initial ArrayRecord and ``evaluate`` Flower's ``evaluate_fn``.
    """

    strategy: str
    client: str
    keys: tuple[str, ...]
    summary: str
    paper: str
    #: dotted path of a `validate(cfg)` function with the algorithm's own run-config rules ("" = none)
    checks: str = ""
    #: False for algorithms whose privacy keys are their own (the DP_KEYS of seed 000 are not echoed)
    uses_dp_keys: bool = True
    initial: str = "fedpdm_flower.fedapp.apps.common:numpy_initial_model"
    #: dotted path of the builder ``(cfg) -> evaluate_fn`` of a public algorithm (Flower's evaluate_fn signature)
    evaluate: str = "fedpdm_flower.fedapp.apps.common:evaluate_fn"

    def validate(self, cfg: RunConfig) -> None:
        """Apply the algorithm's own run-config rules (raise ConfigError naming the key)."""
        if self.checks:
            _load(self.checks)(cfg)

    def make_strategy(self, cfg: RunConfig, *, evaluate: bool = True) -> FederatedStrategy:
        """The run's strategy, holding its initial model and (with ``evaluate``) the central evaluation."""
        strategy = _load(self.strategy)(cfg)
        # the reproduction evaluates the global model centrally, as the papers do (results.json's test_accuracy):
        # no client-side evaluation exchange, so its bytes and wall time stay the algorithm's alone
        strategy.fraction_evaluate, strategy.min_evaluate_nodes = 0.0, 0
        strategy.initialize(_load(self.initial)(cfg))
        strategy.prepare(cfg.num_server_rounds, evaluate_fn=_load(self.evaluate)(cfg) if evaluate else None)
        return strategy  # type: ignore[no-any-return]

    def make_client(self, cfg: RunConfig, context: Any) -> FedClient:
        """This node's client for the run."""
        return _load(self.client)(cfg, context)  # type: ignore[no-any-return]

    def used_config(self, cfg: RunConfig) -> dict[str, Any]:
        """The hyperparameters this algorithm actually reads (echoed under "config" in results.json)."""
        full = cfg.to_run_config()
        keys = COMMON_KEYS + self.keys + (DP_KEYS if cfg.dp and self.uses_dp_keys else ())
        return {k: full[k] for k in full if k in keys}


def _load(path: str) -> Any:
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


FEDREP_KEYS = (
    "conspar-fraction", "conspar-alpha", "buffer-size", "secagg-mode", "sparse-downlink", "aggregator", "geomed-iters",
    "tmean-fraction", "cclip-tau", "cclip-iters", "local-steps", "lr", "momentum", "lr-decay-round",
    "byzantine-clients", "attack", "coord-attack", "alie-z", "foe-eps",
)
SPARSESECAGG_PAPER = "Ergun, Sami, Guler, Sparsified Secure Aggregation for Privacy-Preserving Federated Learning, arXiv 2112.12872"
SEED003 = "Yang, Wang, Li, FedREP: A Byzantine-Robust, Communication-Efficient and Privacy-Preserving Framework, arXiv 2303.05206"
SHARE_PAPER = "Velicheti, Xia, Koyejo, Secure Byzantine-Robust Distributed Learning via Clustering, arXiv 2110.02940"
FEDREP_CHECKS = "fedpdm_flower.fedapp.apps.fedrep:validate_config"
RECAL_KEYS = (
    "graph", "walk", "walk-start", "recal-mode", "recal-epsilon", "recal-sigma1", "recal-r", "recal-delta", "xi-plan",
    "stop-on-budget", "alpha-scale", "recal-nu1", "recal-nu2", "label-mode", "recal-samples", "x1-init", "noise-seed",
)
SEED001 = "DP-RECAL: decentralized primal-dual learning with relay communication (seed 001)"
RECAL_CHECKS = "fedpdm_flower.fedapp.apps.recal:validate_config"
# DP-RECAL's Table V baselines (seed 001, spec 5.6): the DP and problem keys of dp-recal they read
SYNC_BASELINE_KEYS = (
    "graph", "recal-epsilon", "recal-sigma1", "recal-r", "recal-delta", "alpha-scale", "recal-nu1", "recal-nu2",
    "label-mode", "recal-samples", "x1-init", "noise-seed",
)
RW_ADMM_KEYS = (
    "graph", "walk", "walk-start", "recal-epsilon", "recal-sigma1", "recal-r", "recal-delta", "xi-plan",
    "stop-on-budget", "rw-beta-scale", "rw-activation-prob", "recal-nu1", "recal-nu2", "label-mode", "recal-samples",
    "x1-init", "noise-seed",
)
SYNC_BASELINE_CHECKS = "fedpdm_flower.fedapp.apps.recal:validate_sync_config"
RW_ADMM_CHECKS = "fedpdm_flower.fedapp.apps.recal:validate_rw_admm_config"
#: the seed-001 family's start x^1 and evaluation (relative error to the central x*, spec 5.7)
RECAL_INITIAL, RECAL_EVALUATE = "fedpdm_flower.fedapp.apps.recal:initial_model", "fedpdm_flower.fedapp.apps.recal:evaluate_fn"
# Seed 004 (spec shared/specs/dp_quantized.md): DPQ-DSGD, every node every round, the server routes the quantized
# noisy messages (fedpdm_flower/strategies/dpq.py; built by fedpdm_flower/fedapp/apps/dpq.py)
DPQ_KEYS = (
    "graph", "dpq-variant", "dpq-q-step", "dpq-sigma-exp", "dpq-sigma-offset", "dpq-sigma-scale", "dpq-a1", "dpq-alpha",
    "dpq-a2", "dpq-beta", "dpq-a3", "dpq-gamma", "dpq-delta-exp", "dpq-c", "dpq-horizon", "dpq-eval-limit",
    "dpq-eval-average",
)
DPQ_CHECKS = "fedpdm_flower.fedapp.apps.dpq:validate_config"
SEED004 = ("Chen, Wang, Zhang, Differentially Private Distributed Nonconvex Stochastic Optimization with Quantized "
           "Communications, arXiv 2403.18254 (first version)")
PG_EXTRA_PAPER = "Shi, Ling, Wu, Yin, A Proximal Gradient Algorithm for Decentralized Composite Optimization, IEEE TSP 2015"
NIDS_PAPER = "Li, Shi, Yan, A Decentralized Proximal-Gradient Method With Network Independent Step-Sizes and Separated Convergence Rates, IEEE TSP 2019"
RW_ADMM_PAPER = "Shah & Avrachenkov, asynchronous ADMM with Markov-chain node selection, arXiv 1810.05067 (Walkman-style stand-in)"
# Flower's Krum / FedMedian / FedTrimmedAvg on the FedREP setup: the local algorithm and attack keys, no ConSpar,
# buffers, masking or FedREP aggregator (tmean-fraction only for FedTrimmedAvg's beta)
FLWR_ROBUST_KEYS = ("local-steps", "lr", "momentum", "lr-decay-round", "byzantine-clients", "attack", "alie-z", "foe-eps")
FLWR_ROBUST_CHECKS = "fedpdm_flower.fedapp.apps.fedrep:validate_flower_robust"
#: w^0 of the FedREP family: the zoo network's state dict, torch's initialisation seeded with the run seed
FEDREP_INITIAL = "fedpdm_flower.fedapp.apps.fedrep:fedrep_initial"
KRUM_PAPER = "Blanchard et al., Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent, NeurIPS 2017"
YIN_PAPER = "Yin et al., Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates, ICML 2018"
SEED000 = "Li et al., Privacy-preserving Federated Primal-dual Learning ..., arXiv 2310.19558"
FEDAVG_PAPER = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
FEDPROX_PAPER = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"
SCAFFOLD_PAPER = "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020"
SEED002 = "Ryu & Kim, Differentially Private Federated Learning via Inexact ADMM with Multiple Local Updates"
HUANG_PAPER = "Huang et al., DP-ADMM: ADMM-based Distributed Learning with Differential Privacy, IEEE TIFS 15, 2020"
IADMM_CHECKS = "fedpdm_flower.fedapp.apps.iadmm:validate_config"
IADMM_INITIAL = "fedpdm_flower.fedapp.apps.iadmm:zero_initial_model"
FEDDYN_PAPER = "Acar et al., Federated Learning Based on Dynamic Regularization, ICLR 2021"

ALGORITHMS: dict[str, AlgorithmSpec] = {
    "dp-fedpdm": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:broadcast_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", FEDPDM_KEYS,
        "DP federated primal-dual method (Alg. 1): duals on clients, Gaussian noise, l1 prox at the server", SEED000,
        FEDPDM_CHECKS, initial=BROADCAST_INITIAL,
    ),
    "bsdp-fedpdm": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:broadcast_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", FEDPDM_KEYS + SPARSE_KEYS,
        "DP-FedPDM with bidirectional top-k / rand-k sparsification (Alg. 2)", SEED000, FEDPDM_CHECKS,
        initial=BROADCAST_INITIAL,
    ),
    # Baselines of seed 000 (Figs. 7-8); DP, l1 and sparsification treatment are ours (spec 6.4, A22).
    "fedavg": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:broadcast_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", ("gamma",),
        "FedAvg / DP-FedAvg baseline: Q local SGD steps on f_i + gamma*||x||_1 (subgradient), unweighted model mean",
        FEDAVG_PAPER, initial=BROADCAST_INITIAL,
    ),
    "fedavg-sparse": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:broadcast_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", ("gamma", *SPARSE_KEYS),
        "FedAvg with top-k / rand-k uplink and top-k downlink, element-wise mean (Fig. 8 baseline)", FEDAVG_PAPER,
    ),
    "fedprox": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:broadcast_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", ("gamma", "mu"),
        "FedProx baseline: FedAvg with the local proximal term (mu/2)||x - x_0||^2", FEDPROX_PAPER,
    ),
    "fedprox-sparse": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:broadcast_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", ("gamma", "mu", *SPARSE_KEYS),
        "FedProx with top-k / rand-k uplink and top-k downlink, element-wise mean (Fig. 8 baseline)", FEDPROX_PAPER,
    ),
    "scaffold": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:broadcast_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", ("gamma",),
        "SCAFFOLD baseline (option II, global step 1): control variates c_i on clients, c on the server",
        SCAFFOLD_PAPER,
    ),
    "scaffold-sparse": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:broadcast_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", ("gamma", *SPARSE_KEYS),
        "SCAFFOLD with sparse (Delta y, Delta c) uplink on shared indices and top-k (x, c) downlink (Fig. 8 baseline)",
        SCAFFOLD_PAPER,
    ),
    "feddyn": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:broadcast_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", ("gamma", "feddyn-alpha"),
        "FedDyn baseline: client linear term grad L_i, server state h, theta = mean - h/alpha", FEDDYN_PAPER,
    ),
    "feddyn-sparse": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:broadcast_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", ("gamma", "feddyn-alpha", *SPARSE_KEYS),
        "FedDyn with top-k / rand-k uplink and top-k downlink, element-wise mean (Fig. 8 baseline)", FEDDYN_PAPER,
    ),
    # Seed 002 (spec shared/specs/dp_iadmm.md): all agents every round, duals replicated on server and agents.
    "dp-iadmm": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.iadmm:iadmm_strategy", "fedpdm_flower.fedapp.apps.iadmm:iadmm_client", (*OBJP_KEYS, "local-updates"),
        "DP-IADMM (Alg. 1): E perturbed inexact ADMM solves per round (the paper's Laplace objective perturbation, or DP-SGD with dp-calibration = dpsgd), average sent", SEED002,
        IADMM_CHECKS, False, IADMM_INITIAL,
    ),
    "objp": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.iadmm:iadmm_strategy", "fedpdm_flower.fedapp.apps.iadmm:iadmm_client", OBJP_KEYS,
        "ObjP: DP-IADMM with E = 1 (Section IV)", SEED002, IADMM_CHECKS, False, IADMM_INITIAL,
    ),
    "objpm": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.iadmm:iadmm_strategy", "fedpdm_flower.fedapp.apps.iadmm:iadmm_client", OBJP_KEYS,
        "ObjPM: DP-IADMM with E = 10 local updates (Section IV)", SEED002, IADMM_CHECKS, False, IADMM_INITIAL,
    ),
    "outp": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.iadmm:iadmm_strategy", "fedpdm_flower.fedapp.apps.iadmm:iadmm_client", OUTP_KEYS,
        "OutP baseline: inexact ADMM with Gaussian output perturbation, (eps, delta)-DP per step (reference code, spec 5.2), or DP-SGD with dp-calibration = dpsgd",
        HUANG_PAPER, IADMM_CHECKS, False, IADMM_INITIAL,
    ),
    # Seed 003 (spec shared/specs/fedrep.md): all m clients every round, two exchanges per round (three masked).
    "fedrep": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedrep:fedrep_strategy", "fedpdm_flower.fedapp.apps.fedrep:fedrep_client", FEDREP_KEYS,
        "FedREP: ConSpar consensus sparsification + buffered pairwise-masked secure aggregation + robust aggregation",
        SEED003, FEDREP_CHECKS, False, FEDREP_INITIAL,
    ),
    "share": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedrep:fedrep_strategy", "fedpdm_flower.fedapp.apps.fedrep:fedrep_client", FEDREP_KEYS,
        "SHARE: buffered secure + robust aggregation of dense updates (FedREP with k = d)", SHARE_PAPER,
        FEDREP_CHECKS, False, FEDREP_INITIAL,
    ),
    "fedrep-fedavg": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedrep:fedrep_strategy", "fedpdm_flower.fedapp.apps.fedrep:fedrep_client", FEDREP_KEYS,
        "FedAvg baseline of the FedREP experiments: mean of the dense updates in the clear (same local algorithm)",
        FEDAVG_PAPER, FEDREP_CHECKS, False, FEDREP_INITIAL,
    ),
    "sparse-secagg": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedrep:fedrep_strategy", "fedpdm_flower.fedapp.apps.fedrep:fedrep_client", (*FEDREP_KEYS, "sparsesecagg-scale"),
        "SparseSecAgg baseline: pairwise Bernoulli location masks + additive masks, per-coordinate sums, no error "
        "compensation, no robust aggregation (Gamma = conspar-fraction)", SPARSESECAGG_PAPER, FEDREP_CHECKS, False,
        FEDREP_INITIAL,
    ),
    # Seed 001 (spec shared/specs/dp_recal.md): the server only routes the baton along a random walk.
    "dp-recal": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.recal:recal_strategy", "fedpdm_flower.fedapp.apps.recal:recal_client", RECAL_KEYS,
        "DP-RECAL: one agent per round holds the baton (x, u~), (12a)-(12e) + Gaussian noise on u~, random-walk relay",
        SEED001, RECAL_CHECKS, False, RECAL_INITIAL, RECAL_EVALUATE,
    ),
    # DP-RECAL's Table V baselines: the server routes the agents' published messages (fedpdm_flower/strategies/recal_baselines.py)
    "dp-pg-extra": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.recal:recal_strategy", "fedpdm_flower.fedapp.apps.recal:recal_client", SYNC_BASELINE_KEYS,
        "DP-PG-EXTRA baseline of DP-RECAL: every agent every round, the server forwards neighbours' noisy x_j",
        PG_EXTRA_PAPER, SYNC_BASELINE_CHECKS, False, RECAL_INITIAL, RECAL_EVALUATE,
    ),
    "dp-nids": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.recal:recal_strategy", "fedpdm_flower.fedapp.apps.recal:recal_client", SYNC_BASELINE_KEYS,
        "DP-NIDS baseline of DP-RECAL: every agent every round, the server forwards neighbours' noisy v_j",
        NIDS_PAPER, SYNC_BASELINE_CHECKS, False, RECAL_INITIAL, RECAL_EVALUATE,
    ),
    "dp-rw-admm": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.recal:recal_strategy", "fedpdm_flower.fedapp.apps.recal:recal_client", RW_ADMM_KEYS,
        "DP-RW-ADMM baseline of DP-RECAL: a Walkman-style ADMM token relayed along the random walk, one hop per round",
        RW_ADMM_PAPER, RW_ADMM_CHECKS, False, RECAL_INITIAL, RECAL_EVALUATE,
    ),
    "dpq-dsgd": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.dpq:dpq_strategy", "fedpdm_flower.fedapp.apps.dpq:dpq_client", DPQ_KEYS,
        "DPQ-DSGD (Alg. 1): every node noises and quantizes its state, the server forwards the bit-packed levels to "
        "the graph neighbours, (5)-(6) on the nodes; dpq-variant = dpq | dp-only | quant-only | dsgd", SEED004,
        DPQ_CHECKS, False, initial="fedpdm_flower.fedapp.apps.dpq:initial_arrays",
    ),
    # Flower's own FedAvg / FedProx (flwr.serverapp.strategy), dense, Flower engines only (no in-process driver).
    "flwr-fedavg": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:flower_builtin_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", ("gamma",),
        "Flower's built-in FedAvg (num-examples weighted mean, Flower's sampling) with our FedAvg client", FEDAVG_PAPER,
    ),
    "flwr-fedprox": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedpdm:flower_builtin_strategy", "fedpdm_flower.fedapp.apps.fedpdm:broadcast_client", ("gamma", "mu"),
        "Flower's built-in FedProx (proximal-mu = mu) with our FedAvg client", FEDPROX_PAPER,
    ),
    # Flower's own robust strategies on the FedREP setup (torch net, Eq. (180) clients), Flower engines only.
    "flwr-krum": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedrep:flower_robust_strategy", "fedpdm_flower.fedapp.apps.fedrep:flower_robust_client", FLWR_ROBUST_KEYS,
        "Flower's built-in Krum (num_malicious_nodes = byzantine-clients) over all clients' models, FedREP setup",
        KRUM_PAPER, FLWR_ROBUST_CHECKS, False, FEDREP_INITIAL,
    ),
    "flwr-fedmedian": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedrep:flower_robust_strategy", "fedpdm_flower.fedapp.apps.fedrep:flower_robust_client", FLWR_ROBUST_KEYS,
        "Flower's built-in FedMedian (coordinate-wise median) over all clients' models, FedREP setup",
        YIN_PAPER, FLWR_ROBUST_CHECKS, False, FEDREP_INITIAL,
    ),
    "flwr-fedtrimmedavg": AlgorithmSpec(
        "fedpdm_flower.fedapp.apps.fedrep:flower_robust_strategy", "fedpdm_flower.fedapp.apps.fedrep:flower_robust_client",
        (*FLWR_ROBUST_KEYS, "tmean-fraction"),
        "Flower's built-in FedTrimmedAvg (beta = tmean-fraction cut per side) over all clients' models, FedREP setup",
        YIN_PAPER, FLWR_ROBUST_CHECKS, False, FEDREP_INITIAL,
    ),
}
