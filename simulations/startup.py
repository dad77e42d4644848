"""``python -m simulations bench --suite startup``: whole runs at 1,000 and 10,000 SuperNodes, ours vs Flower's FedAvg.

For each configuration it runs ``python -m simulations run --engine flower`` (the command a user types) for Flower's
own FedAvg (``flwr-fedavg``), then BSDP-FedPDM as the reproduction app runs it (``identify-nodes = "ask"``: a
``query.whoami`` to every node before round 1) and BSDP-FedPDM with ``identify-nodes = "node-order"`` (no message
before round 1, as FedAvg), back to back on the local simulation SuperLink, and reports

* the wall time of the whole command (submission, Ray start-up, every round, results), and its ratio;
* the sum of the rounds' own timers and what lies outside them (start-up and shutdown);
* round 1 alone (BSDP-FedPDM's Alg. 1 line 2 trains all N clients in round 1, S_0 = [N], unless ``first-round-all
  = false``), and the messages sent before it;
* the peak resident set (``VmHWM``) of every process of the simulation (the ``flwr-simulation`` process that runs
  the ServerApp, and each Ray worker that runs ClientApps), polled from ``/proc`` every 0.25 s;

plus the CPU time and traced memory of building node 9,999's share of a 10,000-node MNIST split for each partitioner
(a fresh process; the test suite checks the memory, this bench reports the time).

Configurations (MNIST, 100 clients per round, ``--rounds`` rounds, default 10):

* **1,000 nodes**: the default run config otherwise (the paper's split, 60 samples per node);
* **10,000 nodes**: MNIST's 60,000 samples give 6 per node, so local training is cut to 2 steps of batch 2
  (BSDP-FedPDM's subsampling rate q = steps x batch / n_local must stay below 1), and ``first-round-all = false``
  (round 1 samples 100 clients as every other round; with the paper's S_0 = [N] round 1 alone would train all
  10,000). Both algorithms get the same keys.

The machine is shared: the ratio of two runs in one invocation is the figure to read, not the seconds. Writes
``startup.json`` and ``startup.md`` into ``--out``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CONFIGS", "main", "partition_cost"]

#: (label, algorithm, extra run config): Flower's FedAvg first, the baseline of every ratio
RUNS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("flwr-fedavg", "flwr-fedavg", {}),
    ("bsdp-fedpdm", "bsdp-fedpdm", {}),
    ("bsdp-fedpdm node-order", "bsdp-fedpdm", {"identify-nodes": "node-order"}),
    # FedAvg's work in round 1 too: 100 sampled clients instead of Alg. 1's S_0 = [N] (where the config keeps it)
    ("bsdp-fedpdm node-order, round 1 sampled", "bsdp-fedpdm", {"identify-nodes": "node-order",
                                                                "first-round-all": False}),
)
POLL_S = 0.25
CONFIGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("1,000 nodes", {"dataset": "mnist", "num-clients": 1000, "clients-per-round": 100}),
    ("10,000 nodes", {"dataset": "mnist", "num-clients": 10_000, "clients-per-round": 100, "batch-size": 2,
                      "max-local-steps": 2, "first-round-all": False}),
)

_PARTITION_COST = """
import json, time, tracemalloc
import numpy as np
from fedpdm_flower.fedapp.data import sources
from fedpdm_flower.fedapp.data.partition import split_dataset
t = time.process_time()
y, _ = sources.train_labels("mnist")
out = {"read labels": {"cpu_s": time.process_time() - t}}
for scheme in ("paper", "iid", "label-k", "dirichlet"):
    kw = {"dirichlet_alpha": 1.0} if scheme == "dirichlet" else {}
    labels = np.random.default_rng(0).integers(0, 10, 1_000_000) if scheme == "dirichlet" else y
    t = time.process_time()
    rows = split_dataset(labels, scheme, 10_000, 0, **kw).indices(9_999)
    cpu = time.process_time() - t
    tracemalloc.start()
    split_dataset(labels, scheme, 10_000, 0, **kw).indices(9_999)
    out[scheme] = {"cpu_s": cpu, "traced_peak_mb": tracemalloc.get_traced_memory()[1] / 1e6, "rows": int(rows.size)}
    tracemalloc.stop()
