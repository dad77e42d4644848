"""Which hyperparameters train a small neural network, per algorithm: the defaults against the documented settings.

Each algorithm's defaults are the paper's, tuned for its linear tasks. This runs them, and the settings that
docs/models-and-data.md recommends for a neural network, on the examples' own models and MNIST slices (examples/*:
the user's CNN or MLP and loaders), in this process (:class:`simulations.inprocess.LocalGrid`: the examples'
ClientApps answer the same messages Flower carries), and prints the central test accuracy after given rounds.

    python -m simulations.cnn_settings --rounds 5 20 --out results/cnn_settings.json [--only fedpdm fedavg ...]

Accuracy is on the first 2,000 MNIST test images (the examples' ``load_test``). Nothing is timed here.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedpdm_flower.fedapp.compression import ConSpar
from fedpdm_flower.fedapp.robust import GeometricMedian
from simulations.flower_driver import ROOT

EXAMPLES = ROOT / "examples"
for _name in ("fedpdm_cnn", "fedrep_cnn", "iadmm_mlp", "dpq_ring"):
    if str(EXAMPLES / _name) not in sys.path:
        sys.path.insert(0, str(EXAMPLES / _name))


def _bn_net() -> Any:
    """The fedpdm_cnn example's CNN with BatchNorm after each convolution (what a user's template CNN often has)."""
    import torch
    from torch import nn

    class NetBN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(1, 8, 5), nn.BatchNorm2d(8)
            self.conv2, self.bn2 = nn.Conv2d(8, 16, 5), nn.BatchNorm2d(16)
            self.fc1, self.fc2 = nn.Linear(16 * 4 * 4, 64), nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
            x = torch.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
            out: torch.Tensor = self.fc2(torch.relu(self.fc1(x.flatten(1))))
            return out

    return NetBN()


def _run(strategy: Any, app: Any, nodes: int, rounds: int, net: Any, task: Any, run_config: dict[str, Any]) -> list[float]:
    """Central accuracy after every round of ``strategy`` over ``nodes`` nodes running ``app``."""
    from flwr.app import ArrayRecord, MetricRecord

    from simulations.inprocess import LocalGrid

    test, accs = task.load_test(), []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = task.evaluate(net, test)
        if server_round > 0:
            accs.append(round(acc, 4))
        return MetricRecord({"accuracy": acc, "loss": loss})

    strategy.start(grid=LocalGrid(app, nodes, run_config=run_config), initial_arrays=ArrayRecord(net.state_dict()),
                   num_rounds=rounds, evaluate_fn=central)
    return accs


def broadcast(kind: str, batchnorm: bool = False, **kw: Any) -> Callable[[int], list[float]]:
    """FedPDM / BSDP-FedPDM and the local-SGD baselines on fedpdm_cnn's data: 3 nodes of 1,200 images, batch 32."""
    def go(rounds: int) -> list[float]:
        from fedpdm_cnn import task
        from torch import nn

        from fedpdm_flower.clients.fedavg import FedAvgClient
        from fedpdm_flower.clients.feddyn import FedDynClient
        from fedpdm_flower.clients.fedpdm import FedPDMClient
        from fedpdm_flower.clients.scaffold import ScaffoldClient
        from fedpdm_flower.fedapp.compression import TopK
        from fedpdm_flower.strategies.fedavg import FedAvg
        from fedpdm_flower.strategies.feddyn import FedDyn
        from fedpdm_flower.strategies.fedpdm import BSDPFedPDM
        from fedpdm_flower.strategies.scaffold import Scaffold

        strategies = {"bsdp-fedpdm": (BSDPFedPDM, FedPDMClient), "fedavg": (FedAvg, FedAvgClient),
                      "scaffold": (Scaffold, ScaffoldClient), "feddyn": (FedDyn, FedDynClient)}
        cls, client = strategies[kind]
        if kind == "bsdp-fedpdm":
            kw.setdefault("uplink", TopK(0.3))
            kw.setdefault("downlink", TopK(0.75))
            kw.setdefault("gamma", 0.0)
        make = _bn_net if batchnorm else task.Net

        def client_fn(context: Any) -> Any:
            nc = context.node_config
            return client(make(), task.load_partition(int(nc["partition-id"]), int(nc["num-partitions"]), 1200, 32),
                          loss_fn=nn.CrossEntropyLoss())

        return _run(cls(min_available_nodes=3, **kw), client.client_app(client_fn), 3, rounds, make(), task, {})

    return go


def fedrep(**kw: Any) -> Callable[[int], list[float]]:
    """FedREP on fedrep_cnn (its BatchNorm CNN, its secure-mode client app): 4 nodes, masked buffers of 2."""
    def go(rounds: int) -> list[float]:
        from fedrep_cnn import client_app, task
        from fedrep_cnn.provision import provision

        from fedpdm_flower.strategies.fedrep import FedREP

        with tempfile.TemporaryDirectory() as keys:
            provision(Path(keys), 4)
            rc = {"samples-per-node": 1200, "batch-size": 32, "keys-dir": keys}
            return _run(FedREP(min_available_nodes=4, **kw), client_app.app, 4, rounds, task.Net(), task, rc)

    return go


