"""`bench --suite dp-seeds`: one table, one row per DP seed algorithm, the same columns for every row.

Columns (:data:`COLUMNS`): the algorithm without noise; the paper's own calibration with its rigorous epsilon beside
it; the record-level DP-SGD mechanism (``PrivacyTarget``) at epsilon 1, 3 and 8; two references on the row's task,
record-level DP-SGD under Flower's own FedAvg (:class:`fedpdm_flower.clients.dpsgd.DeviceDPSGD` in the ClientApp) and
client-level DP with a trusted server (:class:`fedpdm_flower.strategies.central_dp.CentralDP` around Flower's
FedAvg); the bytes the epsilon-8 run moved. Below the table, the speed ratio of a DP local epoch to a plain torch
SGD epoch on a user's CNN (:func:`speed_ratio`). Goal: within 5 points of the row's no-noise accuracy at epsilon 8,
within 10 at epsilon 3.

**A row registry.** Every module of :mod:`simulations.dp_rows` that defines ``ROWS: list[Row]`` adds its rows; this
file imports them all (``pkgutil``), so a family adds its row in its own module without touching another's. The
reference cells (:func:`dpsgd_fedavg_cell`, :func:`central_dp_cell`) run on any task given as app run-config keys.

Each cell runs in this process (the in-process driver for the library's strategies, :class:`simulations.inprocess.
LocalGrid` for Flower's FedAvg): the quick start (``make run``) is what goes through Flower's simulation engine.
"""

from __future__ import annotations

import importlib
import json
import math
import pkgutil
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "Cell", "Row", "central_dp_cell", "dpsgd_fedavg_cell", "main", "rows", "run_cell", "speed_ratio"]

COLUMNS = ("no noise", "paper's calibration", "eps 1", "eps 3", "eps 8", "DeviceDPSGD + Flower FedAvg (eps 8)",
           "CentralDP + Flower FedAvg (eps 8)")


@dataclass
class Cell:
    """One cell: the final test accuracy, the rigorous epsilon it spent (worst device, or the run's for client-level
    DP) and by which accountant, the paper's own figure where it has one, bytes moved, wall time and a note."""

    accuracy: float | None
    epsilon: float | None = None
    accountant: str = ""
    paper_epsilon: float | None = None
    mbytes: float | None = None
    wall_s: float = 0.0
    note: str = ""


@dataclass(frozen=True)
class Row:
    """One algorithm on one task: ``cells`` maps a column of :data:`COLUMNS` to the function that runs it."""

    name: str
    task: str
    cells: Mapping[str, Callable[[], Cell]] = field(default_factory=dict)


def rows() -> list[Row]:
    """Every row of every module in :mod:`simulations.dp_rows`, in module order."""
    import simulations.dp_rows as pkg

    out: list[Row] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        out.extend(getattr(module, "ROWS", []))
    return out


# ---------------------------------------------------------------------------------------------------- cells
def run_cell(overrides: Mapping[str, Any]) -> Cell:
    """One configuration of the reproduction app, in process: accuracy, the rigorous figure its devices report,
    the paper's own figure if any, bytes."""
    from fedpdm_flower.fedapp.config import parse_run_config
    from simulations.inprocess import run_inprocess

    cfg = parse_run_config(dict(overrides))
    t0 = time.perf_counter()
    strategy, _, _ = run_inprocess(cfg)
    hist = strategy.history
    priv = strategy.privacy_summary()
    eps, how = None, ""
    for key, name in (("eps_dpsgd", "rdp, subsampled Gaussian (device ledgers)"),
                      ("eps_gdp", "gdp, exact, no amplification (device ledgers)")):
        if key in priv:
            eps, how = float(priv[key]), name
            break
    paper = priv.get("eps_eq36")
    return Cell(accuracy=hist[-1].test_accuracy, epsilon=eps, accountant=how,
                paper_epsilon=None if paper is None else float(paper),
                mbytes=sum(r.uplink_bytes + r.downlink_bytes for r in hist) / 1e6, wall_s=time.perf_counter() - t0)


def _task_data(task: Mapping[str, Any]) -> tuple[Any, Any, int]:
    """The task's partitions as float32 tensors (node i -> (x, y)), the test set, and the classes."""
    import numpy as np
    import torch

    from fedpdm_flower.fedapp.config import parse_run_config
    from fedpdm_flower.fedapp.task import client_dataset, dataset_info

    cfg = parse_run_config(dict(task))
    info = dataset_info(cfg)
    parts = {}
    for i in range(cfg.num_clients):
        ds = client_dataset(cfg, i, cfg.num_clients)
        parts[i] = (torch.from_numpy(ds.x.astype(np.float32)), torch.from_numpy(ds.y.astype(np.int64)))
    from fedpdm_flower.fedapp.data.sources import load_dataset

    _, test, _ = load_dataset(cfg.dataset, source=cfg.data_source)
    return parts, (torch.from_numpy(test.x.astype(np.float32)), torch.from_numpy(test.y.astype(np.int64))), \
        info.num_classes


