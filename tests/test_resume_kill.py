"""Runs that survive their ServerApp (issue 25): the ServerApp's process is SIGKILLed mid-run, the app is run again
(a new Flower run, fresh Contexts on every node), and the finished run is compared with an uninterrupted one.

The app is a user's own (tests/resumeapp: a torch MLP, synthetic data, Flower's ``@app.main()``) with its strategy in
:class:`fedpdm_flower.strategies.checkpointed.Checkpointed` and :func:`fedpdm_flower.clients.state.persistent_state_mod`
first among its ClientApp's mods. Three strategies, in Flower's simulation engine:

* Flower's ``FedAvg`` -- deterministic given the seeds: the final model equals the uninterrupted run's within 1e-6
  (relative L2). The kill lands mid-round: the devices have answered round 2, the server has neither aggregated
  nor checkpointed it; the resumed run does round 2 again from round 1's checkpoint.
* ``SecureBuffers(Robust(FedAvg))`` -- not deterministic: the masked uploads are rounded stochastically from the
  devices' OS randomness, and the buffers are drawn over the order of Flower's FedAvg sample (Python's unseeded
  ``random``), so which nodes share a buffer -- and, with unequal weights, the buffer means the geometric median
  sees -- differs from run to run. The same rounds, every buffer unmasked, the model within 1e-2 and every
  round's accuracy within 0.02 of the uninterrupted run's (6 nodes in two buffers of 3: a device refuses a buffer
  below 3). Measured: three uninterrupted in-process runs 1.4e-4 to 1.7e-4 apart, a run killed and resumed in
  process 2.1e-4 from an uninterrupted one (the resume adds nothing measurable), the resumed `flwr run` 1.9e-3 and
  2.0e-3 from the in-process truth (Flower's node ids and reply order change the buffers; accuracy 0.508 vs 0.507).
* ``BSDPFedPDM`` with each device's Gaussian noise (GDP target epsilon 30 over the run) -- deterministic given the
  seeds: model within 1e-6, and the same privacy figures (every client's ledger, the server's accountants, every
  round's epsilon), which needs the devices' duals and ledgers carried over.

The moment of each kill is picked by the app's testing-only ``pause-at-round`` / ``pause-when``: the ServerApp
writes its pid and waits there, and the test SIGKILLs it (a kill at an unplanned moment raced the run to its end on
a machine at load 30: the tiny rounds finished before the kill landed). For the last two the ServerApp waits
before sending round 2 -- after round 1's checkpoint, before any device saw round 2 -- so that the comparison can
ask for the same privacy figures (a device that already released in round 2 keeps that release in its ledger when
the round is done again: tests/test_checkpointed.py). The truth is the same app run in this process, uninterrupted
(simulations.inprocess.LocalGrid: the same ServerApp code, ClientApp and mods, no Ray), so each test needs two
`flwr run`s, not three.

Each simulation test is as short as its point allows -- 3 rounds (one before the kill, the killed one done again,
one more after it), 4 nodes (6 under SecureBuffers) of 100 examples -- and carries the ``slow`` marker
(``make test-deploy``): most of its time is the two `flwr run`s' start-up, not the rounds.

The ``deployment`` tests do the same on real loopback processes (TLS + SuperNode authentication): BSDP-FedPDM with
the devices' snapshot directories in their node config; and a SuperNode SIGKILLed and restarted at once under a
retry loop (systemd's ``Restart=on-failure``), which the SuperLink refuses until it has missed two heartbeats, and
which then rejoins under its registered node id while the run goes on.
"""

from __future__ import annotations

import json
import os
import signal
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simulations.flower_driver import CONNECTION_VAR, FlowerRun, flwr_env, run_flower, run_status, submit_run

APP = Path(__file__).resolve().parent / "resumeapp"
BASE: dict[str, Any] = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def provision(keys: Path, nodes: int) -> Path:
    """Every node's long-term identity and the trust store they share (the operator's job)."""
    from fedpdm_flower.fedapp.secagg import NodeIdentity, TrustStore

    keys.mkdir(parents=True, exist_ok=True)
    public = {}
    for i in range(nodes):
        ident = NodeIdentity.generate()
        ident.save(keys / f"node-{i}.pem")
        public[i] = ident.public_bytes()
    TrustStore(public).save(keys / "trust.json")
    return keys


