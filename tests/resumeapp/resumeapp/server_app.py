"""ServerApp: the user's main(), its strategy wrapped in Checkpointed, so that a killed ServerApp started again
(a new `flwr run` with the same run config) continues the run from its last checkpoint."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy

from fedpdm_flower.fedapp.compression import RandK, TopK
from fedpdm_flower.fedapp.privacy import GaussianTarget
from fedpdm_flower.fedapp.robust import GeometricMedian
from fedpdm_flower.strategies.checkpointed import Checkpointed
from fedpdm_flower.strategies.fedpdm import BSDPFedPDM
from fedpdm_flower.strategies.wrappers import Robust, SecureBuffers
from resumeapp.task import evaluate, load_test, make_net

torch.set_num_threads(1)
app = ServerApp()
#: run-config keys that may differ between the killed run and the resumed one (testing and output only)
FREE = ("pid-file", "pause-at-round", "pause-when", "pause-file", "result-path")


def build(rc: Mapping[str, Any]) -> Strategy:
    n, mode = int(rc["min-nodes"]), str(rc["mode"])
    if mode == "fedavg":
        return FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)
    if mode == "secure-robust":
        inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)
        return SecureBuffers(Robust(inner, GeometricMedian()), buffer_size=int(rc["buffer-size"]), seed=int(rc["seed"]))
    if mode == "fedpdm":
        eps = float(rc["epsilon"])
        return BSDPFedPDM(fraction_train=0.75, min_train_nodes=2, min_available_nodes=n, first_round_all=True,
                          fraction_evaluate=1.0 if rc["client-eval"] else 0.0,
                          rho=1.0, gamma=0.0, eta0=0.5, max_local_steps=5, uplink=RandK(0.5), downlink=TopK(0.75),
                          privacy=GaussianTarget(epsilon=eps, delta=1e-5, clip_norm=1.0) if eps > 0 else None,
                          seed=int(rc["seed"]), require_partition_ids=True)
    raise ValueError(f"mode must be fedavg, secure-robust or fedpdm, got {mode!r}")


class PausingGrid:
    """Testing only: write this process's pid to ``path`` and wait (to be killed) either before the first message of
    round ``pause_at`` leaves (``when="before"``: after round pause_at - 1's checkpoint, before any device saw round
    pause_at) or once the devices' replies to round ``pause_at``'s train messages are in (``when="after-replies"``:
    the devices did the round, the server never aggregated it). The kill is a real SIGKILL of the ServerApp's
    process; the pause only picks its moment."""

    def __init__(self, grid: Grid, pause_at: int, path: str, when: str) -> None:
        if when not in ("before", "after-replies"):
            raise ValueError(f"pause-when must be 'before' or 'after-replies', got {when!r}")
        self._grid, self._at, self._path, self._when = grid, pause_at, path, when

    def _ours(self, messages: list[Message]) -> bool:
        return any((cfg := m.content.config_records.get("config")) is not None and cfg.get("server-round") == self._at
                   and m.metadata.message_type == "train" for m in messages)

    def _pause(self) -> None:
        Path(self._path).write_text(f"{os.getpid()} {time.time()}")
        while True:
            time.sleep(60)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        msgs = list(messages)
        if self._when == "before" and self._ours(msgs):
            self._pause()
        replies = list(self._grid.send_and_receive(msgs, timeout=timeout))
        if self._when == "after-replies" and self._ours(msgs):
            self._pause()
        return replies

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        if self._ours(msgs):
            self._pause()
        return self._grid.push_messages(msgs)

    def __getattr__(self, name: str) -> Any:
        if name == "_grid":
            raise AttributeError(name)
        return getattr(self._grid, name)


def run(grid: Any, rc: Mapping[str, Any]) -> dict[str, Any]:
    """The whole run: build, start (resuming from checkpoint-dir if a checkpoint is there), summarise."""
    net, test = make_net(int(rc["seed"])), load_test()

    def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(net, test)
        return MetricRecord({"loss": loss, "accuracy": acc})

    inner = build(rc)
    strategy = Checkpointed(inner, str(rc["checkpoint-dir"]), config={k: v for k, v in rc.items() if k not in FREE})
    if int(rc["pause-at-round"]) > 0:
        grid = PausingGrid(grid, int(rc["pause-at-round"]), str(rc["pause-file"]), str(rc["pause-when"]))
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net(int(rc["seed"])).state_dict()),
                            num_rounds=int(rc["num-server-rounds"]), evaluate_fn=central_eval)
    out: dict[str, Any] = {
        "resumed_from": strategy.resumed_from,
        "token": strategy.token,
        "server": {str(r): dict(m) for r, m in result.evaluate_metrics_serverapp.items()},
        "train": {str(r): {k: v for k, v in m.items() if isinstance(v, float | int)}
                  for r, m in result.train_metrics_clientapp.items()},
        "model": {k: v.numpy().tolist() for k, v in result.arrays.items()},
        # the strategy's own figures of every round (our wrappers and strategies; none for Flower's FedAvg alone)
        "diagnostics": {str(r): dict(m) for r, m in getattr(strategy, "diagnostics", {}).items()},
    }
    if isinstance(inner, BSDPFedPDM):
        spent = inner.privacy_spent()
        out["privacy"] = {"clients": {str(c): p for c, p in inner.client_privacy.items()},
                          "spent": None if spent is None else [spent.epsilon, spent.delta, spent.num_releases],
                          "history_eps": [r.epsilon for r in inner.history]}
    return out


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    if rc["pid-file"]:
        Path(str(rc["pid-file"])).write_text(f"{os.getpid()} {time.time()}")
    out = run(grid, rc)
    if rc["result-path"]:
        Path(str(rc["result-path"])).write_text(json.dumps(out))
    last = out["server"][str(rc["num-server-rounds"])]
    print(f"final accuracy {last.get('accuracy', last.get('test_accuracy'))} (resumed after round "
          f"{out['resumed_from']})", flush=True)
    _ = np  # numpy is the user's too
