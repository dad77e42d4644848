"""A user's environment, offline: the library pip-installed from its wheel, next to the user's Flower apps.

`build_installed_env` does what a user does, on a machine with no network:

1. builds the wheel from the checkout (``pip wheel --no-deps --no-build-isolation``: hatchling comes from the dev
   environment instead of an index);
2. creates a fresh virtual environment;
3. ``pip install``s the user's apps (``examples/*``) into it with ``--no-index --find-links <wheels>``: each app's
   ``pyproject.toml`` lists ``fedpdm-flower`` by name, and pip resolves it to the wheel just built.

What cannot be downloaded here is the heavy third-party stack (flwr, torch, ray, numpy, ...). The fresh environment
takes it from the test environment's site-packages through a ``.pth`` line that points at a directory of links to
every entry there except this project's own (its editable install, which would put the checkout on sys.path). A
``.pth`` path line only appends that directory to sys.path; the ``.pth`` files inside it are not run. So pip sees
flwr, torch, ... as installed and fedpdm-flower as missing, and installs the wheel; `fedpdm_flower` then resolves
to the environment's own copy (checked by ``library_file``), never to the checkout.

flwr's console scripts (``flwr``, ``flower-superlink``, ``flwr-simulation``, ...) are written into the new
environment's ``bin/`` as pip writes them when it installs flwr, so the SuperLink, its ServerApp and ClientApp
processes run on the new environment's interpreter (``local_simulation(bin_dir=...)``).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = ("fedpdm_flower", "_editable_impl_fedpdm_flower", "__editable__.fedpdm_flower", "__editable___fedpdm_flower")


@dataclass(frozen=True)
class InstalledEnv:
    """A virtual environment with the library installed from its wheel (``python``, ``bin_dir``, ``site``)."""

    root: Path
    wheel: Path

    @property
    def bin_dir(self) -> Path:
        return self.root / "venv" / "bin"

    @property
    def python(self) -> Path:
        return self.bin_dir / "python"

    @property
    def site(self) -> Path:
        return Path(subprocess.run([str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   env=clean_env(), cwd=self.root, capture_output=True, text=True,
                                   check=True).stdout.strip())

    def library_file(self) -> Path:
        """Where ``import fedpdm_flower`` resolves in this environment (run from a directory outside the checkout)."""
        out = subprocess.run([str(self.python), "-c", "import fedpdm_flower; print(fedpdm_flower.__file__)"],
                             env=clean_env(), cwd=self.root, capture_output=True, text=True, check=True)
        return Path(out.stdout.strip())


def clean_env() -> dict[str, str]:
    """This process's environment without PYTHONPATH (which would put the checkout first)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(argv: list[str], cwd: Path) -> None:
    proc = subprocess.run(argv, env=clean_env(), cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _console_scripts(bin_dir: Path, python: Path, distribution: str) -> None:
    for ep in importlib.metadata.distribution(distribution).entry_points:
        if ep.group != "console_scripts":
            continue
        module, _, attr = ep.value.partition(":")
        script = bin_dir / ep.name
        script.write_text(f"#!{python}\nimport sys\nfrom {module} import {attr}\n"
                          f"if __name__ == '__main__':\n    sys.exit({attr}())\n")
        script.chmod(0o755)


def build_installed_env(dest: Path, apps: list[Path]) -> InstalledEnv:
    """Build the wheel, create ``dest/venv`` and ``pip install`` ``apps`` (each with its own pyproject) into it."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = dest / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(wheels), str(ROOT)], dest)
    (wheel,) = wheels.glob("fedpdm_flower-*.whl")
    deps = dest / "third-party"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(OWN):
            (deps / entry.name).symlink_to(entry)
    _run([sys.executable, "-m", "venv", "--without-pip", str(dest / "venv")], dest)
    env = InstalledEnv(root=dest, wheel=wheel)
    (env.site / "_third_party.pth").write_text(f"{deps}\n")
    _console_scripts(env.bin_dir, env.python, "flwr")
    # pip (itself one of the third-party packages) installs into the new environment: its interpreter runs it
    _run([str(env.python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
          "--no-build-isolation", *map(str, apps)], dest)
    return env
