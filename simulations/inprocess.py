"""In-process driver: the same Strategy and NumPyClient code as the Flower run, without the transport.

Every message is built as the same RecordDict Flower would carry (so bytes are counted the same way), each
client keeps its own `Context` (so state lives in `context.state` exactly as under Flower), and the ClientApp's
`handle` answers it. Use it for long sweeps; a test pins that it matches the Flower simulation for a fixed seed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from flwr.app import Context, RecordDict

from fedapp.client_app import handle
from fedapp.config import RunConfig
from fedapp.runner import build_strategy


def make_contexts(cfg: RunConfig) -> dict[int, Context]:
    """One Context per client, node id = partition id, run_config = the validated config."""
    rc = cfg.to_run_config()
    return {
        pid: Context(run_id=0, node_id=pid, node_config={"partition-id": pid, "num-partitions": cfg.num_clients},
                     state=RecordDict(), run_config=dict(rc))
        for pid in range(cfg.num_clients)
    }


def run_rounds(strategy: Any, contexts: dict[int, Context], rounds: int, *, start: int = 1) -> None:
    """Drive `rounds` rounds: configure -> every client's handler -> aggregate -> evaluate."""
    for rnd in range(start, start + rounds):
        strategy.begin_round(rnd)
        pre = strategy.pre_train_contents(rnd)
        if pre:
            strategy.consume_pre_train(rnd, [_answer(mtype, node, content, contexts) for node, mtype, content in pre])
        replies = [_answer("train", node, content, contexts) for node, content in strategy.train_contents(rnd)]
        strategy.consume_replies(rnd, replies)
        strategy.evaluate_round(rnd)


def _answer(mtype: str, node_id: int, content: RecordDict, contexts: dict[int, Context]) -> tuple[int, RecordDict | str]:
    """One client's reply, or its error text (as Flower turns a ClientApp exception into an error reply)."""
    try:
        return node_id, handle(mtype, content, contexts[node_id])
    except Exception as err:
        return node_id, f"{type(err).__name__}: {err}"


def run_inprocess(cfg: RunConfig, *, evaluate: bool = True) -> tuple[Any, dict[int, Context], float]:
    """Run cfg.num_server_rounds rounds in this process; return the strategy (with history), contexts, wall."""
    t0 = time.perf_counter()
    strategy = build_strategy(cfg, evaluate=evaluate)
    contexts = make_contexts(cfg)
    strategy.attach({pid: pid for pid in contexts})
    strategy.summary()
    run_rounds(strategy, contexts, cfg.num_server_rounds)
    return strategy, contexts, time.perf_counter() - t0


__all__ = ["make_contexts", "run_clients", "run_inprocess", "run_rounds"]


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
        strategy.consume_replies(rnd, [answer("train", node, content) for node, content in strategy.train_contents(rnd)])
        strategy.evaluate_round(rnd)
    return strategy, contexts
