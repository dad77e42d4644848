"""ServerApp: the user's own main(), with the run config's DP seed algorithm as the strategy."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from dp_seeds.algorithms import pick
from dp_seeds.task import Net, evaluate, load_test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    net, test = Net(), load_test()

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(net, test)
        return MetricRecord({"loss": loss, "accuracy": acc})

    build, _ = pick(rc)
    strategy = build(rc)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()),
                            num_rounds=int(rc["num-server-rounds"]), evaluate_fn=central_eval)
    net.load_state_dict(result.arrays.to_torch_state_dict())
    loss, acc = evaluate(net, test)
    spent = strategy.privacy_spent()
    print(f"{rc['algorithm']}: final central accuracy {acc:.4f} (loss {loss:.4f}); {spent}")
    if rc["result-path"]:
        Path(str(rc["result-path"])).write_text(json.dumps({
            "algorithm": rc["algorithm"], "accuracy": acc, "loss": loss,
            "privacy": {"epsilon": spent.epsilon, "delta": spent.delta, "accountant": spent.accounting_method}}))


torch.set_num_threads(1)
