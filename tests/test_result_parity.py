"""Our strategies fill Flower's Result as Flower's FedAvg fills it, and follow its message flow (issue 23).

A user's app around our clients: the user's ``@app.train()`` hands each message to the algorithm's client built
from the user's torch model and data (API.md: "inside the user's own @app.train()"), adds its own metric, and
its ``@app.evaluate()`` is its own. Everything runs through a real ClientApp on
:class:`simulations.inprocess.LocalGrid`; the expected numbers are recomputed by hand from the replies the nodes
sent (Flower's weighted mean), and Flower's own ``aggregate_metricrecords`` is the reference of the aggregation.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader
from usertorch import TinyCNN, accuracy, images

from fedpdm_flower.clients.fedpdm import BSDPFedPDMClient
from fedpdm_flower.clients.fedrep import FedREPClient
from fedpdm_flower.clients.secure import SecureDevice
from fedpdm_flower.fedapp.compression import TopK
from fedpdm_flower.fedapp.compression.conspar import ConSpar
from fedpdm_flower.fedapp.robust import Mean
from fedpdm_flower.fedapp.secagg import NodeIdentity, TrustStore
from fedpdm_flower.strategies.base import FederationError
from fedpdm_flower.strategies.fedpdm import BSDPFedPDM
from fedpdm_flower.strategies.fedrep import FedREP
from simulations.inprocess import LocalGrid

torch.set_num_threads(1)
N = 4
SIZES = {i: 24 + 12 * i for i in range(8)}  # unequal: FedAvg's weighting shows
IDENTITIES = [NodeIdentity.generate() for _ in range(N)]
TRUST = TrustStore({i: ident.public_bytes() for i, ident in enumerate(IDENTITIES)})
TEST = images(90, 99)


def client_for(name: str, context: Context) -> Any:
    pid = int(context.node_config["partition-id"])
    loader = DataLoader(images(SIZES[pid], pid), batch_size=12)
    if name == "fedrep":
        return FedREPClient(TinyCNN(), loader, loss_fn=nn.CrossEntropyLoss(), context=context, seed=pid,
                            secure=SecureDevice(IDENTITIES[pid], TRUST, min_buffer=2))
    return BSDPFedPDMClient(TinyCNN(), loader, loss_fn=nn.CrossEntropyLoss(), context=context, seed=pid)


def app_of(name: str = "bsdp", *, eval_poison: dict[int, str] | None = None) -> ClientApp:
    """The user's ClientApp: our client inside the user's train function, the user's own evaluate."""
    app = ClientApp()

    def delegate(action: str, msg: Message, context: Context) -> Message:
        cfg = dict(msg.content.config_records.get("config", ConfigRecord()))
        content = client_for(name, context).handle(action, msg.content)
        if "metrics" in content.metric_records and "user-tag" in cfg:  # the user's own metric beside ours
            content.metric_records["metrics"]["user_tag"] = float(cfg["user-tag"])  # type: ignore[arg-type]
        return Message(content, reply_to=msg)

    app.train()(lambda msg, ctx: delegate("train", msg, ctx))
    app.query("whoami")(lambda msg, ctx: delegate("query.whoami", msg, ctx))
    app.query("propose")(lambda msg, ctx: delegate("query.propose", msg, ctx))
    app.query("unmask")(lambda msg, ctx: delegate("query.unmask", msg, ctx))

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        cfg = msg.content.config_records["config"]
        net = TinyCNN()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())  # type: ignore[union-attr]
        val = images(10 + 5 * pid, 50 + pid)
        metrics: dict[str, Any] = {"eval_acc": accuracy(net, val), "num-examples": len(val),
                                   "user_eval_tag": float(cfg.get("user-eval-tag", -1)),  # type: ignore[arg-type]
                                   "server_round_seen": int(cfg["server-round"])}  # type: ignore[arg-type]
        kind = (eval_poison or {}).get(pid)
        if kind == "empty":
            return Message(RecordDict(), reply_to=msg)
        if kind == "extra-key":
            metrics["surprise"] = 1.0
        if kind == "nan":
            metrics["eval_acc"] = float("nan")
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


