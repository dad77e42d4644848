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

ALGORITHMS: dict[str, AlgorithmSpec] = {
    "dp-fedpdm": AlgorithmSpec(
        "strategies.fedpdm:DPFedPDM", "clients.fedpdm:FedPDMClient", FEDPDM_KEYS,
        "DP federated primal-dual method (Alg. 1): duals on clients, Gaussian noise, l1 prox at the server", SEED000,
    ),
    "bsdp-fedpdm": AlgorithmSpec(
        "strategies.fedpdm:BSDPFedPDM", "clients.fedpdm:BSDPFedPDMClient", FEDPDM_KEYS + SPARSE_KEYS,
        "DP-FedPDM with bidirectional top-k / rand-k sparsification (Alg. 2)", SEED000,
    ),
}
