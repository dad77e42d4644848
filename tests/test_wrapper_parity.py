"""The wrappers around Flower's FedAvg keep FedAvg's Result and weighting, and screen evaluate replies (issue 23).

The user's app is tests/userapp.py (the template's train and evaluate functions on the user's own linear
regression); everything runs through a real ClientApp (its mods included) on :class:`simulations.inprocess.LocalGrid`.
Independent truth: Flower's own FedAvg on the same app, and weighted means recomputed by hand from what the user's
functions return.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy import FedAvg
from userapp import EVAL_POISONS, D, eval_data, initial, mse, node_data, user_app

from fedpdm_flower.clients.mods import compress_mod, secure_buffers_mod
from fedpdm_flower.fedapp import secagg
from fedpdm_flower.fedapp.robust import GeometricMedian
from fedpdm_flower.strategies.central_dp import CentralDP
from fedpdm_flower.strategies.distributed_dp import DistributedDP
from fedpdm_flower.strategies.wrappers import Compressed, Robust, SecureBuffers, StrategyWrapper
from simulations.inprocess import LocalGrid

N = 8
#: unequal local datasets: a weighted mean differs from the plain one
SIZES = {i: 60 + 50 * i for i in range(N)}
IDENTITIES = {i: secagg.NodeIdentity.generate() for i in range(N)}
TRUST = secagg.TrustStore({i: ident.public_bytes() for i, ident in IDENTITIES.items()})


def fedavg(n: int = N, **kw: Any) -> FedAvg:
    return FedAvg(**{"fraction_train": 1.0, "fraction_evaluate": 1.0, "min_available_nodes": n, "min_train_nodes": n,
                     "min_evaluate_nodes": n, **kw})


def secure_mod() -> Any:
    return secure_buffers_mod(identity=lambda ctx: IDENTITIES[int(ctx.node_config["partition-id"])],
                              trust_store=lambda ctx: TRUST)


def run(strategy: Any, app: Any, rounds: int = 2, n: int = N, **kw: Any) -> Any:
    return strategy.start(grid=LocalGrid(app, n), initial_arrays=initial(), num_rounds=rounds, **kw)


def weighted(values: dict[int, float], weights: dict[int, float]) -> float:
    return sum(values[i] * weights[i] for i in values) / sum(weights[i] for i in values)


# ----------------------------------------------------------------------------- evaluate replies are screened
@pytest.mark.parametrize("kind", EVAL_POISONS)
def test_one_malformed_evaluate_reply_is_dropped_where_flowers_fedavg_fails_or_is_poisoned(kind: str) -> None:
    poison = {0: kind}
    config = ConfigRecord({"user-eval-tag": 3})
    # Flower's own FedAvg: the empty / metric-less / extra-key reply fails the run (InconsistentMessageReplies); the
    # NaN poisons the aggregate; the zero weight is taken as given (notes/flower-1.42.md section 9)
    if kind in ("eval-empty", "eval-no-metrics", "eval-extra-key"):
        with pytest.raises(InconsistentMessageReplies):
            run(fedavg(), user_app(poison=poison, sizes=SIZES), rounds=1, evaluate_config=config)
    elif kind == "eval-nan":
        plain = run(fedavg(), user_app(poison=poison, sizes=SIZES), rounds=1, evaluate_config=config)
        assert np.isnan(plain.evaluate_metrics_clientapp[1]["eval_mse"])
    # every wrapper drops it, logs it, and aggregates the others as FedAvg would
    for wrapper in (StrategyWrapper(fedavg()), Robust(fedavg(), GeometricMedian()),
                    Compressed(fedavg()), SecureBuffers(Robust(fedavg(), GeometricMedian()), buffer_size=4)):
        mods = [compress_mod()] if isinstance(wrapper, Compressed) else (
            [secure_mod()] if isinstance(wrapper, SecureBuffers) else [])
        result = run(wrapper, user_app(poison=poison, sizes=SIZES, mods=mods), rounds=1, evaluate_config=config)
        got = result.evaluate_metrics_clientapp[1]
        model = result.arrays
        honest = {i: mse(model, *eval_data(i)) for i in range(1, N)}
        assert got["eval_mse"] == pytest.approx(weighted(honest, {i: len(eval_data(i)[1]) for i in honest}), rel=1e-9)
        assert got["user_eval_tag"] == pytest.approx(3.0) and "num-examples" not in got
        assert wrapper.diagnostics[1]["screen.evaluate_rejected"] == 1, type(wrapper).__name__


def test_a_train_reply_with_other_metric_keys_is_dropped_where_flowers_fedavg_fails() -> None:
    with pytest.raises(InconsistentMessageReplies):
        run(fedavg(), user_app(poison={2: "extra-key"}), rounds=1)
    wrapper = StrategyWrapper(fedavg())
    result = run(wrapper, user_app(poison={2: "extra-key"}), rounds=1)
    assert wrapper.diagnostics[1]["screen.rejected"] == 1
    assert set(result.train_metrics_clientapp[1]) == {"train_loss"}  # the six others, FedAvg's keys


# ----------------------------------------------------------------------------- the Result is FedAvg's
def test_wrappers_return_fedavgs_result_and_keep_their_figures_apart() -> None:
    train_config = ConfigRecord({"user-tag": 5.0})
    plain = run(fedavg(), user_app(sizes=SIZES), train_config=train_config)
    for wrapper, mods in ((Robust(fedavg(), GeometricMedian()), []), (Compressed(fedavg()), [compress_mod()])):
        result = run(wrapper, user_app(sizes=SIZES, mods=mods), train_config=train_config)
        for field in ("train_metrics_clientapp", "evaluate_metrics_clientapp"):
            assert {r: set(m) for r, m in getattr(result, field).items()} == {
                r: set(m) for r, m in getattr(plain, field).items()}
        assert all(m["user_tag"] == pytest.approx(5.0) for m in result.train_metrics_clientapp.values())
        assert set(wrapper.diagnostics) == {1, 2} and "screen.rejected" in wrapper.diagnostics[1]


def test_a_user_key_in_a_wrappers_namespace_is_refused_before_round_one() -> None:
    grid = LocalGrid(user_app(mods=[compress_mod()]), 4)
    with pytest.raises(ValueError, match=r"compress\.level"):
        Compressed(fedavg(4)).start(grid=grid, initial_arrays=initial(), num_rounds=1,
                                    train_config=ConfigRecord({"compress.level": 3}))
    assert grid.down_bytes == 0  # nothing was sent
    with pytest.raises(ValueError, match=r"secure\.mode"):
        SecureBuffers(fedavg(4), buffer_size=4).start(grid=LocalGrid(user_app(), 4), initial_arrays=initial(),
                                                      num_rounds=1, train_config=ConfigRecord({"secure.mode": 1}))


# ----------------------------------------------------------------------------- weights inside the masks
def test_secure_buffers_keep_fedavgs_weighting_and_the_users_train_metrics() -> None:
    """FedAvg over the buffers is FedAvg over the clients: the model and the train metrics equal plain FedAvg's
    (the weighted means, by num-examples) up to the fixed-point step, although the server sees no client's weight."""
    cfg = ConfigRecord({"user-tag": 2.0})
    plain = run(fedavg(fraction_evaluate=0.0), user_app(sizes=SIZES), rounds=1, train_config=cfg)
    wrapper = SecureBuffers(fedavg(fraction_evaluate=0.0), buffer_size=4)
    secure = run(wrapper, user_app(sizes=SIZES, mods=[secure_mod()]), rounds=1, train_config=cfg)
    w_plain, w_secure = plain.arrays["w"].numpy(), secure.arrays["w"].numpy()
    # the step of the code is 16 / 2^22 = 3.8e-6 on (n_k / 1000) u_k; divided by sum_k n_k / 1000 = 3.2 over the
    # buffers' sums it stays below 1e-5
    np.testing.assert_allclose(w_secure, w_plain, atol=1e-5)
    # what the old count-weighted buffers gave (each client 1): visibly another model
    from userapp import reference_update

    updates = {i: reference_update(i, np.zeros(D), 0.0, SIZES[i])[:D] for i in range(N)}
    by_hand = sum(updates[i] * SIZES[i] for i in range(N)) / sum(SIZES.values())  # FedAvg's weighted mean
    np.testing.assert_allclose(w_plain, by_hand, atol=1e-6)
    unweighted = np.mean(list(updates.values()), axis=0)
    assert np.max(np.abs(unweighted - w_plain)) > 100 * 1e-5
    m_plain, m_secure = plain.train_metrics_clientapp[1], secure.train_metrics_clientapp[1]
    assert set(m_secure) == set(m_plain) == {"train_loss", "user_tag"}
    losses = {i: float(np.mean(node_data(i, SIZES[i])[1] ** 2)) for i in range(N)}  # w = 0: loss = mean y^2
    assert m_secure["train_loss"] == pytest.approx(weighted(losses, SIZES), rel=1e-7)
    assert m_secure["train_loss"] == pytest.approx(m_plain["train_loss"], rel=1e-7)
    assert m_secure["user_tag"] == pytest.approx(2.0, abs=1e-7)
    assert wrapper.diagnostics[1]["secure.clipped_coordinates"] == 0


