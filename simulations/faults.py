"""Faults in a real local deployment: kill one SuperNode at a given server round, optionally start it again.

    python -m simulations.deploy --nodes 3 --kill 1@2 --restart-after 1 -- algorithm=bsdp-fedpdm dataset=synthetic \
        num-server-rounds=3

`--kill NODE@ROUND` kills SuperNode NODE (its partition id) -- the `flower-supernode` process and everything it
spawned (its `flower-superexec` and any running `flwr-clientapp`), SIGKILL by default, a crash without goodbye --
as soon as the ServerApp starts server round ROUND. The round is read from the run's own log stream (`flwr log
<run> --stream`): Flower's `Strategy.start` logs ``[ROUND r/R]`` before it configures round r, so the kill lands
after rounds 1..r-1 completed and before the node can answer round r (a reply needs the node's 3 s poll plus a
ClientApp start; :attr:`FaultEvent.replies_before` records what it had sent, so a caller can check). No timing guess.

`--restart NODE@ROUND` starts the same node again (the same command line: node config, port, flags) when round
ROUND starts; `--restart-after S` starts it S seconds after the kill. `--supervise S` starts it under a retry loop
instead -- what systemd's ``Restart=on-failure`` with ``RestartSec=S`` does for a device -- which starts the
SuperNode again S seconds after every failed exit: with node authentication the SuperLink refuses the registered
node (exit code 305, ApiError 2004) until it has missed two heartbeats (up to 2 x 30 s after its last one), and
the loop keeps trying until it is let in (:func:`supervisor_attempts` reads the loop's log). A restarted SuperNode registers as a new node
id (insecure SuperLink) with an empty `context.state`; the strategies give it the client of its partition-id back
at the start of the next round (:meth:`fedpdm_flower.strategies.base.FederatedStrategy.readmit`).

What the SuperLink does meanwhile (flwr 1.42, read from its code and seen in the tests): a SIGKILLed node is
online until its last heartbeat + 2 x 30 s; then every message to it is answered by the SuperLink itself with the
error "Node Unavailable", which the strategies attribute to the dead node (:meth:`~fedpdm_flower.strategies.base.
FederatedStrategy.reply_items`). A SIGTERMed node deactivates itself at once (``--kill-signal TERM``), so the same
error comes without the wait.

The faults are injected from the calling thread (the main thread for the CLI), while the run is driven from a
worker thread: a restarted SuperNode must get its parent-death signal from a thread that lives as long as the
deployment (see :func:`simulations.deploy._die_with_parent`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from simulations.deploy import LocalDeployment, _Daemon, _spawn, _tree
from simulations.flower_driver import ROOT, FlowerRun, FlowerRunError, run_flower

__all__ = ["FaultEvent", "FaultPlan", "FaultRun", "NodeAtRound", "add_fault_arguments", "describe_events",
           "describe_supervision", "fault_plan", "kill_node", "parse_node_at_round", "restart_node", "run_faulty",
           "run_with_faults", "supervisor_attempts"]

#: Flower's Strategy.start logs this when a server round begins (before configure_train)
ROUND_LINE = re.compile(r"\[ROUND (\d+)/(\d+)\]")
#: the SuperLink logs this when `flwr run` submits a run
CREATED_RUN = re.compile(r"Created run (\d+)")
#: a SuperNode logs this once per reply it sends
SENT_LINE = "Sending: "
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}


@dataclass(frozen=True)
class NodeAtRound:
    """``NODE@ROUND``: SuperNode NODE (its partition id) at the start of server round ROUND."""

    node: int
    round: int


def parse_node_at_round(text: str, flag: str = "--kill") -> NodeAtRound:
    """``"1@2"`` -> NodeAtRound(1, 2); one clear error naming the flag otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*@\s*(\d+)\s*", text)
    if m is None:
        raise ValueError(f"{flag} {text!r}: expected NODE@ROUND, e.g. 1@2 (node = partition id, round >= 1)")
    node, rnd = int(m.group(1)), int(m.group(2))
    if rnd < 1:
        raise ValueError(f"{flag} {text!r}: the round must be >= 1")
    return NodeAtRound(node, rnd)


