"""The record-level DP-SGD core (fedpdm_flower.fedapp.privacy.dpsgd) against independent truth.

* per-record gradients: finite differences of one record's loss, torch autograd on a batch of one, and the
  models' own mean gradient;
* the step by hand: clipping to C, the Poisson rate (a binomial count), the noise std measured empirically, the
  q n denominator (the mean of many steps);
* the accountant: dp-accounting's RdpAccountant (a second implementation of the same RDP analysis) and Opacus's
  RDPAccountant object recompute the ledger's epsilon; the calibration is tight and refuses what no noise meets.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpdm_flower.fedapp.localdata import ArrayData
from fedpdm_flower.fedapp.models.l1_logistic import NonconvexL1Logistic
from fedpdm_flower.fedapp.models.least_squares import LeastSquares
from fedpdm_flower.fedapp.models.multinomial import MultinomialLogistic
from fedpdm_flower.fedapp.privacy.dpsgd import (
    DPSGDLedger,
    DPSGDMechanism,
    DPSGDStep,
    clip_rows,
    clipped_gradient_sum,
    dpsgd_epsilon,
    gaussian_noise,
    noise_multiplier_for,
    noisy_gradient,
    poisson_sample,
    recompute_epsilon,
)
from fedpdm_flower.fedapp.privacy.target import MISSING, PrivacyNotChosen, PrivacyTarget, require_privacy


def _linear_data(rng: np.random.Generator, n: int = 12, m: int = 3, f: int = 5) -> tuple[Any, Any]:
    x = rng.normal(size=(n, f))
    x[:, -1] = 1.0  # the loaders' bias column
    return x, rng.integers(0, m, size=n)


MODELS = [
    ("l1-logistic", lambda: NonconvexL1Logistic(3, 5, beta=0.5)),
    ("multinomial", lambda: MultinomialLogistic(3, 5, l2=0.1)),
    ("multinomial-nobias", lambda: MultinomialLogistic(3, 4, l2=0.0, bias=False)),
]


@pytest.mark.parametrize(("name", "make"), MODELS)
def test_numpy_models_per_record_gradients_are_finite_differences_of_one_records_loss(name: str, make: Any) -> None:
    rng = np.random.default_rng(1)
    model = make()
    feats, labels = _linear_data(rng)
    x = rng.normal(scale=0.5, size=model.dim)
    rows = model.per_sample_grads(x, feats, labels)
    assert rows.shape == (len(labels), model.dim)
    # the mean of the rows plus the data-independent part is the model's own gradient
    np.testing.assert_allclose(rows.mean(axis=0) + model.regularizer_grad(x), model.grad(x, feats, labels),
                               rtol=1e-12, atol=1e-12)
    # record 3's row by central differences of its data term alone (the loss of a batch of one, minus the regulariser)
    j, h = 3, 1e-6

    def record_loss(v: Any) -> float:
        reg = model.regulariser(v) if name == "l1-logistic" else 0.5 * model.l2 * float(v @ v)
        return float(model.loss(v, feats[j:j + 1], labels[j:j + 1])) - reg

    fd = np.array([(record_loss(x + h * e) - record_loss(x - h * e)) / (2 * h) for e in np.eye(model.dim)])
    np.testing.assert_allclose(rows[j], fd, rtol=1e-6, atol=1e-8)
    # the closed-form clipped sum is the clipped rows summed, at a clip that bites some rows and not others
    clip = float(np.median(np.linalg.norm(rows, axis=1)))
    np.testing.assert_allclose(model.clipped_grad_sum(x, feats, labels, clip), clip_rows(rows, clip).sum(axis=0),
                               rtol=1e-12, atol=1e-14)


def test_least_squares_per_record_gradients_and_clipped_sum() -> None:
    rng = np.random.default_rng(2)
    a, c = rng.normal(size=(9, 4)), rng.normal(size=9)
    model, x = LeastSquares(4), rng.normal(size=4)
    rows = model.per_sample_grads(x, a, c)
    np.testing.assert_allclose(rows.mean(axis=0), model.grad(x, a, c), rtol=1e-12)
    np.testing.assert_allclose(rows[2], (a[2] @ x - c[2]) * a[2], rtol=1e-12)
    np.testing.assert_allclose(model.clipped_grad_sum(x, a, c, 0.5), clip_rows(rows, 0.5).sum(axis=0), rtol=1e-12)


def test_torch_per_sample_gradients_are_autograd_on_a_batch_of_one_and_the_clipped_sum_matches() -> None:
    import torch
    from torch import nn

    from fedpdm_flower.fedapp.models.torch_model import TorchModel

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 6 * 6, 4))
    model = TorchModel(net, nn.CrossEntropyLoss())
    xs, ys = torch.randn(7, 1, 8, 8), torch.randint(0, 4, (7,))
    x = model.get_flat()
    rows = model.per_sample_grads(x, xs, ys)
    for j in (0, 4):
        np.testing.assert_allclose(rows[j], model.grad(x, xs[j:j + 1], ys[j:j + 1]), rtol=1e-4, atol=1e-6)
    clip = float(np.median(np.linalg.norm(rows, axis=1)))
    np.testing.assert_allclose(model.clipped_grad_sum(x, xs, ys, clip), clip_rows(rows, clip).sum(axis=0),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(model.clipped_grad_sum(x, xs[:0], ys[:0], clip), np.zeros(model.dim))


def test_clipping_bounds_every_row_at_c_and_leaves_short_rows_alone() -> None:
    g = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    out = clip_rows(g, 1.0)
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]])
    assert clipped_gradient_sum(LeastSquares(2), np.zeros(2), np.eye(2) * 10.0, np.array([1.0, 1.0]), 1.0) \
        == pytest.approx([-1.0, -1.0])  # each record's gradient -10 e_j clipped to norm 1


def test_poisson_sampling_draws_each_record_with_probability_q() -> None:
    rng, n, q, draws = np.random.default_rng(3), 500, 0.04, 400
    counts = np.zeros(n)
    sizes = []
    for _ in range(draws):
        idx = poisson_sample(n, q, rng)
        assert np.all(np.diff(idx) > 0)  # distinct records, ascending
        counts[idx] += 1
        sizes.append(len(idx))
    total, expected = counts.sum(), n * q * draws
    assert abs(total - expected) < 5 * math.sqrt(expected * (1 - q))  # Binomial(n draws, q): within 5 sd
    assert np.var(sizes) == pytest.approx(n * q * (1 - q), rel=0.25)  # a Poisson sample's size is Binomial(n, q)
    assert len(poisson_sample(10, 1.0, rng)) == 10
    for bad in (0.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="sample_rate"):
            poisson_sample(10, bad, rng)


@pytest.mark.parametrize("secure", [False, True])
def test_the_noise_has_std_z_c_over_q_n(secure: bool) -> None:
    mech = DPSGDMechanism(noise_multiplier=0.8, sample_rate=0.05, clip_norm=2.0, steps=1)
    rng, n, d = np.random.default_rng(4), 400, 200_000
    g = noisy_gradient(np.zeros(d), mech, n, rng, secure=secure)
    want = 0.8 * 2.0 / (0.05 * 400)
    assert np.std(g) == pytest.approx(want, rel=0.01)  # 200k draws: the sample sd is within 0.3 % (1 sd)
    assert abs(np.mean(g)) < 5 * want / math.sqrt(d)
    np.testing.assert_array_equal(gaussian_noise(5, 0.0, rng), np.zeros(5))


def test_a_dpsgd_step_is_unbiased_for_the_mean_clipped_gradient_and_empty_samples_still_step() -> None:
    rng = np.random.default_rng(5)
    a, c = rng.normal(size=(50, 3)) * 3.0, rng.normal(size=50)
    model, x = LeastSquares(3), np.zeros(3)
    mech = DPSGDMechanism(noise_multiplier=0.5, sample_rate=0.2, clip_norm=1.0, steps=4000)
    step = DPSGDStep(model, ArrayData(a, c), mech, rng)
    mean = np.mean([step(x) for _ in range(4000)], axis=0)
    truth = clip_rows(model.per_sample_grads(x, a, c), 1.0).sum(axis=0) / 50  # E[sum over B] / (q n) = mean clipped
    sd = math.sqrt((0.5**2 + 50 * 0.2) / (0.2 * 50) ** 2 / 4000)  # noise plus sampling, per coordinate (upper bound)
    assert np.max(np.abs(mean - truth)) < 5 * sd
    assert step.taken == 4000 and step.sampled == pytest.approx(0.2 * 50 * 4000, rel=0.05)
    with pytest.raises(RuntimeError, match="charged for 4000"):
        step(x)
    tiny = DPSGDStep(model, ArrayData(a[:1], c[:1]), DPSGDMechanism(1.0, 1e-9, 1.0, 3), rng)
    assert all(np.all(np.isfinite(tiny(x))) for _ in range(3)) and tiny.sampled == 0  # noise-only steps


def test_the_ledger_epsilon_is_recomputed_by_dp_accountings_rdp_and_opacus_rdp_accountant(tmp_path: Path) -> None:
    from opacus.accountants import RDPAccountant

    ledger = DPSGDLedger()
    mechs = [DPSGDMechanism(0.9, 0.01, 1.0, 40)] * 10 + [DPSGDMechanism(1.3, 0.05, 1.0, 15)] * 3
    for m in mechs:
        ledger.record(m)
    assert ledger.history == [(0.9, 0.01, 400), (1.3, 0.05, 45)] and ledger.steps == 445
    ours = ledger.epsilon(1e-5)
    second = recompute_epsilon(ledger.history, 1e-5)  # dp-accounting, Opacus's orders: like for like
    assert ours >= 0.98 * second and ours == pytest.approx(second, rel=0.02)
    assert ledger.recompute(1e-5) == second
    opacus = RDPAccountant()
    opacus.history = [(z, q, s) for z, q, s in ledger.history]
    assert ours == pytest.approx(opacus.get_epsilon(1e-5), rel=1e-9)
    # the record and the file carry it exactly
    again = DPSGDLedger.from_record(ledger.to_record())
    assert again.epsilon(1e-5) == ours and again.history == ledger.history
    ledger.save(tmp_path / "l.json")
    assert DPSGDLedger.load(tmp_path / "l.json").epsilon(1e-5) == ours
    assert DPSGDLedger.load(tmp_path / "missing.json").epsilon(1e-5) == 0.0
    nxt = DPSGDMechanism(0.9, 0.01, 1.0, 40)
    projected = ledger.epsilon_after(nxt, 1e-5)
    ledger.record(nxt)
    assert projected == ledger.epsilon(1e-5) > ours
    with pytest.raises(ValueError, match="ledger record"):
        DPSGDLedger.from_record({"rdp": [1.0], "history": [1.0, 2.0]})


def test_calibration_is_tight_and_matches_opacus() -> None:
    from opacus.accountants.utils import get_noise_multiplier

    z = noise_multiplier_for(8.0, 1e-5, 0.01, 800)
    assert dpsgd_epsilon(z, 0.01, 800, 1e-5) <= 8.0
    assert dpsgd_epsilon(z * (1 - 1e-3), 0.01, 800, 1e-5) > 8.0  # no less noise would do
    theirs = get_noise_multiplier(target_epsilon=8.0, target_delta=1e-5, sample_rate=0.01, steps=800,
                                  accountant="rdp", epsilon_tolerance=0.001)
    assert z == pytest.approx(theirs, rel=0.01)
    assert recompute_epsilon([(z, 0.01, 800)], 1e-5) == pytest.approx(8.0, rel=0.02)


def test_targets_no_noise_can_meet_and_bad_knobs_are_refused_by_name() -> None:
    # RDP at Opacus's orders cannot certify epsilon 0.05 at delta 1e-5 whatever the noise (its floor is about 0.2)
    with pytest.raises(ValueError, match=r"epsilon = 0.05 .* cannot be met by any noise multiplier"):
        noise_multiplier_for(0.05, 1e-5, 1.0, 1000)
    with pytest.raises(ValueError, match=r"PrivacyTarget epsilon: epsilon = 0\.05"):
        PrivacyTarget(epsilon=0.05, sample_rate=1.0).mechanism(10, 100)
    for kw, knob in [({"epsilon": 0.0}, "epsilon"), ({"epsilon": 8.0, "delta": 1.0}, "delta"),
                     ({"epsilon": 8.0, "clip_norm": 0.0}, "clip_norm"), ({"epsilon": 8.0, "clip_norm": -1.0}, "clip_norm"),
                     ({"epsilon": 8.0, "sample_rate": 0.0}, "sample_rate"),
                     ({"epsilon": 8.0, "sample_rate": 1.01}, "sample_rate"), ({"epsilon": 8.0, "horizon": 0}, "horizon")]:
        with pytest.raises(ValueError, match=f"PrivacyTarget {knob}"):
            PrivacyTarget(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"needs the Poisson sample rate .* sample_rate=q"):
        PrivacyTarget(epsilon=8.0).mechanism(10, 10, owner="BSDPFedPDM")
    for bad, key in [({"dp-sample-rate": 0.0}, "dp-sample-rate"), ({"clip": 0.0}, "clip"),
                     ({"dp-noise-multiplier": -1.0}, "dp-noise-multiplier"), ({"dp-steps": 0}, "dp-steps")]:
        cfg = {**DPSGDMechanism(1.0, 0.1, 1.0, 5).message_config(), **bad}
        with pytest.raises(ValueError, match=f"message config '{key}'"):
            DPSGDMechanism.from_config(cfg)


def test_a_target_calibrates_for_every_step_of_the_horizon_and_dp_named_strategies_need_one() -> None:
    t = PrivacyTarget(epsilon=3.0, sample_rate=0.02, clip_norm=0.5)
    m = t.mechanism(steps_per_participation=25, participations=12)
    assert (m.sample_rate, m.clip_norm, m.steps) == (0.02, 0.5, 25)
    assert dpsgd_epsilon(m.noise_multiplier, 0.02, 25 * 12, 1e-5) == pytest.approx(3.0, rel=1e-3)
    assert PrivacyTarget(epsilon=3.0, sample_rate=0.02, horizon=6).mechanism(25, 12).noise_multiplier \
        < m.noise_multiplier  # calibrated for 6 participations, not 12
    assert DPSGDMechanism.from_config(t.message_config(m)) == m
    assert PrivacyTarget(epsilon=1.0).delta == 1e-5
    with pytest.raises(PrivacyNotChosen, match=r"MyDP is a differentially private strategy and needs privacy=: "
                       r"pass privacy=PrivacyTarget"):
        require_privacy(MISSING, "MyDP")
    assert issubclass(PrivacyNotChosen, TypeError)  # a missing required argument, as Python reports one
    assert require_privacy(None, "MyDP") is None and require_privacy(t, "MyDP") is t
