"""Record-level DP-SGD in the decentralized seeds (DP-RECAL and its Table V baselines; DPQ-DSGD), through the public
layer only: the agents' own data, keyword strategies, ``simulations.inprocess.run_clients``.

What is checked, each against an independent truth:

* the vocabulary: a DP-named strategy without ``privacy=`` trains without noise and warns, naming what to pass; bad input (an
  unreachable target, q outside (0, 1], C <= 0, no sample rate) is refused before round 1, naming the knob;
* the device's side: its floor refuses a message before the data is touched (past the floor, or a message without
  DP-SGD); its ledger in ``context.state`` holds exactly the steps it took, and its epsilon is recomputed by a second
  implementation of the same accountant (Opacus's ``RDPAccountant`` object) and never passes the target;
* post-processing: under DP-SGD the messages carry no noise of their own -- DP-RECAL's relayed u~ is exactly the sum
  of the agents' duals (the invariant of spec 2.4 with no noise), the baselines publish their exact state;
* learning: at epsilon = 8 the model gets close to the pooled optimum (the normal equations).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context
from numpy.typing import NDArray

from fedpdm_flower.clients.recal import RecalClient
from fedpdm_flower.clients.recal_baselines import NidsClient, PGExtraClient, RWAdmmClient
from fedpdm_flower.fedapp.algorithms.recal import LocalLeastSquares
from fedpdm_flower.fedapp.models.least_squares import LeastSquares
from fedpdm_flower.fedapp.privacy.dpsgd import DPSGDLedger, clip_rows, dpsgd_epsilon
from fedpdm_flower.fedapp.privacy.target import PrivacyNotChosen, PrivacyTarget
from fedpdm_flower.fedapp.privacy.zcdp import Theorem3Calibration
from fedpdm_flower.strategies.base import RoundFailed
from fedpdm_flower.strategies.recal import DPRECAL
from fedpdm_flower.strategies.recal_baselines import DPNids, DPPGExtra, DPRWAdmm
from simulations.inprocess import run_clients

N, Q, M = 4, 3, 400
F = NDArray[np.float64]
TRUTH = np.array([1.0, -0.5, 0.25])


def rows(i: int, m: int = M) -> tuple[F, F]:
    """Agent i's records: a shared linear truth plus noise."""
    rng = np.random.default_rng(7 + i)
    x = rng.normal(0.0, 1.0, (m, Q))
    return x, x @ TRUTH + 0.1 * rng.standard_normal(m)


def pooled_optimum(nu2: float) -> F:
    """argmin sum_i f_i(w) + n nu2 ||w||^2 (normal equations)."""
    g = sum(x.T @ x / len(y) for x, y in map(rows, range(N)))
    h = sum(x.T @ y / len(y) for x, y in map(rows, range(N)))
    return np.asarray(np.linalg.solve(g + 2 * N * nu2 * np.eye(Q), h), dtype=np.float64)


def pid(context: Context) -> int:
    return int(context.node_config["partition-id"])


W0 = ArrayRecord({"w": Array(np.zeros(Q))})
#: amplification by Poisson sampling (q = 0.2): the accounting tests
TARGET = PrivacyTarget(epsilon=8.0, sample_rate=0.2, clip_norm=3.0)
#: every record in every step (q = 1): the RDP of the plain Gaussian is closed-form, so calibrating is instant
FULL = PrivacyTarget(epsilon=8.0, sample_rate=1.0, clip_norm=3.0)


def recal_agent(context: Context, **kw: Any) -> RecalClient:
    return RecalClient(LocalLeastSquares(*rows(pid(context))), **kw)


