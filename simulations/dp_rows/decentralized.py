"""The decentralized rows of the dp-seeds table: DP-RECAL, DP-NIDS, DP-PG-EXTRA, DP-RW-ADMM and DPQ-DSGD on MNIST.

The cells are :func:`simulations.dp_seeds_decentralized.run_cell` (tasks, hyperparameters and which of them are
ours: that module's docstring), converted to the table's :class:`simulations.dp_seeds.Cell`. The two reference
columns (DeviceDPSGD and CentralDP under Flower's FedAvg) run on DPQ-DSGD's task (the zoo's tiny-cnn, 5 nodes of
12,000 IID records) with DPQ-DSGD's own budget: 300 steps per node of expected batch 240 (q = 0.02), DeviceDPSGD with
DPQ-DSGD's DP-SGD step (lr 2.0, clip 1.0) for 6 rounds of one epoch each, CentralDP with the no-noise column's step
(lr 0.2, batch 240) for 6 rounds of 50 local steps, updates clipped to 1.0. For the RECAL family they stay empty
("-"): its model is the paper's linear least squares on an elastic net, which the reference cells (a zoo network
under cross-entropy) do not train, so their accuracy would compare models, not mechanisms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from simulations.dp_seeds import Cell, Row, central_dp_cell, dpsgd_fedavg_cell
from simulations.dp_seeds_decentralized import DPQ_TASK, run_cell
from simulations.dp_seeds_decentralized import ROWS as TASKS

#: the table's columns -> this module's settings
COLUMN_OF = {"no noise": "none", "paper's calibration": "paper", "eps 1": "eps1", "eps 3": "eps3", "eps 8": "eps8"}
NAMES = {"dp-recal": "DP-RECAL", "dp-nids": "DP-NIDS (DP-RECAL's baseline)",
         "dp-pg-extra": "DP-PG-EXTRA (DP-RECAL's baseline)", "dp-rw-admm": "DP-RW-ADMM (DP-RECAL's baseline)",
         "dpq-dsgd": "DPQ-DSGD"}
TASK_TEXT = {
    "dp-recal": "MNIST elastic net (nu = 1e-3), 8 agents on a ring, 1,200 baton hops",
    "dp-nids": "MNIST elastic net (nu = 1e-3), 8 agents on a ring, 150 rounds",
    "dp-pg-extra": "MNIST elastic net (nu = 1e-3), 8 agents on a ring, 150 rounds",
    "dp-rw-admm": "MNIST elastic net (nu = 1e-3), 8 agents on a ring, 1,200 token hops",
    "dpq-dsgd": "MNIST, tiny-cnn, 5 nodes on a ring, 300 iterations",
}


def _cell(row: str, setting: str, overrides: Mapping[str, Any] | None) -> Callable[[], Cell]:
    def run() -> Cell:
        out = run_cell(row, setting, overrides)
        note = f"{out['rounds']} rounds, {out['wall_s']:.0f} s"
        if row == "dpq-dsgd" and out.get("node_mean_accuracy") is not None:
            note += f"; node-average model, mean of the nodes' own {out['node_mean_accuracy']:.3f}"
        if setting == "paper":
            rigorous = ("inf (the baton's x travels in the clear)" if row != "dpq-dsgd"
                        else "inf (no per-sample gradient is clipped)")
            return Cell(accuracy=out["accuracy"], epsilon=math.inf, accountant=f"rigorous: {rigorous}",
                        paper_epsilon=out.get("epsilon_paper"),
                        mbytes=(out["uplink_bytes"] + out["downlink_bytes"]) / 1e6, wall_s=out["total_s"],
                        note=note + f"; rigorous epsilon {rigorous}")
        eps = out.get("epsilon_rigorous")
        return Cell(accuracy=out["accuracy"], epsilon=None if setting == "none" else eps,
                    accountant="" if setting == "none" else "rdp, subsampled Gaussian (device ledgers)",
                    mbytes=(out["uplink_bytes"] + out["downlink_bytes"]) / 1e6, wall_s=out["total_s"], note=note)

    return run


#: DPQ-DSGD's task for the reference cells: 300 steps per node at batch 240 (= q 0.02 of 12,000 records)
DPQ_REFERENCE_TASK: dict[str, object] = {**DPQ_TASK, "batch-size": 240}
DPQ_STEPS = 300


def _references(row: str) -> dict[str, Callable[[], Cell]]:
    if row != "dpq-dsgd":
        return {}
    return {
        "DeviceDPSGD + Flower FedAvg (eps 8)": lambda: dpsgd_fedavg_cell(DPQ_REFERENCE_TASK, epsilon=8.0,
                                                                         steps=DPQ_STEPS, lr=2.0),
        "CentralDP + Flower FedAvg (eps 8)": lambda: central_dp_cell(DPQ_REFERENCE_TASK, epsilon=8.0, rounds=6,
                                                                     local_steps=50, lr=0.2, clip=1.0),
    }


def make_rows(overrides: Mapping[str, Mapping[str, Any]] | None = None, *, references: bool = True) -> list[Row]:
    """The rows; ``overrides`` maps a row to run-config keys replacing its task's (a shorter run for a test),
    ``references=False`` leaves the two Flower FedAvg reference cells out."""
    return [Row(name=NAMES[r], task=TASK_TEXT[r],
                cells={**{col: _cell(r, s, (overrides or {}).get(r)) for col, s in COLUMN_OF.items()},
                       **(_references(r) if references else {})})
            for r in TASKS]


ROWS = make_rows()
