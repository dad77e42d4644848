"""DP-RECAL through our Strategy / NumPyClient (in-process driver) against the framework-free reference simulator."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedpdm_flower.fedapp import topology
from fedpdm_flower.fedapp.algorithms.recal import simulate_dprecal
from fedpdm_flower.fedapp.apps.recal import recal_problem, reference_solution, start_point
from fedpdm_flower.fedapp.config import ConfigError, RunConfig, parse_run_config
from fedpdm_flower.fedapp.privacy import zcdp
from fedpdm_flower.strategies.recal import DPRECAL
from simulations.inprocess import run_inprocess

BASE: dict[str, Any] = {"algorithm": "dp-recal", "dataset": "mnist", "num-clients": 8, "clients-per-round": 8,
                        "num-server-rounds": 60, "recal-samples": 2000, "eval-every": 20}


def run(**kw: Any) -> tuple[DPRECAL, RunConfig]:
    cfg = parse_run_config({**BASE, **kw})
    strategy, _, _ = run_inprocess(cfg)
    assert isinstance(strategy, DPRECAL)
    return strategy, cfg


@pytest.mark.parametrize("mode", ["exact", "private"])
def test_flower_strategy_matches_the_reference_simulator_bit_for_bit(mode: str) -> None:
    """Same walk (fedpdm_flower.fedapp.topology), same noise streams, same sigma_1: the baton x after K hops is identical."""
    s, cfg = run(**{"recal-mode": mode, "recal-epsilon": 10.0})
    graph = s.graph
    assert graph is not None
    ref = simulate_dprecal(
        recal_problem(cfg), graph.neighbours, cfg.num_server_rounds,
        lambda cur, k: topology.next_agent(graph, cur, k, cfg.seed, cfg.walk, start=s.first_holder),
        s.first_holder, mode=mode, sigma1=s.sigma1, R=cfg.recal_r, noise_seed=cfg.noise_seed, alpha_scale=cfg.alpha_scale,
        x1=start_point(cfg), x_star=reference_solution(cfg), eval_every=cfg.eval_every,
    )
    # the strategy works on the flat vector of the user's arrays (here one (784, 10) array, row-major)
    np.testing.assert_array_equal(s.baton[0], ref.x.ravel())
    np.testing.assert_array_equal(s.current_arrays()["0"].numpy(), ref.x)
    np.testing.assert_array_equal(s.tau, ref.tau)
    assert s.sigma1 > 0
    # the history's objective gap is the simulator's relative error at the same iterations (every 20th and the last)
    assert [r.objective_gap for r in s.history if r.objective_gap is not None] == ref.rel_errors[1:].tolist()


def test_communication_lci_and_realised_epsilon() -> None:
    s, cfg = run(walk="cyclic", **{"recal-epsilon": 5.0, "walk-start": "fixed:0"})
    K, n = 60, 8
    assert s.hops == K == s.history[-1].extra["graph_msgs"]  # one logical message per iteration (spec 7.6)
    np.testing.assert_array_equal(s.tau, np.full(n, K // n + (np.arange(n) < K % n)))  # Hamiltonian cycle
    xi = int(s.tau.max())
    assert xi == int(np.ceil(K / n)) == s.xi_plan
    expected = zcdp.epsilon_from_noise(s.sigma1, s.delta_sens, cfg.recal_r, xi, cfg.recal_delta)
    assert s.history[-1].epsilon == pytest.approx(expected) == pytest.approx(5.0)  # calibrated to the plan
    for r in s.history[1:]:  # (round 1 also carries the registration) every hop is 2 baton transfers of float64 arrays, (x, u~) = 2 * 7840 * 8 bytes + framing
        assert 2 * 7840 * 8 < r.uplink_bytes < 2 * 7840 * 8 + 1000


def test_without_noise_both_u_modes_coincide_and_there_is_no_privacy() -> None:
    """Spec 2.3: with sigma_1 = 0 exact and private mode are the same algorithm (u~ = u = sum lambda)."""
    exact, _ = run(**{"recal-epsilon": 0.0, "recal-mode": "exact"})
    private, _ = run(**{"recal-epsilon": 0.0, "recal-mode": "private"})
    np.testing.assert_array_equal(exact.baton[0], private.baton[0])
    np.testing.assert_array_equal(exact.baton[1], private.baton[1])
    assert exact.history[-1].epsilon is None  # no noise: no privacy figure (null in results.json)


def test_stop_on_budget_ends_before_any_agent_exceeds_the_plan() -> None:
    s, _ = run(**{"stop-on-budget": True, "xi-plan": "walk", "num-server-rounds": 200})
    assert s.finished and int(s.tau.max()) <= s.xi_plan < 200
    assert s.history[-1].epsilon <= 10.0 + 1e-9


def test_a_holder_that_fails_twice_stops_the_run() -> None:
    cfg = parse_run_config({**BASE, "num-server-rounds": 5})
    from fedpdm_flower.fedapp.runner import build_strategy
    from simulations.inprocess import make_contexts, run_rounds

    strategy = build_strategy(cfg)
    contexts = make_contexts(cfg)
    strategy.attach({pid: pid for pid in contexts})
    run_rounds(strategy, contexts, 1)
    assert isinstance(strategy, DPRECAL)
    victim = strategy.holder
    del contexts[victim].state.array_records["dprecal"]  # the holder lost its state: it cannot relay
    with pytest.raises(RuntimeError, match=f"agent {victim} failed to relay the baton twice"):
        run_rounds(strategy, contexts, 2, start=2)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [({"graph": "er:2"}, "'graph'"), ({"dataset": "adult"}, "'dataset'"), ({"walk-start": "fixed:9"}, "'walk-start'"),
     ({"recal-r": 0.5}, "'recal-r'"), ({"dataset": "covtype"}, "'data-source'")],
)
def test_bad_recal_configs_name_the_key(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_run_config({**BASE, **overrides})
