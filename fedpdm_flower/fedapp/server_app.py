"""ServerApp: parse the run config -> build the strategy from the registry -> run -> write results.

A run that cannot start (bad run config, unwritable out-dir) or that stops early (a round without an accepted
reply, any other error) logs one ERROR line saying why and raises, which is what makes Flower mark the run
``finished:failed`` (`flwr run` itself exits 0 either way: check `flwr list`). Once rounds have run, results.json is
written first, with ``"status": "failed"``. Flower logs the exception it catches with a traceback of its own; ours
is cut to the raise in this module unless FEDAPP_DEBUG=1 asks for the whole chain.

After every round the run's server state goes to ``<out-dir>/checkpoint`` (run config ``checkpoint``, default on);
``resume=true`` with the same run config and out-dir continues a run that stopped from the round after its last
checkpoint (:func:`fedpdm_flower.fedapp.runner.setup_checkpoints`, docs/deployment.md "Checkpoints and resume").
"""

from __future__ import annotations

import time
from logging import ERROR, INFO

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedpdm_flower.fedapp.config import ConfigError, debug_enabled, parse_run_config
from fedpdm_flower.fedapp.runner import (
    RunFailed,
    build_strategy,
    prepare_out_dir,
    run_to_results,
    setup_checkpoints,
    summary_lines,
)
from fedpdm_flower.strategies.base import PromptGrid

app = ServerApp()


class RunNotStarted(RuntimeError):
    """The run could not start (its config or its data): nothing ran, nothing was written."""


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the configured algorithm for num-server-rounds and write results.json + accuracy.png."""
    t0 = time.perf_counter()
    debug = debug_enabled()
    try:
        cfg = parse_run_config(context.run_config)
        out = prepare_out_dir(cfg)  # before round 1: a bad location costs nothing
        strategy = build_strategy(cfg)  # loads the data and the model: may still reject the config
        setup_checkpoints(cfg, strategy, out)  # resume: the checkpoint's state replaces the initial one
    except ConfigError as err:
        log(ERROR, "invalid run config: %s", err)
        if debug:
            raise
        raise ConfigError(f"invalid run config: {err}") from None
    except Exception as err:
        log(ERROR, "could not start the run: %s: %s", type(err).__name__, err)
        if debug:
            raise
        raise RunNotStarted(f"could not start the run: {type(err).__name__}: {err}") from None
    engine = "flower-simulation" if type(grid).__name__ == "InMemoryGrid" else "flower-deployment"
    log(INFO, "results will be written to %s", out)

    exchanges = grid if engine == "flower-simulation" else PromptGrid(grid)  # replies collected within 0.1-1 s

    def drive() -> None:  # the strategy holds the initial model (in the user's layout) and the central evaluation
        strategy.start(grid=exchanges, initial_arrays=strategy.current_arrays(), num_rounds=cfg.num_server_rounds,
                       evaluate_fn=strategy.evaluate_fn)

    try:
        doc, path = run_to_results(cfg, strategy, engine, drive, out=out, t0=t0)
    except RunFailed as err:
        log(ERROR, "run failed: %s", err)
        log(ERROR, "results of the %d round(s) that ran (status failed): %s", err.rounds, err.results)
        if debug:
            raise
        raise RunFailed(str(err), err.results, err.rounds) from None
    for line in summary_lines(doc, path, plot=cfg.plot):
        log(INFO, "%s", line)