# ----------------------------------------------------------------------------- the vocabulary, bad input
@pytest.mark.parametrize("cls", [DPRECAL, DPNids, DPPGExtra, DPRWAdmm])
def test_a_dp_strategy_without_privacy_refuses_and_says_what_to_pass(cls: Any) -> None:
    with pytest.raises(PrivacyNotChosen, match=r"needs privacy=: pass privacy=PrivacyTarget\(epsilon=\.\.\., "
                                               r"sample_rate=\.\.\.\).*Theorem3Calibration.*privacy=None.*"
                                               r"No epsilon is chosen for you"):
        cls(min_available_nodes=N)
    strategy = cls(min_available_nodes=N, privacy=None)
    assert strategy.dpsgd is None and strategy.paper is None


@pytest.mark.parametrize(("make", "knob"), [
    (lambda: PrivacyTarget(epsilon=8.0, sample_rate=0.0), "sample_rate"),
    (lambda: PrivacyTarget(epsilon=8.0, sample_rate=1.5), "sample_rate"),
    (lambda: PrivacyTarget(epsilon=8.0, sample_rate=0.1, clip_norm=0.0), "clip_norm"),
    (lambda: DPRECAL(min_available_nodes=N, privacy=PrivacyTarget(epsilon=8.0)), "sample_rate=q"),
    (lambda: DPNids(min_available_nodes=N, privacy="epsilon=8"), "privacy must be a PrivacyTarget"),
])
def test_bad_privacy_input_names_the_knob(make: Any, knob: str) -> None:
    with pytest.raises((ValueError, TypeError), match=knob):
        make()


def test_an_unreachable_target_is_refused_before_round_one() -> None:
    """RDP cannot certify epsilon = 0.05 at delta = 1e-5 for any noise: the strategy says so when the federation is
    attached, before any message is sent to an agent."""
    sent: list[int] = []

    def client_fn(context: Context) -> RecalClient:
        sent.append(pid(context))
        return recal_agent(context)

    strategy = DPRECAL(graph="ring", min_available_nodes=N, seed=0,
                       privacy=PrivacyTarget(epsilon=0.05, sample_rate=1.0, clip_norm=1.0))
    with pytest.raises(ValueError, match=r"PrivacyTarget epsilon: epsilon = 0.05 .* cannot be met by any noise "
                                         r"multiplier.*raise epsilon or delta"):
        run_clients(strategy, client_fn, num_nodes=N, num_rounds=40, initial_arrays=W0)
    assert sent == []


# ----------------------------------------------------------------------------- DP-RECAL under DP-SGD
def _recal_run(rounds: int, target: PrivacyTarget = TARGET, **client_kw: Any) -> tuple[DPRECAL, dict[int, Context]]:
    strategy = DPRECAL(graph="ring", min_available_nodes=N, seed=0, nu1=0.0, nu2=0.01, privacy=target,
                       eval_every=rounds)
    return run_clients(strategy, lambda c: recal_agent(c, **client_kw), num_nodes=N, num_rounds=rounds,
                       initial_arrays=W0)


def test_recal_ledgers_hold_every_step_and_a_second_accountant_agrees() -> None:
    """After the run every agent's ledger (context.state) holds one DP-SGD step per activation, at the strategy's
    (z, q); Opacus's RDPAccountant object, fed the same history, gives the same epsilon, and no agent passes the
    target (the run stops before any agent would exceed its planned activations)."""
    from opacus.accountants import RDPAccountant

    strategy, contexts = _recal_run(120)
    mech = strategy.dpsgd
    assert mech is not None and strategy.stop_on_budget and strategy.xi_plan >= 1
    worst = 0.0
    for i, ctx in contexts.items():
        ledger = DPSGDLedger.from_record(dict(ctx.state.config_records["dpsgd"]))
        assert ledger.steps == int(strategy.tau[i]) >= 1
        assert ledger.history == [(mech.noise_multiplier, mech.sample_rate, int(strategy.tau[i]))]
        ours = ledger.epsilon(TARGET.delta)
        acc = RDPAccountant()
        acc.history = [(mech.noise_multiplier, mech.sample_rate, int(strategy.tau[i]))]
        assert ours == pytest.approx(acc.get_epsilon(TARGET.delta), rel=0.02)
        assert ours == pytest.approx(dpsgd_epsilon(mech.noise_multiplier, mech.sample_rate, ledger.steps,
                                                   TARGET.delta), rel=1e-12)
        worst = max(worst, ours)
    assert worst <= TARGET.epsilon * (1 + 1e-9)
    assert strategy.history[-1].epsilon == pytest.approx(worst, rel=1e-12)  # the record reports the worst agent
    assert strategy.privacy_spent().epsilon == pytest.approx(worst, rel=1e-12)


