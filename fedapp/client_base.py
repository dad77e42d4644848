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

from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.privacy.accountants import PrivacyLedger
from fedapp.sampling import STREAM_CLIENT, rng_for
from fedapp.task import build_model, client_dataset


class FedClient(NumPyClient):
    """Shared client plumbing.

    Parameters
    ----------
    context
        The node's Flower Context: node_config gives partition-id / num-partitions, state persists across rounds.
    cfg
        The validated run config.
    """

    def __init__(self, context: Context, cfg: RunConfig) -> None:
        self.node_context = context
        self.cfg = cfg
        self.partition_id = int(context.node_config["partition-id"])
        self.num_partitions = int(context.node_config["num-partitions"])
        self.data = client_dataset(cfg, self.partition_id, self.num_partitions)
        self.model = build_model(cfg)

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

    def rng(self, server_round: int, stream: int = 0) -> np.random.Generator:
        """Per-(client, round, stream) generator: reproducible across drivers, independent across clients."""
        return rng_for(self.cfg.seed, STREAM_CLIENT, self.partition_id, server_round, stream)

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
