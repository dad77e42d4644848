"""DP-RECAL (seed 001) mathematics: spec dp_recal.md section 9 items 12-19 and the elastic-net reference x*."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
from scipy.optimize import minimize_scalar
from sklearn.linear_model import ElasticNet

from fedpdm_flower.fedapp.algorithms.recal import (
    MODES,
    AgentState,
    Baton,
    ElasticNetProblem,
    LocalLeastSquares,
    RecalConfig,
    alpha_for,
    beta_for,
    check_alpha,
    dprecal_step,
    elastic_net,
    encode_targets,
    lipschitz_power_iteration,
    load_covtype_problem,
    markov_next,
    minmax_scale,
    noise_sigma,
    prox_nr,
    relative_error,
    simulate_dprecal,
    sklearn_elastic_net_params,
    solve_elastic_net,
    split_agents,
)
from fedpdm_flower.fedapp.algorithms.recal import synthetic_problem as synthetic
from fedpdm_flower.fedapp.apps.recal import load_mnist_problem
from fedpdm_flower.fedapp.data.sources import ArrayDataset, DatasetInfo

N = 8
RING = [[(i - 1) % N, (i + 1) % N] for i in range(N)]


@pytest.fixture(scope="module")
def problem() -> ElasticNetProblem:
    return synthetic()


@pytest.fixture(scope="module")
def x_star(problem: ElasticNetProblem) -> np.ndarray:
    sol = solve_elastic_net(problem)
    assert sol.converged and sol.residual < 1e-12
    return sol.x


# --------------------------------------------------------------------------------------------- building blocks
@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize(("nu1", "nu2"), [(0.0, 0.0), (0.5, 0.0), (0.0, 0.5), (0.5, 0.5)])
def test_prox_matches_brute_force_1d(n: int, nu1: float, nu2: float) -> None:
    """Spec 9.12: prox_{n r}(v) per coordinate = argmin_z n (nu1 |z| + nu2 z^2) + (z - v)^2 / 2."""
    v = np.random.default_rng(3).uniform(-12, 12, 15)
    got = prox_nr(v, n, nu1, nu2)
    for vi, gi in zip(v, got, strict=True):

        def obj(z: float, vi: float = vi) -> float:
            return n * (nu1 * abs(z) + nu2 * z * z) + 0.5 * (z - vi) ** 2

        res = minimize_scalar(obj, bounds=(-abs(vi) - 1.0, abs(vi) + 1.0), method="bounded", options={"xatol": 1e-12})
        # Brent's method locates a minimiser of a function with curvature ~1 only to ~sqrt(machine eps)
        assert gi == pytest.approx(res.x, abs=1e-6)
        assert obj(gi) <= obj(res.x) + 1e-13
        grid = gi + np.linspace(-1e-3, 1e-3, 201)
        assert obj(gi) <= min(obj(z) for z in grid) + 1e-15
    if nu1 == nu2 == 0:
        np.testing.assert_array_equal(got, v)  # r = 0: identity


def test_prox_of_the_paper_and_elastic_net_value() -> None:
    v = np.array([-7.0, -3.0, 0.5, 4.0, 9.0])
    np.testing.assert_allclose(prox_nr(v, 8, 0.5, 0.5), np.array([-3.0, 0.0, 0.0, 0.0, 5.0]) / 9.0)
    assert elastic_net(np.array([1.0, -2.0]), 0.5, 0.5) == pytest.approx(0.5 * 3 + 0.5 * 5)


@pytest.mark.parametrize("outputs", [None, 3])
def test_gradient_matches_finite_differences(outputs: int | None) -> None:
    rng = np.random.default_rng(4)
    shape = (6,) if outputs is None else (6, outputs)
    for m in (40, 4):  # Gram path (q <= m) and direct path (q > m)
        agent = LocalLeastSquares(rng.uniform(0, 1, (m, 6)), rng.standard_normal((m, *shape[1:])))
        assert agent.uses_gram == (m >= 6)
        y = rng.standard_normal(shape)
        g = agent.grad(y)
        np.testing.assert_allclose(g, agent.grad_direct(y), rtol=1e-12, atol=1e-13)
        fd = np.zeros(shape)
        h = 1e-6
        for idx in np.ndindex(shape):
            e = np.zeros(shape)
            e[idx] = h
            fd[idx] = (agent.value(y + e) - agent.value(y - e)) / (2 * h)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)


def test_lipschitz_eigvalsh_vs_power_iteration_and_svd() -> None:
    rng = np.random.default_rng(5)
    for m, q in ((50, 12), (7, 12)):
        b_mat = rng.uniform(0, 1, (m, q))
        agent = LocalLeastSquares(b_mat, rng.standard_normal(m))
        svd = np.linalg.norm(b_mat, 2) ** 2 / m
        assert agent.lipschitz == pytest.approx(svd, rel=1e-12)
        assert lipschitz_power_iteration(b_mat) == pytest.approx(agent.lipschitz, rel=1e-10)
        # L_i bounds the gradient's variation
        y1, y2 = rng.standard_normal(q), rng.standard_normal(q)
        assert np.linalg.norm(agent.grad(y1) - agent.grad(y2)) <= agent.lipschitz * np.linalg.norm(y1 - y2) * (
            1 + 1e-12
        )


def test_stepsizes_and_guard() -> None:
    assert beta_for(8) == pytest.approx(1 / 18)
    assert alpha_for(9.0) == pytest.approx(0.1)  # 0.5 * 2 / (9 + 1)
    assert alpha_for(9.0, 0.95) == pytest.approx(0.19)
    with pytest.raises(ValueError, match="alpha_scale"):
        alpha_for(9.0, 1.0)
    check_alpha(0.19, 9.0)
    with pytest.raises(ValueError, match="Assumption 2"):  # spec 9.18
        check_alpha(0.2, 9.0)
    check_alpha(0.2, 9.0, allow_large_alpha=True)


def test_noise_schedule() -> None:
    assert noise_sigma(1, 2.0, 1.05) == pytest.approx(2.0)
    assert noise_sigma(3, 2.0, 1.05) == pytest.approx(2.0 / 1.05)
    assert noise_sigma(5000, 1e100, 2.0) == pytest.approx(1e100 * 2.0 ** (-4999 / 2), rel=1e-9)
    assert noise_sigma(7, 0.0, 1.5) == 0.0
    with pytest.raises(ValueError):
        noise_sigma(0, 1.0, 1.0)


def test_relative_error() -> None:
    assert relative_error(np.array([1.0, 1.0]), np.array([0.0, 2.0])) == pytest.approx(np.sqrt(2) / 2)
    assert relative_error(np.array([1.0]), np.array([2.0]), x_ref=np.array([4.0])) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="A9"):
        relative_error(np.zeros(3), np.zeros(3))


# --------------------------------------------------------------------------------------------- reference x*
@pytest.mark.parametrize(
    ("sizes", "outputs"),
    [([30] * N, None), ([10, 20, 30, 40, 15, 25, 35, 45], None), ([30] * N, 3)],
    ids=["equal-m", "unequal-m", "onehot-3"],
)
def test_fista_matches_sklearn_elastic_net(sizes: list[int], outputs: int | None) -> None:
    """x* by FISTA equals scikit-learn's ElasticNet with alpha = nu1 + 2 nu2, l1_ratio = nu1 / alpha, row weights
    N / (n m_i) (all 1 for equal m_i)."""
    prob = synthetic(sizes=sizes, seed=7, nu1=0.3, nu2=0.05, outputs=outputs)
    sol = solve_elastic_net(prob)
    assert sol.converged and sol.residual < 1e-12
    assert 0 < np.count_nonzero(sol.x) < sol.x.size  # the l1 term is active, x* is not trivial
    alpha, l1_ratio, weights = sklearn_elastic_net_params(prob)
    assert alpha == pytest.approx(0.4) and l1_ratio == pytest.approx(0.75)
    assert weights.sum() == pytest.approx(sum(sizes))
    feats = np.vstack([a.features for a in prob.agents])
    targets = np.concatenate([a.targets for a in prob.agents])
    fit = ElasticNet(alpha=alpha, l1_ratio=l1_ratio, fit_intercept=False, tol=1e-14, max_iter=1_000_000)
    coef = fit.fit(feats, targets, sample_weight=weights).coef_
    coef = coef if outputs is None else coef.T
    assert np.abs(coef - sol.x).max() <= 1e-6 * np.abs(sol.x).max()
    if len(set(sizes)) > 1:  # the weights matter: the unweighted mean is a different problem
        plain = ElasticNet(alpha=alpha, l1_ratio=l1_ratio, fit_intercept=False, tol=1e-14, max_iter=1_000_000)
        assert np.abs(plain.fit(feats, targets).coef_ - sol.x).max() > 1e-3


def test_fista_without_polish_and_closed_form() -> None:
    prob = synthetic(seed=2)
    polished = solve_elastic_net(prob).x
    raw = solve_elastic_net(prob, polish=False)
    assert raw.method == "fista" and raw.converged
    assert relative_error(raw.x, polished) < 1e-10
    # nu1 = 0: closed form vs FISTA; r = 0: closed form vs numpy lstsq on rows scaled by 1/sqrt(m_i) (spec 9.13)
    ridge = synthetic(seed=2, nu1=0.0, nu2=0.1)
    closed = solve_elastic_net(ridge)
    assert closed.method == "closed_form"
    assert relative_error(solve_elastic_net(ridge, method="fista").x, closed.x) < 1e-10
    ls = synthetic(seed=2, sizes=[50, 30, 70, 40, 60, 45, 55, 35], nu1=0.0, nu2=0.0)
    rows = np.vstack([a.features / np.sqrt(a.m) for a in ls.agents])
    rhs = np.concatenate([a.targets / np.sqrt(a.m) for a in ls.agents])
    np.testing.assert_allclose(solve_elastic_net(ls).x, np.linalg.lstsq(rows, rhs, rcond=None)[0], rtol=1e-10)


def test_objective_is_minimal_at_x_star(problem: ElasticNetProblem, x_star: np.ndarray) -> None:
    f_star = problem.objective(x_star)
    rng = np.random.default_rng(9)
    for _ in range(20):
        assert problem.objective(x_star + 1e-3 * rng.standard_normal(x_star.shape)) > f_star
    assert problem.objective(x_star) == pytest.approx(
        sum(a.value(x_star) for a in problem.agents) + N * (0.05 * np.abs(x_star).sum() + 0.1 * x_star @ x_star)
    )


# --------------------------------------------------------------------------------------------- the step
def _walk(seed: int, steps: int) -> list[int]:
    rng = np.random.default_rng(seed)
    cur, out = 0, [0]
    for _ in range(steps - 1):
        cur = RING[cur][int(rng.integers(2))]
        out.append(cur)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_step_invariants_and_closed_forms(problem: ElasticNetProblem, mode: str) -> None:
    """Spec 9.17 and the 2.3 closed forms, with noise on, at every iteration."""
    cfg = RecalConfig(N, problem.nu1, problem.nu2, sigma1=0.3, R=1.01, mode=mode, noise_seed=11)
    beta = 1 / 18
    alphas = [alpha_for(a.lipschitz) for a in problem.agents]
    x1 = np.random.default_rng(1).standard_normal(problem.x_shape)
    baton = Baton.initial(x1, mode)
    states = [AgentState.initial(x1) for _ in range(N)]
    noise_sum = np.zeros(problem.x_shape)
    prev_eps = np.zeros(problem.x_shape)
    for i in _walk(5, 300):
        old, st = baton, states[i]
        snapshot = [a.copy() for a in (old.x, old.ut, st.y, st.lam)]
        res = dprecal_step(old, st, problem.agents[i].grad, alphas[i], cfg, i)
        new, ns = res.baton, res.state
        # lam_half - lam = beta (x - y), read back through (12c): lam_half = grad f_i(y) + (y_new - y) / alpha
        lam_half = problem.agents[i].grad(st.y) + (ns.y - st.y) / alphas[i]
        np.testing.assert_allclose(lam_half - st.lam, beta * (old.x - st.y), rtol=1e-9, atol=1e-11)
        # Delta lambda = beta (x_new - y_new)
        np.testing.assert_allclose(ns.lam - st.lam, beta * (new.x - ns.y), rtol=1e-12, atol=1e-13)
        # x_new = prox((1 - beta) x + beta y - ut)
        np.testing.assert_allclose(
            new.x, problem.prox((1 - beta) * old.x + beta * st.y - old.ut), rtol=1e-12, atol=1e-13
        )
        assert ns.tau == st.tau + 1 and res.sigma == pytest.approx(0.3 * 1.01 ** (-(ns.tau - 1) / 2))
        # nothing is updated in place: the inputs (and so every inactive agent's y_j, lambda_j) are unchanged
        for before, after in zip(snapshot, (old.x, old.ut, st.y, st.lam), strict=True):
            np.testing.assert_array_equal(before, after)
        states[i] = ns
        baton = new
        lam_sum = np.sum([s.lam for s in states], axis=0)
        noise_sum += res.noise
        if mode == "exact":
            assert new.u is not None
            np.testing.assert_allclose(new.u, lam_sum, atol=1e-12)  # u^k = sum_j lambda_j^k
            np.testing.assert_allclose(new.ut, lam_sum - res.noise, atol=1e-12)  # one draw only
        else:
            assert new.u is None
            np.testing.assert_allclose(new.ut, lam_sum - noise_sum, atol=1e-12)  # ut = sum lam - sum eps
        prev_eps = res.noise
    assert np.linalg.norm(prev_eps) > 0
    assert sum(s.tau for s in states) == 300


def test_step_rejects_wrong_baton(problem: ElasticNetProblem) -> None:
    x1 = np.zeros(problem.x_shape)
    st = AgentState.initial(x1)
    with pytest.raises(ValueError, match="exact mode"):
        dprecal_step(Baton.initial(x1, "private"), st, problem.agents[0].grad, 0.1, RecalConfig(N, mode="exact"), 0)
    with pytest.raises(ValueError, match="private mode"):
        dprecal_step(Baton.initial(x1, "exact"), st, problem.agents[0].grad, 0.1, RecalConfig(N), 0)
    with pytest.raises(ValueError, match="mode"):
        RecalConfig(N, mode="noisy")


def test_fixed_point(problem: ElasticNetProblem, x_star: np.ndarray) -> None:
    """Spec 9.16: from x = y_i = x*, lambda_i = grad f_i(x*), u = sum lambda, a noise-free step changes nothing."""
    lams = [a.grad(x_star) for a in problem.agents]
    u = np.sum(lams, axis=0)
    cfg = RecalConfig(N, problem.nu1, problem.nu2, mode="exact")
    for i in (0, 5):
        res = dprecal_step(Baton(x_star, u, u), AgentState(x_star, lams[i], 3), problem.agents[i].grad, 0.05, cfg, i)
        scale = np.linalg.norm(x_star)
        assert np.linalg.norm(res.baton.x - x_star) <= 1e-13 * scale
        assert np.linalg.norm(res.state.y - x_star) <= 1e-13 * scale
        assert np.linalg.norm(res.state.lam - lams[i]) <= 1e-13 * max(1.0, float(np.linalg.norm(lams[i])))


# --------------------------------------------------------------------------------------------- simulator
@pytest.mark.parametrize("mode", MODES)
def test_recal_converges_to_fista_solution(problem: ElasticNetProblem, x_star: np.ndarray, mode: str) -> None:
    """Noise off: RECAL on the 8-agent ring reaches x* (FISTA) to relative error < 1e-8 in both modes (spec 9.14)."""
    res = simulate_dprecal(
        problem,
        RING,
        12000,
        markov_next(RING, np.random.default_rng(0)),
        0,
        mode=mode,
        x_star=x_star,
        eval_every=500,
    )
    assert res.rel_errors[-1] < 1e-8
    assert relative_error(res.x, x_star) < 1e-8
    assert np.array_equal(res.x != 0, x_star != 0)  # same support
    assert max(np.linalg.norm(s.y - res.x) for s in res.states) < 1e-8 * np.linalg.norm(x_star)
    assert res.iterations == 12000 and res.tau.sum() == 12000 and res.lci == res.tau.max()
    assert all(b in RING[a] for a, b in zip(res.holders[:-1], res.holders[1:], strict=True))
    assert list(res.eval_iters[:3]) == [0, 500, 1000] and res.eval_iters[-1] == 12000


def test_sigma_zero_modes_coincide_and_cyclic_walk(problem: ElasticNetProblem, x_star: np.ndarray) -> None:
    """Spec 9.19 / 9.15: sigma1 = 0 gives bit-identical exact and private runs; a cyclic walk also converges."""
    runs = [
        simulate_dprecal(problem, RING, 600, markov_next(RING, np.random.default_rng(4)), 2, mode=m, x_star=x_star)
        for m in MODES
    ]
    np.testing.assert_array_equal(runs[0].x, runs[1].x)
    np.testing.assert_array_equal(runs[0].rel_errors, runs[1].rel_errors)
    cyc = simulate_dprecal(problem, RING, 12000, lambda cur, k: (cur + 1) % N, 0, x_star=x_star, eval_every=12000)
    assert cyc.rel_errors[-1] < 1e-8
    assert cyc.tau.tolist() == [1500] * N


def test_simulation_is_deterministic(problem: ElasticNetProblem, x_star: np.ndarray) -> None:
    def run(walk_seed: int, noise_seed: int, mode: str = "private") -> Any:
        return simulate_dprecal(
            problem,
            RING,
            400,
            markov_next(RING, np.random.default_rng(walk_seed)),
            0,
            mode=mode,
            sigma1=0.5,
            R=1.01,
            noise_seed=noise_seed,
            x_star=x_star,
        )

    a, b = run(1, 2), run(1, 2)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.holders, b.holders)
    np.testing.assert_array_equal(a.rel_errors, b.rel_errors)
    assert not np.array_equal(run(1, 3).x, a.x)  # another noise seed, same walk
    assert np.array_equal(run(1, 3).holders, a.holders)
    assert not np.array_equal(run(7, 2).holders, a.holders)
    # exact mode is more accurate than private mode at the same noise (spec 9.21, one seed, wide margin)
    assert run(1, 2, "exact").rel_errors[-1] < a.rel_errors[-1]


def test_simulator_checks_and_budget_stop(problem: ElasticNetProblem, x_star: np.ndarray) -> None:
    with pytest.raises(ValueError, match="not a graph edge"):
        simulate_dprecal(problem, RING, 10, lambda cur, k: (cur + 3) % N, 0, x_star=x_star)
    jump = simulate_dprecal(problem, RING, 10, lambda cur, k: (cur + 3) % N, 0, x_star=x_star, check_edges=False)
    assert jump.iterations == 10
    with pytest.raises(ValueError, match="Assumption 2"):
        simulate_dprecal(problem, RING, 10, lambda cur, k: (cur + 1) % N, 0, x_star=x_star, alphas=[1.0] * N)
    with pytest.raises(ValueError, match="A9"):
        simulate_dprecal(problem, RING, 10, lambda cur, k: (cur + 1) % N, 0, x_star=x_star, x1=x_star)
    # stop_on_budget: the star-like walk 0 -> 1 -> 0 -> 7 -> 0 ... exhausts agent 0 first
    stop = simulate_dprecal(
        problem,
        RING,
        100,
        lambda cur, k: 0 if cur != 0 else (1 if k % 4 == 1 else 7),
        0,
        x_star=x_star,
        xi_plan=5,
        eval_every=3,
    )
    assert stop.tau.max() == 5 and stop.tau[0] == 5 and stop.iterations == 10
    assert stop.eval_iters[-1] == 10 and len(stop.holders) == 10


# --------------------------------------------------------------------------------------------- data (5.2)
def test_data_helpers() -> None:
    feats = np.array([[0.0, 5.0, 2.0], [10.0, 5.0, 4.0], [5.0, 5.0, 3.0]])
    np.testing.assert_allclose(minmax_scale(feats), np.array([[0, 0, 0], [1, 0, 1], [0.5, 0, 0.5]]))
    np.testing.assert_array_equal(encode_targets([2, 0], "onehot_pm1", 3), [[-1, -1, 1], [1, -1, -1]])
    np.testing.assert_array_equal(encode_targets([2, 1, 4], "binary_pm1", 5, positive=(0, 2, 4)), [1, -1, 1])
    b_parts, t_parts = split_agents(np.arange(44.0).reshape(22, 2), np.arange(22.0), 4, seed=3)
    assert [len(p) for p in b_parts] == [6, 6, 5, 5]
    assert sorted(np.concatenate(t_parts).tolist()) == list(range(22))
    again = split_agents(np.arange(44.0).reshape(22, 2), np.arange(22.0), 4, seed=3)[1]
    assert all(np.array_equal(a, b) for a, b in zip(t_parts, again, strict=True))


def test_load_mnist_problem_on_fake_mnist(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedpdm_flower.fedapp.data import sources

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (80, 6)).astype(np.float64) / 255.0
    pixels[:, 3] = 0.0  # an always-dark pixel
    train = ArrayDataset(x=np.hstack([pixels, np.ones((80, 1))]), y=np.arange(80, dtype=np.int64) % 10)
    info = DatasetInfo("mnist", 10, 7, "fake")
    monkeypatch.setattr(sources, "load_dataset", lambda name, source="offline", root=None: (train, train, info))
    prob = load_mnist_problem(n_agents=8, seed=1)
    assert prob.n == 8 and prob.sizes.tolist() == [10] * 8 and prob.x_shape == (6, 10)
    assert prob.nu1 == prob.nu2 == 0.5
    rows = np.vstack([a.features for a in prob.agents])
    assert sorted(map(tuple, rows)) == sorted(map(tuple, pixels))  # bias dropped, /255 kept, every row once
    assert set(np.unique(np.vstack([a.targets for a in prob.agents]))) == {-1.0, 1.0}
    binary = load_mnist_problem(n_agents=8, seed=1, label_mode="binary_pm1", num_samples=40, scaling="minmax")
    assert binary.x_shape == (6,) and binary.sizes.tolist() == [5] * 8
    assert all(a.features.min() >= 0 and a.features.max() <= 1 for a in binary.agents)
    even = np.concatenate([a.targets for a in binary.agents]) == 1.0
    assert 0 < even.sum() < 40


def test_load_covtype_problem_with_fake_fetch() -> None:
    rng = np.random.default_rng(0)
    data = np.hstack([rng.uniform(0, 3000, (100, 3)), np.ones((100, 1))])

    def fetch(**kwargs: Any) -> Any:
        assert kwargs["download_if_missing"] is True
        return types.SimpleNamespace(data=data, target=np.arange(100) % 7 + 1)

    prob = load_covtype_problem(n_agents=8, num_samples=50, fetch=fetch)
    assert prob.sizes.tolist() == [7, 7] + [6] * 6 and prob.x_shape == (4, 7)
    rows = np.vstack([a.features for a in prob.agents])
    assert rows.min() >= 0 and rows.max() <= 1 and np.all(rows[:, 3] == 0)  # constant column -> 0
    binary = load_covtype_problem(n_agents=8, num_samples=50, fetch=fetch, label_mode="binary_pm1")
    assert binary.x_shape == (4,)


@pytest.mark.parametrize("outputs", [None, 3])
def test_local_least_squares_on_the_flat_vector(outputs: int | None) -> None:
    """A Flower message carries y flat (row-major, d = q C): value and gradient are the shaped ones, bit for bit."""
    rng = np.random.default_rng(6)
    shape = (5,) if outputs is None else (5, outputs)
    for m in (40, 3):  # Gram path and direct path
        agent = LocalLeastSquares(rng.uniform(0, 1, (m, 5)), rng.standard_normal((m, *shape[1:])))
        y = rng.standard_normal(shape)
        assert agent.dim == y.size
        np.testing.assert_array_equal(agent.grad(y.ravel()), agent.grad(y).ravel())
        np.testing.assert_array_equal(agent.grad_direct(y.ravel()), agent.grad_direct(y).ravel())
        assert agent.value(y.ravel()) == agent.value(y)
        assert agent.grad(y.ravel()).shape == (y.size,) and agent.grad(y).shape == shape
