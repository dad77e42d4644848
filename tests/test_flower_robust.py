"""Flower's own Krum / FedMedian / FedTrimmedAvg on the FedREP setup (keys flwr-krum, flwr-fedmedian,
flwr-fedtrimmedavg; fedpdm_flower/strategies/flower_robust.py, fedpdm_flower.clients.fedrep.MomentumSGDClient).

The unmarked tests drive Flower's own configure_train / aggregate_train on a stub Grid with our client answering
(no Flower engine) and check each rule against an independent computation; the ``flower`` tests run ``flwr run``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from numpy.typing import NDArray

from fedpdm_flower.fedapp import attacks, robust
from fedpdm_flower.fedapp.attacks import OmniscientOracle
from fedpdm_flower.fedapp.client_app import handle
from fedpdm_flower.fedapp.config import ConfigError, RunConfig, parse_run_config
from fedpdm_flower.fedapp.registry import ALGORITHMS
from fedpdm_flower.fedapp.runner import build_strategy
from fedpdm_flower.strategies.flower_builtin import FlowerOnlyError
from fedpdm_flower.strategies.flower_robust import (
    FedREPLocalMixin,
    FlwrFedTrimmedAvg,
    FlwrKrum,
    forge_byzantine_replies,
)
from simulations.flower_driver import run_flower
from simulations.inprocess import make_contexts, run_inprocess

BASE: dict[str, Any] = {
    "plot": False,  # results.json is what these runs are read by; tests/test_results.py checks the plot
    "dataset": "mnist", "partitioner": "iid", "model": "lenet5", "num-clients": 4, "clients-per-round": 4,
    "num-server-rounds": 2, "batch-size": 25, "lr": 0.5, "local-steps": 2,
}
FOE = {"byzantine-clients": 1, "attack": "foe", "foe-eps": 10.0}


def cfg_of(alg: str, **over: Any) -> RunConfig:
    return parse_run_config({**BASE, "algorithm": alg, "eval-every": 100, **over})


def fedrep_fedavg(**over: Any) -> NDArray[np.float64]:
    """The final model of the in-process fedrep-fedavg run (plain mean of the same clients' updates)."""
    return run_inprocess(cfg_of("fedrep-fedavg", **{"secagg-mode": "plain", **over}), evaluate=False)[0].global_model()


def pid_of(content: RecordDict) -> int:
    pid = content.metric_records["metrics"]["partition-id"]
    assert isinstance(pid, int)
    return pid


def flat(content: RecordDict) -> NDArray[np.float64]:
    return np.concatenate([a.reshape(-1) for a in content.array_records["arrays"].to_numpy_ndarrays()]).astype(np.float64)


# ------------------------------------------------------------------ config, construction
@pytest.mark.parametrize(
    ("overrides", "key"),
    [({"model": "multinomial"}, "'model'"), ({"coord-attack": "min"}, "'coord-attack'"),
     ({"byzantine-clients": 4}, "'byzantine-clients'")],
)
def test_bad_configs_name_the_key(overrides: dict[str, Any], key: str) -> None:
    for alg in ("flwr-krum", "flwr-fedmedian", "flwr-fedtrimmedavg"):
        with pytest.raises(ConfigError, match=key):
            cfg_of(alg, **overrides)


def test_flower_parameters_map_to_the_run_config() -> None:
    # FedREP's buffer / masking defaults (buffer-size 2, secagg-mode masked) do not apply: FoE with 5 clients is fine
    cfg = cfg_of("flwr-krum", **{"num-clients": 5, "clients-per-round": 2, "byzantine-clients": 2, "attack": "foe"})
    krum = build_strategy(cfg, evaluate=False)
    assert isinstance(krum, FlwrKrum)
    assert krum.num_malicious_nodes == 2 and krum.num_nodes_to_select == 1
    assert (krum.fraction_train, krum.min_train_nodes, krum.min_available_nodes, krum.fraction_evaluate) == (1.0, 5, 5, 0.0)
    assert krum.oracle is not None and krum.oracle.values == "foe" and krum.oracle.eps == cfg.foe_eps
    assert krum.oracle.byzantine == frozenset(attacks.byzantine_ids(5, 2, cfg.seed))
    assert build_strategy(cfg_of("flwr-krum"), evaluate=False).oracle is None  # no attack: no simulation code
    trimmed = build_strategy(cfg_of("flwr-fedtrimmedavg", **{"tmean-fraction": 0.25}), evaluate=False)
    assert isinstance(trimmed, FlwrFedTrimmedAvg) and trimmed.beta == 0.25
    assert trimmed.local_config(1, 1.0) == {"lr": 0.5, "momentum": 0.9, "local-steps": 2, "batch-size": 25}
    # the same w^0 as FedREP's strategies (torch's seeded default initialisation)
    np.testing.assert_array_equal(krum.x, build_strategy(cfg_of("fedrep-fedavg"), evaluate=False).global_model())
    used = ALGORITHMS["flwr-fedmedian"].used_config(cfg)
    assert "foe-eps" in used and "buffer-size" not in used and "tmean-fraction" not in used
    assert "tmean-fraction" in ALGORITHMS["flwr-fedtrimmedavg"].used_config(cfg)
    with pytest.raises(FlowerOnlyError, match="needs a Flower Grid"):
        run_inprocess(cfg_of("flwr-fedmedian"), evaluate=False)


# ------------------------------------------------------------------ the simulation-only oracle
def test_oracle_replaces_only_the_byzantine_replies() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=6)
    updates = {pid: rng.normal(size=6) for pid in (2, 0, 3, 1)}
    byzantine = {0, 3, 7}  # 7 sent nothing: ignored

    def reply(model: NDArray[Any], metrics: dict[str, int]) -> RecordDict:
        arrays = ArrayRecord([model.astype(np.float32).reshape(2, 3)])
        return RecordDict({"arrays": arrays, "metrics": MetricRecord({**metrics, "num-examples": 10})})

    contents = [reply(w - u, {"partition-id": pid}) for pid, u in updates.items()]
    contents.append(reply(w + 100.0, {}))  # no partition id: neither forged nor in the honest statistics
    before = [flat(c) for c in contents]
    sent = {pid: w - flat(c) for pid, c in zip(updates, contents, strict=False)}  # the float32 updates
    honest = np.stack([sent[2], sent[1]])
    for attack, kw, forged in (
        ("foe", {"eps": 2.0, "z": None}, -2.0 * honest.mean(axis=0)),
        ("alie", {"eps": 0.5, "z": 1.0}, honest.mean(axis=0) - honest.std(axis=0, ddof=1)),
    ):
        out = forge_byzantine_replies(contents, w, OmniscientOracle(byzantine=frozenset(byzantine), values=attack, **kw))
        assert len(out) == len(contents)
        for i, (pid, new) in enumerate(zip([*updates, None], out, strict=True)):
            if pid in byzantine:
                assert new is not contents[i]
                arr = new.array_records["arrays"].to_numpy_ndarrays()
                assert list(new.array_records["arrays"]) == ["0"] and arr[0].shape == (2, 3) and arr[0].dtype == np.float32
                np.testing.assert_allclose(flat(new), w - forged, rtol=0, atol=1e-6)
                assert dict(new.metric_records["metrics"]) == dict(contents[i].metric_records["metrics"])
            else:
                assert new is contents[i]
        for c, b in zip(contents, before, strict=True):  # the inputs are never modified
            np.testing.assert_array_equal(flat(c), b)
    with pytest.raises(ValueError, match="partition-id 2"):
        forge_byzantine_replies([contents[0], contents[0]], w, OmniscientOracle(frozenset(byzantine), "foe"))


