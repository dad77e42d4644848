"""A user's Flower app in the template's shape, shared by the tests of the wrappers and mods.

An ``@app.train()`` function trains the user's own numpy linear regression for 5 gradient steps and replies with
its arrays (a float32 weight, a float32 bias and an int64 step counter), ``num-examples`` and its own metrics
("train_loss", the mean squared residual before the steps, and "user_tag", the train config's "user-tag" when the
user sent one). ``poison`` makes a node reply badly (for the screening tests), attack (``"reverse"``, a
well-formed reversed and scaled update, for the robustness tests) or go offline (``"offline"``, for the dropout
tests). An ``@app.evaluate()`` function scores the model on the node's own validation rows ("eval_mse", and
"user_eval_tag" echoing the evaluate config's "user-eval-tag"); ``poison`` kinds ``"eval-..."`` spoil that reply
instead. ``sizes`` gives nodes other numbers of training rows than 300 (weighting matters then).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

D = 500  # large enough that a payload outweighs the records' fixed serialization overhead (~1 kB per message)
TRUE_W = np.linspace(-1.0, 1.0, D)


@functools.lru_cache(maxsize=64)  # the same rows at every message (a device loads its data once): read-only
def node_data(pid: int, n: int = 300) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(pid)
    x = rng.normal(size=(n, D))
    y = x @ TRUE_W + 0.5 + 0.01 * rng.normal(size=n)
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


#: the evaluate replies ``poison`` can spoil: no records at all, no MetricRecord, an extra metric key, a NaN, a zero
#: weight
EVAL_POISONS = ("eval-empty", "eval-no-metrics", "eval-extra-key", "eval-nan", "eval-zero-weight")


def user_app(*, mods: list[Any] | None = None, poison: dict[int, str] | None = None,
             sizes: dict[int, int] | None = None) -> ClientApp:
    """A user's ClientApp: 5 gradient steps of least squares on its own data (poison: a bad reply, for tests)."""
    app = ClientApp(mods=mods or [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        rec = msg.content["arrays"]
        cfg = msg.content.config_records.get("config", {})
        w, b, steps = (rec[k].numpy().astype(np.float64) for k in ("w", "b", "steps"))
        x, y = node_data(pid, (sizes or {}).get(pid, 300))
        train_loss = float(np.mean((x @ w + b[0] - y) ** 2))
        for _ in range(5):
            r = x @ w + b[0] - y
            w, b = w - 0.1 * x.T @ r / len(y), b - 0.1 * r.mean()
        out = {"w": w.astype(np.float32), "b": b.astype(np.float32), "steps": np.array(steps + 5, np.int64)}
        kind = (poison or {}).get(pid)
        if kind == "offline":
            raise RuntimeError("device went offline")
        if kind == "nan":
            out["w"][0] = np.nan
        elif kind == "shape":
            out["w"] = out["w"][:-1]
        elif kind == "huge":
            out["w"] = np.full(D, 3e38, np.float32)
        elif kind == "reverse":  # a Byzantine node: its honest update, reversed and scaled by 5 (well-formed)
            w0, b0 = (rec[k].numpy().astype(np.float64) for k in ("w", "b"))
            out["w"] = (w0 - 5.0 * (w - w0)).astype(np.float32)
            out["b"] = (b0 - 5.0 * (b - b0)).astype(np.float32)
        metrics: dict[str, Any] = {"num-examples": 1e300 if kind == "weight" else len(y), "train_loss": train_loss}
        if "user-tag" in cfg:
            metrics["user_tag"] = float(cfg["user-tag"])
        if kind == "extra-key":
            metrics["surprise"] = 1.0
        return Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in out.items()}),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        cfg = msg.content.config_records.get("config", {})
        x, y = eval_data(pid)
        metrics: dict[str, Any] = {"eval_mse": mse(msg.content["arrays"], x, y), "num-examples": len(y),
                                   "user_eval_tag": float(cfg.get("user-eval-tag", -1))}
        kind = (poison or {}).get(pid, "")
        if kind == "eval-empty":
            return Message(RecordDict(), reply_to=msg)
        if kind == "eval-no-metrics":
            return Message(RecordDict({"config": ConfigRecord({"note": "no metrics"})}), reply_to=msg)
        if kind == "eval-extra-key":
            metrics["surprise"] = 1.0
        elif kind == "eval-nan":
            metrics["eval_mse"] = float("nan")
        elif kind == "eval-zero-weight":
            metrics["num-examples"] = 0
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def eval_data(pid: int) -> tuple[np.ndarray, np.ndarray]:
    """Node ``pid``'s own validation rows (a different draw than its training rows; 20 + 10 pid of them)."""
    return node_data(1000 + pid, 20 + 10 * pid)


def mse(arrays: ArrayRecord, x: np.ndarray, y: np.ndarray) -> float:
    w, b = arrays["w"].numpy().astype(np.float64), arrays["b"].numpy().astype(np.float64)
    return float(np.mean((x @ w + b[0] - y) ** 2))


def reference_update(pid: int, w: np.ndarray, b: float, n: int = 300) -> np.ndarray:
    """The user's train function recomputed in the clear (``n`` training rows): 5 gradient steps, the update
    w_k - w in float32 (as on the wire)."""
    x, y = node_data(pid, n)
    w0, b0 = w.copy(), b
    for _ in range(5):
        r = x @ w + b - y
        w, b = w - 0.1 * x.T @ r / len(y), b - 0.1 * r.mean()
    return np.concatenate([w.astype(np.float32) - w0.astype(np.float32), [np.float32(b) - np.float32(b0)]])


def initial() -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(D, np.float32)), "b": Array(np.zeros(1, np.float32)),
                        "steps": Array(np.array(0, np.int64))})


def loss(arrays: ArrayRecord) -> float:
    x, y = node_data(99, 500)
    w, b = arrays["w"].numpy(), arrays["b"].numpy()
    return float(np.mean((x @ w + b[0] - y) ** 2))


