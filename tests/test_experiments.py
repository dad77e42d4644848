"""The figure and benchmark configurations: every run they would start is a valid run config, none of their defaults
needs data that pip cannot install, and `--set` changes a base configuration without overruling what is compared.

Only configurations are built here (no training): each check takes milliseconds.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from fedpdm_flower.fedapp.config import ConfigError, parse_run_config
from simulations import benchmark, experiments
from simulations.__main__ import build_parser

#: offline datasets that only an apt package provides (Debian's dataset-fashion-mnist)
APT_ONLY = {"fashion-mnist"}
FEDREP_FIGURES = [name for name in experiments.FIGURES if name.startswith("fedrep-")]


@pytest.mark.parametrize("name", list(experiments.FIGURES))
def test_every_figure_job_is_a_valid_config_on_pip_installable_data(name: str, tmp_path: Path) -> None:
    fig = experiments.FIGURES[name]
    jobs = experiments.figure_jobs(name, tmp_path, rounds=7, seeds=2)
    assert len(jobs) == 2 * len(fig.variants) and len({out for _, _, out in jobs}) == len(jobs)
    for label, raw, _ in jobs:
        cfg = parse_run_config(raw)
        assert cfg.num_server_rounds == 7
        assert cfg.dataset not in APT_ONLY, f"{name} / {label} defaults to {cfg.dataset}, which pip cannot install"


def test_fedrep_figures_default_to_mnist_and_reproduce_the_readme_on_fashion_mnist(tmp_path: Path) -> None:
    """docs/fedrep.md's FedREP tables were measured with `--set dataset=fashion-mnist`: same configs otherwise."""
    assert FEDREP_FIGURES
    for name in FEDREP_FIGURES:
        default = experiments.figure_jobs(name, tmp_path, rounds=150, seeds=1)
        fashion = experiments.figure_jobs(name, tmp_path, rounds=150, seeds=1, overrides={"dataset": "fashion-mnist"})
        assert [(label, {**raw, "dataset": "fashion-mnist"}) for label, raw, _ in default] == \
            [(label, raw) for label, raw, _ in fashion]
        assert {parse_run_config(raw).dataset for _, raw, _ in default} == {"mnist"}
        assert {parse_run_config(raw).model for _, raw, _ in default} == {"lenet5"}


@pytest.mark.parametrize(
    ("name", "overrides", "match"),
    [
        ("fedrep-table", {"attack": "none"}, "sets attack itself"),  # a variant sets it
        ("fedrep-alpha", {"seed": 3}, "sets seed itself"),  # the seed loop sets it
        ("fig4-mnist", {"num-server-rounds": 5}, "sets num-server-rounds itself"),  # --rounds sets it
        ("fedrep-table", {"foe-epsilon": 1.0}, r"figure fedrep-table, variant 'FedREP geomed none': .*foe-epsilon"),
        ("fedrep-coord", {"dataset": "imagenet"}, r"variant 'coord none': .*'dataset'"),
    ],
)
def test_figure_overrides_are_refused_before_any_run(name: str, overrides: dict[str, Any], match: str,
                                                      tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=match):
        experiments.run_figure(name, tmp_path, rounds=2, seeds=1, overrides=overrides)
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_figure_cli_passes_set_to_run_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    got: dict[str, Any] = {}
    monkeypatch.setattr(experiments, "run_figure", lambda name, out, **kw: got.update(name=name, **kw) or "")
    args = build_parser().parse_args(["figure", "fedrep-table", "--rounds", "150", "--seeds", "1",
                                      "--set", "dataset=fashion-mnist", "--set", "cclip-tau=0.002"])
    assert args.func(args) == 0
    assert got == {"name": "fedrep-table", "scale": "reduced", "seeds": 1, "rounds": 150,
                   "overrides": {"dataset": "fashion-mnist", "cclip-tau": 0.002}}


def test_fedrep_bench_task_defaults_to_mnist_and_refuses_overrides_of_what_it_compares(tmp_path: Path) -> None:
    assert benchmark.FEDREP_TASK["dataset"] == "mnist"
    for _, over in benchmark.FEDREP_WIRE_RUNS:
        assert parse_run_config({**benchmark.FEDREP_TASK, **over}).dataset not in APT_ONLY
    with pytest.raises(ConfigError, match="sets secagg-mode itself"):
        benchmark.fedrep_wire(tmp_path / "a", rounds=2, overrides={"secagg-mode": "plain"})
    with pytest.raises(ConfigError, match="'buffer-size'"):  # s = 3 does not divide m = 32: refused before any run
        benchmark.fedrep_wire(tmp_path / "b", rounds=2, overrides={"buffer-size": 3})
    assert not any(tmp_path.iterdir())


def test_bench_set_is_refused_for_the_fixed_suites() -> None:
    args = build_parser().parse_args(["bench", "--suite", "recal", "--set", "dataset=fashion-mnist"])
    assert isinstance(args, argparse.Namespace)
    with pytest.raises(ConfigError, match="--suite fedrep only"):
        args.func(args)
