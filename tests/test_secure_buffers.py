"""SecureBuffers around Flower's own FedAvg, with a user's plain ClientApp and secure_buffers_mod.

The user's app is the template-shaped linear regression of tests/test_wrappers.py; every node gets a long-term
Ed25519 identity and the same trust store. Checks against independent truth: the masked run equals plain FedAvg
up to the fixed-point step, the buffer sums equal the survivors' updates recomputed in the clear, and the server's
transcript does not give back any individual update.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp.strategy import FedAvg
from userapp import D, initial, loss, reference_update, user_app

from fedpdm_flower.clients.mods import secure_buffers_mod
from fedpdm_flower.fedapp import secagg
from fedpdm_flower.strategies.wrappers import SecureBuffers
from simulations.inprocess import LocalGrid

N = 8
IDENTITIES = [secagg.NodeIdentity.generate() for _ in range(N + 1)]  # the last one is nobody's peer
TRUST = secagg.TrustStore({i: IDENTITIES[i].public_bytes() for i in range(N)})


def secure_app(**kw: Any) -> Any:
    mod = secure_buffers_mod(identity=lambda ctx: IDENTITIES[int(ctx.node_config["partition-id"])], trust_store=TRUST,
                             **kw.pop("mod", {}))
    return user_app(mods=[mod], **kw)


def fedavg() -> FedAvg:
    return FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=N, min_train_nodes=N)


class Recorder(LocalGrid):
    """A LocalGrid that keeps every reply the server receives: the server's transcript."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.transcript: list[Message] = []

    def pull_messages(self, message_ids: Any) -> list[Message]:
        got = super().pull_messages(message_ids)
        self.transcript.extend(copy.deepcopy([m for m in got if not m.has_error()]))  # as received, before any use
        return got



def test_secure_buffers_equal_plain_fedavg_up_to_the_fixed_point_step() -> None:
    plain = fedavg().start(grid=LocalGrid(user_app(), N), initial_arrays=initial(), num_rounds=3)
    grid = Recorder(secure_app(), N)
    wrapper = SecureBuffers(fedavg(), buffer_size=4)
    secure = wrapper.start(grid=grid, initial_arrays=initial(), num_rounds=3)
    np.testing.assert_allclose(secure.arrays["w"].numpy(), plain.arrays["w"].numpy(), atol=5e-5)
    assert loss(secure.arrays) < 0.5 * loss(initial())  # it learns (3 rounds take the loss from 155 to 25)
    m = wrapper.diagnostics
    assert all(m[r]["secure.buffers"] == 2 and m[r]["secure.buffers_discarded"] == 0 for r in m)
    # round 1 needs the key exchange; later rounds use the keys that rode on the unmask replies: 3 then 2 exchanges
    phases = [str(x.content.config_records.get("secure-info", ConfigRecord()).get("round", "")) for x in grid.transcript]
    assert phases.count("1") == N and phases.count("2") == N and phases.count("3") == N and phases.count("4") == N


def test_the_servers_transcript_holds_no_individual_update() -> None:
    grid = Recorder(secure_app(), N)
    strategy = SecureBuffers(fedavg(), buffer_size=4)
    strategy.start(grid=grid, initial_arrays=initial(), num_rounds=1)
    uploads = [m for m in grid.transcript if "masked" in m.content.array_records.get("secure", {})]
    assert len(uploads) == N
    w0 = np.zeros(D)
    for reply in uploads:
        pid = strategy.keys[reply.metadata.src_node_id][0]
        truth = reference_update(pid, w0, 0.0)
        masked = reply.content.array_records["secure"]["masked"].numpy()
        # the update (scaled by its weight / max_weight = 300 / 1000), then the tail: the weight, the weighted
        # metrics (only their names are in the clear) and the clipped count
        declared = reply.content.config_records["secure-tail"]["metrics"]
        assert declared == '[["train_loss", -1]]'
        assert masked.shape == (D + 1 + secagg.tail_size([("train_loss", -1)]),)
        seen = secagg.dequantize(masked[:D + 1], 1, strategy.clip, strategy.levels) / 0.3
        # the upload alone decodes to noise uniform on [-clip, clip]: nothing like the update (|u| < 1)
        assert np.median(np.abs(seen - truth)) > 1.0
        # within 6 standard errors (1/sqrt(n)) of the zero correlation of independent vectors (0.2 was 4.5 of them:
        # a chance failure in about 6e-5 runs)
        assert abs(np.corrcoef(seen, truth)[0, 1]) < 6 / np.sqrt(len(truth))
        # the weight rides masked too: its exact code decodes to noise, not to the node's 300 examples
        assert abs(secagg.decode_exact(masked[D + 1:D + 1 + secagg.EXACT_LIMBS], 1)[0] - 300) > 1e3
    # the strongest attempt from the transcript: remove the rebuilt self-mask (the server learns it for a survivor)
    b = strategy._round["buffers"][0]
    label = secagg.round_label(strategy.run_label, 1, 0)
    node = b[0]
    cid = strategy.keys[node][0]
    answers = [m for m in grid.transcript if m.content.array_records.get("secure", {}) and
               f"bshare.{cid}" in m.content.array_records["secure"]]
    seed = secagg.combine_secret([a.content.array_records["secure"][f"bshare.{cid}"].numpy().tobytes()
                                  for a in answers])
    upload = next(r for r in uploads if r.metadata.src_node_id == node).content.array_records["secure"]["masked"].numpy()
    left = upload - secagg.self_mask(seed, label, upload.size)
    seen = secagg.dequantize(left[:D + 1], 1, strategy.clip, strategy.levels) / 0.3
    assert np.median(np.abs(seen - reference_update(cid, w0, 0.0))) > 1.0  # the pairwise masks of the mates still hide it


