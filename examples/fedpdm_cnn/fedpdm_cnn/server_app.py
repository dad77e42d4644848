"""ServerApp: the user's own main(), with our BSDP-FedPDM strategy swapped in for FedAvg."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedpdm_cnn.task import Net, evaluate, load_test
from fedpdm_flower.fedapp.compression import TopK
from fedpdm_flower.fedapp.privacy import Eq36Calibration
from fedpdm_flower.strategies.fedpdm import BSDPFedPDM

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    net, test = Net(), load_test()

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(net, test)
        return MetricRecord({"loss": loss, "accuracy": acc})

    # epsilon > 0 turns on the paper's Gaussian mechanism with its eq. (36) calibration: each client adds noise to
    # what it uploads, and reports the RDP epsilon of its releases beside the paper's figure. Local noise of this
    # size stops a CNN from learning in a few rounds (measured: chance accuracy at epsilon = 8), so it is off here.
    epsilon = float(rc["epsilon"])
    # fraction_evaluate=0.0: this app evaluates centrally (evaluate_fn); its nodes hold no test data
    strategy = BSDPFedPDM(
        fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=int(rc["min-nodes"]),
        rho=float(rc["rho"]), gamma=0.0, eta0=float(rc["eta0"]), max_local_steps=10,
        uplink=TopK(0.3), downlink=TopK(0.75),
        privacy=Eq36Calibration(epsilon=epsilon, delta=1e-5, clip_norm=1.0) if epsilon > 0 else None,
    )
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()),
                            num_rounds=int(rc["num-server-rounds"]), evaluate_fn=central_eval)
    net.load_state_dict(result.arrays.to_torch_state_dict())
    loss, acc = evaluate(net, test)
    print(f"final central accuracy {acc:.4f} (loss {loss:.4f}); privacy {strategy.privacy_summary()}")
    if rc["result-path"]:
        Path(str(rc["result-path"])).write_text(json.dumps({"accuracy": acc, "loss": loss,
                                                            "privacy": strategy.privacy_summary()}))


torch.set_num_threads(1)