def reference(rc: dict[str, Any], nodes: int, tmp: Path) -> dict[str, Any]:
    """The uninterrupted run, in this process: the app's ServerApp code over a LocalGrid of its ClientApp."""
    import sys

    sys.path.insert(0, str(APP))
    try:
        from resumeapp.client_app import app
        from resumeapp.server_app import run

        from simulations.inprocess import LocalGrid

        local = {**rc, "checkpoint-dir": str(tmp / "ref-ckpt"), "state-dir": str(tmp / "ref-devices"),
                 "pid-file": "", "pause-at-round": 0, "pause-file": "", "result-path": ""}
        return run(LocalGrid(app, nodes, run_config=local), local)
    finally:
        sys.path.remove(str(APP))


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait_for(what: str, check: Any, timeout: float, poll: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def checkpoint_round(directory: Path) -> int:
    try:
        return int(json.loads((directory / "state.json").read_text())["round"])
    except (OSError, ValueError, KeyError):
        return 0


def kill_and_resume(rc: dict[str, Any], tmp: Path, *, nodes: int, pause_at: int, when: str = "before",
                    connection: str | None = None, env: dict[str, str] | None = None, simulation: bool = True,
                    timeout: float = 900) -> dict[str, Any]:
    """Submit the app, SIGKILL its ServerApp process where it waits (round ``pause_at``, ``when`` "before" or
    "after-replies"), run it again with the same run config; returns what happened and the resumed run's output."""
    if connection is None:
        connection = os.environ[CONNECTION_VAR]  # the test session's simulation SuperLink (tests/conftest.py)
    env = env or flwr_env()
    pid_file, pause_file, result = tmp / "server.pid", tmp / "paused", tmp / "result.json"
    killed = {**rc, "pid-file": str(pid_file), "pause-at-round": pause_at, "pause-when": when,
              "pause-file": str(pause_file), "result-path": str(result)}
    t0 = time.monotonic()
    run_id = submit_run(killed, num_supernodes=nodes, connection=connection, env=env, simulation=simulation, app=APP)
    ckpt = Path(rc["checkpoint-dir"])
    checked = [time.monotonic()]

    def alive() -> bool:  # the killed run must not end before it is killed: say why if it did (every 10 s)
        if time.monotonic() - checked[0] < 10:
            return True
        checked[0] = time.monotonic()
        status = run_status(run_id, connection=connection, env=env)
        if str(status["status"]).startswith("finished"):
            import subprocess

            log = subprocess.run(["flwr", "log", str(run_id), str(connection)], env=env, capture_output=True,
                                 text=True, timeout=60, check=False)
            raise AssertionError(f"run {run_id} ended before the kill: {status['status']} "
                                 f"{status.get('status-details')}\n{log.stdout[-3000:]}")
        return True

    _wait_for("the ServerApp to pause", lambda: pause_file.exists() or (alive() and False), timeout, poll=0.2)
    pid = int(pause_file.read_text().split()[0])
    assert pid == int(pid_file.read_text().split()[0])  # the process the ServerApp runs in
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic() - t0
    _wait_for(f"ServerApp process {pid} to die", lambda: not _alive(pid), 30)
    at_kill = checkpoint_round(ckpt)
    assert not result.exists(), "the killed run finished before it was killed"
    t1 = time.monotonic()
    resumed: FlowerRun = run_flower({**rc, "result-path": str(result)}, tmp, num_supernodes=nodes,
                                    connection=connection, env=env, simulation=simulation, app=APP,
                                    results_name="result.json", stream=False, timeout=timeout)
    return {"run_id": run_id, "killed_at_s": killed_at, "checkpoint_at_kill": at_kill, "resumed": resumed,
            "resume_s": time.monotonic() - t1, "out": json.loads(result.read_text()),
            "killed_status": run_status(run_id, connection=connection, env=env)["status"]}


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{"a/b": leaf}`` (pytest.approx compares flat mappings only)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(flat(v, f"{prefix}/{k}"))
    return out


def model(out: dict[str, Any]) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in out["model"].values()])