@pytest.mark.parametrize(("n", "size", "threshold", "offline"), [(8, 4, 3, {0}), (5, 5, 3, {0, 1})])
def test_a_buffer_survives_dropouts_down_to_its_threshold_with_the_survivors_exact_sum(
        n: int, size: int, threshold: int, offline: set[int]) -> None:
    """Buffers of 4 with t = 3 and one node offline; a buffer of 5 with t = 3 and two offline (issue 18's case):
    the buffer still contributes the exact (to the fixed-point step) mean of its survivors' updates."""
    grid = Recorder(secure_app(poison=dict.fromkeys(offline, "offline")), n)
    strategy = SecureBuffers(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n,
                                    min_train_nodes=n), buffer_size=size, threshold=threshold)
    result = strategy.start(grid=grid, initial_arrays=initial(), num_rounds=1)
    m = strategy.diagnostics[1]
    assert m["secure.dropped"] == len(offline) and m["secure.buffers_discarded"] == 0
    survivors = [strategy.keys[x][0] for buffer in strategy._round["buffers"] for x in buffer
                 if strategy.keys[x][0] not in offline]
    # FedAvg weighs the buffers by their survivor counts: the global update is the mean over all survivors
    want = np.mean([reference_update(p, np.zeros(D), 0.0) for p in survivors], axis=0)
    np.testing.assert_allclose(result.arrays["w"].numpy(), want[:D], atol=2e-5)
    np.testing.assert_allclose(result.arrays["b"].numpy(), want[D:], atol=2e-5)


def test_a_buffer_below_its_threshold_is_discarded_not_unmasked() -> None:
    grid = Recorder(secure_app(poison={0: "offline", 1: "offline"}), 4)
    strategy = SecureBuffers(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=4,
                                    min_train_nodes=4), buffer_size=4, threshold=3)
    strategy.start(grid=grid, initial_arrays=initial(), num_rounds=1)
    assert strategy.diagnostics[1]["secure.buffers_discarded"] == 1
    # nobody was asked to unmask: the two survivors' replies in the transcript are their masked uploads only
    assert not [x for x in grid.transcript if any(k.startswith("bshare.")
                                                  for k in x.content.array_records.get("secure", {}))]


def test_a_node_in_secure_mode_refuses_what_the_protocol_does_not_allow() -> None:
    app = secure_app()
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": N}, state=RecordDict(),
                  run_config={})

    def train(config: dict[str, Any], extra: dict[str, Any] | None = None) -> Message:
        from flwr.supercore.task_identity import TaskIdentity

        for attr, v in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
            if getattr(TaskIdentity, attr) is None:
                setattr(TaskIdentity, attr, v)
        content = RecordDict({"arrays": initial(), "config": ConfigRecord(config), **(extra or {})})
        msg = Message(content, dst_node_id=1, message_type="train")
        msg.metadata.__dict__["_message_id"] = "m"
        return app(msg, ctx)

    plain = train({"lr": 0.1})
    assert plain.has_error() and "secure mode" in plain.error.reason  # masked=False from a lying server: refused
    keys = train({"secure.phase": "keys", "secure.run": "r", "secure.round": 1})
    assert not keys.has_error()
    base = {"secure.phase": "mask", "secure.run": "r", "secure.round": 1, "secure.buffer": 0, "secure.threshold": 2,
            "secure.clip": 8.0, "secure.levels": 2**22}
    small = train({**base, "secure.members": "[0, 1]"})
    assert small.has_error() and "below this device's minimum of 3" in small.error.reason
    # a mate whose key is not signed by a trusted identity (the server substitutes its own key)
    _, pk = secagg.new_keypair()
    forged = {f"pk.{c}": np.frombuffer(pk, np.uint8).copy() for c in (1, 2)}
    forged.update({f"sig.{c}": np.frombuffer(IDENTITIES[N].sign(secagg.signing_statement(b"r", 1, c, pk)), np.uint8).copy()
                   for c in (1, 2)})
    sub = train({**base, "secure.members": "[0, 1, 2]"}, {"secure": _rec(forged)})
    assert sub.has_error() and "not signed by its trusted identity" in sub.error.reason
    # a stranger the device does not trust, next to an honest, trusted mate
    _, pk1 = secagg.new_keypair()
    mates = {"pk.1": np.frombuffer(pk1, np.uint8).copy(),
             "sig.1": np.frombuffer(IDENTITIES[1].sign(secagg.signing_statement(b"r", 1, 1, pk1)), np.uint8).copy(),
             "pk.99": forged["pk.1"], "sig.99": forged["sig.1"]}
    stranger = train({**base, "secure.members": "[0, 1, 99]"}, {"secure": _rec(mates)})
    assert stranger.has_error() and "not in this device's trust store" in stranger.error.reason


def _rec(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    from flwr.app import Array

    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def test_the_server_side_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="2t > s"):
        SecureBuffers(fedavg(), buffer_size=4, threshold=2)
    with pytest.raises(ValueError, match="buffer_size"):
        SecureBuffers(fedavg(), buffer_size=1)
