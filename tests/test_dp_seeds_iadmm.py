"""DP-IADMM's rows of ``bench --suite dp-seeds`` (simulations/dp_rows/iadmm.py) run and report what they ran.

The bench's own task (10 agents of 6 000 MNIST images, 50 rounds) takes most of an hour; here the same row builder
runs ObjPM (E = 10) on a small synthetic task (4 agents of 2,000 records, 20 rounds = 200 solves per agent), and each
cell's figures are checked against an independent computation: the paper cell's composed epsilon lies between
dp-accounting's PLD of the same 30 Laplace releases (tighter than any RDP bound) and Mironov's RDP of the Laplace
mechanism (Prop. 6) composed and converted by hand with the classic conversion (looser than dp-accounting's).
"""

from __future__ import annotations

import math

import pytest

from simulations.dp_rows import iadmm as iadmm_rows
from simulations.dp_seeds import COLUMNS, Cell, rows, table

ROUNDS, E, PAPER_EPS, DELTA = 20, 10, iadmm_rows.PAPER_EPSILON, 1e-5
TINY = {**iadmm_rows.TASK, "dataset": "synthetic", "num-clients": 4, "clients-per-round": 4, "samples-per-client": 2000,
        "num-server-rounds": ROUNDS, "eval-every": ROUNDS}


def _mironov_laplace_epsilon(eps: float, count: int, delta: float) -> float:
    """(epsilon, delta) of ``count`` eps-DP Laplace releases: Mironov (2017) Prop. 6 RDP, summed, converted by
    epsilon = min_alpha RDP(alpha) + log(1/delta) / (alpha - 1), on a grid of orders."""
    best = math.inf
    for alpha in [1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16, 20, 32, 48, 64, 128, 256]:
        rdp = math.log(alpha / (2 * alpha - 1) * math.exp((alpha - 1) * eps)
                       + (alpha - 1) / (2 * alpha - 1) * math.exp(-alpha * eps)) / (alpha - 1)
        best = min(best, count * rdp + math.log(1 / delta) / (alpha - 1))
    return best


def test_registry_has_every_dp_iadmm_row_with_every_column() -> None:
    by_name = {r.name: r for r in rows()}
    for name in ("ObjP (DP-IADMM)", "ObjPM (DP-IADMM)", "OutP (DP-IADMM baseline)"):
        assert name in by_name, sorted(by_name)
        assert set(by_name[name].cells) == set(COLUMNS)
    assert "10 agents x 6,000" in by_name["ObjP (DP-IADMM)"].task


@pytest.fixture(scope="module")
def objpm_cells() -> dict[str, Cell]:
    row = iadmm_rows.row("ObjPM (tiny)", "objpm", E, task=TINY)
    return {c: row.cells[c]() for c in ("no noise", "paper's calibration", "eps 8")}


def test_dpsgd_cell_spends_its_target_under_rdp_and_learns(objpm_cells: dict[str, Cell]) -> None:
    cell, plain = objpm_cells["eps 8"], objpm_cells["no noise"]
    assert cell.epsilon is not None and 7.9 < cell.epsilon <= 8.0 + 1e-6
    assert cell.accountant.startswith("rdp, subsampled Gaussian")
    assert cell.mbytes is not None and cell.mbytes > 0
    assert plain.epsilon is None
    assert cell.accuracy is not None and plain.accuracy is not None
    # 4 classes: chance 0.25. The devices' DP-SGD draws are unseeded by design (their own entropy), so the accuracy
    # varies run to run: 30 repeats of this cell measured at least 0.854 (mean 0.93); at 300 records x 3 rounds it spread
    # 0.32-0.84 and failed CI once, which is why the task is this size.
    assert cell.accuracy > 0.5 and plain.accuracy > 0.5


def test_paper_cell_reports_the_composition_of_its_laplace_solves(objpm_cells: dict[str, Cell]) -> None:
    from dp_accounting import dp_event
    from dp_accounting.pld import PLDAccountant

    cell = objpm_cells["paper's calibration"]
    solves = ROUNDS * E
    assert cell.paper_epsilon == PAPER_EPS
    pld = PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_event.LaplaceDpEvent(1.0 / PAPER_EPS), solves)
    lower, upper = pld.get_epsilon(DELTA), min(_mironov_laplace_epsilon(PAPER_EPS, solves, DELTA), solves * PAPER_EPS)
    assert cell.epsilon is not None and lower <= cell.epsilon <= upper + 1e-9
    assert f"basic composition {solves * PAPER_EPS:.3g}" in cell.note


def test_table_renders_the_row_against_its_no_noise_accuracy(objpm_cells: dict[str, Cell]) -> None:
    md = table({"ObjPM (tiny)": objpm_cells}, {"ObjPM (tiny)": "synthetic"})
    line = md.splitlines()[-1]
    assert line.startswith("| ObjPM (tiny) (synthetic) |") and "pts), eps 8" in line and "(paper's figure 0.05)" in line
