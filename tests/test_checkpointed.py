"""Checkpointed (strategies/checkpointed.py) and the devices' snapshots (clients/state.py), in this process.

The ServerApp's death is an exception raised by the Grid (before round r's messages leave, or after the devices
answered round r), and the restarted ServerApp is a new strategy object, a new Grid and fresh Contexts on every node:
all a resumed run gets is the checkpoint directory and the devices' snapshot directory. The truth is the same
configuration run without a stop. Real SIGKILLs of a ServerApp under `flwr run` are in tests/test_resume_kill.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedYogi,
    Result,
    Strategy,
)

from fedpdm_flower.clients.mods import compress_mod, secure_buffers_mod
from fedpdm_flower.clients.state import MARK, StateSnapshots, persistent_state_mod
from fedpdm_flower.fedapp.checkpoint import CheckpointError
from fedpdm_flower.fedapp.compression import TopK
from fedpdm_flower.fedapp.robust import Bucketing, GeometricMedian
from fedpdm_flower.fedapp.secagg import NodeIdentity, TrustStore
from fedpdm_flower.strategies.central_dp import CentralDP
from fedpdm_flower.strategies.checkpointed import Checkpointed
from fedpdm_flower.strategies.wrappers import Compressed, Robust, SecureBuffers
from simulations.inprocess import LocalGrid

sys.path.insert(0, str(Path(__file__).resolve().parent))
from userapp import initial, loss, user_app

N = 4
ROUNDS = 4


class Crash(RuntimeError):
    """The ServerApp's death."""


