"""The decentralized rows of the dp-seeds table: DP-RECAL, DP-NIDS, DP-PG-EXTRA, DP-RW-ADMM and DPQ-DSGD on MNIST.

The cells are :func:`simulations.dp_seeds_decentralized.run_cell` (tasks, hyperparameters and which of them are
ours: that module's docstring), converted to the table's :class:`simulations.dp_seeds.Cell`. The two reference
columns (DeviceDPSGD and CentralDP under Flower's FedAvg) are not run for these rows: the RECAL family's model is the
paper's linear least squares, which Flower's FedAvg reference cells (a zoo network) do not train, and DPQ-DSGD's
task is the quick start's network on other nodes; their cells stay empty ("-").
"""

from __future__ import annotations

import math
from collections.abc import Callable

from simulations.dp_seeds import Cell, Row
from simulations.dp_seeds_decentralized import ROWS as TASKS
from simulations.dp_seeds_decentralized import run_cell

#: the table's columns -> this module's settings
COLUMN_OF = {"no noise": "none", "paper's calibration": "paper", "eps 1": "eps1", "eps 3": "eps3", "eps 8": "eps8"}
NAMES = {"dp-recal": "DP-RECAL (seed 001)", "dp-nids": "DP-NIDS (seed 001's baseline)",
         "dp-pg-extra": "DP-PG-EXTRA (seed 001's baseline)", "dp-rw-admm": "DP-RW-ADMM (seed 001's baseline)",
         "dpq-dsgd": "DPQ-DSGD (seed 004)"}
TASK_TEXT = {
    "dp-recal": "MNIST elastic net (nu = 1e-3), 8 agents on a ring, 4,800 baton hops",
    "dp-nids": "MNIST elastic net (nu = 1e-3), 8 agents on a ring, 600 rounds",
    "dp-pg-extra": "MNIST elastic net (nu = 1e-3), 8 agents on a ring, 600 rounds",
    "dp-rw-admm": "MNIST elastic net (nu = 1e-3), 8 agents on a ring, 4,800 token hops",
    "dpq-dsgd": "MNIST, tiny-cnn, 5 nodes on a ring, 300 iterations",
}


def _cell(row: str, setting: str) -> Callable[[], Cell]:
    def run() -> Cell:
        out = run_cell(row, setting)
        note = f"{out['rounds']} rounds, {out['wall_s']:.0f} s"
        if row == "dpq-dsgd" and out.get("node_mean_accuracy") is not None:
            note += f"; node-average model, mean of the nodes' own {out['node_mean_accuracy']:.3f}"
        if setting == "paper":
            rigorous = "inf (x in the clear, spec A1)" if row != "dpq-dsgd" else "inf (no clipping, spec 9.11)"
            return Cell(accuracy=out["accuracy"], epsilon=math.inf, accountant=f"rigorous: {rigorous}",
                        paper_epsilon=out.get("epsilon_paper"),
                        mbytes=(out["uplink_bytes"] + out["downlink_bytes"]) / 1e6, wall_s=out["total_s"],
                        note=note + f"; rigorous epsilon {rigorous}")
        eps = out.get("epsilon_rigorous")
        return Cell(accuracy=out["accuracy"], epsilon=None if setting == "none" else eps,
                    accountant="" if setting == "none" else "rdp, subsampled Gaussian (device ledgers)",
                    mbytes=(out["uplink_bytes"] + out["downlink_bytes"]) / 1e6, wall_s=out["total_s"], note=note)

    return run


ROWS = [Row(name=NAMES[r], task=TASK_TEXT[r], cells={col: _cell(r, s) for col, s in COLUMN_OF.items()})
        for r in TASKS]
