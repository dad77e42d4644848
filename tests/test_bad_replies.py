"""Malformed client replies are rejected with the node id logged; the round goes on with the others (and stops the
run when none is left)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from fedpdm_flower.fedapp.client_app import handle
from fedpdm_flower.fedapp.config import parse_run_config
from fedpdm_flower.fedapp.runner import build_strategy
from fedpdm_flower.strategies.base import RoundFailed
from simulations.inprocess import make_contexts

CFG = {"algorithm": "bsdp-fedpdm", "dataset": "synthetic", "partitioner": "iid", "num-clients": 4,
       "clients-per-round": 4, "num-server-rounds": 1, "alpha-up": 0.5, "alpha-down": 1.0}


def _honest_round() -> tuple[object, list[tuple[int, RecordDict]]]:
    cfg = parse_run_config(CFG)
    strategy = build_strategy(cfg)
    ctx = make_contexts(cfg)
    strategy.attach({p: p for p in ctx})
    replies = [(n, handle("train", c, ctx[n])) for n, c in strategy.train_contents(1)]
    return strategy, replies


def _tamper(content: RecordDict, arrays: list[np.ndarray] | None = None, **metrics: float) -> RecordDict:
    arr = content["arrays"].to_numpy_ndarrays() if arrays is None else arrays
    m = dict(content["metrics"])
    m.update(metrics)
    return RecordDict({"arrays": ArrayRecord(arr), "metrics": MetricRecord(m)})


def _bad_variants(good: RecordDict) -> dict[str, RecordDict | str]:
    val, mask = good["arrays"].to_numpy_ndarrays()
    idx = np.flatnonzero(np.unpackbits(mask))[: len(val)].astype(np.uint16)
    nan_val = val.copy()
    nan_val[3] = np.nan
    dup = idx.copy()
    dup[1] = dup[0]
    oob = idx.copy()
    oob[-1] = 60000
    return {
        "nan": _tamper(good, [nan_val, mask]),
        "inf": _tamper(good, [np.full_like(val, np.inf), mask]),
        "wrong shape": _tamper(good, [val[:-3], mask]),
        "duplicate index": _tamper(good, [val, dup], **{"payload-format": 1}),
        "index out of range": _tamper(good, [val, oob], **{"payload-format": 1}),
        "wrong dtype": _tamper(good, [val.astype(np.int32), mask]),
        "oversized": _tamper(good, [np.zeros(84, np.float32)], **{"payload-format": 0}),
        "unknown format": _tamper(good, None, **{"payload-format": 7}),
        "missing metrics": RecordDict({"arrays": good["arrays"]}),
        "missing arrays": RecordDict({"metrics": good["metrics"]}),
        "client error": "ValueError: boom",
    }


@pytest.mark.parametrize("case", list(_bad_variants(_honest_round()[1][0][1])))
def test_malformed_reply_is_rejected_and_round_continues(case: str, caplog: pytest.LogCaptureFixture) -> None:
    strategy, replies = _honest_round()
    reference, ref_replies = _honest_round()
    bad_node = replies[0][0]
    replies[0] = (bad_node, _bad_variants(replies[0][1])[case])
    with caplog.at_level(logging.WARNING, logger="flwr"):
        metrics = strategy.consume_replies(1, replies)  # type: ignore[attr-defined]
    assert metrics["rejected"] == 1.0 and metrics["clients"] == 3.0
    assert any(f"node {bad_node}" in r.getMessage() for r in caplog.records)
    # the round aggregated exactly the three honest replies
    reference.consume_replies(1, ref_replies[1:])  # type: ignore[attr-defined]
    np.testing.assert_array_equal(strategy.x, reference.x)  # type: ignore[attr-defined]


def test_duplicate_and_unknown_nodes_are_rejected() -> None:
    strategy, replies = _honest_round()
    replies.append(replies[1])
    replies.append((999, replies[2][1]))
    metrics = strategy.consume_replies(1, replies)  # type: ignore[attr-defined]
    assert metrics["rejected"] == 2.0 and metrics["clients"] == 4.0


def test_all_replies_bad_stops_the_run_and_keeps_the_model() -> None:
    strategy, replies = _honest_round()
    x = strategy.x.copy()  # type: ignore[attr-defined]
    bad = [(n, "RuntimeError: down") for n, _ in replies[:3]] + [(replies[3][0], _tamper(replies[3][1], loss=float("nan")))]
    with pytest.raises(RoundFailed) as info:
        strategy.consume_replies(1, bad)  # type: ignore[attr-defined]
    assert str(info.value) == ('round 1: no reply accepted (4 of 4 rejected): 3x "RuntimeError: down"; '
                               "1x \"non-finite metric(s) ['loss']\"")
    assert info.value.errors == {"RuntimeError: down": 3, "non-finite metric(s) ['loss']": 1}
    np.testing.assert_array_equal(strategy.x, x)  # type: ignore[attr-defined]
