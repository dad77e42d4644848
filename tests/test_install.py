"""A user's own Flower app, with modules named like ours (strategies.py, clients/), uses the pip-installed library.

Flower puts an app's folder first on sys.path, so an app's own ``strategies`` and ``clients`` win over any top-level
package of those names. The library lives under one distinctive top-level name, ``fedpdm_flower``, so nothing of the
user's can shadow it (docs/architecture.md). The app (tests/apps/own_modules) runs through ``flwr run`` on a
SuperLink whose processes run in a fresh environment with the library installed from its wheel (tests/installed.py);
its ServerApp logs where each module came from.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from installed import InstalledEnv

from simulations.deploy import LocalSimulation
from simulations.flower_driver import ROOT, run_flower

pytestmark = [pytest.mark.flower, pytest.mark.install]

APP = ROOT / "tests" / "apps" / "own_modules"


def test_a_user_app_with_its_own_strategies_and_clients_modules_runs_on_the_installed_library(
        installed_env: InstalledEnv, installed_simulation: LocalSimulation, tmp_path: Path) -> None:
    run = run_flower({}, tmp_path, num_supernodes=3, connection=installed_simulation.connection,
                     env=installed_simulation.env, simulation=True, app=APP, results_name=None, stream=False,
                     timeout=600)
    assert run.status == "finished:completed", run.log[-3000:]
    where = dict(re.findall(r"module (\w+) from (\S+)", run.log))
    assert Path(where["fedpdm_flower"]) == installed_env.site / "fedpdm_flower" / "__init__.py", where
    for own in ("strategies", "clients"):  # the user's modules, shipped in the app's FAB, not anything installed
        path = Path(where[own])
        assert installed_env.site not in path.parents and ROOT not in path.parents, where
    assert where["strategies"].endswith("strategies.py") and where["clients"].endswith("clients/__init__.py")
    found = re.findall(r"final accuracy (\d\.\d+)", run.log)
    assert found and float(found[-1]) > 0.8, run.log[-3000:]  # three separable classes: chance is 1/3
