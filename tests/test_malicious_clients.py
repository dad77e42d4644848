"""A malicious client spoils nothing (issue 18): each bad reply is rejected with its reason, the honest clients
train, and the run ends exactly where a run without that client ends.

A user's numpy least-squares model under our FedAvg (the broadcast family's checks, shared by FedPDM, FedProx,
SCAFFOLD, FedDyn), 5 clients, client 4 malicious in every round. The corruptions act on the real reply the honest
client produced, so everything else about it is well-formed. Independent truth: the run with the 4 honest clients
alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, MetricRecord, RecordDict

from fedpdm_flower.clients.fedavg import FedAvgClient
from fedpdm_flower.fedapp.compression.payload import FORMAT_KEY, to_arrays
from fedpdm_flower.strategies.fedavg import FedAvg
from simulations.inprocess import run_clients

D = 40
TRUE_W = np.linspace(-1.0, 1.0, D)


class LeastSquares:
    """The user's numpy model: mean squared error of a linear map."""

    dim = D

    def grad(self, x: Any, inputs: Any, targets: Any) -> Any:
        return inputs.T @ (inputs @ x - targets) / len(targets)

    def loss(self, x: Any, inputs: Any, targets: Any) -> float:
        return float(np.mean((inputs @ x - targets) ** 2))


def data(pid: int, n: int = 200) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(pid)
    x = rng.normal(size=(n, D))
    return x, x @ TRUE_W + 0.1 * rng.normal(size=n)


def held_out_loss(w: np.ndarray) -> float:
    x, y = data(99, 1000)
    return float(np.mean((x @ w - y) ** 2))


def _arrays(content: RecordDict) -> list[np.ndarray]:
    return content.array_records["arrays"].to_numpy_ndarrays()


def _with(content: RecordDict, arrays: list[np.ndarray] | None = None, metrics: dict[str, Any] | None = None,
          drop: str | None = None) -> RecordDict:
    out = RecordDict({k: v for k, v in content.items() if k != drop})
    if arrays is not None:
        out["arrays"] = ArrayRecord(list(arrays))
    if metrics is not None:
        out["metrics"] = MetricRecord(metrics)
    return out


def _metrics(content: RecordDict) -> dict[str, Any]:
    return dict(content.metric_records["metrics"])


def _sparse(content: RecordDict, **change: Any) -> RecordDict:
    """The reply as 5 (value, index) pairs, one field changed."""
    payload = {"val": _arrays(content)[0][:5], "idx": np.arange(5, dtype=np.uint8), **change}
    arrays, code = to_arrays(payload)
    return _with(content, arrays, {**_metrics(content), FORMAT_KEY: code})


