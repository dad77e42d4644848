"""simulations/dpq_table.py: the run grid, and one tiny run against the simulator and the accountant."""

from __future__ import annotations

import numpy as np
import pytest

from fedpdm_flower.fedapp.algorithms import dpq
from fedpdm_flower.fedapp.apps import dpq as dpq_app
from fedpdm_flower.fedapp.compression import quantize
from fedpdm_flower.fedapp.config import parse_run_config
from simulations.dpq_table import base_config, run_one, runs


def test_the_grid_is_the_papers_plus_the_baselines() -> None:
    grid = runs()
    assert len(grid) == 16
    assert sum(v["dpq-variant"] == "dpq" for v in grid.values()) == 9
    assert {v["dpq-variant"] for v in grid.values()} == {"dpq", "dp-only", "quant-only", "dsgd"}
    cfg = parse_run_config({**base_config(2000), **grid["DPQ Delta=5 sigma=-0.1"]})
    assert cfg.num_server_rounds == 2002 and dpq_app.horizon(cfg) == 2000 and cfg.dpq_q_step == 5.0


def test_a_tiny_run_reports_the_simulators_accuracy_bits_and_eps() -> None:
    raw = {**base_config(2000, samples=200, eval_limit=200), **runs()["DPQ Delta=1 sigma=0.1"]}
    row = run_one(("t", raw, 3, 2, 100))
    cfg = parse_run_config(raw)
    setup = dpq_app.network(cfg)
    p = dpq_app.params(cfg)
    trace = dpq.simulate(p, setup.A, setup.objectives, setup.x0, 3)
    acc = dpq_app.node_accuracies(setup, trace.x, test_limit=200)["test"]
    assert row["test_acc_mean"] == pytest.approx(float(acc.mean()), abs=1e-12)
    assert [c["k"] for c in row["curve"]] == [1.0, 2.0] and row["curve"][0]["test_samples"] == 100.0
    first = np.mean([quantize.message_bits(dpq.node_message(p, i, 0, setup.x0)) for i in range(5)])
    assert row["bits_per_message_first"] == first
    assert row["eps"] == pytest.approx(dpq_app.schedule(cfg).budget(2, warn=False).eps_total, rel=1e-12)
    assert row["delta_hat_vacuous"] is True and row["batch"] == 50 and row["iterations"] == 3
