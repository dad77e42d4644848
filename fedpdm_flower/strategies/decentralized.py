"""Decentralized algorithms on Flower's star network: the server is a mailbox between graph agents.

Flower connects every node to the server only, so a graph edge ``j -> i`` is realised as ``j -> server -> i`` with
the message unchanged. :class:`GraphRouting` holds what every routed algorithm shares: the communication graph
(an object of :mod:`fedpdm_flower.fedapp.topology` or a spec string such as ``"ring"``, built once the number of agents is
known), agents numbered by their ``partition-id`` (0..n-1, required: an agent's identity is its place in the
graph), and the mixing row each agent needs, sent in the message (the strategy is the single source of truth).

:class:`SyncRouter` is the synchronous case, where *every agent talks to its neighbours every iteration*
(PG-EXTRA, NIDS, DPQ-DSGD, ...):

* the server keeps an **outbox**: the latest published message of every agent (one or more arrays);
* round k sends agent i the round-(k-1) messages of its graph neighbours ``N_i`` (ascending ids; no message in
  round 1), with ``config["neighbours"]`` = the JSON list of those ids, ``config["weights"]`` = the JSON list of the
  Metropolis weights W_ij in the same order and ``config["self-weight"]`` = W_ii, so the agent can check the
  routing and mix without knowing the whole graph;
* the agent updates its private state (kept in ``context.state``) and replies with its round-k message, already
  privatised (noise is added on the node, before the message leaves it);
* the server stores the replies in the outbox (the round-k messages), nothing else.

The server **never mixes, sums or otherwise computes on the messages** for the algorithm (spec dp_recal.md 7.7
also allows a neighbour-weighted sum; we do not, so the server is a pure router like DP-RECAL's). It checks only
the form of each reply (count, dtype, shape, finiteness) and the agent's publication counter.

Failure rule: a synchronous round needs every agent's message (its neighbours step with it next round, and an agent
that missed a round is one iteration behind), so a round in which any agent's message is missing or rejected stops
the run with :class:`fedpdm_flower.strategies.base.RoundFailed` naming the agents and quoting why their replies were
rejected (the rounds before it are kept). Re-using a stale outbox entry would change the algorithm silently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.compression.codec import MalformedPayload
from fedpdm_flower.strategies.base import FederatedStrategy, FederationError, Scalar

#: config key with the JSON list of the agent's graph neighbours, whose messages (from round 2) are carried in order
NEIGHBOURS = "neighbours"
#: config key with the JSON list of the mixing weights W_ij of those senders, and W_ii
WEIGHTS, SELF_WEIGHT = "weights", "self-weight"
#: config key with the round whose messages a train message carries (k - 1; 0 = none)
MSG_ROUND = "msg-round"
#: config key with the agent id the server believes it is talking to
AGENT_KEY = "agent-id"
#: metric key of an agent's publication counter (must be the server's count + 1)
PUBLICATIONS = "t"

__all__ = ["AGENT_KEY", "MSG_ROUND", "NEIGHBOURS", "PUBLICATIONS", "SELF_WEIGHT", "WEIGHTS", "GraphRouting",
           "SyncRouter"]


class GraphRouting(FederatedStrategy):
    """What routed decentralized strategies share: the graph, agents = partition ids, mixing rows.

    Parameters
    ----------
    graph
        The communication graph: a :class:`fedpdm_flower.fedapp.topology.Graph` on n agents, or a spec string of
        :func:`fedpdm_flower.fedapp.topology.parse_graph` ("ring", "complete", "star", "path", "er:<p>", "geometric:<r>")
        built with the strategy's seed once n = the number of connected agents is known. Default "ring".
    **federation
        :class:`fedpdm_flower.strategies.base.FederatedStrategy`'s arguments; every agent takes part in every round in which the
        algorithm needs it, and agents are numbered by their partition-id (``require_partition_ids`` is forced).
    """

    resume_unsupported: str | None = ("the routers' state (outboxes, counters, the walk) is not checkpointed yet")

    #: the nodes own their buffers (BatchNorm statistics): no server model to send them from
    SEND_BUFFERS = False

    def __init__(self, *, graph: topology.Graph | str = "ring", **federation: Any) -> None:
        federation["require_partition_ids"] = True
        federation.setdefault("fraction_train", 1.0)
        super().__init__(**federation)
        if not isinstance(graph, topology.Graph | str):
            raise TypeError(f"graph must be a fedpdm_flower.fedapp.topology.Graph or a spec string, got {type(graph).__name__}")
        self.graph_spec = graph
        self.graph: topology.Graph | None = graph if isinstance(graph, topology.Graph) else None
        self.weights: NDArray[np.float64] | None = None

    def attach(self, node_of: Mapping[int, int]) -> None:
        """Number the agents, then build the graph (a spec string) on them and its Metropolis weights."""
        super().attach(node_of)
        n = self.num_clients
        if isinstance(self.graph_spec, str):
            self.graph = topology.parse_graph(self.graph_spec, n, self.seed)
        assert self.graph is not None
        if self.graph.n != n:
            raise FederationError(f"the graph has {self.graph.n} agents but {n} nodes are connected")
        self.weights = topology.metropolis_weights(self.graph)
        self.on_graph()

    def on_graph(self) -> None:
        """Allocate per-agent server state once the graph and n are known."""

    def neighbours(self, agent: int) -> list[int]:
        """Agent i's graph neighbours, ascending."""
        assert self.graph is not None
        return sorted(self.graph.neighbours[agent])

    def mixing_config(self, agent: int, senders: Sequence[int]) -> dict[str, Scalar]:
        """W_ii and W_ij of ``senders`` for agent i (JSON lists; exact float round trip)."""
        assert self.weights is not None
        return {WEIGHTS: json.dumps([float(self.weights[agent, j]) for j in senders]),
                SELF_WEIGHT: float(self.weights[agent, agent])}

    def describe(self) -> dict[str, Any]:
        label = self.graph.label if self.graph is not None and self.graph.label else self.graph_spec
        return {**super().describe(), "graph": label}


