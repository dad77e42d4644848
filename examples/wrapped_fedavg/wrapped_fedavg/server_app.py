"""ServerApp: the user's main() with Flower's own FedAvg, wrapped by the run config's choice of our wrappers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedapp.compression.codecs import TopK
from fedapp.robust import GeometricMedian
from strategies.wrappers import Compressed, Robust, SecureBuffers
from wrapped_fedavg.task import Net, evaluate, load_test

torch.set_num_threads(1)
app = ServerApp()


def build(rc: Any) -> Any:
    """Flower's FedAvg inside the wrappers named by ``wrappers`` (innermost first: robust, then the transport)."""
    n = int(rc["min-nodes"])
    strategy: Any = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)
    wrappers = {w.strip() for w in str(rc["wrappers"]).split(",") if w.strip()}
    unknown = wrappers - {"robust", "secure", "compressed"}
    if unknown:
        raise ValueError(f"unknown wrappers {sorted(unknown)}; choose from robust, secure, compressed")
    if "robust" in wrappers:
        strategy = Robust(strategy, GeometricMedian())
    if "compressed" in wrappers:
        strategy = Compressed(strategy, uplink=TopK(float(rc["uplink-fraction"])),
                              downlink=TopK(float(rc["downlink-fraction"])))
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
    # the wrappers' per-round figures (bytes both ways, buffers, robust inputs), summed over the rounds
    totals: dict[str, float] = {}
    for metrics in result.train_metrics_clientapp.values():
        for k, v in metrics.items():
            if "." in k and isinstance(v, int | float):
                totals[k] = totals.get(k, 0.0) + float(v)
    print(f"final central accuracy {acc:.4f} (loss {loss:.4f}); {totals}")
    if rc["result-path"]:
        Path(str(rc["result-path"])).write_text(json.dumps({"accuracy": acc, "loss": loss, "totals": totals}))
