"""Seed 004 (DPQ-DSGD), the paper's MNIST experiment as a table: test accuracy at K for the quantizer step
Delta in {1, 5, 10} x noise exponent sigma in {-0.1, 0.1, 0.2}, plus the spec 2.5 baselines (no quantization
= dp-only at each sigma, no noise = quant-only at each Delta, plain DSGD), with bits per message and the paper
accountant's cumulative epsilon beside each (spec dp_quantized.md 6.1-6.4; the paper itself has figures only).

Setup (spec 6.3): 5 nodes, ring with Metropolis weights, IID MNIST shards of 12,000, the unpadded LeNet-5
(``lenet5-valid``, d = 44,426), common seeded x_0, the paper's constants (a1 = .35, alpha = 1, a2 = .3, beta = .75,
a3 = .24, gamma = .7, delta = 3, C = .2, noise offset 5): at K = 2000 alpha_hat = 0.0101, beta_hat = 0.0010, batch 50.
Each run is Algorithm 1 for k = 0..K (K + 1 updates; the Flower run of ``num-server-rounds = K + 2``).

Engine: :func:`fedpdm_flower.fedapp.algorithms.dpq.simulate` (``engine="vectorised"``) on
:func:`fedpdm_flower.fedapp.apps.dpq.network` -- the same run config, data, x_0 and streams as the Flower strategy
(tests/test_dpq_flower.py pins the Flower run to the simulator bit for bit, tests/test_dpq.py the two engines) --
in a spawn-based pool of ``--workers`` processes with one BLAS / torch thread each.

Reported per run: test accuracy at K of the node models (mean, min, max over nodes; spec 9.17) and of the
node-average model (evaluation only), mean train accuracy on the shards, bits per message (spec 3: ``d b + 40``
with b the bits per coordinate of that message's level range; 32 d unquantized) averaged over all messages, and at
the first and last iteration, the empirical entropy, and the paper accountant's cumulative eps over k = 0..K with
delta_hat (vacuous: delta_0 = 1, spec 9.8); the noise-free runs have no DP (eps = inf). Curves: the accuracies
every ``--eval-every`` iterations on the first ``--curve-limit`` test and shard samples (the final point on all).

    python -m simulations.dpq_table --out outputs/dpq-table --rounds 2000            # the full table (the lead's)
    python -m simulations.dpq_table --out /tmp/dpq-t --rounds 2000 --max-iters 20     # timing: 20 iterations each
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

Q_STEPS = (1.0, 5.0, 10.0)
SIGMAS = (-0.1, 0.1, 0.2)


def runs(q_steps: tuple[float, ...] = Q_STEPS, sigmas: tuple[float, ...] = SIGMAS) -> dict[str, dict[str, Any]]:
    """label -> run-config overrides: the Delta x sigma grid, then the baselines."""
    out: dict[str, dict[str, Any]] = {}
    for q in q_steps:
        for s in sigmas:
            out[f"DPQ Delta={q:g} sigma={s:g}"] = {"dpq-variant": "dpq", "dpq-q-step": q, "dpq-sigma-exp": s}
    for s in sigmas:
        out[f"no quantization (DP only) sigma={s:g}"] = {"dpq-variant": "dp-only", "dpq-sigma-exp": s}
    for q in q_steps:
        out[f"no noise (quantization only) Delta={q:g}"] = {"dpq-variant": "quant-only", "dpq-q-step": q}
    out["plain DSGD"] = {"dpq-variant": "dsgd"}
    return out


def base_config(K: int, *, samples: int = 0, eval_limit: int = 0, seed: int = 0, graph: str = "ring") -> dict[str, Any]:
    """The spec 6.3 run config at horizon K (every run adds its dpq-variant / q-step / sigma)."""
    return {"algorithm": "dpq-dsgd", "dataset": "mnist", "model": "lenet5-valid", "partitioner": "iid",
            "num-clients": 5, "clients-per-round": 5, "graph": graph, "num-server-rounds": K + 2, "dpq-horizon": K,
            "samples-per-client": samples, "dpq-eval-limit": eval_limit, "seed": seed}


def run_one(job: tuple[str, dict[str, Any], int, int, int]) -> dict[str, Any]:
    """One configuration: simulate ``num_iters`` iterations, evaluating every ``eval_every`` iterations on the first
    ``curve_limit`` test / shard samples (0 = all) and at the end on all of them (``dpq-eval-limit``)."""
    label, raw, num_iters, eval_every, curve_limit = job
    import torch

    torch.set_num_threads(1)
    from fedpdm_flower.fedapp.algorithms import dpq
    from fedpdm_flower.fedapp.apps import dpq as dpq_app
    from fedpdm_flower.fedapp.compression import quantize
    from fedpdm_flower.fedapp.config import parse_run_config

    cfg = parse_run_config(raw)
    setup = dpq_app.network(cfg)
    params = dpq_app.params(cfg)
    bits: list[float] = []
    entropy: list[float] = []
    curve: list[dict[str, float]] = []
    t_eval = [0.0, 0.0]  # intermediate, final

    def evaluate(k: int, x: np.ndarray, limit: int) -> dict[str, float]:
        test = [dpq_app.evaluate(setup.net, x[i], setup.test, limit)[0] for i in range(x.shape[0])]
        train = [dpq_app.evaluate(setup.net, x[i], shard, limit)[0] for i, shard in enumerate(setup.shards)]
        avg_acc, avg_loss = dpq_app.evaluate(setup.net, x.mean(axis=0), setup.test, limit)
        return {"k": float(k), "test_acc_mean": float(np.mean(test)), "test_acc_min": float(np.min(test)),
                "test_acc_max": float(np.max(test)), "train_acc_mean": float(np.mean(train)),
                "avg_model_test_acc": avg_acc, "avg_model_test_loss": avg_loss,
                "test_samples": float(min(limit, len(setup.test)) if limit else len(setup.test))}

    def callback(k: int, x: np.ndarray, msgs: list[np.ndarray]) -> None:
        if params.quantized:
            bits.append(float(np.mean([quantize.message_bits(m) for m in msgs])))
            entropy.append(float(np.mean([quantize.empirical_entropy_bits(m) for m in msgs])))
        else:
            bits.append(float(quantize.float32_message_bits(x.shape[1])))
        last = k + 1 == num_iters
        if (k + 1) % eval_every == 0 or last:
            t0 = time.perf_counter()
            curve.append(evaluate(k, x, cfg.dpq_eval_limit if last else curve_limit))  # x = x_{k+1}
            t_eval[int(last)] += time.perf_counter() - t0

    t0 = time.perf_counter()
    trace = dpq.simulate(params, setup.A, setup.objectives, setup.x0, num_iters, engine="vectorised", callback=callback)
    wall = time.perf_counter() - t0
    final = curve[-1]
    row: dict[str, Any] = {
        "label": label, "variant": cfg.dpq_variant, "q_step": params.q_step, "sigma_exp": cfg.dpq_sigma_exp,
        "noise": params.noise, "K": dpq_app.horizon(cfg), "iterations": num_iters, "batch": params.batch_size,
        "alpha_hat": params.alpha_hat, "beta_hat": params.beta_hat, **{key: final[key] for key in final if key != "k"},
        "bits_per_message_mean": float(np.mean(bits)), "bits_per_message_first": bits[0],
        "bits_per_message_last": bits[-1], "bits_per_coordinate_mean": (float(np.mean(bits)) - 40) / setup.x0.shape[0]
        if params.quantized else 32.0, "entropy_bits_per_coordinate_mean": float(np.mean(entropy)) if entropy else None,
        "float32_message_bits": quantize.float32_message_bits(setup.x0.shape[0]),
        "consensus_error_final": float(trace.consensus_error[-1]),
        "wall_s": wall, "eval_s": sum(t_eval), "final_eval_s": t_eval[1],
        "curve_eval_s_per_point": t_eval[0] / max(len(curve) - 1, 1) if len(curve) > 1 else None,
        "s_per_iteration": (wall - sum(t_eval)) / num_iters, "curve": curve,
    }
    if params.noise:
        budget = dpq_app.schedule(cfg).budget(num_iters - 1, warn=False)
        row.update({"eps": budget.eps_total, "log_delta_hat": budget.log_delta_hat, "delta_hat": budget.delta_hat,
                    "delta_hat_vacuous": budget.vacuous, "eps_k_max": budget.eps_max,
                    "lemma3_violations": budget.lemma3_violations})
    else:
        row.update({"eps": float("inf"), "delta_hat": None, "delta_hat_vacuous": None})
    print(f"{label:42s} acc {final['test_acc_mean']:.4f} (avg model {final['avg_model_test_acc']:.4f}) "
          f"bits/msg {row['bits_per_message_mean']:.0f} eps {row['eps']:.4g} {wall:.1f}s "
          f"({row['s_per_iteration'] * 1e3:.1f} ms/iter)", flush=True)
    return row


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def run_table(out: Path, K: int = 2000, *, max_iters: int = 0, eval_every: int = 50, curve_limit: int = 2000,
              samples: int = 0, eval_limit: int = 0, seed: int = 0, workers: int = 2,
              graph: str = "ring") -> list[dict[str, Any]]:
    """Every run of :func:`runs`; writes table.md, table.json and curves.png under ``out``; returns the rows."""
    num_iters = min(max_iters, K + 1) if max_iters else K + 1
    base = base_config(K, samples=samples, eval_limit=eval_limit, seed=seed, graph=graph)
    jobs = [(label, {**base, **over}, num_iters, eval_every, curve_limit) for label, over in runs().items()]
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters read the thread limits at import
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        rows = list(pool.map(run_one, jobs))
    wall = time.perf_counter() - t0
    per_iter = float(np.mean([r["s_per_iteration"] for r in rows]))
    final_eval = float(np.mean([r["final_eval_s"] for r in rows]))
    curve_evals = [r["curve_eval_s_per_point"] for r in rows if r["curve_eval_s_per_point"] is not None]
    curve_eval = float(np.mean(curve_evals)) if curve_evals else final_eval
    # the full table: K = 2000 (2001 iterations, batch 50), the same evaluation settings
    estimate = len(rows) * (2001 * per_iter + (2001 // eval_every) * curve_eval + final_eval) / workers
    timing = {"wall_s": wall, "workers": workers, "iterations_per_run": num_iters, "runs": len(rows),
              "s_per_iteration_mean": per_iter, "curve_eval_s_per_point_mean": curve_eval,
              "final_eval_s_mean": final_eval, "estimate_full_table_K2000_s": estimate}
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.json").write_text(json.dumps({"K": K, "iterations": num_iters, "eval_every": eval_every,
                                                "curve_limit": curve_limit,
                                                "samples_per_node": samples or 12000, "eval_limit": eval_limit or 10000,
                                                "seed": seed, "graph": graph, "timing": timing, "rows": rows}, indent=1))
    lines = [f"DPQ-DSGD on MNIST (5-node {graph}, lenet5-valid), horizon K = {K}, {num_iters} iterations, seed {seed}; "
             "accuracies on the test set at the end (node models: mean [min, max]; node-average model: evaluation only)",
             "",
             "| run | test acc (mean node) | [min, max] | avg-model test acc | train acc | bits / message (mean) | "
             "bits / coord | first -> last bits | eps (sum eps_k) | delta_hat |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eps = "inf (no DP)" if not r["noise"] else f"{r['eps']:.4g}"
        dh = "n/a" if not r["noise"] else (f"{r['delta_hat']:.3g} (vacuous)" if r["delta_hat_vacuous"]
                                          else f"{r['delta_hat']:.3g}")
        lines.append(f"| {r['label']} | {r['test_acc_mean']:.4f} | [{r['test_acc_min']:.4f}, {r['test_acc_max']:.4f}] "
                     f"| {r['avg_model_test_acc']:.4f} | {r['train_acc_mean']:.4f} | {r['bits_per_message_mean']:,.0f} | "
                     f"{r['bits_per_coordinate_mean']:.2f} | {_fmt(r['bits_per_message_first'], ',.0f')} -> "
                     f"{_fmt(r['bits_per_message_last'], ',.0f')} | {eps} | {dh} |")
    lines += ["", f"float32 reference: {rows[0]['float32_message_bits']:,} bits / message (32 d).",
              f"Timing: {per_iter * 1e3:.1f} ms per iteration (5 nodes, vectorised, one thread per worker; "
              f"batch {rows[0]['batch']}), {curve_eval:.2f} s per curve evaluation, {final_eval:.1f} s for the final "
              f"one; the full K = 2000 table ({len(rows)} runs x 2001 iterations, curve every {eval_every}) would "
              f"take about {estimate / 60:.0f} min on {workers} workers (wall {wall:.0f} s for this run)."]
    if K != 2000:
        lines.append(f"(Horizon K = {K} has batch {rows[0]['batch']}, the paper's K = 2000 has 50: for the estimate, "
                     "time the K = 2000 schedule with --rounds 2000 --max-iters 20.)")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    _plot(rows, out / "curves.png")
    print(table, flush=True)
    return rows


def _plot(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        ks = [c["k"] + 1 for c in r["curve"]]
        ax.plot(ks, [c["test_acc_mean"] for c in r["curve"]], label=r["label"],
                linestyle="-" if r["variant"] == "dpq" else ":")
    ax.set_xlabel("iteration k")
    ax.set_ylabel("test accuracy (mean over nodes)")
    ax.set_title("DPQ-DSGD, MNIST, 5-node ring")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulations.dpq_table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/dpq-table")
    p.add_argument("--rounds", type=int, default=2000, help="horizon K of the schedule (runs k = 0..K)")
    p.add_argument("--max-iters", type=int, default=0, help="stop every run after this many iterations (timing); "
                   "0 = all K + 1")
    p.add_argument("--eval-every", type=int, default=50, help="iterations between curve points")
    p.add_argument("--curve-limit", type=int, default=2000, help="test (and shard) samples of a curve point; the "
                   "final evaluation uses all (see --eval-limit); 0 = all")
    p.add_argument("--samples", type=int, default=0, help="samples per node (0 = the 12,000 of the IID split)")
    p.add_argument("--eval-limit", type=int, default=0, help="test samples (and shard samples for the train "
                   "accuracy) evaluated; 0 = all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--graph", default="ring")
    a = p.parse_args(argv)
    run_table(Path(a.out), a.rounds, max_iters=a.max_iters, eval_every=a.eval_every, curve_limit=a.curve_limit,
              samples=a.samples, eval_limit=a.eval_limit, seed=a.seed, workers=a.workers, graph=a.graph)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