def test_recal_baton_carries_no_noise_of_its_own_under_dpsgd() -> None:
    """Post-processing: the relayed u~ equals sum_j lambda_j of the agents' states exactly (spec 2.4's private-mode
    invariant u~ = sum lambda - sum eps, with no eps), and the agents report sigma = 0."""
    from fedpdm_flower.clients.decentralized import load_state
    from fedpdm_flower.fedapp.algorithms.recal import AgentState

    strategy, contexts = _recal_run(60, FULL)
    lam = sum(load_state(c.state, "dprecal", AgentState).lam for c in contexts.values())  # type: ignore[union-attr]
    np.testing.assert_allclose(strategy.baton[1], lam, rtol=0, atol=1e-12)
    assert all(r.extra.get("sigma", 0.0) == 0.0 for r in strategy.history)


def test_recal_learns_at_epsilon_eight() -> None:
    """At epsilon = 8 (RDP, delta = 1e-5) the baton's x is within 10 % of the pooled ridge optimum."""
    strategy, _ = _recal_run(400, FULL)
    x_star = pooled_optimum(0.01)
    w = strategy.current_arrays()["w"].numpy()
    assert np.linalg.norm(w - x_star) < 0.1 * np.linalg.norm(x_star)


def test_a_device_floor_refuses_before_touching_its_data() -> None:
    """An agent whose floor is below what its first step costs refuses the baton (the run stops naming it after the
    retry); a device with a floor also refuses the paper's mechanism (rigorous epsilon unbounded) and no noise."""
    z = FULL.mechanism(1, 12)  # the plan of 40 rounds on a ring of 4: ceil(1.15 * 40 / 4) activations
    first = dpsgd_epsilon(z.noise_multiplier, z.sample_rate, 1, FULL.delta)
    with pytest.raises(RoundFailed, match=r"refused: 1 DP-SGD step\(s\) .* > its floor max_epsilon"):
        _recal_run(40, FULL, max_epsilon=first / 2)
    for privacy, what in ((Theorem3Calibration(sigma1=1.0), "the paper's noise on u~ only"), (None, "no noise")):
        strategy = DPRECAL(graph="ring", min_available_nodes=N, seed=0, privacy=privacy)
        with pytest.raises(RoundFailed, match=f"refused: the message asks for {what}.*unbounded"):
            run_clients(strategy, lambda c: recal_agent(c, max_epsilon=8.0), num_nodes=N, num_rounds=5,
                        initial_arrays=W0)


def test_a_device_floor_below_the_target_stops_the_run_before_round_one() -> None:
    """Through Flower's message flow (a Grid, whoami): an agent whose device floor (node config) is below the target
    says so in its whoami reply, and the strategy refuses to start, naming it, before any train message."""
    from simulations.inprocess import LocalGrid

    def client_fn(context: Context) -> RecalClient:
        floor = context.node_config.get("max-epsilon")
        return recal_agent(context, max_epsilon=float(floor) if floor is not None else None)

    grid = LocalGrid(RecalClient.client_app(client_fn), N, node_config={2: {"max-epsilon": 3.0}})
    strategy = DPRECAL(graph="ring", min_available_nodes=N, seed=0, privacy=FULL)
    with pytest.raises(ValueError, match=r"agent 2 \(node 3\) accepts at most epsilon = 3 .* PrivacyTarget epsilon = 8"):
        strategy.start(grid=grid, initial_arrays=W0, num_rounds=10)
    assert grid.up_bytes > 0 and all("dprecal" not in c.state for c in grid.contexts.values())  # only whoami answered


