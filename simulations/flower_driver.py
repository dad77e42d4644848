"""Run one configuration through Flower itself (`flwr run`), simulation or deployment, and check it completed.

`flwr run --stream` exits 0 even when the run failed, so we submit the run (`flwr run --format json`, or for a
named SuperLink connection the same steps with flwr's own functions in this process), stream the logs with `flwr log`,
and then read the run's status with `flwr list --run-id`; anything but `finished:completed` raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: a simulation SuperLink connection that replaces `flwr run`'s shared local one when set (the tests set it)
CONNECTION_VAR = "FEDAPP_FLWR_CONNECTION"


class FlowerRunError(RuntimeError):
    """A `flwr` command failed or the run did not finish as completed; `run` holds the run's record if any."""

    def __init__(self, message: str, run: FlowerRun | None = None) -> None:
        super().__init__(message)
        self.run = run


def flwr_env(flwr_home: Path | None = None) -> dict[str, str]:
    """Environment for the flwr CLI: project-local FLWR_HOME, no telemetry, no runtime dependency install."""
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)  # flwr spawns flower-superlink from PATH
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env.setdefault("FLWR_HOME", str(flwr_home or ROOT / ".flwr"))
    env.update({
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "RAY_DEDUP_LOGS": "0",
    })
    return env


