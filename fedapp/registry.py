"""Algorithm key -> (Strategy class, NumPyClient class, the run-config keys it reads).

`parse_run_config` rejects unknown algorithm keys against this table; the ServerApp, the ClientApp and the
in-process driver all build their objects from it, so adding an algorithm is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedapp.client_base import FedClient
    from fedapp.config import RunConfig
    from fedapp.strategy_base import FederatedStrategy

# keys every algorithm reads
COMMON_KEYS = (
    "algorithm", "dataset", "data-source", "partitioner", "model", "num-clients", "clients-per-round",
    "first-round-all", "num-server-rounds", "seed", "out-dir", "batch-size", "eta0", "max-local-steps", "init-std",
    "beta", "labels-per-client", "samples-per-client", "dirichlet-alpha", "eval-every", "node-wait-s", "dp",
)
DP_KEYS = ("epsilon-total", "delta", "clip-norm", "c0", "privacy-q-power", "privacy-horizon")
FEDPDM_KEYS = ("rho", "nu", "gamma")
SPARSE_KEYS = ("alpha-up", "alpha-down", "uplink-sparsifier")


@dataclass(frozen=True)
class AlgorithmSpec:
    """How to build one algorithm: dotted paths (imported lazily) and the run-config keys it reads."""

    strategy: str
    client: str
    keys: tuple[str, ...]
    summary: str
    paper: str

    def strategy_cls(self) -> type[FederatedStrategy]:
        return _load(self.strategy)  # type: ignore[no-any-return]

    def client_cls(self) -> type[FedClient]:
        return _load(self.client)  # type: ignore[no-any-return]

    def used_config(self, cfg: RunConfig) -> dict[str, Any]:
        """The hyperparameters this algorithm actually reads (echoed under "config" in results.json)."""
        full = cfg.to_run_config()
        keys = COMMON_KEYS + self.keys + (DP_KEYS if cfg.dp else ())
        return {k: full[k] for k in full if k in keys}


def _load(path: str) -> Any:
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


SEED000 = "Li et al., Privacy-preserving Federated Primal-dual Learning ..., arXiv 2310.19558"
FEDAVG_PAPER = "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017"
FEDPROX_PAPER = "Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020"
SCAFFOLD_PAPER = "Karimireddy et al., SCAFFOLD: Stochastic Controlled Averaging for Federated Learning, ICML 2020"
FEDDYN_PAPER = "Acar et al., Federated Learning Based on Dynamic Regularization, ICLR 2021"

ALGORITHMS: dict[str, AlgorithmSpec] = {
    "dp-fedpdm": AlgorithmSpec(
        "strategies.fedpdm:DPFedPDM", "clients.fedpdm:FedPDMClient", FEDPDM_KEYS,
        "DP federated primal-dual method (Alg. 1): duals on clients, Gaussian noise, l1 prox at the server", SEED000,
    ),
    "bsdp-fedpdm": AlgorithmSpec(
        "strategies.fedpdm:BSDPFedPDM", "clients.fedpdm:BSDPFedPDMClient", FEDPDM_KEYS + SPARSE_KEYS,
        "DP-FedPDM with bidirectional top-k / rand-k sparsification (Alg. 2)", SEED000,
    ),
    # Baselines of seed 000 (Figs. 7-8); DP, l1 and sparsification treatment are ours (spec 6.4, A22).
    "fedavg": AlgorithmSpec(
        "strategies.fedavg:FedAvg", "clients.fedavg:FedAvgClient", ("gamma",),
        "FedAvg / DP-FedAvg baseline: Q local SGD steps on f_i + gamma*||x||_1 (subgradient), unweighted model mean",
        FEDAVG_PAPER,
    ),
    "fedavg-sparse": AlgorithmSpec(
        "strategies.fedavg:SparseFedAvg", "clients.fedavg:SparseFedAvgClient", ("gamma", *SPARSE_KEYS),
        "FedAvg with top-k / rand-k uplink and top-k downlink, element-wise mean (Fig. 8 baseline)", FEDAVG_PAPER,
    ),
    "fedprox": AlgorithmSpec(
        "strategies.fedavg:FedProx", "clients.fedavg:FedAvgClient", ("gamma", "mu"),
        "FedProx baseline: FedAvg with the local proximal term (mu/2)||x - x_0||^2", FEDPROX_PAPER,
    ),
    "fedprox-sparse": AlgorithmSpec(
        "strategies.fedavg:SparseFedProx", "clients.fedavg:SparseFedAvgClient", ("gamma", "mu", *SPARSE_KEYS),
        "FedProx with top-k / rand-k uplink and top-k downlink, element-wise mean (Fig. 8 baseline)", FEDPROX_PAPER,
    ),
    "scaffold": AlgorithmSpec(
        "strategies.scaffold:Scaffold", "clients.scaffold:ScaffoldClient", ("gamma",),
        "SCAFFOLD baseline (option II, global step 1): control variates c_i on clients, c on the server",
        SCAFFOLD_PAPER,
    ),
    "scaffold-sparse": AlgorithmSpec(
        "strategies.scaffold:SparseScaffold", "clients.scaffold:SparseScaffoldClient", ("gamma", *SPARSE_KEYS),
        "SCAFFOLD with sparse (Delta y, Delta c) uplink on shared indices and top-k (x, c) downlink (Fig. 8 baseline)",
        SCAFFOLD_PAPER,
    ),
    "feddyn": AlgorithmSpec(
        "strategies.feddyn:FedDyn", "clients.feddyn:FedDynClient", ("gamma", "feddyn-alpha"),
        "FedDyn baseline: client linear term grad L_i, server state h, theta = mean - h/alpha", FEDDYN_PAPER,
    ),
    "feddyn-sparse": AlgorithmSpec(
        "strategies.feddyn:SparseFedDyn", "clients.feddyn:SparseFedDynClient", ("gamma", "feddyn-alpha", *SPARSE_KEYS),
        "FedDyn with top-k / rand-k uplink and top-k downlink, element-wise mean (Fig. 8 baseline)", FEDDYN_PAPER,
    ),
    # Flower's own FedAvg / FedProx (flwr.serverapp.strategy), dense, Flower engines only (no in-process driver).
    "flwr-fedavg": AlgorithmSpec(
        "strategies.flower_builtin:FlwrFedAvg", "clients.fedavg:FedAvgClient", ("gamma",),
        "Flower's built-in FedAvg (num-examples weighted mean, Flower's sampling) with our FedAvg client", FEDAVG_PAPER,
    ),
    "flwr-fedprox": AlgorithmSpec(
        "strategies.flower_builtin:FlwrFedProx", "clients.fedavg:FedAvgClient", ("gamma", "mu"),
        "Flower's built-in FedProx (proximal-mu = mu) with our FedAvg client", FEDPROX_PAPER,
    ),
}
