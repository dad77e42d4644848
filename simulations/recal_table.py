"""Seed 001, Table V (and Figs. 2-3 in numbers): DP-RECAL vs DP-NIDS, DP-PG-EXTRA, DP random-walk ADMM at equal
privacy budgets on the 8-agent ring, MNIST elastic net (spec shared/specs/dp_recal.md 5.4 E2/E3, 6.1).

Runs the framework-free simulators, which tests pin bit for bit to the Flower strategies (tests/test_recal_driver.py
and the baselines' tests), so K = 4800 activations take seconds rather than the ~9 minutes of a Flower run.
Conditions (paper, spec 5.4): DP-RECAL K = 4800 hops (expected LCI 600); NIDS and PG-EXTRA T = 600 (LCI 600);
RW-ADMM T = 1200 at activation probability 0.5 = 4800 hops (LCI ~600); delta = 1e-3; every method's sigma_1
calibrated to the same epsilon with its own sensitivity and planned LCI (Theorem 3's formula); R = 1.01 (not
stated in the paper). x^1 = a seeded N(0, I) (spec A9). Relative error ||x - x*|| / ||x^1 - x*|| (5.7).

    python -m simulations.recal_table --out outputs/recal [--eps 1 5 10] [--samples 0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

RING8_TABLE_V = {"DP-NIDS": 9600, "DP-PG-EXTRA": 19200, "DP-RW-ADMM": 19200, "DP-RECAL": 4800}


def run_table(out: Path, *, eps_list: tuple[float, ...] = (1.0, 5.0, 10.0), samples: int = 0, R: float = 1.01,
              delta: float = 1e-3, seed: int = 0, graph_spec: str = "ring") -> list[dict[str, Any]]:
    """Every method at every epsilon (plus the noise-free runs); writes table.md and table.json under ``out``."""
    from fedpdm_flower.fedapp import topology
    from fedpdm_flower.fedapp.algorithms.recal import alpha_for, beta_for, simulate_dprecal, solve_elastic_net
    from fedpdm_flower.fedapp.algorithms.recal_baselines import (
        paper_communication,
        simulate_nids,
        simulate_pg_extra,
        simulate_rw_admm,
    )
    from fedpdm_flower.fedapp.apps.recal import STREAM_X1, load_mnist_problem
    from fedpdm_flower.fedapp.privacy import zcdp
    from fedpdm_flower.fedapp.sampling import rng_for

    n, K = 8, 4800
    problem = load_mnist_problem(n, seed=seed, num_samples=samples or None)
    graph = topology.parse_graph(graph_spec, n, seed)
    x_star = solve_elastic_net(problem).x
    x1 = rng_for(seed, STREAM_X1).standard_normal(problem.x_shape)  # the app's x^1 (fedpdm_flower.fedapp.apps.recal.start_point)
    start = topology.start_agent(graph, "stationary", seed)
    beta = beta_for(n)
    l_max = max(a.lipschitz for a in problem.agents)
    alpha_max = max(alpha_for(a.lipschitz, 0.5) for a in problem.agents)
    xi_plan = topology.plan_xi(K, graph, "markov")
    rows: list[dict[str, Any]] = []

    def record(method: str, eps: float | None, res: Any, comm: int, wall: float, realised: float, lci: int) -> None:
        rows.append({"method": method, "epsilon_target": eps, "final_relative_error": float(res.rel_errors[-1]),
                     "min_relative_error": float(np.min(res.rel_errors)), "communication": comm, "lci": lci,
                     "epsilon_realised": realised, "wall_s": wall})
        print(f"{method:16s} eps={eps!s:5s} rel.err {res.rel_errors[-1]:.3e} comm {comm} LCI {lci} "
              f"eps_realised {realised:.4g} {wall:.1f}s", flush=True)

    for eps in (None, *eps_list):
        for mode in ("private", "exact"):
            sigma1 = 0.0 if eps is None else zcdp.calibrate_sigma1(eps, delta, R, xi_plan, alpha_max, beta, l_max)
            t0 = time.perf_counter()
            res = simulate_dprecal(problem, graph.neighbours, K,
                                   lambda cur, k: topology.next_agent(graph, cur, k, seed, "markov", start=start),
                                   start, mode=mode, sigma1=sigma1, R=R, noise_seed=seed, x1=x1, x_star=x_star,
                                   eval_every=K // 48)
            realised = (zcdp.epsilon_dp_recal(alpha_max, beta, l_max, sigma1, R, res.lci, delta) if sigma1 > 0
                        else float("inf"))
            label = "RECAL" if eps is None else "DP-RECAL"
            record(f"{label} ({mode})", eps, res, K, time.perf_counter() - t0, realised, res.lci)
            if eps is None:
                break  # without noise both modes are the same algorithm
        common: dict[str, Any] = {"x0": x1, "x_star": x_star, "R": R, "noise_seed": seed, "delta": delta,
                                  "epsilon": eps, "eval_every": 25}
        for method, sim, T in (("DP-NIDS", simulate_nids, 600), ("DP-PG-EXTRA", simulate_pg_extra, 600)):
            t0 = time.perf_counter()
            base = sim(problem, graph, T, **common)
            realised = base.epsilon(delta) if eps is not None else float("inf")
            record(method if eps is not None else method[3:], eps, base, paper_communication(method[3:].lower(), graph, T),
                   time.perf_counter() - t0, realised, base.lci)
        t0 = time.perf_counter()
        rw = simulate_rw_admm(problem, graph, 1200, **{**common, "eval_every": 100}, walk_seed=seed)
        record("DP-RW-ADMM" if eps is not None else "RW-ADMM", eps, rw, paper_communication("rw-admm", graph, 1200),
               time.perf_counter() - t0, rw.epsilon(delta) if eps is not None else float("inf"), rw.lci)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps({"rows": rows, "R": R, "delta": delta, "K": K, "xi_plan": xi_plan,
                                                "samples": samples or 60000, "graph": graph_spec}, indent=1))
    lines = ["| method | target eps | final rel. error | min rel. error | comm. | LCI | realised eps (Thm 3) | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['epsilon_target'] if r['epsilon_target'] is not None else 'none'} | "
              f"{r['final_relative_error']:.3e} | {r['min_relative_error']:.3e} | {r['communication']} | {r['lci']} | "
              f"{r['epsilon_realised']:.4g} | {r['wall_s']:.1f} |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.recal_table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/recal-table5")
    p.add_argument("--eps", type=float, nargs="+", default=[1.0, 5.0, 10.0])
    p.add_argument("--samples", type=int, default=0, help="MNIST images used (0 = all 60,000)")
    p.add_argument("--graph", default="ring")
    p.add_argument("--r", type=float, default=1.01)
    a = p.parse_args(argv)
    run_table(Path(a.out), eps_list=tuple(a.eps), samples=a.samples, graph_spec=a.graph, R=a.r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
