"""A run that fails says so (issue 11): one line naming the key or the cause, a non-zero exit, and nothing lost.

Three families of bad input, each a parametrized test through the CLI's in-process driver
(`python -m simulations run --engine in-process`, called as ``main([...])``):

* every reply rejected (these used to end "completed" with an untrained model): the run stops with exit 1, one
  error quoting the clients' errors, and results.json with status "failed" and the rounds that ran;
* bare tracebacks: one line naming the key, exit 2 before round 1 (or 1 when the cause shows only in round 1);
* output locations results could not be written to: exit 2 naming out-dir before any round ran.

The Flower engine is covered by the `flower`-marked test at the end.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpdm_flower.fedapp.config import parse_run_config
from fedpdm_flower.fedapp.runner import RunFailed, build_strategy, run_to_results
from simulations.__main__ import EXIT_CONFIG, EXIT_FAILED, main
from simulations.inprocess import make_contexts, run_rounds

PDM = {"plot": False, "algorithm": "bsdp-fedpdm", "dataset": "synthetic", "partitioner": "iid", "num-clients": 4,
       "clients-per-round": 4, "num-server-rounds": 2}
DPQ = {"plot": False, "algorithm": "dpq-dsgd", "model": "lenet5-valid", "num-clients": 4, "clients-per-round": 4,
       "num-server-rounds": 4, "samples-per-client": 100, "dpq-eval-limit": 100}
RECAL = {"plot": False, "algorithm": "dp-recal", "num-clients": 4, "clients-per-round": 4, "num-server-rounds": 6,
         "recal-samples": 400}


def _cli(config: dict[str, Any], out: Path | str, *extra: str) -> list[str]:
    args = ["run", "--engine", "in-process", "--algorithm", str(config["algorithm"]), "--out", str(out), *extra]
    for key, value in config.items():
        if key != "algorithm":
            args += ["--set", f"{key}={value}"]
    return args


def _run(config: dict[str, Any], out: Path | str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
         *extra: str) -> tuple[int, str, list[str]]:
    """Exit code, the last stderr line, and the round lines logged (progress of rounds that ran)."""
    with caplog.at_level(logging.INFO, logger="flwr"):
        code = main(_cli(config, out, *extra))
    err = capsys.readouterr().err.strip().splitlines()
    rounds = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[round ")]
    return code, err[-1] if err else "", rounds


# ---------------------------------------------------------------------------------------------- every reply rejected
REJECTED = {
    # (config, what the error must quote, rounds that ran before the failing one)
    "batch-size=1e9": ({**PDM, "batch-size": 1_000_000_000}, "q = steps*batch/n_local", 0),
    "eta0=1e6": ({**PDM, "eta0": 1e6}, "local training diverged", 0),
    # the client names the strategy's calibration argument (Eq36Calibration(clip_norm=...), run config clip-norm)
    "clip-norm=1e300": ({**PDM, "clip-norm": 1e300}, "clip_norm 1e+300", 0),
    "partitioner=paper, 4 clients of synthetic": ({**PDM, "partitioner": "paper"}, "paper split (one class per client)", 0),
    "dpq quant-only, dpq-q-step=1e-300": ({**DPQ, "dpq-variant": "quant-only", "dpq-q-step": 1e-300},
                                          "|v / q_step| must be < 2^63", 0),
    "dp-recal recal-sigma1=1e300": ({**RECAL, "recal-epsilon": 0.0, "recal-sigma1": 1e300},
                                    "overflowed float64 (local loss inf) with noise std sigma = 1e+300", 3),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_a_round_without_an_accepted_reply_stops_the_run_and_keeps_the_rounds_that_ran(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    config, quoted, ran = REJECTED[case]
    code, line, rounds = _run(config, tmp_path, capsys, caplog)
    assert code == EXIT_FAILED
    failed_round = ran + 1
    assert line.startswith(f"error: run failed: round {failed_round}: ")
    assert quoted in line
    if config["algorithm"] == "dp-recal":  # one retry, then the holder is named (spec 7.4)
        assert re.search(r"agent \d+ failed to relay the baton twice in a row: 2x ", line)
    else:
        n = config["num-clients"]
        assert f"no reply accepted ({n} of {n} rejected): {n}x \"" in line
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["status"] == "failed"
    assert line.startswith(f"error: run failed: {doc['error']}")
    assert [r["round"] for r in doc["rounds"]] == list(range(1, ran + 1))
    assert len(rounds) == ran  # what results.json holds is every round that ran
    assert (tmp_path / "model.npy").is_file()


@pytest.mark.parametrize("algorithm", ["bsdp-fedpdm", "flwr-fedavg"])
def test_through_flowers_message_api_the_client_error_reply_stops_the_run(
    algorithm: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No engine: our ClientApp called as Flower calls it, the replies handed to the strategy's aggregate_train.

    The ClientApp answers a failure with an error reply (it does not raise, so Flower logs no traceback per
    client), and both our strategies and Flower's built-in FedAvg stop the run on a round without an accepted reply.
    """
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.supercore.task_identity import TaskIdentity

    from fedpdm_flower.fedapp.client_app import app
    from fedpdm_flower.strategies.base import RoundFailed

    for attr in ("_run_id", "_node_id", "_task_id"):  # what the ServerApp runtime would set
        monkeypatch.setattr(TaskIdentity, attr, 0)

    class StubGrid:
        def get_node_ids(self) -> list[int]:
            return list(range(4))

    cfg = parse_run_config({**PDM, "algorithm": algorithm, "batch-size": 1_000_000_000})
    strategy = build_strategy(cfg, evaluate=False)
    contexts = make_contexts(cfg)
    if algorithm != "flwr-fedavg":  # Flower's FedAvg samples node ids itself
        strategy.attach({p: p for p in contexts})
    msgs = list(strategy.configure_train(1, ArrayRecord([strategy.x.astype(np.float32)]), ConfigRecord(),
                                         StubGrid()))  # type: ignore[arg-type]
    for m in msgs:
        m.metadata.__dict__["_message_id"] = f"m{m.metadata.dst_node_id}"  # what the Grid would assign on sending
    replies = [app(m, contexts[m.metadata.dst_node_id]) for m in msgs]
    assert replies and all(r.has_error() for r in replies)
    assert replies[0].error.reason.startswith("ValueError: q = steps*batch/n_local = ")
    with pytest.raises(RoundFailed) as info:
        strategy.aggregate_train(1, replies)
    n = len(msgs)
    assert str(info.value).startswith(f'round 1: no reply accepted ({n} of {n} rejected): {n}x "ValueError: q = ')


