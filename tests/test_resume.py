"""Checkpoints and resume (issue 15): a run that stops after round k and is resumed from out-dir/checkpoint ends
exactly as the run that never stopped -- the same final model bit for bit, the same per-round accuracy, loss,
epsilon and bytes, the same privacy spent.

The stop is the ServerApp's own death between rounds: run config ``crash-after-round = k`` raises right after the
round-k checkpoint is on disk (the run ends failed, as a killed ServerApp's would), and the resumed run is a new
process (in-process CLI) or a new `flwr run` (Flower simulation) that gets nothing but out-dir and the clients'
state directory. The truth is the uninterrupted run of the same config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from crossproc import TRAJECTORY_ULPS, assert_same_across_processes

from fedpdm_flower.fedapp.checkpoint import (
    CHECKPOINT_DIR,
    Journal,
    decode_state,
    encode_state,
    read_checkpoint,
    write_checkpoint,
)
from simulations.__main__ import EXIT_CONFIG, EXIT_FAILED, main

#: per-round fields that must agree (wall_s and the timestamps are the only ones that may not)
ROUND_KEYS = ("round", "test_accuracy", "test_loss", "epsilon", "delta", "uplink_bytes", "downlink_bytes", "clients",
              "rejected")

FEDPDM = {"plot": False, "algorithm": "bsdp-fedpdm", "dataset": "synthetic", "partitioner": "iid", "num-clients": 6,
          "clients-per-round": 3, "num-server-rounds": 5, "eta0": 0.05, "uplink-sparsifier": "randk",
          "alpha-up": 0.3, "alpha-down": 0.5, "dp": True, "epsilon-total": 50.0}


def _sets(cfg: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in cfg.items():
        if k != "algorithm":
            out += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return out


def _run(cfg: dict[str, Any], out: Path, *extra: str) -> int:
    return main(["run", "--algorithm", str(cfg["algorithm"]), "--out", str(out), *_sets(cfg), *extra])


def _assert_same_run(a: Path, b: Path, ulps: int = 0) -> None:
    """results.json and model.npy of two out-dirs: same rounds, same privacy, same final model: bit for bit when both
    ran in this process (``ulps`` 0), floats within ``ulps`` ulps when one ran in other processes (tests/crossproc.py)."""
    ra, rb = json.loads((a / "results.json").read_text()), json.loads((b / "results.json").read_text())
    assert ra["status"] == rb["status"] == "completed"
    assert len(ra["rounds"]) == len(rb["rounds"])
    for x, y in zip(ra["rounds"], rb["rounds"], strict=True):
        assert_same_across_processes({k: x.get(k) for k in ROUND_KEYS}, {k: y.get(k) for k in ROUND_KEYS}, ulps=ulps,
                                     what=f"round {x.get('round')}")
        assert_same_across_processes({k: v for k, v in x.items() if k.startswith("privacy_")},
                                     {k: v for k, v in y.items() if k.startswith("privacy_")}, ulps=ulps,
                                     what=f"round {x.get('round')} privacy")
    for key in ("privacy", "privacy_by_accountant", "final_test_accuracy", "total_uplink_bytes", "total_downlink_bytes"):
        assert_same_across_processes(ra["summary"][key], rb["summary"][key], ulps=ulps, what=key)
    if ulps:
        assert_same_across_processes(np.load(a / "model.npy"), np.load(b / "model.npy"), ulps=ulps, what="model")
    else:
        np.testing.assert_array_equal(np.load(a / "model.npy"), np.load(b / "model.npy"))


def test_state_encoding_round_trips_bit_for_bit(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal(7)
    state = {"x": x, "ints": {3: [1, 2], 0: (4.5, None)}, "s": {1, 5}, "nan": float("nan"), "inf": -np.inf,
             "tiny": 5e-324, "f32": np.float32(0.1), "nested": [{"a": np.arange(3, dtype=np.int64)}]}
    arrays: dict[str, Any] = {}
    back = decode_state(json.loads(json.dumps(encode_state(state, arrays))), arrays)
    np.testing.assert_array_equal(back["x"], x)
    assert back["x"].tobytes() == x.tobytes()
    assert back["ints"] == {3: [1, 2], 0: (4.5, None)} and back["s"] == {1, 5}
    assert np.isnan(back["nan"]) and back["inf"] == -np.inf and back["tiny"] == 5e-324
    assert back["f32"] == float(np.float32(0.1))
    assert back["nested"][0]["a"].dtype == np.int64
    # written, read back, and a torn arrays file is refused
    write_checkpoint(tmp_path, 3, {"seed": 1}, state)
    doc, loaded = read_checkpoint(tmp_path)
    assert doc["round"] == 3 and loaded["x"].tobytes() == x.tobytes()
    npz = tmp_path / CHECKPOINT_DIR / doc["arrays"]
    blob = bytearray(npz.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    npz.write_bytes(bytes(blob))
    with pytest.raises(RuntimeError, match="SHA-256"):
        read_checkpoint(tmp_path)


def test_a_journal_is_appended_once_not_rewritten_every_round(tmp_path: Path) -> None:
    """The per-round history goes to a journal file, each entry written once: state.json stays the same size from
    round 2 to round 300 (it carried the whole history before, 1.3 MB by round 1,500 of a DP-IADMM run). Bytes a
    crash left past the committed length are not read and are cut off by the next write, also from a new process;
    a changed committed byte fails the SHA-256."""
    from fedpdm_flower.fedapp import checkpoint

    ckpt = tmp_path / CHECKPOINT_DIR
    history: list[dict[str, Any]] = []
    sizes = {}
    for rnd in range(1, 301):
        history.append({"round": rnd, "loss": 1.0 / rnd, "nan": float("nan"), "bytes": 1000 + rnd})
        write_checkpoint(tmp_path, rnd, {"seed": 1}, {"x": np.arange(3.0), "history": Journal(history)})
        sizes[rnd] = (ckpt / "state.json").stat().st_size
    assert abs(sizes[300] - sizes[2]) <= 8  # digits of the counts, not the history
    assert len((ckpt / "journal-0.jsonl").read_bytes().splitlines()) == 300
    doc, state = read_checkpoint(tmp_path)
    assert doc["round"] == 300 and len(state["history"]) == 300
    assert state["history"][-1]["loss"] == 1.0 / 300 and np.isnan(state["history"][7]["nan"])
    # a crash after an append, before its state.json: the extra bytes are not read ...
    with open(ckpt / "journal-0.jsonl", "ab") as fh:
        fh.write(b'{"round": 301, "lo')
    assert len(read_checkpoint(tmp_path)[1]["history"]) == 300
    # ... and a resumed run (a new process: nothing cached) writes on from the committed entries
    checkpoint._JOURNALS.clear()
    history = [*state["history"], {"round": 301, "loss": 0.5, "nan": 0.0, "bytes": 7}]
    write_checkpoint(tmp_path, 301, {"seed": 1}, {"x": np.arange(3.0), "history": Journal(history)})
    lines = (ckpt / "journal-0.jsonl").read_bytes().splitlines()
    assert len(lines) == 301 and json.loads(lines[-1])["round"] == 301
    assert [r["round"] for r in read_checkpoint(tmp_path)[1]["history"]] == list(range(1, 302))
    blob = bytearray((ckpt / "journal-0.jsonl").read_bytes())
    blob[10] ^= 0x01
    (ckpt / "journal-0.jsonl").write_bytes(bytes(blob))
    with pytest.raises(RuntimeError, match=r"journal .* SHA-256"):
        read_checkpoint(tmp_path)


@pytest.mark.parametrize(("algorithm", "extra"), [
    ("bsdp-fedpdm", {}),
    ("scaffold", {}),
    ("dp-iadmm", {"model": "multinomial-nobias", "clients-per-round": 6}),
])
def test_inprocess_resume_equals_uninterrupted(tmp_path: Path, algorithm: str, extra: dict[str, Any]) -> None:
    """In-process CLI: crash after round 2 of 5, resume in the same out-dir, compare with the uninterrupted run.

    bsdp-fedpdm: DP noise, rand-k, the clients' duals lambda_i and ledgers (persisted in client-state-dir);
    scaffold: the server's control variate c and each client's c_i; dp-iadmm: the server's z_p and lambda_p of
    every agent, the sample count I learnt before round 1, and the agents' own duals."""
    cfg = {**FEDPDM, "algorithm": algorithm, **extra, "client-state-dir": str(tmp_path / "devices")}
    assert _run(cfg, tmp_path / "whole") == 0
    assert _run({**cfg, "crash-after-round": 2}, tmp_path / "resumed") == EXIT_FAILED
    crashed = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert crashed["status"] == "failed" and len(crashed["rounds"]) == 2
    assert json.loads((tmp_path / "resumed" / CHECKPOINT_DIR / "state.json").read_text())["round"] == 2
    assert _run(cfg, tmp_path / "resumed", "--resume") == 0
    _assert_same_run(tmp_path / "whole", tmp_path / "resumed")


