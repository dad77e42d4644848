"""The DLG attack demonstration against RECAL / DP-RECAL (simulations/dlg.py; spec 5.8 and 8 item A1).

Real MNIST (offline files), the spec 5.8 protocol with a smaller subset for the non-target agents (300 images each).
Measured with seed 0 (``python -m simulations.dlg``, 1,000 images per agent; this file's subset gives the same
picture): RECAL u-channel gradient cosine 1.0 (rel. error 5e-15), DLG PSNR ~228 dB; DP-RECAL sigma_1 = 0.01:
cosine 0.17, DLG PSNR ~12 dB; eps = 10 calibrated (sigma_1 ~ 35): cosine ~0, PSNR ~4 dB, while the x-channel
recovers y_i to ~2e-13 on ~96% of the coordinates and the image at ~211 dB.

Thresholds: PSNR > 30 dB means an RMS pixel error below 0.032 of the [0, 1] range (~8 grey levels of 255), an image
indistinguishable by eye from the original; exact gradients give > 150 dB (30 random MNIST images, prototype).
The noisy gradients gave 7.7-15.9 dB over the same 30 images at sigma_1 = 0.01, so "< 20 dB" can fail only if DLG
genuinely gets much closer than it does; an all-black guess already scores ~10 dB on MNIST.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedpdm_flower.fedapp.algorithms.recal import prox_nr
from fedpdm_flower.fedapp.privacy import zcdp
from simulations import dlg

pytest.importorskip("scipy.optimize")

PER_AGENT = 300


@pytest.fixture(scope="module")
def setup() -> dlg.DLGSetup:
    try:
        return dlg.build_setup(seed=0, per_agent=PER_AGENT)
    except FileNotFoundError as exc:  # the offline MNIST package is not installed
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def reports(setup: dlg.DLGSetup) -> dict[str, dlg.CaseReport]:
    return {c.name: dlg.attack_case(setup, c) for c in dlg.default_cases(setup)}


# ------------------------------------------------------------------------------------------------- protocol
def test_setup_follows_spec_5_8(setup: dlg.DLGSetup) -> None:
    assert setup.n == 8 and setup.graph.num_edges == 8 and all(d == 2 for d in setup.graph.degrees)
    assert setup.problem.nu1 == 0.5 and setup.problem.nu2 == 0.5
    tgt = setup.problem.agents[setup.target]
    assert tgt.m == 1 and np.array_equal(tgt.features[0], setup.image)  # batch size 1: one real image
    assert setup.image.min() >= 0 and setup.image.max() <= 1 and setup.image.shape == (784,)
    assert sorted(setup.label.tolist()) == [-1.0] * 9 + [1.0] and setup.label[setup.digit] == 1.0  # onehot_pm1
    assert all(a.m == PER_AGENT for i, a in enumerate(setup.problem.agents) if i != setup.target)
    assert setup.x1.shape == (784, 10) and abs(float(setup.x1.std()) - 1.0) < 0.05  # seeded N(0, I), A9
    np.testing.assert_allclose(setup.alphas, 1.0 / (setup.problem.lipschitz + 1.0))
    # batch of one: L_target = ||B||^2 and the gradient is a scaled copy of the image in every column
    assert tgt.lipschitz == pytest.approx(float(setup.image @ setup.image), rel=1e-12)
    g = tgt.grad(setup.x1)
    np.testing.assert_allclose(g, dlg.model_gradient(setup.image, setup.x1, setup.label), rtol=1e-12, atol=1e-12)
    assert np.linalg.matrix_rank(g) == 1


def test_calibration_is_spec_4_5(setup: dlg.DLGSetup) -> None:
    sigma1, xi = dlg.calibrated_sigma1(setup, 10.0, 1e-3, 1.01)
    assert xi == 690  # ceil(1.15 * 4800 / 8)
    delta_sens = 4.0 * float(setup.alphas.max()) * setup.beta * float(setup.problem.lipschitz.max())
    expected = delta_sens * np.sqrt(zcdp.geom_sum(1.01, 690) / (2.0 * zcdp.rho_from_eps(10.0, 1e-3)))
    assert sigma1 == pytest.approx(expected, rel=1e-12)
    assert zcdp.epsilon_dp_recal(float(setup.alphas.max()), setup.beta, float(setup.problem.lipschitz.max()),
                                 sigma1, 1.01, 690, 1e-3) == pytest.approx(10.0, rel=1e-9)
    assert sigma1 > 1000 * dlg.SMALL_SIGMA  # the paper budget's noise dwarfs the spec's sigma = 0.01 example


def test_transcript_view_matches_the_ground_truth(setup: dlg.DLGSetup) -> None:
    run = dlg.run_relay(setup, sigma1=0.5, R=1.0, target_activations=3)
    acts = dlg.observed_activations(run.messages, setup.target, setup.x1)
    assert [a.k for a in acts] == [t.k for t in run.truth] and len(acts) == 3
    assert run.messages[-1].sender == setup.target  # stops right after the last target activation
    for m, nxt in zip(run.messages, run.messages[1:], strict=False):
        assert setup.graph.has_edge(m.sender, m.receiver) and nxt.sender == m.receiver  # baton hops along edges
    # private mode: u~_out - u~_in = dlambda - eps exactly
    for a, t in zip(acts, run.truth, strict=True):
        np.testing.assert_allclose(a.ut_out - a.ut_in, setup.beta * (a.x_out - t.y_next) - t.noise, atol=1e-9)


def test_dlg_objective_gradient_is_analytic(setup: dlg.DLGSetup) -> None:
    rng = np.random.default_rng(3)
    g_hat = rng.standard_normal((784, 10))
    mask = rng.random((784, 10)) < 0.7
    b = rng.uniform(0, 1, 784)
    for m in (None, mask):
        _, grad = dlg.dlg_objective(b, g_hat, setup.x1, setup.label, m)
        for p in rng.choice(784, 12, replace=False):
            e = np.zeros(784)
            e[p] = 1e-6
            fd = (dlg.dlg_objective(b + e, g_hat, setup.x1, setup.label, m)[0]
                  - dlg.dlg_objective(b - e, g_hat, setup.x1, setup.label, m)[0]) / 2e-6
            assert grad[p] == pytest.approx(fd, rel=1e-5, abs=1e-9)
    # the true image is a zero of the objective for the exact gradient
    val, grad = dlg.dlg_objective(setup.image, dlg.model_gradient(setup.image, setup.x1, setup.label), setup.x1,
                                  setup.label)
    assert val < 1e-28 and float(np.abs(grad).max()) < 1e-12


def test_invert_prox_is_exact_on_its_mask() -> None:
    rng = np.random.default_rng(0)
    v = 6.0 * rng.standard_normal((784, 10))
    for nu1, nu2 in ((0.5, 0.5), (0.0, 0.5), (0.5, 0.0)):
        x = prox_nr(v, 8, nu1, nu2)
        v_hat, mask = dlg.invert_prox(x, 8, nu1, nu2)
        assert mask.any()
        np.testing.assert_allclose(v_hat[mask], v[mask], rtol=1e-13, atol=1e-12)
        if nu1 > 0:
            assert not mask[np.abs(v) <= 8 * nu1].any()  # thresholded entries are not claimed


# ------------------------------------------------------------------------------------------------- RECAL: leaks
def test_recal_u_channel_gradient_is_exact(reports: dict[str, dlg.CaseReport]) -> None:
    u = reports["recal"].u.metrics
    assert len(u["gradient_cosine"]) == 3
    assert min(u["gradient_cosine"]) > 0.999999  # spec 9 item 27
    assert max(u["gradient_rel_error"]) < 1e-9  # measured 5e-15, 6e-13, 3e-11 (error grows by ~alpha^-1 per step)


def test_recal_dlg_recovers_the_image(reports: dict[str, dlg.CaseReport], setup: dlg.DLGSetup) -> None:
    rep = reports["recal"].u
    m = rep.metrics["dlg"]
    assert m["psnr_db"] > 30.0 and m["mse"] < 1e-6 and m["image_cosine"] > 0.999  # measured ~228 dB
    assert rep.metrics["closed_form"]["psnr_db"] > 30.0  # B ∝ g^ rescaled is exact too for a clean gradient
    assert rep.dlg is not None
    # the snapshots are the figure's columns: the initial dummy is noise, the final one the image
    assert dlg.image_metrics(rep.dlg.initial, setup.image)["psnr_db"] < 10.0
    assert rep.dlg.iterations <= dlg.DLG_ITERS


# ------------------------------------------------------------------------------------------------- DP: u-channel
@pytest.mark.parametrize("case", ["dp_sigma0.01", "dp_eps10"])
def test_dp_noise_defeats_the_u_channel(reports: dict[str, dlg.CaseReport], case: str) -> None:
    u = reports[case].u.metrics
    assert u["gradient_cosine"][0] < 0.4  # spec 5.8 step 3: <= 0.42 at sigma = 0.01; measured 0.17 and ~0
    assert max(abs(c) for c in u["gradient_cosine"][1:]) < 0.1  # the error compounds at later activations
    assert min(u["gradient_rel_error"]) > 1.0
    recal_psnr = reports["recal"].u.metrics["dlg"]["psnr_db"]
    assert u["dlg"]["psnr_db"] < 20.0 and u["dlg"]["psnr_db"] < recal_psnr - 100.0
    assert u["dlg"]["mse"] > 0.01
    assert u["closed_form"]["psnr_db"] < 20.0
    if case == "dp_eps10":  # the calibrated noise leaves nothing: worse than an all-black guess (~10 dB)
        assert u["gradient_cosine"][0] < 0.05 and u["dlg"]["psnr_db"] < 8.0


# ------------------------------------------------------------------------------------------------- DP: x-channel
def test_x_channel_recovers_y_exactly_under_calibrated_noise(reports: dict[str, dlg.CaseReport]) -> None:
    """Spec 8 A1, a known limitation kept on purpose: the x message is not protected by the noise."""
    x = reports["dp_eps10"].x.metrics
    assert min(x["y_support_fraction"]) > 0.5  # measured 0.91-0.97: the noise pushes v past the l1 threshold
    assert max(x["y_rel_error_on_support"]) < 1e-10  # measured ~2e-13
    assert x["gradient_rel_error_on_support"] < 1e-9 and x["gradient_cosine"] > 0.999999
    assert x["pixel_coverage"] == 1.0
    assert x["dlg"]["psnr_db"] > 30.0 and x["dlg"]["mse"] < 1e-6  # the image, despite eps = 10 on the u-channel


def test_x_channel_with_an_invertible_prox_leaks_at_small_noise(reports: dict[str, dlg.CaseReport]) -> None:
    x = reports["dp_sigma0.01_ridge"].x.metrics  # labelled deviation: nu1 = 0
    assert min(x["y_support_fraction"]) == 1.0
    assert max(x["y_rel_error_on_support"]) < 1e-10
    assert x["dlg"]["psnr_db"] > 30.0
    assert reports["dp_sigma0.01_ridge"].u.metrics["gradient_cosine"][0] < 0.4  # while its u-channel is noisy


def test_x_channel_is_dark_when_the_l1_threshold_zeroes_x(reports: dict[str, dlg.CaseReport]) -> None:
    """With the paper's nu1 = 1/2 (threshold n nu1 = 4) and small u~ noise, x = 0 almost everywhere (measured: all)."""
    for case in ("recal", "dp_sigma0.01"):
        x = reports[case].x.metrics
        assert max(x["y_support_fraction"]) <= 0.01
        if not x["attack_possible"]:
            assert "dlg" not in x and reports[case].x.dlg is None


