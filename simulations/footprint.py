"""``python -m simulations bench --suite footprint``: a SuperNode's memory and start-up cost per algorithm family.

For each family (fedpdm, iadmm, recal: numpy; dpq, fedrep: torch) it writes MNIST partitions with the partition
command, starts a real local deployment (1 SuperLink + 2 SuperNodes on loopback, node config ``data-path`` =
partition 0 / 1 of a 10-way split: 6,000 samples per device), runs 2 rounds (dpq-dsgd: 4, its minimum), and polls
``/proc`` every 50 ms for every process of the deployment:

* **SuperNode**: the ``flower-supernode`` process and the ``flower-superexec`` it spawns (both live for the whole
  deployment); peak RSS = ``VmHWM`` (the kernel's high-water mark of the resident set) at the last poll.
* **ClientApp**: Flower 1.42's deployment starts one ``flwr-clientapp`` process per message (shared/notes/
  flower-1.42.md section 6); each imports the app, loads its data-path and the model, answers one message and
  exits. Peak RSS = the largest ``VmHWM`` over those processes (read at the last poll before each exits, so a
  lower bound that misses at most the last 50 ms of growth); "start to reply" = the process's lifetime, from its
  start time in ``/proc/<pid>/stat`` to the first poll that no longer sees it (the reply is sent just before exit;
  resolution 50 ms).

A device runs the SuperNode, its superexec and one ClientApp at a time, so its total is about the sum of the three
peaks. The SuperLink and the ServerApp run on the server and are not counted. IADMM's products use torch when it
is installed; the numpy row forces ``FEDAPP_IADMM_BACKEND=numpy``, as a device without torch would run.

Writes ``footprint.json`` and ``footprint.md`` (the table in docs/deployment.md) into ``--out``.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "Proc", "main", "measure"]

NODES = 2
SPLIT = 10  # partitions of the 10-way split; nodes 0, 1 get 6,000 samples each
POLL_S = 0.05

#: family -> (run-config overrides, partitioner, test samples in each file, environment of the daemons)
FAMILIES: dict[str, tuple[dict[str, Any], str, int, dict[str, str]]] = {
    "fedpdm (numpy)": ({"algorithm": "bsdp-fedpdm"}, "iid", 0, {}),
    "iadmm (numpy)": ({"algorithm": "objpm", "model": "multinomial-nobias", "total-samples": NODES * 6000},
                      "iid", 0, {"FEDAPP_IADMM_BACKEND": "numpy"}),
    "recal (numpy)": ({"algorithm": "dp-recal", "recal-samples": SPLIT * 6000, "graph": "complete"}, "recal", 0,
                      {}),
    "dpq (torch)": ({"algorithm": "dpq-dsgd", "model": "lenet5-valid", "num-server-rounds": 4, "graph": "complete",
                     "dpq-eval-limit": 500}, "iid", 500, {}),
    "fedrep (torch)": ({"algorithm": "fedrep", "model": "lenet5", "batch-size": 25, "local-steps": 2,
                        "buffer-size": 2, "secagg-mode": "plain"}, "iid", 0, {}),
}


@dataclass
class Proc:
    """One process of the deployment as the poller saw it."""

    pid: int
    role: str
    start_s: float  # process start, seconds since boot
    last_seen_s: float = 0.0  # seconds since boot
    hwm_kb: int = 0
    gone: bool = False


@dataclass
class Poller:
    """Polls the deployment's process tree every POLL_S seconds in a thread."""

    dep: Any
    procs: dict[tuple[int, float], Proc] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        while not self.stop.is_set():
            now = _uptime()
            seen = set()
            for pid, start in self.dep.process_tree().items():
                key = (pid, start / ticks)
                role = _role(pid)
                hwm = _hwm_kb(pid)
                if role is None or hwm is None:
                    continue
                p = self.procs.setdefault(key, Proc(pid=pid, role=role, start_s=start / ticks))
                p.hwm_kb, p.last_seen_s = max(p.hwm_kb, hwm), now
                seen.add(key)
            for key, p in self.procs.items():
                if key not in seen and not p.gone:
                    p.gone, p.last_seen_s = True, now  # first poll without it: it ended within the last POLL_S
            time.sleep(POLL_S)


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def _cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def _role(pid: int) -> str | None:
    """What the process is; a superexec counts as the SuperNode's when its parent is a flower-supernode."""
    cmd = _cmdline(pid)
    if cmd is None:
        return None
    for role in ("flwr-clientapp", "flower-supernode", "flower-superexec", "flwr-serverapp", "flower-superlink"):
        if role in cmd:
            if role == "flower-superexec":  # the SuperNode's, or the SuperLink's (ServerApp side)
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                    ppid = int(stat[stat.rindex(")") + 2:].split()[1])
                except (OSError, ValueError):
                    return None
                return role if "flower-supernode" in (_cmdline(ppid) or "") else "superexec-server"
            return role
    return None