class Recorder(LocalGrid):
    """A LocalGrid that keeps what the server sends and receives, and the timeout of every exchange."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.sent: list[Message] = []
        self.replies: list[Message] = []
        self.timeouts: list[tuple[str, float | None]] = []

    def push_messages(self, messages: Any) -> list[str]:
        messages = list(messages)
        self.sent.extend(copy.deepcopy(messages))
        return super().push_messages(messages)

    def pull_messages(self, message_ids: Any) -> list[Message]:
        got = super().pull_messages(message_ids)
        self.replies.extend(copy.deepcopy(got))
        return got

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.timeouts.extend((m.metadata.message_type, timeout) for m in messages)
        return super().send_and_receive(messages, timeout=timeout)


def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    net = TinyCNN()
    net.load_state_dict(arrays.to_torch_state_dict())
    return MetricRecord({"accuracy": accuracy(net, TEST), "my_central_key": float(server_round)})


def bsdp(**kw: Any) -> BSDPFedPDM:
    return BSDPFedPDM(**{"min_available_nodes": N, "min_train_nodes": N, "uplink": TopK(0.5), "seed": 0, "rho": 0.1, "privacy": None,
                         "eta0": 0.2, **kw})


def start(strategy: Any, grid: Any, rounds: int = 2, **kw: Any) -> Any:
    torch.manual_seed(0)
    return strategy.start(grid=grid, initial_arrays=ArrayRecord(TinyCNN().state_dict()), num_rounds=rounds, **kw)


def weighted_mean(replies: list[Message], key: str) -> float:
    ms = [r.content.metric_records["metrics"] for r in replies]
    return sum(float(m[key]) * float(m["num-examples"]) for m in ms) / sum(float(m["num-examples"]) for m in ms)


# ----------------------------------------------------------------------------- the Result
def test_the_result_holds_the_users_evaluate_fn_record_and_flowers_aggregate_of_the_clients_metrics() -> None:
    grid = Recorder(app_of(), N)
    strategy = bsdp()
    result = start(strategy, grid, train_config=ConfigRecord({"user-tag": 4.0}),
                   evaluate_config=ConfigRecord({"user-eval-tag": 9}), evaluate_fn=central)
    # evaluate_metrics_serverapp: the user's records as returned, round 0 (the initial model) included
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]
    for r, m in result.evaluate_metrics_serverapp.items():
        assert dict(m) == {"accuracy": pytest.approx(m["accuracy"]), "my_central_key": float(r)}
        if r:
            assert strategy.history[r - 1].test_accuracy == m["accuracy"]  # and our history has it as before
    # train_metrics_clientapp: Flower's weighted mean (by num-examples, which it leaves out) of what the nodes sent
    for r in (1, 2):
        replies = [m for m in grid.replies if m.metadata.message_type == "train"
                   and m.content.config_records.get("config") is None][(r - 1) * N:r * N]
        got = result.train_metrics_clientapp[r]
        assert "num-examples" not in got and got["user_tag"] == pytest.approx(4.0)
        assert got["train_loss"] == pytest.approx(weighted_mean(replies, "train_loss"), rel=1e-12)
    # evaluate_metrics_clientapp: every node evaluated (fraction_evaluate = 1, Flower's default) with the user's
    # evaluate_config and the round; the weighted mean of their replies
    for r in (1, 2):
        replies = [m for m in grid.replies if m.metadata.message_type == "evaluate"][(r - 1) * N:r * N]
        got = result.evaluate_metrics_clientapp[r]
        assert got["user_eval_tag"] == pytest.approx(9.0) and got["server_round_seen"] == pytest.approx(r)
        assert got["eval_acc"] == pytest.approx(weighted_mean(replies, "eval_acc"), rel=1e-12)
    # our own figures: strategy.diagnostics, one record a round, none of it in the Result
    assert sorted(strategy.diagnostics) == [1, 2]
    assert strategy.diagnostics[1]["clients"] == N and strategy.diagnostics[1]["evaluate_replies"] == N
    assert strategy.diagnostics[1]["uplink_bytes"] > 0 and strategy.diagnostics[1]["evaluate_down_bytes"] > 0
    assert not {"clients", "rejected", "coverage"} & {k for m in result.train_metrics_clientapp.values() for k in m}


def test_client_side_evaluation_samples_fraction_evaluate_and_drops_malformed_replies() -> None:
    grid = Recorder(app_of(eval_poison={0: "empty", 1: "extra-key", 2: "nan"}), 8)
    strategy = bsdp(min_available_nodes=8, min_train_nodes=8, fraction_evaluate=0.75, min_evaluate_nodes=2)
    result = start(strategy, grid, rounds=1, evaluate_config=ConfigRecord({"user-eval-tag": 1}))
    asked = [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert len(asked) == 6  # max(int(8 * 0.75), 2), as Flower's FedAvg samples
    honest = [m for m in grid.replies if m.metadata.message_type == "evaluate"
              and m.metadata.src_node_id - 1 not in (0, 1, 2)]  # node i + 1 has partition i
    got = result.evaluate_metrics_clientapp[1]
    assert got["eval_acc"] == pytest.approx(weighted_mean(honest, "eval_acc"), rel=1e-12)
    poisoned = len([n for n in asked if n - 1 in (0, 1, 2)])
    assert strategy.diagnostics[1]["evaluate_rejected"] == poisoned and "surprise" not in got


# ----------------------------------------------------------------------------- the messages
def test_the_users_train_config_reaches_the_client_and_a_clash_names_the_key() -> None:
    grid = Recorder(app_of(), N)
    start(bsdp(), grid, rounds=1, train_config=ConfigRecord({"user-tag": 1.0, "server-round": 99}))
    sent = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all(m.content.config_records["config"]["user-tag"] == 1.0 for m in sent)
    assert all(m.content.config_records["config"]["server-round"] == 1 for m in sent)  # Flower sets it, as FedAvg
    # "rho" is a key BSDP-FedPDM sends each client: the run stops before a train message goes out
    grid = Recorder(app_of(), N)
    with pytest.raises(ValueError, match=r"\['rho'\].*BSDPFedPDM"):
        start(bsdp(), grid, rounds=1, train_config=ConfigRecord({"rho": 5.0}))
    assert not [m for m in grid.sent if m.metadata.message_type == "train"]
    # "dim" is in every message: refused before anything is sent at all
    grid = Recorder(app_of(), N)
    with pytest.raises(ValueError, match=r"\['dim'\]"):
        start(bsdp(), grid, rounds=1, train_config=ConfigRecord({"dim": 5}))
    assert not grid.sent


def test_configure_train_starts_the_round_from_the_arrays_it_is_given() -> None:
    grid = LocalGrid(app_of(), N)
    strategy = bsdp(downlink=None)  # a dense downlink: the message carries the whole model
    start(strategy, grid, rounds=1)
    torch.manual_seed(5)
    other = ArrayRecord(TinyCNN().state_dict())
    strategy.configure_train(2, other, ConfigRecord(), grid)
    got = strategy.current_arrays()
    for k in other:
        np.testing.assert_array_equal(got[k].numpy(), other[k].numpy())
    torch.manual_seed(5)
    wrong = {k: v for k, v in TinyCNN().state_dict().items() if k != "fc.bias"}
    with pytest.raises(ValueError, match=r"missing \['fc.bias'\]"):
        strategy.configure_train(3, ArrayRecord(wrong), ConfigRecord(), grid)


def test_starts_timeout_bounds_every_exchange_of_a_round() -> None:
    """Masked FedREP has four: the node query (round 1), the propose phase (which trains), the masked train and the
    unmask phase; and the evaluation. Each gets start's timeout (Flower passes it to train and evaluate)."""
    grid = Recorder(app_of("fedrep"), N)
    strategy = FedREP(min_available_nodes=N, conspar=ConSpar(0.5), aggregator=Mean(), seed=0)
    start(strategy, grid, rounds=1, timeout=17.0)
    kinds = {kind for kind, _ in grid.timeouts}
    assert kinds == {"query.whoami", "query.propose", "train", "query.unmask", "evaluate"}
    assert {t for _, t in grid.timeouts} == {17.0}


