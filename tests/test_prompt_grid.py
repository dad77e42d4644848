"""PromptGrid (fedpdm_flower/strategies/base.py), the reproduction app's Grid on deployments: the same replies in
the same order as the wrapped Grid's own ``send_and_receive``, an exchange that ends once every reply is in, and
Flower's ``timeout``. The real deployment Grid runs under it in every `make test-deploy` test."""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedpdm_flower.strategies.base import PromptGrid
from simulations.inprocess import LocalGrid

app = ClientApp()


@app.query()
def echo(msg: Message, context: Context) -> Message:
    """A user's ClientApp: answers with its partition id and what it was sent."""
    n = int(msg.content["config"]["n"])  # type: ignore[arg-type]
    return Message(RecordDict({"metrics": MetricRecord({"pid": int(context.node_config["partition-id"]), "n": n})}),
                   reply_to=msg)


def _messages(grid: LocalGrid) -> list[Message]:
    return [Message(RecordDict({"config": ConfigRecord({"n": 10 * node})}), dst_node_id=node, message_type="query")
            for node in grid.get_node_ids()]


def _seen(replies: Iterable[Message]) -> list[tuple[int, int]]:
    return [(int(r.content["metrics"]["pid"]), int(r.content["metrics"]["n"])) for r in replies]  # type: ignore[arg-type]


class LateGrid(LocalGrid):
    """Replies reach the 'SuperLink' only from the given pull on (counting pulls), as a slow round's do."""

    def __init__(self, *args: object, ready_at_pull: int = 4) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.pulls, self.ready_at_pull = 0, ready_at_pull

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        self.pulls += 1
        return super().pull_messages(message_ids) if self.pulls >= self.ready_at_pull else []


def test_the_replies_are_the_grids_own_in_its_order() -> None:
    theirs = _seen(LocalGrid(app, 5).send_and_receive(_messages(LocalGrid(app, 5)), timeout=10))
    grid = LocalGrid(app, 5)
    ours = _seen(PromptGrid(grid).send_and_receive(_messages(grid), timeout=10))
    assert ours == theirs == [(i, 10 * (i + 1)) for i in range(5)]
    assert list(PromptGrid(grid).get_node_ids()) == list(grid.get_node_ids())  # the rest is the Grid's


def test_it_pulls_until_every_reply_is_in_and_then_stops() -> None:
    grid = LateGrid(app, 3, ready_at_pull=4)
    replies = PromptGrid(grid).send_and_receive(_messages(grid), timeout=30)
    assert _seen(replies) == [(0, 10), (1, 20), (2, 30)]
    assert grid.pulls == 4  # no pull after the last reply


def test_the_timeout_ends_an_exchange_whose_replies_never_come() -> None:
    grid = LateGrid(app, 3, ready_at_pull=10**9)
    t0 = time.monotonic()
    assert PromptGrid(grid).send_and_receive(_messages(grid), timeout=0.5) == []
    assert time.monotonic() - t0 >= 0.5 and grid.pulls >= 2