def test_fedrep_round_whose_proposals_are_all_rejected_stops_the_run() -> None:
    """The rule counts every phase: when no proposal is accepted FedREP stops before sending any train message."""
    from fedpdm_flower.strategies.base import RoundFailed

    cfg = parse_run_config({"algorithm": "fedrep", "dataset": "mnist", "partitioner": "iid", "model": "lenet5",
                            "num-clients": 2, "clients-per-round": 2, "num-server-rounds": 1, "buffer-size": 2,
                            "samples-per-client": 50})
    strategy = build_strategy(cfg, evaluate=False)
    strategy.attach({0: 0, 1: 1})
    strategy.begin_round(1)
    proposals = [(node, "RuntimeError: no key") for node, _, _ in strategy.pre_train_contents(1)]
    with pytest.raises(RoundFailed, match=r'^round 1: no proposal accepted \(2 of 2 rejected\): 2x "propose: '
                                          r'RuntimeError: no key"$'):
        strategy.consume_pre_train(1, proposals)


def test_quoting_groups_errors_that_differ_only_in_numbers() -> None:
    from fedpdm_flower.strategies.base import quote_errors

    errors = {f"ValueError: q = {s}*10/600 must lie in (0, 1)": 3 for s in range(1, 5)} | {"boom": 1, "bang": 1,
                                                                                             "crash": 1, "x": 1}
    text = quote_errors(errors)
    assert text.startswith('12x "ValueError: q = 4*10/600 must lie in (0, 1)" (4 variants differing in numbers); ')
    assert text.endswith("and 2 other distinct error(s) (2x)")


# ---------------------------------------------------------------------------------------------- bare tracebacks
TRACEBACKS = {
    # (config, the key(s) the line must name, exit code); before: a traceback (or a silent, useless run)
    "rho=1e-300": ({**PDM, "rho": 1e-300}, "run config key 'rho' (1e-300)", EXIT_CONFIG),
    "rho=1e-300 gamma=1e9 (overflow)": ({**PDM, "rho": 1e-300, "gamma": 1e9}, "run config key 'rho'", EXIT_CONFIG),
    "init-std=1e300": ({**PDM, "init-std": 1e300}, "run config key 'init-std' (1e+300)", EXIT_CONFIG),
    "dataset=synthetic model=lenet5": ({**PDM, "model": "lenet5"}, "run config key 'model' ('lenet5')", EXIT_CONFIG),
    "fedrep on synthetic": ({**PDM, "algorithm": "fedrep", "model": "lenet5"}, "run config key 'model'", EXIT_CONFIG),
    "dpq-sigma-exp=50": ({**DPQ, "dpq-sigma-exp": 50.0}, "'dpq-sigma-exp' (50)", EXIT_CONFIG),
    "dpq-q-step=1e-300": ({**DPQ, "dpq-q-step": 1e-300}, "'dpq-q-step' (1e-300)", EXIT_CONFIG),
    # known only once the agents have registered their L_i (round 1): a failed run with no round
    # the calibration needs L_max, known at registration (round 1); the strategy names its arguments, which the
    # run config sets from recal-epsilon and recal-r
    "dp-recal recal-r=50": ({**RECAL, "recal-r": 50.0, "num-server-rounds": 2000},
                            "epsilon = 10 and R = 50 cannot be met over xi_plan", EXIT_FAILED),
}


