"""DPQ-DSGD on Flower (seed 004, spec shared/specs/dp_quantized.md sections 3, 7, 8): the server is a mailbox.

Algorithm 1 runs on the nodes (clients/dpq.py, with the per-node functions of :mod:`fedapp.algorithms.dpq`); this
strategy is a :class:`strategies.decentralized.SyncRouter`: every node every round, and round r sends node i its
graph neighbours' round-(r-1) messages unchanged (never mixed, summed or decoded into anything the nodes get).

Round schedule (spec 7.2; K = ``dpq-horizon``, default ``num-server-rounds - 2``)
    * Round 1 (bootstrap, empty inbox): every node sets the common seeded x_{i,0}, publishes
      ``m_{i,0} = Q-levels(x_{i,0} + n_{i,0})`` and stores x_{i,0} and its own m_{i,0} in ``context.state``.
    * Round r = k + 2 (k = 0..K): node i gets its neighbours' m_{j,k}, computes g_{i,k} (5) on its minibatch, updates
      x_{i,k+1} (6) with ``a_ii z_{i,k}`` from its own stored message, records eps_k in its ledger (the release
      x_{i,k+1} + n_{i,k+1} costs eps_k, spec 4.1) and publishes m_{i,k+1} with sigma_{k+1}.
    After R rounds every node holds x_{i,R-1} -- exactly ``simulate(params, ..., num_iters=R - 1)`` -- and has
    published R messages; with R = K + 2 the run is Algorithm 1's k = 0..K, and its last message m_{K+1} makes the
    ledger's sum over k = 0..K Theorem 1's epsilon exactly (spec 7.2 allows skipping it; we send it).

What the server sees and checks (spec 1.5, 7.7)
    Only the messages: bit-packed integer levels (:func:`fedapp.compression.quantize.encode_levels`, one uint8 array)
    or, for the unquantized ablations, float32 x + n (x itself for ``dsgd``). It decodes each (form, count d,
    padding, int64 range) to count its bits and rejects malformed ones; a round without every node's message stops
    the run (SyncRouter's failure rule).

Per-round record (results.json)
    * bytes: ``uplink_bytes`` / ``downlink_bytes`` from the serialized records (the base class), and spec 3 / 7.5's
      accounting: ``bits_per_message`` (mean over nodes of ``d b + 40``, :func:`~fedapp.compression.quantize.message_bits`;
      32 d unquantized), its min / max, ``bits_per_coordinate`` (b), ``entropy_bits_per_coordinate``,
      ``float32_message_bits`` (32 d), ``compression_ratio`` (32 d / bits), ``uplink_bits`` (sum_i bits_i) and
      ``downlink_bits`` (sum_i sum_{j in N_i} bits_j of the forwarded messages), ``message_wire_bytes`` (the payload
      array itself, 13 + ceil(d b / 8)); ``eval_upload_bytes``: the part of ``uplink_bytes`` that is the
      evaluation-only x_i of ``dpq-eval-average`` (array bytes), not the algorithm's traffic.
    * privacy (the paper accountant, :class:`fedapp.privacy.dpq.DPQLedger`, each node's own in its ``context.state``;
      the worst node): ``epsilon`` = cumulative sum eps_k over the recorded updates, ``delta`` = delta_hat (null in
      JSON when it overflows; ``dpq_log_delta_hat`` keeps it), ``dpq_delta_hat_vacuous`` (delta_hat >= 1, always true
      for the paper's delta_0 = 1, spec 9.8), ``dpq_eps_k_max``. No noise (quant-only, dsgd): no privacy, epsilon null.
    * evaluation (every eval-every rounds and the last): each node evaluates its own x_i on the test set and its
      shard (``dpq-eval-limit`` samples) and reports the numbers as metrics (outside the DP guarantee, like the loss;
      spec 7.4). ``test_accuracy`` / ``test_loss`` = the mean over nodes (spec 9.17), with ``node_test_acc_min`` /
      ``_max`` / ``node0_test_acc`` and ``node_train_acc_mean``. With ``dpq-eval-average`` the nodes also upload x_i in
      those rounds (evaluation only, not private) and ``avg_model_test_accuracy`` / ``avg_model_test_loss`` are the
      node-average model's, evaluated by the server on the same test samples.

``global_model()`` (model.npy, and the ArrayRecord Flower keeps) is the node-average model when the last evaluation
uploaded the x_i, otherwise the average of the decoded published messages z_i (what the server holds: noisy, never
evaluated, spec 7.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.common.logger import log
from numpy.typing import NDArray

from fedapp.algorithms import dpq_config
from fedapp.compression import quantize
from fedapp.compression.codec import MalformedPayload
from fedapp.config import RunConfig
from fedapp.models.base import FloatArray
from fedapp.results import RoundRecord
from fedapp.strategy_base import Scalar
from strategies._legacy_decentralized import SyncRouter

#: config keys of a train message: the update index k (-1 = bootstrap) and whether the round is evaluated
K_KEY = "dpq-k"
EVAL_KEY = "dpq-eval"


@dataclass(frozen=True)
class MessageInfo:
    """What the server learns from decoding one published message (for the bit accounting)."""

    bits: int  # spec 3 accounting: d b + 40 (quantized) or 32 d
    width: int  # b bits per coordinate (32 unquantized)
    entropy: float  # empirical entropy of the levels, bits per coordinate (32 unquantized)
    wire_bytes: int  # the payload array's bytes
    z: FloatArray  # the decoded message (q_step m, or the float32 values)


def _log_delta_to_delta(log_dh: float) -> float:
    if log_dh == -math.inf:
        return 0.0
    return math.exp(log_dh) if log_dh < math.log(np.finfo(np.float64).max) else math.inf


class DPQDSGD(SyncRouter):
    """DPQ-DSGD router (key ``dpq-dsgd``; module docstring).

    Parameters
    ----------
    cfg
        Run config: num-clients n, graph, num-server-rounds, the ``dpq-*`` keys (:mod:`fedapp.algorithms.dpq_config`),
        dataset, model, partitioner, samples-per-client, seed, eval-every.
    evaluator
        Unused: the nodes evaluate their own models (and the server the node-average one with ``dpq-eval-average``).
    """

    privacy_label = "eps(Thm 1)"

    def __init__(self, cfg: RunConfig, evaluator: Any = None) -> None:
        self.params = dpq_config.params(cfg)
        self.schedule = dpq_config.schedule(cfg)
        self.horizon = self.schedule.K
        self.net = dpq_config.build_net(cfg)
        self.dim = self.net.dim
        self.outbox_bits: dict[int, int] = {}
        self.infos: dict[int, MessageInfo] = {}
        self.eval_x: dict[int, FloatArray] = {}
        self.avg_model: FloatArray | None = None
        self.z_mean: FloatArray | None = None
        self.node_privacy: dict[str, float] = {}
        self.node_eval: dict[str, float] = {}
        self._test: Any = None
        super().__init__(cfg, None)

    def initial_model(self) -> FloatArray:
        """The common x_0 every node computes itself (:func:`fedapp.algorithms.dpq_config.initial_model`)."""
        return dpq_config.initial_model(self.cfg, self.net)

    # ------------------------------------------------------------------ rounds
    def is_eval_round(self, server_round: int) -> bool:
        """Every eval-every rounds and the last."""
        return server_round % self.cfg.eval_every == 0 or server_round == self.cfg.num_server_rounds

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        """The update index k = round - 2 (the client checks it against its own counter) and the evaluation flag."""
        return {K_KEY: server_round - 2, EVAL_KEY: self.is_eval_round(server_round)}

    def client_payload(self, server_round: int, partition_id: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        arrays, config = super().client_payload(server_round, partition_id)
        if self.outbox:  # spec 7.5 downlink_bits: the forwarded messages' accounting bits
            self._acc["down_bits"] = self._acc.get("down_bits", 0) + sum(
                self.outbox_bits[j] for j in self.graph.neighbours[partition_id])
        return arrays, config

    def decode_update(self, server_round: int, partition_id: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        """The message (validated, forwarded later unchanged) plus, in evaluation rounds with ``dpq-eval-average``,
        the node's x_i (kept apart, never forwarded)."""
        upload_x = self.cfg.dpq_eval_average and self.is_eval_round(server_round)
        if len(arrays) != 1 + int(upload_x):
            raise MalformedPayload(f"round {server_round}: expected {1 + int(upload_x)} array(s), got {len(arrays)}")
        if int(metrics.get("k", -2)) != server_round - 2:
            raise MalformedPayload(f"node {partition_id} reports update k = {metrics.get('k')}, "
                                   f"expected {server_round - 2}")
        msg = super().decode_update(server_round, partition_id, arrays[:1], metrics)
        if upload_x:
            x = np.asarray(arrays[1])
            if x.dtype != np.float64 or x.shape != (self.dim,) or not np.all(np.isfinite(x)):
                raise MalformedPayload(f"node {partition_id}'s evaluation x must be finite float64 of shape "
                                       f"({self.dim},), got {x.dtype} {x.shape}")
            self.eval_x[partition_id] = x
            self._acc["eval_up"] = self._acc.get("eval_up", 0) + int(x.nbytes)
        return msg

    def validate_message(self, partition_id: int, arrays: list[NDArray[Any]]) -> list[NDArray[Any]]:
        """Decode the message exactly as a receiving node will (form, count d, padding, range); count its bits."""
        raw = arrays[0]
        if self.params.quantized:
            levels = quantize.decode_levels({"qlevels": raw}, count=self.dim)
            width = quantize.level_width(levels)
            info = MessageInfo(bits=quantize.message_bits(levels), width=width,
                               entropy=quantize.empirical_entropy_bits(levels), wire_bytes=int(raw.nbytes),
                               z=quantize.dequantize(levels, self.params.q_step))
        else:
            z = quantize.decode_float32({"dense": raw}, count=self.dim)
            info = MessageInfo(bits=quantize.float32_message_bits(self.dim), width=32, entropy=32.0,
                               wire_bytes=int(raw.nbytes), z=z)
        self.infos[partition_id] = info
        return arrays

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Store the messages (SyncRouter), then the round's bits, the worst node's privacy and the evaluation."""
        diag = super().aggregate(server_round, updates, metrics)
        n = self.cfg.num_clients
        infos = [self.infos[i] for i in range(n)]
        bits = np.array([m.bits for m in infos], dtype=np.float64)
        self.outbox_bits = {i: infos[i].bits for i in range(n)}
        ref = quantize.float32_message_bits(self.dim)
        diag.update({
            "k": float(server_round - 2),
            "bits_per_message": float(bits.mean()), "bits_per_message_min": float(bits.min()),
            "bits_per_message_max": float(bits.max()),
            "bits_per_coordinate": float(np.mean([m.width for m in infos])),
            "entropy_bits_per_coordinate": float(np.mean([m.entropy for m in infos])),
            "float32_message_bits": float(ref), "compression_ratio": float(ref / bits.mean()),
            "uplink_bits": float(bits.sum()), "downlink_bits": float(self._acc.get("down_bits", 0)),
            "message_wire_bytes": float(np.mean([m.wire_bytes for m in infos])),
            "eval_upload_bytes": float(self._acc.get("eval_up", 0)),
        })
        if server_round > 1:
            diag["mean_train_loss"] = float(np.mean([float(m["train_loss"]) for m in metrics.values()]))
        self.z_mean = np.mean(np.stack([m.z for m in infos]), axis=0)
        self.infos = {}
        if self.params.noise:
            eps = [float(metrics[i].get("dpq_eps", math.nan)) for i in range(n)]
            logs = [float(metrics[i].get("dpq_log_delta_hat", -math.inf)) for i in range(n)]
            worst_log = max(logs)
            self.node_privacy = {
                "dpq_eps": max(eps), "dpq_log_delta_hat": worst_log, "dpq_delta_hat": _log_delta_to_delta(worst_log),
                "dpq_eps_k_max": max(float(metrics[i].get("dpq_eps_k_max", 0.0)) for i in range(n)),
                "dpq_lemma3_violations": max(float(metrics[i].get("dpq_lemma3_violations", 0.0)) for i in range(n)),
            }
        self.node_eval = {}
        if self.is_eval_round(server_round):
            acc = np.array([float(metrics[i]["test_accuracy"]) for i in range(n)])
            self.node_eval = {
                "test_accuracy": float(acc.mean()),
                "test_loss": float(np.mean([float(metrics[i]["test_loss"]) for i in range(n)])),
                "node_test_acc_min": float(acc.min()), "node_test_acc_max": float(acc.max()),
                "node0_test_acc": float(acc[0]),
                "node_train_acc_mean": float(np.mean([float(metrics[i]["train_accuracy"]) for i in range(n)])),
            }
            if self.cfg.dpq_eval_average:
                self.avg_model = np.mean(np.stack([self.eval_x[i] for i in range(n)]), axis=0)
                self.eval_x = {}
                if self._test is None:
                    self._test = dpq_config.eval_data(self.cfg)
                a, loss = dpq_config.evaluate(self.net, self.avg_model, self._test)
                self.node_eval.update({"avg_model_test_accuracy": a, "avg_model_test_loss": loss})
        return diag

    # ------------------------------------------------------------------ records
    def global_model(self) -> FloatArray:
        """The node-average model of the last evaluation upload, else the mean decoded message, else x_0."""
        if self.avg_model is not None:
            return self.avg_model
        if self.z_mean is not None:
            return self.z_mean
        return self.x

    def privacy_summary(self) -> dict[str, float]:
        """The worst node's ledger (cumulative eps, delta_hat) after the last round; empty without noise."""
        return dict(self.node_privacy)

    def evaluate_round(self, server_round: int) -> RoundRecord:
        """The round's record: bytes and bits, the worst node's privacy, the nodes' evaluation (module docstring)."""
        import time

        rec = RoundRecord(round=server_round)
        rec.uplink_bytes, rec.downlink_bytes = int(self._acc.get("up", 0)), int(self._acc.get("down", 0))
        rec.wall_s = time.perf_counter() - float(self._acc.get("t0", time.perf_counter()))
        rec.extra.update(self._acc.get("diag", {}))
        if self.params.noise and self.node_privacy:
            rec.epsilon, rec.delta = self.node_privacy["dpq_eps"], self.node_privacy["dpq_delta_hat"]
            rec.extra.update(self.node_privacy)
            rec.extra["dpq_delta_hat_vacuous"] = self.node_privacy["dpq_log_delta_hat"] >= 0.0
        ev = dict(self.node_eval)
        if ev:
            rec.test_accuracy, rec.test_loss = ev.pop("test_accuracy"), ev.pop("test_loss")
            rec.extra.update(ev)
        self.history.append(rec)
        if self.is_eval_round(server_round):
            eps = "" if rec.epsilon is None else f" {self.privacy_label}={rec.epsilon:.4g}"
            avg = ev.get("avg_model_test_accuracy")
            log(INFO, "[round %d/%d] k=%d mean node test_acc=%s%s%s bits/msg=%.0f (%.2f/coord) up=%.1fkB down=%.1fkB",
                server_round, self.cfg.num_server_rounds, server_round - 2,
                "n/a" if rec.test_accuracy is None else f"{rec.test_accuracy:.4f}",
                "" if avg is None else f" avg-model acc={avg:.4f}", eps, rec.extra.get("bits_per_message", 0.0),
                rec.extra.get("bits_per_coordinate", 0.0), rec.uplink_bytes / 1e3, rec.downlink_bytes / 1e3)
        return rec

    def summary(self) -> None:
        c, p = self.cfg, self.params
        log(INFO, "dpq-dsgd (%s): n=%d graph=%s rounds=%d K=%d alpha_hat=%.6g beta_hat=%.6g batch=%s q_step=%g "
            "noise=%s sigma_k=%g(k+%g)^%g d=%d", c.dpq_variant, c.num_clients, self.graph.label or c.graph,
            c.num_server_rounds, self.horizon, p.alpha_hat, p.beta_hat, p.batch_size, p.q_step, p.noise,
            p.sigma_scale, p.sigma_offset, p.sigma_exp, self.dim)


__all__ = ["DPQDSGD", "EVAL_KEY", "K_KEY", "MessageInfo"]