def rel_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    x, y = model(a), model(b)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def accuracy(out: dict[str, Any]) -> dict[str, float]:
    return {r: float(m.get("accuracy", m.get("test_accuracy", float("nan")))) for r, m in out["server"].items()}


def _check_resumed(got: dict[str, Any], rounds: int, resumed_from: int) -> dict[str, Any]:
    out, log = got["out"], f"the resumed run's log:\n{got['resumed'].log[-6000:]}"
    assert got["resumed"].status == "finished:completed", log
    assert got["killed_status"] != "finished:completed"  # the killed run never completed (running, then failed)
    assert got["checkpoint_at_kill"] == resumed_from and out["resumed_from"] == resumed_from
    assert sorted(int(r) for r in out["server"]) == list(range(rounds + 1))  # round 0's evaluation is the saved one
    assert sorted(int(r) for r in out["train"]) == list(range(1, rounds + 1)), log
    return dict(out)


#: the simulation tests' run: 3 rounds of 4 nodes with 100 examples each (the kill comes at round 2)
SIM: dict[str, Any] = {**BASE, "min-nodes": 4, "num-server-rounds": 3, "samples-per-node": 100}


def learns(out: dict[str, Any], rounds: int) -> bool:
    """The run learnt: the final accuracy is well above round 0's (chance is 0.25)."""
    acc = accuracy(out)
    return acc[str(rounds)] > acc["0"] + 0.1


@pytest.mark.slow
@pytest.mark.flower
def test_flower_fedavg_killed_mid_round_resumes_to_the_same_model(tmp_path: Path) -> None:
    rc = {**SIM, "mode": "fedavg", "checkpoint-dir": str(tmp_path / "ckpt"), "state-dir": str(tmp_path / "devices")}
    got = kill_and_resume(rc, tmp_path, nodes=4, pause_at=2, when="after-replies")
    out = _check_resumed(got, 3, 1)  # round 2 was answered, never checkpointed: done again
    truth = reference(rc, 4, tmp_path)
    assert rel_diff(out, truth) < 1e-6
    assert accuracy(out) == pytest.approx(accuracy(truth), abs=1e-6)
    assert learns(out, 3)
    print(f"fedavg: killed {got['killed_at_s']:.1f} s after submission (round 2 answered, not aggregated), resumed run "
          f"{got['resume_s']:.1f} s; relative model difference {rel_diff(out, truth):.2e}; accuracy {accuracy(out)}")


@pytest.mark.slow
@pytest.mark.flower
def test_flower_secure_robust_killed_resumes_within_tolerance(tmp_path: Path) -> None:
    nodes = 6  # two buffers of 3: secure_buffers_mod refuses a buffer below 3 (the device's own floor)
    rc = {**SIM, "mode": "secure-robust", "min-nodes": nodes, "buffer-size": 3, "keys-dir": str(provision(tmp_path / "keys", nodes)),
          "checkpoint-dir": str(tmp_path / "ckpt"), "state-dir": str(tmp_path / "devices")}
    got = kill_and_resume(rc, tmp_path, nodes=nodes, pause_at=2)
    out = _check_resumed(got, 3, 1)
    truth = reference(rc, nodes, tmp_path)
    # two buffers of 3 every round, both unmasked: the resumed run's first round asked every node for a new key
    assert all(m["secure.buffers"] == 2.0 and m["secure.buffers_discarded"] == 0.0 for m in out["diagnostics"].values())
    assert sorted(int(r) for r in out["diagnostics"]) == [1, 2, 3]  # round 1's from the checkpoint
    assert rel_diff(out, truth) < 1e-2  # the buffers' members are drawn afresh (module docstring)
    assert accuracy(out) == pytest.approx(accuracy(truth), abs=0.02)
    assert learns(out, 3)
    # the devices' secure state went through the snapshots, under the killed run's token: each node's two latest
    # snapshots are of the resumed rounds
    for node in range(nodes):
        snaps = sorted((tmp_path / "devices").glob(f"run-{out['token']}/node-{node}/round-*.state"))
        assert [p.name for p in snaps] == ["round-000002.state", "round-000003.state"]
    print(f"secure-robust: killed while paused before round 2 ({got['killed_at_s']:.1f} s), resumed run "
          f"{got['resume_s']:.1f} s; relative model difference {rel_diff(out, truth):.2e}, accuracy "
          f"{accuracy(out)['3']:.4f} vs {accuracy(truth)['3']:.4f}")


