"""A SuperNode that dies mid-run, and one that comes back (docs/deployment.md, "Faults").

Two parts:

* the strategy layer without an engine, driven as Flower drives it (``configure_train`` -> replies ->
  ``aggregate_train``) with a stub Grid, our real ClientApp answering, and the SuperLink's own error reply for a
  dead node (flwr's ``create_message_error_unavailable_res_message``): the dead node is named, and a node that
  comes back under a new node id with the same partition-id gets its client back;
* real loopback deployments (``deployment`` marker; :mod:`simulations.faults` kills a SuperNode process tree when
  the ServerApp starts a given round): what each algorithm really does when one node dies.
"""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from test_deployment_secure import plain_http_reply

from fedpdm_flower.fedapp.config import parse_run_config
from fedpdm_flower.fedapp.runner import build_strategy
from simulations.faults import FaultPlan, NodeAtRound, parse_node_at_round

PDM = {"algorithm": "bsdp-fedpdm", "dataset": "synthetic", "partitioner": "iid", "num-clients": 3,
       "clients-per-round": 3, "num-server-rounds": 3, "seed": 0}
NODES = {0: 1000, 1: 1001, 2: 1002}  # client (partition) id -> node id: distinct, so a message can confuse them


def _contexts(cfg: Any, node_of: dict[int, int]) -> dict[int, Context]:
    """One Context per node id (node config = its partition), as a SuperNode would hold it."""
    rc = cfg.to_run_config()
    return {nid: Context(run_id=0, node_id=nid, node_config={"partition-id": pid, "num-partitions": cfg.num_clients},
                         state=RecordDict(), run_config=dict(rc)) for pid, nid in node_of.items()}


class StubGrid:
    """What the strategy asks of Flower's Grid: online node ids, and whoami exchanges answered by our ClientApp."""

    def __init__(self, online: Iterable[int], contexts: dict[int, Context]) -> None:
        self.online = list(online)
        self.contexts = contexts
        self.asked: list[int] = []

    def get_node_ids(self) -> list[int]:
        return list(self.online)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        from fedpdm_flower.fedapp.client_app import app

        out = []
        for i, m in enumerate(messages):
            m.metadata.__dict__["_message_id"] = f"q{i}-{m.metadata.dst_node_id}"
            self.asked.append(m.metadata.dst_node_id)
            out.append(app(m, self.contexts[m.metadata.dst_node_id]))
        return out


@pytest.fixture()
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):  # what the ServerApp runtime would set
        monkeypatch.setattr(TaskIdentity, attr, 0)


def _train_round(strategy: Any, rnd: int, grid: StubGrid, contexts: dict[int, Context],
                 dead: Iterable[int] = ()) -> tuple[list[Message], list[Message]]:
    """configure_train -> the Grid's ids -> replies (the SuperLink's "Node Unavailable" for dead nodes)."""
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    from fedpdm_flower.fedapp.client_app import app

    msgs = list(strategy.configure_train(rnd, strategy.current_arrays(), ConfigRecord(), grid))
    for m in msgs:
        m.metadata.__dict__["_message_id"] = f"t{rnd}-{m.metadata.dst_node_id}"  # what the Grid sets on sending
    replies = [create_message_error_unavailable_res_message(m.metadata, "node_unavail")
               if m.metadata.dst_node_id in set(dead) else app(m, contexts[m.metadata.dst_node_id]) for m in msgs]
    return msgs, replies


