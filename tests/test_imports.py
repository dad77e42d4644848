"""Flower's simulation imports the ServerApp and the ClientApp in different threads of one process.

A package ``__init__`` that eagerly imports its submodules deadlocks against a thread importing one of those
submodules directly: a benchmark run failed with "deadlock detected by _ModuleLock('fedpdm_flower.fedapp.privacy.accountants')",
and importing the apps from five threads at once failed in 5 of 12 fresh interpreters. The invariant that rules
the race out: importing one of our packages imports none of its submodules (re-exports resolve lazily).
"""

from __future__ import annotations

import subprocess
import sys

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
