"""The decentralized rows of ``bench --suite dp-seeds`` (simulations/dp_rows/decentralized.py) work: the registry
holds them with the table's columns, every cell's run config is accepted by the app's parser, and short runs of the
real cells (MNIST, the real strategies and agents, only fewer hops / rounds) fill each column with what it
promises -- no epsilon without noise, an infinite rigorous epsilon beside the paper's own figure, and at epsilon 8
the worst agent's ledger at (and not past) the target with a model well above chance.
"""

from __future__ import annotations

import math

import pytest

from fedpdm_flower.fedapp.config import parse_run_config
from simulations.dp_rows.decentralized import NAMES, make_rows
from simulations.dp_seeds import COLUMNS, rows
from simulations.dp_seeds_decentralized import ROWS as TASKS
from simulations.dp_seeds_decentralized import SETTINGS, run_config

#: a short DP-RECAL run: 48 baton hops on the ring of 8 (z calibrated for this horizon, as in the full row)
SHORT = {"dp-recal": {"num-server-rounds": 48}, "dp-pg-extra": {"num-server-rounds": 4}}


def test_the_registry_holds_every_decentralized_row_with_the_tables_columns() -> None:
    registered = {r.name: r for r in rows()}
    for name in NAMES.values():
        assert name in registered, name
        cols = list(registered[name].cells)
        assert set(cols) <= set(COLUMNS)
        assert cols[:5] == list(COLUMNS[:5])
    # DPQ-DSGD's task is a zoo network, so the Flower FedAvg reference cells run on it; RECAL's linear model is not
    assert list(registered[NAMES["dpq-dsgd"]].cells) == list(COLUMNS)
    assert list(registered[NAMES["dp-recal"]].cells) == list(COLUMNS[:5])


@pytest.mark.parametrize(("row", "settings"), [("dpq-dsgd", SETTINGS), ("dp-recal", SETTINGS),
                                               *((r, ("eps8",)) for r in ("dp-nids", "dp-pg-extra", "dp-rw-admm"))])
def test_every_cell_config_is_accepted_by_the_apps_parser(row: str, settings: tuple[str, ...]) -> None:
    """The RECAL baselines' configs differ from DP-RECAL's only by the algorithm and its horizon: one of each."""
    for setting in settings:
        cfg = parse_run_config(run_config(row, setting))
        assert cfg.num_server_rounds == TASKS[row]["num-server-rounds"]
        assert cfg.algorithm == row
        if setting.startswith("eps"):
            assert cfg.epsilon_total == float(setting[3:]) and cfg.dp_calibration == "dpsgd"
        if setting == "none":
            assert cfg.dp is False


@pytest.mark.xdist_group("dp_seeds_decentralized")  # one MNIST load for the two short-run tests
def test_short_recal_cells_fill_their_columns() -> None:
    """The adapter turns each real run into the table's cell: the columns' promises, not the full-length numbers
    (epsilon 1 and 3 differ from 8 only by the target)."""
    recal = next(r for r in make_rows(SHORT, references=False) if r.name == NAMES["dp-recal"])
    cells = {col: recal.cells[col]() for col in ("no noise", "paper's calibration", "eps 8")}
    plain, paper, eps8 = cells["no noise"], cells["paper's calibration"], cells["eps 8"]
    assert plain.epsilon is None and plain.accountant == ""
    assert paper.epsilon == math.inf and paper.paper_epsilon is not None and 0 < paper.paper_epsilon < math.inf
    # the worst agent spends its planned activations, and the run stops before any agent passes them
    assert eps8.epsilon is not None and 7.2 <= eps8.epsilon <= 8.0 * (1 + 1e-9), eps8
    assert "rdp" in eps8.accountant
    for cell in cells.values():
        assert cell.accuracy is not None and 0.0 <= cell.accuracy <= 1.0
        assert cell.mbytes is not None and cell.mbytes > 0
    assert eps8.accuracy is not None and eps8.accuracy > 0.3  # 3x chance after 48 hops at epsilon 8


@pytest.mark.xdist_group("dp_seeds_decentralized")
def test_a_short_synchronous_baseline_cell_spends_its_target() -> None:
    row = next(r for r in make_rows(SHORT, references=False) if r.name == NAMES["dp-pg-extra"])
    cell = row.cells["eps 8"]()
    assert cell.epsilon is not None and 7.2 <= cell.epsilon <= 8.0 * (1 + 1e-9)
    assert cell.accuracy is not None and cell.mbytes is not None and cell.mbytes > 0
