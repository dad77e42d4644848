"""FedREP server (Alg. 1 of Yang, Wang, Li, "FedREP: A Byzantine-Robust, Communication-Efficient and Privacy-
Preserving Framework for Federated Learning", arXiv 2303.05206; spec shared/specs/fedrep.md 3.4, 10.3), and the
baselines built from the same pieces: SHARE, dense FedAvg and SparseSecAgg.

One FedREP iteration is one Flower round: two message exchanges with plain buffers, three with masked ones (each
exchange costs about 6 s in a deployment):

1. ``query.propose`` to all m clients (sent from ``configure_train`` through the Grid): the downlink of the last
   round's sparse aggregate (I^{t-1}, G~^{t-1}) -- or the dense model for a client that is not in sync -- and the
   round's local-algorithm settings. Replies: each client's k = K/m proposed coordinates and, when masked, its
   fresh key for this round signed by its long-term identity. The server takes the union I^t (S1) and draws a
   fresh random partition into buffers of size s (S2).
2. ``train`` to the buffered clients: I^t, the buffer and, when masked, the buffer-mates' signed keys (S3).
   Replies: g[I^t], masked inside the buffer with the threshold protocol of :mod:`fedpdm_flower.fedapp.secagg` (pairwise masks
   plus a Shamir-shared self-mask), so that the server learns only each buffer's sum (S4); plain otherwise.
3. masked only, ``query.unmask`` to the survivors of each buffer with at least t survivors (the post-train exchange
   of :class:`fedpdm_flower.strategies.base.FederatedStrategy`): each reveals, per buffer-mate, a share of its self-mask seed or
   the pairwise seed of a dropped mate, never both; the server rebuilds the survivors' exact quantized sum. Then
   the robust aggregator over the buffer means gives G~^t (S5) and w^{t+1} = w^t - G~^t (S7).

The secure aggregation is the one :class:`fedpdm_flower.strategies.wrappers.SecureBuffers` uses (server steps
:class:`fedpdm_flower.strategies.secure.BufferSecAgg`, device steps :mod:`fedpdm_flower.clients.secure`): the devices hold the security
policy, not the server. A masked round needs devices in secure mode (``FedREPClient(..., secure=SecureDevice(...))``);
such a device never sends an update in the clear, whatever a message says.

The clients are :class:`fedpdm_flower.clients.fedrep.FedREPClient` (``FedREPClient.client_app(client_fn)`` registers every
action). Failures never stall a round (spec 4.3 "Dropouts"): a client that fails phase 1 is left out of this
round's buffers; a buffer keeps its survivors' mean while at least t members upload and answer the unmask request
(t = 2 for s = 2: there a dropout discards the buffer, which no protocol can avoid), else it is discarded and the
aggregator runs on the others. A round in which no proposal is accepted raises :class:`fedpdm_flower.strategies.base.RoundFailed`.

The math is in the math layer, so that other strategies can reuse it: ConSpar in
:mod:`fedpdm_flower.fedapp.compression.conspar`, the buffers and the threshold protocol in :mod:`fedpdm_flower.fedapp.secagg`, the
aggregators in :mod:`fedpdm_flower.fedapp.robust`, the local algorithm and the server step in :mod:`fedpdm_flower.fedapp.algorithms.fedrep`.

Simulation only (spec 10.4): an :class:`fedpdm_flower.fedapp.attacks.OmniscientOracle` given as ``oracle`` replaces the
Byzantine clients' plain uploads by ALIE or FoE vectors computed from the honest ones, and their proposals by an
honest one ("same"). With masking the server cannot see individual uploads, by design: a masked strategy refuses
an ALIE / FoE oracle (proposals travel in the clear in both modes, so "same" runs in both). Without an oracle no
attack code runs.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from logging import WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.common.logger import log
from numpy.typing import NDArray

from fedpdm_flower.fedapp import secagg
from fedpdm_flower.fedapp.algorithms.fedrep import (
    buffer_indices,
    learning_rate,
    model_crc,
    server_step,
    trainable_count,
)
from fedpdm_flower.fedapp.compression import conspar
from fedpdm_flower.fedapp.compression.codec import MalformedPayload
from fedpdm_flower.fedapp.compression.conspar import ConSpar
from fedpdm_flower.fedapp.layout import FloatArray
from fedpdm_flower.fedapp.robust import CenteredClipping, Mean
from fedpdm_flower.fedapp.wire import numpy_list, train_content
from fedpdm_flower.strategies.base import ROUND_KEY, FederatedStrategy, Scalar, client_error_text
from fedpdm_flower.strategies.secure import BufferSecAgg, UnmaskPlan

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.attacks import OmniscientOracle

__all__ = ["SHARE", "DenseFedAvg", "FedREP", "SparseSecAgg"]

PROPOSE, UNMASK = "query.propose", "query.unmask"
STREAM_BUFFERS, STREAM_ORACLE, STREAM_SANITIZE = 20, 21, 22
MAX_KEY_BYTES = 512

Aggregator = Callable[[NDArray[Any]], NDArray[np.float64]]


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _count(name: str, value: Any, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return value


class FedREP(FederatedStrategy):
    """FedREP: ConSpar + buffered secure aggregation + robust aggregation over the buffer means (Alg. 1).

    All connected clients take part in every round (fraction_train is 1, Alg. 1). The model is kept in float32,
    the values every client receives, so that the sparse downlink can be replayed bit for bit by the clients.
    BatchNorm statistics are in w, and their coordinates are in every round's I^t, outside the proposals, with no
    error memory (:func:`fedpdm_flower.fedapp.algorithms.fedrep.buffer_indices`).

    For a neural network use ``local_steps=20, batch_size=None, conspar=ConSpar(0.1),
    aggregator=GeometricMedian(iters=5)``: on a small BatchNorm CNN the defaults reach 0.18 after 5 rounds and 0.70
    after 20, these 0.93 and 0.96 (docs/models-and-data.md).

    Parameters
    ----------
    conspar
        :class:`fedpdm_flower.fedapp.compression.conspar.ConSpar`: K/d and alpha (Sec. 3.2). K is a fraction of the trainable
        parameters (every floating-point array of ``initial_arrays`` except BatchNorm running statistics, spec 11.2),
        each of the m clients proposes k = round(K/m). Default ``ConSpar(fraction=0.05, alpha=0.0)`` (Sec. 5).
        None sends every coordinate (k = d, no proposals): SHARE.
    buffer_size
        s, clients per secure buffer (Sec. 3.3); the server learns only the mean of each buffer and aggregates the
        m/s means robustly. Default 2 (Sec. 5). Keep the Byzantine clients below m/(2s) (spec 3.1); with m not a
        multiple of s, the clients of a short last buffer sit out the round (drawn afresh each round).
    masked
        True (default): the threshold secure aggregation inside each buffer (:mod:`fedpdm_flower.fedapp.secagg`, Bonawitz et al.
        2017 per buffer; the devices must be in secure mode, :class:`fedpdm_flower.clients.secure.SecureDevice`), so the server
        learns only each buffer's sum; False: plain uploads (the server computes the buffer means).
    threshold
        t, survivors a masked buffer needs to be unmasked (default s // 2 + 1; 2 <= t <= s and 2t > s). With s = 2,
        t = 2: a dropout discards its buffer (the lone survivor is never unmasked).
    aggregator
        The robust aggregator over the buffer means, a callable of an (n, |I^t|) array (:mod:`fedpdm_flower.fedapp.robust`):
        ``Mean()``, ``GeometricMedian(iters=5)``, ``TrimmedMean(7/16)`` or ``CenteredClipping(tau=0.5, iters=5)``
        (default; the paper's settings, Sec. 5; CClip's tau must match the scale of the updates).
    eta0
        eta of Eq. (180), the local learning rate (default 0.5, the paper's FedREP lr, Fig. 7); the server step is 1
        (spec 3.3). The same name as the broadcast strategies' local step size.
    eta0_decay_round
        Round from which eta is multiplied by ``eta0_decay_factor`` (the paper: epoch 80 of 120, spec 3.3); None
        (default) never.
    eta0_decay_factor
        Default 0.1 (spec 3.3).
    momentum
        beta of Eq. (180), dampened and persistent across rounds (default 0.9, Sec. 5).
    local_steps
        I, local steps per round (default 1, the paper's alpha study; 5 in its RCGD-EF comparison).
    batch_size
        B (default 25, Sec. 5); None uses each client's DataLoader batch size.
    sparse_downlink
        True (default): phase 1 carries only (I^{t-1}, G~^{t-1}) to clients in sync (two-way sparsity, Sec. 3.2),
        checked by a CRC of the float32 model; False: the dense model every round.
    clients_hold_initial
        True when every client's model already holds ``initial_arrays`` (Alg. 2: "the same w^0", e.g. seeded or
        loaded from one checkpoint): round 1 then sends the sparse (empty) downlink too. Default False: the first
        downlink to each client is the dense model.
    oracle
        SIMULATION ONLY: :class:`fedpdm_flower.fedapp.attacks.OmniscientOracle` replacing the Byzantine clients' uploads (ALIE,
        FoE; needs ``masked=False``) and proposals ("same": the proposals are in the clear in both modes) from the
        honest ones. Default None.
    reproducible_buffers
        False (default): each round's buffer partition comes from the OS CSPRNG, unpredictable to anyone. True: from
        (seed, round), so a run repeats exactly, and anyone who knows the seed knows who shares a buffer (weaker;
        logged as such). The reproduction app sets it to compare drivers bit for bit.
    **federation
        :class:`fedpdm_flower.strategies.base.FederatedStrategy`'s arguments (min_available_nodes, seed, require_partition_ids,
        node_wait_s, eval_every, arrayrecord_key, configrecord_key).

    Examples
    --------
    >>> strategy = FedREP(min_available_nodes=4, conspar=ConSpar(0.05), buffer_size=2,
    ...                   aggregator=GeometricMedian(iters=5))
    >>> result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=3)
    """

    #: FedREP's w holds the floating-point buffers (spec 11.2); they are sent every round, outside the proposals
    BUFFERS = "in-vector"

    resume_unsupported = ("FedREP's round state (I^{t-1}, the clients' sync set, the buffer draw and, masked, the "
                          "devices' per-run signed keys) is not checkpointed")

    #: the phase-2 upload the clients make: "conspar" (g on I^t) or "sparse-secagg"
    upload = "conspar"

    def __init__(
        self,
        *,
        conspar: ConSpar | None = ConSpar(),  # noqa: B008 (frozen, immutable)
        buffer_size: int = 2,
        masked: bool = True,
        threshold: int | None = None,
        aggregator: Aggregator = CenteredClipping(),  # noqa: B008 (frozen, immutable)
        eta0: float = 0.5,
        eta0_decay_round: int | None = None,
        eta0_decay_factor: float = 0.1,
        momentum: float = 0.9,
        local_steps: int = 1,
        batch_size: int | None = 25,
        sparse_downlink: bool = True,
        clients_hold_initial: bool = False,
        oracle: OmniscientOracle | None = None,
        reproducible_buffers: bool = False,
        **federation: Any,
    ) -> None:
        if federation.get("fraction_train", 1.0) != 1.0:
            raise ValueError(f"fraction_train must be 1: FedREP trains every client every round (Alg. 1), got "
                             f"{federation['fraction_train']!r}")
        super().__init__(**federation)
        if conspar is not None and not isinstance(conspar, ConSpar):
            raise TypeError(f"conspar must be a ConSpar(fraction, alpha) or None, got {type(conspar).__name__}")
        self.conspar = conspar
        self.buffer_size = _count("buffer_size", buffer_size)
        if not isinstance(masked, bool):
            raise ValueError(f"masked must be True or False, got {masked!r}")
        if masked and buffer_size < 2:
            raise ValueError("masked=True needs buffer_size >= 2: a buffer of one client is its update in the clear "
                             "(use masked=False for s = 1)")
        if not callable(aggregator):
            raise TypeError(f"aggregator must be a callable of an (n, d) array, e.g. GeometricMedian(), got "
                            f"{aggregator!r}")
        if oracle is not None:
            if not callable(getattr(oracle, "forge_values", None)):
                raise TypeError(f"oracle must be a fedpdm_flower.fedapp.attacks.OmniscientOracle, got {type(oracle).__name__}")
            if masked and oracle.values != "none":
                raise ValueError(f"an omniscient {oracle.values!r} oracle needs the clients' uploads in the clear: "
                                 "masked=False (with masking the server cannot see individual vectors, by design)")
        self.masked = masked
        self.secure: BufferSecAgg | None = None
        if masked:
            t = secagg.default_threshold(buffer_size) if threshold is None else threshold
            try:
                secagg.check_threshold(buffer_size, t)
            except ValueError:
                raise ValueError(f"threshold must be an integer with 2 <= t <= s and 2t > s (s = {buffer_size}), "
                                 f"got {t!r}") from None
            self.secure = BufferSecAgg(threshold=t)
        elif threshold is not None:
            raise ValueError("threshold applies to masked buffers only (masked=False)")
        self.aggregator = aggregator
        if not isinstance(reproducible_buffers, bool):
            raise ValueError(f"reproducible_buffers must be True or False, got {reproducible_buffers!r}")
        # S2's partition: from the OS CSPRNG by default, so that nobody (a reader of the logs, a client that knows
        # the seed) can predict who shares a buffer; from the strategy's seed only when asked, for reproduction
        self.reproducible_buffers = reproducible_buffers
        self._buffer_rng = None if reproducible_buffers else np.random.default_rng(secrets.randbits(128))
        if reproducible_buffers and masked:
            log(WARNING, "FedREP(reproducible_buffers=True): buffers follow the seed (%d) and are predictable from "
                "it (weaker than the default OS-random buffers); meant for reproducing runs", self.seed)
        self.eta0 = _positive("eta0", eta0)
        if eta0_decay_round is not None:
            _count("eta0_decay_round", eta0_decay_round)
        self.eta0_decay_round = eta0_decay_round
        self.eta0_decay_factor = _positive("eta0_decay_factor", eta0_decay_factor)
        if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.local_steps = _count("local_steps", local_steps)
        self.batch_size = None if batch_size is None else _count("batch_size", batch_size)
        self.sparse_downlink = bool(sparse_downlink)
        self.clients_hold_initial = bool(clients_hold_initial)
        self.oracle = oracle
        self.w: NDArray[np.float32] = np.zeros(0, dtype=np.float32)
        self.num_trainable = 0
        self.buffer_idx = np.zeros(0, dtype=np.int64)  # coordinates of w holding BatchNorm statistics
        self.synced: set[int] | None = None  # clients holding w^t (None: not decided before round 1)
        self.last_update: tuple[NDArray[np.int64], NDArray[np.float32]] = _EMPTY
        self.rs: dict[str, Any] = {}  # the current round's I^t, buffers, keys, uploads (server state of one round)

    # ------------------------------------------------------------------ the model
    def on_initialize(self) -> None:
        """w^0 in float32 (what every client holds), and the trainable count ConSpar's K refers to."""
        assert self.layout is not None
        self.w = self.x.astype(np.float32)
        self.num_trainable = trainable_count(self.layout)
        self.buffer_idx = buffer_indices(self.layout)
        self.synced = None
        self.last_update = _EMPTY

    def global_model(self) -> FloatArray:
        return self.w.astype(np.float64)

    def set_global_model(self, x: FloatArray) -> None:
        """Start the next round from other arrays (Flower's ``configure_train`` argument): w = x in float32, and every
        client gets the dense model next (none holds this w^t to replay a sparse downlink on)."""
        if not np.all(np.isfinite(x)):
            raise ValueError("the arrays passed to configure_train hold NaN or Inf values")
        self.w = np.asarray(x, dtype=np.float32)
        self.x = self.w.astype(np.float64)
        self.synced = set() if self.synced is not None else None
        self.last_update = _EMPTY

    def client_train_metrics(self, server_round: int) -> MetricRecord | None:
        """The clients train in phase 1 (``query.propose``): the round's train metrics are the accepted proposals'
        (Flower's aggregation, as the base does for train replies). A device in secure mode keeps its metrics (a
        per-client loss in the clear would leak what the masks hide): the aggregate is then empty."""
        if self.secure is not None:
            return MetricRecord()
        self._acc["train_replies"] = self._acc.get("propose_replies", {})
        return super().client_train_metrics(server_round)

    @property
    def k(self) -> int:
        """Coordinates each client proposes (k = d without ConSpar); needs the model and the federation."""
        if self.conspar is None:
            return self.dim
        return self.conspar.k(self.num_trainable, max(1, self.num_clients))

    def attach(self, node_of: Any) -> None:
        super().attach(node_of)
        if self.num_clients % self.buffer_size:
            log(WARNING, "%d clients are not a multiple of buffer_size %d: %d sit out each round (drawn afresh)",
                self.num_clients, self.buffer_size, self.num_clients % self.buffer_size)
        if self.conspar is not None:
            self.k  # noqa: B018 -- raises now (fraction > m) rather than in round 1

    def learning_rate(self, server_round: int) -> float:
        """eta_t (spec 3.3)."""
        return learning_rate(self.eta0, server_round, self.eta0_decay_round or 0, self.eta0_decay_factor)

    # ------------------------------------------------------------------ phase 1: propose
    def propose_config(self, server_round: int) -> dict[str, Scalar]:
        """Everything the clients' phase 1 needs: the local algorithm, ConSpar, masking, the downlink's CRC."""
        cfg: dict[str, Scalar] = {
            **self.common_config(), ROUND_KEY: server_round,
            "lr": self.learning_rate(server_round), "momentum": self.momentum, "local-steps": self.local_steps,
            "k": self.k, "alpha": self.conspar.alpha if self.conspar is not None else 0.0,
            "error-feedback": self.upload == "conspar", "masked": self.masked,
            "sparse-downlink": self.sparse_downlink, "model-crc": model_crc(self.w),
        }
        if self.batch_size is not None:
            cfg["batch-size"] = self.batch_size
        if self.secure is not None:  # the devices sign this round's key for this run
            cfg[secagg.S_RUN] = self.secure.run_label
        return self.with_user_config(cfg)

    def pre_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        """query.propose to every client: the sparse aggregate (or the dense model) and the round's settings."""
        if self.synced is None:
            start_synced = self.sparse_downlink and self.clients_hold_initial
            self.synced = set(range(self.num_clients)) if start_synced else set()
        base = self.propose_config(server_round)
        idx, vals = self.last_update
        # An update on every coordinate (k = d: SHARE, dense FedAvg) goes without its index list: empty indices
        # with d values mean "all coordinates" (half the bytes of listing them).
        wire_idx = np.zeros(0, dtype=np.uint32) if len(idx) == self.dim else idx.astype(np.uint32)
        keys = {"arrays_key": self.arrayrecord_key, "config_key": self.configrecord_key}
        sparse = train_content([wire_idx, vals], {**base, "dense-model": False}, **keys)
        dense = train_content([self.w], {**base, "dense-model": True}, **keys)
        out = []
        for cid in range(self.num_clients):
            content = sparse if cid in self.synced else dense
            self.count_down(content)
            out.append((self.node_of[cid], PROPOSE, content))
        self.last_update = _EMPTY
        return out

    #: arrays of a proposal reply: the proposed indices (SparseSecAgg adds its unsigned key)
    proposal_arrays = 1

    def _decode_proposal(self, server_round: int, cid: int, content: RecordDict) -> tuple[NDArray[np.int64], list[NDArray[Any]]]:
        """The sanitized proposal of one reply, and the reply's arrays."""
        if self.arrayrecord_key not in content.array_records:
            raise MalformedPayload(f"propose reply must carry an ArrayRecord {self.arrayrecord_key!r}")
        arrays = numpy_list(content.array_records[self.arrayrecord_key])
        if len(arrays) != self.proposal_arrays:
            raise MalformedPayload(f"propose reply has {len(arrays)} arrays, expected {self.proposal_arrays}")
        raw = arrays[0]
        if self.k >= self.dim:
            if raw.size:
                raise MalformedPayload("with k = d (SHARE) the proposal must be empty")
            return np.zeros(0, dtype=np.int64), arrays
        return conspar.sanitize_proposal(raw, self.dim, self.k, self.rng(STREAM_SANITIZE, server_round, cid)), arrays

    def accept_key(self, server_round: int, node_id: int, content: RecordDict, arrays: list[NDArray[Any]]) -> bytes:
        """The key a proposal reply carries for this round's buffer: with masked buffers the device's signed key
        (kept by :class:`fedpdm_flower.strategies.secure.BufferSecAgg`; its mates check the signature); none in plain mode."""
        if self.secure is None:
            return b""
        if secagg.S_RECORD not in content.array_records or secagg.S_INFO not in content.config_records:
            raise MalformedPayload("a masked round's proposal must carry the device's signed key (records "
                                   f"{secagg.S_RECORD!r}, {secagg.S_INFO!r})")
        return self.secure.accept_key(server_round, node_id, content).public_key

    def consume_pre_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> None:
        """S1-S2: validate the proposals, take the union I^t, draw the buffers.

        Raises
        ------
        RoundFailed
            When no proposal was accepted.
        """
        assert self.synced is not None
        proposals: dict[int, NDArray[np.int64]] = {}
        keys: dict[int, bytes] = {}
        losses: list[float] = []
        for node_id, content in replies:
            cid = self.pid_of.get(node_id)
            if isinstance(content, str) or cid is None:
                why = client_error_text(content) if isinstance(content, str) else "unknown node"
                self.reject(server_round, node_id, f"propose: {why}")
                if cid is not None:
                    self.synced.discard(cid)  # it may not hold w^t: send it the dense model next round
                continue
            self.count_up(content)
            try:
                proposal, arrays = self._decode_proposal(server_round, cid, content)
                keys[cid] = self.accept_key(server_round, node_id, content, arrays)
            except (MalformedPayload, ValueError, TypeError, KeyError) as err:
                self.reject(server_round, node_id, f"propose: {err}")
                continue
            proposals[cid] = proposal
            self._acc.setdefault("propose_replies", {})[cid] = (node_id, content)
            if self.sparse_downlink:
                self.synced.add(cid)
            metrics = content.metric_records.get("metrics")
            loss = metrics.get("train_loss") if metrics is not None else None
            if isinstance(loss, int | float) and math.isfinite(loss):
                losses.append(float(loss))
        if not proposals:  # no client can submit: the round fails as a train exchange with no accepted reply would
            raise self.round_failed(server_round, f"no proposal accepted ({sum(self.round_errors().values())} of "
                                    f"{self.num_clients} rejected)")
        if self.oracle is not None and self.k < self.dim:  # SIMULATION ONLY: copy honest proposals ("same")
            proposals = self.oracle.forge_proposals(proposals, self.rng(STREAM_ORACLE, server_round))
        if self.k >= self.dim:
            consensus = np.arange(self.dim, dtype=np.int64)
        else:  # the buffers' coordinates ride along every round (fedpdm_flower.fedapp.algorithms.fedrep.buffer_indices)
            consensus = np.union1d(conspar.consensus(list(proposals.values()), self.dim, self.k), self.buffer_idx)
        buffers, left_out = self.make_buffers(sorted(proposals), server_round)
        if left_out:
            log(WARNING, "round %d: clients %s left out of the buffers (incomplete buffer)", server_round, left_out)
        mask: dict[int, tuple[dict[str, Any], ArrayRecord]] = {}
        if self.secure is not None:  # S3: each buffer's mask request with its members' signed keys
            for b, members in enumerate(buffers):
                try:
                    mask[b] = self.secure.mask_config(server_round, b, [self.node_of[c] for c in members])
                except ValueError as err:
                    log(WARNING, "round %d: buffer %d sits out: %s", server_round, b, err)
        self.rs = {
            "I": consensus, "buffers": buffers, "keys": keys, "losses": losses, "mask": mask,
            "buffer_of": {cid: b for b, members in enumerate(buffers) for cid in members
                          if self.secure is None or b in mask},
            "I_wire": consensus.astype(np.uint32) if self.k < self.dim else np.zeros(0, dtype=np.uint32),
        }

    def on_readmit(self, client: int, old_node: int, new_node: int) -> None:
        """A restarted client holds no w^t (its context.state is empty): send it the dense model next."""
        if self.synced is not None:
            self.synced.discard(client)

    def make_buffers(self, present: list[int], server_round: int) -> tuple[list[list[int]], list[int]]:
        """S2: a fresh uniformly random partition of the present clients into buffers of size s (+ the left-out),
        from the OS CSPRNG (``reproducible_buffers=False``, default) or from (seed, round)."""
        from fedpdm_flower.fedapp import secagg

        rng = self.rng(STREAM_BUFFERS, server_round) if self._buffer_rng is None else self._buffer_rng
        return secagg.buffer_partition(present, self.buffer_size, rng)

    # ------------------------------------------------------------------ phase 2: submit
    def participants(self, server_round: int) -> list[int]:
        """The clients placed in a buffer this round (all of them unless some failed phase 1)."""
        return sorted(self.rs.get("buffer_of", {}))

    def client_payload(self, server_round: int, client: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        b = self.rs["buffer_of"][client]
        config: dict[str, Any] = {"buffer-id": b, "masked": self.masked, "upload": self.upload}
        if self.secure is not None:
            config.update(self.rs["mask"][b][0])
        return [self.rs["I_wire"]], config

    def client_records(self, server_round: int, client: int) -> dict[str, ArrayRecord]:
        """Masked: the buffer-mates' signed keys (record ``secure``), which each device checks itself."""
        if self.secure is None:
            return {}
        return {secagg.S_RECORD: self.rs["mask"][self.rs["buffer_of"][client]][1]}

    def decode_reply(self, server_round: int, client: int, content: RecordDict) -> tuple[Any, dict[str, Any]]:
        """Masked: the device's masked upload (record ``secure``: g[I^t] masked, the sealed shares of its self-mask
        seed, the seed's commitment) and its metrics; plain: as every strategy (:meth:`decode_update`)."""
        if self.secure is None:
            return super().decode_reply(server_round, client, content)
        metrics = self.validate_metrics(content)
        members = [self.node_of[c] for c in self.rs["buffers"][self.rs["buffer_of"][client]]]
        return self.secure.parse_upload(content, self.node_of[client], members, len(self.rs["I"])), metrics

    def decode_update(self, server_round: int, client: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        n = len(self.rs["I"])
        if len(arrays) != 1:
            raise MalformedPayload(f"submit reply has {len(arrays)} arrays, expected 1")
        x = arrays[0]
        if x.dtype != np.float32 or x.shape != (n,):
            raise MalformedPayload(f"upload must be float32 of shape ({n},), got {x.dtype} {x.shape}")
        if not np.all(np.isfinite(x)):
            raise MalformedPayload("upload has non-finite values")
        return x

    def update_vector(self, server_round: int, client: int, update: Any) -> FloatArray | None:
        """A plain upload is the update on I^t itself; a masked one cannot be screened (the buffer means are,
        by the robust aggregator)."""
        return None if self.masked else np.asarray(update, dtype=np.float64)

    def buffer_means(self, server_round: int, updates: dict[int, Any]) -> tuple[list[FloatArray], list[int]]:
        """S4 with plain uploads: the mean of each complete buffer."""
        buffers: list[list[int]] = self.rs["buffers"]
        vecs = {cid: np.asarray(v, dtype=np.float64) for cid, v in updates.items()}
        if self.oracle is not None:  # SIMULATION ONLY: ALIE / FoE from the honest plain uploads
            vecs = self.oracle.forge_values(vecs)
        means, discarded = [], []
        for b, members in enumerate(buffers):
            if all(p in vecs for p in members):
                means.append(np.mean([vecs[p] for p in members], axis=0))
            else:
                discarded.append(b)
        return means, discarded

    def round_diagnostics(self, idx: NDArray[np.int64], buffers: int, discarded: int) -> dict[str, float]:
        losses = self.rs["losses"]
        trained = len(idx) - int(np.isin(idx, self.buffer_idx).sum())  # the buffers ride along, outside ConSpar's K
        return {"consensus_size": float(len(idx)), "gamma": trained / self.num_trainable,
                "buffers": float(buffers), "discarded_buffers": float(discarded),
                "mean_train_loss": float(np.mean(losses)) if losses else float("nan")}

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """S4-S7: buffer means -> robust aggregate G~^t on I^t -> w^{t+1} = w^t - G~^t. Masked: the uploads wait
        for the unmask exchange (:meth:`post_train_contents`), which completes the round."""
        if self.secure is not None:
            self.rs["uploads"] = updates
            return {}
        means, discarded = self.buffer_means(server_round, updates)
        if discarded:
            log(WARNING, "round %d: buffer(s) %s discarded (a member missing or malformed)", server_round, discarded)
        return self.apply_means(server_round, means, discarded)

    # ------------------------------------------------------------------ phase 3 (masked): unmask
    def post_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        """query.unmask to the survivors of each masked buffer with at least t of them; a round with nothing to
        unmask is completed here (every buffer discarded)."""
        uploads = self.rs.pop("uploads", None)
        if self.secure is None or uploads is None:
            return []
        buffers = {b: [self.node_of[c] for c in self.rs["buffers"][b]] for b in sorted(self.rs["mask"])}
        plan = self.secure.plan_unmask(server_round, buffers, {self.node_of[c]: u for c, u in uploads.items()})
        self.rs["plan"] = plan
        if not plan.messages:
            self._finish_unmask(server_round, plan, {})
            return []
        out = []
        for node, content in plan.messages.items():
            self.count_down(content)
            out.append((node, UNMASK, content))
        return out

    def consume_post_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> MetricRecord:
        """S4 masked: the survivors' answers -> each buffer's exact mean -> S5-S7."""
        plan: UnmaskPlan = self.rs.pop("plan")
        answers: dict[int, RecordDict | str] = {}
        for node_id, content in replies:
            if isinstance(content, str):
                answers[node_id] = client_error_text(content)
                self.reject(server_round, node_id, f"unmask: {answers[node_id]}")
                continue
            self.count_up(content)
            answers[node_id] = content
        return self._finish_unmask(server_round, plan, answers)

    def _finish_unmask(self, server_round: int, plan: UnmaskPlan, answers: dict[int, RecordDict | str]) -> MetricRecord:
        assert self.secure is not None
        sums, failed = self.secure.unmask(plan, answers)
        skipped = {b: "a member's key could not be used" for b in range(len(self.rs["buffers"])) if b not in self.rs["mask"]}
        why = {**skipped, **plan.discarded, **failed}
        for b in sorted(why):
            log(WARNING, "round %d: buffer %d discarded: %s", server_round, b, why[b])
        split = [(self.secure.split(total), count) for total, count in (sums[b] for b in sorted(sums))]
        means = [secagg.dequantize(q, count, self.secure.clip, self.secure.levels) for (q, _), count in split]
        clipped = sum(lost for (_, lost), _ in split)
        if clipped:
            log(WARNING, "round %d: %d coordinate(s) of the masked updates lay outside the fixed-point range [-%g, %g] "
                "and were clipped (diagnostic 'clipped')", server_round, clipped, self.secure.clip, self.secure.clip)
        diag = self.apply_means(server_round, means, sorted(why))
        self._acc["diag"] = {**self._acc.get("diag", {}), **diag, "dropped": float(plan.dropped),
                             "clipped": float(clipped), "rejected": float(self._acc.get("rejected", 0))}
        return self.round_metrics()

    def apply_means(self, server_round: int, means: list[FloatArray], discarded: list[int]) -> dict[str, float]:
        """S5-S7: the robust aggregate G~^t of the buffer means on I^t, w^{t+1} = w^t - G~^t; the diagnostics."""
        idx: NDArray[np.int64] = self.rs["I"]
        diag = self.round_diagnostics(idx, len(means), len(discarded))
        if not means:
            log(WARNING, "round %d: no complete buffer; the model is unchanged", server_round)
            return diag
        update = np.asarray(self.aggregator(np.stack(means))).astype(np.float32)
        if update.shape != idx.shape:
            raise ValueError(f"the aggregator returned shape {update.shape}, expected {idx.shape}")
        self.w = server_step(self.w, idx, update.astype(np.float64))
        self.last_update = (idx, update)  # exactly the float32 values applied: clients replay them bit for bit
        diag["update_norm"] = float(np.linalg.norm(update))
        return diag

    def describe(self) -> dict[str, Any]:
        out = {**super().describe(), "conspar": self.conspar, "buffer_size": self.buffer_size, "masked": self.masked,
               **({"threshold": self.secure.threshold} if self.secure is not None else {}),
               "aggregator": self.aggregator, "eta0": self.eta0, "eta0_decay_round": self.eta0_decay_round,
               "momentum": self.momentum, "local_steps": self.local_steps, "batch_size": self.batch_size,
               "sparse_downlink": self.sparse_downlink}
        if self.num_clients and self.layout is not None:
            out["k"] = self.k
        if self.oracle is not None:
            out["oracle (simulation only)"] = self.oracle
        return out


_EMPTY: tuple[NDArray[np.int64], NDArray[np.float32]] = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))