print(json.dumps(out))
"""


def partition_cost() -> dict[str, Any]:
    """CPU seconds and traced peak MB of node 9,999's share of a 10,000-node split, per partitioner (fresh process;
    dirichlet on 1,000,000 labels: MNIST's 60,000 cannot give 10,000 nodes its minimum of 10 samples each)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _PARTITION_COST], capture_output=True, text=True, env=env,
                          check=True, timeout=600)
    return dict(json.loads(proc.stdout))


# ------------------------------------------------------------------------------------------- process polling
def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return None


def _ppid_and_start(pid: int) -> tuple[int, int] | None:
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19])  # ppid, starttime (clock ticks since boot)


def _hwm_kb(pid: int) -> int | None:
    status = _read(f"/proc/{pid}/status")
    if status is None:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return None


def _role(cmd: str) -> str:
    if "ClientAppActor" in cmd:
        return "ray worker (ClientApps)"
    if "flwr-simulation" in cmd:
        return "flwr-simulation (ServerApp)"
    if "flower-superlink" in cmd:
        return "flower-superlink"
    return "other (ray daemons)"


@dataclass
class _Proc:
    role: str
    hwm_kb: int = 0


@dataclass
class Poller:
    """Polls the process tree of this FLWR_HOME's SuperLink (and the simulations it starts) every POLL_S."""

    flwr_home: str
    procs: dict[tuple[int, int], _Proc] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def tree(self) -> dict[int, tuple[int, str]]:
        """pid -> (start ticks, cmdline) of the SuperLink's / simulations' processes and their descendants."""
        parent: dict[int, int] = {}
        info: dict[int, tuple[int, str]] = {}
        roots: list[int] = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            ps = _ppid_and_start(pid)
            cmd = _read(f"/proc/{pid}/cmdline")
            if ps is None or cmd is None:
                continue
            parent[pid], info[pid] = ps[0], (ps[1], cmd.replace("\0", " "))
            if "flower-superlink" in cmd or "flwr-simulation" in cmd:
                env = _read(f"/proc/{pid}/environ") or ""
                if f"FLWR_HOME={self.flwr_home}\0" in env:
                    roots.append(pid)
        keep = set(roots)
        changed = True
        while changed:  # descendants (a handful of levels: superlink -> simulation -> raylet -> workers)
            changed = False
            for pid, pp in parent.items():
                if pp in keep and pid not in keep:
                    keep.add(pid)
                    changed = True
        return {pid: info[pid] for pid in keep}

    def run(self) -> None:
        while not self.stop.is_set():
            for pid, (start, cmd) in self.tree().items():
                hwm = _hwm_kb(pid)
                if hwm is None:
                    continue
                p = self.procs.setdefault((pid, start), _Proc(role=_role(cmd)))
                if p.role == "other (ray daemons)":  # a Ray worker is named after its actor once it hosts one
                    p.role = _role(cmd)
                p.hwm_kb = max(p.hwm_kb, hwm)
            self.stop.wait(POLL_S)

    def peaks(self, since_ticks: int) -> dict[str, dict[str, float]]:
        """Per role: how many processes started after ``since_ticks`` and their largest peak RSS (MB)."""
        out: dict[str, dict[str, float]] = {}
        for (_pid, start), p in self.procs.items():
            if start < since_ticks:
                continue  # the long-lived SuperLink and earlier runs' processes
            row = out.setdefault(p.role, {"processes": 0, "max_peak_rss_mb": 0.0})
            row["processes"] += 1
            row["max_peak_rss_mb"] = max(row["max_peak_rss_mb"], p.hwm_kb / 1024)
        return out


def _now_ticks() -> int:
    return int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))


def run_once(algorithm: str, overrides: dict[str, Any], out: Path, poller: Poller) -> dict[str, Any]:
    """One ``python -m simulations run --engine flower`` as a user types it; its wall time and figures."""
    from simulations.flower_driver import flwr_env, toml_value

    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "simulations", "run", "--engine", "flower", "--algorithm", algorithm,
           "--out", str(out / "run")]
    for k, v in overrides.items():
        cmd += ["--set", f"{k}={toml_value(v)}"]
    since = _now_ticks()
    t0 = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=flwr_env(), check=False,
                              cwd=Path(__file__).resolve().parents[1])
    wall = time.perf_counter() - t0
    time.sleep(2 * POLL_S)  # one more poll of the last processes
    results = out / "run" / "results.json"
    doc = json.loads(results.read_text()) if results.is_file() else {}
    if proc.returncode != 0 or doc.get("status") != "completed":
        raise RuntimeError(f"{algorithm} {overrides}: exit code {proc.returncode}, status {doc.get('status')!r}; "
                           f"see {out / 'log.txt'}")
    rounds = [float(r["wall_s"]) for r in doc["rounds"]]
    return {"command": " ".join(cmd[1:]), "wall_s": wall, "rounds_s": sum(rounds), "round1_s": rounds[0],
            "later_rounds_s": sum(rounds[1:]), "outside_rounds_s": wall - sum(rounds),
            "round1_clients": doc["rounds"][0].get("clients"), "final_test_accuracy": doc["summary"][
                "final_test_accuracy"], "processes": poller.peaks(since)}


