"""Table V baselines of DP-RECAL (fedpdm_flower/fedapp/algorithms/recal_baselines.py): spec dp_recal.md 5.6, 5.7, 6.1, 7.7, A13.

Noise-free PG-EXTRA / NIDS / RW-ADMM reach the FISTA x* on the 8-ring; the per-agent functions (what a Flower client
runs) equal the vectorised simulators bit for bit; the DP noise follows sigma_t = sigma_1 R^{-(t-1)/2} from the
stateless streams and is calibrated with the section-4.5 formulas of fedpdm_flower.fedapp.privacy.zcdp; the communication
constants reproduce Table V's Comm. column.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.algorithms.recal import ElasticNetProblem, FloatArray, solve_elastic_net
from fedpdm_flower.fedapp.algorithms.recal import synthetic_problem as synthetic
from fedpdm_flower.fedapp.algorithms.recal_baselines import (
    ALGORITHMS,
    STREAM_NIDS,
    STREAM_PG_EXTRA,
    STREAM_RW_ADMM,
    TABLE_V_COMM_RING8,
    TABLE_V_ITERATIONS,
    BaselineResult,
    NoiseConfig,
    RWAdmmState,
    baseline_sigma1,
    canonical_algorithm,
    elastic_net_prox,
    gradient_message_sensitivity,
    messages_per_iteration,
    mixing_row,
    nids_alpha_bound,
    nids_init,
    nids_publish,
    nids_step,
    paper_communication,
    pg_extra_alpha_bound,
    pg_extra_init,
    pg_extra_publish,
    pg_extra_step,
    publication_noise,
    rw_admm_hops,
    rw_admm_initial_token,
    rw_admm_publish,
    rw_admm_sensitivity,
    rw_admm_step,
    simulate_nids,
    simulate_pg_extra,
    simulate_rw_admm,
)
from fedpdm_flower.fedapp.privacy import zcdp

RING8 = topology.ring(8)
Simulator = Callable[..., BaselineResult]
SYNC: dict[str, Simulator] = {"pg-extra": simulate_pg_extra, "nids": simulate_nids}


@pytest.fixture(scope="module")
def problem() -> ElasticNetProblem:
    return synthetic()


@pytest.fixture(scope="module")
def x_star(problem: ElasticNetProblem) -> FloatArray:
    sol = solve_elastic_net(problem)
    assert sol.converged and sol.residual < 1e-12
    return sol.x


# --------------------------------------------------------------------------------------------- communication
def test_messages_per_iteration_reproduces_table_v() -> None:
    """Spec 5.6 table / 6.1: 16, 32, 32, 16, 1 per iteration on ring-8; x (600, 600, 600, 1200, 4800) iterations."""
    per_iter = {"nids": 16, "pg-extra": 32, "ic-admm": 32, "rw-admm": 16, "dp-recal": 1}
    spec_iters = {"nids": 600, "pg-extra": 600, "ic-admm": 600, "rw-admm": 1200, "dp-recal": 4800}
    spec_totals = {"nids": 9600, "pg-extra": 19200, "ic-admm": 19200, "rw-admm": 19200, "dp-recal": 4800}
    assert set(ALGORITHMS) == set(per_iter)
    assert spec_iters == TABLE_V_ITERATIONS
    assert spec_totals == TABLE_V_COMM_RING8
    for algo in ALGORITHMS:
        assert messages_per_iteration(algo, RING8) == per_iter[algo]
        assert messages_per_iteration(algo, RING8) * spec_iters[algo] == spec_totals[algo]
        assert paper_communication(algo, RING8) == spec_totals[algo]
        assert paper_communication(algo, RING8, 10) == 10 * per_iter[algo]
    # documented extrapolation: multiples of 2m (complete-8: m = 28)
    k8 = topology.complete(8)
    assert [messages_per_iteration(a, k8) for a in ("nids", "pg-extra", "rw-admm", "dp-recal")] == [56, 112, 56, 1]


def test_algorithm_names() -> None:
    assert canonical_algorithm("DP-NIDS") == "nids"
    assert canonical_algorithm("DP_PG_EXTRA") == "pg-extra"
    assert canonical_algorithm("pgextra") == "pg-extra"
    assert canonical_algorithm("RW-ADMM") == "rw-admm"
    assert canonical_algorithm("recal") == canonical_algorithm("DP-RECAL") == "dp-recal"
    with pytest.raises(ValueError, match="unknown algorithm"):
        canonical_algorithm("extra")
    with pytest.raises(ValueError, match="iterations"):
        paper_communication("nids", RING8, -1)


def test_rw_admm_activation_probability_mapping() -> None:
    """P = 0.5, T = 1200 on ring-8 -> 4800 token hops, expected LCI P T = 600 (= 4800 g_i)."""
    assert rw_admm_hops(1200, 0.5, 8) == 4800
    assert rw_admm_hops(1200, 0.5, 8) * topology.stationary_distribution(RING8).max() == pytest.approx(600)
    assert rw_admm_hops(3, 0.5, 5) == 8  # round(7.5) half up
    assert rw_admm_hops(0, 0.5, 8) == 0
    with pytest.raises(ValueError):
        rw_admm_hops(10, 0.0, 8)


# --------------------------------------------------------------------------------------------- convergence
@pytest.mark.parametrize("algo", ["pg-extra", "nids"])
def test_noise_free_sync_baselines_converge_on_ring8(algo: str, problem: ElasticNetProblem, x_star: FloatArray) -> None:
    """Noise off, Table V's T = 600 rounds on the 8-ring: agent average and every agent reach x* (< 1e-9)."""
    res = SYNC[algo](problem, RING8, 600, x_star=x_star, eval_every=100)
    assert res.algorithm == algo
    assert res.rel_errors[-1] < 1e-9 and res.max_rel_errors[-1] < 1e-9
    assert np.linalg.norm(res.x - x_star) / np.linalg.norm(x_star) < 1e-9
    # support of x*: PG-EXTRA's local x_i^{k+1/2} approach the l1 threshold from above off the support, so there
    # x_i decays to ~1e-16 rather than hitting exact zeros
    assert np.abs(res.agent_x[:, x_star == 0]).max() < 1e-12 and np.all(res.agent_x[:, x_star != 0] != 0)
    assert list(res.eval_iters) == [0, 100, 200, 300, 400, 500, 600]
    assert res.rel_errors[0] == 1.0 and res.rel_errors[2] < res.rel_errors[1] < 1.0
    assert res.lci == 600 and np.all(res.tau == 600)
    assert res.paper_messages == TABLE_V_COMM_RING8[algo] and res.messages_sent == 16 * 600
    assert res.sigma1 == 0.0 and math.isinf(res.epsilon(1e-3))


