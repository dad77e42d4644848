"""DPQ-DSGD (fedpdm_flower/fedapp/algorithms/dpq.py): spec dp_quantized.md 2.1-2.5, 5, 6.3, 7.6 and the section-10 items
"Schedules" (S1, S2), "Theory helpers" (T1) and "Algorithmic behaviour" (A1, A2, A4, A5).

Noise and quantization off reach the closed-form fixed point of a quadratic (consensus at b when the b_i agree);
the per-node functions (what a Flower client runs) equal the vectorised simulator bit for bit with noise,
quantization and minibatches on; with quantization only, the deviation from the noiseless trajectory stays under
the linear-filter bound of E||e||^2 <= n d Delta^2 / 4, grows with Delta, and the error to the optimum shrinks with
the horizon K under the Theorem 2 schedule; a 2-iteration CNN run on a small MNIST subset changes the model.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.algorithms import dpq
from fedpdm_flower.fedapp.apps import dpq as dpq_app
from fedpdm_flower.fedapp.compression import quantize
from fedpdm_flower.fedapp.privacy import dpq as accountant

RING5 = topology.metropolis_weights(topology.ring(5))


def _params(**kw: object) -> dpq.DPQParams:
    base: dict[str, object] = {"alpha_hat": 0.05, "beta_hat": 0.2, "batch_size": None, "q_step": 0.0, "noise": False}
    base.update(kw)
    return dpq.DPQParams(**base)  # type: ignore[arg-type]


def _least_squares(n: int = 5, rows: int = 40, dim: int = 4, seed: int = 1) -> list[dpq.LeastSquaresObjective]:
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((n, rows, dim))
    targets = rng.standard_normal((n, rows))
    return [dpq.LeastSquaresObjective(feats[i], targets[i]) for i in range(n)]


# ------------------------------------------------------------------------------------------- schedules (S1, S2)
def test_paper_schedule_values() -> None:
    """S1: K = 2000, a1 = 0.35, alpha = 1, a2 = 0.3, beta = 0.75, a3 = 0.24, gamma = 0.7."""
    # the spec prints 10 decimals (0.0101104007 is 0.01011040068 rounded): compare to half a unit of the last digit
    assert dpq.alpha_hat(2000, 0.35, 1.0) == pytest.approx(0.0101104007, abs=5e-11)
    assert dpq.beta_hat(2000, 0.3, 0.75) == pytest.approx(0.0010031105, abs=5e-11)
    assert dpq.gamma_hat(2000, 0.24, 0.7) == 50  # floor(49.083) + 1
    p = dpq.paper_mnist_params(q_step=5.0, sigma_exp=0.2)
    assert (p.batch_size, p.K, p.q_step, p.sigma_offset) == (50, 2000, 5.0, 5.0)
    assert p.alpha_hat == dpq.alpha_hat(2000, 0.35, 1.0) and p.beta_hat == dpq.beta_hat(2000, 0.3, 0.75)
    # gamma_hat grows with the horizon, constant within a run
    assert [dpq.gamma_hat(k, 0.24, 0.7) for k in (100, 1000, 10000)] == [7, 31, 152]
    # the same numbers as the accountant's schedule (fedpdm_flower.fedapp.privacy.dpq)
    for K, consts in ((2000, (0.35, 1.0, 0.3, 0.75, 0.24, 0.7)), (10**5, (1.0, 0.9, 2.0, 0.6, 0.5, 0.8))):
        a1, al, a2, be, a3, ga = consts
        mine = (dpq.alpha_hat(K, a1, al), dpq.beta_hat(K, a2, be), dpq.gamma_hat(K, a3, ga))
        assert mine == accountant.step_sizes(K, a1, al, a2, be, a3, ga)
    sched = accountant.DPQSchedule.paper_mnist(sigma_exp=0.2)
    assert dpq.params_from_schedule(sched, q_step=5.0) == p
    assert all(p.sigma(k) == sched.sigma(k) for k in (0, 1, 1999, 2000))
    with pytest.raises(ValueError):
        dpq.beta_hat(2000, 400.0, 0.75)  # a2 >= K^beta
    with pytest.raises(ValueError):
        dpq.alpha_hat(1, 0.35, 1.0)


def test_noise_schedule_and_empirical_std() -> None:
    """S2: offset 5, sigma = 0.1 -> sigma_0 = 1.174619, sigma_2000 = 2.139003; sigma = -0.1 -> 0.851340; draws within 2%."""
    assert dpq.sigma_k(0, 0.1, offset=5) == pytest.approx(1.174619, abs=1e-6)
    assert dpq.sigma_k(2000, 0.1, offset=5) == pytest.approx(2.139003, abs=1e-6)
    assert dpq.sigma_k(0, -0.1, offset=5) == pytest.approx(0.851340, abs=1e-6)
    assert dpq.sigma_k(0, 0.2, offset=5) == pytest.approx(1.3797, abs=1e-4)
    assert dpq.sigma_k(3, 0.5) == 2.0  # theory offset 1: (k + 1)^sigma
    p = dpq.paper_mnist_params(q_step=0.0, sigma_exp=0.1)
    for k in (0, 2000):
        msg = dpq.node_message(p, 2, k, np.zeros(40000))
        assert msg.dtype == np.float64
        assert float(np.std(msg)) == pytest.approx(p.sigma(k), rel=0.02)
    assert dpq.ablation(p, "dsgd").sigma(7) == 0.0


# ------------------------------------------------------------------------------------------- theory helpers (T1)
@pytest.mark.parametrize(("alpha", "beta", "sigma", "r"), [(1, 0.67, 0.005, 0.33), (1, 0.75, 0.2, 0.10),
                                                           (1, 0.75, 0.1, 0.25), (1, 0.75, -0.1, 0.25)])
def test_rate_exponent(alpha: float, beta: float, sigma: float, r: float) -> None:
    assert dpq.rate_exponent(alpha, beta, sigma) == pytest.approx(r, abs=1e-12)


def test_corollary1_and_assumption4() -> None:
    """Corollary 1 holds for Remark 13's sets and the MNIST sigma = 0.1, 0.2 (not -0.1: alpha + gamma - beta = 0.95
    <= 1.1); Assumption 4 fails with the paper's MNIST constants on the 5-ring (spec 5.3, 9.13)."""
    assert dpq.corollary1_holds(1.0, 0.8, 0.2, 0.7, 1.5)
    assert dpq.corollary1_holds(0.9, 0.6, 0.05, 0.8, 2.0)
    assert dpq.corollary1_holds(1.0, 0.75, 0.1, 0.7, 3.0)
    assert dpq.corollary1_holds(1.0, 0.75, 0.2, 0.7, 3.0)
    assert not dpq.corollary1_holds(1.0, 0.75, -0.1, 0.7, 3.0)
    assert not dpq.corollary1_holds(1.0, 0.8, 0.2, 0.7, 1.0)  # delta > 1 needed
    assert not dpq.corollary1_holds(1.0, 0.6, 0.2, 0.7, 1.5)  # beta <= sigma + 1/2
    rho = topology.rho_laplacian(RING5)
    assert rho == pytest.approx(0.4607, abs=1e-4)
    rep = dpq.assumption4_check(2000, 0.35, 1.0, 0.3, 0.75, 0.24, 0.1, rho, L=1.0, mu=0.1, n=5)
    assert rep.constants_positive and rep.exponents
    assert not rep.a2_condition  # 179.4 - 0.09 - 339.9 < 0
    assert 2 * 0.3 * 2000**0.75 - 0.09 - 2000**0.5 * math.log(2000) == pytest.approx(179.4 - 0.09 - 339.9, abs=0.1)
    assert rep.gamma < 0
    assert rep.holds is False
    assert dpq.assumption4_check(2000, 0.35, 1.0, 0.3, 0.75, 0.24, 0.1, rho).holds is False


