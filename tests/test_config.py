"""Run-config parsing: every bad value stops with one message naming the key; pyproject defaults match."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedpdm_flower.fedapp.config import ConfigError, RunConfig, known_keys, parse_run_config
from fedpdm_flower.fedapp.registry import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_run_config_lists_every_key_with_the_same_defaults() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert sorted(cfg) == known_keys()  # flwr rejects `-c` keys missing here, so every key must be listed
    assert parse_run_config(cfg) == RunConfig()


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"epsilon-total": 0.0}, "epsilon-total"),
        ({"epsilon-total": -1}, "epsilon-total"),
        ({"alpha-up": 0.0}, "alpha-up"),
        ({"alpha-down": 1.5}, "alpha-down"),
        ({"delta": 1.0}, "delta"),
        ({"algorithm": "fedsgd"}, "algorithm"),
        ({"dataset": "cifar100"}, "dataset"),
        ({"uplink-sparsifier": "topq"}, "uplink-sparsifier"),
        ({"num-server-rounds": 2.5}, "num-server-rounds"),
        ({"dp": "maybe"}, "dp"),
        ({"rho": "ten"}, "rho"),
        ({"rho": float("nan")}, "rho"),
        ({"clients-per-round": 200}, "clients-per-round"),
        ({"epsilon_total": 1.0}, "epsilon_total"),
    ],
)
def test_bad_values_name_the_key(raw: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        parse_run_config(raw)


def test_toml_types_are_accepted() -> None:
    cfg = parse_run_config({"rho": 10, "num-server-rounds": 5.0, "dp": "false", "algorithm": "dp-fedpdm"})
    assert cfg.rho == 10.0 and cfg.num_server_rounds == 5 and cfg.dp is False


def test_used_config_echoes_only_what_the_algorithm_reads() -> None:
    cfg = parse_run_config({"algorithm": "dp-fedpdm", "dp": False})
    used = ALGORITHMS["dp-fedpdm"].used_config(cfg)
    assert "rho" in used and "alpha-up" not in used and "epsilon-total" not in used
    used = ALGORITHMS["bsdp-fedpdm"].used_config(cfg.replace(algorithm="bsdp-fedpdm", dp=True))
    assert {"alpha-up", "alpha-down", "epsilon-total", "delta"} <= set(used)


def test_cli_rejects_bad_config_before_running(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "simulations", "run", "--algorithm", "dp-fedpdm", "--out", str(tmp_path), "--set", "alpha-up=0"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )
    assert out.returncode == 2
    assert "'alpha-up'" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "results.json").exists()