@pytest.mark.parametrize("case", list(TRACEBACKS))
def test_a_bad_value_ends_with_one_line_naming_the_key_and_no_traceback(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    config, named, expected_code = TRACEBACKS[case]
    with caplog.at_level(logging.INFO, logger="flwr"):
        code = main(_cli(config, tmp_path))
    captured = capsys.readouterr()
    err_lines = captured.err.strip().splitlines()
    assert code == expected_code
    assert err_lines[-1].startswith("error: ") and named in err_lines[-1]
    assert "Traceback" not in captured.err + captured.out
    assert not any(r.getMessage().startswith("[round ") for r in caplog.records)  # no round completed
    if expected_code == EXIT_CONFIG:  # rejected before round 1: nothing ran, nothing written
        assert not (tmp_path / "results.json").exists()
    else:  # stopped in round 1: results.json says so, with no round
        doc = json.loads((tmp_path / "results.json").read_text())
        assert doc["status"] == "failed" and doc["rounds"] == [] and named in doc["error"]


def test_debug_flag_prints_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_cli({**PDM, "model": "lenet5"}, tmp_path, "--debug")) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "run config key 'model'" in err.splitlines()[-1]


def test_values_that_are_usable_still_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          caplog: pytest.LogCaptureFixture) -> None:
    """The fixes must not reject legitimate values: a subnormal delta (its 1.25/delta overflowed) and a huge
    iadmm-epsilon (its advanced-composition bound overflowed) train to the end with finite privacy figures."""
    tiny_delta = {**PDM, "delta": 1e-320}
    code, _, rounds = _run(tiny_delta, tmp_path / "delta", capsys, caplog)
    doc = json.loads((tmp_path / "delta" / "results.json").read_text())
    assert code == 0 and doc["status"] == "completed" and len(rounds) == 2
    assert doc["final"]["clients"] == 4 and 0 < doc["final"]["epsilon"] < float("inf")
    objpm = {"algorithm": "objpm", "dataset": "mnist", "partitioner": "iid", "model": "multinomial-nobias",
             "num-clients": 2, "clients-per-round": 2, "num-server-rounds": 1, "samples-per-client": 200,
             "iadmm-epsilon": 1e300}
    code, _, _ = _run(objpm, tmp_path / "objpm", capsys, caplog)
    doc = json.loads((tmp_path / "objpm" / "results.json").read_text())
    assert code == 0 and doc["status"] == "completed" and doc["final"]["clients"] == 2
    assert "privacy_eps_advanced" not in doc["final"] and doc["final"]["privacy_eps_basic"] > 0  # vacuous bound left out


def test_any_error_after_rounds_ran_keeps_them(tmp_path: Path) -> None:
    """The safety net behind the named errors: an unexpected exception in round 2 still writes round 1."""
    cfg = parse_run_config(PDM)
    strategy = build_strategy(cfg)
    contexts = make_contexts(cfg)
    strategy.attach({p: p for p in contexts})

    def drive() -> None:
        run_rounds(strategy, contexts, 1)
        strategy.begin_round(2)
        raise ZeroDivisionError("an unforeseen bug")

    with pytest.raises(RunFailed) as info:
        run_to_results(cfg, strategy, "in-process", drive, out=tmp_path, t0=0.0)
    assert str(info.value) == "round 2: ZeroDivisionError: an unforeseen bug" and info.value.rounds == 1
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["status"] == "failed" and doc["error"] == str(info.value) and [r["round"] for r in doc["rounds"]] == [1]
    np.testing.assert_array_equal(np.load(tmp_path / "model.npy"), strategy.global_model())


# ---------------------------------------------------------------------------------------------- output location
def _inside_a_file(tmp: Path) -> Path:
    (tmp / "a-file").write_text("x")
    return tmp / "a-file" / "out"


def _results_json_is_a_directory(tmp: Path) -> Path:
    (tmp / "out" / "results.json").mkdir(parents=True)
    return tmp / "out"


def _read_only(tmp: Path) -> Path:
    """A directory this process may not write into: mode 0500, and for root (who ignores modes) immutable."""
    ro = tmp / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() == 0:
        chattr = shutil.which("chattr")
        if chattr is None or subprocess.run([chattr, "+i", str(ro)], capture_output=True).returncode != 0:
            pytest.skip("running as root without chattr +i: no directory is unwritable to test with")
    return ro / "out"