@dataclass(frozen=True)
class FaultPlan:
    """Kill ``kill.node`` when round ``kill.round`` starts; start it again at ``restart`` or ``restart_after`` s."""

    kill: NodeAtRound
    restart: NodeAtRound | None = None
    restart_after: float | None = None
    signal: signal.Signals = signal.SIGKILL
    #: start the node again under a retry loop with this delay between attempts (None: start it once)
    supervise: float | None = None

    def check(self, num_nodes: int, num_rounds: int | None = None) -> None:
        """Raise ValueError naming what does not fit the deployment (before anything starts)."""
        if not 0 <= self.kill.node < num_nodes:
            raise ValueError(f"--kill {self.kill.node}@{self.kill.round}: node must be a partition id 0..{num_nodes - 1}")
        if num_rounds is not None and self.kill.round > num_rounds:
            raise ValueError(f"--kill {self.kill.node}@{self.kill.round}: the run has only {num_rounds} round(s)")
        if self.restart is not None and self.restart_after is not None:
            raise ValueError("give --restart NODE@ROUND or --restart-after S, not both")
        if self.restart is not None:
            if self.restart.node != self.kill.node:
                raise ValueError(f"--restart {self.restart.node}@{self.restart.round}: only the killed node "
                                 f"({self.kill.node}) can be restarted")
            if self.restart.round <= self.kill.round:
                raise ValueError(f"--restart {self.restart.node}@{self.restart.round}: must come after the kill in "
                                 f"round {self.kill.round}")
        if self.restart_after is not None and not self.restart_after >= 0:
            raise ValueError(f"--restart-after must be >= 0 seconds, got {self.restart_after}")
        if self.supervise is not None:
            if self.restart is None and self.restart_after is None:
                raise ValueError("--supervise needs --restart NODE@ROUND or --restart-after S (when to start the loop)")
            if not self.supervise > 0:
                raise ValueError(f"--supervise must be > 0 seconds, got {self.supervise}")


@dataclass
class FaultEvent:
    """What was done to a node: ``kill`` (the pids signalled) or ``restart`` (the new SuperNode's pid)."""

    action: str
    node: int
    round: int  # the server round in progress (whose [ROUND] line triggered it, or the last one seen)
    at_s: float  # seconds since the run was submitted
    pids: list[int]
    replies_before: int = 0  # replies the node had sent before it was killed (its log's "Sending:" lines)
    wall: float = 0.0  # time.time() of the event (the supervisor's log stamps attempts with the same clock)


@dataclass
class FaultRun:
    """The run's outcome (its FlowerRun, or the FlowerRunError it ended with), the faults and the ServerApp log."""

    run: FlowerRun | None
    error: FlowerRunError | None
    events: list[FaultEvent] = field(default_factory=list)
    server_log: str = ""

    @property
    def results(self) -> Path | None:
        """results.json of the run (written for a failed run too, once rounds have run)."""
        run = self.run if self.run is not None else (self.error.run if self.error is not None else None)
        return run.results if run is not None else None


# ---------------------------------------------------------------------------------------------------- one node
def _node_daemon(dep: LocalDeployment, node: int) -> _Daemon:
    """The latest process started as SuperNode ``node``."""
    name = f"supernode-{node}"
    found = [d for d in dep._daemons if d.name == name]
    if not found:
        raise ValueError(f"the deployment has no SuperNode {node} (nodes 0..{len(dep.node_ports) - 1})")
    return found[-1]