def test_assumption4_can_hold() -> None:
    """A parameter set inside Remark 7's ranges passes every condition (so the checker is not always False)."""
    K, beta, rho, L, mu, n = 10**6, 0.75, 1.0, 1.0, 0.5, 2
    a2 = K**beta / rho  # centre of Remark 7's a2 range
    rep = dpq.assumption4_check(K, 1e-3, 1.0, a2 * 0.999, beta, 1.0, 0.1, rho, L=L, mu=mu, n=n)
    assert rep.a2_condition and rep.gamma > 0 and rep.exponents
    assert rep.theta_consensus and rep.theta_optimality and rep.holds is True
    assert dpq.assumption4_check(K, 1e-3, 1.0, a2 * 0.999, beta, 1.0, 0.1, rho).holds is None  # L, mu not given


# ------------------------------------------------------------------------------------------- quantizer, messages
def test_message_uses_the_eq3_quantizer() -> None:
    """node_message = fedpdm_flower.fedapp.compression.quantize.quantize_levels(x + n, q_step, default_rng([seed, 51, node, k]))."""
    assert dpq.quantize_levels is quantize.quantize_levels and dpq.dequantize is quantize.dequantize
    p = _params(q_step=0.25, noise=True, sigma_exp=0.2, seed=11)
    x = np.linspace(-2.0, 2.0, 9)
    noise = dpq.privacy_noise(p, 3, 5, 9)
    assert noise is not None
    np.testing.assert_array_equal(noise, p.sigma(5) * np.random.default_rng([11, 50, 3, 5]).standard_normal(9))
    expect = quantize.quantize_levels(x + noise, 0.25, np.random.default_rng([11, 51, 3, 5]))
    np.testing.assert_array_equal(dpq.node_message(p, 3, 5, x), expect)
    np.testing.assert_array_equal(dpq.decode_message(p, expect.astype(np.int16)), 0.25 * expect)


