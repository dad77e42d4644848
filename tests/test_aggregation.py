"""Tests of the server aggregation (spec 10.1, 10.4): soft-thresholding, element-wise and plain means."""

from __future__ import annotations

import numpy as np
import pytest

from fedpdm_flower.fedapp.aggregation import elementwise_mean, plain_mean, prox_l1, soft_threshold
from fedpdm_flower.fedapp.compression import (
    SparseVector,
    decode_vector,
    encode_dense,
    encode_sparse,
    top_k,
)


def _sv(entries: dict[int, float], dim: int) -> SparseVector:
    idx = np.array(sorted(entries), dtype=np.int64)
    return SparseVector(indices=idx, values=np.array([entries[i] for i in sorted(entries)]), dim=dim)


# --- prox (spec 10.1) --------------------------------------------------------------------------------------------


def test_prox_spec_example() -> None:
    u = np.array([0.1, -0.03, -0.2, 0.0])
    assert np.allclose(prox_l1(u, gamma=0.5, rho=10.0), [0.05, 0.0, -0.15, 0.0], rtol=0, atol=1e-15)
    assert np.allclose(soft_threshold(u, 0.05), [0.05, 0.0, -0.15, 0.0], rtol=0, atol=1e-15)


def test_prox_gamma_zero_is_identity_copy() -> None:
    u = np.random.default_rng(0).normal(size=20)
    out = prox_l1(u, gamma=0.0, rho=10.0)
    assert np.array_equal(out, u) and out is not u


def test_soft_threshold_properties() -> None:
    u = np.random.default_rng(1).normal(size=1000)
    out = soft_threshold(u, 0.3)
    assert np.all(out[np.abs(u) <= 0.3] == 0.0)
    assert np.all(np.sign(out[np.abs(u) > 0.3]) == np.sign(u[np.abs(u) > 0.3]))
    assert np.allclose(np.abs(u) - np.abs(out), np.minimum(np.abs(u), 0.3))


def test_prox_validation() -> None:
    with pytest.raises(ValueError, match="gamma"):
        prox_l1(np.zeros(2), -1.0, 10.0)
    with pytest.raises(ValueError, match="rho"):
        prox_l1(np.zeros(2), 0.5, 0.0)
    with pytest.raises(ValueError, match="threshold"):
        soft_threshold(np.zeros(2), -0.1)


# --- element-wise mean (spec 10.4) -------------------------------------------------------------------------------


def test_elementwise_mean_spec_example() -> None:
    a = _sv({0: 1.0, 2: 3.0}, 4)
    b = _sv({0: 3.0, 1: 2.0}, 4)
    mean, counts = elementwise_mean([a, b], 4)
    assert mean.tolist() == [2.0, 2.0, 3.0, 0.0]
    assert counts.tolist() == [2, 1, 1, 0]
    assert counts.dtype == np.int64


def test_transmitted_zero_counts_as_sent() -> None:
    # Spec A10: a sent 0.0 is a value, not a missing coordinate.
    mean, counts = elementwise_mean([_sv({0: 0.0, 1: 4.0}, 3), _sv({0: 6.0}, 3)], 3)
    assert counts.tolist() == [2, 1, 0]
    assert mean.tolist() == [3.0, 4.0, 0.0]


def test_full_index_sets_equal_plain_mean_bitwise() -> None:
    rng = np.random.default_rng(3)
    ys = [rng.normal(size=162) for _ in range(30)]
    dense = [decode_vector(encode_dense(y), 162) for y in ys]
    sparse = [decode_vector(encode_sparse(SparseVector.from_dense(y, top_k(y, 162))), 162) for y in ys]
    expected = plain_mean([y.astype(np.float32) for y in ys])
    for vecs in (dense, sparse):
        mean, counts = elementwise_mean(vecs, 162)
        assert np.all(counts == 30)
        assert np.array_equal(mean, expected)
    stacked = np.stack([y.astype(np.float32) for y in ys])
    assert np.allclose(expected, np.mean(stacked, axis=0, dtype=np.float64), rtol=1e-12)


def test_elementwise_mean_is_unbiased_over_senders() -> None:
    # Spec P1: each coordinate is averaged over the clients that sent it, not diluted by zero padding.
    dim = 50
    rng = np.random.default_rng(4)
    vecs = [_sv({int(j): 2.5 for j in rng.choice(dim, 10, replace=False)}, dim) for _ in range(8)]
    mean, counts = elementwise_mean(vecs, dim)
    assert np.all(mean[counts > 0] == 2.5)
    assert np.all(mean[counts == 0] == 0.0)


def test_elementwise_mean_validation() -> None:
    with pytest.raises(ValueError, match="at least one"):
        elementwise_mean([], 4)
    with pytest.raises(ValueError, match="dim"):
        elementwise_mean([_sv({0: 1.0}, 4), _sv({0: 1.0}, 5)], 4)


def test_plain_mean() -> None:
    assert plain_mean([np.array([1.0, 2.0]), np.array([3.0, 6.0])]).tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="at least one"):
        plain_mean([])
    with pytest.raises(ValueError, match="shape"):
        plain_mean([np.zeros(2), np.zeros(3)])
