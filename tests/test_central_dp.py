"""CentralDP around Flower's FedAvg: DP-FedAvg with secret Poisson sampling, its calibration and its accounting.

Independent truth: the update the formula gives from the clients' own (deterministic) updates, recomputed here;
Opacus's RDP analysis of the Poisson-subsampled Gaussian as a second accountant; a binomial test of the sampling.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
from flwr.app import Message
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import FedAvg
from userapp import D, initial, reference_update, user_app

from fedpdm_flower.fedapp.privacy.pld import poisson_epsilon, poisson_noise_multiplier_for
from fedpdm_flower.strategies.central_dp import CentralDP
from simulations.inprocess import LocalGrid

N = 20


def fedavg(**kw: Any) -> FedAvg:
    return FedAvg(**{"fraction_train": 1.0, "min_train_nodes": 1, "min_available_nodes": 1, "fraction_evaluate": 0.0,
                     **kw})


class Recorder(LocalGrid):
    """Keeps which nodes got a train message each round, and the replies."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.sent: list[list[int]] = []
        self.replies: list[Message] = []

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.sent.append([m.metadata.dst_node_id for m in messages])
        got = super().send_and_receive(messages, timeout=timeout)
        self.replies.extend(copy.deepcopy(got))
        return got



@pytest.mark.parametrize(("epsilon", "q", "rounds"), [(1.0, 0.1, 10), (8.0, 0.05, 100)])
def test_the_calibration_spends_the_target_and_opacus_rdp_bounds_it(epsilon: float, q: float, rounds: int) -> None:
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    z = poisson_noise_multiplier_for(epsilon, 1e-5, q, rounds)
    assert poisson_epsilon(z, q, rounds, 1e-5) == pytest.approx(epsilon, rel=1e-3)
    assert poisson_epsilon(z, q, rounds, 1e-5) <= epsilon
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 256))
    eps_rdp, _ = get_privacy_spent(orders=orders, rdp=compute_rdp(q=q, noise_multiplier=z, steps=rounds,
                                                                  orders=orders), delta=1e-5)
    assert epsilon < eps_rdp < 1.5 * epsilon  # a second library: RDP is an upper bound, and not far off
    # amplification: without sampling the same target needs far more noise
    from fedpdm_flower.fedapp.privacy import gdp

    assert gdp.noise_multiplier_for(epsilon, 1e-5, rounds) > 2 * z


def test_one_round_is_the_formula_on_the_clients_own_updates() -> None:
    """No noise and C large: w + sum_{k in S} (w_k - w) / (q N), with S the nodes that got a message."""
    grid = Recorder(user_app(), N)
    s = CentralDP(fedavg(), epsilon=8.0, clip_norm=1e6, sample_rate=0.5, num_rounds=3, min_available_nodes=N,
                  noise_multiplier=0.0)
    res = s.start(grid=grid, initial_arrays=initial(), num_rounds=1)
    sampled = sorted(next(nodes for nodes in grid.sent if nodes))
    assert 0 < len(sampled) < N
    total = sum(reference_update(node - 1, np.zeros(D), 0.0) for node in sampled)  # node i has partition i - 1
    want = total / (0.5 * N)
    got = np.concatenate([res.arrays["w"].numpy(), res.arrays["b"].numpy()])
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-5, atol=1e-6)
    m = s.diagnostics[1]
    assert m["central_dp.sampled"] == len(sampled) and m["central_dp.clipped"] == 0
    assert int(res.arrays["steps"].numpy()) == 0  # the integer entry: carried as sent (not averaged)


def test_every_update_is_clipped_to_c() -> None:
    grid = Recorder(user_app(), N)
    s = CentralDP(fedavg(), epsilon=8.0, clip_norm=1e-3, sample_rate=0.5, num_rounds=3, min_available_nodes=N,
                  noise_multiplier=0.0)
    res = s.start(grid=grid, initial_arrays=initial(), num_rounds=1)
    m = s.diagnostics[1]
    sampled = next(nodes for nodes in grid.sent if nodes)
    assert m["central_dp.clipped"] == m["central_dp.sampled"] == len(sampled)
    got = np.concatenate([res.arrays["w"].numpy(), res.arrays["b"].numpy()])
    assert np.linalg.norm(got) <= len(sampled) * 1e-3 / (0.5 * N) * (1 + 1e-5)


def test_the_sample_is_poisson_at_rate_q() -> None:
    grid = Recorder(user_app(), N)
    s = CentralDP(fedavg(), epsilon=50.0, clip_norm=1.0, sample_rate=0.3, num_rounds=40, min_available_nodes=N,
                  noise_multiplier=0.0)  # the sampling does not depend on the noise; no accounting: fast
    s.start(grid=grid, initial_arrays=initial(), num_rounds=40)
    counts = [s.diagnostics[r]["central_dp.sampled"] for r in range(1, 41)]  # every node answers
    mean, se = np.mean(counts), math.sqrt(N * 0.3 * 0.7 / 40)
    assert abs(mean - N * 0.3) < 5 * se  # 5 standard errors: a chance failure in about 6e-7 runs (4: 7e-5)
    assert len({tuple(sorted(n)) for n in grid.sent if n}) > 30  # a fresh draw each round


def test_an_empty_sample_still_releases_the_noise() -> None:
    s = CentralDP(fedavg(), epsilon=8.0, clip_norm=1.0, sample_rate=1e-9, num_rounds=2, min_available_nodes=N,
                  noise_multiplier=1.0)
    grid = Recorder(user_app(), N)
    res = s.start(grid=grid, initial_arrays=initial(), num_rounds=1)
    assert not any(grid.sent)  # nobody was asked to train
    assert s.diagnostics[1]["central_dp.sampled"] == 0
    assert np.std(res.arrays["w"].numpy()) > 1e6  # noise z C / (q N) with q N = 2e-8: the model is noise
    assert s.privacy_spent().num_releases == 1


def test_the_run_stops_before_a_round_past_the_target() -> None:
    s = CentralDP(fedavg(), epsilon=4.0, clip_norm=1.0, sample_rate=0.25, num_rounds=3, min_available_nodes=N)
    with pytest.raises(PrivacyBudgetExhausted, match="round 4"):
        s.start(grid=LocalGrid(user_app(), N), initial_arrays=initial(), num_rounds=6)
    spent = s.privacy_spent()
    assert spent.num_releases == 3 and spent.epsilon == pytest.approx(4.0, rel=1e-3) and spent.epsilon <= 4.0


def test_what_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="samples the clients itself"):
        CentralDP(FedAvg(fraction_train=0.1), epsilon=1.0, num_rounds=3)
    with pytest.raises(ValueError, match="sample_rate"):
        CentralDP(fedavg(), epsilon=1.0, num_rounds=3, sample_rate=0.0)
    with pytest.raises(ValueError, match="outside the calibrated range"):
        CentralDP(fedavg(), epsilon=500.0, num_rounds=1, sample_rate=0.01)
