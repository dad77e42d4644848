"""Shared test fixtures and markers."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "flower: runs a real Flower simulation through `flwr run` (slow)")
    config.addinivalue_line("markers", "deployment: starts a real SuperLink and SuperNodes on loopback (slow)")


@pytest.fixture(autouse=True)
def _quiet_flower_logs() -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)