def test_secure_buffers_count_the_coordinates_their_fixed_point_code_clips() -> None:
    from userapp import reference_update

    clip, max_weight = 0.002, 1000.0
    wrapper = SecureBuffers(fedavg(fraction_evaluate=0.0), buffer_size=4, clip=clip, max_weight=max_weight)
    run(wrapper, user_app(sizes=SIZES, mods=[secure_mod()]), rounds=1)
    by_hand = sum(int(np.count_nonzero(np.abs(reference_update(i, np.zeros(D), 0.0, SIZES[i]) * (SIZES[i] / max_weight))
                                        > clip)) for i in range(N))
    assert by_hand > 0
    assert wrapper.diagnostics[1]["secure.clipped_coordinates"] == by_hand


def test_distributed_dp_averages_models_unweighted_and_metrics_weighted() -> None:
    from userapp import reference_update

    updates = [reference_update(i, np.zeros(D), 0.0, SIZES[i]) for i in range(N)]
    clip = 1.5 * max(float(np.linalg.norm(u)) for u in updates)  # no update is clipped
    wrapper = DistributedDP(fedavg(fraction_evaluate=0.0), epsilon=8.0, num_rounds=1, noise_multiplier=0.0,
                            clip_norm=clip, buffer_size=4)
    result = run(wrapper, user_app(sizes=SIZES, mods=[secure_mod()]), rounds=1)
    mean = np.mean(updates, axis=0)  # each client once
    np.testing.assert_allclose(result.arrays["w"].numpy(), mean[:D], atol=1e-4)
    losses = {i: float(np.mean(node_data(i, SIZES[i])[1] ** 2)) for i in range(N)}
    assert result.train_metrics_clientapp[1]["train_loss"] == pytest.approx(weighted(losses, SIZES), rel=1e-7)
    assert set(result.train_metrics_clientapp[1]) == {"train_loss"}