def test_x_channel_recovery_against_ground_truth(setup: dlg.DLGSetup) -> None:
    """Direct check, independent of the reports: y_i from (x_in, u~_in, x_out) under big noise, both u modes."""
    for mode in ("private", "exact"):
        run = dlg.run_relay(setup, sigma1=5.0, R=1.0, mode=mode, target_activations=3)
        acts = dlg.observed_activations(run.messages, setup.target, setup.x1)
        ys = dlg.x_channel_states(acts, setup.beta, setup.n, 0.5, 0.5)
        for (y, mask), t in zip(ys, run.truth, strict=True):
            assert mask.mean() > 0.3
            assert dlg.relative_error(y, t.y, mask) < 1e-10
        g, mask = dlg.x_channel_gradients(acts, setup.x1, setup.beta, float(setup.alphas[setup.target]), setup.n,
                                          0.5, 0.5)[0]
        assert dlg.relative_error(g, run.truth[0].grad, mask) < 1e-9


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_writes_figure_and_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dlg.main(["--out", str(tmp_path), "--per-agent", "100", "--iters", "40"]) == 0
    png = tmp_path / "dlg_fig5.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((tmp_path / "dlg_metrics.json").read_text())
    assert set(doc["cases"]) == {"recal", "dp_eps10", "dp_sigma0.01", "dp_sigma0.01_ridge"}
    assert doc["setup"]["target_images"] == 1 and doc["setup"]["other_agents_images_each"] == 100
    assert doc["cases"]["recal"]["u_channel"]["gradient_cosine"][0] > 0.999999
    assert doc["cases"]["dp_sigma0.01"]["x_channel"]["attack_possible"] is False
    out = capsys.readouterr().out
    assert "recal" in out and "dp_eps10" in out and "wrote" in out