DPQ = {"plot": False, "algorithm": "dpq-dsgd", "dataset": "mnist", "model": "lenet5-valid", "num-clients": 5,
       "clients-per-round": 5, "dpq-horizon": 2000, "samples-per-client": 200, "dpq-eval-limit": 200, "eval-every": 2,
       "num-server-rounds": 4}


def test_inprocess_dpq_resume_equals_uninterrupted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DPQ-DSGD: the server routes the quantized noisy messages of round k into round k + 1 (the outbox, the
    publication counters, the bits), the nodes hold x_i. Resumed with the nodes' state: exact. Without it, the
    nodes refuse round 3 (no x_i to step from) and the run stops naming them."""
    cfg = {**DPQ, "client-state-dir": str(tmp_path / "devices")}
    assert _run(cfg, tmp_path / "whole") == 0
    assert _run({**cfg, "crash-after-round": 2}, tmp_path / "resumed") == EXIT_FAILED
    assert _run(cfg, tmp_path / "resumed", "--resume") == 0
    _assert_same_run(tmp_path / "whole", tmp_path / "resumed")
    assert _run({**DPQ, "crash-after-round": 2}, tmp_path / "lost") == EXIT_FAILED
    capsys.readouterr()
    assert _run(DPQ, tmp_path / "lost", "--resume") == EXIT_FAILED
    assert "has no DPQ state" in capsys.readouterr().err


def test_resume_without_client_state_restarts_the_duals(tmp_path: Path) -> None:
    """The same crash with no client state directory: the server resumes exactly, but FedPDM's clients start
    again from lambda_i = 0, so the run ends elsewhere (the equality above is not vacuous)."""
    assert _run(FEDPDM, tmp_path / "whole") == 0
    assert _run({**FEDPDM, "crash-after-round": 2}, tmp_path / "resumed") == EXIT_FAILED
    assert _run(FEDPDM, tmp_path / "resumed", "--resume") == 0
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    resumed = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert [r["test_accuracy"] for r in whole["rounds"][:2]] == [r["test_accuracy"] for r in resumed["rounds"][:2]]
    assert not np.array_equal(np.load(tmp_path / "whole" / "model.npy"), np.load(tmp_path / "resumed" / "model.npy"))


def test_resume_refuses_another_run_config_naming_the_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {**FEDPDM, "num-server-rounds": 2}
    assert _run({**cfg, "crash-after-round": 1}, tmp_path) == EXIT_FAILED
    capsys.readouterr()
    assert _run({**cfg, "eta0": 0.07, "seed": 3}, tmp_path, "--resume") == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "eta0: 0.05 -> 0.07" in err and "seed: 0 -> 3" in err and "another run config" in err
    assert _run(cfg, tmp_path / "nothing-here", "--resume") == EXIT_CONFIG
    assert "no checkpoint to resume from" in capsys.readouterr().err
    assert _run({**cfg, "algorithm": "flwr-fedavg"}, tmp_path / "flwr", "--resume") == EXIT_CONFIG
    assert "algorithm 'flwr-fedavg' cannot resume" in capsys.readouterr().err


@pytest.mark.flower
def test_flower_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """Through `flwr run` (the Flower simulation engine): a run whose ServerApp stopped after round 2 is resumed by
    `flwr run` with resume=true -- a new run, with fresh Contexts on every node -- which takes the server state from
    out-dir/checkpoint and the clients' duals and ledgers from client-state-dir, and ends as the uninterrupted run:
    same per-round figures, same privacy spent, same final model (within a few ulps: the resumed run computed in
    other processes, tests/crossproc.py).

    The stopped run and the uninterrupted one are the in-process driver's, which tests/test_flower.py pins to the
    Flower simulation: the ServerApp writes its checkpoint, and the devices their snapshots, with the same code in
    either driver (tests/test_resume_kill.py SIGKILLs a ServerApp process inside `flwr run` and resumes it). One
    `flwr run`, not two, on a shared machine."""
    from simulations.flower_driver import run_flower

    cfg = {**FEDPDM, "num-server-rounds": 4, "client-state-dir": str(tmp_path / "devices")}
    assert _run(cfg, tmp_path / "whole") == 0
    assert _run({**cfg, "crash-after-round": 2}, tmp_path / "resumed") == EXIT_FAILED
    assert json.loads((tmp_path / "resumed" / CHECKPOINT_DIR / "state.json").read_text())["round"] == 2
    resumed = run_flower({**cfg, "resume": True}, tmp_path / "resumed", num_supernodes=6, stream=False)
    assert resumed.status == "finished:completed"
    doc = json.loads(resumed.results.read_text())
    assert doc["engine"] == "flower-simulation" and len(doc["rounds"]) == 4
    _assert_same_run(tmp_path / "whole", tmp_path / "resumed", ulps=TRAJECTORY_ULPS)
    # the resumed run used the crashed run's token: one state directory for both, one for the in-process run
    assert len(list((tmp_path / "devices").glob("run-*"))) == 2


def test_server_accountants_survive_a_checkpoint() -> None:
    """Flower's per-client accountants on the server (set_accountant): rebuilt from the checkpoint by replaying the
    composed events, they report the same PrivacySpent and stop the run before the same release."""
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.exception import PrivacyBudgetExhausted

    from fedpdm_flower.fedapp.privacy.protocol import GdpAccountant, no_amplification
    from fedpdm_flower.strategies.fedpdm import DPFedPDM

    def strategy() -> DPFedPDM:
        s = DPFedPDM(min_available_nodes=3, accountant=lambda: GdpAccountant(no_amplification(1e-5, 3, max_epsilon=4.0)),
                     seed=7, privacy=None)
        s.initialize(ArrayRecord({"w": Array(np.zeros(5))}))
        return s

    before = strategy()
    for sigma in (1.0, 1.5, 0.9):  # client 0 releases three times, client 1 twice
        before.account_release(0, {"sigma": sigma, "sensitivity": 0.5}, 3)
    for sigma in (2.0, 2.5):
        before.account_release(1, {"sigma": sigma, "sensitivity": 0.5}, 3)
    arrays: dict[str, Any] = {}
    saved = decode_state(json.loads(json.dumps(encode_state(before.state_dict(), arrays))), arrays)
    after = strategy()
    after.load_state_dict(saved)
    assert after.privacy_spent() == before.privacy_spent()
    assert after.privacy_spent().num_releases == 3
    for s in (before, after):  # client 0's next release (forecast as its last, z = 1.8) would pass epsilon 4
        with pytest.raises(PrivacyBudgetExhausted, match="client 0"):
            s.check_privacy_budget(4, [0, 1])
        s.check_privacy_budget(4, [1])


def test_node_state_snapshots_roll_back_to_the_round_before(tmp_path: Path) -> None:
    """A node's snapshots: node config state-dir wins over the run config's client-state-dir; a fresh Context
    restores the latest snapshot of a round before the one asked for (the server's checkpoint may be one round
    behind the node), the two latest are kept, and another run token sees nothing."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

    from fedpdm_flower.fedapp.client_app import persist_state, restore_state, state_files

    token = "ab" * 16

    def message(rnd: int, tok: str = token) -> RecordDict:
        return RecordDict({"config": ConfigRecord({"run-token": tok, "server-round": rnd})})

    def context(**node: Any) -> Context:
        return Context(run_id=1, node_id=9, node_config={"partition-id": 2, **node}, state=RecordDict(),
                       run_config={"client-state-dir": str(tmp_path / "run-config")})

    dev = context(**{"state-dir": str(tmp_path / "device")})
    files = state_files(message(1), dev)
    assert files == (tmp_path / "device" / f"run-{token}" / "node-2", 1)
    assert state_files(message(1), context())[0].parent.parent == tmp_path / "run-config"
    assert state_files(RecordDict({"config": ConfigRecord({"server-round": 1})}), dev) is None  # no token
    assert state_files(message(1, "../../etc"), dev) is None  # the token names a directory: hex only
    folder = files[0]
    for rnd in (1, 3, 4):  # the node was sampled in rounds 1, 3 and 4
        dev.state["dual"] = ArrayRecord([np.full(3, float(rnd))])
        persist_state(dev, folder, rnd)
    assert sorted(p.name for p in folder.iterdir()) == ["round-000003.state", "round-000004.state"]

    def restored(rnd: int) -> float | None:
        fresh = context(**{"state-dir": str(tmp_path / "device")})
        restore_state(fresh, folder, rnd)
        rec = fresh.state.array_records.get("dual")
        return None if rec is None else float(rec.to_numpy_ndarrays()[0][0])

    assert restored(5) == 4.0  # checkpoint of round 4: resume at 5 from the node's round-4 state
    assert restored(4) == 3.0  # checkpoint of round 3, the node already did round 4: redo it from round 3's state
    assert restored(3) is None  # round 1's snapshot is gone (two kept): nothing older than 3 left
    other = context(**{"state-dir": str(tmp_path / "device")})
    other_files = state_files(message(5, "cd" * 16), other)
    assert other_files is not None
    restore_state(other, other_files[0], 5)
    assert len(other.state) == 0