class CrashingGrid(LocalGrid):
    """LocalGrid that dies when round ``at``'s first message would leave (``after=False``) or once the devices
    answered round ``at``'s train messages (``after=True``: they did the round, the server never aggregated it)."""

    def __init__(self, *args: Any, at: int | None = None, after: bool = False, at_exchange: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.at, self.after, self.at_exchange = at, after, at_exchange
        self.sent: list[Message] = []
        self.exchanges = 0

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        msgs = list(messages)
        self.exchanges += 1
        if self.exchanges == self.at_exchange:  # by count: an exchange whose message list may be empty
            raise Crash(f"killed at exchange {self.at_exchange}")
        rounds = {m.content.config_records["config"].get("server-round") for m in msgs
                  if "config" in m.content.config_records}
        if self.at is not None and self.at in rounds and not self.after:
            raise Crash(f"killed before round {self.at}")
        self.sent += msgs
        replies = super().send_and_receive(msgs, timeout=timeout)
        if self.at is not None and self.at in rounds and self.after and any(m.metadata.message_type == "train" for m in msgs):
            raise Crash(f"killed after the devices answered round {self.at}")
        return replies


def eval_loss(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    return MetricRecord({"loss": loss(arrays)})


def run(make: Callable[[], Strategy], directory: Path, *, app: ClientApp | None = None, crash: int | None = None,
        after: bool = False, crash_at_exchange: int | None = None, nodes: int = N, rounds: int = ROUNDS,
        node_config: Any = None, **kwargs: Any) -> tuple[Checkpointed, Result | None, CrashingGrid]:
    """One ServerApp life: a fresh strategy and Grid (fresh Contexts) on ``directory``; None when it died."""
    strategy = Checkpointed(make(), directory, **kwargs)
    grid = CrashingGrid(app if app is not None else user_app(), nodes, at=crash, after=after,
                        at_exchange=crash_at_exchange, node_config=node_config)
    try:
        return strategy, strategy.start(grid=grid, initial_arrays=initial(), num_rounds=rounds, evaluate_fn=eval_loss), grid
    except Crash:
        return strategy, None, grid


def killed_and_resumed(make: Callable[[], Strategy], tmp: Path, *, crash: int = 3, after: bool = False,
                       app: Callable[[], ClientApp] | None = None, **kwargs: Any) -> tuple[Result, Result, Checkpointed]:
    """(uninterrupted Result, resumed Result, the resumed strategy)."""
    _, whole, _ = run(make, tmp / "whole", app=app() if app else None, **kwargs)
    _, died, _ = run(make, tmp / "resumed", app=app() if app else None, crash=crash, after=after, **kwargs)
    assert whole is not None and died is None
    strategy, resumed, _ = run(make, tmp / "resumed", app=app() if app else None, **kwargs)
    assert resumed is not None and strategy.resumed_from == crash - 1
    return whole, resumed, strategy


def same_result(a: Result, b: Result, rel: float = 0.0, metrics_rel: float | None = None) -> None:
    """The model and every round's metrics: bit for bit (``rel`` 0), or within ``rel`` (relative L2 of the model,
    relative per metric; ``metrics_rel`` for the metrics if it differs)."""
    metrics_rel = rel if metrics_rel is None else metrics_rel
    assert list(a.arrays) == list(b.arrays)
    for k in a.arrays:
        x, y = a.arrays[k].numpy(), b.arrays[k].numpy()
        assert x.dtype == y.dtype
        if rel == 0.0:
            np.testing.assert_array_equal(x, y)
        else:
            assert np.linalg.norm(x.astype(np.float64) - y) <= rel * np.linalg.norm(y.astype(np.float64)), k
    for field in ("train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp"):
        ma, mb = ({(r, k): v for r, m in getattr(res, field).items() for k, v in m.items()} for res in (a, b))
        assert ma == (mb if metrics_rel == 0.0 else pytest.approx(mb, rel=metrics_rel))


def fedavg() -> FedAvg:
    return FedAvg(fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N)


FLOWER: dict[str, Callable[[], Strategy]] = {
    "FedAvg": fedavg,
    "FedProx": lambda: FedProx(fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N, proximal_mu=0.1),
    "FedMedian": lambda: FedMedian(fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N),
    # the server optimizers' moments m_t, v_t and momentum carry from round to round
    "FedAdam": lambda: FedAdam(fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N, eta=0.05),
    "FedYogi": lambda: FedYogi(fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N, eta=0.05),
    "FedAvgM": lambda: FedAvgM(fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N, server_momentum=0.9),
    # our wrappers: the pre-aggregator's randomness (seeded), the downlink reference and the devices' error memory
    "Robust(FedAvg, Bucketing)": lambda: Robust(fedavg(), GeometricMedian(), pre=Bucketing(2), seed=3),
}


@pytest.mark.parametrize("name", sorted(FLOWER))
def test_flower_strategies_and_wrappers_resume_to_the_same_model(name: str, tmp_path: Path) -> None:
    """A run killed before round 3 and resumed ends as the run that never stopped: within 1e-6 relative. Not bit
    for bit: Flower's FedAvg draws its sample with Python's global ``random`` (never written down), so the resumed
    run gets the same four nodes in another order and sums their models in another order (two uninterrupted runs
    differ the same way). Our Robust sorts its rows by node, so that chain's model is equal bit for bit; the clients'
    metrics are aggregated by Flower's ``aggregate_metricrecords`` in reply order, equal to the last bits."""
    whole, resumed, _ = killed_and_resumed(FLOWER[name], tmp_path)
    robust = name.startswith("Robust")
    same_result(whole, resumed, rel=0.0 if robust else 1e-6, metrics_rel=1e-12 if robust else None)
    assert sorted(resumed.evaluate_metrics_serverapp) == list(range(ROUNDS + 1))


def test_the_state_is_not_vacuous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FedAdam's moments are what makes the resumed run equal: resumed from the same round-2 checkpoint without
    them (a fresh FedAdam given the model only), the run ends elsewhere."""
    from fedpdm_flower.strategies import checkpointed

    whole, _, _ = killed_and_resumed(FLOWER["FedAdam"], tmp_path)
    _, died, _ = run(FLOWER["FedAdam"], tmp_path / "again", crash=3)
    real = checkpointed.load_layer_state
    monkeypatch.setattr(checkpointed, "load_layer_state", lambda layer, state: real(
        layer, {k: v for k, v in state.items() if k not in ("m_t", "v_t")}))
    _, lost, _ = run(FLOWER["FedAdam"], tmp_path / "again")
    assert died is None and lost is not None
    assert not np.allclose(lost.arrays["w"].numpy(), whole.arrays["w"].numpy(), rtol=1e-3)


def test_compressed_resumes_bit_for_bit_with_the_devices_error_memory(tmp_path: Path) -> None:
    """Compressed(FedAvg) with top-k both ways: the server's reference model and, on the devices, compress_mod's
    error memory and reference (through persistent_state_mod). The first resumed round sends every device the dense
    model (the same reference, more bytes)."""
    def app() -> ClientApp:
        return user_app(mods=[persistent_state_mod(str(tmp_path / "devices")), compress_mod()])

    def make() -> Strategy:
        return Compressed(fedavg(), uplink=TopK(0.2), downlink=TopK(0.5), seed=1)

    whole, resumed, strategy = killed_and_resumed(make, tmp_path, app=app)
    x, y = whole.arrays["w"].numpy(), resumed.arrays["w"].numpy()
    assert np.linalg.norm(x - y) <= 1e-6 * np.linalg.norm(x)
    assert {r: m["loss"] for r, m in resumed.evaluate_metrics_serverapp.items()} == pytest.approx(
        {r: m["loss"] for r, m in whole.evaluate_metrics_serverapp.items()}, rel=1e-6)
    # the wrapper's own figures (never in the Result, which holds the clients' metrics), rounds 1-2 from the checkpoint
    assert sorted(strategy.diagnostics) == list(range(1, ROUNDS + 1))
    down = {r: m["compress.down_bytes"] for r, m in strategy.diagnostics.items()}
    dense = {r: m["compress.down_dense_bytes"] for r, m in strategy.diagnostics.items()}
    assert down[3] == dense[3] and down[4] < dense[4]  # round 3 (the first resumed) dense, then compressed again


def test_compressed_without_the_devices_state_ends_elsewhere(tmp_path: Path) -> None:
    """The same crash, devices without snapshots: their error memory restarts at zero, the model differs."""
    def make() -> Strategy:
        return Compressed(fedavg(), uplink=TopK(0.2), downlink=TopK(0.5), seed=1)

    whole, resumed, _ = killed_and_resumed(make, tmp_path, app=lambda: user_app(mods=[compress_mod()]))
    assert not np.array_equal(whole.arrays["w"].numpy(), resumed.arrays["w"].numpy())


def test_flower_dp_wrappers_continue_their_accountant_and_clipping_norm(tmp_path: Path) -> None:
    """Flower's DP wrappers draw their noise from numpy's global generator (never written down), so the models
    differ; what must continue is the accountant (every release counted once, the same epsilon) and the adaptive
    clipping norm (it moves every round)."""
    from flwr.serverapp import RdpAccountant
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )

    NO_AMP, ADD_REMOVE = SamplingMethod.NO_AMPLIFICATION, NeighboringRelation.ADD_OR_REMOVE_ONE

    def fixed() -> Strategy:
        acc = RdpAccountant(PrivacyConfig(target_delta=1e-5, population_size=N, sampling_method=NO_AMP,
                                          neighboring_relation=ADD_REMOVE))
        return DifferentialPrivacyServerSideFixedClipping(fedavg(), noise_multiplier=0.5, clipping_norm=5.0,
                                                          num_sampled_clients=N, accountant=acc)

    _, _, strategy = killed_and_resumed(fixed, tmp_path / "fixed")
    spent = strategy.privacy_spent()
    truth = RdpAccountant(PrivacyConfig(target_delta=1e-5, population_size=N, sampling_method=NO_AMP,
                                          neighboring_relation=ADD_REMOVE))
    truth.compose(GaussianPrivacyEvent(noise_multiplier=0.5, sample_size=N, population_size=N), count=ROUNDS)
    assert spent.num_releases == ROUNDS  # rounds 1-2 from the checkpoint, 3-4 after: none lost, none twice
    assert spent.epsilon == pytest.approx(truth.get_privacy_spent().epsilon, rel=1e-12)

    def adaptive() -> Strategy:
        return DifferentialPrivacyServerSideAdaptiveClipping(fedavg(), noise_multiplier=0.0, num_sampled_clients=N,
                                                             initial_clipping_norm=1.0)

    whole, resumed, strategy = killed_and_resumed(adaptive, tmp_path / "adaptive")
    # noise multiplier 0: the clipped-count noise is off too, so the clipping norm's path is deterministic
    assert strategy.strategy.clipping_norm != 1.0  # type: ignore[attr-defined]
    same_result(whole, resumed, rel=1e-6)


def test_central_dp_continues_its_accountant(tmp_path: Path) -> None:
    """CentralDP's secret sample and noise are drawn afresh after a restart; its PLD accountant goes on from the
    checkpoint's releases: after the resumed run it has composed exactly one release per round, none lost and none
    twice -- the (epsilon, delta) of ROUNDS releases composed by dp-accounting's PLD directly."""
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )

    from fedpdm_flower.fedapp.privacy.protocol import PldAccountant

    def make() -> Strategy:
        # z given (calibrating it to epsilon is a PLD search per construction): epsilon is only the budget
        return CentralDP(FedAvg(fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1), epsilon=20.0,
                         sample_rate=0.5, num_rounds=ROUNDS, min_available_nodes=N, clip_norm=2.0,
                         noise_multiplier=4.0)

    # killed as round 3's train exchange would leave, counted by exchanges (train and evaluate, 2 per round): a
    # secret sample may draw nobody (1/16 here), and a round-3 message to look for would then not exist
    assert run(make, tmp_path, crash_at_exchange=5)[1] is None
    strategy, resumed, _ = run(make, tmp_path)
    assert resumed is not None and strategy.resumed_from == 2
    truth = PldAccountant(PrivacyConfig(target_delta=1e-5, population_size=N, max_epsilon=20.0 * (1 + 1e-6),
                                        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                        sampling_method=SamplingMethod.POISSON))
    truth.compose(GaussianPrivacyEvent(noise_multiplier=4.0, sample_size=2, population_size=N), count=ROUNDS)
    spent = strategy.privacy_spent()
    assert spent.num_releases == ROUNDS
    assert spent.epsilon == pytest.approx(truth.get_privacy_spent().epsilon, rel=1e-9)
    # every round's figures, rounds 1-2 from the checkpoint (the Result's train metrics skip a round whose secret
    # sample drew nobody: no client metrics to aggregate, but the release happened)
    assert sorted(strategy.diagnostics) == list(range(1, ROUNDS + 1))
    assert strategy.diagnostics[4]["central_dp.releases"] == float(ROUNDS)


def _keys(tmp: Path, n: int) -> Path:
    keys = tmp / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    public = {}
    for i in range(n):
        ident = NodeIdentity.generate()
        ident.save(keys / f"node-{i}.pem")
        public[i] = ident.public_bytes()
    TrustStore(public).save(keys / "trust.json")
    return keys


def _secure_app(tmp: Path, keys: Path, snapshots: bool = True) -> ClientApp:
    mod = secure_buffers_mod(identity=lambda ctx: NodeIdentity.load(keys / f"node-{ctx.node_config['partition-id']}.pem"),
                             trust_store=lambda ctx: TrustStore.load(keys / "trust.json"))
    return user_app(mods=[persistent_state_mod(str(tmp / "devices")), mod] if snapshots else [mod])


def test_a_secure_round_in_flight_is_lost_never_masked_twice(tmp_path: Path) -> None:
    """SecureBuffers(Robust(FedAvg)): the server dies after the devices masked and unmasked round 3. The resumed
    run (a fresh run label) asks for round-3 keys; every device refuses (it already masked round 3: its last masked
    round is never rolled back), so round 3 aggregates nothing and leaves the model as round 2 left it; round 4
    trains again with fresh keys."""
    keys = _keys(tmp_path, 6)

    def make() -> Strategy:
        return SecureBuffers(Robust(FedAvg(fraction_evaluate=0.0, min_available_nodes=6, min_train_nodes=6),
                                    GeometricMedian()), buffer_size=3, seed=5)

    strategy = Checkpointed(make(), tmp_path / "ckpt")
    died = CrashingGrid(_secure_app(tmp_path, keys), 6, at=3, after=True)
    with pytest.raises(Crash):
        strategy.start(grid=died, initial_arrays=initial(), num_rounds=ROUNDS, evaluate_fn=eval_loss)
    strategy = Checkpointed(make(), tmp_path / "ckpt")
    grid = CrashingGrid(_secure_app(tmp_path, keys), 6)
    result = strategy.start(grid=grid, initial_arrays=initial(), num_rounds=ROUNDS, evaluate_fn=eval_loss)
    losses = {r: m["loss"] for r, m in result.evaluate_metrics_serverapp.items()}
    assert losses[3] == losses[2] and losses[4] < losses[3]  # round 3 lost, round 4 trained
    figures = strategy.diagnostics
    assert figures[3].get("secure.buffers", 0) == 0 and figures[4]["secure.buffers"] == 2.0
    assert [figures[r]["secure.buffers"] for r in (1, 2)] == [2.0, 2.0]  # the crashed run's, from the checkpoint
    # without the devices' snapshots they would have masked round 3 again (over new buffers): the second sum of the
    # same updates the monotone record prevents
    again = Checkpointed(make(), tmp_path / "ckpt2")
    with pytest.raises(Crash):
        again.start(grid=CrashingGrid(_secure_app(tmp_path / "x", keys, snapshots=False), 6, at=3, after=True),
                    initial_arrays=initial(), num_rounds=ROUNDS, evaluate_fn=eval_loss)
    again = Checkpointed(make(), tmp_path / "ckpt2")
    again.start(grid=CrashingGrid(_secure_app(tmp_path / "x", keys, snapshots=False), 6),
                initial_arrays=initial(), num_rounds=ROUNDS, evaluate_fn=eval_loss)
    assert again.diagnostics[3]["secure.buffers"] == 2.0


def test_distributed_dp_devices_keep_their_floor_across_a_restart(tmp_path: Path) -> None:
    """DistributedDP (z = 1) with devices whose own Skellam ledger allows epsilon 8: two releases cost 7.09, so the
    uninterrupted run's devices refuse round 3. Killed before round 3 and resumed, the devices' ledgers come back
    through their snapshots and they refuse round 3 the same way, and the server's accountant goes on from its two
    releases. Without the snapshots the devices' ledgers would restart at zero and they would release a third time,
    past their own epsilon: the floor holds only because the ledger is carried over."""
    from fedpdm_flower.clients.distributed_dp import DeviceSkellam
    from fedpdm_flower.strategies.distributed_dp import DistributedDP

    n, keys = 8, _keys(tmp_path, 8)

    def app(snapshots: bool) -> ClientApp:
        mod = secure_buffers_mod(
            identity=lambda ctx: NodeIdentity.load(keys / f"node-{ctx.node_config['partition-id']}.pem"),
            trust_store=lambda ctx: TrustStore.load(keys / "trust.json"),
            distributed_dp=DeviceSkellam(min_noise_multiplier=0.5, max_epsilon=8.0))
        return user_app(mods=[persistent_state_mod(str(tmp_path / "devices")), mod] if snapshots else [mod])

    def make() -> Strategy:
        return DistributedDP(FedAvg(fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n), epsilon=100.0,
                             num_rounds=3, noise_multiplier=1.0, buffer_size=4)

    uninterrupted, whole, _ = run(make, tmp_path / "whole", app=app(False), nodes=n, rounds=3)
    assert run(make, tmp_path / "resumed", app=app(True), nodes=n, rounds=3, crash=3)[1] is None
    strategy, resumed, _ = run(make, tmp_path / "resumed", app=app(True), nodes=n, rounds=3)
    assert whole is not None and resumed is not None and strategy.resumed_from == 2
    for s in (uninterrupted, strategy):
        m = s.diagnostics
        assert [m[r]["secure.buffers"] for r in (1, 2, 3)] == [2.0, 2.0, 0.0] and m[3]["secure.dropped"] == n
    assert strategy.diagnostics[3]["ddp.epsilon"] == pytest.approx(uninterrupted.diagnostics[3]["ddp.epsilon"],
                                                                   rel=1e-12)
    # the control: the same restart, devices without snapshots, release in round 3 past their own epsilon
    assert run(make, tmp_path / "lost", app=app(False), nodes=n, rounds=3, crash=3)[1] is None
    lost, res_lost, _ = run(make, tmp_path / "lost", app=app(False), nodes=n, rounds=3)
    assert res_lost is not None and lost.diagnostics[3]["secure.buffers"] == 2.0


# ----------------------------------------------------------------------------------------------- BSDP-FedPDM
def _pdm_app() -> tuple[Any, Callable[..., Any]]:
    app_dir = str(Path(__file__).resolve().parent / "resumeapp")
    if app_dir not in sys.path:
        sys.path.insert(0, app_dir)
    from resumeapp.client_app import app
    from resumeapp.server_app import build

    return app, build


def _pdm_run(tmp: Path, name: str, devices: str | None, crash: int | None = None,
             after: bool = False) -> tuple[Checkpointed, Result | None]:
    import tomllib

    app, build = _pdm_app()
    rc = {**tomllib.loads((Path(__file__).resolve().parent / "resumeapp" / "pyproject.toml").read_text())["tool"][
        "flwr"]["app"]["config"], "mode": "fedpdm", "epsilon": 30.0, "state-dir": devices or ""}
    from resumeapp.task import make_net

    strategy = Checkpointed(build(rc), tmp / name)
    grid = CrashingGrid(app, 4, at=crash, after=after, run_config=rc)
    try:
        return strategy, strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net(7).state_dict()), num_rounds=4)
    except Crash:
        return strategy, None