@pytest.mark.parametrize("words", [(0,), (11, 50, 3, 5), (2**32 - 1, 52, 0, 7), (2**32, 50, 1, 1), (2**40 + 5, 51, 9, 10**6),
                                   (np.int64(3), 50, 2, 4)])
def test_the_stateless_streams_are_numpys_default_rng_of_the_words(words: tuple[int, ...]) -> None:
    """rng_for (the fast path for 32-bit words, numpy's own path otherwise) draws default_rng([*words])'s stream."""
    from fedpdm_flower.fedapp.sampling import rng_for

    np.testing.assert_array_equal(rng_for(*words).random(8), np.random.default_rng(list(words)).random(8))


def test_messages_and_ablation_flags() -> None:
    """Spec 2.5: dpq -> integer levels of x + n; dp-only -> float x + n; quant-only -> levels of x; dsgd -> x."""
    x = np.array([0.25, -1.5, 3.0, 0.1])
    p = _params(q_step=0.5, noise=True, sigma_exp=0.1, seed=4)
    noise = dpq.privacy_noise(p, 1, 3, 4)
    assert noise is not None
    m = dpq.node_message(p, 1, 3, x)
    assert m.dtype == np.int64
    s = (x + noise) / 0.5
    assert np.all((m == np.floor(s)) | (m == np.floor(s) + 1))
    assert np.array_equal(dpq.node_message(p, 1, 3, x), m)  # stateless streams
    assert not np.array_equal(dpq.node_message(p, 2, 3, x), m)
    dp_only = dpq.ablation(p, "dp-only")
    assert dp_only.q_step == 0.0 and dp_only.noise
    np.testing.assert_array_equal(dpq.node_message(dp_only, 1, 3, x), x + noise)
    quant = dpq.ablation(p, "quant-only")
    assert dpq.privacy_noise(quant, 1, 3, 4) is None
    np.testing.assert_array_equal(dpq.node_message(quant, 1, 3, x)[[1, 2]], [-3, 6])  # on-grid inputs exact
    plain = dpq.ablation(p, "dsgd")
    np.testing.assert_array_equal(dpq.node_message(plain, 1, 3, x), x)
    assert dpq.ablation(plain, "dpq", q_step=1.0).quantized
    with pytest.raises(ValueError):
        dpq.ablation(plain, "quant-only")
    with pytest.raises(ValueError):
        dpq.decode_message(p, x)  # float message while quantizing


