"""DP-RECAL's Table V baselines on Flower (fedpdm_flower/strategies/recal_baselines.py, fedpdm_flower/clients/recal_baselines.py).

The Flower strategies driven in-process (simulations.inprocess.run_inprocess, the same RecordDicts and
context.state as a Flower run) against the framework-free simulators of fedpdm_flower.fedapp.algorithms.recal_baselines, bit for
bit with the DP noise on; the failure rules; bad run configs; and one real `flwr run` simulation of dp-nids
against the in-process driver.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from crossproc import TRAJECTORY_ULPS, assert_same_across_processes

from fedpdm_flower.clients.decentralized import load_state
from fedpdm_flower.fedapp.algorithms.recal import relative_error
from fedpdm_flower.fedapp.algorithms.recal_baselines import (
    STREAM_NIDS,
    STREAM_PG_EXTRA,
    NidsState,
    NoiseConfig,
    PGExtraState,
    RWAdmmState,
    baseline_sigma1,
    gradient_message_sensitivity,
    messages_per_iteration,
    nids_alpha_bound,
    pg_extra_alpha_bound,
    publication_noise,
    rw_admm_sensitivity,
    simulate_nids,
    simulate_pg_extra,
    simulate_rw_admm,
)
from fedpdm_flower.fedapp.apps.recal import recal_problem, reference_solution, start_point
from fedpdm_flower.fedapp.config import ConfigError, parse_run_config
from fedpdm_flower.fedapp.privacy import zcdp
from fedpdm_flower.fedapp.runner import build_strategy, finish
from fedpdm_flower.strategies.base import RoundFailed
from fedpdm_flower.strategies.recal_baselines import DPNids, DPPGExtra, DPRWAdmm
from simulations.inprocess import make_contexts, run_inprocess, run_rounds

BASE: dict[str, Any] = {"plot": False, "dataset": "mnist", "num-clients": 8, "clients-per-round": 8, "recal-samples": 2000,
                        "recal-epsilon": 10.0, "eval-every": 1}
T_SYNC = 6
SYNC = {"dp-pg-extra": (DPPGExtra, PGExtraState, simulate_pg_extra, STREAM_PG_EXTRA),
        "dp-nids": (DPNids, NidsState, simulate_nids, STREAM_NIDS)}


def run(algorithm: str, **kw: Any) -> Any:
    cfg = parse_run_config({**BASE, "algorithm": algorithm, **kw})
    strategy, contexts, _ = run_inprocess(cfg)
    return strategy, contexts, cfg


def flat(x: Any) -> Any:
    """The simulators work on x of the problem's shape (q, C), the strategies on its row-major flat vector."""
    return x.reshape(x.shape[0], -1) if x.ndim == 3 else x.ravel()