def _hwm_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def measure(family: str, work: Path) -> dict[str, Any]:
    """Run one family on a fresh deployment and summarise its processes (module docstring)."""
    from simulations.deploy import local_deployment
    from simulations.flower_driver import run_flower
    from simulations.partition import write_partitions

    overrides, partitioner, test_samples, extra_env = FAMILIES[family]
    slug = family.split()[0]
    parts = work / f"parts-{slug}"
    manifest = write_partitions("mnist", SPLIT, parts, partitioner=partitioner, seed=0, test_samples=test_samples,
                                num_samples=overrides.get("recal-samples", 0))
    run = {"dataset": "mnist", "partitioner": partitioner if partitioner != "recal" else "iid",
           "num-clients": NODES, "clients-per-round": NODES, "num-server-rounds": 2, "node-wait-s": 120,
           "eval-every": 1, **overrides}
    saved = {k: os.environ.get(k) for k in extra_env}
    os.environ.update(extra_env)  # the daemons inherit this process's environment (simulations.flower_driver)
    t0 = time.monotonic()
    try:
        with local_deployment(NODES, flwr_home=work / f"home-{slug}", startup_timeout=300,
                              node_config=lambda i: {"data-path": str(parts / f"partition_{i}.npz")}) as dep:
            poller = Poller(dep)
            thread = threading.Thread(target=poller.run, daemon=True)
            thread.start()
            try:
                res = run_flower(run, work / f"out-{slug}", connection=dep.connection, env=dep.env, stream=False,
                                 timeout=900)
                time.sleep(3 * POLL_S)
            finally:
                poller.stop.set()
                thread.join()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    wall = time.monotonic() - t0
    procs = list(poller.procs.values())
    apps = [p for p in procs if p.role == "flwr-clientapp"]
    lifetimes = [p.last_seen_s - p.start_s for p in apps if p.gone]

    def peak(role: str) -> float:
        return max((p.hwm_kb for p in procs if p.role == role), default=0) / 1024

    row = {
        "family": family, "algorithm": run["algorithm"], "status": res.status, "rounds": run["num-server-rounds"],
        "samples_per_device": manifest["partitions"][0]["samples"],
        "file_bytes": (parts / "partition_0.npz").stat().st_size,
        "supernode_peak_mb": peak("flower-supernode"), "superexec_peak_mb": peak("flower-superexec"),
        "clientapp_peak_mb": peak("flwr-clientapp"), "clientapp_processes": len(apps),
        "clientapp_median_s": statistics.median(lifetimes) if lifetimes else float("nan"),
        "clientapp_max_s": max(lifetimes) if lifetimes else float("nan"), "wall_s": wall,
        "env": extra_env,
    }
    first = min(apps, key=lambda p: p.start_s) if apps else None
    row["clientapp_first_s"] = (first.last_seen_s - first.start_s) if first is not None and first.gone else float("nan")
    row["device_total_mb"] = row["supernode_peak_mb"] + row["superexec_peak_mb"] + row["clientapp_peak_mb"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of docs/deployment.md."""
    out = ["| family | algorithm | samples / device (npz) | SuperNode | its superexec | ClientApp peak (max over "
           "processes) | device total | ClientApp start to reply: first / median / max | processes |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['family']} | {r['algorithm']} | {r['samples_per_device']} ({r['file_bytes'] / 1e6:.1f} MB) | "
            f"{r['supernode_peak_mb']:.0f} MB | {r['superexec_peak_mb']:.0f} MB | {r['clientapp_peak_mb']:.0f} MB | "
            f"{r['device_total_mb']:.0f} MB | {r['clientapp_first_s']:.1f} / {r['clientapp_median_s']:.1f} / "
            f"{r['clientapp_max_s']:.1f} s | {r['clientapp_processes']} |")
    return "\n".join(out)


def main(out: Path, families: list[str] | None = None, attempts: int = 2) -> int:
    """Measure every family (or the given ones, replacing their rows in an existing footprint.json), print and
    write the table. A family whose deployment fails to start (e.g. nodes not listed online on a loaded machine) is
    tried again, up to ``attempts`` times; a failure is reported, never turned into a row."""
    from simulations.deploy import DeploymentError
    from simulations.flower_driver import FlowerRunError

    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    unknown = [f for f in families or [] if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown families {unknown}; valid: {', '.join(FAMILIES)}")
    path = out / "footprint.json"
    rows: dict[str, dict[str, Any]] = {}
    if families and path.is_file():
        rows = {r["family"]: r for r in json.loads(path.read_text())}
    failed = []
    for family in families or list(FAMILIES):
        for attempt in range(1, attempts + 1):
            print(f"[footprint] {family} (attempt {attempt}) ...", flush=True)
            try:
                row = measure(family, out / "work")
            except DeploymentError as err:  # start-up on a loaded machine: try again
                print(f"[footprint] {family}: deployment did not start: {str(err).splitlines()[0]}", flush=True)
                continue
            except FlowerRunError as err:  # the run itself failed: report it, do not retry
                print(f"[footprint] {family} failed: {str(err).splitlines()[0]}", flush=True)
                failed.append(family)
                break
            print(f"[footprint] {json.dumps(row)}", flush=True)
            rows[family] = row
            path.write_text(json.dumps([rows[f] for f in FAMILIES if f in rows], indent=1) + "\n")
            break
        else:  # every attempt's deployment failed to start
            failed.append(family)
    ordered = [rows[f] for f in FAMILIES if f in rows]
    md = table(ordered)
    (out / "footprint.md").write_text(md + "\n")
    print(md)
    if failed:
        print(f"[footprint] not measured: {', '.join(failed)}", flush=True)
    return 0 if not failed and all(r["status"] == "finished:completed" for r in ordered) else 1