def test_the_superlinks_node_unavailable_reply_is_charged_to_the_dead_node(
    task_identity: None, caplog: pytest.LogCaptureFixture,
) -> None:
    """The SuperLink answers a message to a dead node itself, from its own node id: the rejection must name the node
    that was asked (1001) and its client (1), and FedPDM's round goes on with the two replies it got."""
    cfg = parse_run_config({**PDM, "num-server-rounds": 4})
    strategy = build_strategy(cfg, evaluate=False)
    strategy.attach(NODES)
    strategy.prepare(4)
    contexts = _contexts(cfg, NODES)
    grid = StubGrid(NODES.values(), contexts)
    _, replies = _train_round(strategy, 1, grid, contexts, dead=[1001])
    unavailable = [r for r in replies if r.has_error()]
    # the SuperLink's own reply, as flwr 1.42 sends it: from the SuperLink's node id, not from the dead node
    assert [r.metadata.src_node_id for r in unavailable] == [SUPERLINK_NODE_ID]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.aggregate_train(1, replies)
    metrics = strategy.round_metrics()
    assert metrics["clients"] == 2.0 and metrics["rejected"] == 1.0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "round 1: rejected reply from node 1001 (client 1): Error: Node Unavailable" in text
    assert f"from node {SUPERLINK_NODE_ID}:" not in text


