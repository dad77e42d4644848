"""BSDP-FedPDM's row of the dp-seeds table, on the quick start's task (simulations/quickstart.py).

Columns: no noise (``dp = false``: plain mini-batch SGD in (8a), same batch, steps and rounds); the paper's own
mechanism (noise on the upload, calibrated by (32)/(36) for a total of 8 at delta 1e-5, clip G = 1 per mini-batch)
with the exact epsilon of what it released (GDP of the device ledgers, no amplification); record-level DP-SGD at
epsilon 1, 3 and 8; DeviceDPSGD under Flower's FedAvg with the same DP-SGD steps per device; CentralDP around
Flower's FedAvg (client level, trusted server) with the same rounds and local steps.
"""

from __future__ import annotations

from typing import Any

from simulations.dp_seeds import Cell, Row, central_dp_cell, dpsgd_fedavg_cell, run_cell
from simulations.quickstart import QUICKSTART

TASK: dict[str, Any] = dict(QUICKSTART)
STEPS = int(TASK["num-server-rounds"]) * int(TASK["max-local-steps"])  # DP-SGD steps per device over the run


def _at(**keys: Any) -> Any:
    return lambda: run_cell({**TASK, **keys})


def _paper() -> Cell:
    cell = run_cell({**TASK, "dp-calibration": "eq36", "epsilon-total": 8.0})
    cell.note = "the paper's (32)/(36) at a total of 8; epsilon = the exact GDP of the noise it added"
    return cell


ROWS = [Row(
    name="BSDP-FedPDM",
    task=f"MNIST, {TASK['num-clients']} devices x {TASK['samples-per-client']} records, "
         f"{TASK['labels-per-client']} labels each, tiny-cnn, {TASK['num-server-rounds']} rounds",
    cells={
        "no noise": _at(dp=False),
        "paper's calibration": _paper,
        "eps 1": _at(**{"epsilon-total": 1.0}),
        "eps 3": _at(**{"epsilon-total": 3.0}),
        "eps 8": _at(**{"epsilon-total": 8.0}),
        "DeviceDPSGD + Flower FedAvg (eps 8)": lambda: dpsgd_fedavg_cell(TASK, epsilon=8.0, steps=STEPS,
                                                                         lr=float(TASK["eta0"])),
        "CentralDP + Flower FedAvg (eps 8)": lambda: central_dp_cell(
            TASK, epsilon=8.0, rounds=int(TASK["num-server-rounds"]), local_steps=int(TASK["max-local-steps"]),
            lr=float(TASK["eta0"]), clip=1.0),
    },
)]
