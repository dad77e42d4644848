"""Flower's simulation imports the ServerApp and the ClientApp in different threads of one process.

A package ``__init__`` that eagerly imports its submodules deadlocks against a thread importing one of those
submodules directly: a benchmark run failed with "deadlock detected by _ModuleLock('fedpdm_flower.fedapp.privacy.accountants')",
and importing the apps from five threads at once failed in 5 of 12 fresh interpreters. The invariant that rules
the race out: importing one of our packages imports none of its submodules (re-exports resolve lazily).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ["fedpdm_flower", "fedpdm_flower.fedapp", "fedpdm_flower.fedapp.data", "fedpdm_flower.fedapp.models", "fedpdm_flower.fedapp.privacy", "fedpdm_flower.fedapp.compression", "fedpdm_flower.fedapp.algorithms",
            "fedpdm_flower.strategies", "fedpdm_flower.clients", "simulations"]


@pytest.mark.parametrize("package", PACKAGES)
def test_package_init_imports_no_submodule(package: str) -> None:
    code = (f"import sys, {package}\n"
            f"print(' '.join(m for m in sys.modules if m.startswith('{package}.') and m != 'fedpdm_flower.fedapp.lazy'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


def test_lazy_reexports_still_resolve() -> None:
    from fedpdm_flower.fedapp.compression import top_k
    from fedpdm_flower.fedapp.data import load_dataset
    from fedpdm_flower.fedapp.models import NonconvexL1Logistic
    from fedpdm_flower.fedapp.privacy import PrivacyLedger

    assert callable(top_k) and callable(load_dataset) and NonconvexL1Logistic.name == "l1-logistic"
    assert PrivacyLedger.__module__ == "fedpdm_flower.fedapp.privacy.accountants"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import fedpdm_flower.fedapp.data

        _ = fedpdm_flower.fedapp.data.nope  # type: ignore[attr-defined]


def test_no_strategy_or_client_module_imports_torch() -> None:
    """A ServerApp or a device whose model is not torch pays nothing for torch (about 2.3 s of CPU to import, on
    every message of a deployment, where each message is a fresh `flwr-clientapp` process): the modules import it
    where a torch model is trained or built. FedREP's server side (server_step, model_crc, ...) is numpy. Private
    files are left out: test_layering's probe writes one into clients/ for a moment, maybe beside this test."""
    import fedpdm_flower.clients
    import fedpdm_flower.strategies

    mods = [f"{pkg.__name__}.{p.stem}" for pkg in (fedpdm_flower.strategies, fedpdm_flower.clients)
            for p in sorted(Path(pkg.__file__).parent.glob("*.py")) if not p.stem.startswith("_")]
    assert "fedpdm_flower.strategies.fedrep" in mods and "fedpdm_flower.clients.fedrep" in mods
    code = f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
