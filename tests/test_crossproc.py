"""The cross-process comparison (tests/crossproc.py) admits the stated ulps and nothing more."""

from __future__ import annotations

import numpy as np
import pytest
from crossproc import ONE_STEP_ULPS, assert_same_across_processes


def test_a_few_ulps_pass_more_fail_and_non_floats_compare_exactly() -> None:
    x = np.array([0.1, -3.0, 1e-300, 0.0, np.nan], dtype=np.float64)
    near = x.copy()
    near[:3] = np.nextafter(np.nextafter(x[:3], np.inf), np.inf)  # 2 ulps up
    assert_same_across_processes(near, x, ulps=ONE_STEP_ULPS)
    far = x.copy()
    far[0] += 100 * np.spacing(0.1)
    with pytest.raises(AssertionError, match="1 of 5 entries differ by more than 4 ulps"):
        assert_same_across_processes(far, x, ulps=ONE_STEP_ULPS)
    with pytest.raises(AssertionError):  # zero ulps: bit for bit
        assert_same_across_processes(near, x, ulps=0)
    f32 = x[:2].astype(np.float32)  # the ulp is the array's own dtype's
    assert_same_across_processes(np.nextafter(f32, np.float32(np.inf)), f32)
    with pytest.raises(AssertionError, match="dtype"):
        assert_same_across_processes(f32.astype(np.float64), f32)
    with pytest.raises(AssertionError):  # integers (indices, byte counts) exactly
        assert_same_across_processes(np.array([1, 2]), np.array([1, 3]))
    record = {"round": 2, "acc": 0.5, "bytes": 1024, "name": "a"}
    assert_same_across_processes({**record, "acc": float(np.nextafter(0.5, 1.0))}, record)
    with pytest.raises(AssertionError, match="bytes"):
        assert_same_across_processes({**record, "bytes": 1025}, record)
    with pytest.raises(AssertionError, match="acc"):
        assert_same_across_processes({**record, "acc": 0.5 + 1e-9}, record)
    with pytest.raises(AssertionError):
        assert_same_across_processes(float("inf"), 1.0)
