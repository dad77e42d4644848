"""TRANSITIONAL (until DP-RECAL's baselines and DPQ-DSGD move to the public layer; see strategies/decentralized.py).

Synchronous routing of a decentralized algorithm through Flower's star network: the server is a mailbox.

Decentralized methods in which *every agent talks to its graph neighbours every iteration* (PG-EXTRA, NIDS,
DPQ-DSGD, ...) run here with one Flower round per iteration and all agents in every round:

* the server keeps an **outbox**: the latest published message of every agent (one or more arrays);
* round k sends agent i the round-(k-1) messages of its graph neighbours ``N_i`` (ascending ids, nothing in
  round 1), with ``config["neighbours"]`` = the JSON list of those ids so the agent can check the routing;
* the agent updates its private state (kept in ``context.state``) and replies with its round-k message, already
  privatised (noise is added on the node, before the message leaves it);
* the server stores the replies in the outbox (the round-k messages), nothing else.

The server **never mixes, sums or otherwise computes on the messages** for the algorithm: every graph link
``j -> i`` is realised as ``j -> server -> i`` with the message unchanged (spec dp_recal.md 7.7 also allows the
server to send a neighbour-weighted sum; we do not, so the server is a pure router like DP-RECAL's). It checks
only the form of each reply (count, dtype, shape, finiteness) and the agent's publication counter.

Failure rule: a synchronous round needs every agent's message (its neighbours step with it next round, and
an agent that missed a round is one iteration behind), so a round in which any agent's message is missing or
rejected stops the run with a RuntimeError naming the agents. Re-using a stale outbox entry would change the
algorithm silently (DPQ-DSGD's spec lists it only as a logged deviation).

Subclasses supply the algorithm: :meth:`initial_model`, :meth:`round_config` (scalars every agent gets),
:meth:`validate_message`, and optionally a round-1 pre-train exchange (:meth:`pre_train_contents` /
:meth:`consume_pre_train`, e.g. a ``query.register``) and the evaluation.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedapp import topology
from fedapp.compression.codec import MalformedPayload
from fedapp.config import RunConfig
from fedapp.strategy_base import FederatedStrategy, Scalar

#: config key with the JSON list of the sender ids whose messages a train message carries, in order
NEIGHBOURS = "neighbours"
#: config key with the round whose messages a train message carries (k - 1; 0 = none)
MSG_ROUND = "msg-round"
#: metric key of an agent's publication counter (must be the server's count + 1)
PUBLICATIONS = "t"


class SyncRouter(FederatedStrategy):
    """Every agent every round; the server forwards the neighbours' latest messages (module docstring).

    Parameters
    ----------
    cfg
        Run config: num-clients n (= agents), graph (:func:`fedapp.topology.parse_graph` with seed),
        num-server-rounds (iterations).
    evaluator
        Passed to :class:`FederatedStrategy` (None: no test-set evaluation).

    Attributes
    ----------
    graph
        The communication graph; agent i's inbox is ``graph.neighbours[i]``.
    outbox
        ``{agent: its latest published message (list of arrays)}``, from round ``outbox_round``.
    tau
        Publications per agent (every agent once per completed round, so the LCI is the round count).
    forwarded
        Messages actually forwarded along graph edges so far (``sum_i d_i`` per round from round 2 on).
    """

    #: arrays per published message
    message_arrays = 1

    def __init__(self, cfg: RunConfig, evaluator: Any = None) -> None:
        self.graph = topology.parse_graph(cfg.graph, cfg.num_clients, cfg.seed)
        self.outbox: dict[int, list[NDArray[Any]]] = {}
        self.outbox_round = 0
        self.tau = np.zeros(cfg.num_clients, dtype=np.int64)
        self.forwarded = 0
        super().__init__(cfg, evaluator)

    # ------------------------------------------------------------------ algorithm hooks
    def round_config(self, server_round: int) -> dict[str, Scalar]:
        """Scalars every agent receives this round (stepsizes, noise scale, ...); none by default."""
        return {}

    def validate_message(self, partition_id: int, arrays: list[NDArray[Any]]) -> list[NDArray[Any]]:
        """Check one published message (``message_arrays`` arrays); raise MalformedPayload to reject it."""
        return arrays

    # ------------------------------------------------------------------ routing
    def participants(self, server_round: int) -> list[int]:
        """All agents, every round."""
        return list(range(self.cfg.num_clients))

    def inbox(self, partition_id: int) -> tuple[list[int], list[NDArray[Any]]]:
        """The senders (ascending neighbour ids) and their latest messages, concatenated, for one agent."""
        if not self.outbox:
            return [], []
        senders = list(self.graph.neighbours[partition_id])
        return senders, [a for j in senders for a in self.outbox[j]]

    def client_payload(self, server_round: int, partition_id: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        if self.outbox_round != server_round - 1:
            raise RuntimeError(f"round {server_round}: the outbox holds round {self.outbox_round}'s messages, "
                               f"expected round {server_round - 1}'s")
        senders, arrays = self.inbox(partition_id)
        self.forwarded += len(senders)
        return arrays, {NEIGHBOURS: json.dumps(senders), MSG_ROUND: self.outbox_round, **self.round_config(server_round)}

    def decode_update(self, server_round: int, partition_id: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        if len(arrays) != self.message_arrays:
            raise MalformedPayload(f"a message has {self.message_arrays} array(s), got {len(arrays)}")
        if int(metrics.get(PUBLICATIONS, -1)) != int(self.tau[partition_id]) + 1:
            raise MalformedPayload(f"agent {partition_id} reports publication {metrics.get(PUBLICATIONS)}, "
                                   f"expected {int(self.tau[partition_id]) + 1}")
        return self.validate_message(partition_id, arrays)

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Store every agent's new message in the outbox (unchanged); stop the run if any is missing."""
        missing = sorted(set(range(self.cfg.num_clients)) - set(updates))
        if missing:
            raise self.round_failed(server_round, f"no valid message from agent(s) {missing} (a synchronous round "
                                    "needs every agent: their neighbours step with it next round)")
        self.outbox = {i: list(updates[i]) for i in range(self.cfg.num_clients)}
        self.outbox_round = server_round
        self.tau += 1
        return {"lci": float(self.tau.max()), "forwarded": float(self.forwarded)}

    def outbox_stack(self, index: int = 0) -> NDArray[Any]:
        """Array ``index`` of every agent's latest message, stacked in agent order (shape (n, ...))."""
        return np.stack([self.outbox[i][index] for i in range(self.cfg.num_clients)])


__all__ = ["MSG_ROUND", "NEIGHBOURS", "PUBLICATIONS", "SyncRouter"]
