"""FedREP client (Alg. 2 of Yang, Wang, Li, arXiv 2303.05206; spec shared/specs/fedrep.md 3.4): two phases.

``propose`` (message ``query.propose``, phase 1)
    Bring the local model to w^t (apply the sparse aggregate of the last round, or take the dense model), train
    I steps of Eq. (180), form the error-compensated update g = u + (w^t - w_k^{t+1}), propose k coordinates
    with ConSpar (Sec. 3.2), and, in ``secagg-mode = masked``, draw a fresh key pair for this round's buffer.
    Reply: the proposal (uint32 indices) and the public key.
``fit`` (message ``train``, phase 2)
    Receive the consensus set I^t, the buffer and the buffer-mates' public keys; upload g[I^t] -- masked with
    pairwise one-time pads so the server learns only the buffer sum -- and keep u = g with I^t zeroed.

Persistent state in ``context.state`` (spec 3.5): the error memory u, the momentum m of Eq. (180), the
pending g between the phases (with its round tag), the data cursor, the local copy of w (sparse downlink), and
the round's secret key. A pending g that was never asked for (the client was left out of phase 2) is folded
back into u at the next phase 1: nothing of it was transmitted.

A Byzantine client (simulation only: its partition id is drawn from the run seed, :func:`fedapp.attacks.byzantine_ids`)
runs this same honest pipeline and corrupts only what it transmits (spec 11.10): bit-flipping of its phase-2
values and the min / rand coordinate attacks of Appendix C.2 are applied here; ALIE, FoE and "same" need the
honest clients' messages and live in the server's simulation-only oracle (strategies/fedrep.py).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from numpy.typing import NDArray

from fedapp import attacks
from fedapp.algorithms.fedrep import local_momentum_sgd, server_step
from fedapp.client_base import FedClient
from fedapp.compression import conspar
from fedapp.config import RunConfig
from fedapp.data.sources import ArrayDataset
from fedapp.models.base import FloatArray
from fedapp.sampling import STREAM_CLIENT, STREAM_INIT, rng_for
from fedapp.task import build_net, client_dataset

# RNG streams of a client round (0 is the data order of fedapp.client_base)
STREAM_ORDER, STREAM_PROPOSE, STREAM_QUANT, STREAM_ATTACK = 10, 11, 12, 13
STATE = "fedrep"


_DATA: dict[tuple[Any, ...], ArrayDataset] = {}


def cached_partition(cfg: RunConfig, partition_id: int, num_partitions: int) -> ArrayDataset:
    """The client's partition, kept per process: a FedREP client is rebuilt twice a round, and copying its
    partition out of the dataset each time cost more than its training (measured: 20 ms vs 16 ms per message).
    A pure cache of deterministic data, not client state (that lives in context.state)."""
    key = (cfg.dataset, cfg.data_source, cfg.partitioner, cfg.seed, cfg.labels_per_client, cfg.samples_per_client,
           cfg.dirichlet_alpha, partition_id, num_partitions)
    if key not in _DATA:
        if len(_DATA) >= 256:
            _DATA.clear()
        _DATA[key] = client_dataset(cfg, partition_id, num_partitions)
    return _DATA[key]


def model_crc(w: NDArray[np.float32]) -> int:
    """CRC-32 of the float32 model bytes: server and client compare it to prove they hold the same w."""
    return zlib.crc32(np.ascontiguousarray(w, dtype=np.float32).tobytes())


def initial_weights(cfg: RunConfig, net: Any) -> NDArray[np.float32]:
    """w^0: torch's default initialisation seeded with the run seed (server and clients build the same one)."""
    return net.init(rng_for(cfg.seed, STREAM_INIT)).astype(np.float32)  # type: ignore[no-any-return]


