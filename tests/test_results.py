"""The results contract of DESIGN.md, written by the in-process driver through the same `finish` as Flower runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from fedpdm_flower.fedapp.config import parse_run_config
from fedpdm_flower.fedapp.runner import finish
from simulations.inprocess import run_inprocess

ROUND_KEYS = {"round", "test_accuracy", "test_loss", "objective_gap", "epsilon", "delta", "uplink_bytes",
              "downlink_bytes", "wall_s"}


def test_results_json_follows_the_contract(tmp_path: Path) -> None:
    cfg = parse_run_config({"algorithm": "bsdp-fedpdm", "dataset": "synthetic", "partitioner": "iid",
                            "num-clients": 4, "clients-per-round": 2, "num-server-rounds": 3, "eval-every": 2})
    strategy, _, wall = run_inprocess(cfg)
    doc, path = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(tmp_path))
    on_disk = json.loads(path.read_text())
    assert on_disk == doc
    assert {"algorithm", "dataset", "config", "seed", "rounds", "final", "engine"} <= set(doc)
    assert doc["engine"] == "in-process" and doc["seed"] == 0 and doc["algorithm"] == "bsdp-fedpdm"
    assert [r["round"] for r in doc["rounds"]] == [1, 2, 3]
    for r in doc["rounds"]:
        assert set(r) >= ROUND_KEYS
        assert isinstance(r["uplink_bytes"], int) and r["uplink_bytes"] > 0 and r["downlink_bytes"] > 0
        assert r["delta"] == cfg.delta and math.isfinite(r["epsilon"])
    # eval-every=2: round 1 not evaluated (null), round 2 and the last round are
    assert doc["rounds"][0]["test_accuracy"] is None and doc["rounds"][1]["test_accuracy"] is not None
    assert doc["final"] == doc["rounds"][-1] and doc["final"]["test_accuracy"] is not None
    # the echoed config is what the algorithm read, and reproduces the run
    assert doc["config"]["alpha-up"] == cfg.alpha_up and "mu" not in doc["config"]
    assert set(doc["summary"]["privacy_accountants"]) == {"eps_gdp", "eps_rdp", "eps_basic"}
    named = {e["accountant"]: e for e in doc["summary"]["privacy_by_accountant"]}
    assert set(named) == {"gdp", "rdp", "basic composition"} and named["gdp"]["rigorous"]
    assert named["gdp"]["unit"] == "one record of a client's data" and named["gdp"]["delta"] == cfg.delta
    assert named["gdp"]["epsilon"] <= cfg.epsilon_total * (1 + 1e-9) <= named["rdp"]["epsilon"]
    # what another library needs to recompute the figures is in every round
    assert all({"noise_multiplier", "sample_rate", "releases"} <= set(r) for r in doc["rounds"])
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
    np.testing.assert_array_equal(np.load(tmp_path / "model.npy"), strategy.global_model())
    rerun = parse_run_config({k: v for k, v in doc["config"].items() if k != "out-dir"})
    again, _, _ = run_inprocess(rerun)
    np.testing.assert_array_equal(again.global_model(), strategy.global_model())
