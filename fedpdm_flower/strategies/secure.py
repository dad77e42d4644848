"""The server side of the threshold secure aggregation (:mod:`fedpdm_flower.fedapp.secagg`), shared by every strategy that uses it.

One implementation, two users: the :class:`fedpdm_flower.strategies.wrappers.SecureBuffers` wrapper (any Flower strategy) and
:class:`fedpdm_flower.strategies.fedrep.FedREP` (FedREP's buffers). :class:`BufferSecAgg` keeps the protocol's server state and
does each of its server steps on Flower records; the caller decides which messages carry them and when they go out:

1. :meth:`BufferSecAgg.accept_key`: keep a node's signed key for a round (the format is checked here; the signature
   is checked by the node's buffer-mates against their own trust stores -- the server is not trusted);
2. :meth:`BufferSecAgg.mask_config`: the "mask" config of one buffer and the record of its members' signed keys;
3. :meth:`BufferSecAgg.parse_upload`: a member's masked upload (masked vector, sealed shares, commitment);
4. :meth:`BufferSecAgg.plan_unmask`: per buffer with at least t survivors, the unmask request of each survivor
   (who survived, who dropped, the shares the other survivors sealed for it); a buffer below t is discarded and
   nobody in it is asked anything;
5. :meth:`BufferSecAgg.unmask`: each planned buffer's exact quantized sum of its survivors (self-mask seeds rebuilt
   from the revealed shares and checked against the commitments, the dropped members' pairwise masks removed).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from numpy.typing import NDArray

from fedpdm_flower.fedapp import secagg
from fedpdm_flower.fedapp.compression.codec import MalformedPayload
from fedpdm_flower.fedapp.secagg import (
    S_BUFFER,
    S_CLIP,
    S_COUNT,
    S_DROPPED,
    S_INFO,
    S_LEVELS,
    S_MEMBERS,
    S_PHASE,
    S_RECORD,
    S_ROUND,
    S_RUN,
    S_SURVIVORS,
    S_THRESHOLD,
)

__all__ = ["BufferPlan", "BufferSecAgg", "SignedKey", "UnmaskPlan", "Upload"]

MAX_KEY_BYTES = 512


def _record(arrays: Mapping[str, NDArray[Any]]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.require(v, requirements="C")) for k, v in arrays.items()})


def _uint8(data: bytes) -> NDArray[np.uint8]:
    return np.frombuffer(data, dtype=np.uint8).copy()


class SignedKey(NamedTuple):
    """A node's key for one round: the client id it signs with, the round, the public key and its signature."""

    client_id: int
    server_round: int
    public_key: bytes
    signature: bytes


@dataclass(frozen=True)
class Upload:
    """One member's masked upload: the masked vector, the shares it sealed for each mate (by client id), and the
    commitment to its self-mask seed."""

    masked: NDArray[np.uint32]
    shares: dict[int, bytes]
    commit: bytes


@dataclass
class BufferPlan:
    """One buffer on its way to being unmasked: its members (node ids), their client ids, the survivors' uploads."""

    buffer_id: int
    members: list[int]
    client_ids: dict[int, int]
    uploads: dict[int, Upload]

    @property
    def survivors(self) -> list[int]:
        """The members whose upload arrived (node ids, ascending)."""
        return sorted(self.uploads)

    @property
    def survivor_ids(self) -> list[int]:
        return [self.client_ids[n] for n in self.survivors]

    @property
    def dropped_ids(self) -> list[int]:
        return [self.client_ids[n] for n in self.members if n not in self.uploads]


@dataclass
class UnmaskPlan:
    """A round's unmask exchange: the request to each survivor (node -> content), the buffers it serves, the buffers
    discarded before it (buffer id -> why) and how many members dropped."""

    server_round: int
    messages: dict[int, RecordDict] = field(default_factory=dict)
    buffers: list[BufferPlan] = field(default_factory=list)
    discarded: dict[int, str] = field(default_factory=dict)
    dropped: int = 0


