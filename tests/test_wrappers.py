"""Wrappers around Flower's own FedAvg, with a user's plain ClientApp: compression, reply screening.

The user's app here is Flower's template shape: an ``@app.train()`` function that trains its own numpy linear
regression and replies with its arrays (a float32 weight, a float32 bias and an int64 step counter) and
``num-examples``. The strategy is ``flwr.serverapp.strategy.FedAvg``. Everything runs through a real ClientApp (its
mods included) on :class:`simulations.inprocess.LocalGrid`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from userapp import D, initial, loss, user_app

from fedpdm_flower.clients.mods import MEMORY, compress_mod
from fedpdm_flower.fedapp.compression.codecs import Quantizer, RandK, TopK, codec_from_spec
from fedpdm_flower.strategies.wrappers import Compressed, StrategyWrapper
from simulations.inprocess import LocalGrid


def run(strategy: Any, app: ClientApp, rounds: int = 6, nodes: int = 4) -> tuple[Any, LocalGrid]:
    grid = LocalGrid(app, nodes)
    result = strategy.start(grid=grid, initial_arrays=initial(), num_rounds=rounds)
    return result, grid


def fedavg(**kw: Any) -> FedAvg:
    return FedAvg(**{"fraction_train": 1.0, "fraction_evaluate": 0.0, "min_available_nodes": 4, "min_train_nodes": 4,
                     **kw})


# ----------------------------------------------------------------------------- codecs
@pytest.mark.parametrize("codec", [TopK(0.1), RandK(0.25), Quantizer(4), TopK(1.0)])
def test_codecs_round_trip_and_name_themselves(codec: Any) -> None:
    v = np.random.default_rng(0).normal(size=97)
    rng = np.random.default_rng(1)
    out = codec.decode(codec.encode(v, rng), 97)
    assert codec_from_spec(codec.spec) == codec
    if isinstance(codec, TopK) and not isinstance(codec, RandK):
        keep = np.argsort(-np.abs(v))[: codec.k(97)]
        np.testing.assert_allclose(out[keep], v[keep], rtol=1e-6)  # float32 on the wire
        assert np.count_nonzero(out) == codec.k(97)
    if isinstance(codec, Quantizer):
        step = np.max(np.abs(v)) / codec.max_level
        assert np.all(np.abs(out - v) < step + 1e-12)


def test_the_quantizer_is_unbiased_and_packs_b_bits() -> None:
    v = np.random.default_rng(0).normal(size=50)
    q = Quantizer(3)
    rng = np.random.default_rng(1)
    mean = np.mean([q.decode(q.encode(v, rng), 50) for _ in range(4000)], axis=0)
    step = np.max(np.abs(v)) / q.max_level
    # each coordinate's mean of 4000 draws is within 5 standard errors (sd <= step / 2)
    assert np.all(np.abs(mean - v) < 5 * (step / 2) / np.sqrt(4000))
    payload = q.encode(np.random.default_rng(2).normal(size=1000), rng)
    assert payload["qlevels"].nbytes == 13 + (1000 * 3 + 7) // 8  # header + 3 bits per coordinate


def test_a_codec_refuses_a_forged_payload() -> None:
    code = TopK(0.1).encode(np.arange(100.0))
    with pytest.raises(ValueError, match="k"):
        TopK(0.05).decode(code, 100)  # more entries than the receiver's k
    with pytest.raises(ValueError, match="levels exceed"):
        Quantizer(2).decode(Quantizer(8).encode(np.arange(10.0), np.random.default_rng(0)), 10)
    with pytest.raises(ValueError, match="unknown codec"):
        codec_from_spec("gzip:9")


# ----------------------------------------------------------------------------- Compressed around Flower's FedAvg
def test_compressed_with_lossless_codecs_equals_plain_fedavg() -> None:
    plain, _ = run(fedavg(), user_app())
    comp, _ = run(Compressed(fedavg(), uplink=TopK(1.0), downlink=TopK(1.0)), user_app(mods=[compress_mod()]))
    for k in ("w", "b", "steps"):  # the update travels as float32: equal up to float32 rounding
        np.testing.assert_allclose(comp.arrays[k].numpy(), plain.arrays[k].numpy(), rtol=1e-5, atol=1e-6)
    # the wrapper hands back the layout that was sent; Flower's FedAvg alone turns the int64 counter into float64
    assert [(k, v.numpy().dtype, v.numpy().shape) for k, v in comp.arrays.items()] == [
        ("w", np.float32, (D,)), ("b", np.float32, (1,)), ("steps", np.int64, ())]
    assert plain.arrays["steps"].numpy().dtype == np.float64


def test_compressed_top_k_both_ways_learns_with_a_fraction_of_the_bytes() -> None:
    compressed = Compressed(fedavg(), uplink=TopK(0.1), downlink=TopK(0.25), seed=0)
    comp, grid = run(compressed, user_app(mods=[compress_mod()]), rounds=12)
    assert loss(comp.arrays) < 0.2 * loss(initial())
    no_memory, _ = run(Compressed(fedavg(), uplink=TopK(0.1), downlink=TopK(0.25), seed=0),
                       user_app(mods=[compress_mod(error_feedback=False)]), rounds=12)
    assert loss(comp.arrays) < 0.5 * loss(no_memory.arrays)  # error feedback: what top-k drops is sent later
    m = compressed.diagnostics  # the wrapper's own figures, apart from the Result
    up = sum(m[r]["compress.up_bytes"] for r in m)
    up_dense = sum(m[r]["compress.up_dense_bytes"] for r in m)
    down = sum(m[r]["compress.down_bytes"] for r in range(2, 13))  # round 1 is dense: nobody holds a reference
    down_dense = sum(m[r]["compress.down_dense_bytes"] for r in range(2, 13))
    assert up < 0.5 * up_dense and down < 0.7 * down_dense, (up, up_dense, down, down_dense)
    assert m[1]["compress.down_bytes"] == m[1]["compress.down_dense_bytes"]
    # the error memory on every device is exactly what the codec dropped: kept, not lost
    for ctx in grid.contexts.values():
        assert MEMORY in ctx.state.array_records


def test_error_feedback_sends_everything_eventually() -> None:
    """With e kept, the sum of what was transmitted plus the memory equals the sum of the updates (telescoping)."""
    codec, rng = TopK(0.2), np.random.default_rng(0)
    e = np.zeros(30)
    sent, total = np.zeros(30), np.zeros(30)
    for _ in range(10):
        u = rng.normal(size=30)
        total += u
        v = u + e
        dec = codec.decode(codec.encode(v), 30)
        e = v - dec
        sent += dec
    np.testing.assert_allclose(sent + e, total, atol=1e-5)


def test_a_device_out_of_sync_is_refused_then_resynchronised_densely() -> None:
    strategy = Compressed(fedavg(), uplink=TopK(0.5), downlink=TopK(0.5), seed=0)
    app = user_app(mods=[compress_mod()])
    grid = LocalGrid(app, 4)
    strategy.start(grid=grid, initial_arrays=initial(), num_rounds=2)
    grid.contexts[2].state["compress.reference"] = ArrayRecord({  # node 2 lost its reference
        "w": Array(np.ones(D, np.float32)), "b": Array(np.zeros(1, np.float32)), "steps": Array(np.array(0, np.int64))})
    result = strategy.start(grid=grid, initial_arrays=initial(), num_rounds=3)
    assert strategy.held.get(2) is not None  # after its refusal it got the dense model and is in sync again
    assert loss(result.arrays) < loss(initial())


# ----------------------------------------------------------------------------- screening replies
@pytest.mark.parametrize("kind", ["nan", "shape", "weight"])
def test_a_malformed_reply_is_dropped_not_aggregated(kind: str) -> None:
    clean, _ = run(StrategyWrapper(fedavg(min_train_nodes=3), max_weight=10_000), user_app(), nodes=4)
    wrapper = StrategyWrapper(fedavg(min_train_nodes=3), max_weight=10_000)
    guarded, _ = run(wrapper, user_app(poison={3: kind}), nodes=4)
    assert np.all(np.isfinite(guarded.arrays["w"].numpy()))
    assert loss(guarded.arrays) < 0.5 * loss(initial())
    assert all(wrapper.diagnostics[r]["screen.rejected"] == 1 for r in guarded.train_metrics_clientapp)
    assert loss(clean.arrays) < 0.5 * loss(initial())


def test_flowers_fedavg_alone_is_poisoned_by_one_reply() -> None:
    """Why the screen exists: the same bad reply breaks plain FedAvg (independent truth: Flower's own behaviour)."""
    result, _ = run(fedavg(min_train_nodes=3), user_app(poison={3: "nan"}), nodes=4, rounds=2)
    assert not np.all(np.isfinite(result.arrays["w"].numpy()))


def test_wrappers_keep_the_inner_strategys_members() -> None:
    inner = fedavg()
    w = Compressed(inner, uplink=TopK(0.5))
    assert w.fraction_train == 1.0 and w.inner is inner
    with pytest.raises(TypeError, match="codec"):
        Compressed(inner, uplink="topk")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Message-API Strategy"):
        StrategyWrapper(object())  # type: ignore[arg-type]
    assert isinstance(ConfigRecord({"x": 1}), ConfigRecord)
