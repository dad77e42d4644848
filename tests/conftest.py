"""Shared test fixtures and markers."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from installed import InstalledEnv

    from simulations.deploy import LocalSimulation

# Before numpy / torch load: one BLAS thread, as in Flower's Ray actors, so that the comparisons of the Flower
# simulation with the in-process driver see the same floating-point reductions (Makefile sets it too); they still
# allow a few ulps (tests/crossproc.py): two processes can round one reduction differently.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
# Every SuperExec of a deployment the tests start (deployed SuperLinks and SuperNodes) looks for a new task every
# 0.2 s instead of Flower's default 1 s (allowed: 0.01-60): on a deployment each message exchange starts half a
# second sooner on average. It changes when work starts, never what it does. The simulation SuperLinks, which live
# for the whole session and start one task per run, keep Flower's 1 s (SIMULATION_POLL below).
os.environ.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.2")
# The suite's noise calibrations (fedpdm_flower/fedapp/privacy/calibration_cache.py) go to one file of this test
# run, shared by its workers and every Flower process they start, not to the user's ~/.cache; removed at the end.
_CALIBRATIONS = os.path.join(tempfile.gettempdir(), "fedpdm-test-calibrations-"
                             f"{os.environ.get('PYTEST_XDIST_TESTRUNUID', os.getpid())}.json")
_OWN_CALIBRATIONS = os.environ.setdefault("FEDPDM_CALIBRATION_CACHE", _CALIBRATIONS) == _CALIBRATIONS


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "flower: runs a real Flower simulation through `flwr run` (slow)")
    config.addinivalue_line("markers", "deployment: starts a real SuperLink and SuperNodes on loopback (slow); "
                                       "left out of `make test`, run by `make test-deploy` (CI runs both)")
    config.addinivalue_line("markers", "slow: a long real-process test (a minute or more, e.g. a killed and resumed "
                                       "simulation); left out of `make test`, run by `make test-deploy` (CI runs both)")
    config.addinivalue_line("markers", "install: builds the wheel and installs it into a fresh virtual environment")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _OWN_CALIBRATIONS:  # a worker that ends first takes the file with it: the other one only searches again
        with contextlib.suppress(OSError):
            os.unlink(_CALIBRATIONS)


@pytest.fixture(autouse=True)
def _quiet_flower_logs() -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)


@pytest.fixture(autouse=True)
def _forget_cached_clients() -> Iterator[None]:
    """The reproduction app keeps one client per (run, node, run config) and process, with its data
    (fedpdm_flower.fedapp.client_app._CLIENTS): right for a ClientApp process, but in one test process every
    in-process run of the session would stay in memory (a test worker reached 8 GB and was OOM-killed). Each test
    starts its own runs, so the cache is emptied after each."""
    yield
    client_app = sys.modules.get("fedpdm_flower.fedapp.client_app")
    if client_app is not None:
        client_app._CLIENTS.clear()


#: the test SuperLinks wait 20 heartbeat intervals (600 s) for a run's heartbeat, not Flower's 2 (60 s). Flower's
#: simulation process sends them from a thread that stops for good on an HTTP error it does not retry, and with
#: two test processes on two cores a healthy run was failed twice in fresh-clone CI ("No heartbeat received from
#: the task", tests/test_examples.py, 2026-11-27: once at a patience of 2, once at 6, no heartbeat after the run's
#: first 20 s, no crash or OOM kill in the kernel log). Every test run ends well within 600 s, so a run is judged
#: by its own end; a process that really dies still fails its test, 10 minutes later, and its output is in the
#: SuperLink's log (simulations.deploy keeps it; run_flower's error quotes it).
HEARTBEAT_PATIENCE = 20
#: the simulation SuperLinks' task poll (s): Flower's default. Each poll is a request the SuperLink serves; at 0.2 s
#: an idle SuperLink and its SuperExec took 4.8 % of a core, at 1 s 1.2 % (30 s idle, 2 cores). The suite keeps
#: both cores busy and holds two or three such SuperLinks for its whole length, so the faster poll cost more CPU
#: than the 0.4 s it saves each run on average (time the other test process uses)
SIMULATION_POLL = 1.0


@pytest.fixture()
def seeded_device_entropy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The devices' OS-keyed generators -- DP-SGD's ``device_rng`` (Poisson samples and Gaussian noise) and
    DeviceSkellam's per-upload Philox (rounding and Skellam noise) -- replaced by one seeded sequence, for a test
    that asserts a learning threshold on a run under real noise: the run then has one outcome instead of a tail
    probability of failing (the noise keeps its calibrated scale; only its draws are fixed). The test states the
    spread it measured unseeded beside its bound, so the seed is not a lucky pick. Only in-process runs: a
    ``flwr run``'s ClientApps are other processes."""
    import importlib
    import itertools

    import numpy as np

    from fedpdm_flower.clients.distributed_dp import DeviceSkellam
    from fedpdm_flower.fedapp.privacy import dpsgd as core

    keys = itertools.count()

    def seeded() -> np.random.Generator:
        return np.random.Generator(np.random.Philox(key=next(keys)))

    for name in ("broadcast", "decentralized", "dpsgd", "iadmm"):  # the clients that import device_rng by name
        importlib.import_module(f"fedpdm_flower.clients.{name}")
    holders = [m for name, m in sorted(sys.modules.items())
               if name.startswith("fedpdm_flower.") and getattr(m, "device_rng", None) is core.device_rng]
    assert core in holders and len(holders) >= 5  # the core and the four clients that call it
    for module in holders:
        monkeypatch.setattr(module, "device_rng", seeded)
    monkeypatch.setattr(DeviceSkellam, "rng", staticmethod(seeded))