def test_log_lines_are_flowers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flwr")
    start(bsdp(), LocalGrid(app_of(), N), rounds=1)
    text = caplog.text
    for line in ("configure_train: Sampled 4 nodes (out of 4)", "aggregate_train: Received 4 results and 0 failures",
                 "configure_evaluate: Sampled 4 nodes (out of 4)",
                 "aggregate_evaluate: Received 4 results and 0 failures"):
        assert line in text


# ----------------------------------------------------------------------------- the federation
class Growing(LocalGrid):
    """Nodes 1..first answer from the start; the rest connect once ``later`` seconds have passed (or, with
    ``rounds``, once that many train exchanges have gone by): a federation that grows, as a deployment's does."""

    fixed_federation = False

    def __init__(self, app: Any, n: int, first: int, *, later: float | None = None, rounds: int | None = None) -> None:
        super().__init__(app, n)
        self.first, self.t0, self.later, self.after = first, time.monotonic(), later, rounds
        self.trains = 0

    def get_node_ids(self) -> list[int]:
        grown = ((self.later is not None and time.monotonic() - self.t0 > self.later)
                 or (self.after is not None and self.trains >= self.after))
        return sorted(self.contexts) if grown else sorted(self.contexts)[:self.first]

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.trains += any(m.metadata.message_type == "train" for m in messages)
        return super().send_and_receive(messages, timeout=timeout)


def test_the_strategy_waits_for_min_available_nodes_as_flower_does(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flwr")
    t0 = time.monotonic()
    result = start(bsdp(fraction_evaluate=0.0), Growing(app_of(), N, 2, later=1.5), rounds=1)
    assert time.monotonic() - t0 > 1.5 and result.train_metrics_clientapp[1]
    assert "Waiting for nodes to connect: 2 connected (minimum required: 4)." in caplog.text
    with pytest.raises(FederationError, match="min_available_nodes = 4 but only 2"):  # a bound, when asked for
        start(bsdp(node_wait_s=1.0), Growing(app_of(), N, 2, later=1e9), rounds=1)


def test_nodes_that_connect_after_round_one_join_when_the_algorithm_allows() -> None:
    grid = Growing(app_of(), 6, N, rounds=1)
    strategy = bsdp(fraction_evaluate=0.0)
    start(strategy, grid, rounds=2)
    assert [r.extra["clients"] for r in strategy.history] == [4.0, 6.0]  # round 2 trains the newcomers too
    assert strategy.num_clients == 6