def toml_value(v: Any) -> str:
    """A run-config value as TOML for `flwr run -c`."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v))  # a TOML basic string


@dataclass
class FlowerRun:
    """Outcome of a `flwr run`: id, final status and the results file the ServerApp wrote."""

    run_id: int
    status: str
    details: dict[str, Any]
    results: Path
    log: str = ""


#: top-level folders of a checkout that are never part of the app: `flwr run .` walks (and resolves) every file
#: under the app directory before applying .gitignore, and a checkout's .venv alone is ~50,000 files (5 s of CPU
#: per `flwr run`, measured); the FAB itself is ~2 MB
_NOT_APP = {".git", ".venv", ".flwr", "outputs", "dist", "build", ".mypy_cache", ".ruff_cache", ".pytest_cache",
            ".hypothesis", "__pycache__", "pki", ".stamps"}


@contextmanager
def staged_app(app: Path) -> Iterator[Path]:
    """``app`` itself, or for this checkout a temporary copy of what its FAB can contain (the checkout without its
    virtual environment, caches and outputs; Flower's own .gitignore / include rules still apply to the copy, so
    the FAB is the same). Removed when the run has been submitted: the SuperLink keeps the FAB."""
    if app.resolve() != ROOT:
        yield app
        return
    stage = Path(tempfile.mkdtemp(prefix="fedpdm-app-"))
    try:
        for entry in ROOT.iterdir():
            if entry.name in _NOT_APP or entry.is_symlink() or entry.name.endswith(".egg-info"):
                continue
            if entry.is_dir():
                shutil.copytree(entry, stage / entry.name, symlinks=True,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".flwr*", "outputs"))
            else:
                shutil.copy2(entry, stage / entry.name)
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _flwr(args: list[str], env: dict[str, str], *, capture: bool = True, timeout: float | None = None) -> str:
    proc = subprocess.run(["flwr", *args], env=env, cwd=ROOT, capture_output=capture, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise FlowerRunError(f"flwr {' '.join(args)} failed ({proc.returncode}): {proc.stderr or proc.stdout}")
    return proc.stdout or ""


def submit_run(config: dict[str, Any], *, num_supernodes: int | None = None, connection: str | None = None,
               env: dict[str, str] | None = None, simulation: bool = False, app: Path = ROOT) -> int:
    """`flwr run APP [CONNECTION] -c CONFIG`: submit the run and return its id at once (no waiting).

    ``config`` is the run config as given (nothing is added); the other arguments are :func:`run_flower`'s.
    """
    env = env or flwr_env()
    run_config = " ".join(f"{k}={toml_value(v)}" for k, v in config.items()) or None
    federation_config = (f"num-supernodes={num_supernodes} client-resources-num-cpus=1"
                         if num_supernodes is not None and (connection is None or simulation) else None)
    with staged_app(app) as app_dir:  # this checkout: a staged copy without .venv/.git/caches (staged_app)
        if connection is not None:  # a named SuperLink: submitted from this process (_start_run_here)
            with contextlib.suppress(ImportError):  # another flwr's CLI layout: its executable below
                return _start_run_here(app_dir, connection, run_config, federation_config, env)
        args = ["run", str(app_dir), "--format", "json"]
        args += ["-c", run_config] if run_config else []
        args += ["--federation-config", federation_config] if federation_config else []
        out = _flwr(args, env, timeout=120)
    try:
        submitted = json.loads(out[out.index("{"):])
        return int(submitted["run-id"])
    except (ValueError, KeyError) as err:
        raise FlowerRunError(f"could not read the run id from `flwr run` output: {out!r}") from err


@contextmanager
def _flwr_home(env: dict[str, str]) -> Iterator[None]:
    """``env``'s FLWR_HOME in ``os.environ`` for the block: flwr's CLI functions read the connections (and any
    account tokens) from there; the rest of the environment is left alone."""
    saved = os.environ.get("FLWR_HOME")
    if "FLWR_HOME" in env:
        os.environ["FLWR_HOME"] = env["FLWR_HOME"]
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("FLWR_HOME", None)
        else:
            os.environ["FLWR_HOME"] = saved


def _start_run_here(app_dir: Path, connection: str, run_config: str | None, federation_config: str | None,
                    env: dict[str, str]) -> int:
    """What ``flwr run APP CONNECTION -c RUN_CONFIG --federation-config FEDERATION_CONFIG`` does, with flwr's own
    functions in this process: read the app's pyproject.toml, build the FAB from disk, send ``StartRun`` on the
    connection's Control API. The ``flwr`` executable costs a Python process importing flwr, about 1.8 s of CPU,
    per run (docs/development.md, "Times"); the tests submit dozens.

    One step of ``flwr run`` is left out: its check that the app's modules can be found, which puts the app folder
    on this process's ``sys.path`` and imports the app's parent packages from it (from a staged copy that is
    deleted after the submit, later submits find nothing). A missing module still fails the run, in the SuperLink.
    """
    import click  # the imports raise ImportError before anything is sent (submit_run's fallback)
    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.config_utils import load_and_validate
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.run.run import _parse_federation_config_overrides
    from flwr.cli.utils import flwr_cli_exc_handler, init_http_client_from_connection
    from flwr.common.config import parse_config_args
    from flwr.common.constant import FAB_CONFIG_FILE
    from flwr.common.serde import fab_to_proto, user_config_to_proto
    from flwr.proto.control_pb2 import StartRunRequest
    from flwr.supercore.fab import Fab

    try:
        with _flwr_home(env), warnings.catch_warnings():
            # pathspec deprecates the pattern name flwr's FAB builder passes it: flwr's to change, not ours
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="pathspec")
            load_and_validate(app_dir / FAB_CONFIG_FILE, check_module=False)
            link = read_superlink_connection(connection)
            fab_bytes = build_fab_from_disk(app_dir)
            req = StartRunRequest(
                fab=fab_to_proto(Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})),
                override_config=user_config_to_proto(parse_config_args([run_config] if run_config else None)),
                federation=link.federation or "",
                override_federation_config=_parse_federation_config_overrides(
                    [federation_config] if federation_config else None, link),
                app_spec="",
            )
            client = init_http_client_from_connection(link)
            try:
                with flwr_cli_exc_handler():
                    res = client.StartRun(req)
            finally:
                client.close()
    except (click.ClickException, ValueError) as err:
        raise FlowerRunError(f"flwr run {app_dir} {connection} failed: {err}") from err
    if not res.HasField("run_id"):
        raise FlowerRunError(f"flwr run {app_dir} {connection}: the SuperLink started no run")
    return int(res.run_id)


def _flwr_here(args: list[str], env: dict[str, str], timeout: float | None = None) -> str:
    """``flwr ARGS`` in this process (typer's CliRunner on flwr's own CLI app, ``env`` applied for the call): the same
    code and output as the ``flwr`` executable without starting a Python process that imports flwr (about a second
    of CPU each; a test session runs dozens of runs). Used for the read-only ``list`` and ``log`` calls only.

    flwr prints ``--format json`` output to ``sys.__stdout__``, past any redirection, so that is captured too. A call
    that has not returned within ``timeout`` seconds raises FlowerRunError (it is left running in a daemon thread).
    """
    import io
    import threading

    from flwr.cli.app import app as flwr_cli
    from typer.testing import CliRunner

    raw, out = io.StringIO(), dict[str, Any]()

    def invoke() -> None:
        with contextlib.ExitStack() as stack:
            saved = sys.__stdout__
            stack.callback(setattr, sys, "__stdout__", saved)
            sys.__stdout__ = raw  # type: ignore[assignment,misc]
            out["result"] = CliRunner().invoke(flwr_cli, args, env=env, catch_exceptions=True)

    worker = threading.Thread(target=invoke, name=f"flwr {args[0]}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise FlowerRunError(f"flwr {' '.join(args)} did not return within {timeout:.0f} s")
    result = out["result"]
    if result.exit_code != 0:
        raise FlowerRunError(f"flwr {' '.join(args)} failed ({result.exit_code}): {result.output}{raw.getvalue()}"
                             + (f"\n{result.exception!r}" if result.exception else ""))
    return str(result.stdout) + raw.getvalue()


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _diagnostics(logs: str, env: dict[str, str], connection: str | None) -> str:
    """What a failed run leaves for whoever reads the error: the end of its own log and, for a SuperLink started by
    ``simulations.deploy`` (its log is FLWR_HOME/logs/<connection>/superlink.log), the end of the SuperLink's log,
    which holds the simulation processes' own output where ``local_simulation`` keeps it (a process that died
    before its first log upload leaves nothing else)."""
    parts = [f"\n--- the run's log (last 40 lines) ---\n{_tail(logs, 40)}"]
    superlink_log = Path(env.get("FLWR_HOME", "")) / "logs" / str(connection) / "superlink.log"
    if connection and superlink_log.is_file():
        text = superlink_log.read_text(errors="replace")
        parts.append(f"\n--- {superlink_log} (last 60 lines) ---\n{_tail(text, 60)}")
    return "".join(parts)


def run_status(run_id: int, *, connection: str | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The run's record from `flwr list --run-id` (``status``, ``status-details``, ``network-traffic``, ...)."""
    out = _flwr_here(["list"] + ([connection] if connection else []) + ["--run-id", str(run_id), "--format", "json"],
                     env or flwr_env(), timeout=120)
    return dict(json.loads(out[out.index("{"):])["runs"][0])


