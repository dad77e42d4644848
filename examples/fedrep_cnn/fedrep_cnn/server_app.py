"""ServerApp: the user's own main(), with our FedREP strategy swapped in for FedAvg."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedpdm_flower.fedapp.compression import ConSpar
from fedpdm_flower.fedapp.robust import GeometricMedian
from fedpdm_flower.strategies.fedrep import FedREP
from fedrep_cnn.task import Net, evaluate, load_test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    net, test = Net(), load_test()

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(net, test)
        return MetricRecord({"loss": loss, "accuracy": acc})

    # FedREP: each client proposes its top k = K/m coordinates (ConSpar) with this round's signed key, uploads its
    # update on their union masked inside a buffer of `buffer-size` clients, and reveals what unmasks the buffer's
    # sum (the server learns only buffer means); the server aggregates the buffer means with the geometric median.
    # batch_size=None: each client's DataLoader batch size.
    # fraction_evaluate=0.0: this app evaluates centrally (evaluate_fn); its nodes hold no test data
    strategy = FedREP(
        min_available_nodes=int(rc["min-nodes"]), fraction_evaluate=0.0,
        conspar=ConSpar(fraction=float(rc["conspar-fraction"])), buffer_size=int(rc["buffer-size"]), masked=True,
        aggregator=GeometricMedian(iters=5), eta0=float(rc["lr"]), local_steps=int(rc["local-steps"]), batch_size=None,
    )
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()),
                            num_rounds=int(rc["num-server-rounds"]), evaluate_fn=central_eval)
    net.load_state_dict(result.arrays.to_torch_state_dict())
    loss, acc = evaluate(net, test)
    bytes_up = sum(r.uplink_bytes for r in strategy.history)
    bytes_down = sum(r.downlink_bytes for r in strategy.history)
    print(f"final central accuracy {acc:.4f} (loss {loss:.4f}); {bytes_up} B up, {bytes_down} B down")
    if rc["result-path"]:
        Path(str(rc["result-path"])).write_text(json.dumps({"accuracy": acc, "loss": loss, "uplink_bytes": bytes_up,
                                                            "downlink_bytes": bytes_down}))


torch.set_num_threads(1)