@pytest.mark.parametrize("algorithm", sorted(SYNC))
def test_sync_baseline_on_flower_equals_the_simulator_bit_for_bit(algorithm: str) -> None:
    """T rounds = init, (publish, step) x (T - 1), publish T at every agent: the agents' x_i equal the simulator's
    after T - 1 iterations (both engines) and the outbox holds their T-th noisy publications, bit for bit."""
    cls, state_cls, simulate, stream = SYNC[algorithm]
    s, contexts, cfg = run(algorithm, **{"num-server-rounds": T_SYNC})
    assert isinstance(s, cls)
    n, problem, x0, x_star = cfg.num_clients, recal_problem(cfg), start_point(cfg), reference_solution(cfg)
    # registration: the stepsize and sigma_1 (xi = T = num-server-rounds, Delta = 2 alpha L_max)
    l_max = float(problem.lipschitz.max())
    bound = pg_extra_alpha_bound(s.weights, l_max) if algorithm == "dp-pg-extra" else nids_alpha_bound(l_max)
    assert s.alpha == cfg.alpha_scale * bound
    assert s.delta_sens == gradient_message_sensitivity(s.alpha, l_max)
    assert s.sigma1 == baseline_sigma1(10.0, cfg.recal_delta, cfg.recal_r, T_SYNC, s.delta_sens) > 0
    common = {"alpha_scale": cfg.alpha_scale, "x0": x0, "x_star": x_star, "sigma1": s.sigma1, "R": cfg.recal_r,
              "noise_seed": cfg.noise_seed}
    states = [load_state(contexts[i].state, s_key(algorithm), state_cls) for i in range(n)]
    agent_x = np.stack([st.x for st in states])
    for engine in ("vectorised", "per_agent"):
        ref = simulate(problem, s.graph, T_SYNC - 1, engine=engine, **common)
        assert ref.step == s.alpha and ref.sigma1 == s.sigma1
        np.testing.assert_array_equal(agent_x, flat(ref.agent_x))
    noise = NoiseConfig(s.sigma1, cfg.recal_r, cfg.noise_seed)
    if algorithm == "dp-pg-extra":
        clean = agent_x
    else:  # v_i^T = 2 x^T - x^{T-1} - alpha grad f_i(x^T) + alpha grad f_i(x^{T-1}), x^{T-1} from T - 2 iterations
        prev = flat(simulate(problem, s.graph, T_SYNC - 2, **common).agent_x)
        grads = [a.grad for a in problem.agents]
        clean = np.stack([2.0 * agent_x[i] - prev[i] - s.alpha * grads[i](agent_x[i].copy())
                          + s.alpha * grads[i](prev[i].copy()) for i in range(n)])
    for i in range(n):
        eps = publication_noise((problem.agents[i].dim,), T_SYNC, i, noise, stream)
        assert eps is not None
        np.testing.assert_array_equal(s.outbox[i][0], clean[i] + eps)
        assert states[i].t == T_SYNC
    # evaluation: the average of the published messages only; the paper's communication count; LCI = T
    last = s.history[-1]
    assert last.objective_gap == relative_error(s.outbox_stack(0).mean(axis=0), x_star.ravel(), x0.ravel())
    assert last.extra["lci"] == T_SYNC and s.tau.tolist() == [T_SYNC] * n
    assert last.extra["graph_msgs"] == messages_per_iteration(algorithm.removeprefix("dp-"), s.graph) * T_SYNC
    assert last.extra["graph_msgs"] == {"dp-pg-extra": 32, "dp-nids": 16}[algorithm] * T_SYNC  # ring-8, Table V
    assert last.extra["messages_sent"] == 16 * T_SYNC and last.extra["forwarded"] == 16 * (T_SYNC - 1) == s.forwarded
    assert last.epsilon == pytest.approx(10.0, rel=1e-9)  # calibrated at xi = T, realised LCI = T
    assert [r.extra["lci"] for r in s.history] == list(range(1, T_SYNC + 1))


def s_key(algorithm: str) -> str:
    return {"dp-pg-extra": "pg-extra", "dp-nids": "nids"}[algorithm]


def test_sync_router_forwards_each_agent_exactly_its_neighbours_messages() -> None:
    """The server never mixes: agent i's round-k arrays are its neighbours' round-(k-1) replies, unchanged."""
    cfg = parse_run_config({**BASE, "algorithm": "dp-nids", "num-server-rounds": 3, "graph": "star"})
    s = build_strategy(cfg)
    assert isinstance(s, DPNids)
    contexts = make_contexts(cfg)
    s.attach({pid: pid for pid in contexts})
    run_rounds(s, contexts, 2)
    sent = dict(s.train_contents(3))
    graph = s.graph
    assert graph is not None
    for i in range(cfg.num_clients):
        arrays = sent[i]["arrays"].to_numpy_ndarrays()
        config = sent[i]["config"]
        assert json.loads(str(config["neighbours"])) == list(graph.neighbours[i])
        assert len(arrays) == graph.degrees[i]
        for a, j in zip(arrays, graph.neighbours[i], strict=True):
            np.testing.assert_array_equal(a, s.outbox[j][0])
        # the agent's Metropolis row travels with the messages (exact float round trip through JSON)
        assert json.loads(str(config["weights"])) == [s.weights[i, j] for j in graph.neighbours[i]]  # type: ignore[index]
        assert config["self-weight"] == s.weights[i, i] and config["agent-id"] == i  # type: ignore[index]
        assert set(config) == {"neighbours", "weights", "self-weight", "agent-id", "msg-round", "alpha", "sigma1", "R",
                               "nu1", "nu2", "server-round", "dim", "layout-crc"}


