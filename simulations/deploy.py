"""A real (non-simulated) Flower deployment on loopback: one SuperLink, N SuperNodes, torn down afterwards.

`local_deployment(n, flwr_home=...)` is secure by default: it writes a throw-away PKI with `simulations.pki` (a CA,
the SuperLink's certificate for 127.0.0.1/localhost, one EC key per node; private keys 0600) and starts

    flower-superlink --ssl-ca-certfile ca.crt --ssl-certfile superlink.crt --ssl-keyfile superlink.key \
                     --enable-supernode-auth --disable-runtime-dependency-installation --host 127.0.0.1 --port P
    flwr supernode register supernode-i.pub deploy-P                          (every node's public key)
    flower-supernode --root-certificates ca.crt --auth-supernode-private-key supernode-i \
                     --superlink 127.0.0.1:P --port Q_i --node-config "partition-id=i num-partitions=N"

(i = 0..N-1; free ports are picked when not given). With `secure=False` (explicit opt-in for a trusted network)
the daemons get `--insecure` instead and no key is registered. The SuperLink becomes the CLI connection "deploy-P"
in $FLWR_HOME/config.toml (`root-certificates` = the CA, or `insecure = true`); the helper waits until
`flwr supernode list` shows all N nodes online, and yields a
`LocalDeployment` whose `connection` and `env` go straight into `run_flower(..., connection=, env=)`. On exit, even
when the body raised, every process it started is stopped (SIGTERM, then SIGKILL after a timeout), including the
`flower-superexec` / `flwr-serverapp` / `flwr-clientapp` processes the daemons spawned, and the connection is
removed from config.toml again.

Command line (one configuration on a fresh local deployment, TLS + SuperNode authentication unless `--insecure`
is given; run-config overrides after `--`):

    python -m simulations.deploy --nodes 2 -- dataset=synthetic partitioner=iid num-server-rounds=2

Linux is the target: the process tree is tracked through /proc, and the daemons get PR_SET_PDEATHSIG so that
they die with the Python process that started them even if it is SIGKILLed (their superexecs follow within
seconds through Flower's own --parent-pid watch). Elsewhere only the SuperLink and SuperNode processes themselves
are tracked.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from simulations.flower_driver import ROOT, FlowerRunError, flwr_env, run_flower
from simulations.pki import DeploymentPKI, generate_pki

__all__ = ["DeploymentError", "LocalDeployment", "free_ports", "local_deployment", "main", "still_running"]

#: how many log lines of each daemon a startup error shows
LOG_TAIL_LINES = 25
#: log lines that mean a daemon is up but useless (port taken)
FATAL_LOG_LINES = ("error while attempting to bind", "address already in use")


class DeploymentError(RuntimeError):
    """The local SuperLink/SuperNodes did not come up (the message carries the tail of their logs)."""


@dataclass
class _Daemon:
    """One process we started (SuperLink or SuperNode; it leads its own process group) and its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    start: int  # start time from /proc (-1 where there is none): tells the process from a later one with its pid
    log: Path
    log_handle: IO[bytes] = field(repr=False)
    argv: list[str] = field(default_factory=list, repr=False)  # as started (simulations.faults restarts with it)
    env: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass
class LocalDeployment:
    """What the body of `local_deployment` gets.

    Attributes
    ----------
    connection
        Name of the SuperLink connection in $FLWR_HOME/config.toml, e.g. "deploy-41235"; pass it as
        `run_flower(..., connection=...)` or `flwr run . <connection>`.
    env
        Environment for the `flwr` CLI (FLWR_HOME set to this deployment's, telemetry off, venv bin on PATH).
    log_dir
        Directory holding superlink.log and supernode-<i>.log (ClientApp output lands in the SuperNode logs).
    address
        The SuperLink's address, "127.0.0.1:<port>".
    node_ports
        Runtime API port of each SuperNode (index = partition id).
    pki
        The CA, SuperLink certificate and node keys in use; None for an insecure deployment (`secure=False`).
    node_ids
        Node id the SuperLink assigned to node i's registered key (index = partition id); empty when insecure.
    """

    connection: str
    env: dict[str, str]
    log_dir: Path
    flwr_home: Path
    address: str
    node_ports: list[int]
    pki: DeploymentPKI | None = None
    node_ids: list[int] = field(default_factory=list)
    _daemons: list[_Daemon] = field(default_factory=list, repr=False)

    @property
    def pids(self) -> list[int]:
        """PIDs of the SuperLink (first) and the SuperNodes."""
        return [d.proc.pid for d in self._daemons]

    def process_tree(self) -> dict[int, int]:
        """Every live process we started plus its descendants, as pid -> start time (Linux; else the daemons)."""
        return _tree({d.proc.pid: d.start for d in self._daemons})

    def logs_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of every daemon's log, for error messages."""
        return _tails(self._daemons, lines)