def test_a_node_that_comes_back_under_a_new_id_gets_its_client_back(
    task_identity: None, caplog: pytest.LogCaptureFixture,
) -> None:
    """Node 1001 (client 1) dies; node 2001 connects with partition-id 1 and empty state. From the next round the
    server sends client 1's messages to 2001 and its reply counts again; a stranger claiming a partition whose node
    is still online (2002 -> partition 0) is ignored. FedPDM's dual lambda_1 restarts at 0 on the new node."""
    cfg = parse_run_config({**PDM, "num-server-rounds": 4})
    strategy = build_strategy(cfg, evaluate=False)
    strategy.attach(NODES)
    strategy.prepare(4)
    contexts = _contexts(cfg, NODES)
    grid = StubGrid(NODES.values(), contexts)
    for rnd in (1, 2):
        _, replies = _train_round(strategy, rnd, grid, contexts, dead=[1001] if rnd == 2 else [])
        strategy.aggregate_train(rnd, replies)
        metrics = strategy.round_metrics()
        assert metrics["clients"] == (3.0 if rnd == 1 else 2.0)
        strategy.evaluate_round(rnd)
    assert "fedpdm.dual" in contexts[1001].state.array_records  # lambda_1 after round 1
    newcomers = _contexts(cfg, {1: 2001, 0: 2002})
    contexts.update(newcomers)
    grid.online = [1000, 1002, 2001, 2002]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        msgs, replies = _train_round(strategy, 3, grid, contexts)
    assert sorted(grid.asked) == [2001, 2002]  # whoami to the unknown nodes only
    assert strategy.node_of == {0: 1000, 1: 2001, 2: 1002}
    assert sorted(m.metadata.dst_node_id for m in msgs) == [1000, 1002, 2001]
    assert "client 1 rejoined as node 2001 (its node 1001 went offline)" in "\n".join(
        r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.aggregate_train(3, replies)
    metrics = strategy.round_metrics()
    assert metrics["clients"] == 3.0 and metrics["rejected"] == 0.0
    assert "fedpdm.dual" in contexts[2001].state.array_records
    # the new node's ledger starts empty: 1 participation again, which the server flags
    assert strategy.client_privacy[1]["participations"] == 1.0 and strategy.client_privacy[0]["participations"] == 3.0
    assert "client 1 reports 1 participation(s) after 1: its privacy ledger restarted" in caplog.text
    # nothing is asked twice: a round later the stranger 2002 is not queried again
    grid.asked.clear()
    _train_round(strategy, 4, grid, contexts)
    assert grid.asked == []


def test_a_restarted_fedrep_client_gets_the_dense_model_again(task_identity: None) -> None:
    """FedREP sends a client in sync only the last sparse aggregate; a readmitted client holds no model, so it must
    be out of sync."""
    cfg = parse_run_config({"algorithm": "fedrep", "dataset": "mnist", "partitioner": "iid", "model": "lenet5",
                            "num-clients": 2, "clients-per-round": 2, "num-server-rounds": 1, "buffer-size": 2,
                            "samples-per-client": 50})
    strategy = build_strategy(cfg, evaluate=False)
    strategy.attach({0: 1000, 1: 1001})
    strategy.synced = {0, 1}
    strategy.on_readmit(1, 1001, 2001)
    assert strategy.synced == {0}


IADMM = {"algorithm": "objp", "dataset": "synthetic", "partitioner": "iid", "num-clients": 3, "clients-per-round": 3,
         "model": "multinomial-nobias", "num-server-rounds": 5, "iadmm-epsilon": 1.0, "seed": 0}
RECAL = {"algorithm": "dp-recal", "num-clients": 4, "clients-per-round": 4, "num-server-rounds": 6,
         "recal-samples": 400, "seed": 0}


def test_iadmm_stops_naming_the_dead_agent_and_a_restarted_agent_cannot_resume(task_identity: None) -> None:
    """ObjP keeps each agent's dual on the agent and a copy on the server ((4c)): the round in which agent 1's node
    dies stops the run naming agent 1 and node 1001; a new node for agent 1 (empty context.state) refuses round 3."""
    from fedpdm_flower.strategies.base import RoundFailed

    cfg = parse_run_config(IADMM)
    strategy = build_strategy(cfg, evaluate=False)
    strategy.attach(NODES)
    strategy.prepare(5)
    contexts = _contexts(cfg, NODES)
    grid = StubGrid(NODES.values(), contexts)
    _, replies = _train_round(strategy, 1, grid, contexts)
    strategy.aggregate_train(1, replies)
    strategy.evaluate_round(1)
    _, replies = _train_round(strategy, 2, grid, contexts, dead=[1001])
    with pytest.raises(RoundFailed) as info:
        strategy.aggregate_train(2, replies)
    assert str(info.value).startswith("round 2: no accepted reply from agent(s) [1] (node(s) [1001]; DPIADMM needs "
                                      "every agent every round")
    assert '1x "Error: Node Unavailable' in str(info.value)
    # the restarted node: the same partition, no state
    contexts.update(_contexts(cfg, {1: 2001}))
    grid.online = [1000, 1002, 2001]
    _, replies = _train_round(strategy, 3, grid, contexts)
    assert strategy.node_of[1] == 2001
    refused = [r for r in replies if r.has_error()]
    assert len(refused) == 1 and "this agent has no IADMM state (context.state) in round 3" in str(refused[0].error.reason)


def test_recal_stops_naming_a_dead_baton_holder_after_one_retry(task_identity: None) -> None:
    """DP-RECAL: the node of the agent that holds the baton dies; the round is retried once with the same holder,
    then the run stops naming it (the walk cannot skip it without losing its update)."""
    from fedpdm_flower.strategies.base import RoundFailed

    cfg = parse_run_config(RECAL)
    node_of = {pid: 1000 + pid for pid in range(4)}
    strategy = build_strategy(cfg, evaluate=False)
    strategy.attach(node_of)
    strategy.prepare(6)
    contexts = _contexts(cfg, node_of)
    grid = StubGrid(node_of.values(), contexts)
    _, replies = _train_round(strategy, 1, grid, contexts)
    strategy.aggregate_train(1, replies)
    strategy.evaluate_round(1)
    holder = strategy.holder
    dead = node_of[holder]
    _, replies = _train_round(strategy, 2, grid, contexts, dead=[dead])
    strategy.aggregate_train(2, replies)  # the retry: logged, not raised
    strategy.evaluate_round(2)
    assert strategy.holder == holder
    msgs, replies = _train_round(strategy, 3, grid, contexts, dead=[dead])
    assert [m.metadata.dst_node_id for m in msgs] == [dead]
    with pytest.raises(RoundFailed) as info:
        strategy.aggregate_train(3, replies)
    assert str(info.value).startswith(f"round 3: agent {holder} failed to relay the baton twice in a row: "
                                      '2x "Error: Node Unavailable')


def test_fault_flags_are_checked_before_anything_starts() -> None:
    assert parse_node_at_round("1@2") == NodeAtRound(1, 2)
    for bad in ("1", "a@2", "1@0", "-1@2"):
        with pytest.raises(ValueError, match=r"--kill .*NODE@ROUND|round must be >= 1"):
            parse_node_at_round(bad)
    with pytest.raises(ValueError, match=r"node must be a partition id 0\.\.2"):
        FaultPlan(kill=NodeAtRound(3, 2)).check(3)
    with pytest.raises(ValueError, match=r"the run has only 2 round"):
        FaultPlan(kill=NodeAtRound(1, 3)).check(3, 2)
    with pytest.raises(ValueError, match=r"must come after the kill in round 2"):
        FaultPlan(kill=NodeAtRound(1, 2), restart=NodeAtRound(1, 2)).check(3)
    with pytest.raises(ValueError, match=r"only the killed node \(1\)"):
        FaultPlan(kill=NodeAtRound(1, 2), restart=NodeAtRound(0, 3)).check(3)
    assert FaultPlan(kill=NodeAtRound(1, 2)).signal is signal.SIGKILL
    with pytest.raises(ValueError, match=r"--supervise needs --restart NODE@ROUND or --restart-after S"):
        FaultPlan(kill=NodeAtRound(1, 2), supervise=5.0).check(3)
    with pytest.raises(ValueError, match=r"--supervise must be > 0 seconds"):
        FaultPlan(kill=NodeAtRound(1, 2), restart_after=1.0, supervise=0.0).check(3)


def test_the_supervisor_log_is_read_back(tmp_path: Path) -> None:
    """--supervise's retry loop stamps each attempt; supervisor_attempts reads them, describe_supervision says when
    each started relative to the kill (the real loop runs in tests/test_resume_kill.py)."""
    from types import SimpleNamespace

    from simulations.faults import FaultEvent, describe_supervision, supervisor_attempts

    log = tmp_path / "supernode-1.restart1.log"
    log.write_text("[supervisor] attempt 1 started at 100.5\n...Exit Code: 305...\n"
                   "[supervisor] attempt 1 exited with 1 at 110.0\n[supervisor] attempt 2 started at 115.25\nSuperNode ID: 7\n")
    assert supervisor_attempts(log) == [{"attempt": 1, "started": 100.5, "exited": 110.0, "rc": 1},
                                        {"attempt": 2, "started": 115.25, "exited": None, "rc": None}]
    dep = SimpleNamespace(log_dir=tmp_path, _daemons=[SimpleNamespace(name="supernode-1")] * 2)
    events = [FaultEvent("kill", 1, 2, 10.0, [1], wall=99.5), FaultEvent("restart", 1, 2, 11.0, [2], wall=100.5)]
    assert describe_supervision(dep, events) == [  # type: ignore[arg-type]
        "[fault] supervisor attempt 1: started 1.0 s after the kill, exit 1",
        "[fault] supervisor attempt 2: started 15.8 s after the kill, still running"]
    assert supervisor_attempts(tmp_path / "missing.log") == []


# ---------------------------------------------------------------------------------------------- real deployments
def _doc(path: Path | None) -> dict[str, Any]:
    assert path is not None and path.exists()
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def _node_id(log: Path) -> int:
    import re

    m = re.search(r"SuperNode ID: (\d+)", log.read_text(errors="replace"))
    assert m is not None, f"no node id in {log}"
    return int(m.group(1))


def _fault_run(tmp_path: Path, n: int, overrides: dict[str, Any], plan: FaultPlan, timeout: float = 420,
               secure: bool = True) -> Any:
    from simulations.deploy import local_deployment
    from simulations.faults import run_with_faults

    with local_deployment(n, flwr_home=tmp_path / "flwr-home", secure=secure, startup_timeout=90) as dep:
        if not secure:  # the insecure opt-in, by name: no PKI, no registered keys, plain text on the SuperLink's
            # port (it answers plain HTTP: the probe that tests/test_deployment_secure.py expects to fail)
            assert dep.pki is None and dep.node_ids == [] and not (tmp_path / "flwr-home" / "pki").exists()
            assert plain_http_reply(int(dep.address.rsplit(":", 1)[1])).startswith(b"HTTP/1.1 ")
        fr = run_with_faults(dep, overrides, tmp_path / "out", plan, timeout=timeout)
        logs = {p.name: p for p in dep.log_dir.iterdir()}
        ids = {name: _node_id(p) for name, p in logs.items() if name.startswith("supernode-")}
        if not fr.events or fr.events[0].action != "kill":
            pytest.fail(f"nothing was killed\n{fr.server_log[-3000:]}\n{dep.logs_tail()}")
    return fr, ids


@pytest.mark.deployment
def test_bsdp_fedpdm_goes_on_without_a_crashed_node_and_takes_it_back_after_a_restart(tmp_path: Path) -> None:
    """SIGKILL (a crash) of node 1 when round 2 starts, started again 1 s later with the same node config.

    Round 2 waits for the SuperLink to declare the node dead (2 missed heartbeats) and goes on with the two replies
    it got (FedPDM averages whoever answered); round 3 sends client 1's message to the restarted node (a new node
    id, found by query.whoami before the round) and its reply counts again."""
    plan = FaultPlan(kill=NodeAtRound(1, 2), restart_after=1.0, signal=signal.SIGKILL)
    # Insecure, by name: with SuperNode authentication (the default) the node's registered id is still "online"
    # on the SuperLink 1 s after a SIGKILL, so the restarted node is refused (ApiError 2004, HTTP 412, exit code
    # 305, seen in a full-suite run) until two missed heartbeats (up to 60 s) mark it offline; a supervisor that
    # retries (systemd Restart=on-failure) gets it back then. This test covers the fresh-id readmission path.
    fr, ids = _fault_run(tmp_path, 3, {**PDM, "node-wait-s": 90}, plan, secure=False)
    assert fr.error is None, f"{fr.error}\n{fr.server_log[-3000:]}"
    kill, restart = fr.events
    assert (kill.action, kill.node, kill.round, restart.action) == ("kill", 1, 2, "restart")
    assert kill.replies_before == 2  # its whoami and its round-1 reply: it died before answering round 2
    doc = _doc(fr.results)
    assert doc["status"] == "completed" and doc["engine"] == "flower-deployment"
    assert [(r["round"], r["clients"], r["rejected"]) for r in doc["rounds"]] == [(1, 3, 0), (2, 2, 1), (3, 3, 0)]
    old, new = ids["supernode-1.log"], ids["supernode-1.restart1.log"]
    assert old != new  # an insecure SuperLink gives the restarted node a fresh id
    log = fr.server_log
    assert f"round 2: rejected reply from node {old} (client 1): Error: Node Unavailable" in log
    assert f"client 1 rejoined as node {new} (its node {old} went offline)" in log
    print(f"fedpdm: kill at {kill.at_s:.0f} s, restart at {restart.at_s:.0f} s; rounds "
          f"{[(r['round'], r['clients'], round(r['wall_s'], 1)) for r in doc['rounds']]}")


DPQ = {"algorithm": "dpq-dsgd", "model": "lenet5-valid", "num-clients": 3, "clients-per-round": 3,
       "num-server-rounds": 4, "samples-per-client": 50, "dpq-eval-limit": 50, "seed": 0, "node-wait-s": 90}


@pytest.mark.deployment
def test_dpq_dsgd_stops_naming_the_dead_node(tmp_path: Path) -> None:
    """DPQ-DSGD needs every node's message every round (its neighbours mix it in the next one): the round in
    which node 1 dies stops the run with one line naming agent 1 and its node id. SIGTERM: the node deactivates
    itself on the way out, so the SuperLink answers "Node Unavailable" at once (SIGKILL only adds the heartbeat
    wait, see the FedPDM test)."""
    plan = FaultPlan(kill=NodeAtRound(1, 2), signal=signal.SIGTERM)
    fr, ids = _fault_run(tmp_path, 3, DPQ, plan)
    assert fr.run is None and fr.error is not None and fr.error.run is not None
    assert fr.error.run.status == "finished:failed"
    doc = _doc(fr.results)
    assert doc["status"] == "failed" and [r["round"] for r in doc["rounds"]] == [1]
    node = ids["supernode-1.log"]
    assert doc["error"].startswith(f"round 2: no valid message from agent(s) [1] (node(s) [{node}]; a synchronous "
                                   "round needs every agent")
    assert '1x "Error: Node Unavailable' in doc["error"]
    assert "\n" not in doc["error"]
    print(f"dpq-dsgd: kill at {fr.events[0].at_s:.0f} s; {doc['error'][:120]}...")


FEDREP = {"algorithm": "fedrep", "dataset": "mnist", "partitioner": "iid", "model": "lenet5", "num-clients": 4,
          "clients-per-round": 4, "num-server-rounds": 2, "batch-size": 25, "local-steps": 1, "buffer-size": 2,
          "samples-per-client": 50, "secagg-mode": "masked", "seed": 0, "node-wait-s": 300}


@pytest.mark.deployment
def test_fedrep_masked_leaves_the_dead_node_out_of_the_buffers(tmp_path: Path) -> None:
    """FedREP with masked buffers (s = 2), 4 nodes: node 3 dies when round 2 starts. Its proposal is rejected
    ("Node Unavailable", naming node and client), the three others are partitioned into one buffer of 2 (the odd
    one sits out), their masks cancel and the run completes. node-wait-s is generous: on a loaded 2-core box four
    ClientApps importing torch at once took over 90 s, and a proposal that misses the wait sits out the round."""
    parse_run_config(FEDREP)  # a bad config fails here, not after a deployment started
    plan = FaultPlan(kill=NodeAtRound(3, 2), signal=signal.SIGTERM)
    fr, ids = _fault_run(tmp_path, 4, FEDREP, plan, timeout=900)
    assert fr.error is None, f"{fr.error}\n{fr.server_log[-3000:]}"
    doc = _doc(fr.results)
    assert doc["status"] == "completed"
    rounds = {r["round"]: r for r in doc["rounds"]}
    got = [(r, rounds[r]["clients"], rounds[r]["buffers"], rounds[r]["discarded_buffers"], rounds[r]["rejected"])
           for r in (1, 2)]
    assert got == [(1, 4, 2, 0, 0), (2, 2, 1, 0, 1)]  # round 2: the dead node's proposal rejected, 3 left, 1 buffer
    # the run's real deployment of masked FedREP (secure default: TLS + node authentication) before the fault:
    # ConSpar's consensus set within its bound, a central evaluation every round
    assert doc["engine"] == "flower-deployment" and all(isinstance(rounds[r]["test_accuracy"], float) for r in (1, 2))
    assert 0 < rounds[1]["consensus_size"] <= 4 * round(0.05 * 61706 / 4)
    node = ids["supernode-3.log"]
    assert f"round 2: rejected reply from node {node} (client 3): propose: Error: Node Unavailable" in fr.server_log
    print(f"fedrep: kill at {fr.events[0].at_s:.0f} s; rounds {got}, wall "
          f"{[round(rounds[r]['wall_s'], 1) for r in (1, 2)]}")


def test_the_deploy_cli_refuses_a_bad_fault_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    from simulations.deploy import main

    assert main(["--nodes", "3", "--kill", "5@2", "--", "dataset=synthetic", "num-server-rounds=2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --kill 5@2: node must be a partition id 0..2"
    assert main(["--nodes", "3", "--restart-after", "1", "--", "dataset=synthetic"]) == 2
    assert "--restart / --restart-after / --supervise need --kill NODE@ROUND" in capsys.readouterr().err