def _ray_cpus() -> int:
    """Logical CPUs of each test process's Ray cluster: this machine's cores shared among the xdist workers (1 on 2
    cores and 2 workers), so one run gets that many ClientApp actors. The suite keeps every core busy with two test
    processes; a second actor per run would only add its start-up (a Python process importing torch and flwr, about
    3 s of CPU) to every run. Results do not depend on it: a run's messages are the same whichever actor runs them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


@pytest.fixture(scope="session")
def flower_simulation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSimulation]:
    """One simulation SuperLink per test process (per xdist worker), shared by every Flower test of that process.

    Not `flwr run`'s shared local daemon: that daemon may have been started from another checkout and would run its
    ClientApps there (the editable install puts that checkout on sys.path); this one imports the checkout under test
    (PYTHONPATH). Starting a SuperLink costs seconds, so tests pass its ``connection`` and ``env`` to ``run_flower``
    instead of starting their own; runs on it are independent (each ``flwr run`` is a new run id). Its runs join one
    Ray cluster started with it (``ray_head``) instead of starting one each: a test process runs one at a time."""
    from simulations.deploy import local_simulation

    with local_simulation(flwr_home=tmp_path_factory.mktemp("flwr-home"), ray_head=True, ray_cpus=_ray_cpus(),
                          heartbeat_patience=HEARTBEAT_PATIENCE, task_poll_interval=SIMULATION_POLL) as sim:
        yield sim


@pytest.fixture(scope="session")
def _own_simulation_superlink(flower_simulation: LocalSimulation) -> Iterator[None]:
    """Points ``run_flower``'s default connection (and FLWR_HOME) at the session's SuperLink for the whole session."""
    from simulations.flower_driver import CONNECTION_VAR

    saved = {k: os.environ.get(k) for k in (CONNECTION_VAR, "FLWR_HOME")}
    os.environ.update({CONNECTION_VAR: flower_simulation.connection, "FLWR_HOME": flower_simulation.env["FLWR_HOME"]})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def installed_env(tmp_path_factory: pytest.TempPathFactory) -> InstalledEnv:
    """A fresh virtual environment with the library pip-installed from its wheel and every example app pip-installed
    by its own pyproject (tests/installed.py). Built once per test run: xdist workers share it through a file lock
    in their common temporary directory."""
    from filelock import FileLock
    from installed import ROOT, InstalledEnv, build_installed_env

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    dest = shared / "installed-env"
    with FileLock(str(shared / "installed-env.lock")):
        if not (dest / "ready").exists():
            build_installed_env(dest, sorted(p for p in (ROOT / "examples").iterdir() if (p / "pyproject.toml").exists()))
            (dest / "ready").write_text("ok\n")
    (wheel,) = (dest / "wheels").glob("fedpdm_flower-*.whl")
    return InstalledEnv(root=dest, wheel=wheel)


@pytest.fixture(scope="session")
def installed_simulation(installed_env: InstalledEnv, tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[LocalSimulation]:
    """A simulation SuperLink whose ServerApp and ClientApps run in ``installed_env`` (no PYTHONPATH, working
    directory outside the checkout): apps import the installed wheel, as a user's would."""
    from simulations.deploy import local_simulation

    work = tmp_path_factory.mktemp("installed-superlink")
    with local_simulation(flwr_home=work / "flwr-home", pythonpath=None, bin_dir=installed_env.bin_dir,
                          cwd=work, ray_head=True, ray_cpus=_ray_cpus(),  # Ray runs the installed env's Python
                          heartbeat_patience=HEARTBEAT_PATIENCE, task_poll_interval=SIMULATION_POLL) as sim:
        yield sim


#: the tests that run the installed environment go to one xdist worker (one group): only that process builds
#: ``installed_simulation`` (a SuperLink and a Ray cluster: about 8 s of start-up on an idle machine and a few
#: percent of a core while they idle), and the other never waits for ``installed_env`` to be built. xdist hands
#: out the largest groups first, so these long runs start at once and the short tests fill in around them.
INSTALLED_GROUP = "installed"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "installed_simulation" in fixtures or "installed_env" in fixtures:
            item.add_marker(pytest.mark.xdist_group(INSTALLED_GROUP))
        # Flower tests run the checkout on the session's SuperLink, except those that run an installed environment
        if (item.get_closest_marker("flower") is not None and hasattr(item, "fixturenames")
                and "installed_simulation" not in item.fixturenames):
            item.fixturenames.append("_own_simulation_superlink")