def test_bsdp_fedpdm_resumes_with_the_devices_duals_and_ledgers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Killed before round 3: with the devices' snapshots the run ends bit for bit as the uninterrupted one, privacy
    figures included; without them the server resumes exactly but the devices start again from lambda_i = 0 with
    empty ledgers (the server flags the restarted ledgers), and the run ends elsewhere."""
    whole, w = _pdm_run(tmp_path, "whole", str(tmp_path / "dev-whole"))
    assert _pdm_run(tmp_path, "resumed", str(tmp_path / "dev"), crash=3)[1] is None
    resumed, r = _pdm_run(tmp_path, "resumed", str(tmp_path / "dev"))
    assert w is not None and r is not None and resumed.resumed_from == 2
    same_result(w, r)
    a, b = whole.strategy, resumed.strategy
    assert a.client_privacy == b.client_privacy  # type: ignore[attr-defined]
    assert a.privacy_spent() == b.privacy_spent()  # type: ignore[attr-defined]
    assert [(h.round, h.epsilon) for h in a.history] == [(h.round, h.epsilon) for h in b.history]  # type: ignore[attr-defined]

    assert _pdm_run(tmp_path, "lost", None, crash=3)[1] is None
    with caplog.at_level("WARNING", logger="flwr"):
        _, rl = _pdm_run(tmp_path, "lost", None)
    assert rl is not None and not np.array_equal(rl.arrays["fc1.weight"].numpy(), w.arrays["fc1.weight"].numpy())
    assert "its privacy ledger restarted" in caplog.text


def test_a_release_in_a_redone_round_stays_spent(tmp_path: Path) -> None:
    """The server dies after the devices answered round 3 (their noisy releases reached it) and before its round-3
    checkpoint. The resumed run does round 3 again from the devices' round-2 state -- the same duals, so the same
    model as the uninterrupted run -- but each device sampled in round 3 keeps the round-3 release in its ledger:
    one participation more than the uninterrupted run, and a larger epsilon. (These devices are seeded, so their
    redone release repeats the same bytes and the count is conservative; a device drawing from the OS, the default,
    releases twice for real.)"""
    whole, w = _pdm_run(tmp_path, "whole", str(tmp_path / "dev-whole"))
    assert _pdm_run(tmp_path, "resumed", str(tmp_path / "dev"), crash=3, after=True)[1] is None
    resumed, r = _pdm_run(tmp_path, "resumed", str(tmp_path / "dev"))
    assert w is not None and r is not None and resumed.resumed_from == 2
    np.testing.assert_array_equal(w.arrays["fc1.weight"].numpy(), r.arrays["fc1.weight"].numpy())
    a, b = whole.strategy.client_privacy, resumed.strategy.client_privacy  # type: ignore[attr-defined]
    sampled3 = resumed.strategy.participants(3)  # type: ignore[attr-defined]
    for cid in a:
        extra = 1 if cid in sampled3 else 0
        assert b[cid]["participations"] == a[cid]["participations"] + extra
        assert (b[cid]["eps_gdp"] > a[cid]["eps_gdp"]) == bool(extra)


# ----------------------------------------------------------------------------------------------- Flower's Result
def same_fields(a: Result, b: Result, *, metrics_rel: float) -> None:
    """Field by field: the same model (bit for bit) and, in each metrics field, the same rounds with the same keys,
    the values equal within ``metrics_rel``."""
    same_result(a, b, rel=0.0, metrics_rel=metrics_rel)
    for field in ("train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp"):
        fa, fb = getattr(a, field), getattr(b, field)
        assert sorted(fa) == sorted(fb), field
        assert all(sorted(fa[r]) == sorted(fb[r]) for r in fa), field


def test_a_resumed_result_is_the_strategys_own_start_result(tmp_path: Path) -> None:
    """A run killed after round 2 and resumed returns, field by field, the Result that the strategy's own ``start``
    (no Checkpointed, never stopped) returns: the model, the clients' aggregated train and evaluate metrics (the
    user's train_config and evaluate_config reach the devices in the resumed rounds too) and the user's
    evaluate_fn figures, round 0 included. Robust(FedAvg) (Flower's strategy under our wrapper, its model equal bit
    for bit) and BSDP-FedPDM (ours, its own bookkeeping under the hook)."""
    cfg = {"train_config": ConfigRecord({"user-tag": 7.0}), "evaluate_config": ConfigRecord({"user-eval-tag": 3.0})}

    def make() -> Strategy:
        return Robust(FedAvg(fraction_evaluate=1.0, min_available_nodes=N, min_train_nodes=N,
                             min_evaluate_nodes=N), GeometricMedian())

    truth = make().start(grid=LocalGrid(user_app(), N), initial_arrays=initial(), num_rounds=ROUNDS,
                         evaluate_fn=eval_loss, **cfg)
    died = Checkpointed(make(), tmp_path / "robust")
    with pytest.raises(Crash):
        died.start(grid=CrashingGrid(user_app(), N, at=3), initial_arrays=initial(), num_rounds=ROUNDS,
                   evaluate_fn=eval_loss, **cfg)
    strategy = Checkpointed(make(), tmp_path / "robust")
    resumed = strategy.start(grid=CrashingGrid(user_app(), N), initial_arrays=initial(), num_rounds=ROUNDS,
                             evaluate_fn=eval_loss, **cfg)
    assert strategy.resumed_from == 2
    same_fields(truth, resumed, metrics_rel=1e-12)  # Flower sums the clients' metrics in reply order
    assert sorted(resumed.evaluate_metrics_serverapp) == list(range(ROUNDS + 1))
    # the tags are the same on every device: their weighted mean is the tag, to the last bits
    assert [resumed.train_metrics_clientapp[r]["user_tag"] for r in range(1, ROUNDS + 1)] == pytest.approx([7.0] * 4)
    assert [resumed.evaluate_metrics_clientapp[r]["user_eval_tag"] for r in range(1, ROUNDS + 1)] == pytest.approx(
        [3.0] * 4)
    # the Result's per-round metrics are journals beside state.json (one line a round, written once), not inline
    doc = json.loads((tmp_path / "robust" / "state.json").read_text())
    assert [j["entries"] for j in doc["journals"]] == [ROUNDS, ROUNDS, ROUNDS + 1]  # train, evaluate, evaluate_fn
    assert all(set(doc["state"]["result"][k]) == {"__journal__"} for k in ("train", "evaluate", "server"))

    import tomllib

    app, build = _pdm_app()
    from resumeapp.task import evaluate, load_test, make_net

    rc = {**tomllib.loads((Path(__file__).resolve().parent / "resumeapp" / "pyproject.toml").read_text())["tool"][
        "flwr"]["app"]["config"], "mode": "fedpdm", "epsilon": 30.0, "state-dir": str(tmp_path / "devices"),
          "samples-per-node": 60}
    net, test = make_net(0), load_test()

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        net.load_state_dict(arrays.to_torch_state_dict())
        loss_, acc = evaluate(net, test)
        return MetricRecord({"loss": loss_, "accuracy": acc})

    def pdm(grid: LocalGrid, strategy: Strategy) -> Result:
        return strategy.start(grid=grid, initial_arrays=ArrayRecord(make_net(7).state_dict()), num_rounds=ROUNDS,
                              evaluate_fn=central)

    truth = pdm(LocalGrid(app, 4, run_config={**rc, "state-dir": ""}), build(rc))
    with pytest.raises(Crash):
        pdm(CrashingGrid(app, 4, at=3, run_config=rc), Checkpointed(build(rc), tmp_path / "pdm"))
    strategy = Checkpointed(build(rc), tmp_path / "pdm")
    resumed = pdm(CrashingGrid(app, 4, run_config=rc), strategy)
    assert strategy.resumed_from == 2
    same_fields(truth, resumed, metrics_rel=0.0)
    assert sorted(resumed.train_metrics_clientapp) == list(range(1, ROUNDS + 1))
    assert sorted(resumed.evaluate_metrics_serverapp) == list(range(ROUNDS + 1))


# ----------------------------------------------------------------------------------------------- refusals
def test_another_configuration_is_refused_naming_what_differs_and_nothing_is_written(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _, died, _ = run(FLOWER["FedAdam"], ckpt, crash=3, config={"lr": 0.1, "data": "a"})
    assert died is None
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}

    def refused(make: Callable[[], Strategy], **kwargs: Any) -> str:
        with pytest.raises(CheckpointError) as err:
            run(make, ckpt, **kwargs)
        assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before  # nothing was overwritten
        return str(err.value)

    text = refused(lambda: FedAdam(fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N, eta=0.07),
                   config={"lr": 0.2, "data": "a"})
    assert "another configuration" in text and "FedAdam.eta: 0.05 -> 0.07" in text and "config.lr: 0.1 -> 0.2" in text
    text = refused(FLOWER["FedYogi"], config={"lr": 0.1, "data": "a"})
    assert "chain: 'FedAdam' -> 'FedYogi'" in text
    text = refused(lambda: Robust(FLOWER["FedAdam"](), GeometricMedian()), config={"lr": 0.1, "data": "a"})
    assert "chain: 'FedAdam' -> 'Robust > FedAdam'" in text
    with pytest.raises(CheckpointError, match="is of round 2, beyond num_rounds = 1"):
        run(FLOWER["FedAdam"], ckpt, rounds=1, config={"lr": 0.1, "data": "a"})
    # another model layout
    strategy = Checkpointed(FLOWER["FedAdam"](), ckpt, config={"lr": 0.1, "data": "a"})
    other = ArrayRecord({k: v for k, v in initial().items() if k != "steps"})
    with pytest.raises(CheckpointError, match=r"model: 'w:\[500\]:float32; b:\[1\]:float32; steps:\[\]:int64' -> "):
        strategy.start(grid=LocalGrid(user_app(), N), initial_arrays=other, num_rounds=ROUNDS)
    # the same configuration resumes
    _, ok, _ = run(FLOWER["FedAdam"], ckpt, config={"lr": 0.1, "data": "a"})
    assert ok is not None


@pytest.mark.parametrize("damage", ["state", "arrays"])
def test_a_damaged_checkpoint_is_refused(tmp_path: Path, damage: str) -> None:
    ckpt = tmp_path / "ckpt"
    assert run(fedavg, ckpt, crash=3)[1] is None
    target = ckpt / "state.json" if damage == "state" else next(ckpt.glob("arrays-*.npz"))
    raw = bytearray(target.read_bytes())
    if damage == "state":  # a digit of the model's round number changed: still valid JSON
        text = raw.decode().replace('"round": 2', '"round": 1', 1)
        raw = bytearray(text.encode())
    else:
        raw[len(raw) // 2] ^= 0x01
    target.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"cannot be resumed: .*SHA-256.*nothing was changed"):
        run(fedavg, ckpt)
    assert target.read_bytes() == bytes(raw)


def test_bad_arguments_are_refused_before_round_one(tmp_path: Path) -> None:
    from fedpdm_flower.strategies.fedrep import FedREP

    with pytest.raises(ValueError, match="absolute path"):
        Checkpointed(fedavg(), "relative/ckpt")
    with pytest.raises(ValueError, match="FedREP cannot resume from a checkpoint: FedREP's round state"):
        Checkpointed(FedREP(min_available_nodes=4), tmp_path)
    with pytest.raises(TypeError, match="must be the outermost strategy"):
        Robust(Checkpointed(fedavg(), tmp_path), GeometricMedian())
    with pytest.raises(TypeError, match="config values must be numbers"):
        Checkpointed(fedavg(), tmp_path, config={"x": [1, 2]})
    from fedpdm_flower.strategies.flower_builtin import FlwrFedAvg

    with pytest.raises(ValueError, match="FlwrFedAvg cannot resume from a checkpoint: the reproduction app's baselines"):
        Checkpointed(FlwrFedAvg(), tmp_path)
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        Checkpointed(fedavg(), tmp_path / "t").start(grid=LocalGrid(user_app(), N), initial_arrays=initial(), timeout=0)
    assert not (tmp_path / "t").exists()

    class Odd(FedAvg):
        def __init__(self) -> None:
            super().__init__(fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N)
            self.cache = object()  # public, not data, no state_dict: refused at the first checkpoint, by name

    with pytest.raises(CheckpointError, match=r"cannot checkpoint Odd\.cache, a object"):
        run(Odd, tmp_path / "odd")


def test_a_finished_checkpoint_returns_its_result_without_sending(tmp_path: Path) -> None:
    _, whole, _ = run(fedavg, tmp_path / "ckpt")
    strategy, again, grid = run(fedavg, tmp_path / "ckpt")
    assert whole is not None and again is not None and grid.sent == [] and strategy.resumed_from == ROUNDS
    same_result(whole, again)


def test_every_message_of_a_wrapped_run_carries_the_token_and_round(tmp_path: Path) -> None:
    """The labels the devices key their snapshots by, on every exchange -- SecureBuffers' key and unmask phases too
    -- and the same token after a restart."""
    keys = _keys(tmp_path, 6)

    def make() -> Strategy:
        return SecureBuffers(fedavg_n(6), buffer_size=3)

    def fedavg_n(n: int) -> FedAvg:
        return FedAvg(fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)

    s1, died, g1 = run(make, tmp_path / "ckpt", app=_secure_app(tmp_path, keys), nodes=6, crash=3)
    s2, done, g2 = run(make, tmp_path / "ckpt", app=_secure_app(tmp_path, keys), nodes=6)
    assert died is None and done is not None and s1.token == s2.token
    for msg in g1.sent + g2.sent:
        cfg = msg.content.config_records["config"]
        assert cfg["run-token"] == s1.token and isinstance(cfg["server-round"], int)
    phases = {m.content.config_records["config"].get("secure.phase") for m in g1.sent + g2.sent}
    assert phases == {"keys", "mask", "unmask"}


# ----------------------------------------------------------------------------------------------- device side
def test_the_state_mod_restores_once_per_fresh_context_and_refuses_damage(tmp_path: Path) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):
        if getattr(TaskIdentity, attr) is None:
            setattr(TaskIdentity, attr, 1)
    token = "ab" * 16
    seen: list[int] = []
    app = ClientApp(mods=[persistent_state_mod(str(tmp_path))])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        n = int(context.state.config_records["n"]["n"]) if "n" in context.state.config_records else 0
        seen.append(n)
        context.state["n"] = ConfigRecord({"n": n + 1})
        return Message(RecordDict({"metrics": MetricRecord({"n": n})}), reply_to=msg)

    def msg(rnd: int) -> Message:
        return Message(RecordDict({"config": ConfigRecord({"run-token": token, "server-round": rnd})}),
                       dst_node_id=5, message_type="train")

    def ctx() -> Context:
        return Context(run_id=1, node_id=5, node_config={"partition-id": 2}, state=RecordDict(), run_config={})

    c = ctx()
    for rnd in (1, 2, 3):
        assert not app(msg(rnd), c).has_error()
    assert seen == [0, 1, 2] and c.state.config_records[MARK]["token"] == token
    # a fresh Context resuming at round 3 starts from round 2's snapshot (n = 2), once
    c2 = ctx()
    app(msg(3), c2)
    app(msg(4), c2)
    assert seen[-2:] == [2, 3]
    # a damaged snapshot: an error reply naming it, not a silent start from nothing
    snap = tmp_path / f"run-{token}" / "node-2" / "round-000003.state"
    raw = bytearray(snap.read_bytes())
    raw[-1] ^= 0xFF
    snap.write_bytes(bytes(raw))
    reply = app(msg(4), ctx())
    assert reply.has_error() and "round-000003.state is damaged" in reply.error.reason
    # a state that cannot be written: the reply is withheld
    blocked = ClientApp(mods=[persistent_state_mod(str(tmp_path / "file"))])
    (tmp_path / "file").write_text("not a directory")
    blocked.train()(train)
    reply = blocked(msg(1), ctx())
    assert reply.has_error() and "the reply is withheld" in reply.error.reason
    # no token, no directory: nothing happens
    assert StateSnapshots(str(tmp_path)).where(RecordDict({"config": ConfigRecord({"server-round": 1})}), ctx()) is None
    assert StateSnapshots().where(msg(1).content, ctx()) is None  # no node config state-dir
    assert json.dumps(sorted(p.name for p in (tmp_path / f"run-{token}" / "node-2").iterdir())) == \
        json.dumps(["round-000003.state", "round-000004.state"])
