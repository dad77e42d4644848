"""FedREP's masked buffers against a lying server, and their dropout recovery (issue 18, items S1, S2, S5).

Real components: FedREPClient devices in secure mode (a long-term Ed25519 identity each, one trust store) answering
every message as they would under Flower (simulations.inprocess.run_clients), and subclasses of the FedREP strategy
that break the protocol one way each. Each time the honest device must refuse with an error reply that says why,
and nothing of its update may reach the server. The dropout test checks the survivors' mean against the plain
uploads of the same clients (same seeds: identical training and proposals).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from torch import nn

from fedpdm_flower.clients.fedrep import FedREPClient
from fedpdm_flower.clients.secure import SecureDevice
from fedpdm_flower.fedapp import secagg
from fedpdm_flower.fedapp.compression import ConSpar
from fedpdm_flower.fedapp.robust import Mean
from fedpdm_flower.strategies.base import RoundFailed, record_of
from fedpdm_flower.strategies.fedrep import SHARE, DenseFedAvg, FedREP, SparseSecAgg
from simulations.inprocess import run_clients

torch.set_num_threads(1)
N = 6
IDENTITIES = [secagg.NodeIdentity.generate() for _ in range(N + 1)]  # the last one is nobody's peer: the server's
TRUST = secagg.TrustStore({i: IDENTITIES[i].public_bytes() for i in range(N)})
STEP = 2 * 8.0 / (2**22 - 1)


def data(pid: int, n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(pid)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def initial() -> ArrayRecord:
    torch.manual_seed(0)
    return ArrayRecord(nn.Linear(6, 3).state_dict())


class Transcript:
    """Mixed into a strategy: keeps every reply the server receives, by phase (an error reply as its text)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[str, list[tuple[int, RecordDict | str]]] = {"propose": [], "train": [], "unmask": []}

    def consume_pre_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> None:
        self.seen["propose"] += copy.deepcopy(list(replies))
        super().consume_pre_train(server_round, replies)  # type: ignore[misc]

    def consume_replies(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> Any:
        self.seen["train"] += copy.deepcopy(list(replies))
        return super().consume_replies(server_round, replies)  # type: ignore[misc]

    def consume_post_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> Any:
        self.seen["unmask"] += copy.deepcopy(list(replies))
        return super().consume_post_train(server_round, replies)  # type: ignore[misc]

    def errors(self, phase: str) -> list[str]:
        return [r for _, r in self.seen[phase] if isinstance(r, str)]


class HonestFedREP(Transcript, FedREP):
    pass


class Offline(FedREPClient):
    """A device that goes offline after phase 1 (its train message fails)."""

    def handle(self, message_type: str, content: RecordDict) -> RecordDict:
        if message_type == "train":
            raise RuntimeError("device went offline")
        return super().handle(message_type, content)


#: the devices' Contexts of the last drive (kept when a round fails, to look at what the devices did)
DEVICES: dict[int, Context] = {}


def drive(strategy: Any, *, rounds: int = 1, nodes: int = N, min_buffer: int = 2, offline: Sequence[int] = (),
          secure: bool = True) -> tuple[Any, dict[int, Context]]:
    DEVICES.clear()

    def client_fn(context: Context) -> FedREPClient:
        pid = int(context.node_config["partition-id"])
        DEVICES[pid] = context
        policy = SecureDevice(IDENTITIES[pid], TRUST, min_buffer=min_buffer) if secure else None
        torch.manual_seed(100 + pid)
        cls = Offline if pid in offline else FedREPClient
        return cls(nn.Linear(6, 3), data(pid), loss_fn=nn.CrossEntropyLoss(), seed=pid, secure=policy)

    return run_clients(strategy, client_fn, num_nodes=nodes, num_rounds=rounds, initial_arrays=initial())


def fedrep(cls: type[FedREP] = HonestFedREP, **kw: Any) -> Any:
    args: dict[str, Any] = {"min_available_nodes": N, "conspar": ConSpar(1.0), "buffer_size": 2, "masked": True,
                            "aggregator": Mean(), "eta0": 0.1, "local_steps": 2, "batch_size": 10, "seed": 3}
    return cls(**{**args, **kw})


def trained_in_vain() -> list[int]:
    """Devices holding a pending update: they trained in a round whose upload never happened."""
    return [pid for pid, ctx in DEVICES.items() if "g" in ctx.state.array_records]


def floats_uploaded(strategy: Any) -> list[Any]:
    """Every float array any reply carried to the server (a plain update would be one)."""
    out = []
    for phase in strategy.seen.values():
        for _, content in phase:
            if isinstance(content, RecordDict):
                out += [a.numpy() for rec in content.array_records.values() for a in rec.values()
                        if np.issubdtype(a.numpy().dtype, np.floating)]
    return out


# ----------------------------------------------------------------------------- the honest protocol
def test_the_honest_protocol_runs_three_exchanges_and_reveals_only_buffer_sums() -> None:
    s, _ = drive(fedrep(), rounds=2)
    assert [r.extra["buffers"] for r in s.history] == [3, 3] and s.rejected_total == 0
    assert len(s.seen["propose"]) == len(s.seen["train"]) == len(s.seen["unmask"]) == 2 * N
    assert floats_uploaded(s) == []  # nothing but indices, keys, masked words and shares reached the server
    for _, answer in s.seen["unmask"]:  # nobody dropped: self-mask shares only, no pairwise seed
        assert isinstance(answer, RecordDict)
        assert not [k for k in answer.array_records["secure"] if k.startswith("pseed.")]


# ----------------------------------------------------------------------------- lying servers
class PlainRound(HonestFedREP):
    """S1: the server asks for plain uploads (masked=False) although it was built masked."""

    def propose_config(self, server_round: int) -> dict[str, Any]:
        return {**super().propose_config(server_round), "masked": False}


class PlainTrain(HonestFedREP):
    """S1, later: proposals go as the protocol says, then a plain train message instead of the mask request."""

    def client_payload(self, server_round: int, client: int) -> tuple[list[Any], dict[str, Any]]:
        return [self.rs["I_wire"]], {"buffer-id": self.rs["buffer_of"][client], "masked": False, "upload": "conspar"}

    def client_records(self, server_round: int, client: int) -> dict[str, ArrayRecord]:
        return {}


def test_a_server_asking_for_plain_uploads_gets_refusals_not_updates() -> None:
    """Before (the old FedREPClient masked only if the message said masked=True): a server sending masked=False got
    every update in the clear. Now each device refuses, in phase 1 (before it trains) or in phase 2."""
    s = fedrep(PlainRound)
    with pytest.raises(RoundFailed, match="no proposal accepted"):
        drive(s)
    assert len(s.errors("propose")) == N
    assert all("secure mode" in e and "asks for plain uploads" in e for e in s.errors("propose"))
    assert trained_in_vain() == []  # refused before training
    s = fedrep(PlainTrain)
    with pytest.raises(RoundFailed, match="no reply accepted"):
        drive(s)
    assert len(s.errors("train")) == N and all("not a mask request" in e for e in s.errors("train"))
    assert floats_uploaded(s) == []
    # a plain strategy is refused the same way by devices in secure mode; a device in plain mode answers it, and
    # refuses a masked round it cannot take part in
    for plain in (DenseFedAvg(min_available_nodes=N, seed=0), SparseSecAgg(min_available_nodes=N, seed=0),
                  SHARE(min_available_nodes=N, masked=False, seed=0)):
        with pytest.raises(RoundFailed, match="secure mode"):
            drive(plain)
    with pytest.raises(RoundFailed, match="masked buffers need a device in secure mode"):
        drive(fedrep(), secure=False)
    drive(fedrep(masked=False), secure=False)


class SubstituteKey(HonestFedREP):
    """S2: the victim (client 0) is sent its buffer-mate's key replaced by the server's own, signed by the server's
    identity, so that the server could compute their pairwise mask and unmask the victim."""

    def client_records(self, server_round: int, client: int) -> dict[str, ArrayRecord]:
        records = super().client_records(server_round, client)
        if client != 0:
            return records
        mate = next(c for c in self.rs["buffers"][self.rs["buffer_of"][0]] if c != 0)
        _, pk = secagg.new_keypair()
        sig = IDENTITIES[N].sign(secagg.signing_statement(self.secure.run_label.encode(), server_round, mate, pk))
        arrays = {k: v.numpy() for k, v in records["secure"].items()}
        arrays.update({f"pk.{mate}": np.frombuffer(pk, np.uint8).copy(), f"sig.{mate}": np.frombuffer(sig, np.uint8).copy()})
        return {"secure": record_of(arrays)}


def test_a_substituted_key_is_refused_and_the_mate_is_never_unmasked_alone() -> None:
    """Before (the old FedREPClient trusted the unsigned keys the server relayed): the server could unmask the
    victim with a key of its own. Now the victim refuses; its mate, alone in the buffer, is never unmasked."""
    s, _ = drive(fedrep(SubstituteKey))
    mate = next(c for c in s.rs["buffers"][s.rs["buffer_of"][0]] if c != 0)
    assert s.errors("train") == [f"ValueError: the key of client {mate} is not signed by its trusted identity"]
    assert all(node != s.node_of[0] for node, r in s.seen["train"] if isinstance(r, RecordDict))  # no upload of 0
    assert s.node_of[mate] not in dict(s.seen["unmask"])  # the lone survivor was never asked to unmask
    assert s.history[0].extra["buffers"] == 2 and s.history[0].extra["discarded_buffers"] == 1


class PairsAgainstTriples(HonestFedREP):
    """A server that puts clients in buffers of 2 while the devices accept no fewer than 3 (in a buffer of 2 one
    colluding mate learns the other's update from the buffer sum)."""

    def make_buffers(self, present: list[int], server_round: int) -> tuple[list[list[int]], list[int]]:
        return secagg.buffer_partition(present, 2, self.rng(20, server_round))


def test_a_buffer_below_the_device_minimum_is_refused() -> None:
    s = fedrep(PairsAgainstTriples, buffer_size=3)
    with pytest.raises(RoundFailed, match="no reply accepted"):
        drive(s, min_buffer=3)
    assert len(s.errors("train")) == N
    assert all("a buffer of 2 is below this device's minimum of 3" in e for e in s.errors("train"))
    assert floats_uploaded(s) == []
    s, _ = drive(fedrep(buffer_size=3), min_buffer=3)  # the same devices take part in buffers of 3
    assert s.rejected_total == 0 and s.history[0].extra["buffers"] == 2


class BothParts(HonestFedREP):
    """S5: around the honest unmask request of each survivor, two forged ones: the first lists a mate as both
    survivor and dropped, the second (after the honest answer) says a surviving mate dropped -- either would give the
    server both the mate's self-mask share and its pairwise seed with this device, i.e. the mate's update."""

    def post_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        honest = super().post_train_contents(server_round)
        self.forged = 0
        out = []
        for node, mtype, content in honest:
            cfg = dict(content.config_records["config"])
            survivors = json.loads(str(cfg[secagg.S_SURVIVORS]))
            me = self.secure.keys[node].client_id
            mate = next(c for c in survivors if c != me)
            both = RecordDict({**dict(content.items()), "config": ConfigRecord(
                {**cfg, secagg.S_DROPPED: json.dumps([mate])})})
            dropped = RecordDict({**dict(content.items()), "config": ConfigRecord(
                {**cfg, secagg.S_SURVIVORS: json.dumps([c for c in survivors if c != mate]),
                 secagg.S_DROPPED: json.dumps([mate])})})
            out += [(node, mtype, both), (node, mtype, content), (node, mtype, dropped)]
        return out

    def consume_post_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> Any:
        replies = list(replies)
        self.forged_replies = [r for i, r in enumerate(replies) if i % 3 != 1]
        self.seen["unmask"] += copy.deepcopy(self.forged_replies)
        return FedREP.consume_post_train(self, server_round, [r for i, r in enumerate(replies) if i % 3 == 1])


def test_a_survivor_never_reveals_both_parts_of_a_mate() -> None:
    s, _ = drive(fedrep(BothParts, buffer_size=3))
    overlap, again = s.forged_replies[0::2], s.forged_replies[1::2]
    assert len(overlap) == len(again) == N
    assert all(isinstance(r, str) and "must split the buffer" in r for _, r in overlap)
    assert all(isinstance(r, str) and "already answered the unmask request of round 1 (it answers once)" in r
               for _, r in again)
    assert not [k for _, r in s.seen["unmask"] if isinstance(r, RecordDict)
                for k in r.array_records["secure"] if k.startswith("pseed.")]  # no pairwise seed left a device
    assert s.history[0].extra["buffers"] == 2 and s.history[0].extra["discarded_buffers"] == 0  # honest answers did


class ReplayKeys(HonestFedREP):
    """Round 2's mask requests carry round 1's signed keys (kept from round 1) instead of the fresh ones."""

    def consume_pre_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> None:
        super().consume_pre_train(server_round, replies)
        if server_round == 1:
            self.round1 = dict(self.secure.keys)  # node -> its signed key of round 1
            return
        for b, (cfg, _) in self.rs["mask"].items():
            old = [self.round1[self.node_of[c]] for c in self.rs["buffers"][b]]
            self.rs["mask"][b] = (cfg, record_of({
                **{f"pk.{k.client_id}": np.frombuffer(k.public_key, np.uint8).copy() for k in old},
                **{f"sig.{k.client_id}": np.frombuffer(k.signature, np.uint8).copy() for k in old}}))


class ReplayRequest(HonestFedREP):
    """Round 2 replays round 1's mask requests as they were (round number, buffers, keys)."""

    def client_payload(self, server_round: int, client: int) -> tuple[list[Any], dict[str, Any]]:
        arrays, config = super().client_payload(server_round, client)
        if server_round == 1:
            self.saved = getattr(self, "saved", {})
            self.saved[client] = (config, super().client_records(server_round, client))
            return arrays, config
        return arrays, self.saved[client][0]

    def client_records(self, server_round: int, client: int) -> dict[str, ArrayRecord]:
        if server_round == 1:
            return super().client_records(server_round, client)
        return self.saved[client][1]

    def message_config(self, server_round: int, config: Any) -> dict[str, Any]:
        return {**super().message_config(server_round, config), "server-round": int(config.get("secure.round", 0)) or server_round}


class RewindRound(HonestFedREP):
    """Round 2 is announced as round 1 again (to get a second masked upload under round 1's masks)."""

    def propose_config(self, server_round: int) -> dict[str, Any]:
        return {**super().propose_config(server_round), "server-round": 1}


def test_replayed_keys_and_rounds_are_refused() -> None:
    s = fedrep(ReplayKeys)
    with pytest.raises(RoundFailed, match="round 2: no reply accepted"):
        drive(s, rounds=2)
    round2 = s.errors("train")
    assert len(round2) == N and all("is not signed by its trusted identity" in e for e in round2)
    s = fedrep(ReplayRequest)
    with pytest.raises(RoundFailed, match="round 2: no reply accepted"):
        drive(s, rounds=2)
    assert len(s.errors("train")) == N and all("holds no key of run" in e and "round 1" in e for e in s.errors("train"))
    s = fedrep(RewindRound)
    with pytest.raises(RoundFailed, match="round 2: no proposal accepted"):
        drive(s, rounds=2)
    assert all("round 1 is not after round 1, which this node already masked" in e for e in s.errors("propose"))
    assert len(s.errors("propose")) == N and trained_in_vain() == []  # refused before training


# ----------------------------------------------------------------------------- dropouts
def test_a_buffer_of_5_with_t_3_and_two_dropouts_contributes_its_survivors_exact_mean() -> None:
    """Issue 18's case with FedREP devices: one buffer of 5, t = 3, clients 1 and 3 go offline after proposing.
    The survivors reveal the pairwise seeds they share with 1 and 3 (and nothing else of them); the update is the
    mean of the three survivors' g[I^t] -- here taken from the plain uploads of the same clients -- up to the step."""
    common = {"min_available_nodes": 5, "buffer_size": 5, "local_steps": 3}
    plain = fedrep(masked=False, **common)
    drive(plain, nodes=5, secure=False)
    masked = fedrep(threshold=3, **common)
    drive(masked, nodes=5, offline=[1, 3])
    extra = masked.history[0].extra
    assert extra["buffers"] == 1 and extra["discarded_buffers"] == 0 and extra["dropped"] == 2
    np.testing.assert_array_equal(masked.rs["I"], plain.rs["I"])  # the same training and proposals
    uploads = {plain.pid_of[n]: c.array_records["arrays"].to_numpy_ndarrays()[0].astype(np.float64)
               for n, c in plain.seen["train"] if isinstance(c, RecordDict)}
    survivors_mean = np.mean([uploads[c] for c in (0, 2, 4)], axis=0)
    w0 = np.concatenate([v.numpy().ravel() for v in initial().values()]).astype(np.float32)
    expected = w0.copy()
    expected[plain.rs["I"]] = (w0[plain.rs["I"]] - survivors_mean.astype(np.float32)).astype(np.float32)
    np.testing.assert_allclose(masked.w, expected, rtol=0, atol=2 * STEP)
    assert np.abs(masked.w - plain.w).max() > 10 * STEP  # not the mean of all five
    for _, answer in masked.seen["unmask"]:
        assert isinstance(answer, RecordDict)
        keys = set(answer.array_records["secure"])
        assert {k for k in keys if k.startswith("pseed.")} == {"pseed.1", "pseed.3"}
        assert {k for k in keys if k.startswith("bshare.")} == {"bshare.0", "bshare.2", "bshare.4"}