def test_one_step_by_hand_uses_own_z() -> None:
    """A4: n = 3, known A; x_{k+1} = (1 - b) x + b (a_ii z_i + sum a_ij z_j) - a g, the self term with z_i."""
    A = np.array([[0.5, 0.25, 0.25], [0.25, 0.75, 0.0], [0.25, 0.0, 0.75]])
    objs = [dpq.QuadraticObjective(np.array([1.0, -2.0])) for _ in range(3)]
    p = _params(alpha_hat=0.1, beta_hat=0.3, q_step=1.0, noise=True, sigma_exp=0.0, seed=9)
    x = np.array([[0.2, 0.4], [1.3, -0.6], [-0.7, 2.2]])
    msgs = [dpq.node_message(p, i, 0, x[i]) for i in range(3)]
    z = np.stack([1.0 * m for m in msgs])
    x1 = dpq.node_update(p, 0, 0, x[0], msgs[0], 0.5, [0.25, 0.25], [msgs[1], msgs[2]], objs[0])
    expect = 0.7 * x[0] + 0.3 * (0.5 * z[0] + 0.25 * z[1] + 0.25 * z[2]) - 0.1 * (x[0] - objs[0].b)
    np.testing.assert_allclose(x1, expect, rtol=0, atol=1e-15)
    x1x = dpq.node_update(replace(p, self_term="x"), 0, 0, x[0], msgs[0], 0.5, [0.25, 0.25], [msgs[1], msgs[2]], objs[0])
    np.testing.assert_allclose(x1x, expect + 0.3 * 0.5 * (x[0] - z[0]), rtol=0, atol=1e-15)
    trace = dpq.simulate(p, A, objs, x, 1)
    np.testing.assert_array_equal(trace.x[0], x1)


def test_minibatch() -> None:
    """A5: indices unique, of size gamma_hat, stateless per (seed, node, k); batch gradient = mean of per-sample."""
    obj = _least_squares(n=1, rows=30)[0]
    p = _params(batch_size=8, seed=5)
    idx = dpq.minibatch_indices(p, 0, 7, obj.num_samples)
    assert idx is not None and idx.size == 8 and np.unique(idx).size == 8 and idx.max() < 30
    again = dpq.minibatch_indices(p, 0, 7, 30)
    assert again is not None and np.array_equal(idx, again)
    other = dpq.minibatch_indices(p, 0, 8, 30)
    assert other is not None and not np.array_equal(idx, other)
    x = np.array([0.3, -1.0, 2.0, 0.5])
    np.testing.assert_allclose(dpq.local_gradient(p, 0, 7, x, obj), obj.per_sample_gradients(x, idx).mean(axis=0),
                               rtol=1e-12, atol=1e-14)
    full = dpq.minibatch_indices(_params(batch_size=30), 0, 0, 30)
    assert full is not None and np.array_equal(full, np.arange(30))
    assert dpq.minibatch_indices(p, 0, 0, None) is None
    assert dpq.minibatch_indices(_params(), 0, 0, 30) is None


# ------------------------------------------------------------------------------------------- A1: exact fixed point
def test_noise_free_quadratic_reaches_closed_form() -> None:
    """A1: noise off, q_step = 0, 5-ring, alpha_hat = 0.05, beta_hat = 0.2, 3000 iterations ->
    x* = alpha_hat (alpha_hat I + beta_hat L)^-1 b within 1e-10; node average = mean(b_i)."""
    objs = dpq.quadratic_toy(5, 3, seed=0)
    b = np.stack([o.b for o in objs])
    trace = dpq.simulate(_params(), RING5, objs, np.zeros(3), 3000)
    x_star = dpq.quadratic_fixed_point(objs, RING5, 0.05, 0.2)
    np.testing.assert_allclose(x_star, 0.05 * np.linalg.solve(0.05 * np.eye(5) + 0.2 * (np.eye(5) - RING5), b),
                               rtol=0, atol=1e-14)
    assert np.abs(trace.x - x_star).max() < 1e-10
    assert np.abs(trace.x.mean(axis=0) - b.mean(axis=0)).max() < 1e-12
    np.testing.assert_allclose(dpq.quadratic_optimum(objs), b.mean(axis=0), rtol=0, atol=1e-14)