def test_the_device_ledger_file_accumulates_across_runs(tmp_path: Any) -> None:
    """A device's ledger file carries its spend into the next run: the second run starts from the first's steps."""
    path = tmp_path / "agent.json"

    def client_fn(context: Context) -> RecalClient:
        return recal_agent(context, ledger_path=path if pid(context) == 0 else None)

    for _ in range(2):
        strategy = DPRECAL(graph="ring", min_available_nodes=N, seed=0, nu1=0.0, nu2=0.01, privacy=FULL,
                           walk_start=0, walk="cyclic")
        run_clients(strategy, client_fn, num_nodes=N, num_rounds=8, initial_arrays=W0)
    assert DPSGDLedger.load(path).steps == 4  # a cyclic walk from agent 0 on a ring of 4: 2 activations a run


# ----------------------------------------------------------------------------- the baselines under DP-SGD
@pytest.mark.parametrize(("cls", "client", "rounds", "steps"), [
    (DPPGExtra, PGExtraClient, 6, lambda r: r), (DPNids, NidsClient, 6, lambda r: r + 1),
])
def test_sync_baselines_publish_their_exact_state_and_charge_every_gradient(cls: Any, client: Any, rounds: int,
                                                                             steps: Any) -> None:
    """Every agent takes one DP-SGD step per round (NIDS two in round 1: grad f_i(x^0) and grad f_i(x^1)); its
    ledger holds exactly those; the published vectors are the agents' exact ones (no noise of their own)."""
    from fedpdm_flower.clients.decentralized import load_state
    from fedpdm_flower.fedapp.algorithms.recal_baselines import NidsState, PGExtraState

    strategy = cls(graph="ring", min_available_nodes=N, seed=0, nu1=0.0, nu2=0.01, privacy=FULL)
    _, contexts = run_clients(strategy, lambda c: client(LocalLeastSquares(*rows(pid(c)))), num_nodes=N,
                              num_rounds=rounds, initial_arrays=W0)
    for i, ctx in contexts.items():
        ledger = DPSGDLedger.from_record(dict(ctx.state.config_records["dpsgd"]))
        assert ledger.steps == steps(rounds)
        if cls is DPPGExtra:
            state = load_state(ctx.state, "pg-extra", PGExtraState)
            assert state is not None and np.array_equal(strategy.outbox[i][0], state.x)
        else:
            nstate = load_state(ctx.state, "nids", NidsState)
            assert nstate is not None and nstate.v is not None and np.array_equal(strategy.outbox[i][0], nstate.v)
    assert strategy.steps_taken() == steps(rounds)


def test_rw_admm_charges_one_step_per_activation() -> None:
    strategy = DPRWAdmm(graph="ring", min_available_nodes=N, seed=0, nu1=0.0, nu2=0.01, privacy=FULL)
    _, contexts = run_clients(strategy, lambda c: RWAdmmClient(LocalLeastSquares(*rows(pid(c)))),
                              num_nodes=N, num_rounds=20, initial_arrays=W0)
    for i, ctx in contexts.items():
        rec = ctx.state.config_records.get("dpsgd")
        assert (0 if rec is None else DPSGDLedger.from_record(dict(rec)).steps) == int(strategy.tau[i])


