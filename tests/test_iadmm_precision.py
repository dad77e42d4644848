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
    residual_gradient,
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


@pytest.mark.parametrize("sensitivity", [None, "clipped"])
def test_blocked_float32_products_equal_the_closed_form(sensitivity: str | None, monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """The numpy backend's float32 residual and gradient, computed block by block over X_p's rows (FUSED_ROWS, a
    partial last block here: 3,000 = 5 x 512 + 440), against the closed form in float64 written out here, with and
    without the per-sample L1 clipping of the "clipped" mode (each x_i (h_i - y_i)^T scaled to L1 norm <= C)."""
    monkeypatch.setenv("FEDAPP_IADMM_BACKEND", "numpy")
    a64, a32 = _agent("float64"), _agent("float32")
    z = np.random.default_rng(5).normal(0.0, 0.05, size=a64.shape)
    s = a64.inputs @ z.T
    h = np.exp(s - s.max(axis=1, keepdims=True))
    r = h / h.sum(axis=1, keepdims=True) - np.eye(10)[a64.labels]
    clip = 20.0
    if sensitivity == "clipped":  # ||x_i (h_i - y_i)^T||_1 = ||x_i||_1 ||h_i - y_i||_1
        norms = np.abs(a64.inputs).sum(axis=1) * np.abs(r).sum(axis=1)
        assert (norms > clip).mean() > 0.5  # the clipping does act on most samples
        r = r * np.minimum(1.0, clip / norms)[:, None]
    want = r.T @ a64.inputs / 60_000 + 2e-6 / 20 * z
    res, g = residual_gradient(a32, z, None, MultinomialObjective(a32, sensitivity, clip)._clip_rows
                               if sensitivity else None)
    assert res.dtype == np.float32 and g.dtype == np.float64
    np.testing.assert_allclose(res, r, rtol=0, atol=1e-6)
    assert np.max(np.abs(g - want)) <= 1e-5 * np.max(np.abs(want))
    g_obj, _ = MultinomialObjective(a32, sensitivity, clip).terms(z.ravel())
    np.testing.assert_array_equal(g_obj, g.ravel())  # the local solve reads the same blocked products


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


def test_the_bench_floors_blocked_and_plain_compute_the_same_round() -> None:
    """``bench --suite iadmm`` times two numpy floors; blocking the rows changes the order of the sums, not the round."""
    from simulations.benchmark import _numpy_floor_round

    rng = np.random.default_rng(2)
    xs = [rng.random((700, 30), dtype=np.float32) for _ in range(3)]
    ys = [np.eye(4, dtype=np.float32)[rng.integers(0, 4, 700)] for _ in range(3)]
    runs = []
    for block in (None, 256):
        zs, lams, w = [np.zeros((4, 30)) for _ in xs], [np.zeros((4, 30)) for _ in xs], np.zeros((4, 30))
        for _ in range(3):
            w = _numpy_floor_round(xs, ys, zs, lams, w, total=2_100, beta=1e-6, rho=10.0, eta=0.1, block=block)
        runs.append((w, zs, lams))
    assert np.abs(runs[0][0]).max() > 1e-4  # the rounds moved w (4.9e-4 here)
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.stack(runs[1][1]), np.stack(runs[0][1]), rtol=1e-5, atol=1e-7)