@pytest.mark.parametrize("algo", ["pg-extra", "nids"])
def test_sync_baselines_converge_complete_graph_multioutput(algo: str) -> None:
    """Complete-8, one-hot-like C = 3 outputs, unequal m_i (q = 20): relative error < 1e-6 within 1500 rounds."""
    prob = synthetic(sizes=[30, 45, 60, 80, 100, 40, 55, 120], outputs=3, seed=2)
    xs = solve_elastic_net(prob).x
    res = SYNC[algo](prob, topology.complete(8), 1500, x_star=xs, eval_every=1500)
    assert res.x.shape == (20, 3) and res.agent_x.shape == (8, 20, 3)
    assert res.rel_errors[-1] < 1e-6 and res.max_rel_errors[-1] < 1e-6


def test_noise_free_rw_admm_converges_on_ring8(problem: ElasticNetProblem, x_star: FloatArray) -> None:
    """Table V's RW-ADMM setting (T = 1200, P = 0.5 -> 4800 hops) reaches x* to < 1e-9 without noise."""
    res = simulate_rw_admm(problem, RING8, 1200, x_star=x_star, eval_every=300)
    assert res.rel_errors[-1] < 1e-9 and res.max_rel_errors[-1] < 1e-9
    assert list(res.eval_iters) == [0, 300, 600, 900, 1200]
    assert np.all(np.diff(res.rel_errors) < 0)
    assert res.hops == 4800 and res.messages_sent == 4800 and int(res.tau.sum()) == 4800
    assert res.paper_messages == 19200 and res.iterations == 1200
    assert 600 <= res.lci <= 720  # expected 600 = P T; realised max over agents (spec 3.4: 606-720)
    assert res.holders is not None
    assert all(RING8.has_edge(int(a), int(b)) for a, b in zip(res.holders[:-1], res.holders[1:], strict=True))
    assert res.step == pytest.approx(2.0 * problem.lipschitz.max())
    k8 = simulate_rw_admm(problem, topology.complete(8), 1200, x_star=x_star, eval_every=1200, walk_seed=3)
    assert k8.rel_errors[-1] < 1e-9