def test_central_dp_returns_the_sampled_clients_train_metrics() -> None:
    wrapper = CentralDP(fedavg(1, fraction_evaluate=0.0, min_evaluate_nodes=0), epsilon=8.0, clip_norm=1e6,
                        sample_rate=1.0, num_rounds=1, min_available_nodes=N, noise_multiplier=0.0)
    result = run(wrapper, user_app(sizes=SIZES), rounds=1)
    losses = {i: float(np.mean(node_data(i, SIZES[i])[1] ** 2)) for i in range(N)}
    assert result.train_metrics_clientapp[1]["train_loss"] == pytest.approx(weighted(losses, SIZES), rel=1e-9)


# ----------------------------------------------------------------------------- the exact code beside a masked vector
def test_exact_codes_sum_on_the_ring_to_the_exact_fixed_point_sum() -> None:
    rng = np.random.default_rng(0)
    vectors = [np.concatenate([rng.normal(size=5) * 10.0 ** rng.integers(-6, 10, size=5), [-(2.0**35), 0.0]])
               for _ in range(9)]  # the sums stay below EXACT_MAX = 2^39 too
    ring = np.zeros(len(vectors[0]) * secagg.EXACT_LIMBS, dtype=np.uint64)
    for v in vectors:
        ring = (ring + secagg.encode_exact(v)) % 2**32
    got = secagg.decode_exact(ring.astype(np.uint32), len(vectors))
    # the fixed-point sum by hand, in Python integers
    want = np.array([sum(int(np.round(v[j] * 2.0**24)) for v in vectors) / 2**24 for j in range(len(vectors[0]))])
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="finite"):
        secagg.encode_exact([np.nan])
    with pytest.raises(ValueError, match="below"):
        secagg.encode_exact([secagg.EXACT_MAX])
    with pytest.raises(ValueError, match="vectors"):
        secagg.decode_exact(ring.astype(np.uint32), 2**16 + 1)