def test_rw_admm_on_flower_equals_the_simulator_bit_for_bit() -> None:
    """24 hops = 6 paper iterations at P = 0.5 on ring-8: same walk, same noise, same sigma_1, same token."""
    s, contexts, cfg = run("dp-rw-admm", **{"num-server-rounds": 24})
    assert isinstance(s, DPRWAdmm)
    problem = recal_problem(cfg)
    ref = simulate_rw_admm(problem, s.graph, 6, activation_prob=cfg.rw_activation_prob, beta_scale=cfg.rw_beta_scale,
                           x0=start_point(cfg), x_star=reference_solution(cfg), epsilon=10.0, delta=cfg.recal_delta,
                           R=cfg.recal_r, noise_seed=cfg.noise_seed, walk=cfg.walk, start=s.first_holder,
                           walk_seed=cfg.seed)
    assert ref.hops == s.hops == 24
    assert ref.step == s.beta and ref.sigma1 == s.sigma1 > 0 and ref.sensitivity == s.delta_sens
    assert s.delta_sens == rw_admm_sensitivity(s.beta, float(problem.lipschitz.max()), 8)
    np.testing.assert_array_equal(s.global_model(), ref.x.ravel())
    np.testing.assert_array_equal(s.tau, ref.tau)
    assert ref.holders is not None
    assert [int(r.extra["agent"]) for r in s.history] == ref.holders.tolist()
    ys = np.stack([load_state(contexts[i].state, "rw-admm", RWAdmmState).y for i in range(8)])  # type: ignore[union-attr]
    np.testing.assert_array_equal(ys, flat(ref.agent_x))
    # per paper iteration (4 hops): the same relative error; the paper's count 16 / paper iteration
    assert [s.history[4 * k - 1].objective_gap for k in range(1, 7)] == ref.rel_errors[1:].tolist()
    assert s.history[-1].extra["graph_msgs"] == ref.paper_messages == 16 * 6
    assert s.history[-1].extra["messages_sent"] == 24
    assert s.history[-1].epsilon == ref.epsilon(cfg.recal_delta)
    assert s.xi_plan == 4  # ceil(1.15 * 24 / 8)


def test_rw_admm_stop_on_budget_matches_the_simulator() -> None:
    """48 hops planned, xi_plan = ceil(1.15 * 48 / 8) = 7; this walk visits an agent 9 times, so both stop early."""
    s, _, cfg = run("dp-rw-admm", **{"num-server-rounds": 48, "stop-on-budget": True})
    assert isinstance(s, DPRWAdmm)
    ref = simulate_rw_admm(recal_problem(cfg), s.graph, 12, x0=start_point(cfg), x_star=reference_solution(cfg),
                           epsilon=10.0, delta=cfg.recal_delta, R=cfg.recal_r, noise_seed=cfg.noise_seed,
                           start=s.first_holder, walk_seed=cfg.seed, stop_on_budget=True)
    assert s.finished and s.hops == ref.hops < 48
    assert int(s.tau.max()) == s.xi_plan == 7
    np.testing.assert_array_equal(s.global_model(), ref.x.ravel())
    assert s.history[-1].epsilon <= 10.0 + 1e-9


def test_without_noise_the_published_average_converges() -> None:
    """recal-epsilon = 0, recal-sigma1 = 0: plain NIDS; the outbox average approaches x*; no privacy figure."""
    s, _, _ = run("dp-nids", **{"num-server-rounds": 150, "recal-epsilon": 0.0, "eval-every": 50})
    errs = [r.objective_gap for r in s.history if r.objective_gap is not None]
    assert len(errs) == 3  # rounds 50, 100, 150
    assert s.sigma1 == 0.0 and errs[-1] < 1e-2 * errs[0]
    assert s.history[-1].epsilon is None


def test_a_missing_agent_stops_a_synchronous_run() -> None:
    cfg = parse_run_config({**BASE, "algorithm": "dp-pg-extra", "num-server-rounds": 4})
    s = build_strategy(cfg)
    contexts = make_contexts(cfg)
    s.attach({pid: pid for pid in contexts})
    run_rounds(s, contexts, 2)
    del contexts[5].state.array_records["pg-extra"]  # agent 5 lost its state: it cannot step
    with pytest.raises(RoundFailed, match=r"no valid message from agent\(s\) \[5\].*agent 5 has None publications"):
        run_rounds(s, contexts, 1, start=3)