class SHARE(FedREP):
    """SHARE (Velicheti, Xia, Koyejo 2021) = FedREP with k = d (spec 7.3): buffered secure + robust aggregation of
    dense updates, no sparsification, no proposals.

    Parameters are those of :class:`FedREP` without ``conspar`` (defaults: s = 2, masked, CClip).
    """

    def __init__(self, **kwargs: Any) -> None:
        if "conspar" in kwargs:
            raise TypeError("SHARE aggregates every coordinate: it takes no conspar (use FedREP for ConSpar)")
        super().__init__(conspar=None, **kwargs)


class DenseFedAvg(FedREP):
    """The undefended baseline in the same framework: every client's dense update w^t - w_k^{t+1} (same local
    Eq. (180) algorithm) averaged in the clear -- FedAvg with server step 1 (s = 1, plain uploads, the mean).

    Parameters are :class:`FedREP`'s local-algorithm and federation arguments (eta0, eta0_decay_round, momentum,
    local_steps, batch_size, sparse_downlink, clients_hold_initial, oracle, ...).
    """

    def __init__(self, **kwargs: Any) -> None:
        fixed = sorted({"conspar", "buffer_size", "masked", "aggregator"} & set(kwargs))
        if fixed:
            raise TypeError(f"DenseFedAvg fixes {fixed} (k = d, s = 1, plain, mean)")
        super().__init__(conspar=None, buffer_size=1, masked=False, aggregator=Mean(), **kwargs)


