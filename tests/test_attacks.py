"""Simulation-only Byzantine attacks (spec fedrep.md 6), checked against the section-12 sanity items 17 and 18."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from fedpdm_flower.fedapp.attacks import (
    alie,
    alie_z,
    apply_coordinate_attack,
    apply_value_attack,
    bit_flip,
    byzantine_ids,
    foe,
    min_attack,
    random_attack,
    same_attack,
)

M, F = 32, 7


def _round(seed: int = 0, d: int = 6) -> tuple[dict[int, np.ndarray], set[int]]:
    rng = np.random.default_rng(seed)
    vectors = {cid: rng.standard_normal(d) for cid in range(M)}
    return vectors, set(byzantine_ids(M, F, seed))


# ------------------------------------------------------------------------------------------------ item 17


def test_alie_z_values() -> None:
    # s = floor(32/2 + 1) - 7 = 10. epfml: Phi^-1((32-7-10)/25) = Phi^-1(0.6); Baruch: Phi^-1((32-10)/32) =
    # Phi^-1(0.6875). Cross-checked against a bisection on NormalDist.cdf, independent of inv_cdf.
    def inv(q: float) -> float:
        lo, hi = -10.0, 10.0
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if statistics.NormalDist().cdf(mid) < q else (lo, mid)
        return lo

    assert alie_z(M, F) == pytest.approx(0.2533, abs=5e-5)
    assert alie_z(M, F, "epfml") == pytest.approx(inv(0.6), abs=1e-12)
    assert alie_z(M, F, "baruch") == pytest.approx(0.4888, abs=5e-5)
    assert alie_z(M, F, "baruch") == pytest.approx(inv(0.6875), abs=1e-12)
    with pytest.raises(ValueError, match="not in"):
        alie_z(32, 17)  # s = 0: quantile 1
    with pytest.raises(ValueError, match="formula"):
        alie_z(M, F, "other")


def test_value_attacks_formulas() -> None:
    x = np.array([1.0, -2.0, 0.0])
    np.testing.assert_array_equal(bit_flip(x), [-1.0, 2.0, -0.0])
    honest = np.array([[1.0, 2.0], [3.0, 2.0], [5.0, 8.0]])
    # mean (3, 4), unbiased std (2, sqrt(12)); FoE = -0.5 * (3, 4).
    np.testing.assert_allclose(alie(honest, 0.5), [3.0 - 0.5 * 2.0, 4.0 - 0.5 * np.sqrt(12.0)], rtol=1e-15)
    np.testing.assert_array_equal(foe(honest), [-1.5, -2.0])
    np.testing.assert_array_equal(foe(honest, eps=2.0), [-6.0, -8.0])
    with pytest.raises(ValueError, match="at least 2"):
        alie(honest[:1], 0.25)


@pytest.mark.parametrize("name", ["none", "bit-flip", "alie", "foe"])
def test_value_attacks_only_touch_byzantine_slots(name: str) -> None:
    vectors, byz = _round()
    before = {cid: v.copy() for cid, v in vectors.items()}
    out = apply_value_attack(name, vectors, byz)
    assert list(out) == list(vectors) and len(byz) == F
    honest_ids = sorted(set(vectors) - byz)
    honest = np.stack([vectors[cid] for cid in honest_ids])
    for cid, v in vectors.items():
        np.testing.assert_array_equal(v, before[cid])  # inputs untouched
        assert out[cid] is not v
        if cid not in byz or name == "none":
            np.testing.assert_array_equal(out[cid], v)
        elif name == "bit-flip":
            np.testing.assert_array_equal(out[cid], -v)
        elif name == "alie":
            expected = honest.mean(axis=0) - 0.2533471031357998 * honest.std(axis=0, ddof=1)
            np.testing.assert_allclose(out[cid], expected, rtol=1e-14)
        else:
            np.testing.assert_allclose(out[cid], -0.5 * honest.mean(axis=0), rtol=1e-14)


def test_value_attack_options_and_errors() -> None:
    vectors, byz = _round()
    honest = np.stack([vectors[cid] for cid in sorted(set(vectors) - byz)])
    b = min(byz)
    np.testing.assert_allclose(apply_value_attack("alie", vectors, byz, z=alie_z(M, F, "baruch"))[b],
                               honest.mean(axis=0) - 0.4887764111146694 * honest.std(axis=0, ddof=1), rtol=1e-14)
    np.testing.assert_allclose(apply_value_attack("foe", vectors, byz, eps=3.0)[b], -3.0 * honest.mean(axis=0),
                               rtol=1e-14)
    # Byzantine ids that did not submit are ignored; no Byzantine submitter means nothing changes.
    assert all(np.array_equal(v, vectors[c]) for c, v in apply_value_attack("foe", vectors, {100}).items())
    with pytest.raises(ValueError, match="unknown value attack 'gauss'"):
        apply_value_attack("gauss", vectors, byz)
    with pytest.raises(ValueError, match="one length"):
        apply_value_attack("foe", {0: np.zeros(2), 1: np.zeros(3)}, {0})


# ------------------------------------------------------------------------------------------------ item 18


def test_min_attack_picks_the_smallest_magnitudes() -> None:
    g = np.array([0.1, -5.0, 0.3, 2.0, 0.0, -0.2, 4.0, 0.0, 1.0, -3.0])
    # |g| ascending: 0 (idx 4), 0 (idx 7), 0.1 (idx 0), 0.2 (idx 5), 0.3 (idx 2), ...
    assert min_attack(g, 3).tolist() == [0, 4, 7]
    assert min_attack(g, 2).tolist() == [4, 7]
    assert min_attack(g, 1).tolist() == [4]  # tie between 4 and 7 broken by index
    assert min_attack(np.ones(5), 2).tolist() == [0, 1]
    assert min_attack(g, 3).dtype == np.int64
    with pytest.raises(ValueError, match="k must satisfy"):
        min_attack(g, 11)


def test_random_and_same_attack() -> None:
    rng = np.random.default_rng(0)
    r = random_attack(100, 10, rng)
    assert r.dtype == np.int64 and len(set(r.tolist())) == 10 and r.tolist() == sorted(r.tolist())
    assert r.min() >= 0 and r.max() < 100
    assert not np.array_equal(r, random_attack(100, 10, rng))
    honest = [np.array([1, 2, 3]), np.array([4, 5, 6]), np.array([7, 8, 9])]
    picks = {tuple(same_attack(honest, rng).tolist()) for _ in range(50)}
    assert picks == {(1, 2, 3), (4, 5, 6), (7, 8, 9)}  # each honest proposal is a possible copy
    copy = same_attack(honest, rng)
    copy[0] = -1
    assert all(p.min() > 0 for p in honest)  # a copy, not an alias


@pytest.mark.parametrize("name", ["none", "min", "rand", "same"])
def test_coordinate_attacks_only_touch_byzantine_slots(name: str) -> None:
    d, k = 50, 4
    rng = np.random.default_rng(1)
    updates = {cid: rng.standard_normal(d) for cid in range(M)}
    # Honest proposals: the top-k of the own update (alpha = 0), ascending.
    proposals = {cid: np.sort(np.argsort(-np.abs(g), kind="stable")[:k]) for cid, g in updates.items()}
    byz = set(byzantine_ids(M, F, 1))
    out = apply_coordinate_attack(name, proposals, byz, d, np.random.default_rng(2), updates=updates)
    assert list(out) == list(proposals)
    honest_props = [proposals[cid] for cid in sorted(set(proposals) - byz)]
    union = set().union(*(set(p.tolist()) for p in out.values()))
    for cid, p in out.items():
        assert p.dtype == np.int64 and len(p) == k and len(set(p.tolist())) == k
        assert p.min() >= 0 and p.max() < d
        if cid not in byz or name == "none":
            np.testing.assert_array_equal(p, proposals[cid])
        elif name == "min":
            np.testing.assert_array_equal(p, min_attack(updates[cid], k))
        elif name == "same":
            assert any(np.array_equal(p, h) for h in honest_props)
        if cid not in byz:
            assert set(proposals[cid].tolist()) <= union  # honest T~_k subset of I^t under every attack
    if name == "rand":
        assert any(not np.array_equal(out[cid], proposals[cid]) for cid in byz)


def test_coordinate_attack_errors_and_reproducibility() -> None:
    proposals = {0: np.array([0, 1]), 1: np.array([2, 3]), 2: np.array([4, 5])}
    with pytest.raises(ValueError, match="needs the update of Byzantine client 2"):
        apply_coordinate_attack("min", proposals, {2}, 6, np.random.default_rng(0))
    with pytest.raises(ValueError, match="unknown coordinate attack"):
        apply_coordinate_attack("max", proposals, {2}, 6, np.random.default_rng(0))
    a = apply_coordinate_attack("rand", proposals, {1, 2}, 6, np.random.default_rng(5))
    b = apply_coordinate_attack("rand", proposals, {1, 2}, 6, np.random.default_rng(5))
    assert all(np.array_equal(a[c], b[c]) for c in a)


def test_byzantine_ids_are_seeded() -> None:
    ids = byzantine_ids(M, F, 42)
    assert len(ids) == F == len(set(ids)) and ids == sorted(ids) and all(0 <= i < M for i in ids)
    assert byzantine_ids(M, F, 42) == ids
    assert any(byzantine_ids(M, F, s) != ids for s in range(1, 5))
    assert byzantine_ids(M, 0, 1) == [] and byzantine_ids(4, 4, 1) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        byzantine_ids(4, 5, 1)



def test_client_attack_and_oracle_are_the_attack_functions() -> None:
    """The simulation-only objects the public classes accept do exactly what the functions above do."""
    from fedpdm_flower.fedapp.attacks import ClientAttack, OmniscientOracle

    rng = np.random.default_rng(3)
    g = rng.normal(size=20)
    x = rng.normal(size=6)
    honest_prop = np.arange(4, dtype=np.int64)
    assert ClientAttack().corrupt_values(x) is x
    np.testing.assert_array_equal(ClientAttack("bit-flip").corrupt_values(x), -x)
    np.testing.assert_array_equal(ClientAttack(coordinates="min").corrupt_proposal(honest_prop, g, 4, rng),
                                  min_attack(g, 4))
    np.testing.assert_array_equal(ClientAttack(coordinates="rand").corrupt_proposal(honest_prop, g, 4,
                                                                                    np.random.default_rng(1)),
                                  random_attack(20, 4, np.random.default_rng(1)))
    vecs = {c: rng.normal(size=6) for c in range(5)}
    oracle = OmniscientOracle(byzantine={1, 4, 9}, values="alie", z=0.3)  # type: ignore[arg-type]
    assert oracle.byzantine == frozenset({1, 4, 9})
    forged = oracle.forge_values(vecs)
    want = apply_value_attack("alie", vecs, {1, 4}, z=0.3)
    for c in vecs:
        np.testing.assert_array_equal(forged[c], want[c])
    props = {c: np.array([c, c + 5]) for c in range(5)}
    same = OmniscientOracle(byzantine=frozenset({0, 3}), coordinates="same").forge_proposals(props,
                                                                                            np.random.default_rng(2))
    r = np.random.default_rng(2)
    honest = [props[c] for c in (1, 2, 4)]
    for c in (0, 3):
        np.testing.assert_array_equal(same[c], same_attack(honest, r))
    assert all(same[c] is props[c] for c in (1, 2, 4))
    assert OmniscientOracle(byzantine=frozenset({0})).forge_proposals(props, r) == props
    for bad in (lambda: ClientAttack(coordinates="same"), lambda: OmniscientOracle(coordinates="min"),
                lambda: OmniscientOracle(eps=float("inf"))):
        with pytest.raises(ValueError):
            bad()
