"""DP-IADMM's products with X_p in float32 (``FEDAPP_IADMM_DTYPE`` / float32 features) against the float64 mode.

Truth: the float64 kernel (which the exact-reference tests of tests/test_iadmm.py pin) and the closed form of the
softmax-regression gradient written out here in float64.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedpdm_flower.fedapp.algorithms.iadmm import (
    DTYPE_VAR,
    AgentData,
    MultinomialObjective,
    gradient,
    products_dtype,
    residual,
)
from fedpdm_flower.fedapp.data import load_partition


def _agent(dtype: str | None) -> AgentData:
    part = load_partition("mnist", "iid", 0, 20, 0)  # 3,000 MNIST samples
    return AgentData(part.x[:, :-1], part.y, 10, 60_000, 1e-6, 20, dtype=dtype)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_float32_products_match_float64_without_upcasting_the_data(backend: str, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    if backend == "torch":
        pytest.importorskip("torch")
    monkeypatch.setenv("FEDAPP_IADMM_BACKEND", backend)
    a64, a32 = _agent("float64"), _agent("float32")
    assert a64.inputs.dtype == np.float64 and a32.inputs.dtype == np.float32 and a32.onehot.dtype == np.float32
    z = np.random.default_rng(3).normal(0.0, 0.05, size=a64.shape)
    # the closed form, by hand: (1/I) X^T (softmax(X z^T) - Y) + (2 beta / P) z
    s = a64.inputs @ z.T
    h = np.exp(s - s.max(axis=1, keepdims=True))
    h /= h.sum(axis=1, keepdims=True)
    want = (h - np.eye(10)[a64.labels]).T @ a64.inputs / 60_000 + 2e-6 / 20 * z
    r32 = residual(a32, z)
    assert r32.dtype == np.float32  # the scores and the residual stay float32
    g32, g64 = gradient(a32, z, r32), gradient(a64, z, residual(a64, z))
    assert g32.dtype == np.float64 and g64.dtype == np.float64
    np.testing.assert_allclose(g64, want, rtol=1e-12, atol=1e-16)
    assert np.max(np.abs(g32 - want)) <= 1e-5 * np.max(np.abs(want))
    # the paper's sensitivity (computed from the float32 residual) agrees to float32 rounding
    d32 = MultinomialObjective(a32, "paper").terms(z.ravel())[1]
    d64 = MultinomialObjective(a64, "paper").terms(z.ravel())[1]
    assert d32 == pytest.approx(d64, rel=1e-5)


def test_precision_follows_the_features_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    x64, x32 = np.zeros((2, 3)), np.zeros((2, 3), dtype=np.float32)
    monkeypatch.delenv(DTYPE_VAR, raising=False)
    assert products_dtype(x64) is np.float64 and products_dtype(x32) is np.float32
    monkeypatch.setenv(DTYPE_VAR, "float32")
    assert products_dtype(x64) is np.float32 and products_dtype(x32, "float64") is np.float64
    monkeypatch.setenv(DTYPE_VAR, "half")
    with pytest.raises(ValueError, match=DTYPE_VAR):
        products_dtype(x64)


# two 15-round runs on 60,000 samples: 18 s on a quiet 2-core machine (67 s once on a heavily loaded one)
def test_float32_test_error_within_a_tenth_of_a_point_of_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-private ObjP on MNIST (2 agents of 30,000 samples, 15 rounds): the float32 run's test error is within 0.1
    percentage point of the float64 run's."""
    from fedpdm_flower.fedapp.config import parse_run_config
    from simulations.inprocess import run_inprocess

    raw = {"algorithm": "objp", "dp": False, "dataset": "mnist", "partitioner": "iid", "num-clients": 2,
           "clients-per-round": 2, "model": "multinomial-nobias", "num-server-rounds": 15, "eval-every": 15}
    errors = {}
    for dtype in ("float64", "float32"):
        monkeypatch.setenv(DTYPE_VAR, dtype)
        strategy, _, _ = run_inprocess(parse_run_config(raw))
        errors[dtype] = 100.0 * (1.0 - strategy.history[-1].test_accuracy)
    assert errors["float64"] < 20.0  # it did learn
    assert abs(errors["float32"] - errors["float64"]) <= 0.1, errors
