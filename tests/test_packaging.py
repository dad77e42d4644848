"""Packaging metadata tells the truth: the declared license has its file, the Python floor is flwr's, the installed
flwr satisfies the declared bounds."""

from __future__ import annotations

import hashlib
import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: MD5 of https://www.apache.org/licenses/LICENSE-2.0.txt (also Debian's /usr/share/common-licenses/Apache-2.0)
APACHE_2_0_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


def floor(spec: str) -> Version:
    """The lowest version a '>=X' specifier set allows."""
    (lower,) = [s for s in SpecifierSet(spec) if s.operator == ">="]
    return Version(lower.version)


def test_license_file_is_the_full_apache_2_0_text() -> None:
    project = PROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    copyright_line, text = (ROOT / "LICENSE").read_text().split("\n", 1)
    assert copyright_line == "Copyright 2026 The fedpdm-flower authors"
    assert hashlib.md5(text.encode()).hexdigest() == APACHE_2_0_MD5  # unmodified, complete


def test_python_floor_is_the_one_flwr_needs_and_ruff_targets_it() -> None:
    ours = floor(PROJECT["project"]["requires-python"])
    flwr_needs = importlib.metadata.metadata("flwr")["Requires-Python"]
    assert ours >= floor(flwr_needs), f"flwr {importlib.metadata.version('flwr')} needs Python {flwr_needs}"
    assert PROJECT["tool"]["ruff"]["target-version"] == f"py{ours.major}{ours.minor}"


def test_installed_flwr_satisfies_the_declared_bounds() -> None:
    (req,) = [Requirement(d) for d in PROJECT["project"]["dependencies"] if Requirement(d).name == "flwr"]
    assert "simulation" in req.extras
    assert req.specifier.contains(importlib.metadata.version("flwr"))
