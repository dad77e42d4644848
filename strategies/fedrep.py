"""FedREP server (Alg. 1 of Yang, Wang, Li, "FedREP: A Byzantine-Robust, Communication-Efficient and
Privacy-Preserving Framework for Federated Learning", arXiv 2303.05206; spec shared/specs/fedrep.md 3.4, 10.3).

One FedREP iteration is one Flower round of exactly two message exchanges (DESIGN.md: each exchange costs about
6 s in a deployment, so there is no third):

1. ``query.propose`` to all m clients (sent from ``configure_train`` through the Grid): the downlink of the last
   round's sparse aggregate (I^{t-1}, G~^{t-1}) -- or the dense model for a client that is not in sync -- and the
   learning rate. Replies: each client's k = K/m proposed coordinates and a fresh public key. The server takes
   the union I^t (S1), draws a fresh random partition into buffers of size s (S2).
2. ``train`` to the buffered clients: I^t, the buffer id and the buffer-mates' public keys (S3). Replies: g[I^t]
   masked with pairwise one-time pads (``secagg-mode = masked``) so that the server learns only each buffer's
   mean b_l (S4); the robust aggregator over the buffer means gives G~^t (S5) and w^{t+1} = w^t - G~^t (S7).

Failures never stall a round (spec 4.3 "Dropouts"): a client that fails phase 1 is left out of this round's
buffers; a buffer with a member missing in phase 2 (or a malformed upload) is discarded and the aggregator runs
on the others. ``share`` is the same protocol with k = d (SHARE of Velicheti et al. 2021, spec 7.3): nothing to
propose, every coordinate aggregated. ``fedrep-fedavg`` is plain averaging of the individual clients' dense
updates with the same local algorithm (k = d, s = 1, plain mode, mean): the undefended baseline.

Simulation-only adversary (spec 10.4): with ``secagg-mode = plain`` the server sees individual vectors and an
oracle replaces the Byzantine clients' uploads by ALIE or FoE vectors computed from the honest ones, and their
proposals by an honest one ("same"). With real masking this is impossible by design, and the run config refuses
those attacks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import RecordDict
from flwr.common.logger import log
from numpy.typing import NDArray

from clients.fedrep import initial_weights, model_crc
from fedapp import attacks, robust
from fedapp.algorithms.fedrep import learning_rate, server_step
from fedapp.compression import conspar
from fedapp.compression.codec import MalformedPayload
from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.sampling import rng_for
from fedapp.strategy_base import FederatedStrategy, Scalar, client_error_text
from fedapp.task import Evaluator, build_net
from fedapp.wire import train_content

PROPOSE = "query.propose"
STREAM_BUFFERS, STREAM_ORACLE, STREAM_SANITIZE = 20, 21, 22
MAX_KEY_BYTES = 512


class FedREP(FederatedStrategy):
    """FedREP: ConSpar + buffered secure aggregation + robust aggregation (keys ``fedrep``, ``share``).

    Parameters
    ----------
    cfg
        Run config: num-clients m (all participate every round), model (a torch network), conspar-fraction K/d,
        conspar-alpha, buffer-size s, secagg-mode, aggregator (+ geomed-iters, tmean-fraction, cclip-tau,
        cclip-iters), lr, lr-decay-round, sparse-downlink, byzantine-clients, attack, coord-attack, alie-z,
        foe-eps, seed.
    evaluator
        Central test-set evaluation; None skips it.
    """

    #: True for SHARE: k = d, every coordinate aggregated, no proposal phase content
    share = False
    #: the undefended baseline fixes s = 1, plain uploads and the mean (whatever the run config says)
    fixed: ClassVar[dict[str, Any]] = {}
    #: privacy of the coordinates is Theorem 2's epsilon, not a DP accountant's: no eps(36) line
    privacy_label = "eps(Thm 2)"

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None = None) -> None:
        self.net = build_net(cfg)
        self.dim = self.net.dim
        self.mode: str = self.fixed.get("secagg_mode", cfg.secagg_mode)
        self.buffer_size: int = self.fixed.get("buffer_size", cfg.buffer_size)
        self.aggregator: str = self.fixed.get("aggregator", cfg.aggregator)
        m = cfg.num_clients
        self.k = self.dim if self.share else conspar.k_per_client(cfg.conspar_fraction, self.net.num_trainable, m)
        self.byzantine = set(attacks.byzantine_ids(m, cfg.byzantine_clients, cfg.seed))
        self.w: NDArray[np.float32] = initial_weights(cfg, self.net)
        self.synced: set[int] = set(range(m)) if cfg.sparse_downlink else set()  # clients that can build w^0
        empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
        self.last_update: tuple[NDArray[np.int64], NDArray[np.float32]] = empty
        self.rs: dict[str, Any] = {}  # the current round's I^t, buffers, keys (server state of one round)
        super().__init__(cfg, evaluator)
        if cfg.byzantine_clients and cfg.byzantine_clients >= math.ceil(m / (2 * self.buffer_size)):
            log(WARNING, "%d Byzantine clients can contaminate half of the %d buffers: no robust aggregator can "
                "hold (spec 3.1 needs f < m/(2s))", cfg.byzantine_clients, m // self.buffer_size)

    def initial_model(self) -> FloatArray:
        """w^0 (torch's seeded default initialisation, the same on every client)."""
        return self.w.astype(np.float64)

    def global_model(self) -> FloatArray:
        return self.w.astype(np.float64)

    def summary(self) -> None:
        c = self.cfg
        log(INFO, "%s: m=%d d=%d k=%d (K=%d) s=%d agg=%s mode=%s byzantine=%s attack=%s/%s rounds=%d",
            type(self).__name__, c.num_clients, self.dim, self.k, self.k * c.num_clients, self.buffer_size,
            self.aggregator, self.mode, sorted(self.byzantine), c.attack, c.coord_attack, c.num_server_rounds)

    # ------------------------------------------------------------------ phase 1: propose
    def pre_train_contents(self, server_round: int) -> list[tuple[int, str, RecordDict]]:
        """query.propose to every client: the sparse aggregate (or the dense model) and the round's lr."""
        c = self.cfg
        base: dict[str, Scalar] = {
            "server-round": server_round, "lr": learning_rate(c.lr, server_round, c.lr_decay_round), "k": self.k,
            "model-crc": model_crc(self.w), "masked": self.mode == "masked",
        }
        idx, vals = self.last_update
        # An update on every coordinate (k = d: SHARE, dense FedAvg) goes without its index list: empty indices
        # with d values mean "all coordinates" (half the bytes of listing them).
        wire_idx = np.zeros(0, dtype=np.uint32) if len(idx) == self.dim else idx.astype(np.uint32)
        sparse = train_content([wire_idx, vals], {**base, "dense-model": False})
        dense = train_content([self.w], {**base, "dense-model": True})
        out = []
        for pid in range(c.num_clients):
            content = sparse if pid in self.synced else dense
            self.count_down(content)
            out.append((self.node_of[pid], PROPOSE, content))
        self.last_update = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
        return out

    def _decode_proposal(self, server_round: int, pid: int, content: RecordDict) -> tuple[NDArray[np.int64], bytes]:
        if "arrays" not in content.array_records:
            raise MalformedPayload("propose reply must carry an ArrayRecord 'arrays'")
        arrays = content.array_records["arrays"].to_numpy_ndarrays()
        want = 2 if self.mode == "masked" else 1
        if len(arrays) != want:
            raise MalformedPayload(f"propose reply has {len(arrays)} arrays, expected {want}")
        raw = arrays[0]
        if self.k >= self.dim:
            if raw.size:
                raise MalformedPayload("with k = d (SHARE) the proposal must be empty")
            prop = np.zeros(0, dtype=np.int64)
        else:
            rng = rng_for(self.cfg.seed, STREAM_SANITIZE, server_round, pid)
            prop = conspar.sanitize_proposal(raw, self.dim, self.k, rng)
        key = b""
        if want == 2:
            from fedapp import secagg

            pk = arrays[1]
            if pk.dtype != np.uint8 or pk.ndim != 1 or not 0 < pk.size <= MAX_KEY_BYTES:
                raise MalformedPayload("public key must be a 1-D uint8 array of at most 512 bytes")
            key = pk.tobytes()
            secagg.check_public_key(key)
        return prop, key

    def consume_pre_train(self, server_round: int, replies: Sequence[tuple[int, RecordDict | str]]) -> None:
        """S1-S2: validate the proposals, take the union I^t, draw the buffers."""
        c = self.cfg
        proposals: dict[int, NDArray[np.int64]] = {}
        keys: dict[int, bytes] = {}
        losses: list[float] = []
        for node_id, content in replies:
            pid = self.pid_of.get(node_id)
            if isinstance(content, str) or pid is None:
                why = client_error_text(content) if isinstance(content, str) else "unknown node"
                self._reject(server_round, node_id, f"propose: {why}")
                if pid is not None:
                    self.synced.discard(pid)  # it may not hold w^t: send it the dense model next round
                continue
            self.count_up(content)
            try:
                proposals[pid], keys[pid] = self._decode_proposal(server_round, pid, content)
            except (MalformedPayload, ValueError, TypeError) as err:
                self._reject(server_round, node_id, f"propose: {err}")
                continue
            if c.sparse_downlink:
                self.synced.add(pid)
            loss = content.metric_records["metrics"].get("train_loss") if "metrics" in content.metric_records else None
            if isinstance(loss, int | float) and math.isfinite(loss):
                losses.append(float(loss))
        if c.coord_attack == "same" and self.k < self.dim:  # simulation oracle: copy an honest proposal
            honest = [p for pid, p in proposals.items() if pid not in self.byzantine]
            rng = rng_for(c.seed, STREAM_ORACLE, server_round)
            for pid in sorted(self.byzantine & set(proposals)):
                proposals[pid] = attacks.same_attack(honest, rng)
        if self.k >= self.dim:
            consensus = np.arange(self.dim, dtype=np.int64)
        else:
            consensus = conspar.consensus(list(proposals.values()), self.dim, self.k)

        buffers, left_out = self.make_buffers(sorted(proposals), server_round)
        if left_out:
            log(WARNING, "round %d: clients %s left out of the buffers (incomplete buffer)", server_round, left_out)
        self.rs = {
            "I": consensus, "buffers": buffers, "keys": keys, "losses": losses,
            "buffer_of": {pid: b for b, members in enumerate(buffers) for pid in members},
            "I_wire": consensus.astype(np.uint32) if self.k < self.dim else np.zeros(0, dtype=np.uint32),
        }

    def make_buffers(self, present: list[int], server_round: int) -> tuple[list[list[int]], list[int]]:
        """S2: a fresh uniformly random partition of the present clients into buffers of size s (+ the left-out)."""
        from fedapp import secagg

        return secagg.buffer_partition(present, self.buffer_size, rng_for(self.cfg.seed, STREAM_BUFFERS, server_round))

    # ------------------------------------------------------------------ phase 2: submit
    def participants(self, server_round: int) -> list[int]:
        """The clients placed in a buffer this round (all m unless some failed phase 1)."""
        return sorted(self.rs.get("buffer_of", {}))

    def client_payload(self, server_round: int, partition_id: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        b = self.rs["buffer_of"][partition_id]
        config: dict[str, Any] = {"buffer-id": b, "masked": self.mode == "masked"}
        if self.mode == "masked":
            peers = [p for p in self.rs["buffers"][b] if p != partition_id]
            config["peer-ids"] = peers
            config["peer-keys"] = [self.rs["keys"][p] for p in peers]
        return [self.rs["I_wire"]], config

    def decode_update(self, server_round: int, partition_id: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        n = len(self.rs["I"])
        if len(arrays) != 1:
            raise MalformedPayload(f"submit reply has {len(arrays)} arrays, expected 1")
        x = arrays[0]
        want = np.uint32 if self.mode == "masked" else np.float32
        if x.dtype != want or x.shape != (n,):
            raise MalformedPayload(f"upload must be {np.dtype(want).name} of shape ({n},), got {x.dtype} {x.shape}")
        if want == np.float32 and not np.all(np.isfinite(x)):
            raise MalformedPayload("upload has non-finite values")
        return x

    def buffer_means(self, server_round: int, updates: dict[int, Any]) -> tuple[list[FloatArray], list[int]]:
        """S4: the mean of each complete buffer (decoded from the masked sums, or computed in plain mode)."""
        buffers: list[list[int]] = self.rs["buffers"]
        if self.mode == "masked":
            from fedapp import secagg

            means_by_id, discarded = secagg.decode_buffers(updates, buffers, length=len(self.rs["I"]))
            return [means_by_id[b] for b in sorted(means_by_id)], list(discarded)
        vecs = {pid: np.asarray(v, dtype=np.float64) for pid, v in updates.items()}
        c = self.cfg
        if c.attack in ("alie", "foe"):  # simulation oracle (plain mode only)
            vecs = attacks.apply_value_attack(
                c.attack, vecs, self.byzantine & set(vecs), eps=c.foe_eps,
                z=attacks.alie_z(c.num_clients, c.byzantine_clients, c.alie_z) if c.byzantine_clients else 0.0,
            )
        means, discarded = [], []
        for b, members in enumerate(buffers):
            if all(p in vecs for p in members):
                means.append(np.mean([vecs[p] for p in members], axis=0))
            else:
                discarded.append(b)
        return means, discarded

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """S4-S7: buffer means -> robust aggregate G~^t on I^t -> w^{t+1} = w^t - G~^t."""
        c = self.cfg
        means, discarded = self.buffer_means(server_round, updates)
        if discarded:
            log(WARNING, "round %d: buffer(s) %s discarded (a member missing or malformed)", server_round, discarded)
        idx: NDArray[np.int64] = self.rs["I"]
        diag = {
            "consensus_size": float(len(idx)), "gamma": len(idx) / self.net.num_trainable,
            "buffers": float(len(means)), "discarded_buffers": float(len(discarded)),
            "mean_train_loss": float(np.mean(self.rs["losses"])) if self.rs["losses"] else float("nan"),
        }
        if not means:
            log(WARNING, "round %d: no complete buffer; the model is unchanged", server_round)
            return diag
        by_name: dict[str, dict[str, Any]] = {
            "geomed": {"iters": c.geomed_iters}, "tmean": {"trim_fraction": c.tmean_fraction},
            "cclip": {"tau": c.cclip_tau, "iters": c.cclip_iters},
        }
        params = by_name.get(self.aggregator, {})
        update = robust.aggregate(self.aggregator, np.stack(means), **params).astype(np.float32)
        self.w = server_step(self.w, idx, update.astype(np.float64))
        self.last_update = (idx, update)  # exactly the float32 values applied: clients replay them bit for bit
        diag["update_norm"] = float(np.linalg.norm(update))
        return diag

    def headline_privacy(self, priv: Any) -> tuple[float | None, float | None]:
        return None, None


class SHARE(FedREP):
    """SHARE (Velicheti, Xia, Koyejo 2021) = FedREP with k = d (spec 7.3): buffered secure + robust aggregation of
    dense updates, no sparsification (key ``share``)."""

    share = True


class DenseFedAvg(FedREP):
    """The undefended baseline in the same framework (key ``fedrep-fedavg``): every client's dense update
    w^t - w_k^{t+1} (same local Eq. (180) algorithm) averaged in the clear -- FedAvg with server step 1.
    buffer-size, secagg-mode and aggregator of the run config are ignored (s = 1, plain, mean)."""

    share = True
    fixed: ClassVar[dict[str, Any]] = {"buffer_size": 1, "secagg_mode": "plain", "aggregator": "mean"}


class SparseSecAgg(FedREP):
    """SparseSecAgg (Ergun, Sami, Guler 2021; spec 7.2, our reading in :mod:`fedapp.sparse_secagg`): every client
    uploads the coordinates of its pairwise Bernoulli location masks, additively masked so that only per-coordinate
    sums are revealed; no error compensation, no robust aggregation, one group of all clients (key
    ``sparse-secagg``). ``conspar-fraction`` is its Gamma (fraction of coordinates each client sends) and
    ``sparsesecagg-scale`` divides the sums by N (default, what the paper's best lr = 5 hints at) or by N Gamma.
    """

    share = True
    fixed: ClassVar[dict[str, Any]] = {"secagg_mode": "masked", "aggregator": "mean"}

    def make_buffers(self, present: list[int], server_round: int) -> tuple[list[list[int]], list[int]]:
        """One group: every client that answered phase 1."""
        return [present], []

    def client_payload(self, server_round: int, partition_id: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        from fedapp.sparse_secagg import location_probability

        arrays, config = super().client_payload(server_round, partition_id)
        config["p"] = location_probability(min(self.cfg.conspar_fraction, 1.0), len(self.rs["buffers"][0]))
        return arrays, config

    def decode_update(self, server_round: int, partition_id: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        if len(arrays) != 2:
            raise MalformedPayload(f"SparseSecAgg upload has {len(arrays)} arrays, expected 2 (indices, values)")
        idx, vals = arrays
        if idx.dtype != np.uint32 or vals.dtype != np.uint32 or idx.ndim != 1 or idx.shape != vals.shape:
            raise MalformedPayload("SparseSecAgg upload must be two 1-D uint32 arrays of one length")
        if idx.size and (int(idx[-1]) >= self.dim or np.any(np.diff(idx.astype(np.int64)) <= 0)):
            raise MalformedPayload(f"indices must be ascending, unique and < {self.dim}")
        return idx, vals

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        from fedapp.sparse_secagg import decode_sparse_sum

        (group,) = self.rs["buffers"]
        diag = {"buffers": 1.0, "discarded_buffers": 0.0,
                "mean_train_loss": float(np.mean(self.rs["losses"])) if self.rs["losses"] else float("nan")}
        if set(group) - set(updates):  # unmatched pairwise masks: nothing can be decoded
            log(WARNING, "round %d: %d client(s) of the group missing; the aggregate is discarded", server_round,
                len(set(group) - set(updates)))
            return {**diag, "buffers": 0.0, "discarded_buffers": 1.0}
        sums, counts = decode_sparse_sum({p: updates[p] for p in group}, self.dim)
        n = len(group)
        gamma = float(np.mean([len(updates[p][0]) for p in group])) / self.dim
        scale = n * gamma if self.cfg.sparsesecagg_scale == "sum/(N*Gamma)" else n
        idx = np.flatnonzero(counts > 0).astype(np.int64)
        update = (sums[idx] / scale).astype(np.float32)
        self.w = server_step(self.w, idx, update.astype(np.float64))
        self.last_update = (idx, update)
        return {**diag, "consensus_size": float(len(idx)), "gamma": gamma, "update_norm": float(np.linalg.norm(update))}
