"""Shared test fixtures and markers."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

# Before numpy / torch load: one BLAS thread, as in Flower's Ray actors, so that the bit-for-bit comparisons of the
# Flower simulation with the in-process driver see the same floating-point reductions (Makefile sets it too).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "flower: runs a real Flower simulation through `flwr run` (slow)")
    config.addinivalue_line("markers", "deployment: starts a real SuperLink and SuperNodes on loopback (slow)")


@pytest.fixture(autouse=True)
def _quiet_flower_logs() -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def _own_simulation_superlink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One simulation SuperLink of the test session's own, which `run_flower` uses instead of `flwr run`'s shared
    local daemon: that daemon may have been started from another checkout and would run its ClientApps there (the
    editable install puts that checkout on sys.path); this one imports the checkout under test (PYTHONPATH)."""
    from simulations.deploy import local_simulation
    from simulations.flower_driver import CONNECTION_VAR

    home = tmp_path_factory.mktemp("flwr-home")
    with local_simulation(flwr_home=home) as sim:
        saved = {k: os.environ.get(k) for k in (CONNECTION_VAR, "FLWR_HOME")}
        os.environ.update({CONNECTION_VAR: sim.connection, "FLWR_HOME": str(home)})
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("flower") is not None and hasattr(item, "fixturenames"):
            item.fixturenames.append("_own_simulation_superlink")
