"""The README's "Use it in your Flower app" code is a working app: it runs through `flwr run` and learns.

The code block after the ``<!-- snippet: use-in-your-app -->`` marker is written, unchanged, to ``my_app.py`` of a
fresh app directory with a minimal pyproject.toml, and run with 3 SuperNodes on a simulation SuperLink whose
processes run in a fresh environment with the library pip-installed from its wheel (tests/installed.py), as a
reader's app would.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from flwr.app import RecordDict

from simulations.deploy import LocalSimulation
from simulations.flower_driver import ROOT, run_flower

MARKER = "<!-- snippet: use-in-your-app -->"
PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "my-app"
version = "1.0.0"
dependencies = ["flwr[simulation]>=1.41,<1.43", "torch>=2.2", "fedpdm-flower"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "readme"

[tool.flwr.app.components]
serverapp = "my_app:server_app"
clientapp = "my_app:client_app"
"""


def snippet(marker: str = MARKER) -> str:
    text = (ROOT / "README.md").read_text()
    after = text[text.index(marker) + len(marker):]
    match = re.match(r"\s*```python\n(.*?)```", after, re.DOTALL)
    assert match, "the README marker must be followed by a python code block"
    return match.group(1)


def test_the_snippet_is_plain_user_code() -> None:
    code = snippet()
    assert "fedpdm_flower.fedapp.config" not in code and "fedpdm_flower.fedapp.registry" not in code and "fedpdm_flower.fedapp.task" not in code
    compile(code, "my_app.py", "exec")


def test_the_wrappers_snippet_builds_what_it_says() -> None:
    """The "Building blocks" code constructs its strategies (the example app runs them through flwr run)."""
    from fedpdm_flower.strategies.wrappers import Compressed, Robust, SecureBuffers

    scope: dict[str, object] = {}
    exec(compile(snippet("<!-- snippet: wrappers -->"), "readme_wrappers.py", "exec"), scope)
    secure, compressed = scope["secure"], scope["compressed"]
    assert isinstance(secure, SecureBuffers) and isinstance(secure.inner, Robust) and secure.buffer_size == 3
    assert isinstance(compressed, Compressed) and isinstance(compressed.inner, Robust)



def test_the_resume_snippet_builds_what_it_says() -> None:
    """The "Runs that survive their server" code wraps Flower's FedAvg and builds a ClientApp with the state mod
    (tests/test_resume_kill.py kills and resumes such runs)."""
    from flwr.app import Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp.strategy import FedAvg

    from fedpdm_flower.strategies.checkpointed import Checkpointed

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"num-server-rounds": 3})
    scope: dict[str, object] = {"context": context}
    exec(compile(snippet("<!-- snippet: resume -->"), "readme_resume.py", "exec"), scope)
    strategy, client_app = scope["strategy"], scope["client_app"]
    assert isinstance(strategy, Checkpointed) and isinstance(strategy.strategy, FedAvg)
    assert str(strategy.directory) == "/var/lib/fl/checkpoint" and strategy.config == {"num-server-rounds": 3}
    assert isinstance(client_app, ClientApp)

@pytest.mark.flower
@pytest.mark.install
def test_the_snippet_runs_through_flwr_and_learns(installed_simulation: LocalSimulation, tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(PYPROJECT)
    (app / "my_app.py").write_text(snippet())
    run = run_flower({}, tmp_path / "out", num_supernodes=3, connection=installed_simulation.connection,
                     env=installed_simulation.env,
                     simulation=True, app=app, results_name=None, stream=False, timeout=600)
    assert run.status == "finished:completed", run.log[-3000:]
    found = re.findall(r"final accuracy (\d\.\d+)", run.log)
    assert found and float(found[-1]) > 0.8, run.log[-3000:]  # three separable classes: chance is 1/3