class FedREPClient(FedClient):
    """Honest FedREP client (and, in simulation, a Byzantine one running the same code).

    Parameters
    ----------
    context
        Flower Context (node_config: partition-id / num-partitions; state: see the module docstring).
    cfg
        Run config: model, batch-size, lr, momentum, local-steps, conspar-fraction, conspar-alpha, secagg-mode,
        byzantine-clients, attack, coord-attack, seed.
    """

    #: False for SparseSecAgg: no error compensation (u stays 0)
    error_feedback = True

    def __init__(self, context: Context, cfg: RunConfig) -> None:  # no linear model: a torch network instead
        self.bind_node(context, cfg)
        self.data = cached_partition(cfg, self.partition_id, self.num_partitions)
        self.net = build_net(cfg)
        self.byzantine = self.partition_id in set(attacks.byzantine_ids(cfg.num_clients, cfg.byzantine_clients, cfg.seed))

    # ---------------------------------------------------------------- state helpers
    def _state(self) -> dict[str, Any]:
        rec = self.node_context.state.config_records.get(STATE)
        return {} if rec is None else dict(rec)

    def _save_state(self, st: dict[str, Any]) -> None:
        self.node_context.state[STATE] = ConfigRecord(st)

    def _load(self, name: str, dtype: Any) -> NDArray[Any] | None:
        rec = self.node_context.state.array_records.get(name)
        return None if rec is None else np.asarray(rec.to_numpy_ndarrays()[0], dtype=dtype)

    def _save(self, name: str, value: NDArray[Any] | None) -> None:
        if value is None:
            if name in self.node_context.state.array_records:
                del self.node_context.state.array_records[name]
            return
        self.node_context.state[name] = ArrayRecord([np.ascontiguousarray(value)])

    def _pending(self, server_round: int) -> tuple[dict[str, Any], FloatArray]:
        """The state record and the update g saved by this round's phase 1 (an error if there is none)."""
        st = self._state()
        g = self._load("g", np.float64)
        if g is None or int(st.get("pending-round", -1)) != server_round:
            raise ValueError(f"client {self.partition_id}: no pending update for round {server_round} (phase 1 missing)")
        return st, g

    def _permutation(self, epoch: int) -> NDArray[np.int64]:
        rng = rng_for(self.cfg.seed, STREAM_CLIENT, self.partition_id, STREAM_ORDER, epoch)
        return rng.permutation(len(self.data)).astype(np.int64)

    # ---------------------------------------------------------------- phase 1
    def current_model(self, parameters: list[Any], config: dict[str, Any]) -> NDArray[np.float32]:
        """w^t: the dense model if the server sent one, else the local copy plus the last sparse aggregate."""
        if config.get("dense-model", True):
            return np.asarray(parameters[0], dtype=np.float32).reshape(-1)
        w = self._load("w", np.float32)
        if w is None:
            w = initial_weights(self.cfg, self.net)
        if len(parameters) == 2 and len(parameters[1]):
            values = np.asarray(parameters[1], dtype=np.float32).astype(np.float64)
            # empty indices with d values: an update on every coordinate (k = d)
            idx = np.asarray(parameters[0], dtype=np.int64) if len(parameters[0]) else np.arange(self.net.dim)
            if idx.shape != values.shape:
                raise ValueError(f"sparse downlink has {len(idx)} indices but {len(values)} values")
            w = server_step(w, idx, values)
        if model_crc(w) != int(config["model-crc"]):
            raise ValueError(f"client {self.partition_id}: local model out of sync with the server at round "
                             f"{config['server-round']} (CRC mismatch); it needs a dense model")
        return w

    def propose(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], dict[str, Any]]:
        """Phase 1 (C1-C4 of spec 3.4): train, error-compensate, propose coordinates, new key pair."""
        cfg, t = self.cfg, int(config["server-round"])
        w = self.current_model(parameters, config)
        st = self._state()
        u = self._load("u", np.float64)
        u = np.zeros(self.net.dim) if u is None or not self.error_feedback else u
        stale = self._load("g", np.float64)
        if stale is not None and self.error_feedback:  # never asked to submit last time: nothing of g was sent
            u = stale
        res = local_momentum_sgd(
            self.net, w.astype(np.float64), self._load("m", np.float32), self.data.x, self.data.y,
            lr=float(config["lr"]), beta=cfg.momentum, steps=cfg.local_steps, batch_size=cfg.batch_size,
            cursor=int(st.get("cursor", 0)), permutation=self._permutation,
        )
        g = u + (w.astype(np.float64) - res.w)  # Alg. 2: g_k^t = u_k^t + (w^t - w_k^{t+1})
        k = int(config["k"])
        rng = self.rng(t, STREAM_PROPOSE)
        if k >= self.net.dim:
            proposal = np.zeros(0, dtype=np.int64)  # SHARE (k = d): every coordinate, nothing to send
        else:
            proposal = conspar.propose(g, k, cfg.conspar_alpha, rng)
            if self.byzantine and cfg.coord_attack == "min":  # Appendix C.2, non-omniscient attacks
                proposal = attacks.min_attack(g, k)
            elif self.byzantine and cfg.coord_attack == "rand":
                proposal = attacks.random_attack(self.net.dim, k, self.rng(t, STREAM_ATTACK))
        arrays: list[NDArray[Any]] = [proposal.astype(np.uint32)]
        if config.get("masked", False):
            from fedapp import secagg

            sk, pk = secagg.new_keypair()
            st["sk"] = sk
            arrays.append(np.frombuffer(pk, dtype=np.uint8).copy())
        st.update({"cursor": res.cursor, "pending-round": t})
        self._save("u", u)
        self._save("g", g)
        self._save("m", res.momentum)
        if cfg.sparse_downlink:  # the next round's downlink is only (I^t, G~^t): keep w^t
            self._save("w", w)
        self._save_state(st)
        return arrays, {"train_loss": res.loss}

    # ---------------------------------------------------------------- phase 2
    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        """Phase 2 (C5-C6): upload g[I^t] (masked inside the buffer), keep u = g with I^t zeroed."""
        cfg, t = self.cfg, int(config["server-round"])
        st, g = self._pending(t)
        idx = np.asarray(parameters[0], dtype=np.int64) if len(parameters[0]) else np.arange(self.net.dim)
        if idx.size and (idx.min() < 0 or idx.max() >= self.net.dim or np.any(np.diff(idx) <= 0)):
            raise ValueError("consensus set must be ascending unique indices in [0, d)")
        payload, u_next = conspar.compress(g, idx)
        if self.byzantine and cfg.attack == "bit-flip":
            payload = attacks.bit_flip(payload)
        if config.get("masked", False):
            from fedapp import secagg

            peers = dict(zip((int(p) for p in config["peer-ids"]), (bytes(b) for b in config["peer-keys"]), strict=True))
            label = secagg.mask_label(cfg.seed, t, int(config["buffer-id"]))
            upload: NDArray[Any] = secagg.masked_upload(
                payload, self.partition_id, st.pop("sk"), peers, label, self.rng(t, STREAM_QUANT)
            )
        else:
            upload = payload.astype(np.float32)
        self._save("u", u_next)
        self._save("g", None)
        st.pop("pending-round", None)
        self._save_state(st)
        return [upload], 1, {}

    def evaluate(self, parameters: list[Any], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        """Loss and accuracy of a dense model on this client's partition."""
        w: FloatArray = np.asarray(parameters[0], dtype=np.float64).ravel()
        acc, loss = self.net.evaluate(w, self.data.x, self.data.y)
        return loss, len(self.data), {"accuracy": acc}


class FlowerDenseClient(FedREPClient):
    """FedREP's local algorithm answering Flower's plain ``train`` message (keys ``flwr-krum``, ``flwr-fedmedian``,
    ``flwr-fedtrimmedavg``; strategies/flower_robust.py).

    The message carries the global model w^t (one ArrayRecord, as Flower's built-in strategies send it) and a config
    with "server-round" and, from our server, "lr". The client runs I = local-steps steps of Eq. (180) from w^t with
    the same persistent momentum, data cursor and RNG streams as :class:`FedREPClient` (so an honest client of this
    class trains exactly like one of ``fedrep-fedavg``) and replies with its model w_k^{t+1} (float32, same layout),
    "num-examples" = |D_k| and its "partition-id" (which the simulation-only oracle needs to find the Byzantine
    replies). No error memory: the whole dense model goes up every round.

    A Byzantine client with ``attack = bit-flip`` replies w^t + (w^t - w_k^{t+1}), i.e. its update flipped.
    """

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        """One local round on the dense global model; the reply is the trained model (or its flipped update)."""
        from fedapp.algorithms.fedrep import learning_rate

        cfg, t = self.cfg, int(config["server-round"])
        lr = float(config["lr"]) if "lr" in config else learning_rate(cfg.lr, t, cfg.lr_decay_round)
        if len(parameters) != 1 or np.asarray(parameters[0]).size != self.net.dim:
            raise ValueError(f"client {self.partition_id}: expected one array of {self.net.dim} model parameters")
        shape = np.asarray(parameters[0]).shape
        w = np.asarray(parameters[0], dtype=np.float32).reshape(-1).astype(np.float64)
        st = self._state()
        res = local_momentum_sgd(
            self.net, w, self._load("m", np.float32), self.data.x, self.data.y,
            lr=lr, beta=cfg.momentum, steps=cfg.local_steps, batch_size=cfg.batch_size,
            cursor=int(st.get("cursor", 0)), permutation=self._permutation,
        )
        model = res.w
        if self.byzantine and cfg.attack == "bit-flip":
            model = w - attacks.bit_flip(w - res.w)  # w^t - (-(w^t - w_k)) = w^t + (w^t - w_k)
        st["cursor"] = res.cursor
        self._save("m", res.momentum)
        self._save_state(st)
        upload = model.astype(np.float32).reshape(shape)
        return [upload], len(self.data), {"train_loss": res.loss, "partition-id": self.partition_id}


class SparseSecAggClient(FedREPClient):
    """SparseSecAgg client (:mod:`fedapp.sparse_secagg`): phase 1 trains and sends a fresh public key, phase 2 uploads
    its update on the union of its pairwise location masks, masked; no error compensation."""

    error_feedback = False

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        """Phase 2: (U_i, y_i) of the update g = w^t - w_k^{t+1}."""
        from fedapp import secagg
        from fedapp.sparse_secagg import sparse_masked_upload

        cfg, t = self.cfg, int(config["server-round"])
        st, g = self._pending(t)
        if self.byzantine and cfg.attack == "bit-flip":
            g = attacks.bit_flip(g)
        peers = dict(zip((int(p) for p in config["peer-ids"]), (bytes(b) for b in config["peer-keys"]), strict=True))
        idx, vals = sparse_masked_upload(g, self.partition_id, st.pop("sk"), peers, secagg.mask_label(cfg.seed, t, 0),
                                         float(config["p"]), self.rng(t, STREAM_QUANT))
        self._save("g", None)
        st.pop("pending-round", None)
        self._save_state(st)
        return [idx, vals], 1, {}
