"""ServerApp: the user's main() with Flower's own FedAvg, wrapped by the run config's choice of our wrappers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedpdm_flower.fedapp.compression.codecs import TopK
from fedpdm_flower.fedapp.robust import GeometricMedian
from fedpdm_flower.strategies.central_dp import CentralDP
from fedpdm_flower.strategies.distributed_dp import DistributedDP
from fedpdm_flower.strategies.wrappers import Compressed, Robust, SecureBuffers
from wrapped_fedavg.task import Net, evaluate, load_test

torch.set_num_threads(1)
app = ServerApp()


def build(rc: Any) -> Any:
    """Flower's FedAvg inside the wrappers named by ``wrappers`` (innermost first: robust, then the transport)."""
    n = int(rc["min-nodes"])
    strategy: Any = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)
    wrappers = {w.strip() for w in str(rc["wrappers"]).split(",") if w.strip()}
    unknown = wrappers - {"robust", "secure", "compressed", "central-dp", "distributed-dp"}
    if unknown:
        raise ValueError(f"unknown wrappers {sorted(unknown)}; choose from robust, secure, compressed, central-dp, "
                         "distributed-dp")
    if "central-dp" in wrappers:  # client-level DP with secret Poisson sampling: it samples, so FedAvg takes all
        if len(wrappers) > 1:
            raise ValueError("wrappers: central-dp goes alone around FedAvg (it clips and noises the plain updates)")
        return CentralDP(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1),
                         epsilon=float(rc["dp-epsilon"]), delta=float(rc["dp-delta"]), clip_norm=float(rc["dp-clip"]),
                         sample_rate=float(rc["dp-sample-rate"]), num_rounds=int(rc["num-server-rounds"]),
                         min_available_nodes=n)
    if "robust" in wrappers:
        strategy = Robust(strategy, GeometricMedian())
    if "compressed" in wrappers:
        strategy = Compressed(strategy, uplink=TopK(float(rc["uplink-fraction"])),
                              downlink=TopK(float(rc["downlink-fraction"])))
    if "distributed-dp" in wrappers:  # secure buffers whose sums carry the devices' Skellam noise
        if "compressed" in wrappers:
            raise ValueError("wrappers: distributed-dp cannot go with compressed (masked uploads do not compress)")
        z = float(rc["ddp-noise-multiplier"])
        return DistributedDP(strategy, epsilon=float(rc["dp-epsilon"]), delta=float(rc["dp-delta"]),
                             num_rounds=int(rc["num-server-rounds"]), clip_norm=float(rc["dp-clip"]),
                             buffer_size=int(rc["buffer-size"]), noise_multiplier=z if z >= 0 else None)
    if "secure" in wrappers:
        strategy = SecureBuffers(strategy, buffer_size=int(rc["buffer-size"]))
    return strategy


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    net, test = Net(), load_test()

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(net, test)
        return MetricRecord({"loss": loss, "accuracy": acc})

    strategy = build(rc)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), train_config=ConfigRecord(),
                            num_rounds=int(rc["num-server-rounds"]), evaluate_fn=central_eval)
    net.load_state_dict(result.arrays.to_torch_state_dict())
    loss, acc = evaluate(net, test)
    # the wrappers' per-round figures (bytes both ways, buffers, robust inputs), summed over the rounds: they are in
    # the wrappers' diagnostics, while the Result holds what Flower's FedAvg puts there (the clients' metrics).
    # Figures that are already running totals or settings (the epsilon spent so far, z, q) keep their last value.
    totals: dict[str, float] = {}
    for figures in getattr(strategy, "diagnostics", {}).values():
        for k, v in figures.items():
            if "." in k and isinstance(v, int | float):
                last = k.rsplit(".", 1)[1] in ("epsilon", "releases", "noise_multiplier", "sample_rate")
                totals[k] = float(v) if last else totals.get(k, 0.0) + float(v)
    last = result.train_metrics_clientapp[max(result.train_metrics_clientapp)] if result.train_metrics_clientapp else {}
    privacy: dict[str, Any] = {}
    if hasattr(strategy, "privacy_spent"):  # central / distributed DP: the server's accountant (one client)
        spent = strategy.privacy_spent()
        privacy = {"epsilon": spent.epsilon, "delta": spent.delta, "accountant": spent.accounting_method,
                   "unit": "client", "releases": float(spent.num_releases),
                   "noise_multiplier": float(getattr(strategy, "z", 0.0) or 0.0)}
    elif "dp_epsilon" in last:  # DP-SGD on the devices: their own ledgers (the same on every device here)
        privacy = {"epsilon": float(last["dp_epsilon"]), "delta": float(rc["dp-delta"]), "accountant": "rdp (Opacus)",
                   "unit": "record"}
    print(f"final central accuracy {acc:.4f} (loss {loss:.4f}); {totals}; privacy {privacy}")
    if rc["result-path"]:
        Path(str(rc["result-path"])).write_text(json.dumps({"accuracy": acc, "loss": loss, "totals": totals,
                                                            "privacy": privacy}))