# ------------------------------------------------------------------ Flower's rules on a stub Grid (no engine)
class StubGrid:
    def __init__(self, n: int) -> None:
        self.n = n

    def get_node_ids(self) -> list[int]:
        return list(range(self.n))


def stub_rounds(
    cfg: RunConfig, rounds: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[FedREPLocalMixin, list[tuple[NDArray[np.float64], dict[int, NDArray[np.float64]], NDArray[np.float64],
                                        dict[str, float]]]]:
    """Run Flower's configure_train / aggregate_train with our clients answering; the strategy and, per round,
    (w^t, partition id -> the model its client sent, w^{t+1}, the round's diagnostics)."""
    for attr in ("_run_id", "_node_id", "_task_id"):  # what the ServerApp runtime would set
        monkeypatch.setattr(TaskIdentity, attr, 0)
    strategy = build_strategy(cfg, evaluate=False)
    assert isinstance(strategy, FedREPLocalMixin)
    contexts = make_contexts(cfg)
    arrays = strategy.current_arrays()
    out = []
    for rnd in range(1, rounds + 1):
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(), StubGrid(cfg.num_clients)))  # type: ignore[arg-type]
        assert len(msgs) == cfg.num_clients and all(m.content["config"]["lr"] == cfg.lr for m in msgs)
        replies = [Message(handle("train", m.content, contexts[m.metadata.dst_node_id]), reply_to=m) for m in msgs]
        sent = {pid_of(r.content): flat(r.content) for r in replies}
        w_t = strategy.x.copy()
        new, _ = strategy.aggregate_train(rnd, replies)
        assert new is not None
        out.append((w_t, sent, strategy.x.copy(), dict(strategy._acc["diag"])))
        assert list(new) == list(arrays)  # the state dict's names come back
        arrays = new
    return strategy, out


