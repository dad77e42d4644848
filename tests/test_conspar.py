"""Tests of ConSpar, FedREP's consensus sparsification (spec fedrep.md 2, 9, 11.1/3/4/5/15/21/23, 12 items 1-8).

Every number asserted from the spec was recomputed by hand in the comment next to it; all of them agreed with the
spec. The statistical tests use fixed seeds (so they are deterministic), and their tolerances are chosen so that a
correct implementation would pass for almost every seed, not just the one fixed here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from fedpdm_flower.fedapp.compression.conspar import (
    bits_bound,
    compress,
    consensus,
    contraction_dprime,
    k_per_client,
    propose,
    propose_parts,
    sanitize_proposal,
    scatter,
    theorem2_epsilon,
    topk_bits,
)
from fedpdm_flower.fedapp.compression.sparsify import top_k

SPEC_G = np.array([0.1, -5.0, 0.3, 2.0, 0.0, -0.2, 4.0, 0.0, 1.0, -3.0])
D_RESNET20 = 269_722  # spec 8.2


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# --- propose (spec 2.2, 12 items 1-3) ----------------------------------------------------------------------------


def test_alpha0_is_the_top_k_set_spec_example() -> None:
    # |g| = [0.1, 5, 0.3, 2, 0, 0.2, 4, 0, 1, 3]: the three largest are 5 (j=1), 4 (j=6), 3 (j=9).
    parts = propose_parts(SPEC_G, 3, 0.0, _rng())
    assert parts.indices.tolist() == [1, 6, 9]
    assert parts.top.tolist() == [1, 6, 9] and parts.kept.tolist() == [1, 6, 9] and parts.extra.size == 0
    assert parts.indices.dtype == np.int64


def test_ties_break_to_the_lower_index() -> None:
    # Spec 11.3: the first k after sorting by (-|g_j|, j); sparsify.top_k implements exactly that rule.
    assert propose(np.array([1.0, -2.0, 2.0, 0.0, -2.0]), 2, 0.0, _rng()).tolist() == [1, 2]
    assert propose(np.ones(6), 3, 0.0, _rng()).tolist() == [0, 1, 2]
    g = _rng(3).integers(-3, 4, size=50).astype(np.float64)  # many ties
    order = sorted(range(50), key=lambda j: (-abs(g[j]), j))
    assert top_k(g, 17).tolist() == sorted(order[:17])


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_proposal_invariants(alpha: float) -> None:
    # Spec 12.2: |I_k| = k, T~ ⊆ T, T~ ∩ R = ∅, indices in [0, d), |I_k ∩ T| >= k - r; ascending int64.
    rng = _rng(1)
    d, k = 40, 7
    for _ in range(200):
        g = rng.standard_normal(d)
        p = propose_parts(g, k, alpha, rng)
        r = p.extra.size
        assert p.indices.size == k and p.indices.dtype == np.int64
        assert np.all(np.diff(p.indices) > 0) and p.indices[0] >= 0 and p.indices[-1] < d
        assert p.top.tolist() == top_k(g, k).tolist()
        assert set(p.kept) <= set(p.top) and p.kept.size == k - r
        assert not set(p.kept) & set(p.extra)
        assert set(p.indices) == set(p.kept) | set(p.extra)
        assert len(set(p.indices) & set(p.top)) >= k - r


def test_extra_coordinates_may_repick_dropped_top_ones() -> None:
    # Spec 11.4: R is drawn from [d] \ T~, not from [d] \ T. With d = 6, k = 5, alpha = 1, T~ = ∅ and R is any
    # 5-subset of 6 coordinates, so it meets T in at least 4 places every time.
    rng = _rng(2)
    g = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    for _ in range(20):
        p = propose_parts(g, 5, 1.0, rng)
        assert p.kept.size == 0 and len(set(p.extra) & set(p.top)) >= 4


def test_mean_r_and_random_share_match_the_binomial_model() -> None:
    # Spec 12.2: r ~ Binomial(k, alpha), so E r = alpha k; given r, R is a uniform r-subset of the d - k + r
    # coordinates outside T~, of which d - k are outside T, so E[|R \ T| | r] = r (d - k) / (d - k + r).
    # d = 30, k = 8, alpha = 0.3: E r = 2.4. Tolerance 5 standard errors of the mean (a correct implementation fails
    # for a random seed with probability < 1e-6); SE(r) = sqrt(k a (1 - a) / N) = sqrt(1.68 / 4000) = 0.0205.
    d, k, alpha, n = 30, 8, 0.3, 4000
    rng = _rng(4)
    g = rng.standard_normal(d)
    r = np.empty(n)
    outside = np.empty(n)
    for i in range(n):
        p = propose_parts(g, k, alpha, rng)
        r[i] = p.extra.size
        outside[i] = np.setdiff1d(p.extra, p.top).size
    se_r = math.sqrt(k * alpha * (1 - alpha) / n)
    assert abs(r.mean() - alpha * k) <= 5 * se_r
    pmf = [math.comb(k, i) * alpha**i * (1 - alpha) ** (k - i) for i in range(k + 1)]
    expected_outside = sum(p_i * i * (d - k) / (d - k + i) for i, p_i in enumerate(pmf))
    assert abs(outside.mean() - expected_outside) <= 5 * outside.std(ddof=1) / math.sqrt(n)


def test_alpha1_draws_do_not_depend_on_g() -> None:
    # Spec 12.3, deterministic half: the mechanism consumes the generator in a way that depends on (d, k, alpha)
    # only, so two very different g under the same seed give the same proposal when alpha = 1.
    d, k = 100, 9
    a = _rng(5).standard_normal(d)
    b = np.arange(d, dtype=np.float64) ** 3
    assert propose(a, k, 1.0, _rng(11)).tolist() == propose(b, k, 1.0, _rng(11)).tolist()
    assert propose(a, k, 1.0, _rng(11)).tolist() != propose(a, k, 1.0, _rng(12)).tolist()


def _uniformity_statistic(counts: NDArray[Any], n: int, d: int, k: int) -> float:
    """Pearson statistic for the coordinate counts of n uniform k-subsets of [d]; ~ chi2(d - 1) under uniformity.

    Each count is Binomial(n, p) with p = k/d, and Cov(c_i, c_j) = -n p (1-p) / (d-1) (exactly k coordinates per
    draw), so the covariance is n p (1-p) d/(d-1) (Id - J/d): scaling sum (c - np)^2 / (n p (1-p)) by (d-1)/d gives
    a chi-square with d - 1 degrees of freedom.
    """
    p = k / d
    return float((d - 1) / d * np.sum((counts - n * p) ** 2) / (n * p * (1 - p)))


def test_alpha1_proposals_are_uniform_chi_square() -> None:
    # Spec 12.3, statistical half: alpha = 1 with a fixed, strongly structured g (top set = {15..19}) must hit every
    # coordinate equally often. Significance 0.001: chi2(19) 99.9 % quantile = 43.82 (scipy.stats.chi2.ppf).
    d, k, n = 20, 5, 4000
    g = np.arange(d, dtype=np.float64)
    rng = _rng(6)
    counts = np.zeros(d)
    top_counts = np.zeros(d)
    for _ in range(n):
        counts[propose(g, k, 1.0, rng)] += 1
        top_counts[propose(g, k, 0.5, rng)] += 1
    assert _uniformity_statistic(counts, n, d, k) < 43.82
    # Power check: at alpha = 0.5 the top coordinates are over-represented, and the same statistic sees it at once.
    assert _uniformity_statistic(top_counts, n, d, k) > 1000


@pytest.mark.parametrize(
    ("g", "k", "alpha", "match"),
    [
        (np.zeros(5), 0, 0.0, "k must"),
        (np.zeros(5), 6, 0.0, "k must"),
        (np.zeros(5), 2.0, 0.0, "k must"),
        (np.zeros(5), 2, -0.1, "alpha"),
        (np.zeros(5), 2, 1.01, "alpha"),
        (np.zeros(5), 2, float("nan"), "alpha"),
        (np.zeros((2, 3)), 2, 0.5, "1-D"),
        (np.array([1.0, np.nan, 0.0]), 1, 0.5, "NaN"),
    ],
)
def test_propose_rejects_bad_arguments(g: NDArray[Any], k: Any, alpha: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        propose(g, k, alpha, _rng())


def test_propose_is_reproducible() -> None:
    g = _rng(8).standard_normal(500)
    assert propose(g, 20, 0.5, _rng(9)).tolist() == propose(g, 20, 0.5, _rng(9)).tolist()


# --- consensus and sanitize_proposal (spec 2.2, 11.5, 12.4) -------------------------------------------------------


def test_consensus_is_the_sorted_union() -> None:
    idx = consensus([np.array([1, 6, 9]), np.array([1, 2, 3])], d=10, k=3)
    assert idx.tolist() == [1, 2, 3, 6, 9] and idx.dtype == np.int64
    assert consensus([], d=10, k=3).size == 0


def test_consensus_size_is_at_most_m_k() -> None:
    rng = _rng(10)
    d, m, k = 60, 8, 5
    for alpha in (0.0, 0.5, 1.0):
        props = [propose(rng.standard_normal(d), k, alpha, rng) for _ in range(m)]
        idx = consensus(props, d, k)
        assert idx.size <= m * k and np.all(np.diff(idx) > 0)
        assert set(idx) == set().union(*(set(p) for p in props))


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (np.array([3, 1]), "ascending"),
        (np.array([1, 1]), "ascending"),
        (np.array([1, 10]), "out of range"),
        (np.array([-1, 2]), "out of range"),
        (np.array([0, 1, 2, 3]), "k = 3"),
        (np.array([1.0, 2.0]), "integer dtype"),
        (np.array([[1, 2]]), "1-D"),
    ],
)
def test_consensus_rejects_unsanitized_proposals(bad: NDArray[Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        consensus([np.array([0]), bad], d=10, k=3)


def test_sanitize_deduplicates_and_drops_out_of_range() -> None:
    raw = np.array([7, 7, -1, 10, 99, 2, 2])
    assert sanitize_proposal(raw, 10, 3, None).tolist() == [2, 7]
    huge = np.array([2**63 + 5, 4], dtype=np.uint64)  # would wrap to a negative int64 if cast first
    assert sanitize_proposal(huge, 10, 3, None).tolist() == [4]


def test_sanitize_truncates_to_the_k_lowest() -> None:
    out = sanitize_proposal(np.array([9, 8, 0, 5, 3, 3, 7]), 10, 3, None)
    assert out.tolist() == [0, 3, 5] and out.dtype == np.int64


def test_sanitize_pads_short_proposals_with_rng() -> None:
    rng = _rng(13)
    short: list[Any] = [np.array([4, 4, 11]), np.array([], dtype=np.int64), []]
    for raw in short:
        out = sanitize_proposal(raw, 10, 3, rng)
        assert out.size == 3 and np.all(np.diff(out) > 0) and out[0] >= 0 and out[-1] < 10
    assert 4 in sanitize_proposal(np.array([4]), 10, 3, rng)
    assert sanitize_proposal(np.array([0, 1, 2, 3, 4]), 10, 3, rng).tolist() == [0, 1, 2]  # no padding needed


def test_sanitize_accepts_whole_floats_and_lists() -> None:
    assert sanitize_proposal(np.array([3.0, 1.0, 12.0]), 10, 3, None).tolist() == [1, 3]
    assert sanitize_proposal([5, 2], 10, 3, None).tolist() == [2, 5]


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (np.array([1.0, 2.5]), "non-integer entry 2.5"),
        (np.array([1.0, np.nan]), "non-finite"),
        (np.array([[1, 2], [3, 4]]), "1-D.*ndim 2"),
        (np.int64(3), "1-D.*ndim 0"),
        (np.array([True, False]), "wrong dtype bool"),
        (np.array(["1", "2"]), "wrong dtype <U1"),
        (np.array([1 + 0j]), "wrong dtype complex"),
        ([[1, 2], [3]], "not an array"),
    ],
)
def test_sanitize_rejects_what_is_not_an_integer_index_array(raw: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sanitize_proposal(raw, 10, 3, _rng())


def test_sanitized_proposals_feed_consensus() -> None:
    rng = _rng(14)
    raws: list[Any] = [np.array([1, 6, 9]), np.array([9, 9, 9, 50, -3]), np.arange(10)[::-1], [2.0, 4.0]]
    props = [sanitize_proposal(raw, 10, 3, rng) for raw in raws]
    idx = consensus(props, 10, 3)
    assert {1, 6, 9, 0, 2, 4} <= set(idx) and idx.size <= 4 * 3


# --- compress / scatter (spec 2.2, 2.3, 12.5, 12.6) ---------------------------------------------------------------


def test_memory_identity_is_exact() -> None:
    rng = _rng(15)
    d = 300
    for _ in range(20):
        g = rng.standard_normal(d) * 10.0 ** rng.integers(-8, 8, size=d)
        idx = consensus([propose(rng.standard_normal(d), 9, 0.5, rng) for _ in range(6)], d, 9)
        payload, u_next = compress(g, idx)
        g_tilde = scatter(payload, idx, d)
        assert np.array_equal(u_next + g_tilde, g)  # exact, not approximate
        assert np.all(u_next[idx] == 0.0)
        off = np.setdiff1d(np.arange(d), idx)
        assert np.all(g_tilde[off] == 0.0) and np.array_equal(u_next[off], g[off])
        assert np.array_equal(payload, g[idx]) and payload.shape == (idx.size,)  # ascending order of I


def test_compress_rejects_unsorted_or_bad_index_sets() -> None:
    g = np.arange(5, dtype=np.float64)
    with pytest.raises(ValueError, match="ascending"):
        compress(g, np.array([3, 1]))
    with pytest.raises(ValueError, match="out of range"):
        compress(g, np.array([1, 5]))
    with pytest.raises(ValueError, match="len\\(indices\\)"):
        scatter(np.ones(3), np.array([0, 1]), 5)


def test_prop1_common_support_never_increases_dissimilarity() -> None:
    # Prop. 1 / spec 12.6: with a common I, ||g~_a - g~_b|| <= ||g_a - g_b|| (a restriction to a coordinate subset).
    rng = _rng(16)
    d = 80
    for _ in range(200):
        g_a, g_b = rng.standard_normal(d), rng.standard_normal(d) * 3
        idx = consensus([propose(g_a, 4, 0.3, rng), propose(g_b, 4, 0.3, rng)], d, 4)
        ta = scatter(compress(g_a, idx)[0], idx, d)
        tb = scatter(compress(g_b, idx)[0], idx, d)
        assert np.linalg.norm(ta - tb) <= np.linalg.norm(g_a - g_b)
    full = np.arange(d)
    g_a, g_b = rng.standard_normal(d), rng.standard_normal(d)
    assert np.array_equal(compress(g_a, full)[0] - compress(g_b, full)[0], g_a - g_b)


@pytest.mark.parametrize(
    ("kind", "alpha"), [("gauss", 0.0), ("gauss", 0.5), ("gauss", 1.0), ("flat", 0.0), ("flat", 0.5), ("flat", 1.0)]
)
def test_prop2_contraction_holds_empirically(kind: str, alpha: float) -> None:
    # Prop. 2 / spec 12.7, honest clients only (delta = 0): E||g - g~||^2 <= (1 - d'_cons/d) ||g||^2 for client 0.
    # d = 200, m = 8, k = 5 (K = 40): a = alpha * 40 * 7 / 1600 = 0.175 alpha,
    #   1 - d'/d = e^{-a} (1 - k/d) = 0.975 e^{-a}: alpha 0 -> 0.975, 0.5 -> 0.89331, 1 -> 0.81847.
    # "flat" g (all |g_j| = 1) makes every client's top set {0..4} (stable ties), the near-worst case: at alpha = 0
    # the ratio is exactly 1 - k/d = 0.975 = the bound. At alpha = 1 the proposals are m independent uniform
    # k-subsets, so the expected ratio is (1 - k/d)^m = 0.975^8 = 0.81668 for every g, 0.0018 below the bound.
    # Tolerance: the mean over n rounds may exceed the bound by 4 standard errors (a correct implementation
    # fails for a random seed with probability ~3e-5); the alpha = 1 case also pins the mean to its exact value.
    d, m, k, n = 200, 8, 5, 600
    rng = _rng(17)
    gs = rng.standard_normal((m, d)) if kind == "gauss" else np.ones((m, d))
    ratio = np.empty(n)
    for i in range(n):
        idx = consensus([propose(gs[c], k, alpha, rng) for c in range(m)], d, k)
        u_next = compress(gs[0], idx)[1]
        ratio[i] = (u_next @ u_next) / (gs[0] @ gs[0])
    se = ratio.std(ddof=1) / math.sqrt(n)
    bound = 1.0 - contraction_dprime(d, m * k, m, alpha, 0.0) / d
    assert bound == pytest.approx(0.975 * math.exp(-0.175 * alpha), rel=1e-12)
    assert ratio.mean() <= bound + 4 * se + 1e-12
    if alpha == 1.0:
        assert abs(ratio.mean() - 0.975**8) <= 4 * se
    if kind == "flat" and alpha == 0.0:
        assert np.all(ratio == 0.975)


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_k_equals_d_selects_everything_and_memory_stays_zero(alpha: float) -> None:
    # Spec 11.15 / SHARE equivalence: with k = d, R fills [d] \ T~ exactly, so I^t = [d] for every alpha.
    rng = _rng(18)
    d = 12
    for _ in range(10):
        gs = rng.standard_normal((4, d))
        props = [propose(g, d, alpha, rng) for g in gs]
        assert all(p.tolist() == list(range(d)) for p in props)
        idx = consensus(props, d, d)
        assert idx.tolist() == list(range(d))
        for g in gs:
            payload, u_next = compress(g, idx)
            assert np.array_equal(payload, g) and not np.any(u_next)


# --- sizes and closed forms (spec 2.4, 2.5, 9, 11.1, 12.8) --------------------------------------------------------


def test_k_per_client() -> None:
    # Spec 8.2 / 11.1: d = 269 722, m = 32. 0.05 d / 32 = 421.44 -> 421; 0.065 d / 32 = 547.87 -> 548;
    # 0.1 d / 32 = 842.88 -> 843.
    assert k_per_client(0.05, D_RESNET20, 32) == 421
    assert k_per_client(0.065, D_RESNET20, 32) == 548
    assert k_per_client(0.1, D_RESNET20, 32) == 843
    assert k_per_client(1e-9, 1000, 32) == 1
    assert k_per_client(32.0, 1000, 32) == 1000  # K = m d: every client proposes all coordinates (spec 11.15)
    for bad in (0.0, -0.1, 33.0, float("nan")):
        with pytest.raises(ValueError, match="fraction"):
            k_per_client(bad, 1000, 32)


def test_theorem2_small_example() -> None:
    # (d, k, alpha) = (100, 2, 0.5): first (1.5 * 2 * 99) / (2 * 0.5) = 297 -> ln 297 = 5.69373;
    # second 1 + (0.5/0.5) (2^2 + 1) 100^2 = 50 001 -> ln 50 001 = 10.81980.
    first, second = theorem2_epsilon(100, 2, 0.5)
    assert first == pytest.approx(math.log(297), rel=1e-12) and round(first, 4) == 5.6937
    assert second == pytest.approx(math.log(50001), rel=1e-12) and round(second, 4) == 10.8198


def test_theorem2_resnet20_values() -> None:
    # k = 421, d = 269 722, so k (d - k + 1) = 421 * 269 302 = 113 376 142.
    # alpha 0.2: x 1.2/0.4 = 3   -> ln 340 128 426 = 19.6448 (spec 19.64)
    # alpha 0.5: x 1.5/1.0 = 1.5 -> ln 170 064 213 = 18.9517 (spec 18.95)
    # alpha 1.0: x 2.0/2.0 = 1   -> ln 113 376 142 = 18.5462 (spec 18.55)
    expected = {0.2: 19.64, 0.5: 18.95, 0.8: 18.66, 0.95: 18.57, 1.0: 18.55}
    for alpha, eps in expected.items():
        assert round(theorem2_epsilon(D_RESNET20, 421, alpha)[0], 2) == eps
    assert theorem2_epsilon(D_RESNET20, 421, 0.2)[0] == pytest.approx(math.log(340_128_426), rel=1e-12)
    # Second bound: 0 at alpha = 1, "astronomically large" otherwise but finite (log space; 2^421 d^421 would
    # overflow a float): at alpha = 0.5 it is 421 ln 2 + 421 ln d + tiny = 291.81 + 5264.67 = 5556.48.
    assert theorem2_epsilon(D_RESNET20, 421, 1.0)[1] == 0.0
    second = theorem2_epsilon(D_RESNET20, 421, 0.5)[1]
    assert math.isfinite(second)
    assert second == pytest.approx(421 * math.log(2) + 421 * math.log(D_RESNET20), rel=1e-12)


def test_theorem2_edge_cases() -> None:
    assert theorem2_epsilon(100, 2, 0.0) == (math.inf, math.inf)  # alpha = 0: no protection (spec 11.23)
    first, second = theorem2_epsilon(100, 2, 0.3)
    assert math.isfinite(first) and second == math.inf  # second bound needs alpha >= 1/2
    firsts = [theorem2_epsilon(1000, 10, a)[0] for a in (0.1, 0.3, 0.5, 0.9, 1.0)]
    assert firsts == sorted(firsts, reverse=True)  # more obfuscation, smaller epsilon
    with pytest.raises(ValueError, match="alpha"):
        theorem2_epsilon(100, 2, 1.5)
    with pytest.raises(ValueError, match="k must"):
        theorem2_epsilon(100, 101, 0.5)


def test_contraction_table_of_section_9() -> None:
    # m = 32, delta = 7/32, K = 0.05 d: (1 - delta) m - 1 = 25 - 1 = 24, so a = alpha * 0.05 * 24 / 32 = 0.0375 alpha
    # and K/m = d/640, hence d'/d = 1 - (639/640) e^{-a}:
    #   alpha 0   -> 1/640 = 0.0015625
    #   alpha 0.2 -> a = 0.0075, e^{-a} = 0.9925281, x 639/640 = 0.9909772 -> 0.0090228 (spec 0.009023)
    #   alpha 0.5 -> a = 0.01875, e^{-a} = 0.9814247, x 639/640 = 0.9798912 -> 0.0201088 (spec 0.020109)
    #   alpha 1   -> a = 0.0375, e^{-a} = 0.9631944, x 639/640 = 0.9616894 -> 0.0383106 (spec 0.038311)
    d, m, delta = D_RESNET20, 32, 7 / 32
    K = 0.05 * d
    assert contraction_dprime(d, K, m, 0.0, delta) / d == pytest.approx(1 / 640, rel=1e-12)
    table = {0.2: 0.009023, 0.5: 0.020109, 0.8: 0.031071, 0.95: 0.036506, 0.99: 0.037950, 1.0: 0.038311}
    for alpha, ratio in table.items():
        assert round(contraction_dprime(d, K, m, alpha, delta) / d, 6) == ratio
    h = {0.2: 110.83, 0.5: 49.73, 1.0: 26.10}  # H = d / d'_cons
    for alpha, value in h.items():
        assert round(d / contraction_dprime(d, K, m, alpha, delta), 2) == value


def test_contraction_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="delta"):
        contraction_dprime(100, 10, 5, 0.5, 0.5)
    with pytest.raises(ValueError, match="K/m"):
        contraction_dprime(100, 0, 5, 0.5, 0.0)
    with pytest.raises(ValueError, match="alpha"):
        contraction_dprime(100, 10, 5, -0.5, 0.0)


def test_bits_bound() -> None:
    # (96 + 32/m) K = 32 (K/m + K + 2K): m = 32 -> 97 K. d = 269 722, K = 0.05 d = 13 486.1:
    # 97 K = 1 308 151.7 bits (<= 1.31 Mbit), top-K 128 K = 1 726 220.8 bits (1.73 Mbit), spec 9 item 1.
    assert bits_bound(1000, 32) == 97_000.0
    assert bits_bound(1000, 1) == 128_000.0 == topk_bits(1000)  # m = 1: no saving over top-K
    K = 0.05 * D_RESNET20
    assert round(bits_bound(K, 32) / 1e6, 2) == 1.31 and round(topk_bits(K) / 1e6, 2) == 1.73
    for m in (2, 8, 32, 100):
        assert bits_bound(1000, m) == pytest.approx(32 * (1000 / m + 1000 + 2 * 1000))
        assert bits_bound(1000, m) < topk_bits(1000)
