"""In-process driver: the same Strategy and NumPyClient code as the Flower run, without the transport.

Every message is built as the same RecordDict Flower would carry (so bytes are counted the same way), each
client keeps its own `Context` (so state lives in `context.state` exactly as under Flower), and the ClientApp's
`handle` answers it. Use it for long sweeps; a test pins that it matches the Flower simulation for a fixed seed.
"""

from __future__ import annotations

import time

from flwr.app import Context, RecordDict

from fedapp.client_app import answer
from fedapp.config import RunConfig
from fedapp.runner import build_strategy
from fedapp.strategy_base import FederatedStrategy


def make_contexts(cfg: RunConfig) -> dict[int, Context]:
    """One Context per client, node id = partition id, run_config = the validated config."""
    rc = cfg.to_run_config()
    return {
        pid: Context(run_id=0, node_id=pid, node_config={"partition-id": pid, "num-partitions": cfg.num_clients},
                     state=RecordDict(), run_config=dict(rc))
        for pid in range(cfg.num_clients)
    }


def run_rounds(strategy: FederatedStrategy, contexts: dict[int, Context], rounds: int, *, start: int = 1) -> None:
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
    """One client's reply, or its error text (the reason our ClientApp puts in an error reply)."""
    return node_id, answer(mtype, content, contexts[node_id])


def run_inprocess(cfg: RunConfig, *, evaluate: bool = True) -> tuple[FederatedStrategy, dict[int, Context], float]:
    """Run cfg.num_server_rounds rounds in this process; return the strategy (with history), contexts, wall."""
    t0 = time.perf_counter()
    strategy = build_strategy(cfg, evaluate=evaluate)
    contexts = make_contexts(cfg)
    strategy.attach({pid: pid for pid in contexts})
    strategy.summary()
    run_rounds(strategy, contexts, cfg.num_server_rounds)
    return strategy, contexts, time.perf_counter() - t0


__all__ = ["make_contexts", "run_inprocess", "run_rounds"]