def iadmm(**kw: Any) -> Callable[[int], list[float]]:
    """ObjPM (E = 10, per-sample clipped Laplace noise, epsilon-bar 5) on iadmm_mlp's MLP: 3 nodes of 1,000 images."""
    def go(rounds: int) -> list[float]:
        from iadmm_mlp import client_app, task

        from fedpdm_flower.fedapp.algorithms.iadmm import ObjectivePerturbation
        from fedpdm_flower.strategies.iadmm import ObjPM

        rc = {"samples-per-node": 1000, "max-epsilon": 1e9}
        strategy = ObjPM(min_available_nodes=3, privacy=ObjectivePerturbation(5.0, sensitivity_mode="clipped", clip_norm=200.0),
                         **kw)
        return _run(strategy, client_app.app, 3, rounds, task.Net(), task, rc)

    return go


def dpq(**kw: Any) -> Callable[[int], list[float]]:
    """DPQ-DSGD on dpq_ring's CNN, a ring of 4 nodes of 2,000 images; the node-average model is evaluated."""
    def go(rounds: int) -> list[float]:
        from dpq_ring import client_app, task

        from fedpdm_flower.strategies.dpq import DPQDSGD

        rc = {"samples-per-node": 2000}
        strategy = DPQDSGD(min_available_nodes=4, graph="ring", evaluate_average=True, **kw)
        return _run(strategy, client_app.app, 4, rounds, task.Net(), task, rc)

    return go


#: name -> (what is run, rounds it takes at most); the "defaults" rows leave the algorithm's hyperparameters alone
CONFIGS: dict[str, tuple[Callable[[int], list[float]], int | None]] = {
    "bsdp-fedpdm defaults (rho=10, eta0=0.04)": (broadcast("bsdp-fedpdm"), None),
    "bsdp-fedpdm rho=0.1, eta0=0.1": (broadcast("bsdp-fedpdm", rho=0.1, eta0=0.1), None),
    "bsdp-fedpdm rho=0.1, eta0=0.2": (broadcast("bsdp-fedpdm", rho=0.1, eta0=0.2), None),
    "bsdp-fedpdm rho=0.1, eta0=0.1, BatchNorm CNN": (broadcast("bsdp-fedpdm", True, rho=0.1, eta0=0.1), None),
    "bsdp-fedpdm rho=0.1, eta0=0.2, BatchNorm CNN": (broadcast("bsdp-fedpdm", True, rho=0.1, eta0=0.2), None),
    "fedavg defaults (eta0=0.04)": (broadcast("fedavg"), None),
    "fedavg eta0=0.2": (broadcast("fedavg", eta0=0.2), None),
    "fedavg eta0=0.2, BatchNorm CNN": (broadcast("fedavg", True, eta0=0.2), None),
    "scaffold defaults (eta0=0.04)": (broadcast("scaffold"), None),
    "scaffold eta0=0.2": (broadcast("scaffold", eta0=0.2), None),
    "feddyn defaults (alpha=10, eta0=0.04)": (broadcast("feddyn"), None),
    "feddyn alpha=0.1, eta0=0.2": (broadcast("feddyn", alpha=0.1, eta0=0.2), None),
    "fedrep defaults (lr=0.5, I=1, B=25, CClip, K/d=0.05)": (fedrep(), None),
    "fedrep I=20, B=loader's, GeoMed, K/d=0.1 (example)": (fedrep(
        local_steps=20, batch_size=None, conspar=ConSpar(fraction=0.1), aggregator=GeometricMedian(iters=5)), None),
    "objpm defaults (rho, eta schedules of the paper)": (iadmm(), 3),
    "objpm rho=0.2, eta=3.0 (example)": (iadmm(rho=0.2, eta=3.0), 3),
    "dpq-dsgd defaults (q_step=1, sigma_scale=1, a3=0.24)": (dpq(), 5),
    "dpq-dsgd q_step=0.05, sigma_scale=0.03, a3=40 (example)": (dpq(q_step=0.05, sigma_scale=0.03, a3=40.0), 5),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, nargs="+", default=[5, 20], help="report the accuracy after these rounds")
    parser.add_argument("--only", nargs="*", default=None, help="run the configurations whose name starts so")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    table: dict[str, dict[str, Any]] = {}
    for name, (go, cap) in CONFIGS.items():
        if args.only and not any(name.startswith(p) for p in args.only):
            continue
        rounds = max(args.rounds) if cap is None else cap  # IADMM and DPQ: a fixed, short run
        torch.manual_seed(0)
        t0 = time.perf_counter()
        accs = go(rounds)
        at = {str(r): accs[r - 1] for r in sorted({*args.rounds, rounds}) if r <= len(accs)}
        table[name] = {"accuracy_after_round": at, "curve": accs}
        print(f"{name:58s} " + "  ".join(f"r{r}={a:.3f}" for r, a in at.items())
              + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
