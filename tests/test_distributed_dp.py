"""Secure aggregation with distributed Skellam noise (issue 14's remedy): the math against independent truth, and
DistributedDP + secure_buffers_mod(distributed_dp=...) on the template-shaped user app of tests/userapp.py.

Independent truths: the exact Renyi divergence of two shifted 1-D Skellam laws summed from scipy's PMF (the bound
must lie above it, and approach the Gaussian's alpha D^2 / (2 sigma^2) with sigma^2 = 2 lam); dp-accounting's
RDP-to-(epsilon, delta) conversion; the noise shares recorded on the devices (the decoded buffer sum must equal
the sum of the encoded updates plus the sum of the shares, exactly); the noise's empirical variance against the
configured one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp.strategy import FedAvg
from scipy.special import logsumexp
from scipy.stats import skellam as sk
from userapp import D, initial, loss, user_app

from fedpdm_flower.clients.distributed_dp import DeviceSkellam
from fedpdm_flower.clients.mods import secure_buffers_mod
from fedpdm_flower.fedapp import secagg
from fedpdm_flower.fedapp.privacy import skellam
from fedpdm_flower.fedapp.privacy.protocol import SkellamAccountant, SkellamPrivacyEvent, no_amplification
from fedpdm_flower.strategies.distributed_dp import DistributedDP
from simulations.inprocess import LocalGrid

N = 8
IDENTITIES = [secagg.NodeIdentity.generate() for _ in range(N)]
TRUST = secagg.TrustStore({i: IDENTITIES[i].public_bytes() for i in range(N)})


def exact_renyi(alpha: int, lam: float, shift: int) -> tuple[float, float]:
    """D_alpha(Sk(lam) + shift || Sk(lam)) by summing the PMF, and the probability mass the sum covered."""
    sd = math.sqrt(2 * lam)
    k = np.arange(int(-40 * sd - 100 - shift), int(40 * sd + 100 + shift))
    lp, lq = sk.logpmf(k, lam, lam), sk.logpmf(k - shift, lam, lam)
    ok = np.isfinite(lp) & np.isfinite(lq)  # beyond ~1e-308 both PMFs underflow; the mass covered is checked
    return float(logsumexp(alpha * lq[ok] + (1 - alpha) * lp[ok])) / (alpha - 1), float(np.exp(lp[ok]).sum())


@pytest.mark.parametrize("lam", [0.5, 2.0, 10.0, 100.0, 2500.0])
@pytest.mark.parametrize("shift", [1, 3, 10])
def test_the_skellam_bound_lies_above_the_exact_renyi_divergence(lam: float, shift: int) -> None:
    for alpha in (2, 8, 32):
        exact, mass = exact_renyi(alpha, lam, shift)
        assert mass > 1 - 1e-12
        bound = float(skellam.skellam_rdp(2 * lam, shift, shift, [alpha])[0])  # variance 2 lam, D1 = D2 = shift
        assert bound >= exact * (1 - 1e-9), (alpha, exact, bound)
        gaussian = alpha * shift**2 / (2 * 2 * lam)
        assert bound >= gaussian  # the Gaussian term, plus the discretization surcharge
        if lam >= 100 and alpha * shift <= 32:  # large lam: bound, exact and Gaussian meet
            assert bound <= exact * 1.03 and bound <= gaussian * 1.03, (alpha, exact, bound, gaussian)


def test_the_bound_is_tight_enough_to_be_useful_and_a_wrong_parametrisation_would_fail() -> None:
    # a sampler that drew Poisson(lam / 2) (variance lam) while the accountant assumed variance 2 lam would leak
    # more than the bound claims: the comparison above can fail
    exact_half, _ = exact_renyi(8, 50.0, 3)
    assert float(skellam.skellam_rdp(200.0, 3, 3, [8])[0]) < exact_half
    exact, _ = exact_renyi(8, 100.0, 3)
    assert float(skellam.skellam_rdp(200.0, 3, 3, [8])[0]) <= 1.01 * exact


def test_epsilon_conversion_equals_dp_accountings_and_calibration_meets_the_target() -> None:
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    rdp = 7 * skellam.skellam_rdp(1e6, 3e3, 1e3)
    ours = skellam.epsilon_of_rdp(rdp, 1e-5)
    theirs, _ = compute_epsilon(np.asarray(skellam.ORDERS, dtype=float), rdp, 1e-5)
    assert ours == pytest.approx(theirs, rel=1e-9)
    d2 = 1e6
    for eps in (1.0, 3.0, 8.0):
        z = skellam.noise_multiplier_for(eps, 1e-5, 5, skellam.l1_bound(d2, 10_000), d2)
        assert skellam.skellam_epsilon((z * d2) ** 2, skellam.l1_bound(d2, 10_000), d2, 5, 1e-5) <= eps
        assert skellam.skellam_epsilon((0.99 * z * d2) ** 2, skellam.l1_bound(d2, 10_000), d2, 5, 1e-5) > eps
        # at a large scale Skellam costs what the Gaussian costs under RDP: dp-accounting's RDP of the Gaussian
        from dp_accounting import dp_event
        from dp_accounting.rdp import RdpAccountant

        acc = RdpAccountant(list(map(float, skellam.ORDERS)))
        acc.compose(dp_event.GaussianDpEvent(z), 5)
        assert acc.get_epsilon(1e-5) == pytest.approx(eps, rel=0.01)


def test_the_accountant_follows_flowers_protocol() -> None:
    from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

    acc = SkellamAccountant(no_amplification(1e-5, 1, max_epsilon=5.0))
    event = SkellamPrivacyEvent.of(4e6, 3e3 * 100, 3e3)
    acc.compose(event, 3)
    want = skellam.skellam_epsilon(4e6, 3e3 * 100, 3e3, 3, 1e-5)
    assert acc.get_privacy_spent().epsilon == pytest.approx(want, rel=1e-12)
    assert acc.get_privacy_spent().num_releases == 3
    assert acc.get_delta(acc.get_epsilon(1e-5)) <= 1e-5 * 1.0001
    restored = SkellamAccountant(no_amplification(1e-5, 1, max_epsilon=5.0))
    restored.load_state_dict(acc.state_dict())
    assert restored.get_epsilon(1e-5) == acc.get_epsilon(1e-5)
    with pytest.raises(TypeError, match="SkellamPrivacyEvent"):
        acc.compose(GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=1, population_size=1))
    assert acc.would_exceed(event, count=50) and not acc.would_exceed(event, max_epsilon=1e9)


def test_conditional_rounding_enforces_the_l2_bound() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=5000)
    x *= 40.0 / np.linalg.norm(x)
    bound = skellam.rounded_l2_bound(40.0, 5000)
    assert bound < 40.0 + math.sqrt(5000)  # the conditional bound is the tighter one here
    for _ in range(20):
        r = skellam.conditional_round(x, bound, rng)
        assert np.linalg.norm(r) <= bound and np.max(np.abs(r - x)) < 1


# ------------------------------------------------------------------------------------------------ the protocol
def ddp_app(policy: DeviceSkellam | None = None, **kw: Any) -> Any:
    mod = secure_buffers_mod(identity=lambda ctx: IDENTITIES[int(ctx.node_config["partition-id"])], trust_store=TRUST,
                             distributed_dp=policy)
    return user_app(mods=[mod], **kw)


def fedavg(n: int = N) -> FedAvg:
    return FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)


class Sums(DistributedDP):
    """DistributedDP that keeps every decoded buffer sum (signed integers) for the test."""

    def decode_sum(self, total: Any, count: int) -> Any:
        self.sums = [*getattr(self, "sums", []), skellam.decode_signed(total)]
        return super().decode_sum(total, count)


def test_masks_cancel_exactly_with_noise_on_and_the_noise_has_the_configured_variance() -> None:
    policy = DeviceSkellam(min_noise_multiplier=0.5)
    shares: list[dict[str, np.ndarray]] = []
    policy.observer = shares.append
    strategy = Sums(fedavg(), epsilon=8.0, num_rounds=3, clip_norm=1.0, buffer_size=4)
    strategy.start(grid=LocalGrid(ddp_app(policy), N), initial_arrays=initial(), num_rounds=1)
    assert len(shares) == N and len(strategy.sums) == 2
    # each buffer's decoded sum is exactly the sum of its members' encoded updates and noise shares: the masks
    # cancel to the last integer (which device is in which buffer: match the shares' sums against the two sums)
    per_device = [s["encoded"] + s["noise"] for s in shares]
    total = np.sum(per_device, axis=0)
    assert np.array_equal(strategy.sums[0] + strategy.sums[1], total)
    found = [any(np.array_equal(buf, np.sum([per_device[i] for i in combo], axis=0))
                 for combo in _combos(N, 4)) for buf in strategy.sums]
    assert all(found)
    # the noise added in the sum: variance (z D2)^2 (each of the 4 members adds (z D2)^2 / t, t = 3, all survive)
    assert strategy.z is not None
    target = (strategy.z * strategy.l2) ** 2
    noise = np.sum([s["noise"] for s in shares[:4]], axis=0).astype(np.float64)  # any 4 shares: same law
    n = noise.size
    var = float(np.var(noise))
    # the sample variance of n draws has relative std sqrt(2 / (n - 1)) (plus the Skellam's tiny excess kurtosis)
    expected = target * 4 / 3
    assert abs(var / expected - 1) < 6 * math.sqrt(2 / (n - 1)), (var, expected)
    # every share alone has the configured variance (z D2)^2 / t
    all_shares = np.concatenate([s["noise"] for s in shares]).astype(np.float64)
    assert abs(np.var(all_shares) / (target / 3) - 1) < 6 * math.sqrt(2 / (all_shares.size - 1))
    m = strategy.diagnostics[1]
    assert m["ddp.releases"] == 1 and 0 < m["ddp.epsilon"] < 8


def _combos(n: int, k: int) -> list[tuple[int, ...]]:
    from itertools import combinations

    return list(combinations(range(n), k))


def test_it_learns_with_noise_and_stops_before_the_budget_is_passed() -> None:
    from flwr.serverapp.exception import PrivacyBudgetExhausted

    # the pipeline learns: 8 devices of a 501-parameter regression cannot learn at a small epsilon (z C / 8 per
    # coordinate of noise against updates clipped to C), so this checks the mechanics at a loose one
    strategy = DistributedDP(fedavg(), epsilon=1000.0, num_rounds=3, clip_norm=5.0, buffer_size=4)
    result = strategy.start(grid=LocalGrid(ddp_app(DeviceSkellam(min_noise_multiplier=0.01)), N),
                            initial_arrays=initial(), num_rounds=3)
    assert loss(result.arrays) < 0.5 * loss(initial())  # measured 30.6 against 154.8
    spent = strategy.privacy_spent()
    assert spent.num_releases == 3 and spent.epsilon <= 1000.0
    assert spent.epsilon == pytest.approx(skellam.skellam_epsilon((strategy.z * strategy.l2) ** 2, strategy.l1,
                                                                  strategy.l2, 3, 1e-5))
    # the 4th round would pass epsilon: Flower's PrivacyBudgetExhausted, before any message goes out
    grid = LocalGrid(ddp_app(DeviceSkellam(min_noise_multiplier=0.01)), N)
    strategy = DistributedDP(fedavg(), epsilon=50.0, num_rounds=3, clip_norm=5.0, buffer_size=4)
    with pytest.raises(PrivacyBudgetExhausted, match="round 4"):
        strategy.start(grid=grid, initial_arrays=initial(), num_rounds=4)
    assert strategy.privacy_spent().num_releases == 3


def _device(policy: DeviceSkellam | None) -> tuple[Any, Any]:
    app = ddp_app(policy)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": N}, state=RecordDict(),
                  run_config={})

    def send(config: dict[str, Any], extra: dict[str, Any] | None = None) -> Message:
        from flwr.supercore.task_identity import TaskIdentity

        for attr, v in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
            if getattr(TaskIdentity, attr) is None:
                setattr(TaskIdentity, attr, v)
        content = RecordDict({"arrays": initial(), "config": ConfigRecord(config), **(extra or {})})
        msg = Message(content, dst_node_id=1, message_type="train")
        msg.metadata.__dict__["_message_id"] = "m"
        return app(msg, ctx)

    return send, ctx


def _signed_mates(run: str, rnd: int) -> ArrayRecord:
    from flwr.app import Array

    arrays: dict[str, Any] = {}
    for c in (1, 2):
        _, pk = secagg.new_keypair()
        arrays[f"pk.{c}"] = Array(np.frombuffer(pk, np.uint8).copy())
        arrays[f"sig.{c}"] = Array(np.frombuffer(IDENTITIES[c].sign(secagg.signing_statement(run.encode(), rnd, c, pk)),
                                                 np.uint8).copy())
    return ArrayRecord(arrays)


@pytest.mark.parametrize(("ask", "why"), [
    ({}, "asks for no noise"),
    ({"ddp.z": 0.0, "ddp.clip": 1.0, "ddp.scale": 1e5}, "below this device's floor"),
    ({"ddp.z": 0.4, "ddp.clip": 1.0, "ddp.scale": 1e5}, "below this device's floor"),
    ({"ddp.z": 1.0, "ddp.clip": 1.0, "ddp.scale": 1e9}, "could wrap"),
    # z just above the floor, but at gamma C = 1 the discrete term of the bound (D1 / V large) costs more than the
    # 1 % margin (at gamma C = 1e5 the same z passes: the ok request below)
    ({"ddp.z": 0.505, "ddp.clip": 1.0, "ddp.scale": 1.0}, "costs more than a Gaussian one"),
])
def test_the_device_refuses_less_noise_than_its_floor(ask: dict[str, Any], why: str) -> None:
    send, _ = _device(DeviceSkellam(min_noise_multiplier=0.5))
    assert not send({"secure.phase": "keys", "secure.run": "r", "secure.round": 1}).has_error()
    base = {"secure.phase": "mask", "secure.run": "r", "secure.round": 1, "secure.buffer": 0,
            "secure.threshold": 2, "secure.clip": 8.0, "secure.levels": 2**22, "secure.members": "[0, 1, 2]",
            "secure.weight-key": "num-examples"}
    reply = send({**base, **ask}, {"secure": _signed_mates("r", 1)})
    assert reply.has_error() and why in reply.error.reason, reply.error.reason
    ok = send({**base, "ddp.z": 0.505, "ddp.clip": 1.0, "ddp.scale": 1e5}, {"secure": _signed_mates("r", 1)})
    assert not ok.has_error(), ok.error.reason if ok.has_error() else ""


def test_the_device_ledger_refuses_a_release_past_its_own_epsilon() -> None:
    policy = DeviceSkellam(min_noise_multiplier=0.5, max_epsilon=8.0)
    strategy = DistributedDP(fedavg(), epsilon=100.0, num_rounds=3, noise_multiplier=1.0, buffer_size=4)
    strategy.start(grid=LocalGrid(ddp_app(policy), N), initial_arrays=initial(), num_rounds=3)
    m = strategy.diagnostics
    # z = 1 at delta = 1e-5: 2 releases cost 7.09 (the server's own figure), a 3rd would pass the devices' 8
    assert m[2]["ddp.epsilon"] == pytest.approx(7.088, abs=0.01)
    assert m[1]["secure.buffers"] == 2 and m[2]["secure.buffers"] == 2 and m[3]["secure.buffers"] == 0
    assert m[3]["secure.dropped"] == N  # every device refused round 3


def test_the_server_side_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="epsilon"):
        DistributedDP(fedavg(), epsilon=0.0, num_rounds=3)
    with pytest.raises(ValueError, match="colluder"):
        DistributedDP(fedavg(), epsilon=1.0, num_rounds=3, buffer_size=4, max_colluders=3)
    with pytest.raises(TypeError, match="DeviceSkellam"):
        secure_buffers_mod(identity=IDENTITIES[0], trust_store=TRUST, distributed_dp=object())  # type: ignore[arg-type]
    assert D > 0