class BufferSecAgg:
    """The server state of the threshold protocol: the run label, the signed keys, the fixed-point code.

    Parameters
    ----------
    threshold
        t, the survivors a buffer needs to be unmasked; None: ``floor(s / 2) + 1`` of each buffer's size s. Devices
        refuse a buffer whose t is not a majority of at least 2.
    clip, levels
        The fixed-point code of the masked vectors (default [-8, 8] in 2^22 levels).
    count_clipped
        Ask each member to append how many of its coordinates the code clipped (default True), so that
        :meth:`split` reports each buffer's total: nothing is clipped silently. False for a caller whose devices
        encode their vectors themselves (distributed DP).
    """

    def __init__(self, *, threshold: int | None = None, clip: float = secagg.DEFAULT_CLIP,
                 levels: int = secagg.DEFAULT_LEVELS, count_clipped: bool = True) -> None:
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 2):
            raise ValueError(f"threshold must be an integer >= 2 or None, got {threshold!r}")
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"clip must be a finite number > 0, got {clip!r}")
        secagg._check_capacity(2, levels)
        self.threshold, self.clip, self.levels = threshold, float(clip), int(levels)
        self.count_clipped = bool(count_clipped)
        self.run_label = secrets.token_hex(16)  # fresh per run: keys and masks of another run never verify here
        self.keys: dict[int, SignedKey] = {}  # node id -> its latest signed key

    def threshold_for(self, size: int) -> int:
        """t of a buffer of ``size`` members."""
        return self.threshold if self.threshold is not None else secagg.default_threshold(size)

    # ------------------------------------------------------------------ 1. keys
    def accept_key(self, server_round: int, node: int, content: RecordDict) -> SignedKey:
        """Keep ``node``'s key for ``server_round`` from a key reply (records ``secure`` {pk, sig} and
        ``secure-info`` {client-id, round}). Raises ValueError / KeyError / TypeError for a malformed one."""
        rec = content.array_records[S_RECORD]
        pk, sig = rec["pk"].numpy(), rec["sig"].numpy()
        info = content.config_records[S_INFO]
        cid, key_round = info["client-id"], info["round"]
        if pk.dtype != np.uint8 or sig.dtype != np.uint8 or sig.shape != (64,) or not 0 < pk.size <= MAX_KEY_BYTES:
            raise ValueError("a key is uint8 bytes and its signature 64 bytes")
        secagg.check_public_key(pk.tobytes())
        if not isinstance(cid, int) or isinstance(cid, bool) or key_round != server_round:
            raise ValueError(f"the key must be for round {server_round} from an integer client id")
        key = SignedKey(int(cid), server_round, pk.tobytes(), sig.tobytes())
        self.keys[node] = key
        return key

    def has_key(self, node: int, server_round: int) -> bool:
        """Whether ``node``'s latest key is for ``server_round``."""
        key = self.keys.get(node)
        return key is not None and key.server_round == server_round

    # ------------------------------------------------------------------ 2. the mask request of a buffer
    def mask_config(self, server_round: int, buffer_id: int, members: Sequence[int]) -> tuple[dict[str, Any], ArrayRecord]:
        """The config entries and the record of signed keys (``pk.<id>``, ``sig.<id>``) every member of a buffer gets.

        Raises ValueError if a member holds no key of this round or two members claim one client id.
        """
        missing = [n for n in members if not self.has_key(n, server_round)]
        if missing:
            raise ValueError(f"node(s) {missing} hold no key of round {server_round}")
        cids = [self.keys[n].client_id for n in members]
        if len(set(cids)) != len(cids):
            raise ValueError(f"two nodes of buffer {buffer_id} claim one client id")
        peers: dict[str, NDArray[Any]] = {}
        for n in members:
            key = self.keys[n]
            peers[f"pk.{key.client_id}"] = _uint8(key.public_key)
            peers[f"sig.{key.client_id}"] = _uint8(key.signature)
        config = {S_PHASE: "mask", S_RUN: self.run_label, S_ROUND: server_round, S_BUFFER: buffer_id,
                  S_MEMBERS: json.dumps(cids), S_THRESHOLD: self.threshold_for(len(members)), S_CLIP: self.clip,
                  S_LEVELS: self.levels}
        if self.count_clipped:
            config[S_COUNT] = True
        return config, _record(peers)

    # ------------------------------------------------------------------ 3. an upload
    def parse_upload(self, content: RecordDict, node: int, members: Sequence[int], length: int) -> Upload:
        """The masked vector (uint32 of ``length``), the sealed shares for each mate and the commitment of ``node``'s
        reply; raises MalformedPayload (a ValueError) or KeyError for anything else."""
        rec = content.array_records[S_RECORD]
        masked = rec["masked"].numpy()
        length += 1 if self.count_clipped else 0  # the clipped-coordinate count rides at the end
        if masked.dtype != np.uint32 or masked.shape != (length,):
            raise MalformedPayload(f"a masked upload is uint32 of shape ({length},), got {masked.dtype} {masked.shape}")
        me = self.keys[node].client_id
        shares = {}
        for n in members:
            cid = self.keys[n].client_id
            if cid != me:
                blob = rec[f"share.{cid}"].numpy()
                if blob.dtype != np.uint8 or not 28 < blob.size <= 128:
                    raise MalformedPayload("an encrypted share is 29..128 uint8 bytes")
                shares[cid] = blob.tobytes()
        commit = rec["commit"].numpy()
        if commit.dtype != np.uint8 or commit.shape != (32,):
            raise MalformedPayload("the self-mask commitment is 32 uint8 bytes")
        return Upload(masked, shares, commit.tobytes())

    # ------------------------------------------------------------------ 4. the unmask requests
    def plan_unmask(self, server_round: int, buffers: Mapping[int, Sequence[int]],
                    uploads: Mapping[int, Upload]) -> UnmaskPlan:
        """The unmask exchange of a round: ``buffers`` maps buffer id -> member nodes, ``uploads`` the parsed uploads
        by node (what arrived). A buffer below its threshold is discarded: its survivors are asked nothing."""
        plan = UnmaskPlan(server_round)
        for b, members in buffers.items():
            cids = {n: self.keys[n].client_id for n in members}
            buffer = BufferPlan(b, list(members), cids, {n: uploads[n] for n in members if n in uploads})
            plan.dropped += len(members) - len(buffer.uploads)
            t = self.threshold_for(len(members))
            if len(buffer.uploads) < t:
                plan.discarded[b] = (f"{len(buffer.uploads)} survivor(s) of {len(members)}, below the threshold {t}: "
                                     "never unmasked")
                continue
            for n in buffer.survivors:
                me = cids[n]
                sealed = {f"share.{cids[m]}": _uint8(buffer.uploads[m].shares[me]) for m in buffer.survivors if m != n}
                plan.messages[n] = RecordDict({
                    "config": ConfigRecord({S_PHASE: "unmask", S_RUN: self.run_label, S_ROUND: server_round,
                                            S_BUFFER: b, S_SURVIVORS: json.dumps(buffer.survivor_ids),
                                            S_DROPPED: json.dumps(buffer.dropped_ids)}),
                    S_RECORD: _record(sealed) if sealed else ArrayRecord()})
            plan.buffers.append(buffer)
        return plan

    def split(self, total: NDArray[np.uint32]) -> tuple[NDArray[np.uint32], int]:
        """(the survivors' quantized sum, how many of their coordinates the fixed-point code clipped) of an unmasked
        buffer sum (0 clipped when the members were not asked to count)."""
        return secagg.split_counted(total) if self.count_clipped else (np.asarray(total, dtype=np.uint32), 0)

    # ------------------------------------------------------------------ 5. the survivors' sums
    def unmask(self, plan: UnmaskPlan, answers: Mapping[int, RecordDict | str]
               ) -> tuple[dict[int, tuple[NDArray[np.uint32], int]], dict[int, str]]:
        """``(sums, failed)``: buffer id -> (the survivors' exact quantized sum mod 2^32, their number) for each
        planned buffer whose survivors all answered well; ``failed`` maps the others to why. ``answers`` holds each
        survivor's reply content, or its error text."""
        sums: dict[int, tuple[NDArray[np.uint32], int]] = {}
        failed: dict[int, str] = {}
        for buffer in plan.buffers:
            try:
                sums[buffer.buffer_id] = (self._rebuild(plan.server_round, buffer, answers), len(buffer.survivors))
            except (MalformedPayload, KeyError, ValueError, TypeError) as err:
                failed[buffer.buffer_id] = str(err)
        return sums, failed

    def _rebuild(self, server_round: int, buffer: BufferPlan, answers: Mapping[int, RecordDict | str]) -> NDArray[np.uint32]:
        shares: dict[int, list[bytes]] = {cid: [] for cid in buffer.survivor_ids}
        pairs: dict[tuple[int, int], bytes] = {}
        for n in buffer.survivors:
            answer = answers.get(n)
            if not isinstance(answer, RecordDict):
                why = "no answer" if answer is None else answer
                raise ValueError(f"survivor {buffer.client_ids[n]} did not reveal its part ({why})")
            rec = answer.array_records[S_RECORD]
            for cid in buffer.survivor_ids:
                share = rec[f"bshare.{cid}"].numpy()
                if share.dtype != np.uint8 or share.shape != (33,):
                    raise MalformedPayload("a self-mask share is 33 uint8 bytes")
                shares[cid].append(share.tobytes())
            for j in buffer.dropped_ids:
                pseed = rec[f"pseed.{j}"].numpy()
                if pseed.dtype != np.uint8 or pseed.shape != (32,):
                    raise MalformedPayload("a pairwise seed is 32 uint8 bytes")
                pairs[(buffer.client_ids[n], j)] = pseed.tobytes()
        cids = buffer.client_ids
        return secagg.rebuild_sum({cids[n]: u.masked for n, u in buffer.uploads.items()},
                                  {cids[n]: u.commit for n, u in buffer.uploads.items()}, shares, pairs,
                                  secagg.round_label(self.run_label, server_round, buffer.buffer_id))
