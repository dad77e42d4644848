"""Our robust aggregators and pre-aggregators against ByzFL's (``byzfl``, EPFL's library; a test-only dependency).

Inputs: random honest rows plus outliers of a much larger scale, so that a wrong rule would give a visibly wrong
answer. Where the two libraries define a rule differently, the test pins the documented mapping:

* Krum / Multi-Krum: ByzFL scores a row by its n - f - 1 nearest neighbours; Blanchard et al. (2017, Def. 1), and
  we, by n - f - 2. Our ``Krum(f - 1)`` is ByzFL's ``Krum(f)``, and ByzFL's ``MultiKrum(f)`` averages m = n - f rows.
* Geometric median: ByzFL runs T smoothed Weiszfeld steps from 0; ours starts from the mean by default (spec 11.7),
  and with ``init="zeros"`` the iterates are the same.
* Trimmed mean: ByzFL trims f per side, ours ``floor(trim_fraction n)`` per side.
* Bucketing: ByzFL draws its permutation from numpy's global RNG, ours from a Generator the caller seeds; the test
  gives both the same permutation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from fedpdm_flower.fedapp.robust import (
    Bucketing,
    CenteredClipping,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    NearestNeighborMixing,
    TrimmedMean,
)

N, F, D = 13, 4, 37


@pytest.fixture(scope="module")
def byzfl() -> Any:
    """ByzFL, imported when a test here runs, not when the suite is collected: its package imports its benchmark
    (torchvision's models, seaborn, matplotlib), about 3 s of every test process's start-up."""
    import byzfl as module

    return module


def rows(seed: int) -> NDArray[np.float64]:
    rng = np.random.default_rng(seed)
    honest = rng.normal(size=(N - F, D))
    outliers = rng.normal(loc=30.0, scale=10.0, size=(F, D))  # far away, and spread so no two coincide
    out = np.concatenate([honest, outliers])
    return out[rng.permutation(N)]  # the outliers anywhere, not last


SEEDS = range(5)


@pytest.mark.parametrize("seed", SEEDS)
def test_coordinate_median(seed: int, byzfl: Any) -> None:
    x = rows(seed)
    np.testing.assert_allclose(CoordinateMedian()(x), byzfl.Median()(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_trimmed_mean(seed: int, byzfl: Any) -> None:
    x = rows(seed)
    np.testing.assert_allclose(TrimmedMean(F / N)(x), byzfl.TrMean(f=F)(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_geometric_median_from_zero(seed: int, byzfl: Any) -> None:
    x = rows(seed)
    ours = GeometricMedian(iters=3, nu=0.1, init="zeros")(x)
    np.testing.assert_allclose(ours, byzfl.GeometricMedian(nu=0.1, T=3)(x), rtol=1e-12, atol=1e-12)
    # run long enough, both reach the one geometric median whatever the start
    np.testing.assert_allclose(GeometricMedian(iters=300, nu=1e-9)(x), byzfl.GeometricMedian(nu=1e-9, T=300)(x),
                               rtol=0, atol=1e-8)


@pytest.mark.parametrize("seed", SEEDS)
def test_krum_counts_one_more_neighbour_in_byzfl(seed: int, byzfl: Any) -> None:
    x = rows(seed)
    np.testing.assert_array_equal(Krum(F - 1)(x), byzfl.Krum(f=F)(x))
    np.testing.assert_allclose(Krum(F - 1, m=N - F)(x), byzfl.MultiKrum(f=F)(x), rtol=0, atol=1e-12)
    # and the rule does its job in both: the pick is an honest row, not one of the outliers
    assert np.abs(Krum(F)(x)).max() < 10


@pytest.mark.parametrize("seed", SEEDS)
def test_centered_clipping_from_zero(seed: int, byzfl: Any) -> None:
    x = rows(seed)
    ours = CenteredClipping(tau=2.0, iters=3)(x)
    np.testing.assert_allclose(ours, byzfl.CenteredClipping(L=3, tau=2.0)(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_nearest_neighbour_mixing(seed: int, byzfl: Any) -> None:
    x = rows(seed)
    np.testing.assert_allclose(NearestNeighborMixing(F)(x), byzfl.NNM(f=F)(x), rtol=0, atol=1e-12)


class _Fixed:
    """A generator stand-in that returns a given permutation."""

    def __init__(self, perm: NDArray[Any]) -> None:
        self.perm = perm

    def permutation(self, n: int) -> NDArray[Any]:
        assert n == len(self.perm)
        return self.perm


@pytest.mark.parametrize(("seed", "size"), [(0, 2), (1, 3), (2, 4), (3, 13)])
def test_bucketing_with_the_same_permutation(seed: int, size: int, byzfl: Any) -> None:
    x = rows(seed)
    np.random.seed(seed)
    perm = np.random.permutation(N)
    np.random.seed(seed)  # ByzFL shuffles the rows with the same draws
    theirs = byzfl.Bucketing(s=size)(x)
    ours = Bucketing(size)(x, _Fixed(perm))  # type: ignore[arg-type]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
