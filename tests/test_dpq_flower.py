"""DPQ-DSGD in the reproduction app (fedpdm_flower/fedapp/apps/dpq.py -> fedpdm_flower/strategies/dpq.py, fedpdm_flower/clients/dpq.py; spec dp_quantized.md
7, 8, 10 F1-F6).

The app's strategy and clients driven in-process (simulations.inprocess: the same RecordDicts and context.state as a
Flower run) against the framework-free simulator of fedpdm_flower.fedapp.algorithms.dpq, bit for bit with noise, quantization and
minibatches on a tiny MNIST subset (the paper's horizon-2000 schedule: batch 50 of 200 samples per node); routing,
the run constants in every message and integer uploads; the bytes of a message against spec 3's ``d b + 40`` bits;
the ledger against the accountant; bad configs; and one real `flwr run` simulation against the in-process driver.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from crossproc import TRAJECTORY_ULPS, assert_same_across_processes
from flwr.app import ArrayRecord, RecordDict

from fedpdm_flower.clients.dpq import LEDGER, META, STATE
from fedpdm_flower.fedapp.algorithms import dpq
from fedpdm_flower.fedapp.apps import dpq as dpq_app
from fedpdm_flower.fedapp.compression import quantize
from fedpdm_flower.fedapp.config import ConfigError, RunConfig, parse_run_config
from fedpdm_flower.fedapp.data import load_dataset
from fedpdm_flower.fedapp.privacy.dpq import DPQLedger
from fedpdm_flower.fedapp.runner import build_strategy, finish
from fedpdm_flower.fedapp.wire import recorddict_nbytes
from fedpdm_flower.strategies.base import RUN_TOKEN_KEY, RoundFailed
from fedpdm_flower.strategies.dpq import DPQDSGD, RUN_KEYS
from simulations.inprocess import make_contexts, run_inprocess, run_rounds

BASE: dict[str, Any] = {
    "plot": False,  # results.json is what these runs are read by; tests/test_results.py checks the plot
    "algorithm": "dpq-dsgd", "dataset": "mnist", "model": "lenet5-valid", "num-clients": 5, "clients-per-round": 5,
    "dpq-horizon": 2000, "samples-per-client": 200, "dpq-eval-limit": 200, "eval-every": 2,
}


@pytest.fixture(scope="module")
def setup() -> dpq_app.DPQNetwork:
    return dpq_app.network(parse_run_config({**BASE, "num-server-rounds": 4}))


def run(rounds: int, **kw: Any) -> tuple[DPQDSGD, dict[int, Any], RunConfig]:
    cfg = parse_run_config({**BASE, "num-server-rounds": rounds, **kw})
    strategy, contexts, _ = run_inprocess(cfg)
    assert isinstance(strategy, DPQDSGD)
    return strategy, contexts, cfg


def node_states(contexts: dict[int, Any]) -> np.ndarray:
    return np.stack([contexts[i].state.array_records[STATE]["x"].numpy() for i in sorted(contexts)])


@pytest.mark.parametrize("variant", ["dpq", "dp-only", "quant-only", "dsgd"])
def test_flower_equals_the_simulator_bit_for_bit(setup: dpq_app.DPQNetwork, variant: str) -> None:
    """R rounds = bootstrap + R - 1 iterations: the nodes' x_i equal simulate(num_iters=R - 1) (per-node and
    vectorised engines), and the outbox holds m_{i,R-1} = node_message(x_{i,R-1}) exactly (spec 10 F1, F2, F6)."""
    rounds = 4 if variant == "dpq" else 3
    s, contexts, cfg = run(rounds, **{"dpq-variant": variant})
    assert s.params is not None and s.params.seed is None  # the server holds no device seed
    p = replace(s.params, seed=cfg.seed)  # what every node runs: the message's constants, its own (= run) seed
    assert p == dpq_app.params(cfg) and p.batch_size == 50 and p.K == 2000
    assert p.quantized == (variant in ("dpq", "quant-only")) and p.noise == (variant in ("dpq", "dp-only"))
    for engine in ("per_node", "vectorised"):
        ref = dpq.simulate(p, setup.A, setup.objectives, setup.x0, rounds - 1, engine=engine)
        np.testing.assert_array_equal(node_states(contexts), ref.x)
    x = node_states(contexts)
    for i in range(5):
        msg = dpq.node_message(p, i, rounds - 1, x[i])
        got = contexts[i].state.array_records[STATE]["m"].numpy()
        assert got.dtype == msg.dtype and np.array_equal(got, msg)
        raw = {"qlevels" if p.quantized else "dense": s.outbox[i][0]}
        np.testing.assert_array_equal(quantize.decode_message(raw, p.q_step or None, x.shape[1]),
                                      dpq.decode_message(p, msg))
        assert int(contexts[i].state.config_records[META]["k"]) == rounds - 1  # x_{i,k} with k = R - 1
        assert int(contexts[i].state.config_records[META]["t"]) == rounds
    assert [int(r.extra["k"]) for r in s.history] == list(range(-1, rounds - 1))


def test_routing_integer_uploads_and_the_ledger() -> None:
    """Node i gets exactly its ring neighbours' previous messages, unchanged; every upload is one uint8 array
    (spec 10 F3, F4); the nodes' ledgers are the accountant's eps_0..eps_{k} (spec 4.6: eps_0 = 3.1940e-5)."""
    cfg = parse_run_config({**BASE, "num-server-rounds": 4})
    s = build_strategy(cfg)
    assert isinstance(s, DPQDSGD)
    contexts = make_contexts(cfg)
    s.attach({pid: pid for pid in contexts})
    run_rounds(s, contexts, 2)
    for pid, content in s.train_contents(3):
        arrays = content["arrays"].to_numpy_ndarrays()
        nbrs = sorted({(pid - 1) % 5, (pid + 1) % 5})
        config = content["config"]
        assert json.loads(str(config["neighbours"])) == nbrs and json.loads(str(config["weights"])) == [1 / 3] * 2
        assert int(config["dpq-k"]) == 1 and int(config["agent-id"]) == pid and config["self-weight"] == pytest.approx(1 / 3)
        assert set(config) == {"neighbours", "weights", "self-weight", "msg-round", "agent-id", "dpq-k", "dpq-eval",
                               "dpq-share-state", "server-round", "layout-crc", "dim", RUN_TOKEN_KEY, *RUN_KEYS}
        # the strategy is the single source of truth: every run constant the nodes use travels in the message
        assert (config["dpq-alpha-hat"], config["dpq-beta-hat"], config["dpq-batch-size"], config["dpq-q-step"],
                config["dpq-noise"], config["dpq-horizon"]) == (s.params.alpha_hat, s.params.beta_hat, 50, 1.0, True,
                                                               2000)
        for a, j in zip(arrays, nbrs, strict=True):
            assert a.dtype == np.uint8
            np.testing.assert_array_equal(a, s.outbox[j][0])
    for i in range(5):
        assert all(a.dtype == np.uint8 and a.ndim == 1 for a in s.outbox[i])
    ledger = DPQLedger.from_record(dict(contexts[0].state.config_records[LEDGER]))
    np.testing.assert_allclose(ledger.eps_array(), s.schedule.eps_array(0), rtol=1e-13)
    assert ledger.eps_array()[0] == pytest.approx(3.1940e-5, rel=1e-4)
    rec = s.history[-1]
    assert rec.epsilon == pytest.approx(s.schedule.budget(0, warn=False).eps_total, rel=1e-12)
    assert rec.extra["dpq_delta_hat_vacuous"] is True and rec.delta is not None and rec.delta >= 1.0


def test_message_bytes_are_spec3_bits_plus_the_header() -> None:
    """The message payload is within its 13-byte wire header of spec 3's ``d b + 40`` bits, and the serialized
    ArrayRecord adds < 256 bytes of protobuf framing; the recorded uplink is the replies' serialized size; on the ring downlink bits = 2 x the previous
    round's uplink bits (spec 10 F5); the float32 reference is 32 d."""
    s, _, _ = run(4)
    d = s.dim
    assert d == 44426
    for r_prev, r in zip(s.history, s.history[1:], strict=False):
        assert r.extra["downlink_bits"] == 2 * r_prev.extra["uplink_bits"]
    for i in range(5):
        raw = s.outbox[i][0]
        levels = quantize.decode_levels({"qlevels": raw}, count=d)
        bits = quantize.message_bits(levels)
        assert raw.nbytes == quantize.WIRE_HEADER_BYTES + math.ceil(d * quantize.level_width(levels) / 8)
        assert 0 <= 8 * raw.nbytes - bits <= 71
        record = recorddict_nbytes(RecordDict({"arrays": ArrayRecord([raw])}))
        assert 0 < record - raw.nbytes < 256  # Flower's ArrayRecord framing (key, dtype, shape, stype): ~190 bytes
    rec = s.history[-1]
    assert rec.extra["float32_message_bits"] == 32 * d
    assert rec.extra["bits_per_message"] == d * rec.extra["bits_per_coordinate"] + 40
    assert rec.extra["compression_ratio"] == pytest.approx(32 * d / rec.extra["bits_per_message"])
    assert rec.extra["entropy_bits_per_coordinate"] < rec.extra["bits_per_coordinate"] <= 6
    # uplink = five replies: the payload plus small metrics / framing; no evaluation upload in this run
    assert 0 < rec.uplink_bytes - 5 * rec.extra["message_wire_bytes"] < 5 * 600


