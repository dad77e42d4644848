"""Experiments CLI: run one configuration (Flower simulation/deployment or in-process), reproduce the paper figures, benchmark."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fedpdm_flower.fedapp.config import ConfigError, RunConfig, debug_enabled, known_keys, parse_run_config
from fedpdm_flower.fedapp.registry import ALGORITHMS

#: exit codes: a run config rejected before any round ran, and a run that failed or stopped early
EXIT_CONFIG, EXIT_FAILED = 2, 1


def parse_set(items: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values parse as TOML scalars would (bool, int, float, else string)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, raw = item.split("=", 1)
        raw = raw.strip()
        value: Any
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw.strip("'\"")
        out[key.strip()] = value
    return out


def cmd_run(args: argparse.Namespace) -> int:
    from fedpdm_flower.fedapp.runner import RunFailed, prepare_out_dir, resolve_out_dir, run_to_results, summary_lines

    overrides = {"algorithm": args.algorithm, **parse_set(args.set or [])}
    if args.resume:
        overrides["resume"] = True
    cfg = parse_run_config(overrides)  # fail fast, before any engine starts
    if args.engine == "in-process":
        from fedpdm_flower.fedapp.runner import build_strategy, setup_checkpoints
        from simulations.inprocess import make_contexts, run_rounds

        t0 = time.perf_counter()
        out = prepare_out_dir(cfg, args.out)  # before round 1: a bad location costs nothing
        strategy = build_strategy(cfg)
        setup_checkpoints(cfg, strategy, out)
        contexts = make_contexts(cfg)
        strategy.attach({pid: pid for pid in contexts})
        strategy.summary()
        first = getattr(strategy, "resume_round", 0) + 1
        try:
            doc, path = run_to_results(cfg, strategy, "in-process",
                                       lambda: run_rounds(strategy, contexts, cfg.num_server_rounds - first + 1,
                                                          start=first), out=out, t0=t0)
        except RunFailed as err:
            failed = json.loads(err.results.read_text())
            print("\n".join(summary_lines(failed, err.results, plot=cfg.plot)))
            raise
        print("\n".join(summary_lines(doc, path, plot=cfg.plot)))
        return 0
    from simulations.flower_driver import FlowerRunError, run_flower

    # The local simulation SuperLink runs on this machine: check the location here, before submitting. A remote
    # SuperLink's ServerApp checks it there, before its round 1.
    out = prepare_out_dir(cfg, args.out) if args.connection is None else resolve_out_dir(cfg, args.out)
    try:
        res = run_flower(overrides, out, num_supernodes=cfg.num_clients, connection=args.connection)
    except FlowerRunError as err:
        results = err.run.results if err.run is not None else out / "results.json"
        if results.is_file():  # the ServerApp kept the rounds that ran: quote its error
            failed = json.loads(results.read_text())
            if failed.get("status") == "failed":
                raise RunFailed(f"run {err.run.run_id if err.run else '?'} {err.run.status if err.run else 'failed'}: "
                                f"{failed.get('error')}", results, len(failed["rounds"])) from err
        details = str(err.run.details.get("status-details", "")) if err.run is not None else ""
        marker = "invalid run config: "  # the ServerApp refused the config before round 1 (fedpdm_flower/fedapp/server_app.py)
        if marker in details:
            raise ConfigError(f"run {err.run.run_id if err.run else '?'} refused: {details.split(marker, 1)[1]}") from err
        raise
    print(f"run {res.run_id}: {res.status}; results in {res.results}")
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    """The README's main job: BSDP-FedPDM with record-level DP-SGD on MNIST through Flower's simulation engine
    (simulations/quickstart.py: the task and why)."""
    from simulations.quickstart import main as quickstart

    return quickstart(args.out, parse_set(args.set or []))


def cmd_list(args: argparse.Namespace) -> int:
    for key, spec in ALGORITHMS.items():
        print(f"{key:14s} {spec.summary}")
    print("\nrun-config keys: " + ", ".join(known_keys()))
    print("defaults: " + json.dumps(RunConfig().to_run_config()))
    return 0


def cmd_figure(args: argparse.Namespace) -> int:
    from simulations.experiments import FIGURES, run_figure

    if args.name not in FIGURES:
        raise ConfigError(f"unknown figure {args.name!r}; available: {', '.join(FIGURES)}")
    run_figure(args.name, Path(args.out), scale=args.scale, seeds=args.seeds, rounds=args.rounds,
               overrides=parse_set(args.set or []))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from simulations.benchmark import fedrep_wire, iadmm_throughput, recal_throughput
    from simulations.benchmark import main as bench_main

    if args.set and args.suite != "fedrep":
        raise ConfigError(f"bench --set applies to --suite fedrep only (the {args.suite} suite's task is fixed)")
    if args.suite == "recal":
        recal_throughput(Path(args.out), rounds=args.rounds, connection=args.connection)
        return 0
    if args.suite == "fedrep":
        fedrep_wire(Path(args.out), rounds=args.rounds, connection=args.connection, overrides=parse_set(args.set or []))
        return 0
    if args.suite == "iadmm":
        from simulations.benchmark import iadmm_floor

        iadmm_floor(Path(args.out), rounds=args.rounds)
        if args.methods != "floor":  # --methods floor: only our round against the numpy floor
            iadmm_throughput(Path(args.out), rounds=args.rounds, connection=args.connection)
        return 0
    if args.suite == "startup":
        from simulations.startup import main as startup

        return startup(Path(args.out), rounds=args.rounds,
                       configs=tuple(m for m in (args.methods or "").split(";") if m) or None)
    if args.suite == "footprint":
        from simulations.footprint import main as footprint

        return footprint(Path(args.out), families=[f for f in (args.methods or "").split(",") if f] or None)
    if args.suite == "byzantine":
        from simulations.byzantine_table import main as byzantine_table

        return byzantine_table(Path(args.out))
    if args.suite == "byzantine-fedrep":
        from simulations.byzantine_table import fedrep_main

        return fedrep_main(Path(args.out), only=tuple(args.methods.split(",")) if args.methods else None)
    if args.suite == "dp-seeds":
        from simulations.dp_seeds import main as dp_seeds

        return dp_seeds(Path(args.out), only=[m for m in (args.methods or "").split(",") if m] or None)
    if args.suite == "dp-anchor":
        from simulations.dp_anchor import main as dp_anchor

        return dp_anchor(Path(args.out), methods=[m for m in (args.methods or "").split(",") if m] or None)
    return bench_main(Path(args.out), rounds=args.rounds)


def cmd_partition(args: argparse.Namespace) -> int:
    from simulations.partition import main as partition_main

    return partition_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulations", description=__doc__)
    debug_help = "on failure print the traceback too (as FEDAPP_DEBUG=1 does)"
    p.add_argument("--debug", action="store_true", help=debug_help)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run one configuration with either driver")
    r.add_argument("--algorithm", required=True, help=f"one of: {', '.join(ALGORITHMS)}")
    r.add_argument("--engine", choices=("in-process", "flower"), default="in-process")
    r.add_argument("--out", default="", help="directory for results.json and accuracy.png (default: the run "
                   "config's out-dir, else outputs/<algorithm>-<dataset>-<timestamp> under the current directory)")
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a run-config key (repeatable)")
    r.add_argument("--connection", default=None, help="flwr SuperLink connection (default: local simulation)")
    r.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is in the out-dir (same "
                   "--out and --set as the run that stopped; run config key resume=true)")
    r.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    r.set_defaults(func=cmd_run)
    q = sub.add_parser("quickstart", help="BSDP-FedPDM with record-level DP-SGD at epsilon 8 on MNIST (label skew), "
                       "Flower engine; --set dp=false for the noiseless twin")
    q.add_argument("--out", default="outputs/quickstart")
    q.add_argument("--set", action="append", metavar="KEY=VALUE")
    q.set_defaults(func=cmd_quickstart)
    f = sub.add_parser("figure", help="reproduce a paper figure (see simulations/experiments.py)")
    from simulations.experiments import FIGURES

    f.add_argument("name", help="one of: " + ", ".join(FIGURES))
    f.add_argument("--out", default="outputs/figures")
    f.add_argument("--scale", choices=("reduced", "paper"), default="reduced")
    f.add_argument("--seeds", type=int, default=None)
    f.add_argument("--rounds", type=int, default=None)
    f.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a key of the figure's base config, e.g. dataset=fashion-mnist (repeatable)")
    f.set_defaults(func=cmd_figure)
    b = sub.add_parser("bench", help="wall time per round: ours vs Flower FedAvg, in-process vs Flower")
    b.add_argument("--out", default="outputs/bench")
    b.add_argument("--rounds", type=int, default=10)
    b.add_argument("--suite", choices=("fedpdm", "iadmm", "fedrep", "recal", "dp-anchor", "dp-seeds", "byzantine",
                                       "byzantine-fedrep", "footprint", "startup"),
                   default="fedpdm",
                   help="fedpdm: the seed-000 benchmark; iadmm: our non-private ObjP round vs a plain numpy floor (float32 and "
                        "float64) and the start-up, then DP-IADMM rounds/s on MNIST, in-process vs Flower (--methods "
                        "floor: the first part only); "
                        "fedrep: FedREP bytes per client per round vs the paper's bound and dense, and rounds/s; "
                        "recal: one-hop DP-RECAL rounds/s, Flower vs in-process vs the reference simulator; "
                        "dp-anchor: DP at epsilon 1/3/8, Flower's DP-FedAvg vs CentralDP vs DeviceDPSGD (about 2 h); "
                        "dp-seeds: every DP seed algorithm without noise, at the paper's calibration, at record-level "
                        "epsilon 1/3/8, beside DeviceDPSGD and CentralDP under Flower's FedAvg, and the DP/plain epoch "
                        "speed ratio (--methods picks rows by name; rows add to --out's table); "
                        "byzantine: robust rules around Flower's FedAvg against attacks that break the mean (~5 min); "
                        "byzantine-fedrep: masked FedREP's rows of that table (--methods picks aggregators by row "
                        "name, e.g. 'FedREP + NNM + CClip (adaptive)'; about 7 s of CPU per cell, 10 rows of 17 cells); "
                        "footprint: a SuperNode's peak RSS and ClientApp start-to-reply per family on a real "
                        "deployment with data-path (~10 min; --methods 'fedpdm (numpy),...' picks families); "
                        "startup: whole Flower-simulation runs at 1,000 and 10,000 SuperNodes, BSDP-FedPDM vs Flower's "
                        "FedAvg, with each simulation process's peak RSS (--methods '1,000 nodes' picks one)")
    b.add_argument("--connection", default=None, help="simulation SuperLink connection for --suite iadmm / fedrep")
    b.add_argument("--methods", default=None,
                   help="--suite dp-anchor: run only these methods (flower,flower-client,ours,dpsgd), adding rows to "
                        "--out's table; --suite byzantine-fedrep / dp-seeds: only these rows (comma-separated row "
                        "names or parts of them)")
    b.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="--suite fedrep only: override a task key, e.g. dataset=fashion-mnist (repeatable)")
    b.set_defaults(func=cmd_bench)
    sub.add_parser("list", help="registered algorithms and run-config keys").set_defaults(func=cmd_list)
    from simulations.partition import build_parser as partition_parser

    pp = sub.add_parser("partition", help="write one data file per device (partition_<i>.npz) for a deployment's "
                        "node-config data-path")
    partition_parser(pp).set_defaults(func=cmd_partition)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run a command; every failure ends with one ``error: ...`` line on stderr and a non-zero exit code
    (EXIT_CONFIG for a run config rejected before any round, EXIT_FAILED otherwise); --debug or FEDAPP_DEBUG=1
    adds the traceback."""
    from fedpdm_flower.fedapp.runner import RunFailed

    args = build_parser().parse_args(argv)
    debug = bool(getattr(args, "debug", False)) or debug_enabled()
    try:
        return int(args.func(args))
    except ConfigError as err:
        if debug:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except RunFailed as err:
        if debug:
            traceback.print_exc()
        print(f"error: run failed: {err} (results of the {err.rounds} round(s) that ran: {err.results})",
              file=sys.stderr)
        return EXIT_FAILED
    except Exception as err:  # no bare traceback: one line, the traceback on request
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug prints the traceback)"
        print(f"error: {type(err).__name__}: {err}{hint}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
