"""Equality across processes, within a stated number of ulps.

The same code on the same inputs can round differently in two processes. BLAS kernels and numpy's SIMD loops may
split a reduction by the buffer's address alignment (OpenBLAS's AVX-512 ``?sum`` / ``?asum`` kernels peel leading
elements up to a 64-byte boundary, OpenMathLib/OpenBLAS#5972), and where the heap puts an array differs between
processes; library builds and instruction sets differ between machines. Observed: a diagnostic metric
(``primal_residual``) 1 ulp (1.4e-17) apart between a parent and a fresh child process on one 2-core machine,
bit-identical on another.

So a value computed in another process (a Flower ClientApp or ServerApp, a fresh interpreter, a device) is compared
with the in-process one within a few ulps of the larger magnitude, and with exact equality for what is not a float
(integers, strings, byte counts, indices, dtypes, shapes, dictionary keys). Bit for bit stays for comparisons made
inside one process, where the same code runs the same reduction on the same buffer.

The bounds, stated once:

* ``ONE_STEP_ULPS`` = 4: one message answered in two processes (the same arithmetic, a reduction grouped another
  way: 1 ulp observed; 4 leaves room for a sum of a few such terms).
* ``TRAJECTORY_ULPS`` = 64: a few rounds of training compared at the end. Assumption: a one-ulp difference in one
  round propagates through at most a few (contractive or float32-rounded) steps before the comparison, growing by
  less than 16x; a different client sample, noise draw or index set moves the values by many orders of magnitude
  more (about 1e-3 relative and above), so the bound still catches every real divergence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ONE_STEP_ULPS = 4
TRAJECTORY_ULPS = 64


def ulp_distance_ok(actual: np.ndarray, desired: np.ndarray, ulps: int) -> np.ndarray:
    """Element-wise: |actual - desired| <= ulps * spacing(max(|actual|, |desired|)) in the arrays' float type;
    NaNs must sit at the same places, infinities must be equal."""
    a, d = np.asarray(actual), np.asarray(desired)
    dtype = np.result_type(a, d)
    a, d = a.astype(dtype), d.astype(dtype)
    both_nan = np.isnan(a) & np.isnan(d)
    exact = a == d
    with np.errstate(invalid="ignore", over="ignore"):
        scale = np.spacing(np.maximum(np.abs(a), np.abs(d)))
        close = np.abs(a - d) <= ulps * scale
    return both_nan | exact | (close & np.isfinite(a) & np.isfinite(d))


def assert_same_across_processes(actual: Any, desired: Any, *, ulps: int = ONE_STEP_ULPS, what: str = "") -> None:
    """``actual`` (computed in another process) equals ``desired``: floats within ``ulps`` ulps, everything else
    exactly; recurses through dicts, lists and tuples."""
    where = what or "value"
    if isinstance(desired, Mapping):
        assert isinstance(actual, Mapping), f"{where}: {type(actual).__name__} is not a mapping"
        assert sorted(actual) == sorted(desired), f"{where}: keys {sorted(actual)} != {sorted(desired)}"
        for key in desired:
            assert_same_across_processes(actual[key], desired[key], ulps=ulps, what=f"{where}[{key!r}]")
        return
    if isinstance(desired, Sequence) and not isinstance(desired, str | bytes):
        assert isinstance(actual, Sequence) and not isinstance(actual, str | bytes), f"{where}: not a sequence"
        assert len(actual) == len(desired), f"{where}: length {len(actual)} != {len(desired)}"
        for i, (x, y) in enumerate(zip(actual, desired, strict=True)):
            assert_same_across_processes(x, y, ulps=ulps, what=f"{where}[{i}]")
        return
    if isinstance(desired, np.ndarray) or isinstance(actual, np.ndarray):
        a, d = np.asarray(actual), np.asarray(desired)
        assert a.shape == d.shape, f"{where}: shape {a.shape} != {d.shape}"
        assert a.dtype == d.dtype, f"{where}: dtype {a.dtype} != {d.dtype}"
        if np.issubdtype(d.dtype, np.floating):
            ok = ulp_distance_ok(a, d, ulps)
            if not ok.all():
                bad = np.flatnonzero(~ok.ravel())
                i = int(bad[0])
                raise AssertionError(f"{where}: {bad.size} of {d.size} entries differ by more than {ulps} ulps, "
                                     f"first at flat index {i}: {a.ravel()[i]!r} != {d.ravel()[i]!r}")
        else:
            np.testing.assert_array_equal(a, d, err_msg=where)
        return
    if isinstance(desired, float) and not isinstance(desired, bool):
        assert isinstance(actual, float | int) and not isinstance(actual, bool), f"{where}: {actual!r} is not a float"
        ok = bool(ulp_distance_ok(np.float64(actual), np.float64(desired), ulps))
        assert ok, f"{where}: {actual!r} != {desired!r} (more than {ulps} ulps apart)"
        return
    assert actual == desired, f"{where}: {actual!r} != {desired!r}"