def test_trimmed_avg_with_beta_zero_is_fedrep_fedavg(monkeypatch: pytest.MonkeyPatch) -> None:
    """beta = 0 cuts nothing: Flower's mean of the models = FedREP's mean of the updates, same local algorithm."""
    s, _ = stub_rounds(cfg_of("flwr-fedtrimmedavg", **{"tmean-fraction": 0.0}), 2, monkeypatch)
    np.testing.assert_allclose(s.x, fedrep_fedavg(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("alg", ["flwr-krum", "flwr-fedmedian", "flwr-fedtrimmedavg"])
def test_each_rule_is_the_papers_rule_on_the_updates(alg: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FoE (eps = 10, 1 of 4 Byzantine): w^{t+1} = w^t - Agg(updates), with the forged update and Agg both
    computed here independently (float64) from the honest clients' models."""
    cfg = cfg_of(alg, **{**FOE, "tmean-fraction": 0.25})
    byz = attacks.byzantine_ids(4, 1, cfg.seed)
    for w_t, sent, w_next, diag in stub_rounds(cfg, 2, monkeypatch)[1]:
        pids = sorted(sent)
        honest = np.stack([w_t - sent[p] for p in pids if p not in byz])
        upd = np.stack([-10.0 * honest.mean(axis=0) if p in byz else w_t - sent[p] for p in pids])
        if alg == "flwr-krum":  # score: sum of squared distances to the n - f - 2 = 1 nearest others
            d2 = ((upd[:, None, :] - upd[None, :, :]) ** 2).sum(axis=-1)
            scores = np.array([np.sort(np.delete(row, i))[:1].sum() for i, row in enumerate(d2)])
            chosen = pids.index(int(diag["krum_selected"]))
            # two mutual nearest neighbours tie with 1 neighbour each: either is Krum's choice (Flower's float32
            # distances break the tie)
            assert scores[chosen] <= scores.min() * (1 + 1e-4) and pids[chosen] not in byz
            expected = upd[chosen]
        elif alg == "flwr-fedmedian":
            expected = np.median(upd, axis=0)
        else:
            expected = robust.trimmed_mean(upd, 0.25)  # int(0.25 * 4) = 1 cut per side
        assert diag["forged"] == 1
        np.testing.assert_allclose(w_next, w_t - expected, rtol=0, atol=2e-6)


def test_byzantine_bit_flip_client_returns_the_flipped_update() -> None:
    flip = cfg_of("flwr-fedmedian", **{"byzantine-clients": 1, "attack": "bit-flip"})
    honest = cfg_of("flwr-fedmedian")
    pid = attacks.byzantine_ids(4, 1, flip.seed)[0]
    s = build_strategy(honest, evaluate=False)
    w = s.global_model()
    content = RecordDict({"arrays": s.current_arrays(), "config": ConfigRecord({"server-round": 1,
                                                                                **s.local_config(1, 1.0)})})
    got = {}
    for name, cfg in (("flip", flip), ("honest", honest)):
        ctx = make_contexts(cfg)[pid]
        reply = handle("train", content, ctx)
        assert reply["metrics"]["partition-id"] == pid and reply["metrics"]["num-examples"] == 15000
        got[name] = flat(reply)
        assert "m" in ctx.state.array_records  # the momentum persists, as for FedREPClient
        assert list(reply["arrays"]) == list(content["arrays"])  # the reply keeps the state dict's names
    np.testing.assert_allclose(got["flip"], 2.0 * w - got["honest"], rtol=0, atol=1e-6)


# ------------------------------------------------------------------ real Flower runs (`flwr run`)
def flower(tmp_path: Path, alg: str, **over: Any) -> tuple[dict[str, Any], NDArray[np.float64]]:
    out = tmp_path / alg
    res = run_flower({**BASE, "algorithm": alg, **over}, out, num_supernodes=4, stream=False)
    assert res.status == "finished:completed"
    doc = json.loads(res.results.read_text())
    assert doc["engine"] == "flower-simulation" and [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["clients"] == 4 and r["uplink_bytes"] > 0
    return doc, np.load(out / "model.npy")


# FedTrimmedAvg with beta = 0 equals FedREP's FedAvg on the stub Grid above (test_trimmed_avg_with_beta_zero_is_
# fedrep_fedavg); through `flwr run` it would take the same path as Krum below (FedREPLocalMixin on Flower's
# strategy, the same ClientApp), one run's start-up (about 20 s of CPU) for nothing new.
@pytest.mark.flower
def test_flower_krum_run_resists_foe(tmp_path: Path) -> None:
    """FoE (eps = 10, 1 of 4 Byzantine): the forged model is never selected, and Krum ends closer to the attack-free
    mean (fedrep-fedavg, same seed) than the undefended mean under the same attack does."""
    doc, model = flower(tmp_path, "flwr-krum", **FOE)
    byz = attacks.byzantine_ids(4, 1, 0)
    assert all(r["forged"] == 1 and r["krum_selected"] not in byz for r in doc["rounds"])
    honest = fedrep_fedavg()
    attacked = fedrep_fedavg(**FOE)
    # measured (MNIST): 0.029 (Krum, one honest client's model) vs 0.139 (the mean, pushed against the honest direction)
    assert np.linalg.norm(model - honest) < np.linalg.norm(attacked - honest)