def test_noise_free_identical_data_reaches_exact_consensus() -> None:
    """A1: identical b_i -> consensus ||Y_k|| -> 0 at the optimum b."""
    objs = dpq.quadratic_toy(5, 3, seed=2, identical=True)
    x0 = np.random.default_rng(3).standard_normal((5, 3))  # start away from consensus
    trace = dpq.simulate(_params(), RING5, objs, x0, 3000)
    assert trace.consensus_error[0] > 1.0
    assert trace.consensus_error[-1] < 1e-24
    assert np.abs(trace.x - objs[0].b).max() < 1e-12


def test_noise_free_least_squares_full_batch() -> None:
    """Full-batch least squares on a star: the fixed point of (6) solves (alpha H + beta (I - A) (x) I) x = alpha c."""
    w = topology.metropolis_weights(topology.star(5))
    objs = _least_squares()
    trace = dpq.simulate(_params(alpha_hat=0.1, beta_hat=0.5), w, objs, np.zeros(4), 4000)
    assert np.abs(trace.x - dpq.quadratic_fixed_point(objs, w, 0.1, 0.5)).max() < 1e-10


def test_dsgd_is_lazy_mixing() -> None:
    """Spec 2.5: without noise and quantization, x_{k+1} = ((1 - b) I + b A) x_k - a g_k."""
    objs = _least_squares()
    p = _params(batch_size=6, seed=1)
    trace = dpq.simulate(p, RING5, objs, np.ones(4), 5, keep_states=True)
    assert trace.states is not None
    lazy = 0.8 * np.eye(5) + 0.2 * RING5
    x = trace.states[0]
    for k in range(5):
        g = np.stack([dpq.local_gradient(p, i, k, x[i], objs[i]) for i in range(5)])
        x = lazy @ x - 0.05 * g
        np.testing.assert_allclose(trace.states[k + 1], x, rtol=0, atol=1e-13)
    assert trace.quant_error_sq is not None and np.all(trace.quant_error_sq == 0.0)