class SyncRouter(GraphRouting):
    """Every agent every round; the server forwards the neighbours' latest messages (module docstring).

    Parameters are :class:`GraphRouting`'s.

    Attributes
    ----------
    outbox
        ``{agent: its latest published message (list of arrays)}``, from round ``outbox_round``.
    tau
        Publications per agent (every agent once per completed round, so the LCI is the round count).
    forwarded
        Messages actually forwarded along graph edges so far (``sum_i d_i`` per round from round 2 on).
    """

    #: the latest messages, their round, the publication counters and the forwarding count (checkpoints)
    CHECKPOINT_ATTRS: tuple[str, ...] = ("outbox", "outbox_round", "tau", "forwarded")
    resume_unsupported: str | None = None

    #: arrays per published message
    message_arrays = 1

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.outbox: dict[int, list[NDArray[Any]]] = {}
        self.outbox_round = 0
        self.tau = np.zeros(0, dtype=np.int64)
        self.forwarded = 0

    def on_graph(self) -> None:
        self.tau = np.zeros(self.num_clients, dtype=np.int64)

    # ------------------------------------------------------------------ algorithm hooks
    def round_config(self, server_round: int) -> dict[str, Scalar]:
        """Scalars every agent receives this round (stepsizes, noise scale, ...); none by default."""
        return {}

    def validate_message(self, agent: int, arrays: list[NDArray[Any]]) -> list[NDArray[Any]]:
        """Check one published message (``message_arrays`` arrays); raise MalformedPayload to reject it."""
        return arrays

    # ------------------------------------------------------------------ routing
    def participants(self, server_round: int) -> list[int]:
        """All agents, every round."""
        return list(range(self.num_clients))

    def inbox(self, agent: int) -> list[NDArray[Any]]:
        """The latest messages of the agent's neighbours (ascending ids), concatenated; none before round 2."""
        if not self.outbox:
            return []
        return [a for j in self.neighbours(agent) for a in self.outbox[j]]

    def client_payload(self, server_round: int, client: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        if self.outbox_round != server_round - 1:
            raise RuntimeError(f"round {server_round}: the outbox holds round {self.outbox_round}'s messages, "
                               f"expected round {server_round - 1}'s")
        arrays = self.inbox(client)
        neighbours = self.neighbours(client)
        if arrays:
            self.forwarded += len(neighbours)
        return arrays, {NEIGHBOURS: json.dumps(neighbours), MSG_ROUND: self.outbox_round, AGENT_KEY: client,
                        **self.mixing_config(client, neighbours), **self.round_config(server_round)}

    def decode_update(self, server_round: int, client: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        if len(arrays) != self.message_arrays:
            raise MalformedPayload(f"a message has {self.message_arrays} array(s), got {len(arrays)}")
        if int(metrics.get(PUBLICATIONS, -1)) != int(self.tau[client]) + 1:
            raise MalformedPayload(f"agent {client} reports publication {metrics.get(PUBLICATIONS)}, "
                                   f"expected {int(self.tau[client]) + 1}")
        return self.validate_message(client, arrays)

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Store every agent's new message in the outbox (unchanged); stop the run if any is missing."""
        missing = sorted(set(range(self.num_clients)) - set(updates))
        if missing:
            raise self.round_failed(server_round, f"no valid message from agent(s) {missing} (node(s) "
                                    f"{[self.node_of.get(c) for c in missing]}; a synchronous round needs every "
                                    "agent: their neighbours step with it next round)")
        self.outbox = {i: list(updates[i]) for i in range(self.num_clients)}
        self.outbox_round = server_round
        self.tau += 1
        return {"lci": float(self.tau.max()), "forwarded": float(self.forwarded)}

    def outbox_stack(self, index: int = 0) -> NDArray[Any]:
        """Array ``index`` of every agent's latest message, stacked in agent order (shape (n, ...))."""
        return np.stack([self.outbox[i][index] for i in range(self.num_clients)])
