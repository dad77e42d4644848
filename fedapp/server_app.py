"""ServerApp: parse the run config -> build the strategy from the registry -> run -> write results."""

from __future__ import annotations

import time
from logging import ERROR, INFO

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedapp.config import ConfigError, parse_run_config
from fedapp.registry import ALGORITHMS
from fedapp.runner import build_strategy, finish, summary_lines
from fedapp.strategy_base import FederationError
from strategies.base import FederationError as PublicFederationError

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the configured algorithm for num-server-rounds and write results.json + accuracy.png."""
    t0 = time.perf_counter()
    try:
        cfg = parse_run_config(context.run_config)
    except ConfigError as err:
        log(ERROR, "invalid run config: %s", err)
        # An exception (not SystemExit) is what makes Flower mark the run finished:failed.
        raise ConfigError(f"invalid run config: {err}") from None
    engine = "flower-simulation" if type(grid).__name__ == "InMemoryGrid" else "flower-deployment"
    strategy = build_strategy(cfg)
    try:
        if ALGORITHMS[cfg.algorithm].public:
            strategy.start(grid=grid, initial_arrays=strategy.current_arrays(), num_rounds=cfg.num_server_rounds,
                           evaluate_fn=strategy.evaluate_fn)
        else:
            strategy.start(grid=grid, initial_arrays=ArrayRecord([strategy.x.astype(np.float32)]),
                           num_rounds=cfg.num_server_rounds, evaluate_fn=strategy.evaluate_fn)
    except (FederationError, PublicFederationError) as err:
        log(ERROR, "federation mismatch: %s", err)
        raise
    doc, path = finish(cfg, strategy, engine, wall_s=time.perf_counter() - t0)
    for line in summary_lines(doc, path):
        log(INFO, "%s", line)