#: kind -> (corruption of the honest reply, a phrase the rejection must contain)
ATTACKS: dict[str, tuple[Callable[[RecordDict], RecordDict], str]] = {
    "NaN value": (lambda c: _with(c, [np.where(np.arange(D) == 3, np.nan, _arrays(c)[0]).astype(np.float32)]),
                  "non-finite"),
    "Inf value": (lambda c: _with(c, [np.full(D, np.inf, np.float32)]), "non-finite"),
    "1e300 in float64": (lambda c: _with(c, [np.full(D, 1e300)]), "beyond float32's range"),
    "3e38 in float32 (finite)": (lambda c: _with(c, [np.full(D, 3e38, np.float32)]), "update norm"),
    "update scaled by 1e4": (lambda c: _with(c, [(_arrays(c)[0] * 1e4).astype(np.float32)]), "update norm"),
    "integer values": (lambda c: _with(c, [_arrays(c)[0].astype(np.int32)]), "dtype"),
    "too short": (lambda c: _with(c, [_arrays(c)[0][:-1]]), "length"),
    "2-D values": (lambda c: _with(c, [_arrays(c)[0].reshape(2, -1)]), "ndim"),
    "an extra array": (lambda c: _with(c, [*_arrays(c), np.zeros(3, np.float32)]), "expects 1 array"),
    "no arrays": (lambda c: _with(c, drop="arrays"), "ArrayRecord"),
    "no metrics": (lambda c: _with(c, drop="metrics"), "MetricRecord"),
    "NaN metric": (lambda c: _with(c, metrics={**_metrics(c), "train_loss": float("nan")}), "non-finite metric"),
    "accuracy 1e300": (lambda c: _with(c, metrics={**_metrics(c), "train_accuracy": 1e300}), "outside [0, 1]"),
    "unknown payload format": (lambda c: _with(c, metrics={**_metrics(c), FORMAT_KEY: 7}), "payload-format"),
    "payload format as float": (lambda c: _with(c, metrics={**_metrics(c), FORMAT_KEY: 0.5}), "payload-format"),
    "payload format as a list": (lambda c: _with(c, metrics={**_metrics(c), FORMAT_KEY: [0.0]}), "payload-format"),
    "sparse instead of dense": (lambda c: _sparse(c), "uploaded values"),
    "index out of range": (lambda c: _sparse(c, idx=np.array([0, 1, 2, 3, 99], np.uint8)), "out of range"),
    "duplicate indices": (lambda c: _sparse(c, idx=np.array([0, 1, 1, 3, 4], np.uint8)), "duplicate"),
    "descending indices": (lambda c: _sparse(c, idx=np.array([4, 3, 2, 1, 0], np.uint8)), "ascending"),
    "negative index": (lambda c: _sparse(c, idx=np.array([-1, 1, 2, 3, 4], np.int8)), "out of range"),
    "float indices": (lambda c: _sparse(c, idx=np.arange(5, dtype=np.float32)), "dtype"),
    "values and indices differ in length": (lambda c: _sparse(c, idx=np.arange(4, dtype=np.uint8)), "length mismatch"),
}


class Malicious:
    """Node 4's client: the honest FedAvgClient's reply, corrupted on its way out."""

    def __init__(self, honest: FedAvgClient, corrupt: Callable[[RecordDict], RecordDict]) -> None:
        self.honest, self.corrupt = honest, corrupt

    def bind(self, context: Context) -> None:
        self.honest.bind(context)

    def handle(self, mtype: str, content: RecordDict) -> RecordDict:
        return self.corrupt(self.honest.handle(mtype, content))


def run(nodes: int, corrupt: Callable[[RecordDict], RecordDict] | None = None, rounds: int = 4) -> Any:
    strategy = FedAvg(min_available_nodes=nodes, eta0=0.05, max_local_steps=5, batch_size=20, seed=0)

    def client_fn(context: Context) -> Any:
        pid = int(context.node_config["partition-id"])
        client = FedAvgClient(LeastSquares(), data(pid), seed=pid)
        return Malicious(client, corrupt) if corrupt is not None and pid == nodes - 1 else client

    initial = ArrayRecord({"w": Array(np.zeros(D, np.float32))})
    run_clients(strategy, client_fn, num_nodes=nodes, num_rounds=rounds, initial_arrays=initial)
    return strategy


@pytest.fixture(scope="module")
def honest_four() -> float:
    return held_out_loss(run(4).global_model())


@pytest.mark.parametrize("kind", list(ATTACKS))
def test_a_malicious_reply_is_rejected_with_its_reason_and_changes_nothing(kind: str, honest_four: float) -> None:
    corrupt, reason = ATTACKS[kind]
    strategy = run(5, corrupt)
    assert strategy.rejected_total == 4  # once per round, the bad client only
    errors = " | ".join(strategy.round_errors())
    assert reason in errors, errors
    # the honest clients trained: the model is the one of a run without the malicious client
    final = held_out_loss(strategy.global_model())
    assert final < 0.5 * held_out_loss(np.zeros(D))
    assert final == pytest.approx(honest_four, rel=1e-9)


def test_the_norm_screen_lets_honest_heterogeneity_through() -> None:
    strategy = run(5)
    assert strategy.rejected_total == 0


def test_the_norm_screen_is_configurable_and_checked() -> None:
    with pytest.raises(ValueError, match="update_norm_factor must be >= 1"):
        FedAvg(min_available_nodes=2, update_norm_factor=0.5)
    with pytest.raises(ValueError, match="max_update_norm"):
        FedAvg(min_available_nodes=2, max_update_norm=-1.0)
    off = FedAvg(min_available_nodes=2, update_norm_factor=None)
    assert off.update_norm_factor is None
