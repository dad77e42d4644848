"""Base NumPyClient: the partition it trains on, the model, and persistent state in `context.state`.

Flower builds a fresh client object for every message (simulation actors serve many nodes; deployment starts a
process per message), so everything that must survive a round -- dual variables, control variates, privacy
ledgers -- is read from and written back to `context.state`, never kept in the object or in module globals.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.client import NumPyClient
from numpy.typing import NDArray

from fedapp.compression.codec import FLOAT32_MAX, SparseVector, encode_dense, encode_sparse
from fedapp.compression.payload import to_arrays
from fedapp.compression.sparsify import rand_k, resolve_k, top_k
from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.privacy.accountants import PrivacyLedger
from fedapp.privacy.gaussian import (
    add_gaussian_noise,
    data_fraction,
    gaussian_noise_std,
    per_round_epsilon_eq36,
    total_privacy_eq36,
)
from fedapp.sampling import STREAM_CLIENT, rng_for
from fedapp.task import build_model, client_dataset

# RNG streams of a client round; stream 0 draws the mini-batch permutation
STREAM_NOISE, STREAM_RANDK = 1, 2


class FedClient(NumPyClient):
    """Shared client plumbing.

    Parameters
    ----------
    context
        The node's Flower Context: node_config gives partition-id / num-partitions, state persists across rounds.
    cfg
        The validated run config.
    """

    #: False: the dense vector on the wire; True: k = alpha_U d values plus their indices (sparse variants)
    sparse_uplink = False

    def __init__(self, context: Context, cfg: RunConfig) -> None:
        self.bind_node(context, cfg)
        self.data = client_dataset(cfg, self.partition_id, self.num_partitions)
        self.model = build_model(cfg)

    def bind_node(self, context: Context, cfg: RunConfig, *, check_partitions: bool = False) -> None:
        """Who this node is (partition-id / num-partitions of its node_config) and the run config; with
        ``check_partitions``, num-partitions must equal num-clients (the graph algorithms index agents by it)."""
        self.node_context = context
        self.cfg = cfg
        self.partition_id = int(context.node_config["partition-id"])
        self.num_partitions = int(context.node_config["num-partitions"])
        if check_partitions and self.num_partitions != cfg.num_clients:
            raise ValueError(f"node has num-partitions={self.num_partitions}, run config num-clients={cfg.num_clients}")

    # ---------------------------------------------------------------- persistent state
    def load_vector(self, name: str) -> FloatArray | None:
        """A float64 vector saved by an earlier round, or None the first time."""
        rec = self.node_context.state.array_records.get(name)
        return None if rec is None else rec.to_numpy_ndarrays()[0].astype(np.float64)

    def save_vector(self, name: str, value: FloatArray) -> None:
        """Persist a vector across rounds (float64: duals accumulate, float32 rounding would drift)."""
        self.node_context.state[name] = ArrayRecord([np.asarray(value, dtype=np.float64)])

    def load_ledger(self) -> PrivacyLedger:
        """This client's privacy ledger (history of per-round epsilons and noise multipliers)."""
        rec = self.node_context.state.config_records.get("privacy")
        if rec is None:
            return PrivacyLedger(delta=self.cfg.delta, eps_rounds=[], noise_multipliers=[])
        return PrivacyLedger.from_record(dict(rec))

    def save_ledger(self, ledger: PrivacyLedger) -> None:
        """Persist the ledger as a ConfigRecord of float lists."""
        self.node_context.state["privacy"] = ConfigRecord(ledger.to_record())  # type: ignore[arg-type]

    def rng(self, server_round: int, stream: int = 0, *extra: int) -> np.random.Generator:
        """Per-(client, round, stream[, extra]) generator: reproducible across drivers, independent across clients."""
        return rng_for(self.cfg.seed, STREAM_CLIENT, self.partition_id, server_round, stream, *extra)

    # ---------------------------------------------------------------- uplink: sparsify, privatize, encode
    def uplink_indices(self, v: FloatArray, server_round: int) -> NDArray[np.int64]:
        """All d indices, or top_k(v) / rand_k with k = alpha_U d (eq. 18), ascending so that alpha_U = 1 pairs
        every noise draw with the same coordinate as the dense path (spec 10.12)."""
        d = len(v)
        if not self.sparse_uplink:
            return np.arange(d, dtype=np.int64)
        k = resolve_k(self.cfg.alpha_up, d)
        if self.cfg.uplink_sparsifier == "topk":
            return top_k(v, k)
        return rand_k(d, k, self.rng(server_round, STREAM_RANDK))

    def release(self, values: FloatArray, server_round: int, *, sensitivity: float, steps: int) -> tuple[FloatArray, dict[str, Any]]:
        """Gaussian mechanism on the uploaded values under DP; the values unchanged and no metrics otherwise.

        The round's epsilon inverts the paper's (36) with q = Q b / |D_i| from the actual Q (spec A3) and
        p = K/N; the noise std is (32) for the caller's L2 `sensitivity` ((35) for FedPDM, (B.2) for local SGD).
        The ledger in context.state records the round and yields the three cumulative figures.
        """
        cfg = self.cfg
        if not cfg.dp:
            return values, {}
        q = data_fraction(steps, cfg.batch_size, len(self.data))
        p = cfg.clients_per_round / cfg.num_clients
        eps_round = per_round_epsilon_eq36(cfg.epsilon_total, cfg.c0, q, p, cfg.horizon, q_power=cfg.privacy_q_power)
        sigma = gaussian_noise_std(sensitivity, eps_round, cfg.delta)
        if not sigma < FLOAT32_MAX:  # the noisy upload would be inf on the float32 wire: say which keys set sigma
            raise ValueError(
                f"DP noise std sigma = {sigma:.3g} is beyond the float32 range of the upload ({FLOAT32_MAX:.3g}): "
                f"sensitivity {sensitivity:.3g} (clip-norm {cfg.clip_norm:g}, {steps} local step(s)) over the "
                f"per-round epsilon {eps_round:.3g} (epsilon-total {cfg.epsilon_total:g}, q = {q:.3g}, delta "
                f"{cfg.delta:g}); lower clip-norm or raise epsilon-total"
            )
        noisy = add_gaussian_noise(values, sigma, self.rng(server_round, STREAM_NOISE))  # (11)/(19)
        ledger = self.load_ledger()
        ledger.record(eps_round, sigma / sensitivity)
        self.save_ledger(ledger)
        eps_basic, delta_basic = ledger.basic_composition()
        return noisy, {
            "q": q, "eps_round": eps_round, "sensitivity": sensitivity, "sigma": sigma,
            "eps_round_gt_1": int(eps_round > 1.0),  # Lemma 1 needs eps < 1 (spec caveat 1)
            "eps_eq36": total_privacy_eq36(eps_round, cfg.c0, q, p, min(server_round, cfg.horizon), q_power=cfg.privacy_q_power),
            "eps_rdp": ledger.rdp_epsilon(cfg.delta),
            "eps_basic": eps_basic, "delta_basic": delta_basic,
            "participations": len(ledger.eps_rounds),
        }

    def encode(self, idx: NDArray[np.int64], values: FloatArray) -> tuple[list[NDArray[Any]], int]:
        """Wire arrays and format code: the dense vector, or k values plus compact indices (sparse variants).

        A sparse upload that kept every coordinate (alpha_U = 1) goes dense: the index set carries nothing.
        Raises ValueError for values that float32 cannot carry (the server would reject them as non-finite).
        """
        largest = float(np.max(np.abs(values))) if len(values) else 0.0
        if not largest <= FLOAT32_MAX:
            raise ValueError(f"the upload has values up to {largest:.3g}, beyond the float32 range of the wire format "
                             f"({FLOAT32_MAX:.3g}): the local update diverged (lower the step size) or the noise "
                             "overflowed")
        if self.sparse_uplink and len(idx) < self.model.dim:
            return to_arrays(encode_sparse(SparseVector(indices=idx, values=values, dim=self.model.dim)))
        return to_arrays(encode_dense(values))

    # ---------------------------------------------------------------- NumPyClient API
    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        """Who this node is (the server asks with query.whoami)."""
        return {"partition-id": self.partition_id, "num-partitions": self.num_partitions}

    def evaluate(self, parameters: list[Any], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        """Loss and accuracy of a dense model on this client's training partition (federated evaluation)."""
        x = np.asarray(parameters[0], dtype=np.float64).ravel()
        loss = self.model.loss(x, self.data.x, self.data.y)
        acc = self.model.accuracy(x, self.data.x, self.data.y)
        return float(loss), len(self.data), {"accuracy": acc}
