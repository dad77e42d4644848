"""Agent side of decentralized algorithms routed through the server (:mod:`fedpdm_flower.strategies.decentralized`).

* :class:`AgentClient`: one graph agent per node; its agent id is its ``partition-id`` (an agent's identity is
  its place in the graph), checked against the id the server addresses it by. Its algorithm state is saved to /
  loaded from ``context.state`` as a dataclass of float64 arrays and integer counters (:func:`save_state`,
  :func:`load_state`; float64 so the state round-trips bit for bit).
* :class:`SyncAgentClient`: reads a synchronous round's inbox -- its graph neighbours' round-(k-1) messages, which
  the server forwards (none in round 1) -- and the mixing row (W_ii, W_ij) the server sends with them. A device may
  pin its neighbours (``neighbours=``): it then refuses a message that gives it other neighbours, whatever the
  server says.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from numpy.typing import NDArray

from fedpdm_flower.clients.base import FedClient, MessageConfig

#: config keys of fedpdm_flower/strategies/decentralized.py (the client does not import the server module)
NEIGHBOURS, WEIGHTS, SELF_WEIGHT, MSG_ROUND, AGENT_KEY = "neighbours", "weights", "self-weight", "msg-round", "agent-id"

T = TypeVar("T")

__all__ = ["AgentClient", "SyncAgentClient", "drop_state", "load_state", "save_state"]


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
    """A graph agent: agent id = the node's partition-id.

    Parameters
    ----------
    model, data, loss_fn, context, seed, test_data, test_fn
        As :class:`fedpdm_flower.clients.base.FedClient` (``model`` may be None for an agent whose algorithm brings its own
        local problem). A torch model's buffers are the node's own: no server model holds them, so they persist in
        the node's ``context.state`` from round to round (``node_local_buffers``).
    """

    node_local_buffers = True

    def __init__(self, model: Any = None, data: Any = None, loss_fn: Any = None, *, context: Context | None = None,
                 seed: int | None = None, test_data: Any = None, test_fn: Any = None) -> None:
        if model is not None:
            super().__init__(model, data, loss_fn, context=context, seed=seed, test_data=test_data, test_fn=test_fn)
        else:  # routing-only or own-problem agents: no flat model
            self.model = None
            self.data = None
            self.test, self.test_fn, self._test_source = None, None, None
            self.seed = seed
            self.node_context = None
            self.client_id = 0
            if context is not None:
                self.bind(context)

    @property
    def agent_id(self) -> int:
        """This agent's id in the graph (the node's partition-id)."""
        nc = {} if self.node_context is None else self.node_context.node_config
        if not isinstance(nc.get("partition-id"), int):
            raise ValueError("a graph agent needs its partition-id in the node config (node-config \"partition-id=<i> "
                             "num-partitions=<n>\")")
        return int(nc["partition-id"])

    def check_addressed(self, cfg: MessageConfig) -> None:
        """The server must address this agent by its own id (and the node must have one)."""
        me = self.agent_id
        if AGENT_KEY in cfg and cfg.integer(AGENT_KEY) != me:
            raise ValueError(f"the server addressed agent {cfg.integer(AGENT_KEY)}, this node is agent {me}")


class SyncAgentClient(AgentClient):
    """An agent of a synchronous routed algorithm (:class:`fedpdm_flower.strategies.decentralized.SyncRouter`).

    Parameters
    ----------
    neighbours
        The device's own list of its graph neighbours (a device policy); None trusts the server's routing.
    **kwargs
        :class:`AgentClient`'s arguments.
    """

    #: arrays per published message
    message_arrays = 1

    def __init__(self, *args: Any, neighbours: Sequence[int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pinned = None if neighbours is None else sorted(int(j) for j in neighbours)

    def inbox(self, parameters: list[Any], cfg: MessageConfig) -> tuple[int, dict[int, list[NDArray[Any]]]]:
        """``(k, {j: neighbour j's round-(k-1) message})`` of a round-k train message; empty in round 1.

        Raises ValueError if the message is addressed to another agent, carries another round's messages, gives
        other neighbours than the device's pinned ones, or a wrong number of arrays.
        """
        self.check_addressed(cfg)
        k = cfg.integer("server-round", lo=1)
        if cfg.integer(MSG_ROUND) != k - 1:
            raise ValueError(f"round {k} must carry round {k - 1}'s messages, got round {cfg.config[MSG_ROUND]}'s")
        neighbours = self.neighbours(cfg)  # checked in every round, the first included
        senders = neighbours if k > 1 else []
        per = self.message_arrays
        if len(parameters) != per * len(senders):
            raise ValueError(f"{len(senders)} senders x {per} array(s) expected, got {len(parameters)} arrays")
        return k, {j: [np.asarray(a) for a in parameters[s * per:(s + 1) * per]] for s, j in enumerate(senders)}

    def neighbours(self, cfg: MessageConfig) -> list[int]:
        """This agent's graph neighbours as the message gives them (ascending, distinct, not itself, and the
        device's pinned neighbours if it has any)."""
        raw = json.loads(str(cfg.config.get(NEIGHBOURS, "[]")))
        if not isinstance(raw, list) or not all(isinstance(j, int) and not isinstance(j, bool) and j >= 0 for j in raw):
            raise ValueError(f"message config {NEIGHBOURS!r} must be a JSON list of agent ids, got {raw!r}")
        if raw != sorted(set(raw)) or self.agent_id in raw:
            raise ValueError(f"message config {NEIGHBOURS!r} = {raw} must be ascending distinct ids other than "
                             f"this agent ({self.agent_id})")
        if self.pinned is not None and raw != self.pinned:
            raise ValueError(f"agent {self.agent_id} accepts messages from its neighbours {self.pinned} only, the "
                             f"server gives it {raw}")
        return list(raw)

    def mixing_row(self, cfg: MessageConfig) -> tuple[float, dict[int, float]]:
        """``(W_ii, {j: W_ij})`` as the server sent it for this agent's neighbours: a probability row (checked)."""
        neighbours = self.neighbours(cfg)
        w = json.loads(str(cfg.config.get(WEIGHTS, "[]")))
        wii = cfg.number(SELF_WEIGHT, lo=0.0, hi=1.0)
        if not isinstance(w, list) or len(w) != len(neighbours) or not all(isinstance(v, int | float) for v in w):
            raise ValueError(f"message config {WEIGHTS!r} must list one weight per neighbour {list(neighbours)}")
        row = {int(j): float(v) for j, v in zip(neighbours, w, strict=True)}
        if any(not 0.0 <= v <= 1.0 for v in row.values()) or abs(wii + sum(row.values()) - 1.0) > 1e-9:
            raise ValueError(f"mixing row W_ii = {wii}, W_ij = {row} is not a probability vector")
        return wii, row