# ------------------------------------------------------------------------------------------- per node == vectorised
@pytest.mark.parametrize("graph", ["ring", "star", "path"])
@pytest.mark.parametrize("self_term", ["z", "x"])
def test_per_node_equals_vectorised_bit_for_bit(graph: str, self_term: str) -> None:
    """Noise, quantization and minibatches on: the per-node functions (node_message / node_round, what a Flower
    client runs) give the vectorised simulator's states bit for bit; the printed compact form (31)-(32) agrees up to
    rounding."""
    w = topology.metropolis_weights(topology.parse_graph(graph, 5))
    objs = _least_squares()
    p = _params(batch_size=7, q_step=0.5, noise=True, sigma_exp=0.1, seed=3, self_term=self_term)
    x0 = np.random.default_rng(0).standard_normal(4)
    vec = dpq.simulate(p, w, objs, x0, 6, keep_states=True)
    per = dpq.simulate(p, w, objs, x0, 6, engine="per_node", keep_states=True)
    assert vec.states is not None and per.states is not None
    for a, b in zip(vec.states, per.states, strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(vec.last_messages, per.last_messages, strict=True):
        assert a.dtype == np.int64 and np.array_equal(a, b)
    np.testing.assert_array_equal(vec.consensus_error, per.consensus_error)
    compact = dpq.simulate(p, w, objs, x0, 6, form="compact")
    np.testing.assert_allclose(compact.x, vec.x, rtol=0, atol=1e-12)
    assert not np.array_equal(vec.states[-1], vec.states[0])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_per_node_equals_vectorised_dp_only(dtype: str) -> None:
    """Float messages x + n (q_step = 0), float64 or the float32 wire: still bit for bit."""
    objs = _least_squares()
    p = _params(batch_size=5, noise=True, sigma_exp=-0.1, sigma_offset=5.0, seed=8, float_messages=dtype)
    vec = dpq.simulate(p, RING5, objs, np.zeros(4), 5)
    per = dpq.simulate(p, RING5, objs, np.zeros(4), 5, engine="per_node")
    assert np.array_equal(vec.x, per.x)
    assert all(m.dtype == np.dtype(dtype) for m in vec.last_messages + per.last_messages)
    assert vec.noise_sq is not None and np.all(vec.noise_sq > 0)


# ------------------------------------------------------------------------------------------- quantization error
def _quadratic_filter_bound(w: np.ndarray, a: float, b: float, dim: int, q_step: float) -> float:
    """sup_k E||x_k - x_k^noiseless||^2 for f_i = 1/2||x - b_i||^2 when only quantization errors enter:
    delta_{k+1} = ((1 - a) I - b L) delta_k + b A e_k, E[e e' | past] <= q_step^2/4 I (martingale differences), so
    E||delta_k||^2 <= d q_step^2/4 b^2 sum_lambda lambda^2 / (1 - (1 - a - b (1 - lambda))^2)."""
    lam = np.linalg.eigvalsh(w)
    mu = 1.0 - a - b * (1.0 - lam)
    return float(dim * q_step**2 / 4.0 * b**2 * np.sum(lam**2 / (1.0 - mu**2)))


def test_quantization_error_bounded_and_grows_with_step() -> None:
    """Quantization only, constant steps: |e| < Delta coordinate-wise, mean ||e_k||^2 <= n d Delta^2 / 4 (eq. (42)
    with the true variance bound, spec 2.2 / 9.15), and the mean squared deviation from the noiseless trajectory
    stays below the linear-filter bound at every k; it grows with Delta (Remark 10)."""
    objs = dpq.quadratic_toy(5, 3, seed=0)
    ref = dpq.simulate(_params(), RING5, objs, np.zeros(3), 40, keep_states=True)
    assert ref.states is not None
    seeds = 100
    means = {}
    for q in (0.5, 1.0, 2.0):
        dev = np.zeros(41)
        qerr = []
        for s in range(seeds):
            tr = dpq.simulate(_params(q_step=q, seed=s), RING5, objs, np.zeros(3), 40, keep_states=True)
            assert tr.states is not None and tr.quant_error_sq is not None
            dev += np.array([np.sum((u - v) ** 2) for u, v in zip(tr.states, ref.states, strict=True)]) / seeds
            qerr.append(tr.quant_error_sq)
            assert np.all(tr.quant_error_sq < 5 * 3 * q**2)  # every |e| < Delta
        bound = _quadratic_filter_bound(RING5, 0.05, 0.2, 3, q)
        assert float(np.mean(qerr)) <= 5 * 3 * q**2 / 4
        assert dev.max() <= bound
        assert dev[-1] > 0.3 * bound  # the bound is not vacuous
        means[q] = dev[-1]
    assert means[0.5] < means[1.0] < means[2.0]
    assert 2.5 < means[2.0] / means[1.0] < 6.0  # ~ Delta^2


def test_quantized_error_decreases_with_horizon() -> None:
    """Theorem 2 / Remark 10 (beta_hat^2 Delta^2 -> 0): quantization only (Delta = 1), the Assumption-4 schedule
    alpha_hat = 0.35 (ln K)^2 / K, beta_hat = K^-0.75, identical quadratics: mean_i ||x_{i,K+1} - x*||^2 (= 2 (F - F*))
    shrinks as the horizon K grows; the unquantized run is far below it (K >= 200)."""
    objs = dpq.quadratic_toy(5, 3, seed=0, identical=True)
    x_star = objs[0].b
    errs = []
    for K in (20, 200, 2000):
        e = []
        for s in range(4):
            p = dpq.schedule_params(K, a1=0.35, alpha=1.0, a2=1.0, beta=0.75, a3=1.0, gamma=0.5, q_step=1.0,
                                    noise=False, seed=s)
            e.append(np.mean(np.sum((dpq.simulate(p, RING5, objs, np.zeros(3)).x - x_star) ** 2, axis=1)))
        plain = dpq.simulate(dpq.ablation(p, "dsgd"), RING5, objs, np.zeros(3))
        errs.append(float(np.mean(e)))
        if K > 20:  # at K = 20 the optimisation transient from x_0 = 0 is still comparable
            assert np.mean(np.sum((plain.x - x_star) ** 2, axis=1)) < 0.01 * errs[-1]
    assert errs[0] > 2 * errs[1] > 4 * errs[2]


def test_noise_and_quantization_are_unbiased() -> None:
    """A2: linear dynamics, noise (offset 1, sigma = 0.1) and Delta = 1 on: the Monte-Carlo mean of x_30 over seeds
    equals the noiseless trajectory within 4 standard errors."""
    objs = dpq.quadratic_toy(5, 3, seed=0)
    ref = dpq.simulate(_params(), RING5, objs, np.zeros(3), 30)
    runs = np.stack([dpq.simulate(_params(q_step=1.0, noise=True, sigma_exp=0.1, seed=s), RING5, objs, np.zeros(3),
                                  30).x for s in range(200)])
    se = runs.std(axis=0, ddof=1) / math.sqrt(runs.shape[0])
    assert np.all(np.abs(runs.mean(axis=0) - ref.x) < 4 * se)
    assert np.all(runs.std(axis=0) > 0)


# ------------------------------------------------------------------------------------------- MNIST (spec 6.3)
@pytest.fixture(scope="module")
def mnist_small() -> dpq_app.DPQNetwork:
    return dpq_app.mnist_setup(samples_per_node=120)


def test_mnist_setup_matches_spec() -> None:
    """5 nodes, 12,000 IID samples each (disjoint), ring with Metropolis weights 1/3, d = 44,426."""
    setup = dpq_app.mnist_setup()
    assert len(setup.objectives) == 5 and setup.x0.shape == (44426,)
    assert [o.num_samples for o in setup.objectives] == [12000] * 5
    np.testing.assert_allclose(setup.A, RING5, rtol=0, atol=0)
    np.testing.assert_allclose(setup.A[setup.A > 0], 1.0 / 3.0, rtol=0, atol=1e-15)
    assert len(setup.test) == 10000
    labels = np.concatenate([shard.y for shard in setup.shards])
    assert np.bincount(labels).min() > 5000  # an IID mix of all ten digits
    assert setup.objectives[0].model is setup.objectives[4].model is setup.net
    assert not np.array_equal(setup.shards[0].x[:5], setup.shards[1].x[:5])


def test_cnn_two_iterations_change_the_model(mnist_small: dpq_app.DPQNetwork) -> None:
    """The paper preset (Delta = 1, sigma = 0.1, offset 5, batch 50) for 2 iterations on 120 samples per node: the
    models change, stay finite, messages are integer levels, and the per-node engine agrees bit for bit."""
    s = mnist_small
    p = dpq.paper_mnist_params(q_step=1.0, sigma_exp=0.1)
    vec = dpq.simulate(p, s.A, s.objectives, s.x0, 2, keep_states=True)
    per = dpq.simulate(p, s.A, s.objectives, s.x0, 2, engine="per_node")
    assert np.array_equal(vec.x, per.x)
    assert np.all(np.isfinite(vec.x))
    delta = np.abs(vec.x - s.x0).max(axis=1)
    assert np.all(delta > 1e-4)
    assert all(m.dtype == np.int64 and m.shape == (44426,) for m in vec.last_messages)
    assert vec.states is not None and vec.consensus_error[0] == 0.0 < vec.consensus_error[2]
    assert all(math.isfinite(o.last_loss) for o in s.objectives)
    acc = dpq_app.node_accuracies(s, vec.x, test_limit=200)
    assert acc["test"].shape == (5,) and np.all((acc["train"] >= 0) & (acc["train"] <= 1))


def test_cnn_gradient_is_mean_cross_entropy(mnist_small: dpq_app.DPQNetwork) -> None:
    """The TorchObjective gradient over a batch is the mean of the single-sample gradients (5), in float64."""
    obj = mnist_small.objectives[0]
    idx = np.array([3, 17, 42], dtype=np.int64)
    g = obj.gradient(mnist_small.x0, idx)
    singles = np.mean([obj.gradient(mnist_small.x0, idx[[t]]) for t in range(3)], axis=0)
    assert g.dtype == np.float64 and g.shape == (44426,)
    np.testing.assert_allclose(g, singles, rtol=1e-4, atol=1e-6)