@pytest.mark.slow
@pytest.mark.flower
def test_flower_bsdp_fedpdm_killed_resumes_with_duals_and_ledgers(tmp_path: Path) -> None:
    rc = {**SIM, "mode": "fedpdm", "epsilon": 30.0, "checkpoint-dir": str(tmp_path / "ckpt"),
          "state-dir": str(tmp_path / "devices")}
    got = kill_and_resume(rc, tmp_path, nodes=4, pause_at=2)
    out = _check_resumed(got, 3, 1)
    truth = reference(rc, 4, tmp_path)
    assert rel_diff(out, truth) < 1e-6
    assert accuracy(out) == pytest.approx(accuracy(truth), abs=1e-6)
    # the same privacy figures: every device's ledger (GDP, RDP, basic composition, participations), the server's
    # per-client accountants, every round's epsilon
    assert flat(out["privacy"]["clients"]) == pytest.approx(flat(truth["privacy"]["clients"]), rel=1e-9)
    assert out["privacy"]["spent"] == pytest.approx(truth["privacy"]["spent"], rel=1e-9)
    assert out["privacy"]["history_eps"] == pytest.approx(truth["privacy"]["history_eps"], rel=1e-9)
    # every device released in round 1 (before the kill) and some in both resumed rounds: ledgers carried over
    assert max(p["participations"] for p in out["privacy"]["clients"].values()) == 3
    print(f"bsdp-fedpdm: killed while paused before round 2 ({got['killed_at_s']:.1f} s), resumed run "
          f"{got['resume_s']:.1f} s; relative model difference {rel_diff(out, truth):.2e}; privacy spent "
          f"{out['privacy']['spent']}")


# ---------------------------------------------------------------------------------------------- real deployments
@pytest.mark.deployment
def test_deployment_bsdp_fedpdm_killed_server_resumes_with_the_devices_state(tmp_path: Path) -> None:
    """The same kill on real loopback processes (TLS + SuperNode authentication): the `flwr-serverapp` process is
    SIGKILLed while it waits before round 2, the app is submitted again, and every SuperNode -- still the same
    process, a new run for it -- restores its duals and ledger from the snapshot directory its own node config
    names. The finished run equals the uninterrupted one (model within 1e-6, the same privacy figures).

    The simulation tests' 3 rounds of 100 examples a node (SIM): one round before the kill, two after it. Every
    message of a deployment starts a `flwr-clientapp` process (Flower's subprocess isolation; importing flwr alone
    is 2.3 s of CPU), so the devices train and do not evaluate (``client-eval = false``: 12 processes fewer; the
    comparison is of the model and the privacy figures, and the central evaluation runs on the server); a 4th round
    added nothing the 3 do not show."""
    from simulations.deploy import local_deployment

    nodes = 4
    rc = {**SIM, "mode": "fedpdm", "min-nodes": nodes, "epsilon": 30.0, "checkpoint-dir": str(tmp_path / "ckpt"),
          "state-dir": "", "client-eval": False}
    t0 = time.monotonic()
    with local_deployment(nodes, flwr_home=tmp_path / "flwr-home", startup_timeout=120,
                          node_config=lambda i: {"state-dir": str(tmp_path / "devices" / f"node-{i}")}) as dep:
        got = kill_and_resume(rc, tmp_path, nodes=nodes, pause_at=2, connection=dep.connection, env=dep.env,
                              simulation=False, timeout=900)
    wall = time.monotonic() - t0
    out = _check_resumed(got, 3, 1)
    assert got["resumed"].details.get("network-traffic", {}).get("total-bytes", 0) > 0  # a real deployment
    for i in range(nodes):  # each device kept its own snapshots, under the run's one token
        assert list((tmp_path / "devices" / f"node-{i}").glob(f"run-{out['token']}/node-{i}/round-*.state"))
    truth = reference(rc, nodes, tmp_path)
    assert rel_diff(out, truth) < 1e-6
    assert flat(out["privacy"]["clients"]) == pytest.approx(flat(truth["privacy"]["clients"]), rel=1e-9)
    assert out["privacy"]["spent"] == pytest.approx(truth["privacy"]["spent"], rel=1e-9)
    print(f"deployment bsdp-fedpdm: killed {got['killed_at_s']:.0f} s after submission, resumed run "
          f"{got['resume_s']:.0f} s, {wall:.0f} s in all; relative model difference {rel_diff(out, truth):.2e}")