def test_evaluation_reports_node_and_average_accuracies(setup: dpq_app.DPQNetwork) -> None:
    """Evaluation rounds: mean / min / max of the nodes' own test accuracies on the first dpq-eval-limit test samples
    (spec 9.17) and, with dpq-eval-average, the node-average model by the app's central evaluation (the whole test
    set); global_model() is that average."""
    s, contexts, _ = run(3, **{"dpq-eval-average": True})
    x = node_states(contexts)
    rec = s.history[-1]
    acc = dpq_app.node_accuracies(setup, x, test_limit=200)["test"]
    assert rec.test_accuracy == pytest.approx(float(acc.mean()), abs=1e-12)
    assert rec.extra["node_test_acc_min"] == acc.min() and rec.extra["node_test_acc_max"] == acc.max()
    np.testing.assert_array_equal(s.global_model(), np.mean(x, axis=0))
    avg_acc, _ = dpq_app.evaluate(setup.net, np.mean(x, axis=0), load_dataset("mnist")[1])
    assert rec.extra["avg_model_test_accuracy"] == avg_acc
    assert s.history[0].test_accuracy is None and s.history[1].test_accuracy is not None  # eval-every 2, and the last


def test_a_node_without_state_stops_the_run() -> None:
    cfg = parse_run_config({**BASE, "num-server-rounds": 4})
    s = build_strategy(cfg)
    contexts = make_contexts(cfg)
    s.attach({pid: pid for pid in contexts})
    run_rounds(s, contexts, 2)
    del contexts[3].state.array_records[STATE]
    with pytest.raises(RoundFailed, match=r"round 3: no valid \w+ from \w+\(s\) \[3\].*no DPQ state"):
        run_rounds(s, contexts, 1, start=3)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [({"model": "l1-logistic"}, "'model'"),
     ({"model": "resnet20"}, "'model'"),
     ({"dataset": "adult"}, "'dataset'"),
     ({"num-clients": 1, "clients-per-round": 1}, "'num-clients'"),
     ({"graph": "er:2"}, "'graph'"),
     ({"dpq-horizon": 1}, "'dpq-horizon'"),
     ({"dpq-horizon": 0, "num-server-rounds": 3}, "'num-server-rounds'"),
     ({"dpq-horizon": 10, "num-server-rounds": 13}, "'num-server-rounds'"),
     ({"dpq-horizon": 10, "dpq-a2": 6.0}, "'dpq-a2'"),
     ({"dpq-q-step": 0.0}, "'dpq-q-step'"),
     ({"dpq-variant": "noisy"}, "'dpq-variant'"),
     ({"dpq-sigma-offset": 0.0}, "'dpq-sigma-offset'"),
     ({"dpq-a3": -1.0}, "'dpq-a3'"),
     ({"dpq-c": 0.0}, "'dpq-c'")],
)
def test_bad_configs_name_the_key(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_run_config({**BASE, "num-server-rounds": 5, **overrides})


def test_the_horizon_defaults_to_rounds_minus_two() -> None:
    cfg = parse_run_config({**BASE, "dpq-horizon": 0, "num-server-rounds": 2002})
    assert dpq_app.horizon(cfg) == 2000
    assert dpq_app.params(cfg) == replace(dpq.paper_mnist_params(1.0, 0.1), float_messages="float32")


FLOWER = {**BASE, "num-server-rounds": 5, "eval-every": 2, "dpq-eval-average": True}


@pytest.mark.flower
def test_dpq_flower_simulation_equals_inprocess_driver(tmp_path: Path) -> None:
    """5 SuperNodes, 5 rounds through `flwr run`: the same messages, bytes, privacy, evaluations and node-average
    model as the in-process driver."""
    from simulations.flower_driver import run_flower

    res = run_flower(FLOWER, tmp_path / "flower", num_supernodes=5, stream=False)
    assert res.status == "finished:completed"
    flower = json.loads(res.results.read_text())
    cfg = parse_run_config(FLOWER)
    strategy, _, wall = run_inprocess(cfg)
    local, path = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(tmp_path / "local"))
    keys = ("round", "test_accuracy", "test_loss", "epsilon", "delta", "uplink_bytes", "downlink_bytes", "clients",
            "bits_per_message", "uplink_bits", "downlink_bits", "entropy_bits_per_coordinate", "dpq_eps",
            "dpq_log_delta_hat", "node_test_acc_min", "avg_model_test_accuracy", "mean_train_loss")
    assert len(flower["rounds"]) == 5
    for fr, lr in zip(flower["rounds"], local["rounds"], strict=True):
        assert_same_across_processes({k: fr.get(k) for k in keys}, {k: lr.get(k) for k in keys},
                                     ulps=TRAJECTORY_ULPS, what=f"round {lr['round']}")
    assert_same_across_processes(np.load(tmp_path / "flower" / "model.npy"), np.load(path.parent / "model.npy"),
                                 ulps=TRAJECTORY_ULPS, what="final model")
    assert all(r["clients"] == 5 for r in flower["rounds"])
