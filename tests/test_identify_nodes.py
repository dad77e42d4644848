"""How the server learns which client each node is: ``identify_nodes="ask"`` (a whoami query to every node before
round 1) or ``"node-order"`` (no message, as Flower's FedAvg; clients are the nodes in node-id order).

Driven as Flower drives a strategy (``configure_train`` -> replies -> ``aggregate_train``) through the stub Grid of
tests/test_faults.py, our real ClientApp answering, with node ids that do not sort like the partition ids, so that
the two ways give different client numbers.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_faults import PDM, StubGrid, _contexts, _train_round, task_identity  # noqa: F401 (a fixture)

from fedpdm_flower.fedapp.config import parse_run_config
from fedpdm_flower.fedapp.runner import build_strategy
from fedpdm_flower.fedapp.sampling import select_clients

#: partition id -> node id; node-id order is 1000 (partition 2), 1001 (1), 1002 (3), 1003 (0)
SCRAMBLED = {0: 1003, 1: 1001, 2: 1000, 3: 1002}
pytestmark = pytest.mark.usefixtures("task_identity")  # the ServerApp's task identity, as in tests/test_faults.py
CFG = {**PDM, "num-clients": 4, "clients-per-round": 2, "num-server-rounds": 3}


def _run(identify: str, rounds: int = 2) -> tuple[Any, StubGrid, list[list[int]]]:
    cfg = parse_run_config({**CFG, "identify-nodes": identify})
    strategy = build_strategy(cfg, evaluate=False)
    strategy.prepare(3)
    contexts = _contexts(cfg, SCRAMBLED)
    grid = StubGrid(sorted(SCRAMBLED.values()), contexts)
    sent = []
    for rnd in range(1, rounds + 1):
        msgs, replies = _train_round(strategy, rnd, grid, contexts)
        sent.append(sorted(m.metadata.dst_node_id for m in msgs))
        strategy.aggregate_train(rnd, replies)
        assert strategy.round_metrics()["clients"] == len(msgs)
        strategy.evaluate_round(rnd)
    return strategy, grid, sent


def test_node_order_asks_no_node_and_numbers_clients_in_node_id_order() -> None:
    strategy, grid, sent = _run("node-order")
    assert grid.asked == []  # no query.whoami: the train messages are the only ones
    assert strategy.node_of == {0: 1000, 1: 1001, 2: 1002, 3: 1003}
    # round 1 trains every client (S_0 = [N]); round 2 the seeded draw of 2 clients, which are node positions
    assert sent[0] == [1000, 1001, 1002, 1003]
    order = sorted(SCRAMBLED.values())
    assert sent[1] == sorted(order[c] for c in select_clients(2, 4, 2, 0, first_round_all=True))


def test_ask_queries_every_node_once_and_numbers_clients_by_partition() -> None:
    strategy, grid, sent = _run("ask")
    assert sorted(grid.asked) == sorted(SCRAMBLED.values())  # one whoami each, before round 1, none after
    assert strategy.node_of == SCRAMBLED
    assert sent[1] == sorted(SCRAMBLED[c] for c in select_clients(2, 4, 2, 0, first_round_all=True))


def test_node_order_takes_a_late_node_as_a_new_client_without_asking() -> None:
    """A node connecting after round 1 is not asked who it is; BSDP-FedPDM admits it as client N (a restarted
    node cannot take its old client back, as under identify_nodes="ask")."""
    cfg = parse_run_config({**CFG, "identify-nodes": "node-order"})
    strategy = build_strategy(cfg, evaluate=False)
    strategy.prepare(3)
    contexts = _contexts(cfg, SCRAMBLED)
    grid = StubGrid(sorted(SCRAMBLED.values()), contexts)
    _, replies = _train_round(strategy, 1, grid, contexts)
    strategy.aggregate_train(1, replies)
    strategy.evaluate_round(1)
    contexts.update(_contexts(cfg, {1: 2001}))
    grid.online = [*sorted(SCRAMBLED.values()), 2001]
    _train_round(strategy, 2, grid, contexts)
    assert grid.asked == []
    assert strategy.admits_new_nodes and strategy.node_of[4] == 2001 and strategy.num_clients == 5


def test_node_order_refuses_a_checkpoint_and_strategies_that_need_partition_ids() -> None:
    ask, _, _ = _run("ask", rounds=1)
    state = ask.state_dict()
    order = build_strategy(parse_run_config({**CFG, "identify-nodes": "node-order"}), evaluate=False)
    order.prepare(3)
    with pytest.raises(ValueError, match="identify_nodes='node-order' cannot resume"):
        order.load_state_dict(state)
    # a checkpoint written under node-order is refused by an "ask" run too: its client ids were node positions
    with pytest.raises(ValueError, match="cannot resume"):
        ask.load_state_dict({**state, "identify_nodes": "node-order"})
    every = {"clients-per-round": 4}
    for algorithm, keys in (("objp", {"model": "multinomial-nobias", **every}), ("fedrep", {"model": "tiny-cnn", **every}),
                           ("dpq-dsgd", {"dataset": "mnist", "model": "tiny-cnn", "num-server-rounds": 4, **every})):
        # I_p, buffers and graphs need the nodes' partition ids
        cfg = parse_run_config({**CFG, **keys, "algorithm": algorithm, "dp": False, "identify-nodes": "node-order"})
        with pytest.raises(ValueError, match="only identify_nodes='ask' learns"):
            build_strategy(cfg, evaluate=False)
    with pytest.raises(ValueError, match="identify-nodes"):
        parse_run_config({**CFG, "identify-nodes": "guess"})