def run_flower(
    overrides: dict[str, Any], out_dir: Path, *, num_supernodes: int | None = None, connection: str | None = None,
    stream: bool = True, timeout: float = 3600.0, env: dict[str, str] | None = None, simulation: bool = False,
    app: Path = ROOT, results_name: str | None = "results.json",
) -> FlowerRun:
    """Submit the app with run-config `overrides`, follow its logs, and return once it has finished.

    `connection` None means the local simulation SuperLink (`flwr run .`); otherwise a connection name from
    $FLWR_HOME/config.toml (e.g. a deployment SuperLink); with `simulation=True` that connection is a simulation
    SuperLink and gets `num_supernodes` like the local one. ``app`` is the Flower app directory (default: this
    project's reproduction app); another app must accept the run config it is given (``out-dir`` is added only
    for this project's app); ``results_name`` None skips the check that a results file was written.
    """
    if connection is None and os.environ.get(CONNECTION_VAR):  # the test session's own SuperLink (tests/conftest.py)
        connection, simulation = os.environ[CONNECTION_VAR], True
    env = env or flwr_env()
    out_dir = out_dir.resolve()  # the ServerApp's cwd is the SuperLink daemon's, not ours
    cfg = {**overrides, "out-dir": str(out_dir)} if app == ROOT else dict(overrides)
    run_id = submit_run(cfg, num_supernodes=num_supernodes, connection=connection, env=env, simulation=simulation,
                        app=app)
    log_args = ["log", str(run_id)] + ([connection] if connection else []) + ["--stream"]
    if stream:  # the user watches the run: the flwr executable prints as the logs arrive
        proc = subprocess.run(["flwr", *log_args], env=env, cwd=ROOT, text=True, timeout=timeout, check=False)
        logs = (proc.stdout or "") + (proc.stderr or "")
    else:  # kept for the caller (tests read them): followed in this process until the run ends
        logs = _flwr_here(log_args, env, timeout=timeout)
    run = run_status(run_id, connection=connection, env=env)
    status = str(run["status"])
    result = FlowerRun(run_id=run_id, status=status, details=run, results=out_dir / (results_name or "results.json"),
                       log=logs)
    if not status.startswith("finished:completed"):
        raise FlowerRunError(f"run {run_id} ended with status {status!r}: {run.get('status-details', '')}"
                             + _diagnostics(logs, env, connection), result)
    if results_name and not result.results.exists():
        raise FlowerRunError(f"run {run_id} completed but wrote no {result.results}")
    return result
