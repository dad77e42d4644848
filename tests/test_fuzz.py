"""Property-based fuzzing of everything that decodes untrusted bytes (issue 18), with ``hypothesis``.

The property, for every decoder and validator: any input either decodes to a well-formed value (the right length,
finite, in range) or raises the module's own error naming the problem (``MalformedPayload``, a ``ValueError``) --
never another exception, and never a value that could reach the model malformed. At the strategy level: a round
of arbitrary replies leaves the global model finite, or stops with ``RoundFailed``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedpdm_flower.fedapp.compression import quantize
from fedpdm_flower.fedapp.compression.codec import FLOAT32_MAX, MalformedPayload, decode_vector, encode_sparse
from fedpdm_flower.fedapp.compression.payload import FORMAT_KEY, from_arrays
from fedpdm_flower.fedapp.compression.sparsify import top_k
from fedpdm_flower.strategies.base import RoundFailed
from fedpdm_flower.strategies.fedavg import FedAvg

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = st.sampled_from([np.uint8, np.int8, np.uint16, np.int32, np.uint32, np.int64, np.uint64, np.float16,
                          np.float32, np.float64, np.bool_])


def arrays(max_len: int = 40) -> st.SearchStrategy[np.ndarray]:
    shapes = st.one_of(hnp.array_shapes(min_dims=0, max_dims=2, max_side=max_len), st.just((0,)))
    return DTYPES.flatmap(lambda dt: hnp.arrays(dt, shapes))


KEYS = st.sampled_from(["dense", "val", "idx", "mask", "rice", "qlevels", "x"])
PAYLOADS = st.dictionaries(KEYS, arrays(), max_size=3)


def _well_formed(v: Any, dim: int, max_k: int | None) -> None:
    assert v.dim == dim and len(v.indices) == len(v.values)
    assert np.all(np.diff(v.indices) > 0) and (v.indices.size == 0 or (v.indices[0] >= 0 and v.indices[-1] < dim))
    assert np.all(np.isfinite(v.values)) and np.all(np.abs(v.values) <= FLOAT32_MAX)
    assert max_k is None or v.k <= max_k


@FUZZ
@given(payload=PAYLOADS, dim=st.integers(1, 64), max_k=st.none() | st.integers(0, 64))
def test_decode_vector_accepts_only_well_formed_vectors(payload: dict[str, np.ndarray], dim: int,
                                                         max_k: int | None) -> None:
    try:
        v = decode_vector(payload, dim, max_k=max_k)
    except MalformedPayload:
        return
    _well_formed(v, dim, max_k)


@FUZZ
@given(data=st.data(), dim=st.integers(2, 300), k=st.integers(1, 300))
def test_a_mutated_valid_payload_decodes_well_formed_or_is_refused(data: Any, dim: int, k: int) -> None:
    """Bit flips and truncations of real encodings (every index form), the inputs an attacker would start from."""
    k = min(k, dim)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    y = rng.normal(size=dim)
    from fedpdm_flower.fedapp.compression.codec import SparseVector

    payload = encode_sparse(SparseVector.from_dense(y, top_k(y, k)))
    key = next(f for f in payload if f != "val")
    raw = bytearray(payload[key].tobytes())
    if raw:
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= 1 << data.draw(st.integers(0, 7))
    size = payload[key].dtype.itemsize
    cut = data.draw(st.integers(0, 2)) * size  # drop whole trailing elements
    mutated = np.frombuffer(bytes(raw[: len(raw) - cut] if cut < len(raw) else raw), dtype=payload[key].dtype).copy()
    try:
        v = decode_vector({"val": payload["val"], key: mutated}, dim, max_k=k)
    except MalformedPayload:
        return
    _well_formed(v, dim, k)


@FUZZ
@given(arrs=st.lists(arrays(), max_size=3), code=st.one_of(st.integers(-3, 9), st.floats(allow_nan=True),
                                                           st.booleans(), st.text(max_size=3)))
def test_positional_payloads_refuse_any_code_or_count_mismatch(arrs: list[np.ndarray], code: Any) -> None:
    try:
        got = from_arrays(arrs, code)
    except MalformedPayload:
        return
    assert len(got) == len(arrs) and int(code) == code


@FUZZ
@given(payload=st.dictionaries(KEYS, arrays(64), max_size=2), count=st.none() | st.integers(0, 50))
def test_dpq_neighbour_messages_decode_exactly_or_are_refused(payload: dict[str, np.ndarray], count: int | None) -> None:
    for decode in (quantize.decode_levels, quantize.decode_float32):
        try:
            out = decode(payload, count=count)
        except MalformedPayload:
            continue
        assert out.ndim == 1 and (count is None or out.shape == (count,))
        assert np.all(np.isfinite(out))


@FUZZ
@given(levels=hnp.arrays(np.int64, st.integers(0, 50), elements=st.integers(-(2**62), 2**62)))
def test_level_packing_round_trips_any_int64_levels(levels: np.ndarray) -> None:
    got = quantize.decode_levels(quantize.encode_levels(levels), count=len(levels))
    np.testing.assert_array_equal(got, levels)


METRIC_VALUES = st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True),
                          st.lists(st.floats(allow_nan=True), max_size=3))


@FUZZ
@given(replies=st.lists(st.tuples(st.lists(arrays(8), max_size=2),
                                  st.dictionaries(st.sampled_from([FORMAT_KEY, "train_loss", "train_accuracy",
                                                                   "num-examples", "x"]), METRIC_VALUES, max_size=4),
                                  st.booleans()), min_size=1, max_size=4))
def test_a_strategy_survives_any_replies(replies: list[tuple[list[np.ndarray], dict[str, Any], bool]]) -> None:
    """Arbitrary replies to our FedAvg (dense uplink, d = 8): the round either keeps the model finite and of its
    layout, or stops with RoundFailed quoting the reasons; nothing else escapes."""
    strategy = FedAvg(min_available_nodes=len(replies), min_train_nodes=len(replies), seed=0, eta0=0.1)
    strategy.initialize(ArrayRecord({"w": __import__("flwr").app.Array(np.zeros(8, np.float32))}))
    strategy.prepare(2)
    strategy.attach({i: i for i in range(len(replies))})
    strategy.begin_round(1)
    sent = strategy.checked_train_contents(1)
    contents: list[tuple[int, RecordDict | str]] = []
    for (node, _), (arrs, metrics, with_arrays) in zip(sent, replies, strict=False):
        rd = RecordDict({"metrics": MetricRecord(metrics)})  # type: ignore[arg-type]
        if with_arrays:
            rd["arrays"] = ArrayRecord(list(arrs))
        contents.append((node, rd))
    try:
        strategy.consume_replies(1, contents)
    except RoundFailed:
        return
    x = strategy.global_model()
    assert x.shape == (8,) and np.all(np.isfinite(x)) and np.all(np.abs(x) <= FLOAT32_MAX)