def _reference_run(task: Mapping[str, Any], *, strategy: Any, device: Any, rounds: int, local_steps: int,
                   lr: float, batch: int) -> tuple[float, Any, float]:
    """Flower's FedAvg (possibly wrapped) on ``task`` through :class:`LocalGrid`; each node trains the task's zoo
    network: with ``device`` (a DeviceDPSGD) one DP-SGD round, else ``local_steps`` plain SGD steps."""
    import torch
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from torch.utils.data import DataLoader, TensorDataset

    from fedpdm_flower.fedapp.config import parse_run_config
    from fedpdm_flower.fedapp.task import build_net
    from simulations.inprocess import LocalGrid

    cfg = parse_run_config(dict(task))
    parts, test, _ = _task_data(task)
    app = ClientApp()

    def fresh() -> Any:
        return build_net(cfg).module

    @app.train()
    def fit(msg: Message, context: Any) -> Message:
        pid = int(context.node_config["partition-id"])
        x, y = parts[pid]
        net = fresh()
        net.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
        metrics: dict[str, float] = {}
        if device is not None:
            metrics = device.train(net, DataLoader(TensorDataset(x, y), batch_size=batch), lr=lr, context=context)
        else:
            opt = torch.optim.SGD(net.parameters(), lr=lr)
            g = torch.Generator().manual_seed(pid)
            for _ in range(local_steps):
                idx = torch.randint(0, len(y), (batch,), generator=g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
                opt.step()
        return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()),
                                   "metrics": MetricRecord({"num-examples": len(y), **metrics})}), reply_to=msg)

    grid = LocalGrid(app, cfg.num_clients)
    torch.manual_seed(cfg.seed)
    net = fresh()
    accs: list[float] = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        m = fresh()
        m.load_state_dict(arrays.to_torch_state_dict())
        m.eval()
        with torch.no_grad():
            acc = float((m(test[0]).argmax(1) == test[1]).double().mean())
        accs.append(acc)
        return MetricRecord({"accuracy": acc})

    strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=rounds, evaluate_fn=central)
    return accs[-1], grid, (grid.up_bytes + grid.down_bytes) / 1e6


def dpsgd_fedavg_cell(task: Mapping[str, Any], *, epsilon: float, steps: int, lr: float, delta: float = 1e-5) -> Cell:
    """Record-level DP-SGD under Flower's own FedAvg (every node every round): each device a :class:`DeviceDPSGD`
    at ``epsilon`` with the task's batch size and clip norm, one local epoch a round, for as many rounds as give
    ``steps`` DP-SGD steps per device in total (the row's own algorithm's budget of steps)."""
    from flwr.serverapp.strategy import FedAvg

    from fedpdm_flower.clients.dpsgd import DeviceDPSGD
    from fedpdm_flower.fedapp.config import parse_run_config

    cfg = parse_run_config(dict(task))
    per_node = cfg.samples_per_client or 60000 // cfg.num_clients
    per_round = math.ceil(per_node / cfg.batch_size)
    rounds = max(1, round(steps / per_round))
    device = DeviceDPSGD(epsilon=epsilon, delta=delta, max_rounds=rounds, clip_norm=cfg.clip_norm)
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=cfg.num_clients,
                      min_train_nodes=cfg.num_clients)
    t0 = time.perf_counter()
    acc, grid, mb = _reference_run(task, strategy=strategy, device=device, rounds=rounds, local_steps=0, lr=lr,
                                   batch=cfg.batch_size)
    worst = max(device.epsilon_spent(c) for c in grid.contexts.values())
    return Cell(accuracy=acc, epsilon=worst, accountant="rdp, subsampled Gaussian (device ledgers)", mbytes=mb,
                wall_s=time.perf_counter() - t0,
                note=f"{rounds} rounds x {per_round} steps (1 epoch, batch {cfg.batch_size}), lr {lr:g}")


def central_dp_cell(task: Mapping[str, Any], *, epsilon: float, rounds: int, local_steps: int, lr: float,
                    clip: float, delta: float = 1e-5) -> Cell:
    """Client-level DP with a trusted server: CentralDP around Flower's FedAvg (secret Poisson sampling of the
    nodes at rate 1 here -- every node every round, so no amplification -- updates clipped to ``clip``, Gaussian
    noise on the sum, PLD accountant). A different unit (a whole device) and adversary (not the server)."""
    from flwr.serverapp.strategy import FedAvg

    from fedpdm_flower.fedapp.config import parse_run_config
    from fedpdm_flower.strategies.central_dp import CentralDP

    cfg = parse_run_config(dict(task))
    strategy = CentralDP(FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1, fraction_evaluate=0.0),
                         epsilon=epsilon, delta=delta, clip_norm=clip, sample_rate=1.0, num_rounds=rounds,
                         min_available_nodes=cfg.num_clients)
    t0 = time.perf_counter()
    acc, _, mb = _reference_run(task, strategy=strategy, device=None, rounds=rounds, local_steps=local_steps, lr=lr,
                                batch=cfg.batch_size)
    spent = strategy.privacy_spent()
    return Cell(accuracy=acc, epsilon=float(spent.epsilon), accountant=f"{spent.accounting_method} (client level)",
                mbytes=mb, wall_s=time.perf_counter() - t0,
                note=f"client-level, trusted server; z = {strategy.z:.3g}, clip {clip:g}")