def test_rw_admm_holder_failing_twice_stops_the_run() -> None:
    cfg = parse_run_config({**BASE, "algorithm": "dp-rw-admm", "num-server-rounds": 5})
    s = build_strategy(cfg)
    assert isinstance(s, DPRWAdmm)
    contexts = make_contexts(cfg)
    s.attach({pid: pid for pid in contexts})
    run_rounds(s, contexts, 1)
    victim = s.holder
    del contexts[victim].state.array_records["rw-admm"]
    with pytest.raises(RoundFailed, match=f"agent {victim} failed to relay the token twice"):
        run_rounds(s, contexts, 2, start=2)


@pytest.mark.parametrize(
    ("algorithm", "overrides", "key"),
    [("dp-nids", {"dataset": "adult"}, "'dataset'"),
     ("dp-pg-extra", {"graph": "er:2"}, "'graph'"),
     ("dp-pg-extra", {"num-clients": 1, "clients-per-round": 1}, "'num-clients'"),
     ("dp-nids", {"alpha-scale": 1.0}, "'alpha-scale'"),
     ("dp-nids", {"recal-r": 2.0, "num-server-rounds": 3000}, "'recal-r'"),
     ("dp-rw-admm", {"recal-r": 2.0, "num-server-rounds": 30000, "xi-plan": "K"}, "'recal-r'"),
     ("dp-rw-admm", {"walk-start": "fixed:9"}, "'walk-start'"),
     ("dp-rw-admm", {"rw-activation-prob": 0.0}, "'rw-activation-prob'"),
     ("dp-rw-admm", {"rw-activation-prob": 1.5}, "'rw-activation-prob'"),
     ("dp-rw-admm", {"rw-beta-scale": 0.0}, "'rw-beta-scale'")],
)
def test_bad_baseline_configs_name_the_key(algorithm: str, overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_run_config({**BASE, "algorithm": algorithm, **overrides})


def test_the_data_free_sensitivity_is_what_registration_computes() -> None:
    from fedpdm_flower.fedapp.algorithms.recal_baselines import data_free_sensitivity

    for algorithm in ("dp-pg-extra", "dp-nids", "dp-rw-admm"):
        s, _, cfg = run(algorithm, **{"num-server-rounds": 1})
        assert data_free_sensitivity(algorithm, s.graph, cfg.alpha_scale, cfg.rw_beta_scale) == pytest.approx(
            s.delta_sens, rel=1e-12)
        assert zcdp.epsilon_from_noise(s.sigma1, s.delta_sens, cfg.recal_r, s.xi_plan, cfg.recal_delta) == \
            pytest.approx(10.0, rel=1e-9)


NIDS_FLOWER = {**BASE, "algorithm": "dp-nids", "num-server-rounds": 10, "eval-every": 5}


@pytest.mark.flower
def test_dp_nids_flower_simulation_equals_inprocess_driver(tmp_path: Path) -> None:
    """8 SuperNodes, 10 rounds through `flwr run`: same registration, routing, noise and agents' states (on the
    test session's simulation SuperLink, whose ClientApps import this checkout)."""
    from simulations.flower_driver import run_flower

    res = run_flower(NIDS_FLOWER, tmp_path / "flower", num_supernodes=8, stream=False)
    assert res.status == "finished:completed"
    flower = json.loads(res.results.read_text())
    cfg = parse_run_config(NIDS_FLOWER)
    strategy, _, wall = run_inprocess(cfg)
    local, path = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=str(tmp_path / "local"))
    keys = ("round", "objective_gap", "epsilon", "uplink_bytes", "downlink_bytes", "clients", "lci", "graph_msgs",
            "messages_sent", "forwarded", "mean_sigma", "mean_local_loss", "relative_error")
    for fr, lr in zip(flower["rounds"], local["rounds"], strict=True):
        assert_same_across_processes({k: fr.get(k) for k in keys}, {k: lr.get(k) for k in keys},
                                     ulps=TRAJECTORY_ULPS, what=f"round {lr['round']}")
    assert [r["round"] for r in flower["rounds"] if r.get("relative_error") is not None] == [5, 10]  # eval-every
    assert_same_across_processes(np.load(tmp_path / "flower" / "model.npy"), np.load(path.parent / "model.npy"),
                                 ulps=TRAJECTORY_ULPS, what="final model")
    assert flower["rounds"][-1]["graph_msgs"] == 160 and all(r["clients"] == 8 for r in flower["rounds"])