# ----------------------------------------------------------------------------- the per-record gradients used
def test_least_squares_records_give_the_clipped_sum_of_their_per_record_gradients() -> None:
    """The paper's multi-output least squares as DP-SGD sees it: record j's gradient is the outer product
    B_j (B_j^T y - b_j)^T (finite differences of its loss), the rows' mean is grad f_i, and the closed-form clipped
    sum equals clipping the rows one by one."""
    rng = np.random.default_rng(0)
    b, t = rng.normal(size=(9, 4)), rng.normal(size=(9, 3))
    model, data = LocalLeastSquares(b, t).records()
    y = rng.normal(size=12)
    per = model.per_sample_grads(y, *data.batch(np.arange(9)))
    eps = 1e-6
    for j in (0, 5):
        fd = np.array([(model.loss(y + eps * e, b[j:j + 1], t[j:j + 1]) - model.loss(y - eps * e, b[j:j + 1],
                                                                                       t[j:j + 1])) / (2 * eps)
                       for e in np.eye(12)])
        np.testing.assert_allclose(per[j], fd, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(per.mean(axis=0), LocalLeastSquares(b, t).grad(y), rtol=1e-12)
    np.testing.assert_allclose(model.clipped_grad_sum(y, b, t, 0.7), clip_rows(per, 0.7).sum(axis=0), rtol=1e-12)
    assert isinstance(model, LeastSquares) and model.dim == 12


# ----------------------------------------------------------------------------- DPQ-DSGD under DP-SGD
def _dpq_run(rounds: int, q_step: float, target: PrivacyTarget = FULL, **kw: Any) -> tuple[Any, dict[int, Context]]:
    from fedpdm_flower.clients.dpq import DPQClient
    from fedpdm_flower.strategies.dpq import DPQDSGD

    strategy = DPQDSGD(min_available_nodes=N, horizon=rounds - 2, q_step=q_step, a1=1.0, a2=3.0, seed=0,
                       privacy=target, evaluate_average=True, eval_every=rounds)
    return run_clients(strategy, lambda c: DPQClient(LeastSquares(Q), rows(pid(c)), seed=5, **kw), num_nodes=N,
                       num_rounds=rounds, initial_arrays=W0)


def test_dpq_without_privacy_refuses_and_says_what_to_pass() -> None:
    from fedpdm_flower.strategies.dpq import DPQDSGD

    with pytest.raises(PrivacyNotChosen, match=r"DPQDSGD is a differentially private strategy and needs privacy=: "
                                               r".*PrivacyTarget.*TimeVaryingNoise"):
        DPQDSGD(min_available_nodes=N)
    strategy = DPQDSGD(min_available_nodes=N, privacy=None)
    assert strategy.target is None and strategy.paper is None and strategy.variant == "quant-only"


def test_dpq_nodes_charge_one_step_per_update_and_publish_their_exact_state() -> None:
    """Every update is one DP-SGD step (none in the bootstrap round); each node's ledger holds exactly those, and a
    second implementation of the accountant agrees; unquantized messages are float32 copies of the node's state
    (no noise of their own); the node-average model upload is inside the guarantee (no share_model needed)."""
    from opacus.accountants import RDPAccountant

    from fedpdm_flower.clients.dpq import STATE

    rounds = 12
    strategy, contexts = _dpq_run(rounds, q_step=0.0, target=TARGET)
    mech = strategy.dpsgd
    assert mech is not None
    for i, ctx in contexts.items():
        ledger = DPSGDLedger.from_record(dict(ctx.state.config_records["dpsgd"]))
        assert ledger.history == [(mech.noise_multiplier, mech.sample_rate, rounds - 1)]
        acc = RDPAccountant()
        acc.history = list(ledger.history)
        assert ledger.epsilon(TARGET.delta) == pytest.approx(acc.get_epsilon(TARGET.delta), rel=0.02)
        x = ctx.state.array_records[STATE]["x"].numpy()
        np.testing.assert_array_equal(strategy.outbox[i][0].view(np.float32), x.astype(np.float32))
    assert strategy.history[-1].epsilon <= TARGET.epsilon * (1 + 1e-9)
    assert strategy.avg_model is not None  # the nodes uploaded x_i without share_model: post-processing


def test_dpq_learns_at_epsilon_eight() -> None:
    """At epsilon = 8 the node-average model is within 10 % of the pooled least-squares optimum (quantized messages,
    Delta = 0.01)."""
    strategy, _ = _dpq_run(150, q_step=0.01)
    x_star = pooled_optimum(0.0)
    w = strategy.current_arrays()["w"].numpy()
    assert np.linalg.norm(w - x_star) < 0.1 * np.linalg.norm(x_star)
