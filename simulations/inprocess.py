"""In-process driver: the same Strategy and NumPyClient code as the Flower run, without the transport.

Every message is built as the same RecordDict Flower would carry (so bytes are counted the same way), each
client keeps its own `Context` (so state lives in `context.state` exactly as under Flower), and the ClientApp's
`handle` answers it. Use it for long sweeps; a test pins that it matches the Flower simulation for a fixed seed.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedpdm_flower.fedapp.client_app import answer
from fedpdm_flower.fedapp.config import RunConfig
from fedpdm_flower.fedapp.runner import build_strategy
from fedpdm_flower.fedapp.wire import recorddict_nbytes


def make_contexts(cfg: RunConfig) -> dict[int, Context]:
    """One Context per client, node id = partition id, run_config = the validated config."""
    rc = cfg.to_run_config()
    return {
        pid: Context(run_id=0, node_id=pid, node_config={"partition-id": pid, "num-partitions": cfg.num_clients},
                     state=RecordDict(), run_config=dict(rc))
        for pid in range(cfg.num_clients)
    }


def run_rounds(strategy: Any, contexts: dict[int, Context], rounds: int, *, start: int = 1) -> None:
    """Drive `rounds` rounds: [pre-train exchange] -> train -> [post-train exchange] -> evaluate, as Flower's path
    (fedpdm_flower.strategies.base.FederatedStrategy.configure_train / aggregate_train) does."""
    for rnd in range(start, start + rounds):
        strategy.begin_round(rnd)
        pre = strategy.pre_train_contents(rnd)
        if pre:
            strategy.consume_pre_train(rnd, [_answer(mtype, node, content, contexts) for node, mtype, content in pre])
        replies = [_answer("train", node, content, contexts) for node, content in strategy.checked_train_contents(rnd)]
        strategy.consume_replies(rnd, replies)
        post = strategy.post_train_contents(rnd)
        if post:
            strategy.consume_post_train(rnd, [_answer(mtype, node, content, contexts) for node, mtype, content in post])
        strategy.complete_round(rnd)


def _answer(mtype: str, node_id: int, content: RecordDict, contexts: dict[int, Context]) -> tuple[int, RecordDict | str]:
    """One client's reply, or its error text (the reason our ClientApp puts in an error reply)."""
    return node_id, answer(mtype, content, contexts[node_id])


def run_inprocess(cfg: RunConfig, *, evaluate: bool = True) -> tuple[Any, dict[int, Context], float]:
    """Run cfg.num_server_rounds rounds in this process; return the strategy (with history), contexts, wall."""
    t0 = time.perf_counter()
    strategy = build_strategy(cfg, evaluate=evaluate)
    contexts = make_contexts(cfg)
    strategy.attach({pid: pid for pid in contexts})
    strategy.summary()
    run_rounds(strategy, contexts, cfg.num_server_rounds)
    return strategy, contexts, time.perf_counter() - t0


__all__ = ["LocalGrid", "make_contexts", "run_clients", "run_inprocess", "run_rounds"]


def run_clients(
    strategy: Any, client_fn: Callable[[Context], Any], *, num_nodes: int, num_rounds: int, initial_arrays: Any,
    evaluate_fn: Any = None, train_config: Any = None,
) -> tuple[Any, dict[int, Context]]:
    """A user's strategy and ``client_fn`` (the public layer only) for ``num_rounds`` rounds in this process.

    Node i gets node config ``partition-id = i``, ``num-partitions = num_nodes`` and its own Context; every message
    is the RecordDict Flower would carry, answered by the client's ``handle`` (exceptions become error replies), so
    the result equals a Flower simulation's with the same seeds. Returns the strategy (with its history) and the
    contexts (with the clients' state).
    """
    contexts = {i: Context(run_id=0, node_id=i, node_config={"partition-id": i, "num-partitions": num_nodes},
                           state=RecordDict(), run_config={}) for i in range(num_nodes)}
    clients: dict[int, Any] = {}

    def answer(mtype: str, node: int, content: RecordDict) -> tuple[int, RecordDict | str]:
        try:
            if node not in clients:
                clients[node] = client_fn(contexts[node])
            clients[node].bind(contexts[node])
            return node, clients[node].handle(mtype, content)
        except Exception as err:
            return node, f"{type(err).__name__}: {err}"

    strategy.initialize(initial_arrays)
    strategy.prepare(num_rounds, train_config=train_config, evaluate_fn=evaluate_fn)
    strategy.attach({i: i for i in range(num_nodes)})
    for rnd in range(1, num_rounds + 1):
        strategy.begin_round(rnd)
        pre = strategy.pre_train_contents(rnd)
        if pre:
            strategy.consume_pre_train(rnd, [answer(mtype, node, content) for node, mtype, content in pre])
        strategy.consume_replies(rnd, [answer("train", node, content) for node, content in strategy.checked_train_contents(rnd)])
        post = strategy.post_train_contents(rnd)
        if post:
            strategy.consume_post_train(rnd, [answer(mtype, node, content) for node, mtype, content in post])
        strategy.evaluate_round(rnd)
    return strategy, contexts


class LocalGrid(Grid):
    """A Flower Grid in this process: messages go to a real ``ClientApp`` (its mods included), one Context per node.

    For tests of a user's whole app -- strategy, wrappers, ClientApp and mods -- without Ray or a SuperLink. Each
    message and reply is deep-copied on the way, as a transport would serialize it, so neither side can change the
    other's objects. A ClientApp exception becomes an error reply, as in Flower.

    Parameters
    ----------
    client_app
        The ClientApp every node runs.
    num_nodes
        Nodes 1..num_nodes (node ids), with node config ``partition-id = i - 1``, ``num-partitions = num_nodes``.
    node_config
        Extra node-config entries per node (by partition id), e.g. a device's own policy.
    """

    #: its nodes are fixed when it is built: a strategy waiting for more gives up (as in Flower's simulation)
    fixed_federation = True

    def __init__(self, client_app: Any, num_nodes: int, *, node_config: Mapping[int, Mapping[str, Any]] | None = None,
                 run_config: Mapping[str, Any] | None = None) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        # this process plays the ServerApp's: Flower's Message constructor reads the task identity it would set
        for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
            if getattr(TaskIdentity, attr) is None:
                setattr(TaskIdentity, attr, value)
        self.client_app = client_app
        self.contexts = {
            i + 1: Context(run_id=1, node_id=i + 1, node_config={"partition-id": i, "num-partitions": num_nodes,
                                                                **dict((node_config or {}).get(i, {}))},
                           state=RecordDict(), run_config=dict(run_config or {}))
            for i in range(num_nodes)
        }
        self._outbox: dict[str, Message] = {}
        self.down_bytes = 0
        self.up_bytes = 0

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return getattr(self, "_run", None)

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            mid = str(uuid.uuid4())
            msg.metadata.__dict__["_message_id"] = mid
            msg.metadata.__dict__["_run_id"] = 1
            delivered = copy.deepcopy(msg)
            self.down_bytes += recorddict_nbytes(delivered.content)
            context = self.contexts[delivered.metadata.dst_node_id]
            try:
                reply = self.client_app(delivered, context)
            except Exception as err:  # what Flower turns into an error reply
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(err).__name__}: {err}"),
                                reply_to=delivered)
            if not reply.has_error():
                self.up_bytes += recorddict_nbytes(reply.content)
            self._outbox[mid] = copy.deepcopy(reply)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._outbox.pop(m) for m in message_ids if m in self._outbox]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))
