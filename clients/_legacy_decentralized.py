"""TRANSITIONAL (until DP-RECAL's baselines and DPQ-DSGD move to the public layer; see strategies/decentralized.py).

Agent side of decentralized algorithms routed through the server (strategies/decentralized.py).

* :class:`AgentClient`: one graph agent per node (partition-id = agent id), the graph from the run config (cached
  per process), and its algorithm state saved to / loaded from ``context.state`` as a dataclass of float64
  arrays and integer counters (:func:`save_state`, :func:`load_state`; float64 so the state round-trips bit
  for bit -- Flower re-creates the client object for every message).
* :class:`SyncAgentClient`: reads a synchronous round's inbox -- the neighbours' round-(k-1) messages the server
  forwarded, checked against this agent's graph neighbours.
"""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from numpy.typing import NDArray

from fedapp import topology
from fedapp.client_base import FedClient
from fedapp.config import RunConfig
from strategies._legacy_decentralized import MSG_ROUND, NEIGHBOURS

T = TypeVar("T")
_GRAPHS: dict[tuple[str, int, int], tuple[topology.Graph, NDArray[np.float64]]] = {}


def graph_and_weights(cfg: RunConfig) -> tuple[topology.Graph, NDArray[np.float64]]:
    """The run's graph and its Metropolis-Hastings W (:func:`fedapp.topology.metropolis_weights`), cached."""
    key = (cfg.graph, cfg.num_clients, cfg.seed)
    if key not in _GRAPHS:
        if len(_GRAPHS) >= 8:
            _GRAPHS.clear()
        graph = topology.parse_graph(cfg.graph, cfg.num_clients, cfg.seed)
        _GRAPHS[key] = (graph, topology.metropolis_weights(graph))
    return _GRAPHS[key]


def save_state(state: RecordDict, key: str, obj: Any) -> None:
    """Persist a dataclass of arrays / ints / None under ``key`` (arrays) and ``key + "-meta"`` (the rest)."""
    if not is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"expected a dataclass instance, got {type(obj).__name__}")
    arrays: dict[str, Array] = {}
    meta: dict[str, int | str] = {}
    nones: list[str] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            nones.append(f.name)
        elif isinstance(value, np.ndarray):
            arrays[f.name] = Array(np.ascontiguousarray(value, dtype=np.float64))
        elif isinstance(value, int | np.integer) and not isinstance(value, bool):
            meta[f.name] = int(value)
        else:
            raise TypeError(f"field {f.name!r} of {type(obj).__name__} is neither an array, an int nor None")
    meta["__none__"] = json.dumps(nones)
    state[key] = ArrayRecord(arrays)
    state[key + "-meta"] = ConfigRecord(meta)  # type: ignore[arg-type]


def load_state(state: RecordDict, key: str, cls: type[T]) -> T | None:
    """The dataclass saved by :func:`save_state`, or None if there is none."""
    if key not in state.array_records:
        return None
    values: dict[str, Any] = {name: np.asarray(arr.numpy(), dtype=np.float64)
                              for name, arr in state.array_records[key].items()}
    meta = dict(state.config_records[key + "-meta"])
    for name in json.loads(str(meta.pop("__none__"))):
        values[name] = None
    values.update({name: int(v) for name, v in meta.items()})  # type: ignore[arg-type]
    return cls(**values)


def drop_state(state: RecordDict, key: str) -> None:
    """Forget the state saved under ``key`` (if any)."""
    for k in (key, key + "-meta"):
        if k in state:
            del state[k]


class AgentClient(FedClient):
    """A graph agent: partition-id = agent id, num-partitions = n, the graph of the run config.

    Parameters
    ----------
    context
        Flower Context (node_config partition-id / num-partitions; state persists across rounds).
    cfg
        Run config: num-clients n, graph, seed.
    """

    def __init__(self, context: Context, cfg: RunConfig) -> None:  # no FedClient data / model: the agent's own
        self.bind_node(context, cfg, check_partitions=True)
        self.graph, self.weights = graph_and_weights(cfg)

    @property
    def neighbours(self) -> list[int]:
        """This agent's graph neighbours, ascending."""
        return list(self.graph.neighbours[self.partition_id])

    def mixing_row(self) -> tuple[float, dict[int, float]]:
        """``(W_ii, {j: W_ij})`` of the Metropolis-Hastings W, computed here from the graph."""
        i = self.partition_id
        return float(self.weights[i, i]), {j: float(self.weights[i, j]) for j in self.graph.neighbours[i]}


class SyncAgentClient(AgentClient):
    """An agent of a synchronous routed algorithm (strategies/decentralized.py :class:`SyncRouter`)."""

    #: arrays per published message
    message_arrays = 1

    def inbox(self, parameters: list[Any], config: dict[str, Any]) -> tuple[int, dict[int, list[NDArray[Any]]]]:
        """``(k, {j: neighbour j's round-(k-1) message})`` of a round-k train message; empty in round 1.

        Raises ValueError if the server forwards messages of other senders than this agent's graph neighbours,
        of another round, or a wrong number of arrays.
        """
        k = int(config["server-round"])
        if int(config[MSG_ROUND]) != k - 1:
            raise ValueError(f"round {k} must carry round {k - 1}'s messages, got round {config[MSG_ROUND]}'s")
        senders = json.loads(str(config[NEIGHBOURS]))
        expected = [] if k == 1 else self.neighbours
        if senders != expected:
            raise ValueError(f"agent {self.partition_id} expects messages from {expected} in round {k}, "
                             f"the server forwarded {senders}")
        per = self.message_arrays
        if len(parameters) != per * len(senders):
            raise ValueError(f"{len(senders)} senders x {per} array(s) expected, got {len(parameters)} arrays")
        return k, {j: [np.asarray(a) for a in parameters[s * per:(s + 1) * per]] for s, j in enumerate(senders)}


__all__ = ["AgentClient", "SyncAgentClient", "drop_state", "graph_and_weights", "load_state", "save_state"]
