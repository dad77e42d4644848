"""ServerApp: the user's `strategies` module supplies the strategy; it logs where each module came from."""

from __future__ import annotations

import clients
import strategies
import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from task import Net, load_data

import fedpdm_flower

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    print(f"module fedpdm_flower from {fedpdm_flower.__file__}")
    print(f"module strategies from {strategies.__file__}")
    print(f"module clients from {clients.__file__}")
    net, test = Net(), load_data(seed=99)

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            acc = (net(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
        return MetricRecord({"accuracy": acc})

    rounds = int(context.run_config["num-server-rounds"])
    result = strategies.make_strategy().start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()),
                                              num_rounds=rounds, evaluate_fn=central_eval)
    print(f"final accuracy {central_eval(rounds, result.arrays)['accuracy']:.3f}")
