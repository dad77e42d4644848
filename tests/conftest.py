"""Shared test fixtures and markers."""

from __future__ import annotations

import logging
import os

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
