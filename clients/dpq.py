"""DPQ-DSGD nodes on Flower (seed 004, spec dp_quantized.md 2.3, 7.2-7.7; server side strategies/dpq.py).

Each node runs Algorithm 1 with the per-node functions of :mod:`fedapp.algorithms.dpq` on its own shard
(:func:`fedapp.algorithms.dpq_config.node_objective`), adds the privacy noise and quantizes before anything leaves
the node, and keeps its state in ``context.state`` (Flower re-creates the client object for every message):

* ``"dpq"`` (ArrayRecord): ``x`` = x_{i,k} (float64, bit for bit) and ``m`` = its own message of iteration k (int64
  levels, or the float32 vector of the unquantized ablations), needed for the ``a_ii z_{i,k}`` self term of (6);
* ``"dpq-meta"`` (ConfigRecord): ``k`` (the iteration of the stored x and m) and ``t`` (messages published);
* ``"dpq-ledger"`` (ConfigRecord): the node's :class:`fedapp.privacy.dpq.DPQLedger` (the sigma of every release
  x_{i,k+1} + n_{i,k+1} and its eps_k; only with noise).

A train message of round r carries the neighbours' round-(r-1) messages (checked against this node's graph
neighbours by :class:`clients.decentralized.SyncAgentClient`) and ``dpq-k`` = r - 2:

* r = 1 (bootstrap, nothing received): x_{i,0} = the common seeded init; publish m_{i,0} (sigma_0).
* r >= 2: k = r - 2; decode the neighbours' m_{j,k}; :func:`fedapp.algorithms.dpq.node_round` (gradient (5) on the
  minibatch ``default_rng([seed, 52, i, k])``, update (6), then m_{i,k+1} with sigma_{k+1}); record eps_k.

The reply is one array: :func:`fedapp.compression.quantize.encode_levels` of the levels (uint8, spec 7.7's integer
upload) or :func:`~fedapp.compression.quantize.encode_float32` of x + n; ``num_examples`` = the batch size gamma_hat.
Metrics (scalars outside the DP guarantee, spec 7.4): ``t``, ``k``, the minibatch ``train_loss``, the ledger's
``dpq_eps`` (sum eps_k), ``dpq_log_delta_hat``, ``dpq_eps_k_max``, and in evaluation rounds the node's own
``test_accuracy`` / ``test_loss`` / ``train_accuracy`` (``dpq-eval-limit`` samples). With ``dpq-eval-average`` an
evaluation round's reply also carries x_{i,k+1} (float64) for the server's node-average model -- evaluation only,
not private.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from numpy.typing import NDArray

from clients._legacy_decentralized import SyncAgentClient
from fedapp.algorithms import dpq, dpq_config
from fedapp.compression import quantize
from fedapp.config import RunConfig
from fedapp.privacy.dpq import DPQLedger, Lemma3Warning
from strategies.dpq import EVAL_KEY, K_KEY

STATE, META, LEDGER = "dpq", "dpq-meta", "dpq-ledger"


class DPQClient(SyncAgentClient):
    """One DPQ-DSGD node (module docstring).

    Parameters
    ----------
    context
        Flower Context: node_config partition-id (= graph node i) / num-partitions; the state lives in
        ``context.state``.
    cfg
        Run config (num-clients, graph, the ``dpq-*`` keys, dataset, model, partitioner, samples-per-client, seed).
    """

    def __init__(self, context: Context, cfg: RunConfig) -> None:
        super().__init__(context, cfg)
        self.params = dpq_config.params(cfg)

    @property
    def objective(self) -> dpq.TorchObjective:
        """f_i: this node's net on its shard (cached per process)."""
        return dpq_config.node_objective(self.cfg, self.partition_id)

    # ------------------------------------------------------------------ wire format
    def encode_message(self, msg: dpq.Message) -> NDArray[Any]:
        """The one array a message travels as: bit-packed levels, or float32 x + n."""
        if self.params.quantized:
            return quantize.encode_levels(msg)["qlevels"]
        return quantize.encode_float32(msg)["dense"]

    def decode_message(self, raw: NDArray[Any], dim: int) -> dpq.Message:
        """A neighbour's message back to what :func:`fedapp.algorithms.dpq.node_update` mixes (levels or floats)."""
        if self.params.quantized:
            return quantize.decode_levels({"qlevels": raw}, count=dim)
        return quantize.decode_float32({"dense": raw}, count=dim)

    # ------------------------------------------------------------------ state
    def load(self, k: int) -> tuple[dpq.FloatArray, dpq.Message, int, DPQLedger | None]:
        """(x_{i,k}, own m_{i,k}, publications, ledger) from ``context.state``; the stored k must be the server's."""
        state = self.node_context.state
        if STATE not in state.array_records:
            raise ValueError(f"node {self.partition_id} has no DPQ state: round {k + 2} needs the bootstrap round first")
        meta = state.config_records[META]
        stored = int(meta["k"])  # type: ignore[arg-type]
        if stored != k:
            raise ValueError(f"node {self.partition_id} holds iteration {stored}, the server runs iteration {k}")
        rec = state.array_records[STATE]
        x = np.asarray(rec["x"].numpy(), dtype=np.float64)
        m = rec["m"].numpy()
        ledger = DPQLedger.from_record(dict(state.config_records[LEDGER])) if LEDGER in state.config_records else None
        return x, m, int(meta["t"]), ledger  # type: ignore[arg-type]

    def save(self, x: dpq.FloatArray, m: dpq.Message, k: int, t: int, ledger: DPQLedger | None) -> None:
        """Store x_{i,k} (float64), the own message of iteration k, k, t and the ledger."""
        state = self.node_context.state
        state[STATE] = ArrayRecord({"x": Array(np.ascontiguousarray(x, dtype=np.float64)),
                                    "m": Array(np.ascontiguousarray(m))})
        state[META] = ConfigRecord({"k": int(k), "t": int(t)})
        if ledger is not None:
            state[LEDGER] = ConfigRecord(ledger.to_record())  # type: ignore[arg-type]

    # ------------------------------------------------------------------ one round
    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        r, msgs = self.inbox(parameters, config)
        k = r - 2
        if int(config[K_KEY]) != k:
            raise ValueError(f"round {r} must run update k = {k}, the server sent {K_KEY} = {config[K_KEY]}")
        p, i = self.params, self.partition_id
        metrics: dict[str, Any] = {"agent_id": i, "k": k}
        if r == 1:
            if STATE in self.node_context.state.array_records:
                raise ValueError(f"node {i} is already initialised (bootstrap round twice?)")
            x = dpq_config.initial_model(self.cfg, self.objective.net)
            m = dpq.node_message(p, i, 0, x)  # z_{i,0}: data-independent, costs no privacy
            t = 1
            ledger = dpq_config.schedule(self.cfg).ledger() if p.noise else None
        else:
            x, own, t, ledger = self.load(k)
            nbrs = self.neighbours
            w_self, w_nbrs = self.mixing_row()
            received = [self.decode_message(msgs[j][0], x.shape[0]) for j in nbrs]
            obj = self.objective
            x, m_next = dpq.node_round(p, i, k, x, own, w_self, [w_nbrs[j] for j in nbrs], received, obj)
            assert m_next is not None
            m, t = m_next, t + 1
            metrics["train_loss"] = obj.last_loss
            if ledger is not None:
                with warnings.catch_warnings():  # eps_k >= 1 is reported (dpq_lemma3_violations), not raised
                    warnings.simplefilter("ignore", Lemma3Warning)
                    ledger.record(k, p.sigma(k + 1))  # the release x_{k+1} + n_{k+1} (spec 4.1)
        self.save(x, m, k + 1, t, ledger)
        metrics["t"] = t
        if ledger is not None:
            budget = ledger.budget()
            metrics.update({"dpq_eps": budget.eps_total, "dpq_eps_k_max": budget.eps_max,
                            "dpq_lemma3_violations": budget.lemma3_violations})
            if math.isfinite(budget.log_delta_hat):
                metrics["dpq_log_delta_hat"] = budget.log_delta_hat
        arrays = [self.encode_message(m)]
        if bool(config[EVAL_KEY]):
            metrics.update(self.evaluate_state(x))
            if self.cfg.dpq_eval_average:
                arrays.append(np.asarray(x, dtype=np.float64))  # evaluation only: NOT covered by the DP guarantee
        return arrays, (p.batch_size or 0) if r > 1 else 0, metrics

    def evaluate_state(self, x: dpq.FloatArray) -> dict[str, float]:
        """This node's x_i on the test set and on its own shard (``dpq-eval-limit`` samples each)."""
        obj = self.objective
        acc, loss = dpq_config.evaluate(obj.net, x, dpq_config.eval_data(self.cfg))
        train_acc, _ = dpq_config.evaluate(obj.net, x, obj.data, self.cfg.dpq_eval_limit)
        return {"test_accuracy": acc, "test_loss": loss, "train_accuracy": train_acc}

    def evaluate(self, parameters: list[Any], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        """The node's own stored x_i on the test set (federated evaluation; the strategies here do not send it)."""
        state = self.node_context.state
        if STATE not in state.array_records:
            raise ValueError(f"node {self.partition_id} has no model yet")
        x = np.asarray(state.array_records[STATE]["x"].numpy(), dtype=np.float64)
        ev = self.evaluate_state(x)
        return ev["test_loss"], len(dpq_config.eval_data(self.cfg)), ev


__all__ = ["LEDGER", "META", "STATE", "DPQClient"]