class SparseSecAgg(FedREP):
    """SparseSecAgg (Ergun, Sami, Guler 2021; spec 7.2, our reading in :mod:`fedpdm_flower.fedapp.sparse_secagg`): every client
    uploads the coordinates of its pairwise Bernoulli location masks, additively masked so that only
    per-coordinate sums are revealed; no error compensation, no robust aggregation, one group of all clients.

    The baseline keeps the key exchange of the paper it reproduces: a fresh, unsigned key per client and round in
    phase 1, relayed by the server (an honest-but-curious server; not the threshold protocol FedREP's masked buffers
    use). Devices in secure mode therefore refuse it.

    Parameters
    ----------
    gamma
        Gamma, the expected fraction of the d coordinates each client sends, in (0, 1] (default 0.05, the paper's
        Fig. 6-7 setting).
    scale
        "sum/N" (default: the sums divided by the number of clients, what the paper's best lr = 5 hints at) or
        "sum/(N*Gamma)" (unbiased).
    **kwargs
        :class:`FedREP`'s local-algorithm and federation arguments (eta0, momentum, local_steps, batch_size,
        sparse_downlink, clients_hold_initial, ...).
    """

    upload = "sparse-secagg"
    proposal_arrays = 2  # the (empty) proposal and the unsigned public key

    def __init__(self, *, gamma: float = 0.05, scale: str = "sum/N", **kwargs: Any) -> None:
        fixed = sorted({"conspar", "buffer_size", "masked", "aggregator", "oracle"} & set(kwargs))
        if fixed:
            raise TypeError(f"SparseSecAgg fixes {fixed} (one masked group, no robust aggregation)")
        if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not 0 < gamma <= 1:
            raise ValueError(f"gamma must lie in (0, 1], got {gamma!r}")
        if scale not in ("sum/N", "sum/(N*Gamma)"):
            raise ValueError(f"scale must be 'sum/N' or 'sum/(N*Gamma)', got {scale!r}")
        super().__init__(conspar=None, buffer_size=2, masked=False, aggregator=Mean(), **kwargs)
        self.gamma, self.scale = float(gamma), scale

    def propose_config(self, server_round: int) -> dict[str, Scalar]:
        """FedREP's phase-1 settings, and: draw this round's (unsigned) SparseSecAgg key pair."""
        return {**super().propose_config(server_round), "sparse-secagg-key": True}

    def accept_key(self, server_round: int, node_id: int, content: RecordDict, arrays: list[NDArray[Any]]) -> bytes:
        """The client's public key for this round's pairwise masks (a PEM SECP384R1 key, checked before relaying)."""
        pk = arrays[1]
        if pk.dtype != np.uint8 or pk.ndim != 1 or not 0 < pk.size <= MAX_KEY_BYTES:
            raise MalformedPayload("public key must be a 1-D uint8 array of at most 512 bytes")
        secagg.check_public_key(pk.tobytes())
        return pk.tobytes()

    def make_buffers(self, present: list[int], server_round: int) -> tuple[list[list[int]], list[int]]:
        """One group: every client that answered phase 1."""
        return [present], []

    def client_payload(self, server_round: int, client: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        """The group's other members and their keys, the run's mask session and the location probability p."""
        from fedpdm_flower.fedapp.sparse_secagg import location_probability

        (group,) = self.rs["buffers"]
        peers = [p for p in group if p != client]
        config: dict[str, Any] = {"upload": self.upload, "masked": False, "client-id": client, "mask-session": self.seed,
                                  "peer-ids": peers, "peer-keys": [self.rs["keys"][p] for p in peers],
                                  "p": location_probability(self.gamma, len(group))}
        return [self.rs["I_wire"]], config

    def decode_update(self, server_round: int, client: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        if len(arrays) != 2:
            raise MalformedPayload(f"SparseSecAgg upload has {len(arrays)} arrays, expected 2 (indices, values)")
        idx, vals = arrays
        if idx.dtype != np.uint32 or vals.dtype != np.uint32 or idx.ndim != 1 or idx.shape != vals.shape:
            raise MalformedPayload("SparseSecAgg upload must be two 1-D uint32 arrays of one length")
        if idx.size and (int(idx[-1]) >= self.dim or np.any(np.diff(idx.astype(np.int64)) <= 0)):
            raise MalformedPayload(f"indices must be ascending, unique and < {self.dim}")
        return idx, vals

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        from fedpdm_flower.fedapp.sparse_secagg import decode_sparse_sum

        (group,) = self.rs["buffers"]
        losses = self.rs["losses"]
        diag = {"buffers": 1.0, "discarded_buffers": 0.0,
                "mean_train_loss": float(np.mean(losses)) if losses else float("nan")}
        if set(group) - set(updates):  # unmatched pairwise masks: nothing can be decoded
            log(WARNING, "round %d: %d client(s) of the group missing; the aggregate is discarded", server_round,
                len(set(group) - set(updates)))
            return {**diag, "buffers": 0.0, "discarded_buffers": 1.0}
        sums, counts = decode_sparse_sum({p: updates[p] for p in group}, self.dim)
        n = len(group)
        gamma = float(np.mean([len(updates[p][0]) for p in group])) / self.dim
        scale = n * gamma if self.scale == "sum/(N*Gamma)" else n
        idx = np.flatnonzero(counts > 0).astype(np.int64)
        update = (sums[idx] / scale).astype(np.float32)
        self.w = server_step(self.w, idx, update.astype(np.float64))
        self.last_update = (idx, update)
        return {**diag, "consensus_size": float(len(idx)), "gamma": gamma, "update_norm": float(np.linalg.norm(update))}

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        for key in ("conspar", "buffer_size", "aggregator", "masked"):
            out.pop(key, None)
        return {**out, "gamma": self.gamma, "scale": self.scale}
