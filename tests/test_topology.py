"""Tests for fedpdm_flower.fedapp.topology: graphs, the relay walk (dp_recal.md 3, 9 items 1-5), LCI and mixing weights."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from fedpdm_flower.fedapp.topology import (
    STREAM_WALK,
    CommCounters,
    Graph,
    activation_counts,
    complete,
    cyclic_route,
    erdos_renyi,
    from_edges,
    laplacian,
    lci,
    metropolis_weights,
    next_agent,
    parse_graph,
    path_graph,
    plan_xi,
    random_geometric,
    rho_laplacian,
    ring,
    slem,
    spectral_gap,
    star,
    start_agent,
    stationary_distribution,
    stationary_lemma1,
    support_graph,
    transition_matrix,
    validate_mixing,
    walk_path,
    walk_uniforms,
)

ER10 = erdos_renyi(10, 0.3, seed=1)
GEO12 = random_geometric(12, 0.4, seed=2)
GRAPHS = [ring(8), complete(8), star(4), star(6), path_graph(3), path_graph(5), ER10, GEO12]


def _is_walk_on(graph: Graph, path: NDArray[np.int64]) -> bool:
    return all(graph.has_edge(int(a), int(b)) for a, b in itertools.pairwise(path.tolist()))


# ---------------------------------------------------------------------------------------------------------------
# Graphs


def test_ring_and_complete_structure() -> None:
    g = ring(8)
    assert g.n == 8 and g.num_edges == 8
    assert g.edges == ((0, 1), (0, 7), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7))
    assert g.degrees.tolist() == [2] * 8
    assert g.neighbours[0] == (1, 7) and g.neighbours[3] == (2, 4)
    assert g.has_edge(7, 0) and g.has_edge(0, 7) and not g.has_edge(0, 2) and not g.has_edge(0, 0)
    assert not g.has_edge(0, 8)
    k = complete(8)
    assert k.num_edges == 28 and k.degrees.tolist() == [7] * 8  # d = n - 1, not n (spec 8 A10)
    assert k.neighbours[3] == (0, 1, 2, 4, 5, 6, 7)
    for gr in GRAPHS:
        assert gr.is_connected()
        assert np.array_equal(gr.adjacency, gr.adjacency.T) and not gr.adjacency.diagonal().any()
        assert gr.degrees.sum() == 2 * gr.num_edges
        assert all(list(nb) == sorted(nb) for nb in gr.neighbours)
        assert list(gr.edges) == sorted(gr.edges) and all(i < j for i, j in gr.edges)


def test_graph_is_canonical_hashable_and_read_only() -> None:
    g = Graph(3, ((2, 1), (1, 0), (0, 1)))
    assert g.edges == ((0, 1), (1, 2))
    assert g == path_graph(3) and hash(g) == hash(path_graph(3))
    assert Graph(3, ((0, 1), (1, 2), (0, 2))) == complete(3) == ring(3)  # labels do not affect equality
    with pytest.raises(ValueError):
        g.adjacency[0, 2] = True
    with pytest.raises(ValueError):
        g.degrees[0] = 5
    disconnected = Graph(4, ((0, 1), (2, 3)))
    assert not disconnected.is_connected()
    assert disconnected.components() == [[0, 1], [2, 3]]


def test_generator_argument_errors() -> None:
    with pytest.raises(ValueError, match="n >= 3"):
        ring(2)
    with pytest.raises(ValueError, match="n >= 2"):
        complete(1)
    with pytest.raises(ValueError, match="0 < p <= 1"):
        erdos_renyi(5, 0.0, seed=0)
    with pytest.raises(ValueError, match="radius > 0"):
        random_geometric(5, -1.0, seed=0)


def test_from_edges_validates() -> None:
    g = from_edges(4, [(0, 1), (1, 0), (1, 2), (2, 3), (3, 2)])
    assert g.edges == ((0, 1), (1, 2), (2, 3))
    with pytest.raises(ValueError, match=r"edge \(2, 2\) is a self-loop"):
        from_edges(3, [(0, 1), (2, 2), (1, 2)])
    with pytest.raises(ValueError, match=r"edge \(0, 4\) has an endpoint out of range 0\.\.3"):
        from_edges(4, [(0, 1), (0, 4)])
    with pytest.raises(ValueError, match="out of range"):
        from_edges(4, [(-1, 2)])
    with pytest.raises(ValueError, match=r"disconnected \(2 components: \[0, 1\], \[2, 3\]\)"):
        from_edges(4, [(0, 1), (2, 3)])
    with pytest.raises(ValueError, match="must be an integer"):
        from_edges(3, [(0, 1.5), (1, 2)])
    with pytest.raises(ValueError, match="exactly two endpoints"):
        from_edges(3, [(0, 1, 2)])


def test_random_graphs_connected_seeded_and_limits() -> None:
    a, b = erdos_renyi(12, 0.25, seed=5), erdos_renyi(12, 0.25, seed=5)
    assert a == b and a.is_connected()
    assert len({erdos_renyi(12, 0.25, seed=s) for s in range(6)}) > 1
    assert erdos_renyi(6, 1.0, seed=3) == complete(6)
    g = random_geometric(15, 0.45, seed=4)
    assert g == random_geometric(15, 0.45, seed=4) and g.is_connected()
    assert random_geometric(6, 1.5, seed=0) == complete(6)  # unit-square diameter sqrt(2) < 1.5
    with pytest.raises(ValueError, match=r"no connected sample in 5 tries"):
        erdos_renyi(30, 0.01, seed=0, max_tries=5)
    with pytest.raises(ValueError, match=r"no connected sample in 5 tries"):
        random_geometric(30, 0.01, seed=0, max_tries=5)


def test_parse_graph_kinds(tmp_path: Path) -> None:
    assert parse_graph("ring", 8) == ring(8)
    assert parse_graph(" Complete ", 5) == complete(5)
    assert parse_graph("star", 5) == star(5) and parse_graph("path", 4) == path_graph(4)
    assert parse_graph("er:0.3", 10, seed=1) == ER10
    assert parse_graph("geometric:0.4", 12, seed=2) == GEO12
    f = tmp_path / "g.txt"
    f.write_text("# a 4-cycle with a chord\n0 1\n1 2\n\n2,3\n3 0  # closing edge\n0 2\n")
    assert parse_graph(f"edges:{f}", 4) == Graph(4, ((0, 1), (1, 2), (2, 3), (0, 3), (0, 2)))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("bogus", "expected 'ring'"),
        ("ring:3", "expected 'ring'"),
        ("er", "expected 'ring'"),
        ("er:abc", "'abc' is not a number"),
        ("er:0", "0 < p <= 1"),
        ("geometric:-0.1", "radius > 0"),
        ("edges:/nonexistent/graph.txt", "no such file"),
        ("edges:", "expected 'ring'"),
    ],
)
def test_parse_graph_errors_name_the_spec(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        parse_graph(spec, 5, seed=0)
    assert f"bad graph spec {spec!r}" in str(err.value)


def test_parse_graph_edge_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("0 1\n1 x\n")
    with pytest.raises(ValueError, match=r"bad\.txt:2: expected two non-negative integers") as err:
        parse_graph(f"edges:{bad}", 3)
    assert "bad graph spec 'edges:" in str(err.value)
    # a config pointing at another file gets the path and line number back, never the file's content
    secret = tmp_path / "passwd"
    secret.write_text("root:x:0:0:hunter2:/root:/bin/bash\n")
    with pytest.raises(ValueError, match=r"passwd:1: expected two") as err:
        parse_graph(f"edges:{secret}", 3)
    assert "hunter2" not in str(err.value) and "/bin/bash" not in str(err.value)
    binary = tmp_path / "blob"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="not an ASCII text file") as err:
        parse_graph(f"edges:{binary}", 3)
    rng_ = tmp_path / "range.txt"
    rng_.write_text("0 1\n1 7\n")
    with pytest.raises(ValueError, match=r"range\.txt:2: edge \(1, 7\) out of range"):
        parse_graph(f"edges:{rng_}", 3)
    split = tmp_path / "split.txt"
    split.write_text("0 1\n2 3\n")
    with pytest.raises(ValueError, match="disconnected"):
        parse_graph(f"edges:{split}", 4)
    loop = tmp_path / "loop.txt"
    loop.write_text("0 1\n1 1\n")
    with pytest.raises(ValueError, match="self-loop"):
        parse_graph(f"edges:{loop}", 2)


# ---------------------------------------------------------------------------------------------------------------
# Random walk, stationary distribution (spec 3.2, 3.3; 9 items 1-2)


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.label)
def test_lemma1_formula_equals_degree_formula(graph: Graph) -> None:
    g_deg = stationary_distribution(graph)
    g_34 = stationary_lemma1(graph)
    np.testing.assert_allclose(g_34, g_deg, rtol=0, atol=1e-12)
    assert abs(g_deg.sum() - 1.0) < 1e-15 and (g_deg > 0).all()
    p = transition_matrix(graph)
    np.testing.assert_allclose(p.T @ g_deg, g_deg, atol=1e-15)  # balance g = P^T g (not the prose g = P g)


def test_stationary_reference_values() -> None:
    np.testing.assert_allclose(stationary_lemma1(ring(8)), np.full(8, 1 / 8), atol=1e-12)
    np.testing.assert_allclose(stationary_lemma1(star(4)), [1 / 2, 1 / 6, 1 / 6, 1 / 6], atol=1e-12)
    np.testing.assert_allclose(stationary_lemma1(path_graph(3)), [1 / 4, 1 / 2, 1 / 4], atol=1e-12)
    np.testing.assert_allclose(stationary_distribution(complete(8)), np.full(8, 1 / 8), atol=1e-15)


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.label)
def test_transition_matrix_and_laplacian(graph: Graph) -> None:
    p = transition_matrix(graph)
    lap = laplacian(graph)
    d = graph.degrees.astype(float)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-15)
    for i in range(graph.n):
        for j in range(graph.n):
            assert p[i, j] == (1.0 / d[i] if graph.has_edge(i, j) else 0.0)
    np.testing.assert_allclose(p, np.eye(graph.n) - lap / d[:, None], atol=1e-15)
    np.testing.assert_allclose(lap @ np.ones(graph.n), 0.0, atol=1e-15)
    np.testing.assert_array_equal(lap, np.diag(d) - graph.adjacency.astype(float))


def test_laplacian_spectrum_of_ring_closed_form() -> None:
    n = 9
    ev = np.sort(np.linalg.eigvalsh(laplacian(ring(n))))
    np.testing.assert_allclose(ev, np.sort(2 - 2 * np.cos(2 * np.pi * np.arange(n) / n)), atol=1e-12)


def test_walk_uniforms_are_the_stream_and_stateless() -> None:
    ref = np.random.default_rng([7, STREAM_WALK]).random(50)
    np.testing.assert_array_equal(walk_uniforms(7, 1, 50), ref)
    for k in (1, 2, 17, 50):
        assert walk_uniforms(7, k, 1)[0] == ref[k - 1]
    np.testing.assert_array_equal(walk_uniforms(7, 11, 5), ref[10:15])


def test_start_agent_modes() -> None:
    g = star(5)
    assert start_agent(g, "fixed:3") == 3
    assert start_agent(g, "stationary", seed=4) == start_agent(g, "stationary", seed=4)
    draws = np.array([start_agent(g, "stationary", seed=s) for s in range(2000)])
    # Binomial(2000, 1/2): std of the centre's share is 0.011; 0.05 is > 4 std.
    assert abs(np.mean(draws == 0) - 0.5) < 0.05
    uni = np.array([start_agent(g, "uniform", seed=s) for s in range(2000)])
    assert abs(np.mean(uni == 0) - 0.2) < 0.05  # std 0.009
    with pytest.raises(ValueError, match="bad start mode 'fixed:9'"):
        start_agent(g, "fixed:9")
    with pytest.raises(ValueError, match="bad start mode 'fixed:x'"):
        start_agent(g, "fixed:x")
    with pytest.raises(ValueError, match="bad start mode 'centre'"):
        start_agent(g, "centre")


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.label)
def test_cyclic_route_is_closed_walk_through_all_agents(graph: Graph) -> None:
    route = cyclic_route(graph)
    assert set(route) == set(range(graph.n))
    assert len(route) <= 2 * (graph.n - 1) or len(route) == graph.n
    assert all(graph.has_edge(route[i], route[(i + 1) % len(route)]) for i in range(len(route)))


def test_cyclic_route_hamiltonian_cases() -> None:
    assert cyclic_route(ring(8)) == tuple(range(8))
    assert cyclic_route(complete(6)) == tuple(range(6))
    assert cyclic_route(star(4)) == (0, 1, 0, 2, 0, 3)
    assert cyclic_route(path_graph(4)) == (0, 1, 2, 3, 2, 1)


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.label)
@pytest.mark.parametrize("walk", ["markov", "cyclic"])
def test_walks_use_graph_edges_only_and_are_seeded(graph: Graph, walk: str) -> None:
    path = walk_path(graph, 500, walk=walk, start="uniform", seed=3)
    assert path.shape == (500,) and _is_walk_on(graph, path)
    np.testing.assert_array_equal(path, walk_path(graph, 500, walk=walk, start="uniform", seed=3))
    assert set(path.tolist()) == set(range(graph.n))


def test_different_seeds_give_different_markov_walks() -> None:
    a = walk_path(ring(8), 200, seed=1)
    b = walk_path(ring(8), 200, seed=2)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("walk", ["markov", "iid", "cyclic"])
@pytest.mark.parametrize("graph", [ring(8), star(5), ER10], ids=lambda g: g.label)
def test_next_agent_recomputes_walk_path(graph: Graph, walk: str) -> None:
    path = walk_path(graph, 60, walk=walk, start="stationary", seed=11)
    start = int(path[0])
    for k in range(1, 60):
        assert next_agent(graph, int(path[k - 1]), k, seed=11, walk=walk, start=start) == path[k]


def test_cyclic_next_agent_needs_start_off_hamiltonian() -> None:
    assert next_agent(ring(8), 7, step=123, seed=0, walk="cyclic") == 0
    with pytest.raises(ValueError, match="needs the start agent"):
        next_agent(star(4), 0, step=1, seed=0, walk="cyclic")
    with pytest.raises(ValueError, match="holder at step 1 is 2, not 0"):
        next_agent(star(4), 0, step=1, seed=0, walk="cyclic", start=2)
    with pytest.raises(ValueError, match="unknown walk"):
        next_agent(ring(8), 0, step=1, seed=0, walk="levy")
    with pytest.raises(ValueError, match="out of range"):
        next_agent(ring(8), 8, step=1, seed=0)


def test_iid_walk_is_not_graph_local_but_follows_g() -> None:
    graph = star(5)
    path = walk_path(graph, 40_000, walk="iid", start="fixed:0", seed=2)
    assert not _is_walk_on(graph, path)  # leaf -> leaf jumps happen
    freq = activation_counts(path[1:], graph.n) / (path.size - 1)
    g = stationary_distribution(graph)
    # i.i.d. draws: the std of each frequency is sqrt(g(1-g)/K) <= 0.0025; allow 5 std.
    np.testing.assert_allclose(freq, g, atol=5 * math.sqrt(0.25 / 40_000))


def test_markov_visit_frequency_matches_g() -> None:
    """Long stationary-start walk on a non-regular ER graph; tolerance from the reversible-chain variance bound.

    For a reversible chain started in g, Var(sum of 1{X_k = i}) <= K (1 + l2)/(1 - l2) g_i (1 - g_i) + O(1), with l2
    the second-largest eigenvalue of P (the factor (1 + l)/(1 - l) grows with l, negative eigenvalues only help).
    We allow 5 such standard deviations per agent.
    """
    graph = ER10
    K = 200_000
    path = walk_path(graph, K, walk="markov", start="stationary", seed=9)
    freq = activation_counts(path, graph.n) / K
    g = stationary_distribution(graph)
    dhalf = 1.0 / np.sqrt(graph.degrees.astype(float))
    ev = np.sort(np.linalg.eigvalsh(dhalf[:, None] * graph.adjacency.astype(float) * dhalf[None, :]))
    l2 = ev[-2]
    assert abs(ev[-1] - 1.0) < 1e-12 and l2 < 1.0
    tol = 5.0 * np.sqrt((1 + l2) / (1 - l2) * g * (1 - g) / K)
    assert (np.abs(freq - g) < tol).all(), (freq, g, tol)
    assert freq.std() > 0.02  # the graph is not regular: frequencies differ visibly (g ranges 1/12 .. 1/6)


def test_star_walk_alternates_with_centre() -> None:
    path = walk_path(star(6), 1001, start="fixed:0", seed=0)
    assert (path[0::2] == 0).all() and (path[1::2] != 0).all()


# ---------------------------------------------------------------------------------------------------------------
# LCI (spec 1.5, 3.4, 4.5; 9 items 3 and 5)


def test_activation_counts_and_lci() -> None:
    tau = activation_counts([0, 1, 0, 2, 0, 1], 4)
    assert tau.tolist() == [3, 2, 1, 0] and lci(tau) == 3
    sync = np.tile(np.arange(5), 37)  # every agent publishes in every one of K = 37 iterations
    assert lci(activation_counts(sync, 5)) == 37
    assert lci(activation_counts([], 3)) == 0 and lci([]) == 0
    with pytest.raises(ValueError, match=r"outside 0\.\.3"):
        activation_counts([0, 4], 4)


@pytest.mark.parametrize("graph", [ring(8), complete(8)], ids=lambda g: g.label)
@pytest.mark.parametrize("start", ["stationary", "fixed:5"])
def test_cyclic_walk_lci_is_exact(graph: Graph, start: str) -> None:
    tau = activation_counts(walk_path(graph, 4800, walk="cyclic", start=start, seed=1), 8)
    assert tau.tolist() == [600] * 8 and lci(tau) == 600 == plan_xi(4800, graph, walk="cyclic")
    tau = activation_counts(walk_path(graph, 4801, walk="cyclic", start=start, seed=1), 8)
    assert lci(tau) == 601 == math.ceil(4801 / 8) == plan_xi(4801, graph, walk="cyclic")


@pytest.mark.parametrize("graph", [star(5), path_graph(4), ER10, GEO12], ids=lambda g: g.label)
def test_cyclic_plan_bounds_lci_off_hamiltonian(graph: Graph) -> None:
    for k_iter in (1, 7, 100, 1001):
        for s in range(graph.n):
            tau = activation_counts(walk_path(graph, k_iter, walk="cyclic", start=f"fixed:{s}"), graph.n)
            assert tau.sum() == k_iter and lci(tau) <= plan_xi(k_iter, graph, walk="cyclic")


@pytest.mark.parametrize(("graph", "ref_mean"), [(ring(8), 644.2), (complete(8), 630.4)], ids=["ring", "complete"])
def test_markov_lci_distribution_matches_spec_table(graph: Graph, ref_mean: float) -> None:
    """Spec 3.4: mean LCI over 2000 walks, K = 4800, n = 8 (ring 644.2, complete 630.4).

    We use 200 walks. The tolerance is 4 standard errors of the difference of the two Monte-Carlo means, with the
    per-walk standard deviation s estimated here (spec: ring 5-95% range 618-679, i.e. s ~ 18; complete s ~ 11):
    4 sqrt(s^2/200 + s^2/2000) ~ 5.5 (ring), 3.0 (complete).
    """
    walks = 200
    vals = np.array([lci(activation_counts(walk_path(graph, 4800, seed=s), 8)) for s in range(walks)])
    assert vals.min() >= 600  # sum tau = K, so max tau >= K/n
    s = vals.std(ddof=1)
    assert 5.0 < s < 30.0
    tol = 4.0 * math.sqrt(s**2 / walks + s**2 / 2000)
    assert abs(vals.mean() - ref_mean) < tol, (vals.mean(), tol)
    if graph == ring(8):
        assert 630 <= vals.mean() <= 660  # spec 9 item 5
        assert np.mean(vals <= plan_xi(4800, graph)) > 0.9  # plan 690 sits above the 95th percentile 679


def test_plan_xi_rules() -> None:
    assert plan_xi(4800, ring(8)) == 690 == math.ceil(1.15 * 4800 / 8)
    assert plan_xi(4800, complete(8), walk="iid") == 690
    assert plan_xi(4800, star(5)) == math.ceil(1.15 * 4800 * 0.5)
    assert plan_xi(4800, ring(8), rule="K") == 4800
    assert plan_xi(3, star(5)) == 2 and plan_xi(1, star(5)) == 1  # capped at K
    assert plan_xi(4800, star(5), walk="cyclic") == math.ceil(4800 / 8) * 4  # route 0,1,0,2,0,3,0,4
    assert plan_xi(0, ring(8)) == 0
    with pytest.raises(ValueError, match="unknown plan rule"):
        plan_xi(10, ring(8), rule="p95")
    with pytest.raises(ValueError, match="unknown walk"):
        plan_xi(10, ring(8), walk="levy")


# ---------------------------------------------------------------------------------------------------------------
# Mixing weights (dp_quantized.md 1.2, 6.3; dp_recal.md 5.6)


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.label)
def test_metropolis_weights_doubly_stochastic_with_gap(graph: Graph) -> None:
    w = metropolis_weights(graph)
    np.testing.assert_array_equal(w, w.T)
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-14)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-14)
    assert (w >= 0).all() and (w.diagonal() > 0).all()
    d = graph.degrees
    for i in range(graph.n):
        for j in range(graph.n):
            if i != j:
                assert w[i, j] == (1.0 / (1 + max(d[i], d[j])) if graph.has_edge(i, j) else 0.0)
    validate_mixing(w, graph)
    assert support_graph(w) == graph
    assert 0.0 < spectral_gap(w) <= 1.0 and slem(w) < 1.0
    assert rho_laplacian(w) > 1e-9


def test_metropolis_ring_reference_values() -> None:
    w5 = metropolis_weights(ring(5))
    np.testing.assert_allclose(w5[w5 > 0], 1 / 3, atol=1e-15)  # dp_quantized.md 6.3: 1/3 everywhere
    assert abs(rho_laplacian(w5) - 0.4607) < 5e-5
    # Closed form for a ring with weights 1/3: eigenvalues 1/3 + 2/3 cos(2 pi k / n).
    for n in (5, 8):
        ev = 1 / 3 + 2 / 3 * np.cos(2 * np.pi * np.arange(n) / n)
        lam = np.sort(ev)[:-1]
        assert abs(slem(metropolis_weights(ring(n))) - max(abs(lam[0]), abs(lam[-1]))) < 1e-12
        assert abs(rho_laplacian(metropolis_weights(ring(n))) - (1 - lam[-1])) < 1e-12
    # Complete graph: W = 11^T/n, consensus in one step.
    assert abs(spectral_gap(metropolis_weights(complete(6))) - 1.0) < 1e-12


def test_validate_mixing_rejects_bad_matrices() -> None:
    w = metropolis_weights(ring(5))
    with pytest.raises(ValueError, match="square"):
        validate_mixing(w[:, :4])
    asym = w.copy()
    asym[0, 1] += 0.01
    asym[0, 0] -= 0.01
    with pytest.raises(ValueError, match="not symmetric"):
        validate_mixing(asym)
    with pytest.raises(ValueError, match="rows do not sum to 1"):
        validate_mixing(w * 1.01)
    neg = np.array([[1.5, -0.5], [-0.5, 1.5]])
    with pytest.raises(ValueError, match="negative entry"):
        validate_mixing(neg)
    block = np.zeros((6, 6))
    block[:3, :3] = metropolis_weights(ring(3))
    block[3:, 3:] = metropolis_weights(ring(3))
    with pytest.raises(ValueError, match="disconnected"):
        validate_mixing(block)
    assert slem(block) == pytest.approx(1.0) and spectral_gap(block) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="support does not match the graph"):
        validate_mixing(metropolis_weights(complete(5)), ring(5))
    with pytest.raises(ValueError, match="graph has n = 8"):
        validate_mixing(w, ring(8))
    bad = w.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        validate_mixing(bad)


# ---------------------------------------------------------------------------------------------------------------
# Counting (dp_recal.md 7.6)


def test_comm_counters_relay_run() -> None:
    n, K, q = 8, 50, 20
    c = CommCounters()
    c.add_registration(n, bytes_up=0, bytes_down=n * q * 8)
    for _ in range(K):
        c.add_hop(bytes_up=2 * q * 8, bytes_down=2 * q * 8)
    assert c.graph_msgs == K and c.flower_transfers == 2 * K + 2 * n
    assert c.as_dict() == {"graph_msgs": K, "flower_transfers": 2 * K + 2 * n,
                           "bytes_up": K * 2 * q * 8, "bytes_down": K * 2 * q * 8 + n * q * 8}
    c.add_round(graph_msgs=16, flower_transfers=2 * n, bytes_up=1, bytes_down=2)
    assert c.graph_msgs == K + 16
