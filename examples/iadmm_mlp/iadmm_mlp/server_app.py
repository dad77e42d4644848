"""ServerApp: the user's own main(), with our ObjPM strategy (DP-IADMM, E = 10 local solves) swapped in."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedpdm_flower.fedapp.privacy.target import PrivacyTarget
from fedpdm_flower.strategies.iadmm import ObjPM
from iadmm_mlp.task import Net, evaluate, load_test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    net, test = Net(), load_test()

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(net, test)
        return MetricRecord({"loss": loss, "accuracy": acc})

    # Every node is an agent in every round; its dual never travels (the server keeps a replica). Each of the E = 10
    # local solves takes one DP-SGD step: the gradient of a Poisson sample of the node's records (rate
    # `sample-rate`, drawn on the node), each record's gradient clipped to `clip`, Gaussian noise calibrated so that
    # everything a node sends over the run is (epsilon, 1e-5)-DP for one of its records (RDP accountant), the
    # server included. The global sample count I is asked from the nodes before round 1, with the whole run's
    # privacy plan, which each node checks against its own floor. rho and eta are constants here: the paper's
    # schedules (24) and 1/sqrt(t) are tuned for 20 000 rounds of a linear model, not 3 rounds of an MLP.
    # fraction_evaluate=0.0: this app evaluates centrally (evaluate_fn); its nodes hold no test data
    strategy = ObjPM(
        min_available_nodes=int(rc["min-nodes"]), fraction_evaluate=0.0,
        privacy=PrivacyTarget(epsilon=float(rc["epsilon"]), clip_norm=float(rc["clip"]),
                              sample_rate=float(rc["sample-rate"])),
        rho=float(rc["rho"]), eta=float(rc["eta"]),
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