def main(out: Path, *, rounds: int = 10, configs: tuple[str, ...] | None = None) -> int:
    """Run every configuration (or those named in ``configs``) and write out/startup.json + out/startup.md."""
    from simulations.flower_driver import flwr_env

    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"rounds": rounds, "partition of node 9,999 of 10,000": partition_cost()}
    poller = Poller(flwr_home=flwr_env()["FLWR_HOME"])
    thread = threading.Thread(target=poller.run, daemon=True)
    thread.start()
    t0 = time.time()
    try:
        for label, over in CONFIGS:
            if configs and label not in configs:
                continue
            runs: dict[str, Any] = {}
            done: list[tuple[str, dict[str, Any]]] = []
            for name, algo, extra in RUNS:
                if (algo, {**over, **extra}) in done:  # the configuration already says it (10,000 nodes)
                    continue
                done.append((algo, {**over, **extra}))
                try:
                    runs[name] = run_once(algo, {**over, **extra, "num-server-rounds": rounds},
                                          out / label.split()[0].replace(",", "") / name.replace(", ", "-").replace(" ", "-"), poller)
                except RuntimeError as err:  # a failed run is a result too: recorded, and the bench goes on
                    runs[name] = {"failed": str(err)[:2000]}
                    print(f"[startup] {label} {name}: {str(err)[:300]}", flush=True)
            flower = runs["flwr-fedavg"]
            ratios: dict[str, Any] = {}
            for name, ours in runs.items():
                ok = name != "flwr-fedavg" and "wall_s" in ours and "wall_s" in flower
                if ok:
                    ratios[name] = {"whole run": ours["wall_s"] / flower["wall_s"],
                                    "rounds 2..R": ours["later_rounds_s"] / flower["later_rounds_s"]}
            report[label] = {"run config": over, "runs": runs, "ratios to flwr-fedavg": ratios}
            (out / "startup.json").write_text(json.dumps(report, indent=1))
    finally:
        poller.stop.set()
        thread.join()
    report["bench_wall_s"] = time.time() - t0
    (out / "startup.json").write_text(json.dumps(report, indent=1))
    md = ["| configuration | algorithm | whole run | rounds (round 1) | outside rounds | worker peak RSS | "
          "ServerApp peak RSS |", "|---|---|---|---|---|---|---|"]
    for label, _ in CONFIGS:
        if label not in report:
            continue
        for algo, r in report[label]["runs"].items():
            if "failed" in r:
                md.append(f"| {label} | {algo} | failed: {r['failed'][:160]} | | | | |")
                continue
            procs = r["processes"]
            worker = procs.get("ray worker (ClientApps)", {}).get("max_peak_rss_mb", float("nan"))
            server = procs.get("flwr-simulation (ServerApp)", {}).get("max_peak_rss_mb", float("nan"))
            md.append(f"| {label} | {algo} | {r['wall_s']:.1f} s | {r['rounds_s']:.1f} s ({r['round1_s']:.1f} s, "
                      f"{r['round1_clients']:.0f} clients) | {r['outside_rounds_s']:.1f} s | {worker:.0f} MB | "
                      f"{server:.0f} MB |")
        for name, ratio in report[label]["ratios to flwr-fedavg"].items():
            md.append(f"| {label} | {name} / flwr-fedavg | {ratio['whole run']:.2f}x | rounds 2..R "
                      f"{ratio['rounds 2..R']:.2f}x | | | |")
    md += ["", "| partitioner (node 9,999 of 10,000) | CPU | traced peak |", "|---|---|---|"]
    for scheme, m in report["partition of node 9,999 of 10,000"].items():
        md.append(f"| {scheme} | {m['cpu_s']:.3f} s | {m.get('traced_peak_mb', float('nan')):.1f} MB |")
    (out / "startup.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0
