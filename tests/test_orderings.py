"""Spec 10.16-10.17: the paper's qualitative orderings on a small non-IID problem, averaged over fixed seeds.

Only orderings with wide margins are asserted (measured here: no DP 0.35, eps=100 0.27, eps=10 0.11 mean
accuracy of the last 5 rounds; top-k 0.31 vs rand-k 0.15 at alpha_U = 0.1). On this data the eq. (41) model is
not monotone in alpha_U (0.5 scored below 0.1), so that ordering is reported by the reproduction, not asserted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedpdm_flower.fedapp.config import parse_run_config
from simulations.inprocess import run_inprocess

BASE = {"dataset": "synthetic-10class", "partitioner": "paper", "num-clients": 20, "clients-per-round": 10,
        "num-server-rounds": 30, "eta0": 0.1, "gamma": 0.0}


def _score(over: dict[str, Any], seeds: int = 3) -> float:
    out = []
    for s in range(seeds):
        strategy, _, _ = run_inprocess(parse_run_config({**BASE, **over, "seed": s}))
        out.append(np.mean([r.test_accuracy for r in strategy.history[-5:]]))
    return float(np.mean(out))


# one xdist worker runs the whole module: its module-scoped runs would otherwise run once per worker
pytestmark = pytest.mark.xdist_group("orderings")


@pytest.fixture(scope="module")
def scores() -> dict[str, float]:
    return {
        "no-dp": _score({"algorithm": "dp-fedpdm", "dp": False}),
        "eps100": _score({"algorithm": "dp-fedpdm", "epsilon-total": 100.0}),
        "eps10": _score({"algorithm": "dp-fedpdm", "epsilon-total": 10.0}),
        "topk": _score({"algorithm": "bsdp-fedpdm", "dp": False, "alpha-up": 0.1, "alpha-down": 1.0}),
        "randk": _score({"algorithm": "bsdp-fedpdm", "dp": False, "alpha-up": 0.1, "alpha-down": 1.0, "uplink-sparsifier": "randk"}),
    }


def test_accuracy_rises_with_the_privacy_budget(scores: dict[str, float]) -> None:
    assert scores["no-dp"] > scores["eps100"] > scores["eps10"]


def test_topk_beats_randk(scores: dict[str, float]) -> None:
    assert scores["topk"] > scores["randk"]
