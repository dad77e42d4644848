"""The routed decentralized base of the public layer, checked on a gossip-averaging toy with a closed form.

A user writes the algorithm as a SyncRouter subclass and a SyncAgentClient subclass; here each agent publishes its
value and mixes the neighbours' with the Metropolis row the server sends: after k rounds the agents hold
W^(k-1) x0 (round 1 only publishes), which numpy computes directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, RecordDict
from numpy.typing import NDArray

from fedpdm_flower.clients.base import MessageConfig
from fedpdm_flower.clients.decentralized import SyncAgentClient
from fedpdm_flower.fedapp import topology
from fedpdm_flower.strategies.base import FederationError, RoundFailed
from fedpdm_flower.strategies.decentralized import SyncRouter
from simulations.inprocess import run_clients


class Gossip(SyncRouter):
    def validate_message(self, agent: int, arrays: list[NDArray[Any]]) -> list[NDArray[Any]]:
        if arrays[0].shape != (3,) or not np.all(np.isfinite(arrays[0])):
            raise ValueError("a message is 3 finite numbers")
        return arrays

    def global_model(self) -> NDArray[np.float64]:
        return self.outbox_stack().mean(axis=0) if self.outbox else self.x


class GossipAgent(SyncAgentClient):
    def __init__(self, x0: NDArray[np.float64], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.x0 = x0

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[Any], int, dict[str, Any]]:
        cfg = MessageConfig(config)
        k, inbox = self.inbox(parameters, cfg)
        x = self.load_vector("x")
        x = self.x0.copy() if x is None else x
        if inbox:
            wii, row = self.mixing_row(cfg)
            x = wii * x + sum(w * inbox[j][0] for j, w in row.items())
        self.save_vector("x", x)
        return [x], 1, {"t": k}


def _run(graph: topology.Graph | str, n: int, rounds: int, **agent_kw: Any) -> tuple[Gossip, NDArray[np.float64]]:
    x0 = np.random.default_rng(0).normal(size=(n, 3))
    strategy = Gossip(graph=graph, min_available_nodes=n, seed=0)
    run_clients(strategy, lambda c: GossipAgent(x0[int(c.node_config["partition-id"])], **agent_kw), num_nodes=n,
                num_rounds=rounds, initial_arrays=ArrayRecord([np.zeros(3)]))
    return strategy, x0


@pytest.mark.parametrize("graph", ["ring", "star", topology.path_graph(5)])
def test_gossip_through_the_router_is_w_power_times_x0(graph: topology.Graph | str) -> None:
    strategy, x0 = _run(graph, 5, rounds=6)
    w = topology.metropolis_weights(strategy.graph)  # type: ignore[arg-type]
    np.testing.assert_allclose(strategy.outbox_stack(), np.linalg.matrix_power(w, 5) @ x0, rtol=1e-12)
    # the server only forwarded: sum_i d_i messages per round from round 2 on
    assert strategy.forwarded == 5 * sum(len(v) for v in strategy.graph.neighbours)  # type: ignore[union-attr]


def test_a_pinned_device_refuses_other_neighbours_and_the_round_stops() -> None:
    n = 4
    x0 = np.zeros((n, 3))
    strategy = Gossip(graph="ring", min_available_nodes=n, seed=0)

    def client_fn(context: Context) -> GossipAgent:
        i = int(context.node_config["partition-id"])
        return GossipAgent(x0[i], neighbours=[(i + 2) % n] if i == 0 else None)  # agent 0 believes in another graph

    with pytest.raises(RoundFailed, match=r"round 1: no valid message from agent\(s\) \[0\].*accepts messages from its "
                                          r"neighbours \[2\] only, the server gives it \[1, 3\]"):
        run_clients(strategy, client_fn, num_nodes=n, num_rounds=2, initial_arrays=ArrayRecord([np.zeros(3)]))


def test_agents_need_partition_ids_and_a_graph_of_their_size() -> None:
    s = Gossip(graph=topology.ring(4), min_available_nodes=3, seed=0)
    s.initialize(ArrayRecord([np.zeros(3)]))
    with pytest.raises(FederationError, match="graph has 4 agents but 3"):
        s.attach({0: 10, 1: 11, 2: 12})
    s = Gossip(graph="ring", min_available_nodes=3, seed=0)
    with pytest.raises(FederationError, match=r"not exactly 0\.\.2"):
        s.attach({0: 10, 1: 11, 5: 12})
    agent = GossipAgent(np.zeros(3), context=Context(run_id=0, node_id=3, node_config={}, state=RecordDict(),
                                                      run_config={}))
    with pytest.raises(ValueError, match="needs its partition-id"):
        agent.fit([], {"server-round": 1, "msg-round": 0, "neighbours": "[]"})
