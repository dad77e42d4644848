"""The user's ServerApp: the same main() with Flower's FedAvg and then with each library strategy.

main() reads every field of each strategy's ``Result`` the way a Flower pipeline does -- it loads
``result.arrays`` into its own model (``load_state_dict``, strict) and indexes the three metric dictionaries by
round -- and writes what it found to ``result-path`` as JSON for the test to compare with Flower's FedAvg. A
strategy that raises is recorded with its error and main() goes on with the next.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedpdm_flower.fedapp.compression import TopK
from fedpdm_flower.fedapp.compression.conspar import ConSpar
from fedpdm_flower.fedapp.robust import GeometricMedian
from fedpdm_flower.strategies.central_dp import CentralDP
from fedpdm_flower.strategies.distributed_dp import DistributedDP
from fedpdm_flower.strategies.dpq import DPQDSGD
from fedpdm_flower.strategies.fedpdm import BSDPFedPDM
from fedpdm_flower.strategies.fedrep import FedREP
from fedpdm_flower.strategies.iadmm import ObjP
from fedpdm_flower.strategies.recal import DPRECAL
from fedpdm_flower.strategies.wrappers import Compressed, Robust, SecureBuffers
from parityapp.task import Net, evaluate, test_data

app = ServerApp()

#: the user's own keys: in the train config, the evaluate config and the central evaluation's record
TRAIN_CONFIG = {"user-lr": 0.05}
EVALUATE_CONFIG = {"user-eval-tag": 7}


#: the samples of the four nodes' training partitions (task.train_data: 48 + 8 pid)
TOTAL_SAMPLES = 48 + 56 + 64 + 72


def fedavg(n: int, **kw: Any) -> FedAvg:
    return FedAvg(**{"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_train_nodes": n, "min_evaluate_nodes": n,
                     "min_available_nodes": n, **kw})


def build(name: str, n: int, rounds: int) -> Any:
    """Each strategy as a user would build it (Flower's vocabulary where it applies, defaults otherwise)."""
    federation: dict[str, Any] = {"min_available_nodes": n, "min_evaluate_nodes": n, "seed": 0}
    strategies = {
        "fedavg": lambda: fedavg(n),
        "bsdp-fedpdm": lambda: BSDPFedPDM(privacy=None, min_train_nodes=n, uplink=TopK(0.5), **federation),
        "fedrep": lambda: FedREP(conspar=ConSpar(0.5), buffer_size=2, **federation),
        "fedrep-plain": lambda: FedREP(conspar=ConSpar(0.5), buffer_size=2, masked=False, **federation),
        # ObjP's (9a) needs I, the federation's number of samples; the user knows it (its own partitions)
        "objp": lambda: ObjP(privacy=None, total_samples=TOTAL_SAMPLES, **federation),
        "dp-recal": lambda: DPRECAL(graph="ring", privacy=None, mode="exact", **federation),
        "dpq-dsgd": lambda: DPQDSGD(privacy=None, q_step=0.0, horizon=2, evaluate_average=True, **federation),
        "robust": lambda: Robust(fedavg(n), GeometricMedian()),
        "compressed": lambda: Compressed(fedavg(n), uplink=TopK(0.5), downlink=TopK(0.5)),
        "secure": lambda: SecureBuffers(fedavg(n), buffer_size=n),
        "central-dp": lambda: CentralDP(fedavg(1, min_evaluate_nodes=n), epsilon=8.0, clip_norm=10.0,
                                        sample_rate=1.0, num_rounds=rounds, min_available_nodes=n,
                                        noise_multiplier=0.0),
        "distributed-dp": lambda: DistributedDP(fedavg(n), epsilon=8.0, num_rounds=rounds, clip_norm=10.0,
                                                buffer_size=n, noise_multiplier=0.0),
    }
    return strategies[name]()


def _plain(m: MetricRecord) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in m.items()}


def read_result(result: Any, norm: str) -> dict[str, Any]:
    """What a Flower pipeline reads from a Result: the model (into the user's own net) and the metrics by round."""
    net = Net(norm)
    net.load_state_dict(result.arrays.to_torch_state_dict())  # strict: every key, every shape
    return {
        "type": f"{type(result).__module__}.{type(result).__qualname__}",
        "arrays": [[k, list(a.numpy().shape), str(a.numpy().dtype)] for k, a in result.arrays.items()],
        "train_metrics_clientapp": {str(r): _plain(m) for r, m in result.train_metrics_clientapp.items()},
        "evaluate_metrics_clientapp": {str(r): _plain(m) for r, m in result.evaluate_metrics_clientapp.items()},
        "evaluate_metrics_serverapp": {str(r): _plain(m) for r, m in result.evaluate_metrics_serverapp.items()},
    }


def run_pass(grid: Grid, rc: Any, test: Any, norm: str, samples: str) -> dict[str, Any]:
    """Every strategy of the run config, one after the other, on the user's ``norm`` model and ``samples`` data
    (central evaluation on ``test``); what main() read from each Result."""
    rounds, n = int(rc["num-server-rounds"]), int(rc["min-nodes"])

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net = Net(norm)
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(net, test)
        return MetricRecord({"accuracy": acc, "loss": loss, "user_central": 1.0})

    torch.manual_seed(0)
    reference = Net(norm).state_dict()
    out: dict[str, Any] = {"state_dict": [[k, list(v.shape), str(v.numpy().dtype)] for k, v in reference.items()],
                           "strategies": {}}
    case = {"parity-norm": norm, "parity-samples": samples}  # which pass a message belongs to (client_app._track)
    for name in [s.strip() for s in str(rc["strategies"]).split(",") if s.strip()]:
        try:
            strategy = build(name, n, rounds)
            result = strategy.start(grid=grid, initial_arrays=ArrayRecord(reference), num_rounds=rounds,
                                    train_config=ConfigRecord({"parity-strategy": name, **case, **TRAIN_CONFIG}),
                                    evaluate_config=ConfigRecord({**case, **EVALUATE_CONFIG}), evaluate_fn=central)
            out["strategies"][name] = read_result(result, norm)
            diagnostics = getattr(strategy, "diagnostics", {})
            out["strategies"][name]["diagnostics"] = {str(r): sorted(m) for r, m in diagnostics.items()}
        except Exception as err:  # recorded for the test; the next strategy still runs
            out["strategies"][name] = {"error": f"{type(err).__name__}: {err}",
                                       "traceback": traceback.format_exc()[-3000:]}
        print(f"parity [{norm}, {samples}]: {name}: "
              f"{'error ' + out['strategies'][name]['error'] if 'error' in out['strategies'][name] else 'ok'}", flush=True)
    return out


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    test = test_data()
    out = run_pass(grid, rc, test, str(rc["model-norm"]), str(rc["samples"]))
    # the device-side passes ("norm:samples", comma-separated) in the same run: the engine starts once
    out["device"] = {}
    for case in [c.strip() for c in str(rc["device-passes"]).split(",") if c.strip()]:
        norm, samples = case.split(":")
        out["device"][case] = run_pass(grid, rc, test, norm, samples)
    if rc["result-path"]:
        Path(str(rc["result-path"])).write_text(json.dumps(out, indent=1))