# ---------------------------------------------------------------------------------------------------- speed
def speed_ratio(reps: int = 5, records: int = 3000, batch: int = 64) -> dict[str, float]:
    """One local epoch of a user's CNN (the 20,522-parameter TinyCNN, MNIST-shaped tensors): DeviceDPSGD's DP-SGD
    epoch (Poisson sampling, per-record gradients by torch.func, clipping, noise) and a plain torch SGD epoch of the
    same model, data and batch size; median over ``reps`` interleaved repetitions, in this one process."""
    import torch
    from flwr.app import Context, RecordDict
    from torch.utils.data import DataLoader, TensorDataset

    from fedpdm_flower.clients.dpsgd import DeviceDPSGD
    from fedpdm_flower.fedapp.models.cnn import TinyCNN

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(records, 1, 28, 28, generator=g), torch.randint(0, 10, (records,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)
    plain_t, dp_t = [], []
    device = DeviceDPSGD(epsilon=8.0, max_rounds=10 * reps, clip_norm=1.0)

    def plain() -> None:
        net = TinyCNN()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()  # type: ignore[no-untyped-call]
            opt.step()

    def private() -> None:
        ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
        device.train(TinyCNN(), loader, lr=0.1, context=ctx)

    plain()
    private()  # warm-up (and the calibration, cached)
    for _ in range(reps):
        t = time.perf_counter()
        plain()
        plain_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        private()
        dp_t.append(time.perf_counter() - t)
    p, d = statistics.median(plain_t), statistics.median(dp_t)
    return {"plain torch SGD epoch s": p, "DeviceDPSGD epoch s": d, "ratio": d / p, "records": float(records),
            "batch": float(batch)}


# ---------------------------------------------------------------------------------------------------- the table
def _fmt(c: Cell | None, reference: float | None) -> str:
    if c is None:
        return "-"
    if c.accuracy is None:
        return f"n/a ({c.note})" if c.note else "n/a"
    s = f"{c.accuracy:.3f}"
    if reference is not None and c.epsilon is not None:
        s += f" ({100 * (c.accuracy - reference):+.1f} pts)"
    if c.epsilon is not None:
        s += f", eps {c.epsilon:.3g}"
    if c.paper_epsilon is not None:
        s += f" (paper's figure {c.paper_epsilon:.3g})"
    return s


def table(results: Mapping[str, Mapping[str, Cell]], tasks: Mapping[str, str]) -> str:
    """The markdown table: rows x :data:`COLUMNS`, points against the row's no-noise accuracy, bytes of eps 8."""
    head = "| algorithm (task) | " + " | ".join(COLUMNS) + " | MB moved (eps 8) |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for name, cells in results.items():
        ref = cells.get("no noise")
        reference = ref.accuracy if ref is not None else None
        mb = cells.get("eps 8")
        moved = f"{mb.mbytes:.1f}" if mb is not None and mb.mbytes is not None else "-"
        lines.append(f"| {name} ({tasks.get(name, '')}) | "
                     + " | ".join(_fmt(cells.get(c), reference) for c in COLUMNS) + f" | {moved} |")
    return "\n".join(lines)


def main(out: Path, only: list[str] | None = None, columns: list[str] | None = None) -> int:
    """Run every registered row (or the rows whose name contains one of ``only``), write dp_seeds.json/.md."""
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dp_seeds.json"
    saved: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    results: dict[str, dict[str, Cell]] = {n: {c: Cell(**v) for c, v in cells.items()}
                                           for n, cells in saved.get("results", {}).items()}
    tasks: dict[str, str] = dict(saved.get("tasks", {}))
    for row in rows():
        if only and not any(o in row.name for o in only):
            continue
        tasks[row.name] = row.task
        for column, run in row.cells.items():
            if columns and column not in columns:
                continue
            cell = run()
            results.setdefault(row.name, {})[column] = cell
            print(json.dumps({"row": row.name, "column": column, **asdict(cell)}), flush=True)
            path.write_text(json.dumps({"results": {n: {c: asdict(v) for c, v in cs.items()} for n, cs in results.items()},
                                        "tasks": tasks, "speed": saved.get("speed")}, indent=1))
    speed = speed_ratio()
    doc = {"results": {n: {c: asdict(v) for c, v in cs.items()} for n, cs in results.items()}, "tasks": tasks,
           "speed": speed}
    path.write_text(json.dumps(doc, indent=1))
    md = table(results, tasks) + (
        f"\n\nDP local epoch / plain torch SGD epoch (TinyCNN, {int(speed['records'])} records, batch "
        f"{int(speed['batch'])}): {speed['ratio']:.2f}x ({speed['DeviceDPSGD epoch s']:.2f} s / "
        f"{speed['plain torch SGD epoch s']:.2f} s, median of 5 interleaved)\n")
    (out / "dp_seeds.md").write_text(md)
    print(md)
    return 0