def test_rw_admm_simulator_is_the_per_agent_step(problem: ElasticNetProblem, x_star: FloatArray) -> None:
    """Replaying rw_admm_step / rw_admm_publish along the simulator's holders gives its x bit for bit, with and
    without noise; noise-free, the token stays (1/n) sum_i (y_i + z_i / beta)."""
    n, T = problem.n, 50
    for sigma1 in (0.0, 0.05):
        res = simulate_rw_admm(problem, RING8, T, x_star=x_star, sigma1=sigma1, R=1.01, noise_seed=7, walk_seed=5)
        assert res.holders is not None and res.hops == rw_admm_hops(T, 0.5, n)
        beta = res.step
        prox = elastic_net_prox(1.0 / beta, problem.nu1, problem.nu2)
        noise = NoiseConfig(sigma1, 1.01, 7)
        states = [RWAdmmState.initial(np.zeros(20)) for _ in range(n)]
        token = rw_admm_initial_token(np.zeros(20))
        for i in res.holders.tolist():
            st, clean, _ = rw_admm_step(token, states[i], problem.agents[i].grad, beta, n, prox)
            states[i], token = rw_admm_publish(clean, st, i, noise)
            if sigma1 == 0.0:
                avg = np.mean([s.y + s.z / beta for s in states], axis=0)
                np.testing.assert_allclose(token, avg, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(prox(token), res.x)
        np.testing.assert_array_equal(np.stack([s.y for s in states]), res.agent_x)
        assert [s.t for s in states] == res.tau.tolist()


def test_rw_admm_fixed_point(problem: ElasticNetProblem, x_star: FloatArray) -> None:
    """At y_i = x*, z_i = -grad f_i(x*), token = x* - sum_i grad f_i(x*) / (n beta), a step changes nothing."""
    n = problem.n
    beta = 2.0 * float(problem.lipschitz.max())
    prox = elastic_net_prox(1.0 / beta, problem.nu1, problem.nu2)
    grads = [a.grad(x_star) for a in problem.agents]
    token = x_star - np.sum(grads, axis=0) / (n * beta)
    for i in range(n):
        st = RWAdmmState(x_star.copy(), -grads[i])
        new, new_token, x = rw_admm_step(token, st, problem.agents[i].grad, beta, n, prox)
        np.testing.assert_allclose(x, x_star, atol=1e-13)
        np.testing.assert_allclose(new.y, x_star, atol=1e-13)
        np.testing.assert_allclose(new.z, -grads[i], atol=1e-13)
        np.testing.assert_allclose(new_token, token, atol=1e-13)


# --------------------------------------------------------------------------------------------- per agent == vectorised
def _per_agent_pg_extra(prob: ElasticNetProblem, graph: topology.Graph, T: int, alpha: float,
                        noise: NoiseConfig) -> FloatArray:
    """A hand-written client loop: publish x_i^k, hand each agent its neighbours' messages as a dict, step."""
    w = topology.metropolis_weights(graph)
    prox = elastic_net_prox(alpha, prob.nu1, prob.nu2)
    states = [pg_extra_init(np.zeros(prob.x_shape), a.grad, alpha, prox) for a in prob.agents]
    for _ in range(T):
        published = {}
        for i in range(prob.n):
            states[i], published[i] = pg_extra_publish(states[i], i, noise)
        new = []
        for i, st in enumerate(states):
            w_self, w_nbrs = mixing_row(w, graph, i)
            msgs = {j: published[j] for j in graph.neighbours[i]}
            new.append(pg_extra_step(st, msgs, w_self, w_nbrs, prob.agents[i].grad, alpha, prox))
        states = new
    return np.stack([s.x for s in states])


def _per_agent_nids(prob: ElasticNetProblem, graph: topology.Graph, T: int, alpha: float,
                    noise: NoiseConfig) -> FloatArray:
    w = topology.metropolis_weights(graph)
    prox = elastic_net_prox(alpha, prob.nu1, prob.nu2)
    states = [nids_init(np.zeros(prob.x_shape), a.grad, alpha, prox) for a in prob.agents]
    for _ in range(T):
        published = {}
        for i in range(prob.n):
            states[i], published[i] = nids_publish(states[i], prob.agents[i].grad, alpha, i, noise)
        new = []
        for i, st in enumerate(states):
            w_self, w_nbrs = mixing_row(w, graph, i)
            new.append(nids_step(st, {j: published[j] for j in graph.neighbours[i]}, w_self, w_nbrs, prox))
        states = new
    return np.stack([s.x for s in states])


@pytest.mark.parametrize("algo", ["pg-extra", "nids"])
@pytest.mark.parametrize(("graph_name", "outputs"), [("ring", None), ("star", None), ("path", 2)])
@pytest.mark.parametrize("sigma1", [0.0, 0.2])
def test_per_agent_functions_equal_vectorised_bit_for_bit(
    algo: str, graph_name: str, outputs: int | None, sigma1: float
) -> None:
    """Five rounds of the per-agent functions (dict messages, as a Flower client gets them) equal the vectorised
    simulator exactly, with and without noise, on regular and non-regular graphs (padded neighbour slots)."""
    n = 8 if graph_name == "ring" else 5
    graph = {"ring": topology.ring, "star": topology.star, "path": topology.path_graph}[graph_name](n)
    prob = synthetic(n=n, outputs=outputs, seed=1)
    xs = solve_elastic_net(prob).x
    noise = NoiseConfig(sigma1, 1.05, 11)
    vec = SYNC[algo](prob, graph, 5, x_star=xs, sigma1=sigma1, R=1.05, noise_seed=11)
    eng = SYNC[algo](prob, graph, 5, x_star=xs, sigma1=sigma1, R=1.05, noise_seed=11, engine="per_agent")
    hand = (_per_agent_pg_extra if algo == "pg-extra" else _per_agent_nids)(prob, graph, 5, vec.step, noise)
    np.testing.assert_array_equal(vec.agent_x, hand)
    np.testing.assert_array_equal(vec.agent_x, eng.agent_x)
    np.testing.assert_array_equal(vec.rel_errors, eng.rel_errors)
    np.testing.assert_array_equal(vec.max_rel_errors, eng.max_rel_errors)
    if sigma1 > 0:  # the noise is really there
        clean = SYNC[algo](prob, graph, 5, x_star=xs)
        assert not np.array_equal(clean.agent_x, vec.agent_x)


def test_pg_extra_first_rounds_by_hand(problem: ElasticNetProblem) -> None:
    """x^{1/2} = W x^0 - a grad f(x^0), x^{3/2} = W x^1 + x^{1/2} - W~ x^0 - a (grad f(x^1) - grad f(x^0)) (dense)."""
    w = topology.metropolis_weights(RING8)
    wt = 0.5 * (np.eye(8) + w)
    alpha = 0.5 * pg_extra_alpha_bound(w, float(problem.lipschitz.max()))
    prox = elastic_net_prox(alpha, problem.nu1, problem.nu2)

    def grad(xs: FloatArray) -> FloatArray:
        return np.stack([a.grad(xs[i]) for i, a in enumerate(problem.agents)])

    x0 = np.zeros((8, 20))
    h1 = w @ x0 - alpha * grad(x0)
    x1 = prox(h1)
    h2 = w @ x1 + h1 - wt @ x0 - alpha * (grad(x1) - grad(x0))
    x2 = prox(h2)
    h3 = w @ x2 + h2 - wt @ x1 - alpha * (grad(x2) - grad(x1))
    res = simulate_pg_extra(problem, RING8, 2, eval_every=1)
    np.testing.assert_allclose(res.agent_x, prox(h3), rtol=0, atol=1e-12)
    assert res.step == alpha == pytest.approx(1.0 / (3.0 * problem.lipschitz.max()))  # lambda_min(W~) = 1/3


def test_nids_first_rounds_by_hand(problem: ElasticNetProblem) -> None:
    """z^1 = x^0 - a grad f(x^0); z^{k+1} = z^k - x^k + W~(2x^k - x^{k-1} - a grad f(x^k) + a grad f(x^{k-1}))."""
    w = topology.metropolis_weights(RING8)
    wt = 0.5 * (np.eye(8) + w)
    alpha = 1.0 / float(problem.lipschitz.max())
    prox = elastic_net_prox(alpha, problem.nu1, problem.nu2)

    def grad(xs: FloatArray) -> FloatArray:
        return np.stack([a.grad(xs[i]) for i, a in enumerate(problem.agents)])

    x_prev = np.zeros((8, 20))
    z = x_prev - alpha * grad(x_prev)
    x = prox(z)
    for _ in range(3):
        z = z - x + wt @ (2 * x - x_prev - alpha * grad(x) + alpha * grad(x_prev))
        x_prev, x = x, prox(z)
    res = simulate_nids(problem, RING8, 3)
    np.testing.assert_allclose(res.agent_x, x, rtol=0, atol=1e-12)
    assert res.step == pytest.approx(alpha)


# --------------------------------------------------------------------------------------------- DP
def test_publication_noise_schedule_and_stream() -> None:
    """sigma_t = zcdp.sigma_at(t) = sigma_1 R^{-(t-1)/2}; stream default_rng([seed, tag, agent, t]); None at 0."""
    noise = NoiseConfig(sigma1=3.0, R=1.05, noise_seed=9)
    for stream in (STREAM_PG_EXTRA, STREAM_NIDS, STREAM_RW_ADMM):
        for t in (1, 50):
            draw = publication_noise((100_000,), t, 4, noise, stream)
            assert draw is not None
            expected = zcdp.sigma_at(t, 3.0, 1.05)
            assert expected == pytest.approx(3.0 * 1.05 ** (-(t - 1) / 2), rel=1e-12)
            assert float(draw.std()) == pytest.approx(expected, rel=0.02)
            ref = expected * np.random.default_rng([9, stream, 4, t]).standard_normal(100_000)
            np.testing.assert_array_equal(draw, ref)
    assert publication_noise((3,), 1, 0, NoiseConfig(0.0), STREAM_NIDS) is None
    assert publication_noise((3,), 1, 0, None, STREAM_NIDS) is None
    a = publication_noise((5,), 2, 1, noise, STREAM_PG_EXTRA)
    b = publication_noise((5,), 2, 2, noise, STREAM_PG_EXTRA)  # other agent
    c = publication_noise((5,), 2, 1, noise, STREAM_NIDS)  # other algorithm
    assert a is not None and b is not None and c is not None
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    with pytest.raises(ValueError, match="from 1"):
        publication_noise((3,), 0, 0, noise, STREAM_NIDS)


def test_publish_adds_the_agents_t_th_noise(problem: ElasticNetProblem) -> None:
    """Each publish increments t and adds exactly publication_noise(t); the exact iterate stays in the state."""
    noise = NoiseConfig(0.7, 1.2, 3)
    grad = problem.agents[2].grad
    alpha = 0.1
    prox = elastic_net_prox(alpha, problem.nu1, problem.nu2)
    st = pg_extra_init(np.zeros(20), grad, alpha, prox)
    for t in (1, 2, 3):
        st, msg = pg_extra_publish(st, 2, noise)
        assert st.t == t
        eps = publication_noise((20,), t, 2, noise, STREAM_PG_EXTRA)
        assert eps is not None
        np.testing.assert_array_equal(msg, st.x + eps)
        st = pg_extra_step(st, {1: msg, 3: msg}, 1 / 3, {1: 1 / 3, 3: 1 / 3}, grad, alpha, prox)
    ns = nids_init(np.zeros(20), grad, alpha, prox)
    ns, msg = nids_publish(ns, grad, alpha, 2, noise)
    assert ns.v is not None and ns.t == 1
    eps = publication_noise((20,), 1, 2, noise, STREAM_NIDS)
    assert eps is not None
    np.testing.assert_array_equal(msg, ns.v + eps)
    with pytest.raises(ValueError, match="already published"):
        nids_publish(ns, grad, alpha, 2, noise)


@pytest.mark.parametrize("algo", ["pg-extra", "nids"])
def test_sync_calibration_matches_zcdp(algo: str, problem: ElasticNetProblem, x_star: FloatArray) -> None:
    """epsilon -> sigma_1 with Delta = 2 alpha L_max and xi = T (spec 5.6 [interp], 4.5 formulas), round trip."""
    T, eps, delta, R = 40, 5.0, 1e-3, 1.01
    res = SYNC[algo](problem, RING8, T, x_star=x_star, epsilon=eps, delta=delta, R=R, eval_every=T)
    L_max = float(problem.lipschitz.max())
    Delta = 2.0 * res.step * L_max
    assert res.sensitivity == pytest.approx(Delta, rel=1e-15) == gradient_message_sensitivity(res.step, L_max)
    assert res.sigma1 == zcdp.sigma1_for_budget(eps, delta, Delta, R, T) == baseline_sigma1(eps, delta, R, T, Delta)
    # spec 4.5 written out: sigma_1 = Delta sqrt(geom_sum(R, xi) / (2 rho(eps, delta)))
    a = math.log(1 / delta)
    rho = (math.sqrt(a + eps) - math.sqrt(a)) ** 2
    assert res.sigma1 == pytest.approx(Delta * math.sqrt((R**T - 1) / (R - 1) / (2 * rho)), rel=1e-9)
    assert res.lci == T and res.R == R
    assert res.epsilon(delta) == pytest.approx(eps, rel=1e-9)
    assert zcdp.epsilon_from_noise(res.sigma1, Delta, R, T, delta) == pytest.approx(eps, rel=1e-9)
    assert np.isfinite(res.rel_errors).all()
    with pytest.raises(ValueError, match="either sigma1 or epsilon"):
        SYNC[algo](problem, RING8, T, x_star=x_star, epsilon=eps, sigma1=1.0)


def test_rw_admm_calibration_and_stop_on_budget(problem: ElasticNetProblem, x_star: FloatArray) -> None:
    """Delta = 4 L / (n beta), sigma_1 calibrated at xi_plan; stop_on_budget keeps every tau_i <= xi_plan."""
    eps, delta, R = 5.0, 1e-3, 1.01
    res = simulate_rw_admm(problem, RING8, 100, x_star=x_star, epsilon=eps, delta=delta, R=R, xi_plan=40,
                           stop_on_budget=True, eval_every=10)
    L_max = float(problem.lipschitz.max())
    assert res.sensitivity == pytest.approx(4 * L_max / (8 * res.step)) == rw_admm_sensitivity(res.step, L_max, 8)
    assert res.sensitivity == pytest.approx(0.25)  # beta = 2 L_max, n = 8
    assert res.sigma1 == zcdp.sigma1_for_budget(eps, delta, res.sensitivity, R, 40)
    assert res.hops is not None and res.hops < 400  # 400 hops would need some tau_i > 40
    assert res.lci <= 40 and res.epsilon(delta) <= eps * (1 + 1e-12)
    assert res.paper_messages == 16 * res.iterations and res.messages_sent == res.hops
    assert res.eval_iters[-1] == res.iterations
    default = simulate_rw_admm(problem, RING8, 20, x_star=x_star, epsilon=eps, R=R, eval_every=20)
    plan = topology.plan_xi(rw_admm_hops(20, 0.5, 8), RING8, "markov")
    assert default.sigma1 == zcdp.sigma1_for_budget(eps, delta, default.sensitivity, R, plan)


@pytest.mark.parametrize("algo", ["pg-extra", "nids", "rw-admm"])
def test_dp_error_decreases_with_epsilon(algo: str, problem: ElasticNetProblem, x_star: FloatArray) -> None:
    """Median final error over 3 noise seeds: eps = 1 worse than eps = 10 (trend only, spec A2)."""
    sim: Simulator = simulate_rw_admm if algo == "rw-admm" else SYNC[algo]
    T = 300 if algo == "rw-admm" else 150

    def final(eps: float, seed: int) -> float:
        return float(sim(problem, RING8, T, x_star=x_star, epsilon=eps, R=1.01, noise_seed=seed,
                         eval_every=T).rel_errors[-1])

    med = {eps: float(np.median([final(eps, s) for s in range(3)])) for eps in (1.0, 10.0)}
    assert med[10.0] < med[1.0]


# --------------------------------------------------------------------------------------------- validation
def test_validation_errors(problem: ElasticNetProblem, x_star: FloatArray) -> None:
    L_max = float(problem.lipschitz.max())
    with pytest.raises(ValueError, match="not below its bound"):
        simulate_nids(problem, RING8, 2, x_star=x_star, alpha=nids_alpha_bound(L_max))
    simulate_nids(problem, RING8, 2, x_star=x_star, alpha=nids_alpha_bound(L_max), allow_large_alpha=True)
    with pytest.raises(ValueError, match="not below its bound"):
        simulate_pg_extra(problem, RING8, 2, x_star=x_star, alpha=1.01 * pg_extra_alpha_bound(
            topology.metropolis_weights(RING8), L_max))
    with pytest.raises(ValueError, match="agents"):
        simulate_pg_extra(problem, topology.ring(5), 2, x_star=x_star)
    with pytest.raises(ValueError, match="engine"):
        simulate_pg_extra(problem, RING8, 2, x_star=x_star, engine="gpu")
    with pytest.raises(ValueError, match="0/0"):
        simulate_nids(problem, RING8, 2, x_star=x_star, x0=x_star)
    with pytest.raises(ValueError, match="support does not match"):
        simulate_nids(problem, RING8, 2, x_star=x_star, weights=topology.metropolis_weights(topology.complete(8)))
    prox = elastic_net_prox(0.1, problem.nu1, problem.nu2)
    grad = problem.agents[0].grad
    st = pg_extra_init(np.zeros(20), grad, 0.1, prox)
    with pytest.raises(ValueError, match="neighbours"):
        pg_extra_step(st, {1: np.zeros(20)}, 1 / 3, {1: 1 / 3, 7: 1 / 3}, grad, 0.1, prox)
    with pytest.raises(ValueError, match="shape"):
        pg_extra_step(st, {1: np.zeros(3)}, 0.5, {1: 0.5}, grad, 0.1, prox)
    with pytest.raises(ValueError, match="nids_publish first"):
        nids_step(nids_init(np.zeros(20), grad, 0.1, prox), {1: np.zeros(20)}, 0.5, {1: 0.5}, prox)
    with pytest.raises(ValueError):
        NoiseConfig(sigma1=-1.0)
    with pytest.raises(ValueError):
        NoiseConfig(R=0.5)
