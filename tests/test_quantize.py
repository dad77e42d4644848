"""DPQ-DSGD probabilistic quantizer (eq. (3)) and its variable-width wire codec (spec 2.2, 3, 10 "Quantizer").

Statistical tests use fixed seeds, so they are deterministic; the tolerances are still chosen so that a correct
quantizer would pass for (almost) any seed: a 5-sigma z-test has a two-sided false-alarm rate of 5.7e-7 per check.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fedpdm_flower.fedapp.compression.codec import MalformedPayload
from fedpdm_flower.fedapp.compression.quantize import (
    HEADER_BITS,
    WIRE_HEADER_BYTES,
    decode_float32,
    decode_levels,
    decode_message,
    dequantize,
    empirical_entropy_bits,
    encode_float32,
    encode_levels,
    float32_message_bits,
    level_width,
    message_bits,
    quantize,
    quantize_levels,
    quantizer_variance,
)

N_DRAWS = 200_000
VALUES = (0.3, -1.7, 5.55, 1e-9, -3.0)
STEPS = (0.1, 1.0, 5.0)
INT64 = np.iinfo(np.int64)


def _draws(v: float, step: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 17])
    return dequantize(quantize_levels(np.full(N_DRAWS, v), step, rng), step)


# ------------------------------------------------------------------------------------------------------- quantizer


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("v", VALUES)
def test_q1_unbiased(v: float, step: float) -> None:
    # E[Q(v)] = v and Var[Q(v)] <= step^2/4, so the sample mean of N draws has sd <= step / (2 sqrt(N)).
    # |mean - v| < 5 sd is a 5-sigma z-test (CLT; N = 2e5 Bernoulli draws).
    z = _draws(v, step, seed=1)
    sd = math.sqrt(step**2 / 4.0 / N_DRAWS)
    assert abs(z.mean() - v) < 5.0 * sd


def test_q1_example_value() -> None:
    # Spec Q1 example: step 1, v = 0.3 -> a sample mean near 0.2997 (ours differs by seed; within 5 sd = 0.0056).
    assert abs(_draws(0.3, 1.0, seed=1).mean() - 0.3) < 5.0 * 0.5 / math.sqrt(N_DRAWS)


def test_q2_variance_matches_p_one_minus_p() -> None:
    near_grid = set()
    for v in VALUES:
        for step in STEPS:
            z = _draws(v, step, seed=2)
            theory = float(quantizer_variance(np.array([v]), step)[0])
            pq = theory / step**2
            emp = float(z.var())
            if pq >= 0.05:
                # Sample variance of a scaled Bernoulli(p): relative sd = sqrt((1 - 3pq)/pq - 1)/sqrt(N) <= 0.0089 at
                # pq >= 0.05 and N = 2e5, so 5 % is >= 5.6 sd.
                tol = 0.05 * theory
            else:
                near_grid.add((v, step))
                # pq ~ 0: the 5 % rule is meaningless; spec Q2's absolute bound (5 sd of the Bernoulli count plus a
                # 10/N allowance for a single stray draw).
                tol = 5.0 * step**2 * math.sqrt(pq / N_DRAWS) + 10.0 * step**2 / N_DRAWS
            assert abs(emp - theory) <= tol, (v, step, emp, theory)
            assert theory <= step**2 / 4.0
            assert emp <= step**2 / 4.0 + tol
    # Exactly the near-grid cases spec 10 Q2 lists (0.3/0.1 = 2.9999999999999996 etc. in float64).
    assert near_grid == {(1e-9, 0.1), (1e-9, 1.0), (1e-9, 5.0), (0.3, 0.1), (-1.7, 0.1), (-3.0, 0.1), (-3.0, 1.0)}


def test_q2_example_value() -> None:
    # Spec Q2 example: step 1, v = 0.3 -> theory 0.21, empirical ~0.2099.
    assert float(quantizer_variance(np.array([0.3]), 1.0)[0]) == pytest.approx(0.21, rel=1e-12)
    assert _draws(0.3, 1.0, seed=3).var() == pytest.approx(0.21, rel=0.05)


def test_variance_bound_over_many_inputs() -> None:
    # E (Q(v) - v)^2 = step^2 p (1 - p) <= step^2 / 4 for every v, including negative ones; one draw per coordinate.
    rng = np.random.default_rng(4)
    v = rng.normal(0.0, 7.0, size=200_000)
    step = 2.5
    err2 = (quantize(v, step, rng) - v) ** 2
    theory = quantizer_variance(v, step)
    assert np.all(theory <= step**2 / 4.0 + 1e-12)
    assert np.all(err2 <= step**2 + 1e-9)
    # mean(err2) estimates mean(theory); err2 <= step^2 so its sd per draw <= step^2 / 2: 5-sigma z-test.
    assert abs(err2.mean() - theory.mean()) < 5.0 * (step**2 / 2.0) / math.sqrt(v.size)


def test_q3_outputs_on_the_grid() -> None:
    rng = np.random.default_rng(5)
    v = rng.normal(0.0, 20.0, size=10_000)
    for step in (1.0, 5.0, 0.25, 0.1):
        m = quantize_levels(v, step, rng)
        assert m.dtype == np.int64
        low = np.floor(v / step)
        assert np.all((m == low) | (m == low + 1))
        assert np.any(m == low) and np.any(m == low + 1)
        z = quantize(v, step, np.random.default_rng(6))
        assert np.allclose(z / step, np.round(z / step), rtol=0.0, atol=1e-9)


@pytest.mark.parametrize("step", [1.0, 5.0, 0.25])
def test_q3_grid_inputs_exact(step: float) -> None:
    grid = step * np.arange(-7, 8, dtype=np.float64)
    for seed in range(5):
        rng = np.random.default_rng(seed)
        assert np.array_equal(quantize_levels(grid, step, rng), np.arange(-7, 8))
        assert np.array_equal(quantize(grid, step, rng), grid)


def test_q3_grid_input_with_inexact_step() -> None:
    # 0.3 / 0.1 = 2.9999999999999996: p ~ 1 - 4e-16, so the result is 3 * 0.1 = 0.30000000000000004.
    out = quantize(np.full(1000, 0.3), 0.1, np.random.default_rng(7))
    assert np.all(np.abs(out - 0.3) < 1e-12)
    out = quantize(np.full(1000, -3.0), 0.1, np.random.default_rng(8))
    assert np.all(np.abs(out + 3.0) < 1e-12)


def test_q4_off_and_determinism() -> None:
    v = np.random.default_rng(9).normal(size=(4, 5))
    rng = np.random.default_rng(10)
    state = rng.bit_generator.state
    for off in (0, 0.0, None):
        out = quantize(v, off, rng)
        assert np.array_equal(out, v) and out is not v
    assert rng.bit_generator.state == state  # identity consumes no randomness
    a = quantize_levels(v, 0.5, np.random.default_rng([3, 1, 4, 1]))
    b = quantize_levels(v, 0.5, np.random.default_rng([3, 1, 4, 1]))
    assert a.shape == v.shape and np.array_equal(a, b)


def test_uniform_stream_is_data_independent() -> None:
    # Exactly v.size draws of rng.random (grid points included), so counter-based seeds stay aligned (spec 7.6).
    v = np.array([0.0, 1.0, 0.5, -2.25, 3.7])
    rng, ref = np.random.default_rng(11), np.random.default_rng(11)
    m = quantize_levels(v, 1.0, rng)
    u = ref.random(v.size)
    assert rng.bit_generator.state == ref.bit_generator.state
    assert np.array_equal(m, np.floor(v).astype(np.int64) + (u < v - np.floor(v)))


def test_step_to_zero_limit() -> None:
    # |Q(v) - v| <= step for every draw, so Q(v) -> v as step -> 0 (float64 rounding ~1e-15 << 1e-3 step).
    rng = np.random.default_rng(12)
    v = rng.normal(0.0, 3.0, size=5000)
    errs = []
    for step in (1e-1, 1e-3, 1e-5, 1e-7, 1e-9):
        err = np.abs(quantize(v, step, rng) - v)
        assert err.max() <= 1.001 * step
        assert quantizer_variance(v, step).max() <= step**2 / 4.0 * (1 + 1e-9)
        errs.append(err.max())
    assert all(a > b for a, b in itertools.pairwise(errs))


def test_quantizer_rejects_bad_input() -> None:
    rng = np.random.default_rng(0)
    for step in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="q_step"):
            quantize_levels(np.ones(3), step, rng)
    with pytest.raises(TypeError):
        quantize_levels(np.ones(3), True, rng)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_levels(np.array([1.0, math.nan]), 1.0, rng)
    with pytest.raises(ValueError, match="2\\^63"):
        quantize_levels(np.array([1e19]), 1.0, rng)
    with pytest.raises(TypeError):
        dequantize(np.array([0.5]), 1.0)


def test_q5_bit_counting() -> None:
    m = np.arange(-3, 5)  # R = 8 -> 3 bits per coordinate
    assert level_width(m) == 3 and message_bits(m) == 8 * 3 + HEADER_BITS
    assert level_width(np.full(100, -7)) == 0 and message_bits(np.full(100, -7)) == 40
    assert level_width(np.array([0, 8])) == 4  # R = 9 -> ceil(log2 9) = 4
    assert level_width(np.array([], dtype=np.int64)) == 0
    assert level_width(np.array([INT64.min, INT64.max])) == 64
    assert float32_message_bits(44_426) == 32 * 44_426
    assert empirical_entropy_bits(np.full(5, 2)) == 0.0
    assert empirical_entropy_bits(np.arange(-3, 5)) == pytest.approx(3.0)
    assert empirical_entropy_bits(np.array([0, 0, 1, 1, 1, 1, 2, 2])) == pytest.approx(1.5)


# ----------------------------------------------------------------------------------------------------------- codec


def _check_round_trip(m: np.ndarray) -> None:
    payload = encode_levels(m)
    assert set(payload) == {"qlevels"}
    raw = payload["qlevels"]
    assert raw.dtype == np.uint8 and raw.ndim == 1 and np.issubdtype(raw.dtype, np.integer)
    back = decode_levels(payload, count=m.size)
    assert back.dtype == np.int64 and np.array_equal(back, m)
    width = level_width(m)
    assert int(raw[8]) == width
    # Serialized size = header + bit count rounded up to a byte; vs the spec's d*b + 40 rule: 64 header bits + < 8.
    assert raw.nbytes == WIRE_HEADER_BYTES + (m.size * width + 7) // 8
    assert 0 <= 8 * raw.nbytes - message_bits(m) < 72


@pytest.mark.parametrize("span", [0, 1, 2, 7, 8, 100, 255, 256, 65_535, 2**31, 2**40 + 3, 2**62])
def test_codec_round_trip_random_ranges(span: int) -> None:
    rng = np.random.default_rng(span % 1000)
    for n in (1, 7, 8, 9, 1000):
        low = int(rng.integers(-(2**61), 2**61))
        m = low + rng.integers(0, span, size=n, endpoint=True)
        _check_round_trip(m.astype(np.int64))


def test_codec_round_trip_quantized_model_vector() -> None:
    # A realistic message: d = 44,426 (LeNet-5), noise std ~1.17 at Delta = 1 -> 4-5 bits per coordinate.
    rng = np.random.default_rng(13)
    x = rng.normal(0.0, 0.05, size=44_426) + rng.normal(0.0, 5.0**0.1, size=44_426)
    m = quantize_levels(x, 1.0, rng)
    _check_round_trip(m)
    assert level_width(m) in (4, 5)
    assert encode_levels(m)["qlevels"].nbytes < 44_426 * 4 / 6  # > 6x smaller than float32
    assert 0.0 < empirical_entropy_bits(m) < level_width(m)


def test_codec_worst_cases() -> None:
    # All equal -> width 0: the payload is only the header, whatever d is.
    const = np.full(10_000, -123_456_789, dtype=np.int64)
    _check_round_trip(const)
    assert encode_levels(const)["qlevels"].nbytes == WIRE_HEADER_BYTES
    # Negative levels only, a zero-length vector, a single level.
    _check_round_trip(np.array([-5, -1, -3, -4], dtype=np.int64))
    _check_round_trip(np.array([], dtype=np.int64))
    _check_round_trip(np.array([INT64.min], dtype=np.int64))
    # Huge range: the full int64 span needs 64 bits; 2^63 is exactly 64 bits too, 2^63 - 1 is 63.
    _check_round_trip(np.array([INT64.min, INT64.max, 0, -1, 1], dtype=np.int64))
    _check_round_trip(np.array([INT64.max, -1, INT64.max], dtype=np.int64))
    _check_round_trip(np.array([0, INT64.max], dtype=np.int64))
    assert level_width(np.array([0, INT64.max])) == 63
    # Other integer dtypes are accepted (values must fit int64).
    _check_round_trip(np.array([250, 3, 7], dtype=np.uint8).astype(np.int64))
    assert np.array_equal(decode_levels(encode_levels(np.array([250, 3], dtype=np.uint8))), [250, 3])


def test_codec_bit_layout() -> None:
    # [-3, 4, 0]: offset -3, width 3, values [0, 7, 3] -> bits 000 111 011 (+ 7 zero bits) = bytes 0x1D, 0x80.
    raw = encode_levels(np.array([-3, 4, 0]))["qlevels"]
    assert raw[:8].tobytes() == (-3).to_bytes(8, "little", signed=True)
    assert raw[8] == 3
    assert raw[9:13].tobytes() == (3).to_bytes(4, "little")
    assert raw[13:].tolist() == [0b00011101, 0b10000000]


def _forge(offset: int, width: int, count: int, body: list[int]) -> dict[str, np.ndarray]:
    head = offset.to_bytes(8, "little", signed=True) + bytes([width]) + count.to_bytes(4, "little")
    return {"qlevels": np.frombuffer(head + bytes(body), dtype=np.uint8).copy()}


def test_codec_rejects_malformed_payloads() -> None:
    good = encode_levels(np.array([-3, 4, 0]))
    raw = good["qlevels"]
    assert np.array_equal(decode_levels(_forge(-3, 3, 3, [0x1D, 0x80])), [-3, 4, 0])
    cases: list[tuple[object, str]] = [
        ({"qlevels": raw[:12]}, "shorter than its 13-byte header"),
        ({"qlevels": raw[:0]}, "shorter than its 13-byte header"),
        (_forge(0, 65, 1, [0] * 9), "width 65 exceeds 64"),
        (_forge(0, 255, 0, []), "width 255 exceeds 64"),
        ({"qlevels": raw[:-1]}, "count 3 x width 3 needs"),  # body too short for the header's count
        ({"qlevels": np.concatenate([raw, np.zeros(1, np.uint8)])}, "count 3 x width 3 needs"),  # too long
        (_forge(-3, 3, 6, [0x1D, 0x80]), "count 6 x width 3 needs"),  # header count vs body mismatch
        (_forge(0, 0, 3, [0]), "count 3 x width 0 needs"),  # width 0 must have an empty body
        (_forge(-3, 3, 3, [0x1D, 0x81]), "padding bits"),
        (_forge(INT64.max - 1, 2, 2, [0x20]), "overflows int64"),  # levels max - 1 + [0, 2]
        # non-canonical headers (encode_levels never writes them): a padded width, an offset below the minimum
        (_forge(-3, 4, 3, [0x07, 0x30]), "width 4, but the levels span 7 needs 3 bits"),
        (_forge(-4, 4, 3, [0x18, 0x40]), "offset -4 is not the smallest level"),
        (_forge(0, 64, 2, [0] * 15 + [2]), "width 64, but the levels span 2 needs 2 bits"),
        (_forge(5, 0, 0, []), "an empty message has offset 0"),
        ({"qlevels": raw.astype(np.int8)}, "wrong dtype int8"),
        ({"qlevels": raw.reshape(1, -1)}, "wrong ndim 2"),
        ({"qlevels": raw.tolist()}, "not an ndarray"),
        ({}, "exactly the key 'qlevels'"),
        ({"qlevels": raw, "dense": raw}, "exactly the key 'qlevels'"),
    ]
    for payload, message in cases:
        with pytest.raises(MalformedPayload, match=message):
            decode_levels(payload)  # type: ignore[arg-type]
        assert issubclass(MalformedPayload, ValueError)
    with pytest.raises(MalformedPayload, match="header count 3 != expected count 4"):
        decode_levels(good, count=4)
    # A forged huge count is rejected by the length check before anything of that size is allocated.
    with pytest.raises(MalformedPayload, match="needs"):
        decode_levels(_forge(0, 64, 2**32 - 1, [0] * 8))


def test_encoder_rejects_non_integer_levels() -> None:
    with pytest.raises(TypeError, match="integer dtype"):
        encode_levels(np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match="1-D"):
        encode_levels(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="fit in int64"):
        encode_levels(np.array([2**63], dtype=np.uint64))


def test_float32_reference_encoding() -> None:
    x = np.random.default_rng(14).normal(size=1000)
    payload = encode_float32(x)
    assert payload["dense"].dtype == np.float32 and payload["dense"].nbytes * 8 == float32_message_bits(1000)
    back = decode_float32(payload, count=1000)
    assert back.dtype == np.float64 and np.array_equal(back, x.astype(np.float32).astype(np.float64))
    with pytest.raises(MalformedPayload, match="non-finite"):
        decode_float32({"dense": np.array([1.0, np.nan], dtype=np.float32)})
    with pytest.raises(MalformedPayload, match="wrong dtype float64"):
        decode_float32({"dense": x})
    with pytest.raises(MalformedPayload, match="expected count 999"):
        decode_float32(payload, count=999)


def test_decode_message_dispatch() -> None:
    x = np.random.default_rng(15).normal(size=50)
    m = quantize_levels(x, 0.5, np.random.default_rng(16))
    assert np.array_equal(decode_message(encode_levels(m), 0.5, count=50), 0.5 * m)
    assert np.array_equal(decode_message(encode_float32(x), 0.0, count=50), x.astype(np.float32).astype(np.float64))
    assert np.array_equal(decode_message(encode_float32(x), None), x.astype(np.float32).astype(np.float64))
    with pytest.raises(MalformedPayload):  # quantization on: a float message is refused
        decode_message(encode_float32(x), 0.5)
    with pytest.raises(MalformedPayload):  # quantization off: a level message is refused
        decode_message(encode_levels(m), 0.0)


def test_codec_through_flower_array_record() -> None:
    # The payload is one uint8 array; Flower's ArrayRecord adds a constant (npy header + protobuf) overhead.
    flwr_app = pytest.importorskip("flwr.app")
    from fedpdm_flower.fedapp.wire import array_record, recorddict_nbytes

    overheads = []
    for n in (1, 1000, 44_426):
        m = np.random.default_rng(n).integers(-8, 8, size=n)
        raw = encode_levels(m)["qlevels"]
        record = array_record([raw])
        assert np.array_equal(decode_levels({"qlevels": record["0"].numpy()}, count=n), m)
        overheads.append(recorddict_nbytes(flwr_app.RecordDict({"arrays": record})) - raw.nbytes)
    assert max(overheads) < 256
