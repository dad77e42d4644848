"""FedREP's rows of the Byzantine table (simulations/byzantine_table.py, issue 16): masked FedREP on the table's task,
with the omniscient adversary living with the devices (SIMULATION ONLY).

Independent truth: the honest updates the adversary is handed are recomputed here with plain torch SGD from w^0 (the
devices' own data order), and with the mean over the buffer means the first round's step is IPM's closed form
``-(n - f - eps f)/n * mean(honest)`` -- which proves that the forged vectors were masked, summed and unmasked.
Then the accuracies of a few short runs, with floors far from the values measured (see each assert).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from flwr.common.logger import FLOWER_LOGGER

from fedpdm_flower.fedapp.robust import GeometricMedian, Mean
from fedpdm_flower.fedapp.sampling import STREAM_CLIENT, rng_for
from simulations.byzantine_table import BATCH, LR, PER, _data, attacks, fedrep_start, run_fedrep

torch.set_num_threads(1)
STEP = 2 * 8.0 / (2**22 - 1)  # the secure aggregation's fixed-point step (fedpdm_flower.fedapp.secagg, clip 8, 2^22 levels)


@pytest.fixture(scope="module")
def data() -> tuple[Any, Any, Any]:
    FLOWER_LOGGER.setLevel(logging.ERROR)
    return _data()


def honest_update_by_hand(w0: torch.nn.Linear, data: tuple[Any, Any, Any], pid: int) -> np.ndarray:
    """w^0 - w_pid^1 (state-dict order) after one pass of SGD (batch 20, lr 0.1) in the device's pass order."""
    from fedpdm_flower.clients.fedrep import STREAM_ORDER

    train, _, order = data
    mine = torch.from_numpy(order[pid * PER:(pid + 1) * PER])
    x, y = train[0][mine], train[1][mine]
    net = torch.nn.Linear(784, 10)
    net.load_state_dict(w0.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    perm = torch.from_numpy(rng_for(pid, STREAM_CLIENT, pid, STREAM_ORDER, 0).permutation(PER))
    for i in range(0, PER, BATCH):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[perm[i:i + BATCH]]), y[perm[i:i + BATCH]]).backward()  # type: ignore[no-untyped-call]
        opt.step()
    flat = [np.concatenate([p.detach().numpy().ravel() for p in m.state_dict().values()]) for m in (w0, net)]
    out: np.ndarray = flat[0].astype(np.float64) - flat[1]
    return out


def test_the_adversary_sees_the_honest_updates_and_its_masked_ipm_vectors_reach_the_sum(data: tuple[Any, Any, Any]) -> None:
    n, f, eps = 8, 2, 10.0
    board: dict[str, np.ndarray] = {}
    s = fedrep_start(Mean(), attacks(f)["IPM 10"], f, data, rounds=1, n=n, board=board)
    idx = s.rs["I"]
    torch.manual_seed(0)
    w0 = torch.nn.Linear(784, 10)  # the run's w^0 (fedrep_start seeds it the same way)
    by_hand = np.array([honest_update_by_hand(w0, data, pid)[idx] for pid in range(f, n)])
    assert board["honest"].shape == (n - f, len(idx)) and 0 < len(idx) < 7850
    np.testing.assert_allclose(board["honest"], by_hand, rtol=0, atol=1e-5)
    assert np.abs(eps * by_hand.mean(axis=0)).max() < 8  # the forged values lie inside the clipping range
    extra = s.history[0].extra
    assert extra["buffers"] == n // 2 and extra["discarded_buffers"] == 0 and s.masked
    # the mean of the buffer means is the mean of the n uploads: ((n - f) mu - f eps mu) / n, up to the step
    w0_flat = np.concatenate([p.detach().numpy().ravel() for p in w0.state_dict().values()]).astype(np.float64)
    step = (n - f - eps * f) / n * by_hand.mean(axis=0)
    np.testing.assert_allclose(s.w[idx].astype(np.float64), w0_flat[idx] - step, rtol=0, atol=STEP + 1e-6)
    rest = np.setdiff1d(np.arange(len(w0_flat)), idx)
    np.testing.assert_array_equal(s.w[rest], w0_flat[rest].astype(np.float32))  # ConSpar: nothing else moved


def test_masked_fedrep_with_a_robust_rule_holds_where_its_mean_collapses(data: tuple[Any, Any, Any]) -> None:
    """IPM(10) from 2 of 12 clients, buffers of 2, 5 rounds. Measured (one seed): the mean 0.803 -> 0.000, the
    geometric median 0.797 -> 0.793."""
    n, f, ipm = 12, 2, attacks(2)["IPM 10"]
    mean_attacked = run_fedrep(Mean(), ipm, f, data, rounds=5, n=n)
    geomed_clean = run_fedrep(GeometricMedian(), attacks(2)["none"], 0, data, rounds=5, n=n)
    geomed_attacked = run_fedrep(GeometricMedian(), ipm, f, data, rounds=5, n=n)
    assert mean_attacked < 0.2  # below chance (0.1 + noise): the forged vectors went through the masked sum
    assert geomed_clean > 0.7
    assert geomed_attacked > geomed_clean - 0.05 and geomed_attacked > mean_attacked + 0.5