@pytest.fixture(autouse=True)
def _undo_immutable(tmp_path: Path) -> Any:
    yield
    if os.geteuid() == 0 and (tmp_path / "ro").exists() and (chattr := shutil.which("chattr")):
        subprocess.run([chattr, "-i", str(tmp_path / "ro")], capture_output=True)


LOCATIONS = {
    "inside a regular file": (_inside_a_file, "which is a file, not a directory"),
    "under /proc": (lambda tmp: Path("/proc/fedapp-out"), "inside /proc, a kernel pseudo-filesystem"),
    "under /sys": (lambda tmp: Path("/sys/fedapp-out"), "inside /sys, a kernel pseudo-filesystem"),
    "results.json is a directory": (_results_json_is_a_directory, "results.json there exists and is not a regular file"),
    "no permission": (_read_only, "cannot be written ("),  # Permission denied, or Operation not permitted as root
}


@pytest.mark.parametrize("case", list(LOCATIONS))
def test_an_unwritable_out_dir_stops_the_run_before_round_one(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    make, why = LOCATIONS[case]
    out = make(tmp_path)
    code, line, rounds = _run(PDM, out, capsys, caplog)
    assert code == EXIT_CONFIG
    assert line.startswith(f"error: run config key 'out-dir' is '{out}'") and why in line
    assert rounds == []  # checked before any work: nothing ran, so nothing is lost
    assert not (out / "results.json").is_file()


def test_empty_out_dir_defaults_to_outputs_under_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """--out '' used to write results.json straight into the current directory."""
    monkeypatch.chdir(tmp_path)
    assert main(_cli({**PDM, "num-server-rounds": 1, "plot": True}, "")) == 0
    (made,) = (tmp_path / "outputs").iterdir()
    assert re.fullmatch(r"bsdp-fedpdm-synthetic-\d{8}-\d{6}", made.name)
    # the absolute paths are printed, the plot's too
    assert f"results: {made / 'results.json'} (plot: {made / 'accuracy.png'})" in capsys.readouterr().out
    assert (made / "accuracy.png").stat().st_size > 1000
    assert json.loads((made / "results.json").read_text())["config"]["out-dir"] == str(made)
    assert not (tmp_path / "results.json").exists()


def test_plot_false_writes_the_results_without_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_cli({**PDM, "num-server-rounds": 1, "plot": False}, tmp_path)) == 0
    assert json.loads((tmp_path / "results.json").read_text())["status"] == "completed"
    assert (tmp_path / "model.npy").exists() and not (tmp_path / "accuracy.png").exists()
    printed = capsys.readouterr().out
    assert f"results: {tmp_path / 'results.json'}\n" in printed and "plot:" not in printed


def test_results_that_cannot_be_written_at_the_end_go_to_a_temporary_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest,
) -> None:
    """The location was fine before round 1 but is gone at the end (here: replaced by a file during the run)."""
    cfg = parse_run_config(PDM)
    strategy = build_strategy(cfg)
    contexts = make_contexts(cfg)
    strategy.attach({p: p for p in contexts})
    out = tmp_path / "out"
    out.mkdir()

    def drive() -> None:
        run_rounds(strategy, contexts, cfg.num_server_rounds)
        out.rmdir()
        out.write_text("not a directory any more")

    with caplog.at_level(logging.WARNING, logger="flwr"):
        doc, path = run_to_results(cfg, strategy, "in-process", drive, out=out, t0=0.0)
    request.addfinalizer(lambda: shutil.rmtree(path.parent, ignore_errors=True))
    assert path.parent != out and path.is_file() and path.parent.name.startswith("fedapp-results-")
    assert any(f"could not write the results to {out}" in r.getMessage() and str(path.parent) in r.getMessage()
               for r in caplog.records)
    saved = json.loads(path.read_text())
    assert saved == doc and saved["status"] == "completed" and len(saved["rounds"]) == 2
    assert saved["config"]["out-dir"] == str(path.parent)
    np.testing.assert_array_equal(np.load(path.parent / "model.npy"), strategy.global_model())


# ---------------------------------------------------------------------------------------------- through Flower
@pytest.mark.flower
def test_flower_run_with_every_reply_rejected_ends_failed_with_results_written(tmp_path: Path) -> None:
    from simulations.flower_driver import FlowerRunError, run_flower

    with pytest.raises(FlowerRunError) as info:
        run_flower({**PDM, "batch-size": 1_000_000_000}, tmp_path, num_supernodes=4, stream=False)
    run = info.value.run
    assert run is not None and run.status == "finished:failed"
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["status"] == "failed" and doc["rounds"] == [] and doc["engine"] == "flower-simulation"
    assert doc["error"].startswith('round 1: no reply accepted (4 of 4 rejected): 4x "ValueError: q = steps*batch/n_local')
    assert f"run failed: {doc['error']}" in run.log  # the ServerApp's one ERROR line