# ---------------------------------------------------------------------------------------------------- processes
def _proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, process group, start time in clock ticks) of a process from /proc; None if gone/unreadable."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2:].split()  # fields 3.. ; the command name (field 2) may contain spaces
    return rest[0], int(rest[1]), int(rest[2]), int(rest[19])


def _has_proc() -> bool:
    return Path("/proc/self/stat").exists()


def _tree(leaders: dict[int, int]) -> dict[int, int]:
    """pid -> start time of the live `leaders` (pid -> start time), their descendants and their process groups.

    A daemon leads its own process group (start_new_session), so a group member whose parent has already exited
    is still found; a process started before the leader cannot belong to it. Without /proc: the leaders only.
    """
    if not _has_proc():
        return {pid: start for pid, start in leaders.items() if _alive(pid, start)}
    table: dict[int, tuple[str, int, int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _proc_stat(int(entry.name))) is not None:
            table[int(entry.name)] = st
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    # a leader pid now held by another process (pid reuse) disowns that group
    ours = {pid for pid, start in leaders.items() if pid not in table or table[pid][3] == start}
    todo = [pid for pid in ours if pid in table]
    todo += [pid for pid, (_, _, pgid, start) in table.items() if pgid in ours and start >= leaders[pgid]]
    out: dict[int, int] = {}
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out[pid] = table[pid][3]
        todo.extend(children.get(pid, []))
    return {pid: start for pid, start in out.items() if table[pid][0] != "Z"}


def _alive(pid: int, start: int) -> bool:
    """The process `pid` still runs (not a zombie) and is the one that had start time `start` (-1: don't check)."""
    if not _has_proc():
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    st = _proc_stat(pid)
    return st is not None and st[0] != "Z" and (start < 0 or st[3] == start)


def still_running(tree: dict[int, int]) -> list[int]:
    """The pids of `tree` (pid -> start time, e.g. from `LocalDeployment.process_tree()`) that are still running."""
    return [pid for pid, start in tree.items() if _alive(pid, start)]


def _signal_all(tracked: dict[int, int], sig: signal.Signals) -> None:
    for pid, start in tracked.items():
        if _alive(pid, start):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def _wait_gone(tracked: dict[int, int], deadline: float) -> bool:
    while any(_alive(pid, start) for pid, start in tracked.items()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _stop(daemons: Sequence[_Daemon], timeout: float) -> None:
    """SIGTERM every daemon and everything it spawned; SIGKILL whatever is left after `timeout` seconds."""
    leaders = {d.proc.pid: d.start for d in daemons}
    tracked = _tree(leaders)
    _signal_all(tracked, signal.SIGTERM)  # daemons and their superexec/serverapp/clientapp children alike
    deadline = time.monotonic() + timeout
    for d in daemons:
        with contextlib.suppress(subprocess.TimeoutExpired):
            d.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    _wait_gone(tracked, deadline)
    tracked.update(_tree(leaders))  # anything spawned meanwhile in the daemons' process groups
    if any(_alive(pid, start) for pid, start in tracked.items()):
        _signal_all(tracked, signal.SIGKILL)
        _wait_gone(tracked, time.monotonic() + 5.0)
    for d in daemons:
        with contextlib.suppress(subprocess.TimeoutExpired):
            d.proc.wait(timeout=5.0)
        d.log_handle.close()
    # A SuperNode never reaps its superexec, so that one ends as a zombie adopted by init; give init a moment to
    # reap it, so that `pgrep flower` right after the deployment shows nothing of ours (dead or alive).
    deadline = time.monotonic() + 5.0
    while _has_proc() and time.monotonic() < deadline and any(
        (st := _proc_stat(pid)) is not None and st[3] == start for pid, start in tracked.items()
    ):
        time.sleep(0.1)


def _die_with_parent() -> Callable[[], None] | None:
    """A Popen preexec_fn that makes the child get SIGTERM when this process dies (Linux), else None.

    The signal is tied to the thread that forks; `local_deployment` is meant to be used from the main thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None

    def preexec() -> None:
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent already died between fork and prctl
            os._exit(1)

    return preexec


def _spawn(name: str, argv: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> _Daemon:
    exe = shutil.which(argv[0], path=env.get("PATH"))
    if exe is None:
        raise DeploymentError(f"{argv[0]} not found on PATH ({env.get('PATH')}); is flwr installed in this venv?")
    handle = log.open("wb")
    try:
        # preexec_fn only calls prctl/getppid/_exit (async-signal-safe), so threads in this process are harmless
        proc = subprocess.Popen(
            [exe, *argv[1:]], env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent(),
        )
    except BaseException:
        handle.close()
        raise
    st = _proc_stat(proc.pid)
    return _Daemon(name=name, proc=proc, start=st[3] if st else -1, log=log, log_handle=handle, argv=list(argv),
                   env=env)


def _check_started(daemons: Sequence[_Daemon]) -> None:
    """Raise DeploymentError if a daemon has exited or logged that it could not bind its port."""
    dead = [d for d in daemons if d.proc.poll() is not None]
    if dead:
        what = ", ".join(f"{d.name} (exit {d.proc.returncode})" for d in dead)
        raise DeploymentError(f"{what} exited during start-up\n{_tails(daemons)}")
    stuck = [d.name for d in daemons if _log_has(d.log, FATAL_LOG_LINES)]
    if stuck:  # flower-superlink 1.41 logs a failed bind and then keeps running without a server
        raise DeploymentError(f"{', '.join(stuck)} could not bind its port\n{_tails(daemons)}")


def _tails(daemons: Sequence[_Daemon], lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(_tail(d.log, d.name, lines) for d in daemons)


def _log_has(path: Path, needles: Sequence[str]) -> bool:
    try:
        text = path.read_text(errors="replace").lower()
    except OSError:
        return False
    return any(n in text for n in needles)


def _tail(path: Path, name: str, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as err:
        text = [f"(cannot read: {err})"]
    return f"----- {name} ({path}) -----\n" + "\n".join(text)


# ---------------------------------------------------------------------------------------------------- ports/config
def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports the OS reports free right now (bind to port 0); another process may still take one."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _section_re(name: str) -> re.Pattern[str]:
    """The TOML table [superlink.<name>] up to the next table header or the end of the file."""
    return re.compile(rf"^\[superlink\.{re.escape(name)}\][^\n]*\n(?:(?!\[)[^\n]*\n?)*", re.MULTILINE)


def _add_connection(flwr_home: Path, name: str, address: str, env: dict[str, str],
                    pki: DeploymentPKI | None = None) -> None:
    """Add [superlink.<name>] to config.toml: TLS trusting `pki`'s CA, or `insecure = true` when `pki` is None."""
    cfg = flwr_home / "config.toml"
    if not cfg.exists():  # let flwr write its own defaults first (format of the installed version)
        subprocess.run(["flwr", "config", "list"], env=env, cwd=ROOT, capture_output=True, timeout=60, check=False)
    text = cfg.read_text() if cfg.exists() else '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
    text = _section_re(name).sub("", text).rstrip("\n") + "\n"  # drop a stale entry of the same name
    if pki is not None:
        text += "\n" + pki.connection_toml(name, address)
    else:
        text += f'\n[superlink.{name}]\naddress = "{address}"\ninsecure = true\n'
    cfg.write_text(text)


def _remove_connection(flwr_home: Path, name: str) -> None:
    cfg = flwr_home / "config.toml"
    with contextlib.suppress(OSError):
        text = cfg.read_text()
        new = _section_re(name).sub("", text).rstrip("\n") + "\n"
        if new != text:
            cfg.write_text(new)


def _online_nodes(connection: str, env: dict[str, str], timeout: float = 30.0) -> int | None:
    """Number of SuperNodes `flwr supernode list` reports online; None while the SuperLink does not answer."""
    try:
        proc = subprocess.run(
            ["flwr", "supernode", "list", connection, "--format", "json"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    out = proc.stdout or ""
    if proc.returncode != 0 or "{" not in out:
        return None
    try:
        doc = json.loads(out[out.index("{"):])
    except ValueError:
        return None
    if not doc.get("success", True):
        return None
    return sum(1 for node in doc.get("nodes", []) if node.get("status") == "online")


def _node_config_arg(i: int, num_nodes: int, extra: Callable[[int], Mapping[str, str | int | float]] | None) -> str:
    """Node i's ``--node-config`` string: partition-id / num-partitions plus `extra(i)`, strings in double quotes."""
    items: dict[str, str | int | float] = {"partition-id": i, "num-partitions": num_nodes, **(extra(i) if extra else {})}
    parts = []
    for key, value in items.items():
        if isinstance(value, str):
            if '"' in value:
                raise ValueError(f"node config {key}={value!r}: a double quote cannot be passed to --node-config")
            value = f'"{value}"'
        parts.append(f"{key}={value}")
    return " ".join(parts)


def _wait_listening(port: int, daemons: Sequence[_Daemon], deadline: float, what: str) -> None:
    """Return once 127.0.0.1:`port` accepts TCP connections; DeploymentError if a daemon died or at `deadline`."""
    while True:
        _check_started(daemons)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise DeploymentError(f"{what} did not listen on {port} in time\n{_tails(daemons)}") from None
            time.sleep(0.3)


def _register_keys(pki: DeploymentPKI, connection: str, env: dict[str, str], daemons: Sequence[_Daemon],
                   deadline: float) -> list[int]:
    """`flwr supernode register supernode-<i>.pub CONNECTION` for every node key (in parallel: each CLI call
    takes seconds to import); retried until `deadline` while the SuperLink does not answer. Returns the node ids."""
    ids: dict[int, int] = {}
    errors: dict[int, str] = {}
    while True:
        _check_started(daemons)
        procs = {
            i: subprocess.Popen(["flwr", "supernode", "register", str(key.public_key), connection, "--format", "json"],
                                env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
            for i, key in enumerate(pki.nodes) if i not in ids
        }
        for i, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=max(10.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            try:
                doc = json.loads(out[out.index("{"):]) if "{" in out else {}
            except ValueError:
                doc = {}
            if doc.get("success") and "node-id" in doc:
                ids[i] = int(doc["node-id"])
            else:
                errors[i] = str(doc.get("error-message") or out).strip()
        if len(ids) == len(pki.nodes):
            return [ids[i] for i in range(len(pki.nodes))]
        if time.monotonic() > deadline:
            failed = "\n".join(f"  {pki.nodes[i].public_key}: {errors.get(i)}" for i in range(len(pki.nodes))
                               if i not in ids)
            raise DeploymentError(f"could not register the SuperNode keys with {connection}:\n{failed}\n"
                                  f"{_tails(daemons)}")
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------------- public API
@contextlib.contextmanager
def local_deployment(
    num_nodes: int,
    *,
    flwr_home: Path,
    secure: bool = True,
    pki_dir: Path | None = None,
    link_port: int | None = None,
    node_base_port: int | None = None,
    log_dir: Path | None = None,
    startup_timeout: float = 60.0,
    stop_timeout: float = 10.0,
    node_config: Callable[[int], Mapping[str, str | int | float]] | None = None,
) -> Iterator[LocalDeployment]:
    """Start a SuperLink and `num_nodes` SuperNodes on 127.0.0.1; yield once all nodes are online.

    Parameters
    ----------
    num_nodes
        SuperNodes to start; node i gets node config "partition-id=i num-partitions=num_nodes".
    node_config
        Extra node-config items of node i (e.g. ``lambda i: {"data-path": f"parts/partition_{i}.npz"}``), added to
        (or overriding) partition-id / num-partitions; strings are quoted for ``--node-config``.
    flwr_home
        FLWR_HOME of the CLI (its config.toml receives the connection). Use a fresh directory per deployment.
    secure
        True (default): TLS with a freshly generated CA and SuperNode authentication, every node's key registered
        with `flwr supernode register` before the node starts. False: `--insecure` daemons, for a trusted network
        only (the opt-in must be written out).
    pki_dir
        Where the CA certificate, the SuperLink's certificate and key and the node keys go (secure only; the CA's
        own key is never written); default $FLWR_HOME/pki/deploy-<link_port>. Files there are overwritten.
    link_port
        SuperLink port (Fleet, Control and Runtime APIs share it); None picks a free one.
    node_base_port
        SuperNode i's Runtime API listens on node_base_port + i; None picks free ports.
    log_dir
        Where superlink.log and supernode-<i>.log go; default $FLWR_HOME/logs/deploy-<link_port>.
    startup_timeout
        Seconds to wait for all nodes to be online before raising DeploymentError (with the logs' tails); in
        secure mode the SuperLink's start and the key registration before the nodes start get as long again.
    stop_timeout
        Seconds between SIGTERM and SIGKILL on exit.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    flwr_home = flwr_home.resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    picked = free_ports((link_port is None) + (num_nodes if node_base_port is None else 0))
    port = link_port if link_port is not None else picked.pop(0)
    node_ports = [node_base_port + i for i in range(num_nodes)] if node_base_port is not None else picked
    connection, address = f"deploy-{port}", f"127.0.0.1:{port}"
    logs = (log_dir or flwr_home / "logs" / connection).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    env = flwr_env(flwr_home)
    env["FLWR_HOME"] = str(flwr_home)  # flwr_env keeps an FLWR_HOME already exported (e.g. by the Makefile)
    # the SuperNodes' ClientApps import this checkout (whatever is installed), like local_simulation's
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    daemon_env = {
        # their superexecs look for new work every 1 s by default; on loopback a shorter poll is cheap
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.25",
        **env,
        "PYTHONUNBUFFERED": "1",  # logs reach the files as they happen (start-up errors, logs_tail)
    }

    pki = generate_pki(pki_dir or flwr_home / "pki" / connection, num_nodes, keep_ca_key=False,
                       overwrite=True) if secure else None
    dep = LocalDeployment(connection=connection, env=env, log_dir=logs, flwr_home=flwr_home, address=address,
                          node_ports=node_ports, pki=pki)
    try:
        deadline, online = time.monotonic() + startup_timeout, None
        dep._daemons.append(_spawn("superlink", [
            "flower-superlink", *(pki.superlink_args() if pki else ["--insecure"]),
            "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port),
        ], daemon_env, logs / "superlink.log"))
        _add_connection(flwr_home, connection, address, env, pki)
        if pki is not None:  # a node whose key is not registered yet is refused for good (exit code 305)
            _wait_listening(port, dep._daemons, deadline, "the SuperLink")
            dep.node_ids = _register_keys(pki, connection, env, dep._daemons, deadline)
            deadline = time.monotonic() + startup_timeout  # the nodes get the same time as without registration
        for i, node_port in enumerate(node_ports):
            dep._daemons.append(_spawn(f"supernode-{i}", [
                "flower-supernode", *(pki.supernode_args(i) if pki else ["--insecure"]),
                "--superlink", address, "--port", str(node_port),
                "--node-config", _node_config_arg(i, num_nodes, node_config),
            ], daemon_env, logs / f"supernode-{i}.log"))
        while True:
            _check_started(dep._daemons)
            # one `flwr supernode list` may use the time left (at least 10 s): on a loaded machine the CLI alone
            # takes 7-10 s to start (load average 20-25, 2 cores), and a shorter cap never sees a node online
            online = _online_nodes(connection, env, timeout=max(10.0, deadline - time.monotonic()))
            if online is not None and online >= num_nodes:
                break
            if time.monotonic() > deadline:
                _check_started(dep._daemons)  # a specific cause beats a timeout
                raise DeploymentError(
                    f"only {online or 0}/{num_nodes} SuperNodes online at {address} after {startup_timeout:.0f} s\n"
                    f"{_tails(dep._daemons)}"
                )
            time.sleep(0.5)
        yield dep
    finally:
        _stop(dep._daemons, stop_timeout)
        _remove_connection(flwr_home, connection)


@dataclass
class LocalSimulation:
    """A simulation SuperLink of our own (not the shared ``:local:`` daemon): its CLI connection and environment."""

    connection: str
    env: dict[str, str]
    log_dir: Path
    _daemons: list[_Daemon] = field(default_factory=list, repr=False)


#: flower-superexec whose simulation processes print to its output (the SuperLink's log) instead of /dev/null:
#: Flower's AutoExecPlugin hides them, so a simulation process that dies leaves no trace but the SuperLink's
#: "No heartbeat received from the task" minutes later.
_VISIBLE_SUPEREXEC = ("import sys; from flwr.supercore.superexec.plugin import base_exec_plugin as b; "
                      "from flwr.supercore.constant import TaskType; "
                      "b.AutoExecPlugin.visible_output_task_types = frozenset(TaskType); "
                      "from flwr.supercore.cli import flower_superexec; sys.argv[0] = 'flower-superexec'; "
                      "sys.exit(flower_superexec())")

#: flower-superlink for tests: the patience for a run's heartbeats raised from Flower's 2 intervals (60 s) to N,
#: and a SuperExec that keeps the simulation processes' output (``_VISIBLE_SUPEREXEC``)
_TEST_SUPERLINK = """\
import sys
import flwr.common.constant as c
c.HEARTBEAT_PATIENCE = {patience}
import flwr.superlink.cli.flower_superlink
s = sys.modules["flwr.superlink.cli.flower_superlink"]  # the package exports a function of the same name
_superexec = s._get_superexec_command
s._get_superexec_command = lambda *a, **k: [sys.executable, "-c", {superexec!r}, *_superexec(*a, **k)[1:]]
sys.argv[0] = "flower-superlink"
sys.exit(s.flower_superlink())
"""


@contextlib.contextmanager
def local_simulation(*, flwr_home: Path, pythonpath: Path | None = ROOT, startup_timeout: float = 30.0,
                     stop_timeout: float = 10.0, bin_dir: Path | None = None,
                     cwd: Path | None = None, ray_head: bool = False,
                     ray_cpus: int | None = None, heartbeat_patience: int | None = None,
                     task_poll_interval: float | None = None) -> Iterator[LocalSimulation]:
    """Start a simulation SuperLink on free loopback ports and register it as a CLI connection.

    Unlike ``flwr run``'s shared local daemon, its ServerApp and ClientApps import this checkout's packages
    (``pythonpath`` is put first on PYTHONPATH), whatever is installed, and its environment is this process's: so a
    test runs the code under test, and an app that is not this project's (``examples/``) can import the library.
    Pass ``connection`` and ``env`` to ``run_flower(..., connection=, env=, simulation=True)``.

    ``pythonpath=None`` and ``bin_dir`` (a virtual environment's ``bin/``, put first on PATH, PYTHONPATH removed)
    run the daemons, and so the apps, in that environment instead: what is installed there is what they import, as
    for a user who ``pip install``-ed the library (``tests/test_install.py``). ``cwd`` is the daemons' working
    directory (default: the checkout).

    ``ray_head=True`` also starts one Ray cluster (``ray start --head --block``, in the same environment) for the
    SuperLink's lifetime, and gives the SuperLink ``RAY_ADDRESS``: each run's simulation process then connects to
    it (Flower's ``RayBackend`` calls ``ray.init()``, which reads ``RAY_ADDRESS``) instead of starting and stopping a
    cluster of its own, about 10 s of every run on 2 cores. The runs themselves are unchanged: each still builds
    its own pool of ClientApp actors (new worker processes, a new Ray job) and ends them when it ends. Runs on one
    such SuperLink share the cluster's CPUs, so they should run one at a time (as one test process does).
    ``ray_cpus`` is the logical CPUs that cluster offers (default: all of the machine's); with Flower's default of
    one CPU per ClientApp it is the number of ClientApp actors a run gets.

    ``heartbeat_patience`` (default None: Flower's own ``flower-superlink``, patience 2) is how many of Flower's
    30-s heartbeat intervals the SuperLink waits for a run's heartbeat before it fails the run ("No heartbeat
    received from the task"). The test suite raises it (tests/conftest.py says why). Given, the SuperLink also
    keeps its simulation processes' output in its log (``superlink.log`` in ``log_dir``), which Flower sends to
    /dev/null: the only trace of a simulation process that dies before it uploads its first log lines.

    ``task_poll_interval`` (seconds; default None: this process's ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``, else
    Flower's 1 s) is how often the SuperLink's SuperExec asks it for a new run to start: a shorter poll starts runs
    sooner and costs CPU while idle (tests/conftest.py's ``SIMULATION_POLL`` has the measurement).
    """
    flwr_home = flwr_home.resolve()
    flwr_home.mkdir(parents=True, exist_ok=True)
    port, control = free_ports(2)
    connection = f"sim-{port}"
    logs = (flwr_home / "logs" / connection).resolve()
    logs.mkdir(parents=True, exist_ok=True)
    env = flwr_env(flwr_home)
    env["FLWR_HOME"] = str(flwr_home)
    if bin_dir is not None:
        env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
        env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])])
    sim = LocalSimulation(connection=connection, env=env, log_dir=logs)
    ray_temp: Path | None = None
    try:
        if ray_head:  # started first, waited for after the SuperLink has been started: they start side by side
            ray_temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
            env["RAY_ADDRESS"] = _spawn_ray_head(sim._daemons, env, logs, ray_temp, cwd or ROOT,
                                                 ray_cpus or os.cpu_count() or 1)
        python = str(bin_dir / "python") if bin_dir is not None else sys.executable
        superlink = (["flower-superlink"] if heartbeat_patience is None else
                     [python, "-c", _TEST_SUPERLINK.format(patience=int(heartbeat_patience),
                                                           superexec=_VISIBLE_SUPEREXEC)])
        poll = {} if task_poll_interval is None else {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": f"{task_poll_interval:g}"}
        sim._daemons.append(_spawn("superlink", [
            *superlink, "--insecure", "--simulation", "--isolation", "subprocess",
            "--disable-runtime-dependency-installation", "--host", "127.0.0.1", "--port", str(port),
            "--control-api-address", f"127.0.0.1:{control}",
        ], {**env, **poll, "PYTHONUNBUFFERED": "1"}, logs / "superlink.log", cwd=cwd or ROOT))
        cfg = flwr_home / "config.toml"
        text = cfg.read_text() if cfg.exists() else '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n'
        cfg.write_text(text + f'\n[superlink.{connection}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
        if ray_temp is not None:
            _wait_ray_head(sim._daemons, ray_temp, startup_timeout)
        deadline = time.monotonic() + startup_timeout
        while True:
            _check_started(sim._daemons)
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise DeploymentError(f"the simulation SuperLink did not listen on {port} within "
                                          f"{startup_timeout:.0f} s\n{_tails(sim._daemons)}") from None
                time.sleep(0.3)
        yield sim
    finally:
        _stop(sim._daemons, stop_timeout)
        _remove_connection(flwr_home, connection)
        if ray_temp is not None:
            shutil.rmtree(ray_temp, ignore_errors=True)


def _spawn_ray_head(daemons: list[_Daemon], env: dict[str, str], logs: Path, temp: Path, cwd: Path,
                    cpus: int) -> str:
    """Start ``ray start --head --block`` (appended to ``daemons``, so it is stopped with them); return its address.
    ``_wait_ray_head`` waits until it is up.

    ``temp`` is its temporary directory: a short new one under /tmp, not Ray's default /tmp/ray, because a process
    that calls ``ray.init()`` without ``RAY_ADDRESS`` joins the latest cluster it finds in /tmp/ray, and Ray's Unix
    socket paths under it must stay within the OS's 107 characters.

    Two of Ray's head processes are not started: the log monitor, which forwards the workers' stdout and stderr to
    the driver (the ClientApps' prints would reach the run's log; Flower's own error replies and the ServerApp's log
    do not pass through it, and the workers' files stay in ``temp``), and the autoscaler monitor, which has no
    nodes to add or remove here. Together they took about 0.01 of a core while idle and more during runs, for the
    whole life of each test cluster.
    """
    (port,) = free_ports(1)
    daemons.append(_spawn("ray-head", [
        "ray", "start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1",
        "--temp-dir", str(temp), "--num-cpus", str(cpus), "--include-dashboard", "false",
        "--disable-usage-stats", "--include-log-monitor", "false", "--no-monitor",
    ], env, logs / "ray-head.log", cwd=cwd))
    return f"127.0.0.1:{port}"


def _wait_ray_head(daemons: list[_Daemon], temp: Path, timeout: float) -> None:
    limit = max(timeout, 60.0)  # Ray's own start-up takes 6-9 s on an idle 2-core machine
    deadline = time.monotonic() + limit
    while not (temp / "ray_current_cluster").exists():  # written once the head's GCS and raylet are up
        _check_started(daemons)
        if time.monotonic() > deadline:
            raise DeploymentError(f"the Ray head did not start within {limit:.0f} s\n{_tails(daemons)}")
        time.sleep(0.3)


# ---------------------------------------------------------------------------------------------------- command line
def _sigterm_to_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through local_deployment's cleanup


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m simulations.deploy",
        description="Run one configuration on a fresh local Flower deployment (1 SuperLink + N SuperNodes on "
                    "127.0.0.1, real processes, no simulation), then stop everything. Secure by default: TLS with "
                    "a locally generated CA and SuperNode authentication (each node's key registered with "
                    "`flwr supernode register`).",
        epilog="example: python -m simulations.deploy --nodes 2 -- dataset=synthetic partitioner=iid "
               "num-server-rounds=2",
    )
    p.add_argument("--nodes", type=int, default=None,
                   help="SuperNodes to start (default: the run config's num-clients, else 2)")
    p.add_argument("--out", default="outputs/deploy", help="directory for results.json and accuracy.png")
    p.add_argument("--flwr-home", default=str(ROOT / ".flwr-deploy"),
                   help="FLWR_HOME for the CLI and the logs (default: .flwr-deploy, git-ignored)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--secure", dest="insecure", action="store_false",
                      help="TLS + SuperNode authentication (the default; the flag only makes it explicit)")
    mode.add_argument("--insecure", dest="insecure", action="store_true",
                      help="plain-text daemons and no node authentication: only on a network you trust")
    p.set_defaults(insecure=False)
    p.add_argument("--pki-dir", default=None,
                   help="where the CA certificate, SuperLink certificate and node keys go (secure mode; default "
                        "FLWR_HOME/pki/deploy-<port>)")
    p.add_argument("--link-port", type=int, default=None, help="SuperLink port (default: a free one)")
    p.add_argument("--node-base-port", type=int, default=None,
                   help="SuperNode i listens on BASE+i (default: free ports)")
    p.add_argument("--startup-timeout", type=float, default=60.0, help="seconds to wait for the nodes")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the run")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="run-config overrides (after --)")
    from simulations.faults import add_fault_arguments

    add_fault_arguments(p)  # --kill NODE@ROUND, --restart NODE@ROUND / --restart-after S
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m simulations.deploy --nodes N -- key=value ...`: one run, results path printed, exit 0 on success."""
    from fedpdm_flower.fedapp.config import ConfigError, parse_run_config
    from simulations.__main__ import parse_set

    args = build_parser().parse_args(argv)
    try:
        overrides: dict[str, Any] = parse_set([o for o in args.overrides if o != "--"])
        nodes = args.nodes if args.nodes is not None else int(overrides.get("num-clients", 2))
        if nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {nodes}")
        overrides.setdefault("num-clients", nodes)
        if int(overrides["num-clients"]) != nodes:
            raise ConfigError(f"--nodes {nodes} but num-clients={overrides['num-clients']}: each node is one client")
        overrides.setdefault("clients-per-round", min(nodes, 30))
        cfg = parse_run_config(overrides)  # fail fast, before any process starts
        from simulations.faults import fault_plan, run_faulty

        plan = fault_plan(args, nodes, cfg.num_server_rounds)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _sigterm_to_exit)
    out = Path(args.out).resolve()
    t0 = time.time()
    try:
        with local_deployment(nodes, flwr_home=Path(args.flwr_home), secure=not args.insecure,
                              pki_dir=Path(args.pki_dir) if args.pki_dir else None, link_port=args.link_port,
                              node_base_port=args.node_base_port, startup_timeout=args.startup_timeout) as dep:
            security = (f"TLS (CA {dep.pki.ca_cert}) + SuperNode authentication, {len(dep.node_ids)} keys registered"
                        if dep.pki else "INSECURE: no TLS, no node authentication (--insecure)")
            print(f"[deploy] SuperLink {dep.address} + {nodes} SuperNodes online (connection {dep.connection!r}, "
                  f"logs in {dep.log_dir}); {security}; running {cfg.algorithm} on {cfg.dataset}, "
                  f"{cfg.num_server_rounds} rounds", flush=True)
            if plan is None:
                res = run_flower(overrides, out, connection=dep.connection, env=dep.env, timeout=args.timeout)
            else:
                res = run_faulty(dep, overrides, out, plan, args.timeout)
    except (DeploymentError, FlowerRunError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    doc = json.loads(res.results.read_text())
    up = sum(int(r.get("uplink_bytes", 0)) for r in doc["rounds"])
    down = sum(int(r.get("downlink_bytes", 0)) for r in doc["rounds"])
    traffic = res.details.get("network-traffic", {})
    print(f"[deploy] run {res.run_id} {res.status} in {time.time() - t0:.0f} s (engine={doc.get('engine')}, "
          f"{len(doc['rounds'])} rounds, final test accuracy {doc['final'].get('test_accuracy')})")
    print(f"[deploy] payload bytes counted by the app: uplink {up}, downlink {down}; SuperLink network-traffic: "
          f"{json.dumps(traffic) if traffic else 'not reported'}")
    print(f"[deploy] results: {res.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
