"""Tests of the sparsifiers (spec 5, 10.2, 10.3, 10.11) and the sparse wire codec."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from fedpdm_flower.fedapp.compression import (
    MalformedPayload,
    SparseVector,
    decode_vector,
    encode_dense,
    encode_sparse,
    payload_nbytes,
    rand_k,
    resolve_k,
    top_k,
)

# --- resolve_k ---------------------------------------------------------------------------------------------------


def test_resolve_k_spec_tables() -> None:
    alphas = [0.05, 0.1, 0.3, 0.5, 0.7, 0.75, 0.9, 1.0]
    assert [resolve_k(a, 7850) for a in alphas] == [392, 785, 2355, 3925, 5495, 5887, 7065, 7850]
    assert [resolve_k(a, 162) for a in alphas] == [8, 16, 48, 81, 113, 121, 145, 162]
    assert resolve_k(1e-6, 162) == 1


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.01, float("nan")])
def test_resolve_k_rejects_bad_alpha(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        resolve_k(alpha, 10)


def test_uplink_cost_formula() -> None:
    # Spec 10.11: 32 * k * T * K with alpha_U = 1, T = 200, K = 30.
    assert 32 * resolve_k(1.0, 7850) * 200 * 30 == 1_507_200_000
    assert 32 * resolve_k(1.0, 162) * 200 * 30 == 31_104_000


# --- top_k -------------------------------------------------------------------------------------------------------


def test_top_k_spec_example() -> None:
    y = np.array([3.0, -5.0, 1.0, 4.0])
    idx = top_k(y, 2)
    assert idx.dtype == np.int64
    assert idx.tolist() == [1, 3]
    sv = SparseVector.from_dense(y, idx)
    assert sv.values.tolist() == [-5.0, 4.0]
    assert sv.to_dense().tolist() == [0.0, -5.0, 0.0, 4.0]
    full = top_k(y, 4)
    assert np.array_equal(SparseVector.from_dense(y, full).to_dense(), y)


def test_top_k_ties_take_lower_index() -> None:
    y = np.array([1.0, -2.0, 2.0, 0.5, -2.0, 2.0])
    assert top_k(y, 1).tolist() == [1]
    assert top_k(y, 2).tolist() == [1, 2]
    assert top_k(y, 3).tolist() == [1, 2, 4]
    assert top_k(np.zeros(5), 2).tolist() == [0, 1]


@pytest.mark.parametrize("seed", range(5))
def test_top_k_matches_full_sort(seed: int) -> None:
    rng = np.random.default_rng(seed)
    # Rounded values create many magnitude ties.
    y = np.round(rng.normal(size=7850), 1)
    for k in (1, 10, 392, 785, 3925, 7849, 7850):
        expected = np.sort(np.lexsort((np.arange(y.size), -np.abs(y)))[:k])
        assert np.array_equal(top_k(y, k), expected)


def test_top_k_validation() -> None:
    with pytest.raises(ValueError, match="k"):
        top_k(np.ones(3), 0)
    with pytest.raises(ValueError, match="k"):
        top_k(np.ones(3), 4)
    with pytest.raises(ValueError, match="1-D"):
        top_k(np.ones((2, 2)), 1)
    with pytest.raises(ValueError, match="NaN"):
        top_k(np.array([1.0, np.nan]), 1)


# --- rand_k ------------------------------------------------------------------------------------------------------


def test_rand_k_distinct_sorted_seeded() -> None:
    y = np.random.default_rng(0).normal(size=162)
    idx = rand_k(162, 16, np.random.default_rng(42))
    assert idx.dtype == np.int64
    assert idx.size == 16
    assert np.unique(idx).size == 16
    assert np.all(np.diff(idx) > 0)
    assert idx.min() >= 0 and idx.max() < 162
    sv = SparseVector.from_dense(y, idx)
    assert np.array_equal(sv.values, y[idx])
    assert np.array_equal(rand_k(162, 16, np.random.default_rng(42)), idx)
    assert not np.array_equal(rand_k(162, 16, np.random.default_rng(43)), idx)
    assert rand_k(10, 10, np.random.default_rng(0)).tolist() == list(range(10))


def test_rand_k_is_roughly_uniform() -> None:
    rng = np.random.default_rng(5)
    hits = np.zeros(20)
    for _ in range(2000):
        hits[rand_k(20, 5, rng)] += 1
    assert np.all(np.abs(hits / 2000 - 0.25) < 0.05)


# --- SparseVector ------------------------------------------------------------------------------------------------


def test_sparse_vector_normalises_and_validates() -> None:
    sv = SparseVector(indices=np.array([0, 3], dtype=np.uint8), values=np.array([1, 2], dtype=np.float32), dim=4)
    assert sv.indices.dtype == np.int64 and sv.values.dtype == np.float64 and sv.k == 2
    with pytest.raises(ValueError, match="ascending"):
        SparseVector(indices=np.array([3, 0]), values=np.zeros(2), dim=4)
    with pytest.raises(ValueError, match="ascending"):
        SparseVector(indices=np.array([0, 4]), values=np.zeros(2), dim=4)
    with pytest.raises(ValueError, match="equal length"):
        SparseVector(indices=np.array([0]), values=np.zeros(2), dim=4)


# --- codec: round trips and encoding choice ----------------------------------------------------------------------


def _random_sparse(dim: int, k: int, seed: int) -> SparseVector:
    rng = np.random.default_rng(seed)
    idx = rand_k(dim, k, rng)
    return SparseVector(indices=idx, values=rng.normal(size=k), dim=dim)


def rice_reference(indices: NDArray[Any], dim: int) -> bytes:
    """Golomb-Rice code of the gaps written out bit by bit as strings (the textbook definition): the b-bit
    remainders MSB first, byte-padded, then per gap q ones and a zero, byte-padded; b = round(log2(mu ln 2))."""
    k = len(indices)
    b = max(0, round(np.log2((dim - k) / k * np.log(2)))) if 0 < k < dim else 0
    gaps = [int(i) - int(j) - 1 for i, j in zip(indices, [-1, *indices[:-1]], strict=True)]
    rem = "".join(format(g % 2**b, f"0{b}b") if b else "" for g in gaps)
    una = "".join("1" * (g // 2**b) + "0" for g in gaps)

    def pack(bits: str) -> bytes:
        bits += "0" * (-len(bits) % 8)
        return bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))

    return pack(rem) + pack(una)


@pytest.mark.parametrize(
    ("dim", "k"),
    [(7850, 785), (7850, 10), (7850, 7850), (162, 8), (162, 81), (256, 5), (257, 5), (70_000, 3), (100_000, 10_000),
     (13, 13), (1000, 999)],
)
def test_sparse_round_trip_in_the_smallest_index_form(dim: int, k: int) -> None:
    sv = _random_sparse(dim, k, seed=dim + k)
    payload = encode_sparse(sv)
    idx_dtype = np.uint8 if dim <= 256 else np.uint16 if dim <= 65536 else np.uint32
    rice = rice_reference(sv.indices, dim)
    sizes = {"idx": k * np.dtype(idx_dtype).itemsize, "mask": (dim + 7) // 8, "rice": len(rice)}
    form = min(sizes, key=lambda f: sizes[f])  # ties: idx, then mask
    assert set(payload) == {"val", form}
    assert payload["val"].dtype == np.float32
    assert payload[form].dtype == (idx_dtype if form == "idx" else np.uint8)
    if form == "rice":
        assert payload["rice"].tobytes() == rice
    assert payload_nbytes(payload) == 4 * k + sizes[form]
    back = decode_vector(payload, dim, max_k=k)
    assert np.array_equal(back.indices, sv.indices)
    assert np.array_equal(back.values, sv.values.astype(np.float32).astype(np.float64))
    assert back.dim == dim


def test_spec_example_bytes() -> None:
    sv = _random_sparse(7850, 785, seed=0)  # top 10 %: uint16 1570 B, mask 982 B, Rice less
    n = payload_nbytes(encode_sparse(sv))
    assert n == 785 * 4 + len(rice_reference(sv.indices, 7850)) and n < 785 * 4 + 982
    sv = _random_sparse(7850, 10, seed=0)  # uint16 20 B, Rice 15 B
    assert payload_nbytes(encode_sparse(sv)) == 10 * 4 + 15 == 10 * 4 + len(rice_reference(sv.indices, 7850))


def test_top_ten_percent_costs_at_most_an_eighth_of_dense() -> None:
    # the values' float32 alone are 0.1 of dense; a uint16 index list would add 0.05, a bitmask 0.031
    d = 100_000
    v = np.random.default_rng(0).standard_t(3, size=d)
    payload = encode_sparse(SparseVector.from_dense(v, top_k(v, d // 10)))
    assert payload_nbytes(payload) <= 0.125 * 4 * d


def test_sparse_zero_values_survive() -> None:
    sv = SparseVector(indices=np.array([1, 5]), values=np.array([0.0, -0.0]), dim=8)
    for payload in (encode_sparse(sv), {"val": np.zeros(2, np.float32), "idx": np.array([1, 5], np.uint8)}):
        back = decode_vector(payload, 8)
        assert back.indices.tolist() == [1, 5]


def test_mask_with_dim_not_multiple_of_8() -> None:
    sv = SparseVector(indices=np.arange(0, 13, dtype=np.int64), values=np.arange(13.0), dim=13)
    payload = encode_sparse(sv)
    assert set(payload) == {"val", "mask"} and payload["mask"].shape == (2,)
    assert np.array_equal(decode_vector(payload, 13).to_dense(), np.arange(13.0))


def test_dense_round_trip() -> None:
    x = np.random.default_rng(0).normal(size=(10, 785))
    payload = encode_dense(x)
    assert set(payload) == {"dense"} and payload["dense"].dtype == np.float32 and payload["dense"].shape == (7850,)
    back = decode_vector(payload, 7850)
    assert np.array_equal(back.indices, np.arange(7850))
    assert np.array_equal(back.to_dense(), x.reshape(-1).astype(np.float32).astype(np.float64))
    assert payload_nbytes(payload) == 4 * 7850


def test_dense_and_full_sparse_decode_identically() -> None:
    y = np.random.default_rng(1).normal(size=162)
    dense = decode_vector(encode_dense(y), 162)
    sparse = decode_vector(encode_sparse(SparseVector.from_dense(y, top_k(y, 162))), 162)
    assert np.array_equal(dense.indices, sparse.indices)
    assert np.array_equal(dense.values, sparse.values)


def test_decode_accepts_signed_and_float64() -> None:
    back = decode_vector({"val": np.array([1.0, 2.0]), "idx": np.array([0, 9], dtype=np.int32)}, 10)
    assert back.indices.tolist() == [0, 9] and back.values.tolist() == [1.0, 2.0]


# --- codec: malformed payloads -----------------------------------------------------------------------------------

F32 = np.float32


def _val(*v: float) -> NDArray[np.float32]:
    return np.array(v, dtype=F32)


def _mask(dim: int, idx: list[int]) -> NDArray[np.uint8]:
    bits = np.zeros(dim, dtype=bool)
    bits[idx] = True
    return np.packbits(bits)


MALFORMED: list[tuple[str, dict[str, Any], int, int | None, str]] = [
    ("empty", {}, 10, None, "missing"),
    ("val only", {"val": _val(1)}, 10, None, "missing"),
    ("idx only", {"idx": np.array([1], np.uint8)}, 10, None, "missing"),
    ("mask only", {"mask": _mask(10, [1])}, 10, None, "missing"),
    ("extra key", {"val": _val(1), "idx": np.array([1], np.uint8), "x": _val(1)}, 10, None, "unexpected key"),
    ("both idx and mask", {"val": _val(1), "idx": np.array([1], np.uint8), "mask": _mask(10, [1])}, 10, None,
     "unexpected key"),
    ("dense plus val", {"dense": _val(*range(10)), "val": _val(1)}, 10, None, "unexpected key"),
    ("int values", {"val": np.array([1], np.int32), "idx": np.array([1], np.uint8)}, 10, None, "dtype"),
    ("float idx", {"val": _val(1), "idx": np.array([1.0])}, 10, None, "dtype"),
    ("bool idx", {"val": _val(1), "idx": np.array([True])}, 10, None, "dtype"),
    ("int mask", {"val": _val(1), "mask": _mask(10, [1]).astype(np.int16)}, 10, None, "dtype"),
    ("int dense", {"dense": np.arange(10)}, 10, None, "dtype"),
    ("2-D val", {"val": np.ones((1, 1), F32), "idx": np.array([1], np.uint8)}, 10, None, "ndim"),
    ("2-D idx", {"val": _val(1), "idx": np.array([[1]], np.uint8)}, 10, None, "ndim"),
    ("0-D dense", {"dense": np.array(1.0, F32)}, 10, None, "ndim"),
    ("2-D dense", {"dense": np.ones((2, 5), F32)}, 10, None, "ndim"),
    ("list not array", {"val": [1.0], "idx": np.array([1], np.uint8)}, 10, None, "ndarray"),
    ("NaN value", {"val": _val(np.nan), "idx": np.array([1], np.uint8)}, 10, None, "non-finite"),
    ("Inf value", {"val": _val(1, np.inf), "idx": np.array([1, 2], np.uint8)}, 10, None, "non-finite"),
    ("NaN dense", {"dense": np.full(10, np.nan, F32)}, 10, None, "non-finite"),
    ("idx too large", {"val": _val(1), "idx": np.array([10], np.uint8)}, 10, None, "out of range"),
    ("idx negative", {"val": _val(1), "idx": np.array([-1], np.int32)}, 10, None, "out of range"),
    ("huge uint64 idx", {"val": _val(1), "idx": np.array([2**63 + 1], np.uint64)}, 10, None, "out of range"),
    ("duplicate idx", {"val": _val(1, 2), "idx": np.array([3, 3], np.uint8)}, 10, None, "duplicate"),
    ("descending idx", {"val": _val(1, 2), "idx": np.array([4, 3], np.uint8)}, 10, None, "ascending"),
    ("len mismatch", {"val": _val(1, 2), "idx": np.array([3], np.uint8)}, 10, None, "length mismatch"),
    ("mask too short", {"val": _val(1), "mask": np.zeros(1, np.uint8)}, 10, None, "mask' length"),
    ("mask too long", {"val": _val(1), "mask": np.zeros(3, np.uint8)}, 10, None, "mask' length"),
    ("mask popcount", {"val": _val(1, 2), "mask": _mask(10, [1])}, 10, None, "popcount"),
    ("mask padding", {"val": _val(1), "mask": np.array([0, 0b00100000], np.uint8)}, 10, None, "padding"),
    ("oversized idx", {"val": _val(1, 2, 3), "idx": np.array([1, 2, 3], np.uint8)}, 10, 2, "oversized"),
    ("oversized mask", {"val": _val(1, 2, 3), "mask": _mask(10, [1, 2, 3])}, 10, 2, "oversized"),
    ("oversized dense", {"dense": _val(*range(10))}, 10, 5, "oversized"),
    ("dense length", {"dense": _val(*range(9))}, 10, None, "dense' length"),
    # dim 1000, k 2 -> b = 8; indices [3, 700] code as remainders [3, 184] and unary "0" "110": [3, 184, 0b01100000]
    ("rice dtype", {"val": _val(1, 2), "rice": np.array([3, 184, 96], np.int16)}, 1000, None, "dtype"),
    ("rice trailing byte", {"val": _val(1, 2), "rice": np.array([3, 184, 96, 0], np.uint8)}, 1000, None, "length"),
    ("rice no remainders", {"val": _val(1, 2), "rice": np.array([3], np.uint8)}, 1000, None, "length"),
    ("rice few codes", {"val": _val(1, 2), "rice": np.array([3, 184, 255], np.uint8)}, 1000, None, "unary codes"),
    ("rice unary padding", {"val": _val(1, 2), "rice": np.array([3, 184, 0b01100001], np.uint8)}, 1000, None,
     "padding"),
    ("rice out of range", {"val": _val(1, 2), "rice": np.array([255, 0, 0b11100000], np.uint8)}, 1000, None,
     "out of range"),
    ("rice remainder padding", {"val": _val(1), "rice": np.array([0, 1, 0], np.uint8)}, 1000, None, "padding"),
    ("rice only", {"rice": np.array([0], np.uint8)}, 10, None, "missing"),
    ("oversized rice", {"val": _val(1, 2, 3), "rice": np.array([0], np.uint8)}, 10, 2, "oversized"),
]


def test_the_rice_example_of_the_malformed_table_is_valid() -> None:
    back = decode_vector({"val": _val(1, 2), "rice": np.array([3, 184, 96], np.uint8)}, 1000)
    assert back.indices.tolist() == [3, 700]


@pytest.mark.parametrize(
    ("arrays", "dim", "max_k", "match"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_payload_rejected(arrays: dict[str, Any], dim: int, max_k: int | None, match: str) -> None:
    with pytest.raises(MalformedPayload, match=match):
        decode_vector(arrays, dim, max_k=max_k)


def test_malformed_payload_is_value_error() -> None:
    assert issubclass(MalformedPayload, ValueError)


def test_every_index_form_crosses_numpyclients_positional_lists() -> None:
    """Each form the encoder can pick has a payload-format code (fedpdm_flower.fedapp.compression.payload)."""
    from fedpdm_flower.fedapp.compression.payload import from_arrays, to_arrays

    forms = set()
    for dim, k in [(7850, 785), (16, 2), (7850, 7850), (100, 60)]:
        payload = encode_sparse(_random_sparse(dim, k, seed=k))
        forms.add(next(f for f in payload if f != "val"))
        arrays, code = to_arrays(payload)
        back = decode_vector(from_arrays(arrays, code), dim)
        assert np.array_equal(back.indices, decode_vector(payload, dim).indices)
    assert forms == {"idx", "mask", "rice"}
