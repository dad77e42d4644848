"""Real Flower simulation through `flwr run` (the local simulation SuperLink), against the in-process driver."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from crossproc import TRAJECTORY_ULPS, assert_same_across_processes

from fedpdm_flower.fedapp.config import parse_run_config
from fedpdm_flower.fedapp.runner import finish
from simulations.flower_driver import FlowerRunError, run_flower
from simulations.inprocess import run_inprocess

pytestmark = pytest.mark.flower

SMALL = {"plot": False, "algorithm": "bsdp-fedpdm", "dataset": "synthetic", "partitioner": "iid", "num-clients": 6,
         "clients-per-round": 3, "num-server-rounds": 4, "eta0": 0.05, "uplink-sparsifier": "randk",
         "alpha-up": 0.3, "alpha-down": 0.5, "dp": True, "epsilon-total": 50.0}


def test_flower_simulation_equals_inprocess_driver(tmp_path: Path) -> None:
    res = run_flower(SMALL, tmp_path / "flower", num_supernodes=6, stream=False)
    assert res.status == "finished:completed"
    flower = json.loads(res.results.read_text())
    cfg = parse_run_config(SMALL)
    strategy, _, wall = run_inprocess(cfg)
    local, path = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(tmp_path / "local"))
    assert flower["engine"] == "flower-simulation" and local["engine"] == "in-process"
    assert flower["config"].pop("out-dir") == str(tmp_path / "flower")
    assert local["config"].pop("out-dir") == str(tmp_path / "local")
    assert flower["config"] == local["config"]
    keys = ("round", "test_accuracy", "test_loss", "epsilon", "uplink_bytes", "downlink_bytes", "clients", "nnz")
    for fr, lr in zip(flower["rounds"], local["rounds"], strict=True):
        assert_same_across_processes({k: fr[k] for k in keys}, {k: lr[k] for k in keys}, ulps=TRAJECTORY_ULPS,
                                     what=f"round {lr['round']}")
    # same final model (within a few ulps across processes, tests/crossproc.py): sampling, noise, rand-k indices and
    # client state all agree
    assert_same_across_processes(np.load(tmp_path / "flower" / "model.npy"), np.load(path.parent / "model.npy"),
                                 ulps=TRAJECTORY_ULPS, what="final model")
    assert flower["rounds"][0]["clients"] == 6 and all(r["clients"] == 3 for r in flower["rounds"][1:])


def test_bad_run_config_stops_the_flower_run_before_round_one(tmp_path: Path) -> None:
    with pytest.raises(FlowerRunError) as info:
        run_flower({**SMALL, "alpha-up": 0.0}, tmp_path, num_supernodes=6, stream=False)
    run = info.value.run
    assert run is not None
    assert run.status.startswith("finished:failed")
    assert "run config key 'alpha-up'" in run.log
    assert "[round 1/" not in run.log
    assert not (tmp_path / "results.json").exists()


def test_our_fedavg_matches_flowers_builtin_fedavg(tmp_path: Path) -> None:
    """Independent truth for the baselines: Flower's own FedAvg strategy driving our FedAvg client.

    Full participation and equal partitions (synthetic 2000 samples / 4 clients), so Flower's num-examples
    weighting equals our unweighted mean and Flower's unseeded sampling picks everyone.
    """
    common = {"plot": False, "dataset": "synthetic", "partitioner": "iid", "num-clients": 4, "clients-per-round": 4,
              "num-server-rounds": 3, "dp": False, "model": "multinomial", "eta0": 0.1, "gamma": 0.0}
    res = run_flower({**common, "algorithm": "flwr-fedavg"}, tmp_path / "builtin", num_supernodes=4, stream=False)
    builtin = json.loads(res.results.read_text())
    strategy, _, _ = run_inprocess(parse_run_config({**common, "algorithm": "fedavg"}))
    ours = [r.test_accuracy for r in strategy.history]
    assert [r["test_accuracy"] for r in builtin["rounds"]] == pytest.approx(ours, abs=1e-3)
    np.testing.assert_allclose(np.load(tmp_path / "builtin" / "model.npy"), strategy.x, rtol=1e-5, atol=1e-6)
    assert all(r["uplink_bytes"] > 0 and r["downlink_bytes"] > 0 for r in builtin["rounds"])


FEDREP = {"plot": False, "algorithm": "fedrep", "dataset": "mnist", "partitioner": "iid", "model": "lenet5", "num-clients": 4,
          "clients-per-round": 4, "num-server-rounds": 2, "batch-size": 25, "local-steps": 2, "buffer-size": 2,
          "eval-every": 1}


def test_fedrep_masked_flower_simulation_equals_inprocess_driver(tmp_path: Path) -> None:
    """Two exchanges per round through Flower's Grid (query.propose, then train), fresh key pairs per round drawn
    from the OS: the masks differ between the runs but cancel exactly, so the models agree (up to the few ulps two
    processes may round apart, tests/crossproc.py)."""
    res = run_flower(FEDREP, tmp_path / "flower", num_supernodes=4, stream=False)
    assert res.status == "finished:completed"
    flower = json.loads(res.results.read_text())
    cfg = parse_run_config(FEDREP)
    strategy, _, wall = run_inprocess(cfg)
    local, path = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(tmp_path / "local"))
    keys = ("round", "test_accuracy", "test_loss", "uplink_bytes", "downlink_bytes", "clients", "consensus_size",
            "buffers", "discarded_buffers")
    for fr, lr in zip(flower["rounds"], local["rounds"], strict=True):
        assert_same_across_processes({k: fr[k] for k in keys}, {k: lr[k] for k in keys}, ulps=TRAJECTORY_ULPS,
                                     what=f"round {lr['round']}")
        assert fr["buffers"] == 2 and fr["discarded_buffers"] == 0
    assert_same_across_processes(np.load(tmp_path / "flower" / "model.npy"), np.load(path.parent / "model.npy"),
                                 ulps=TRAJECTORY_ULPS, what="final model")


RECAL = {"plot": False, "algorithm": "dp-recal", "dataset": "mnist", "num-clients": 8, "clients-per-round": 8,
         "num-server-rounds": 24, "recal-samples": 2000, "recal-epsilon": 5.0, "eval-every": 8}


def test_dp_recal_flower_simulation_equals_inprocess_driver(tmp_path: Path) -> None:
    """The server only routes: one holder per round, the baton (x, u~) relayed unchanged; same walk, same noise.

    On the test session's simulation SuperLink (tests/conftest.py), whose ClientApps import this checkout."""
    res = run_flower(RECAL, tmp_path / "flower", num_supernodes=8, stream=False)
    assert res.status == "finished:completed"
    flower = json.loads(res.results.read_text())
    cfg = parse_run_config(RECAL)
    strategy, _, wall = run_inprocess(cfg)
    local, path = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(tmp_path / "local"))
    keys = ("round", "objective_gap", "epsilon", "uplink_bytes", "downlink_bytes", "agent", "lci", "graph_msgs")
    for fr, lr in zip(flower["rounds"], local["rounds"], strict=True):
        assert_same_across_processes({k: fr[k] for k in keys}, {k: lr[k] for k in keys}, ulps=TRAJECTORY_ULPS,
                                     what=f"round {lr['round']}")
    assert_same_across_processes(np.load(tmp_path / "flower" / "model.npy"), np.load(path.parent / "model.npy"),
                                 ulps=TRAJECTORY_ULPS, what="final model")
    assert flower["rounds"][-1]["graph_msgs"] == 24