def kill_node(dep: LocalDeployment, node: int, sig: signal.Signals = signal.SIGKILL, timeout: float = 10.0) -> list[int]:
    """Signal SuperNode ``node`` and every process it spawned (superexec, ClientApps); wait for the SuperNode to go.

    Returns the pids signalled. With SIGKILL nothing of the node survives to say goodbye (a crash); with SIGTERM
    the SuperNode deactivates itself at the SuperLink before it exits.
    """
    daemon = _node_daemon(dep, node)
    if daemon.proc.poll() is not None:
        raise RuntimeError(f"SuperNode {node} (pid {daemon.proc.pid}) is not running")
    tree = _tree({daemon.proc.pid: daemon.start})
    # the SuperNode first, so that it cannot start a new ClientApp between the signals
    for pid in sorted(tree, key=lambda p: p != daemon.proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    daemon.proc.wait(timeout=timeout)
    return sorted(tree)


#: the retry loop of ``--supervise``: systemd's Restart=on-failure, RestartSec=$1, in bash (stamps each attempt)
SUPERVISOR = """delay=$1; shift; n=0
while true; do
  n=$((n + 1)); echo "[supervisor] attempt $n started at $(date +%s.%N)"
  "$@"; rc=$?
  echo "[supervisor] attempt $n exited with $rc at $(date +%s.%N)"
  [ "$rc" -eq 0 ] && exit 0
  sleep "$delay"
done"""
_ATTEMPT = re.compile(r"\[supervisor\] attempt (\d+) (started at|exited with (-?\d+) at) ([\d.]+)")


def supervisor_attempts(log: Path) -> list[dict[str, Any]]:
    """The attempts a supervised node's log records: ``{"attempt", "started", "exited", "rc"}`` (epoch seconds;
    ``exited`` / ``rc`` None for an attempt still running)."""
    out: dict[int, dict[str, Any]] = {}
    for m in _ATTEMPT.finditer(log.read_text(errors="replace") if log.exists() else ""):
        item = out.setdefault(int(m.group(1)), {"attempt": int(m.group(1)), "started": None, "exited": None,
                                                "rc": None})
        if m.group(2) == "started at":
            item["started"] = float(m.group(4))
        else:
            item["exited"], item["rc"] = float(m.group(4)), int(m.group(3))
    return [out[k] for k in sorted(out)]


def restart_node(dep: LocalDeployment, node: int, supervise: float | None = None) -> int:
    """Start SuperNode ``node`` again with the command line it was started with; returns the new pid.

    With ``supervise`` (seconds) it runs under :data:`SUPERVISOR`, a retry loop that starts it again that long
    after every failed exit. Its log goes to ``supernode-<node>.restart<k>.log``; the deployment stops it (the
    loop and the node) on exit like the others.
    """
    old = _node_daemon(dep, node)
    if old.proc.poll() is None:
        raise RuntimeError(f"SuperNode {node} (pid {old.proc.pid}) is still running")
    k = sum(1 for d in dep._daemons if d.name == old.name)
    argv = old.argv if supervise is None else ["bash", "-c", SUPERVISOR, "supervisor", f"{supervise:g}", *old.argv]
    new = _spawn(old.name, argv, old.env, dep.log_dir / f"{old.name}.restart{k}.log")
    new.argv = list(old.argv)  # a later restart starts the node itself again, not a loop around the loop
    dep._daemons.append(new)
    return new.proc.pid


def _replies_sent(log: Path) -> int:
    try:
        return log.read_text(errors="replace").count(SENT_LINE)
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------------- the run
class _LogFollower:
    """``flwr log <run> <connection> --stream`` in a subprocess; its lines arrive on a queue."""

    def __init__(self, run_id: int, dep: LocalDeployment) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(
            ["flwr", "log", str(run_id), dep.connection, "--stream"], env=dep.env, cwd=ROOT,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self.reader.start()

    def _read(self, stream: IO[str] | None) -> None:
        if stream is None:
            return
        for line in stream:
            self.lines.put(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.reader.join(timeout=5)


def _log_size(dep: LocalDeployment) -> int:
    try:
        return (dep.log_dir / "superlink.log").stat().st_size
    except OSError:
        return 0


def _wait_run_id(dep: LocalDeployment, worker: threading.Thread, timeout: float, offset: int = 0) -> int | None:
    """The id of the run the SuperLink created after byte ``offset`` of its log; None if the worker ended first."""
    log = dep.log_dir / "superlink.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with log.open("rb") as fh:
                fh.seek(offset)
                m = CREATED_RUN.search(fh.read().decode(errors="replace"))
        except OSError:
            m = None
        if m is not None:
            return int(m.group(1))
        if not worker.is_alive():
            return None
        time.sleep(0.2)
    return None


def run_with_faults(dep: LocalDeployment, overrides: Mapping[str, Any], out_dir: Path, plan: FaultPlan, *,
                    timeout: float = 3600.0, echo: bool = False, app: Path = ROOT,
                    results_name: str | None = "results.json") -> FaultRun:
    """Run ``overrides`` on ``dep`` (:func:`simulations.flower_driver.run_flower`) and inject ``plan``'s faults.

    Call it from the thread that entered ``local_deployment`` (the main thread): the restarted SuperNode is
    spawned from it. The run itself is driven from a worker thread. Returns when the run has ended, completed or
    not (a failed run's FlowerRunError is in :attr:`FaultRun.error`); ``echo`` prints the ServerApp's log lines.
    """
    plan.check(len(dep.node_ports))
    box: dict[str, Any] = {}

    def drive() -> None:
        try:
            box["run"] = run_flower(dict(overrides), out_dir, connection=dep.connection, env=dep.env, stream=False,
                                    timeout=timeout, app=app, results_name=results_name)
        except FlowerRunError as err:
            box["error"] = err
        except subprocess.TimeoutExpired:
            box["error"] = FlowerRunError(f"the run did not finish within {timeout:.0f} s")

    t0, offset = time.monotonic(), _log_size(dep)  # a run submitted from now on is ours
    worker = threading.Thread(target=drive, name="flwr-run", daemon=True)
    worker.start()
    events: list[FaultEvent] = []
    lines: list[str] = []
    run_id = _wait_run_id(dep, worker, timeout=120.0, offset=offset)
    follower = _LogFollower(run_id, dep) if run_id is not None else None
    current, restart_at = 0, None
    try:
        while follower is not None and (worker.is_alive() or not follower.lines.empty()):
            try:
                line = follower.lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line:
                lines.append(line)
                if echo:
                    print(line, end="", flush=True)
                m = ROUND_LINE.search(line)
                if m is not None:
                    current = int(m.group(1))
                    if current == plan.kill.round and not events:
                        node_log = _node_daemon(dep, plan.kill.node).log
                        pids = kill_node(dep, plan.kill.node, plan.signal)
                        events.append(FaultEvent("kill", plan.kill.node, current, time.monotonic() - t0, pids,
                                                 _replies_sent(node_log), wall=time.time()))
                        if plan.restart_after is not None:
                            restart_at = time.monotonic() + plan.restart_after
                    if plan.restart is not None and current == plan.restart.round and len(events) == 1:
                        restart_at = time.monotonic()
            if restart_at is not None and time.monotonic() >= restart_at:
                restart_at = None
                pid = restart_node(dep, plan.kill.node, plan.supervise)
                events.append(FaultEvent("restart", plan.kill.node, current, time.monotonic() - t0, [pid],
                                         wall=time.time()))
    finally:
        worker.join(timeout=timeout)
        if follower is not None:
            follower.stop()
            while not follower.lines.empty():
                lines.append(follower.lines.get())
    return FaultRun(run=box.get("run"), error=box.get("error"), events=events, server_log="".join(lines))


# ---------------------------------------------------------------------------------------------------- CLI hook
def add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    """``--kill NODE@ROUND``, ``--restart NODE@ROUND``, ``--restart-after S``, ``--kill-signal`` for
    ``python -m simulations.deploy``."""
    g = parser.add_argument_group("faults (simulations.faults)")
    g.add_argument("--kill", metavar="NODE@ROUND", default=None,
                   help="kill SuperNode NODE (partition id) and its ClientApps when server round ROUND starts")
    g.add_argument("--restart", metavar="NODE@ROUND", default=None,
                   help="start the killed node again (same node config) when round ROUND starts")
    g.add_argument("--restart-after", metavar="S", type=float, default=None,
                   help="start the killed node again S seconds after the kill")
    g.add_argument("--supervise", metavar="S", type=float, default=None,
                   help="start the killed node again under a retry loop (systemd Restart=on-failure, RestartSec=S): "
                        "with node authentication it is refused until the SuperLink missed two heartbeats")
    g.add_argument("--kill-signal", choices=sorted(SIGNALS), default="KILL",
                   help="KILL (default: a crash; the SuperLink notices after 2 missed heartbeats, <= 60 s) or TERM "
                        "(the node deactivates itself on the way out)")


def fault_plan(args: argparse.Namespace, num_nodes: int, num_rounds: int) -> FaultPlan | None:
    """The FaultPlan the parsed arguments ask for (None without ``--kill``); ValueError naming a bad flag."""
    if args.kill is None:
        if args.restart is not None or args.restart_after is not None or args.supervise is not None:
            raise ValueError("--restart / --restart-after / --supervise need --kill NODE@ROUND")
        return None
    plan = FaultPlan(kill=parse_node_at_round(args.kill, "--kill"),
                     restart=parse_node_at_round(args.restart, "--restart") if args.restart is not None else None,
                     restart_after=args.restart_after, signal=SIGNALS[args.kill_signal], supervise=args.supervise)
    plan.check(num_nodes, num_rounds)
    return plan


def describe_events(events: list[FaultEvent]) -> list[str]:
    """One line per fault for the CLI."""
    out = []
    for e in events:
        if e.action == "kill":
            out.append(f"[fault] killed SuperNode {e.node} at the start of round {e.round} ({e.at_s:.0f} s into the "
                       f"run; pids {e.pids}; it had sent {e.replies_before} replies)")
        else:
            out.append(f"[fault] restarted SuperNode {e.node} during round {e.round} ({e.at_s:.0f} s; pid {e.pids[0]})")
    return out


def describe_supervision(dep: LocalDeployment, events: list[FaultEvent]) -> list[str]:
    """For a supervised restart: each attempt of the loop, and when the node was let in (seconds after the kill)."""
    kill = next((e for e in events if e.action == "kill"), None)
    restart = next((e for e in events if e.action == "restart"), None)
    if kill is None or restart is None:
        return []
    k = sum(1 for d in dep._daemons if d.name == f"supernode-{kill.node}") - 1
    attempts = supervisor_attempts(dep.log_dir / f"supernode-{kill.node}.restart{k}.log")
    out = [f"[fault] supervisor attempt {a['attempt']}: started {a['started'] - kill.wall:.1f} s after the kill, "
           + ("still running" if a["rc"] is None else f"exit {a['rc']}") for a in attempts if a["started"]]
    return out


def run_faulty(dep: LocalDeployment, overrides: Mapping[str, Any], out_dir: Path, plan: FaultPlan,
               timeout: float) -> FlowerRun:
    """The CLI's faulty run: :func:`run_with_faults`, the faults printed; a failed run raises FlowerRunError with
    the run's own one-line error (results.json's ``error``) when it wrote one."""
    fr = run_with_faults(dep, overrides, out_dir, plan, timeout=timeout)
    for line in describe_events(fr.events) + describe_supervision(dep, fr.events):
        print(line, flush=True)
    if not fr.events:
        print(f"[fault] the run ended before round {plan.kill.round} started: nothing was killed", flush=True)
    if fr.error is not None:
        results = fr.results
        if results is not None and results.exists():
            import json

            doc = json.loads(results.read_text())
            if doc.get("error"):
                raise FlowerRunError(f"run failed: {doc['error']} (results of the {len(doc.get('rounds', []))} "
                                     f"round(s) that ran: {results})", fr.error.run)
        raise fr.error
    assert fr.run is not None
    return fr.run
