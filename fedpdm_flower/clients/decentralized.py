"""Agent side of decentralized algorithms routed through the server (:mod:`fedpdm_flower.strategies.decentralized`).

* :class:`AgentClient`: one graph agent per node; its agent id is its ``partition-id`` (an agent's identity is
  its place in the graph), checked against the id the server addresses it by. Its algorithm state is saved to /
  loaded from ``context.state`` as a dataclass of float64 arrays and integer counters (:func:`save_state`,
  :func:`load_state`; float64 so the state round-trips bit for bit).
* record-level DP-SGD in the agent's gradient steps (:meth:`AgentClient.private_gradients`, on the core of
  :mod:`fedpdm_flower.fedapp.privacy.dpsgd`): the message names the mechanism (z, q, C, the steps it asks), the
  device checks it against its own floor (``max_epsilon``) before touching its data, draws the Poisson samples and
  the noise from its own randomness, and charges its ledger (``context.state`` and, with ``ledger_path``, a file
  that keeps the spend across runs). A message that asks for no DP-SGD -- no noise, or a paper's own mechanism,
  whose rigorous epsilon is unbounded -- is refused by a device with a floor. In a decentralized run the adversary
  the guarantee covers includes the neighbours that receive the agent's messages, not only the routing server.
* :class:`SyncAgentClient`: reads a synchronous round's inbox -- its graph neighbours' round-(k-1) messages, which
  the server forwards (none in round 1) -- and the mixing row (W_ii, W_ij) the server sends with them. A device may
  pin its neighbours (``neighbours=``): it then refuses a message that gives it other neighbours, whatever the
  server says.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from numpy.typing import NDArray

from fedpdm_flower.clients.base import FedClient, MessageConfig
from fedpdm_flower.clients.dpsgd import DeviceAccount, mechanism_of
from fedpdm_flower.fedapp.privacy.dpsgd import DPSGDLedger, DPSGDMechanism, DPSGDStep, device_rng

#: config keys of fedpdm_flower/strategies/decentralized.py (the client does not import the server module)
NEIGHBOURS, WEIGHTS, SELF_WEIGHT, MSG_ROUND, AGENT_KEY = "neighbours", "weights", "self-weight", "msg-round", "agent-id"

T = TypeVar("T")

__all__ = ["AgentClient", "PrivateSteps", "SyncAgentClient", "drop_state", "load_state", "save_state"]


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


@dataclass
class PrivateSteps:
    """One message's record-level DP-SGD at an agent: the noisy-gradient oracle its solver calls in place of the
    exact gradient, and what :meth:`charge` records once the solver is done (every step the message asked for,
    whether the solver used them all or not: stopping early is never a refund)."""

    step: DPSGDStep
    mechanism: DPSGDMechanism
    delta: float
    ledger: DPSGDLedger
    account: DeviceAccount
    context: Any

    def charge(self) -> dict[str, float]:
        """Record the steps in the device's ledger (context.state and file); the reply's privacy metrics."""
        return self.account.charge(self.context, self.ledger, self.mechanism, self.delta)


class AgentClient(FedClient):
    """A graph agent: agent id = the node's partition-id.

    Parameters
    ----------
    model, data, loss_fn, context, seed, test_data, test_fn
        As :class:`fedpdm_flower.clients.base.FedClient` (``model`` may be None for an agent whose algorithm brings its own
        local problem). A torch model's buffers are the node's own: no server model holds them, so they persist in
        the node's ``context.state`` from round to round (``node_local_buffers``); a private run refuses them
        (:meth:`~fedpdm_flower.clients.base.FedClient.refuse_buffers_under_dp`). The seed drives the algorithm's
        own streams (a paper's noise, quantizer, minibatches), never DP-SGD's: its Poisson samples and noise always
        come from the operating system's entropy (:func:`fedpdm_flower.fedapp.privacy.dpsgd.device_rng`), since
        whoever knows a seed (the reproduction app's is the server's) could recompute the sample and subtract the
        noise.
    max_epsilon
        The device owner's privacy floor: the most epsilon (RDP accountant of record-level DP-SGD, at the
        message's delta) this device spends over everything it ever releases. A message that would pass it, or that
        asks for no DP-SGD at all, is refused before the device touches its data; a model with floating-point
        buffers is refused at construction. None: no floor.
    ledger_path
        A file that keeps the device's DP-SGD ledger across runs (None: ``context.state`` only).
    """

    node_local_buffers = True

    def __init__(self, model: Any = None, data: Any = None, loss_fn: Any = None, *, context: Context | None = None,
                 seed: int | None = None, test_data: Any = None, test_fn: Any = None,
                 max_epsilon: float | None = None, ledger_path: str | Path | None = None) -> None:
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
        self.account = DeviceAccount(max_epsilon=max_epsilon, ledger_path=ledger_path)
        if max_epsilon is not None:  # the device releases only private messages, so never trains buffers
            self.refuse_buffers_under_dp(f"this device sets a privacy floor (max_epsilon = {max_epsilon})")

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

    # ------------------------------------------------------------------ record-level DP-SGD
    def private_gradients(self, config: dict[str, Any], model: Any, data: Any,
                          what: str = "no record-level DP-SGD") -> PrivateSteps | None:
        """The DP-SGD oracle this message asks for, admitted against the device's floor; None when it asks for none.

        Parameters
        ----------
        config
            The message config (untrusted: :func:`fedpdm_flower.clients.dpsgd.mechanism_of` checks every key).
        model, data
            The agent's per-record gradients (``clipped_grad_sum`` / ``per_sample_grads``) and its records.
        what
            How a message without DP-SGD is described in a refusal (e.g. "the paper's noise on u~ only").

        Raises
        ------
        ValueError
            Before the data is touched: the message would take the device past its floor, or asks for no DP-SGD
            while the device has one.
        """
        asked = mechanism_of(config)
        if asked is None:
            if self.account.max_epsilon is not None:
                raise ValueError(f"refused: the message asks for {what}, whose rigorous epsilon is unbounded, and this "
                                 f"device allows at most epsilon = {self.account.max_epsilon:g} (record-level DP-SGD)")
            return None
        mech, delta = asked
        self.refuse_buffers_under_dp("this message asks for record-level DP-SGD")
        ledger = self.account.admit(self.node_context, mech, delta)
        step = DPSGDStep(model, data, mech, device_rng())
        return PrivateSteps(step, mech, delta, ledger, self.account, self.node_context)

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        """:meth:`FedClient.get_properties`, plus the device's privacy floor ``dp-max-epsilon`` when it has one: the
        strategy refuses to start a run whose target the device would refuse (before round 1)."""
        props = super().get_properties(config)
        if self.account.max_epsilon is not None:
            props["dp-max-epsilon"] = float(self.account.max_epsilon)
        return props


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