@pytest.mark.deployment
def test_a_secure_node_killed_and_restarted_under_a_supervisor_rejoins(tmp_path: Path) -> None:
    """TLS + SuperNode authentication, 3 nodes, Flower's FedAvg (Checkpointed). SuperNode 1 is SIGKILLed when round 2
    starts and its retry loop (systemd's Restart=on-failure, RestartSec=5) starts 1 s later. The SuperLink refuses
    it (exit code 305, ApiError 2004: its registered id is still online) until it has missed two heartbeats; then
    the node is let in under its registered node id. Round 2 goes on with the two others once the SuperLink answers
    for the dead node ("Node Unavailable"); FedAvg's next round waits for three nodes and gets the rejoined one."""
    from simulations.deploy import local_deployment
    from simulations.faults import FaultPlan, NodeAtRound, run_with_faults, supervisor_attempts

    rc = {**BASE, "mode": "fedavg", "min-nodes": 3, "num-server-rounds": 4, "checkpoint-dir": str(tmp_path / "ckpt"),
          "state-dir": "", "result-path": str(tmp_path / "result.json")}
    plan = FaultPlan(kill=NodeAtRound(1, 2), restart_after=1.0, signal=signal.SIGKILL, supervise=5.0)
    t0 = time.monotonic()
    with local_deployment(3, flwr_home=tmp_path / "flwr-home", startup_timeout=120) as dep:
        fr = run_with_faults(dep, rc, tmp_path, plan, timeout=900, app=APP, results_name="result.json")
        registered = dep.node_ids[1]
        log = dep.log_dir / "supernode-1.restart1.log"
        attempts = supervisor_attempts(log)
        text = log.read_text(errors="replace")
    wall = time.monotonic() - t0
    assert fr.error is None, f"{fr.error}\n{fr.server_log[-3000:]}"
    kill, restart = fr.events
    assert (kill.action, kill.node, kill.round, restart.action) == ("kill", 1, 2, "restart")
    refused = [a for a in attempts if a["rc"] is not None]
    let_in = [a for a in attempts if a["rc"] is None]
    assert refused and all(a["rc"] != 0 for a in refused)  # refused while its old self was still "online"
    assert len(let_in) == 1 and let_in[0]["attempt"] == len(attempts)  # the last attempt stayed up
    assert text.count("[code: 2004] Failed to activate SuperNode.") == len(refused)
    assert f"SuperNode ID: {registered}" in text  # let in under its registered id
    assert text.count("Sending: ") >= 1  # and it answered the rounds after it rejoined
    out = json.loads((tmp_path / "result.json").read_text())
    assert sorted(int(r) for r in out["server"]) == [0, 1, 2, 3, 4]
    rejoin_s = let_in[0]["started"] - kill.wall
    assert 0 < rejoin_s < 2 * 30 + 2 * plan.supervise + 30  # two heartbeat intervals, the retry delay, start-up
    print(f"secure restart: killed at round 2, {len(refused)} attempt(s) refused (ApiError 2004), let in at attempt "
          f"{let_in[0]['attempt']} started {rejoin_s:.1f} s after the kill; run completed, {wall:.0f} s in all")
