"""The quick start's preset and the dp-seeds table's registry (no training here: `make run` and `bench --suite
dp-seeds` are benchmarks)."""

from __future__ import annotations

import pytest

from fedpdm_flower.fedapp.apps.common import calibration
from fedpdm_flower.fedapp.config import parse_run_config
from fedpdm_flower.fedapp.privacy import PrivacyTarget
from fedpdm_flower.fedapp.privacy.dpsgd import dpsgd_epsilon, recompute_epsilon
from simulations.dp_seeds import COLUMNS, Cell, rows, table
from simulations.quickstart import QUICKSTART, privacy_report


def test_the_quick_start_asks_for_record_level_dpsgd_at_epsilon_8_and_its_twin_for_none() -> None:
    cfg = parse_run_config(QUICKSTART)
    target = calibration(cfg)
    assert isinstance(target, PrivacyTarget) and (target.epsilon, target.delta) == (8.0, 1e-5)
    assert target.sample_rate == pytest.approx(cfg.batch_size / cfg.samples_per_client)
    mech = target.mechanism(cfg.max_local_steps, cfg.num_server_rounds)
    steps = cfg.max_local_steps * cfg.num_server_rounds
    assert dpsgd_epsilon(mech.noise_multiplier, mech.sample_rate, steps, 1e-5) <= 8.0
    assert recompute_epsilon([(mech.noise_multiplier, mech.sample_rate, steps)], 1e-5) == pytest.approx(8.0, rel=0.02)
    assert calibration(parse_run_config({**QUICKSTART, "dp": False})) is None


def test_the_privacy_report_names_unit_adversary_accountant_and_each_devices_recomputed_epsilon() -> None:
    z, q, steps = 0.8, 0.04, 180
    eps = dpsgd_epsilon(z, q, steps, 1e-5)
    doc = {"summary": {"privacy_per_device": {
        str(i): {"eps_dpsgd": eps, "dp_noise_multiplier": z, "dp_sample_rate": q, "dp_steps": float(steps),
                 "dp_mechanisms": 1.0} for i in range(3)}}}
    lines = privacy_report(doc, 1e-5)
    text = "\n".join(lines)
    assert "unit:" in text and "one record" in text and "server" in text and "Renyi DP" in text
    assert sum(line.strip().startswith(("0 ", "1 ", "2 ")) for line in lines) == 3
    theirs = recompute_epsilon([(z, q, steps)], 1e-5)  # dp-accounting's RdpAccountant, a second implementation
    assert 0.98 <= eps / theirs <= 1.02  # ours no more than 2 % below the recomputation (and not far above it)
    assert f"{eps:.4f}" in text and f"{theirs:.4f}" in text and f"{eps / theirs:.4f}" in text


def test_the_table_has_one_registered_row_per_family_with_every_column() -> None:
    registered = {r.name: r for r in rows()}
    fedpdm = registered["BSDP-FedPDM"]
    assert set(fedpdm.cells) == set(COLUMNS)
    md = table({fedpdm.name: {"no noise": Cell(accuracy=0.93), "eps 8": Cell(accuracy=0.90, epsilon=8.0, mbytes=12.5)}},
               {fedpdm.name: fedpdm.task})
    assert "0.900 (-3.0 pts), eps 8" in md and "| 12.5 |" in md
