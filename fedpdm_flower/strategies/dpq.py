"""DPQ-DSGD on Flower: the server is a mailbox between the graph's nodes.

J. Chen, J. Wang, J.-F. Zhang, "Differentially Private Distributed Nonconvex Stochastic Optimization with Quantized
Communications", arXiv 2403.18254 (first version; spec ``shared/specs/dp_quantized.md`` sections 3, 7, 8).

Algorithm 1 runs on the nodes (:mod:`fedpdm_flower.clients.dpq`, with the per-node functions of :mod:`fedpdm_flower.fedapp.algorithms.dpq`);
this strategy is a :class:`fedpdm_flower.strategies.decentralized.SyncRouter`: every node every round, and round r sends node i its
graph neighbours' round-(r-1) messages unchanged (never mixed, summed or decoded into anything the nodes get).

Round schedule (spec 7.2; K = ``horizon``, default ``num_rounds - 2``)
    * Round 1 (bootstrap): every node gets the common x_0 (the ``initial_arrays`` of :meth:`start`, flattened),
      publishes ``m_{i,0} = Q-levels(x_0 + n_{i,0})`` and keeps x_0 and its own m_{i,0} in ``context.state``.
    * Round r = k + 2 (k = 0..K): node i gets its neighbours' m_{j,k}, computes g_{i,k} (5) on its minibatch, updates
      x_{i,k+1} (6) with ``a_ii z_{i,k}`` from its own stored message, records eps_k in its ledger (the release
      x_{i,k+1} + n_{i,k+1} costs eps_k, spec 4.1) and publishes m_{i,k+1} with sigma_{k+1}.
    After R rounds every node holds x_{i,R-1} -- exactly ``simulate(params, ..., num_iters=R - 1)`` -- and has
    published R messages; with R = K + 2 the run is Algorithm 1's k = 0..K, and its last message m_{K+1} makes the
    ledger's sum over k = 0..K Theorem 1's epsilon exactly (spec 7.2 allows skipping it; we send it).

What the nodes receive (the strategy is the single source of truth; keys of :data:`RUN_KEYS`)
    Every train message carries the run constants -- alpha_hat, beta_hat, the batch size gamma_hat, the quantizer
    step Delta (0: float messages), whether to add the paper's noise and its schedule sigma_k, C and delta_k for the
    node's paper ledger, the self term, the horizon K -- plus the update index k, the routing and mixing row of
    :class:`~fedpdm_flower.strategies.decentralized.SyncRouter`, whether the round is evaluated, and under
    record-level DP-SGD the mechanism (z, q, C, one step; :meth:`PrivacyTarget.message_config`). The nodes read
    nothing from the run config, and refuse a message whose run constants differ from the bootstrap's.

Privacy (``privacy=``, required; docs/private-learning-decentralized.md)
    ``PrivacyTarget``: the gradient (5) of every update is one DP-SGD step on a Poisson sample of the node's records
    (from its own entropy), the messages are quantized but not noised (post-processing), and every node's ledger
    composes its steps under RDP; the guarantee covers the server, the neighbours and any eavesdropper.
    ``TimeVaryingNoise``: the paper's noise on the messages, the reproduction setting (the paper accountant's figure,
    rigorous epsilon inf). ``None``: no noise.

What the server sees and checks (spec 1.5, 7.7)
    Only the messages: bit-packed integer levels (:func:`fedpdm_flower.fedapp.compression.quantize.encode_levels`, one uint8 array)
    or, for the unquantized variants, float32 x + n (x itself for ``dsgd``). It decodes each exactly as a receiving
    node will (canonical header, count d, padding, int64 range) to count its bits, and rejects malformed ones; a round
    without every node's message stops the run (SyncRouter's failure rule), so nothing undecodable is forwarded.

Per-round record (``history``, results.json)
    * bytes: ``uplink_bytes`` / ``downlink_bytes`` from the serialized records, and spec 3 / 7.5's accounting:
      ``bits_per_message`` (mean over nodes of ``d b + 40``, :func:`~fedpdm_flower.fedapp.compression.quantize.message_bits`; 32 d
      unquantized), its min / max, ``bits_per_coordinate`` (b), ``entropy_bits_per_coordinate``,
      ``float32_message_bits`` (32 d), ``compression_ratio`` (32 d / bits), ``uplink_bits`` (sum_i bits_i),
      ``downlink_bits`` (sum_i sum_{j in N_i} bits_j of the forwarded messages), ``message_wire_bytes`` (the payload
      array itself, 13 + ceil(d b / 8)); ``eval_upload_bytes``: the part of ``uplink_bytes`` that is the
      evaluation-only x_i of ``evaluate_average`` (array bytes), not the algorithm's traffic.
    * privacy (the worst node): under DP-SGD ``epsilon`` = its ledger's RDP epsilon (``eps_dpsgd``; the server's
      recomputation from (z, q, steps) in ``eps_dpsgd_server``) at the target's delta. With the paper's noise the
      paper accountant (:class:`fedpdm_flower.fedapp.privacy.dpq.DPQLedger`, each node's own in its ``context.state``):
      ``epsilon`` = cumulative sum eps_k over the recorded updates, ``delta`` = delta_hat (null in JSON when it
      overflows; ``dpq_log_delta_hat`` keeps it), ``dpq_delta_hat_vacuous`` (delta_hat >= 1, always true for the
      paper's delta_0 = 1, spec 9.8), ``dpq_eps_k_max``, and ``eps_rigorous`` = inf beside them. No noise: epsilon
      null.
    * evaluation (every ``eval_every`` rounds and the last): each node evaluates its own x_i on its test data and
      its own samples and reports the numbers as metrics (outside the DP guarantee, like the loss; spec 7.4; under
      DP-SGD only the held-out test figures, never figures on its own records).
      ``test_accuracy`` / ``test_loss`` = the mean over nodes (spec 9.17), with ``node_test_acc_min`` / ``_max`` /
      ``node0_test_acc`` and ``node_train_acc_mean``. With ``evaluate_average`` the nodes also upload x_i in those
      rounds (without DP-SGD: evaluation only, not private, and only from devices that allow it; under DP-SGD:
      post-processing, inside the guarantee) and ``evaluate_fn`` is called on the
      node-average model: ``avg_model_test_accuracy`` / ``avg_model_test_loss`` (and ``test_accuracy`` when the
      nodes report none of their own).

:meth:`global_model` (``Result.arrays``, the reproduction's model.npy) is the node-average model when the last
evaluation uploaded the x_i, otherwise the average of the decoded published messages z_i: what the server holds,
noisy, not a trained model (spec 7.4 says never to evaluate it).

Flower's ``Result`` (docs/flower-parity.md): ``train_metrics_clientapp`` aggregates the nodes' train metrics as
Flower's FedAvg does; ``evaluate_metrics_serverapp`` holds what ``evaluate_fn`` returned on the node-average model
and ``evaluate_metrics_clientapp`` the clients' evaluation of it (``fraction_evaluate``), both in the rounds that form
that model (``evaluate_average=True``, every ``eval_every`` rounds and the last) and in no other: there is no global
model to evaluate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.common.logger import log
from numpy.typing import NDArray

from fedpdm_flower.fedapp.algorithms import dpq
from fedpdm_flower.fedapp.compression import quantize
from fedpdm_flower.fedapp.compression.codec import MalformedPayload
from fedpdm_flower.fedapp.layout import FloatArray
from fedpdm_flower.fedapp.privacy.dpq import DPQSchedule, TimeVaryingNoise
from fedpdm_flower.fedapp.privacy.dpsgd import DPSGDMechanism, dpsgd_epsilon
from fedpdm_flower.fedapp.privacy.target import MISSING, PrivacyTarget, require_privacy
from fedpdm_flower.fedapp.results import RoundRecord
from fedpdm_flower.strategies.base import Scalar
from fedpdm_flower.strategies.decentralized import SyncRouter

#: config keys of a train message: the update index k (-1 = bootstrap), whether the round is evaluated, and whether
#: the node is asked to upload its exact x_i for the node-average model
K_KEY, EVAL_KEY, SHARE_KEY = "dpq-k", "dpq-eval", "dpq-share-state"
#: config keys of the run constants (the same in every message of a run; a node refuses a change)
HORIZON_KEY, ALPHA_KEY, BETA_KEY, BATCH_KEY = "dpq-horizon", "dpq-alpha-hat", "dpq-beta-hat", "dpq-batch-size"
QSTEP_KEY, NOISE_KEY, SELF_TERM_KEY = "dpq-q-step", "dpq-noise", "dpq-self-term"
SIGMA_EXP_KEY, SIGMA_OFFSET_KEY, SIGMA_SCALE_KEY = "dpq-sigma-exp", "dpq-sigma-offset", "dpq-sigma-scale"
C_KEY, DELTA_EXP_KEY, DELTA_SHIFT_KEY = "dpq-c", "dpq-delta-exp", "dpq-delta-shift"
RUN_KEYS = (HORIZON_KEY, ALPHA_KEY, BETA_KEY, BATCH_KEY, QSTEP_KEY, NOISE_KEY, SELF_TERM_KEY, SIGMA_EXP_KEY,
            SIGMA_OFFSET_KEY, SIGMA_SCALE_KEY, C_KEY, DELTA_EXP_KEY, DELTA_SHIFT_KEY)
#: spec 2.5: the paper's algorithm and its ablations
VARIANTS = dpq.ABLATIONS

__all__ = ["DPQDSGD", "EVAL_KEY", "K_KEY", "RUN_KEYS", "SHARE_KEY", "VARIANTS", "MessageInfo"]


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


def _real(name: str, value: Any, *, lo: float = -math.inf, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < lo or (lo_open and value == lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    return float(value)


class DPQDSGD(SyncRouter):
    """DPQ-DSGD (Algorithm 1): the nodes noise, quantize and exchange their models along the graph (module docstring).

    The step sizes, the batch size and the noise follow Theorem 1 / Assumption 4 (spec 2.1) for the horizon K; the
    defaults are the paper's MNIST experiment (Section 4): at K = 2000, alpha_hat = 0.0101, beta_hat = 0.0010,
    gamma_hat = 50. Works on any model's ``ArrayRecord``: the nodes (:class:`fedpdm_flower.clients.dpq.DPQClient`) train the
    user's torch module (its buffers stay with each node; with noise, a module without buffers) or numpy model on the
    user's data. For a neural network use ``q_step=0.05, sigma_scale=0.03, a3=40.0``: the defaults diverge on a
    small CNN (0.007 after 5 rounds, these 0.52; docs/models-and-data.md).

    Parameters
    ----------
    privacy
        Required; no epsilon is chosen for you (built without it, the strategy refuses to start with
        :class:`~fedpdm_flower.fedapp.privacy.target.PrivacyNotChosen`, naming what to pass). One of:

        * :class:`fedpdm_flower.fedapp.privacy.target.PrivacyTarget` -- **record-level DP-SGD in the gradient (5)**:
          at iteration k node i Poisson-samples its records at ``sample_rate`` from its own randomness, clips every
          record's gradient to ``clip_norm`` and adds Gaussian noise to the clipped sum (one DP-SGD step per
          iteration; the sample replaces the paper's gamma_hat minibatch). The consensus step (6), the quantizer and
          the messages are post-processing: no noise is added to the messages, and the guarantee holds against
          everyone who sees them -- the routing server, every neighbour, an eavesdropper. z is calibrated under the
          RDP accountant of the subsampled Gaussian for the run's updates (``num_rounds - 1``, or the target's
          ``horizon``); each node charges its own ledger and refuses a step past its floor. The node-average
          model (``evaluate_average``) is post-processing too, so it stays inside the guarantee.
        * :class:`fedpdm_flower.fedapp.privacy.dpq.TimeVaryingNoise` -- the paper's mechanism, the reproduction
          setting: noise ``sigma_k = sigma_scale (k + sigma_offset)^sigma_exp`` on the messages, each node's ledger
          the paper accountant (Theorem 1's sum eps_k); its rigorous epsilon is unbounded (no clipping) and is
          reported as inf beside it.
        * ``None`` -- no noise (quantization only, or plain DSGD with ``q_step=0``).
    q_step
        Delta, the step of the probabilistic quantizer eq. (3) on the grid Delta Z (default 1; the paper uses 1, 5,
        10). 0: no quantization, the messages are float32 (the paper's "DP only" and "DSGD" ablations, spec 2.5).
    horizon
        K: the run is iterations k = 0..K, and alpha_hat, beta_hat, gamma_hat depend on it (Theorem 1: constant
        within a run, a run cannot be extended, spec 9.19). None (default) takes ``num_rounds - 2``, so
        ``num_rounds = K + 2`` runs Algorithm 1 in full; a larger horizon runs only the first ``num_rounds - 1``
        iterations of that schedule.
    a1, alpha
        Gradient step ``alpha_hat = a1 (ln K)^2 / K^alpha`` of (6) (Assumption 4; defaults 0.35 and 1).
    a2, beta
        Consensus step ``beta_hat = a2 / K^beta`` of (6), which must lie in (0, 1) (Theorem 1; defaults 0.3, 0.75).
    a3, gamma
        Minibatch size ``gamma_hat = floor(a3 K^gamma) + 1`` of (5), drawn without replacement (defaults 0.24, 0.7).
        Unused under DP-SGD (its Poisson sample has expected size q D).
    self_term
        ``"z"`` (default: a_ii multiplies the node's own quantized noisy message, as (31) does) or ``"x"`` (its exact
        state; spec 9.3's variant).
    evaluate_average
        In evaluation rounds ask every node to upload its exact x_i, so the server can form and evaluate
        (``evaluate_fn``) the node-average model. Evaluation only and outside the DP guarantee (spec 7.7's
        ``debug_leak_state``): nodes refuse unless their device allows it (``DPQClient(share_model=True)``).
        Default False.
    graph
        The communication graph (:class:`fedpdm_flower.strategies.decentralized.GraphRouting`; default "ring"), with
        Metropolis-Hastings weights (symmetric, doubly stochastic, spec 6.3).
    **federation
        :class:`fedpdm_flower.strategies.base.FederatedStrategy`'s arguments; every node takes part in every round, nodes are
        numbered by their partition-id, ``min_available_nodes`` is the number of nodes, and ``eval_every`` sets the
        evaluation rounds.

    Examples
    --------
    >>> strategy = DPQDSGD(min_available_nodes=4, graph="ring", q_step=0.01, a1=4.6,
    ...                    privacy=PrivacyTarget(epsilon=8.0, sample_rate=0.02, clip_norm=1.0))
    >>> result = strategy.start(grid=grid, initial_arrays=ArrayRecord(net.state_dict()), num_rounds=K + 2)
    """

    #: SyncRouter's, plus the forwarded messages' bits, the mean message, the node-average model and the nodes'
    #: privacy and evaluation figures of the last round (``infos`` lives within one round; checkpoints)
    CHECKPOINT_ATTRS = (*SyncRouter.CHECKPOINT_ATTRS, "outbox_bits", "z_mean", "avg_model", "avg_round", "eval_x",
                        "node_privacy", "node_eval")

    privacy_label = "eps(Thm 1)"
    #: the nodes' rigorous cumulative epsilon under DP-SGD (their ledgers, RDP of the subsampled Gaussian)
    PRIVACY_KEYS = ("eps_dpsgd",)
    RIGOROUS_PRIVACY = ("eps_dpsgd", "RDP (record-level DP-SGD, Poisson-subsampled Gaussian)")

    def __init__(self, *, privacy: Any = MISSING, q_step: float = 1.0, horizon: int | None = None, a1: float = 0.35,
                 alpha: float = 1.0, a2: float = 0.3, beta: float = 0.75, a3: float = 0.24, gamma: float = 0.7,
                 self_term: str = "z", evaluate_average: bool = False, **federation: Any) -> None:
        privacy = require_privacy(privacy, type(self).__name__, "TimeVaryingNoise(sigma_exp=..., ...)")
        super().__init__(**federation)
        if privacy is not None and not isinstance(privacy, PrivacyTarget | TimeVaryingNoise):
            raise TypeError(f"privacy must be a PrivacyTarget (record-level DP-SGD), a TimeVaryingNoise (the paper's "
                            f"mechanism) or None (no noise), got {type(privacy).__name__}")
        self.target: PrivacyTarget | None = privacy if isinstance(privacy, PrivacyTarget) else None
        self.paper: TimeVaryingNoise | None = privacy if isinstance(privacy, TimeVaryingNoise) else None
        if self.target is not None:
            self.target.rate("DPQDSGD")  # the sample rate is required: said now
            self.privacy_label = "eps(DP-SGD, RDP)"
        noise = self.paper or TimeVaryingNoise()  # the schedule's noise constants (unused without the paper's noise)
        self.q_step = _real("q_step", q_step, lo=0.0)
        #: spec 2.5's name of this configuration (noise x quantization), for records and the reproduction app
        self.variant = ("dpq" if self.q_step > 0 else "dp-only") if self.paper is not None else \
            ("quant-only" if self.q_step > 0 else "dsgd")
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 2):
            raise ValueError(f"horizon must be None or an integer K >= 2, got {horizon!r}")
        self.horizon = horizon
        self.a1, self.a2, self.a3 = (_real(n, v, lo=0.0, lo_open=True) for n, v in (("a1", a1), ("a2", a2), ("a3", a3)))
        self.alpha, self.beta, self.gamma = (_real(n, v) for n, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma)))
        self.sigma_exp, self.sigma_offset, self.sigma_scale = noise.sigma_exp, noise.sigma_offset, noise.sigma_scale
        self.delta_exp, self.delta_shift, self.dp_C = noise.delta_exp, noise.delta_shift, noise.dp_C
        #: the DP-SGD mechanism of every node's gradient (z, q, C; one step per update), set by :meth:`prepare`
        self.dpsgd: DPSGDMechanism | None = None
        if self_term not in ("z", "x"):
            raise ValueError(f"self_term must be 'z' or 'x', got {self_term!r}")
        self.self_term = self_term
        if not isinstance(evaluate_average, bool):
            raise ValueError(f"evaluate_average must be True or False, got {evaluate_average!r}")
        self.evaluate_average = evaluate_average
        self.schedule: DPQSchedule | None = None
        self.params: dpq.DPQParams | None = None
        self.on_initialize()

    # ------------------------------------------------------------------ run constants
    def prepare(self, num_rounds: int, **kwargs: Any) -> None:
        """Fix the horizon K and Theorem 1's schedule for a run of ``num_rounds`` rounds (bootstrap + iterations)."""
        super().prepare(num_rounds, **kwargs)
        K = self.horizon if self.horizon is not None else num_rounds - 2
        if K < 2:
            raise ValueError(f"num_rounds = {num_rounds}: with horizon=None the horizon is K = num_rounds - 2 "
                             "(bootstrap round + iterations k = 0..K) and must be >= 2, so num_rounds >= 4")
        if num_rounds > K + 2:
            raise ValueError(f"num_rounds = {num_rounds} exceeds horizon + 2 = {K + 2}: the schedule is built for "
                             "k = 0..K and a run cannot be extended (spec 9.19)")
        self.schedule = DPQSchedule(K=K, a1=self.a1, alpha=self.alpha, a2=self.a2, beta=self.beta, a3=self.a3,
                                    gamma=self.gamma, dp_C=self.dp_C, delta_exp=self.delta_exp,
                                    sigma_exp=self.sigma_exp, sigma_offset=self.sigma_offset,
                                    sigma_scale=self.sigma_scale, delta_shift=self.delta_shift)
        base = dpq.params_from_schedule(self.schedule, q_step=self.q_step, seed=None, self_term=self.self_term,
                                        float_messages="float32")
        self.params = dpq.ablation(base, self.variant)
        if self.target is not None:  # before round 1: an unreachable target stops here, naming the knob
            updates = num_rounds - 1  # round 1 is the bootstrap; every later round is one update (5)-(6)
            if self.target.horizon is not None and self.target.horizon < updates:
                raise ValueError(f"PrivacyTarget horizon = {self.target.horizon} covers fewer DP-SGD steps than the "
                                 f"{updates} updates every node takes in {num_rounds} rounds")
            self.dpsgd = self.target.mechanism(1, updates, owner="DPQDSGD")
            log(INFO, "DPQDSGD: record-level DP-SGD, (epsilon, delta) = (%g, %g) per node over %d step(s): z = %.4g, "
                "q = %g, C = %g", self.target.epsilon, self.target.delta, self.target.horizon or updates,
                self.dpsgd.noise_multiplier, self.dpsgd.sample_rate, self.dpsgd.clip_norm)
        if self.params.noise:
            for k in (0, K + 1):  # sigma_k is a power law in k: its extremes are at the ends
                sig = self.params.sigma(k)
                if not (math.isfinite(sig) and sig > 0):
                    raise ValueError(f"sigma_exp = {self.sigma_exp} gives sigma_{k} = {sig}, not a usable noise std")

    def run_config(self) -> dict[str, Scalar]:
        """The run constants every message carries (:data:`RUN_KEYS`)."""
        p = self.params
        if p is None or self.schedule is None:
            raise RuntimeError("the strategy has no schedule yet: call start(...) or prepare(num_rounds) first")
        assert p.batch_size is not None and p.K is not None
        return {HORIZON_KEY: p.K, ALPHA_KEY: p.alpha_hat, BETA_KEY: p.beta_hat, BATCH_KEY: p.batch_size,
                QSTEP_KEY: p.q_step, NOISE_KEY: p.noise, SELF_TERM_KEY: p.self_term, SIGMA_EXP_KEY: p.sigma_exp,
                SIGMA_OFFSET_KEY: p.sigma_offset, SIGMA_SCALE_KEY: p.sigma_scale, C_KEY: self.schedule.dp_C,
                DELTA_EXP_KEY: self.schedule.delta_exp, DELTA_SHIFT_KEY: self.schedule.delta_shift}

    def on_initialize(self) -> None:
        """Forget the server-side state of any earlier run."""
        self.outbox_bits: dict[int, int] = {}
        self.infos: dict[int, MessageInfo] = {}
        self.eval_x: dict[int, FloatArray] = {}
        self.avg_model: FloatArray | None = None
        self.avg_round = 0
        self.z_mean: FloatArray | None = None
        self.node_privacy: dict[str, float] = {}
        self.node_eval: dict[str, float] = {}

    # ------------------------------------------------------------------ rounds
    def is_eval_round(self, server_round: int) -> bool:
        """Every ``eval_every`` rounds and the last."""
        return server_round % self.eval_every == 0 or server_round == self.num_rounds

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        """The run constants, the update index k = round - 2 (the node checks it against its own counter) and the
        evaluation flags."""
        evaluated = self.is_eval_round(server_round)
        dp: dict[str, Scalar] = {}
        if self.target is not None and self.dpsgd is not None:  # one DP-SGD step per update (none in round 1)
            dp = dict(self.target.message_config(self.dpsgd))
        return {**self.run_config(), K_KEY: server_round - 2, EVAL_KEY: evaluated,
                SHARE_KEY: evaluated and self.evaluate_average, **dp}

    def initial_vector(self) -> NDArray[Any]:
        """x_0 as it travels in round 1: float32 when that is exact (a float32 model), else float64."""
        x32 = self.x.astype(np.float32)
        return x32 if np.array_equal(x32.astype(np.float64), self.x) else self.x.copy()

    def client_payload(self, server_round: int, client: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        """SyncRouter's inbox and routing, plus the common x_0 in round 1 (the bootstrap)."""
        arrays, config = super().client_payload(server_round, client)
        if server_round == 1:
            arrays = [self.initial_vector()]
        elif self.outbox:  # spec 7.5 downlink_bits: the forwarded messages' accounting bits
            self._acc["down_bits"] = self._acc.get("down_bits", 0) + sum(
                self.outbox_bits[j] for j in self.neighbours(client))
        return arrays, config

    def decode_update(self, server_round: int, client: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        """The message (validated, forwarded later unchanged) plus, in evaluation rounds with ``evaluate_average``,
        the node's x_i (kept apart, never forwarded)."""
        upload_x = self.evaluate_average and self.is_eval_round(server_round)
        if len(arrays) != 1 + int(upload_x):
            raise MalformedPayload(f"round {server_round}: expected {1 + int(upload_x)} array(s), got {len(arrays)}")
        if metrics.get("k") != server_round - 2:
            raise MalformedPayload(f"node {client} reports update k = {metrics.get('k')}, expected {server_round - 2}")
        msg = super().decode_update(server_round, client, arrays[:1], metrics)
        if upload_x:
            x = np.asarray(arrays[1])
            if x.dtype != np.float64 or x.shape != (self.dim,) or not np.all(np.isfinite(x)):
                raise MalformedPayload(f"node {client}'s evaluation x must be finite float64 of shape ({self.dim},), "
                                       f"got {x.dtype} {x.shape}")
            self.eval_x[client] = x
            self._acc["eval_up"] = self._acc.get("eval_up", 0) + int(x.nbytes)
        return msg

    def validate_message(self, agent: int, arrays: list[NDArray[Any]]) -> list[NDArray[Any]]:
        """Decode the message exactly as a receiving node will (form, canonical header, count d, padding, range);
        count its bits."""
        assert self.params is not None
        raw = arrays[0]
        if self.params.quantized:
            levels = quantize.decode_levels({"qlevels": raw}, count=self.dim)
            info = MessageInfo(bits=quantize.message_bits(levels), width=quantize.level_width(levels),
                               entropy=quantize.empirical_entropy_bits(levels), wire_bytes=int(raw.nbytes),
                               z=quantize.dequantize(levels, self.params.q_step))
        else:
            z = quantize.decode_float32({"dense": raw}, count=self.dim)
            info = MessageInfo(bits=quantize.float32_message_bits(self.dim), width=32, entropy=32.0,
                               wire_bytes=int(raw.nbytes), z=z)
        self.infos[agent] = info
        return arrays

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Store the messages (SyncRouter), then the round's bits, the worst node's privacy and the nodes' evaluation."""
        assert self.params is not None
        diag = super().aggregate(server_round, updates, metrics)
        n = self.num_clients
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
        losses = [metrics[i].get("train_loss") for i in range(n)]
        if server_round > 1 and all(isinstance(v, int | float) for v in losses):
            diag["mean_train_loss"] = float(np.mean([float(v) for v in losses]))  # type: ignore[arg-type]
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
                "eps_rigorous": TimeVaryingNoise.RIGOROUS_EPSILON,  # no clipping: no bound (TimeVaryingNoise)
            }
        elif self.dpsgd is not None and server_round > 1:
            reported = [metrics[i].get("eps_dpsgd") for i in range(n)]
            steps = server_round - 1
            self.node_privacy = {
                "eps_dpsgd": max(float(v) for v in reported if isinstance(v, int | float)) if any(
                    isinstance(v, int | float) for v in reported) else math.nan,
                # the server's recomputation from (z, q, steps): what every node's ledger must say
                "eps_dpsgd_server": dpsgd_epsilon(self.dpsgd.noise_multiplier, self.dpsgd.sample_rate, steps,
                                                  self.target.delta if self.target is not None else 1e-5),
                "dp_noise_multiplier": self.dpsgd.noise_multiplier, "dp_sample_rate": self.dpsgd.sample_rate,
                "dp_clip": self.dpsgd.clip_norm, "dp_steps": float(steps),
            }
        self.node_eval = {}
        if self.is_eval_round(server_round):
            self.node_eval = self._node_evaluation(metrics)
            if self.evaluate_average:
                self.avg_model = np.mean(np.stack([self.eval_x[i] for i in range(n)]), axis=0)
                self.avg_round = server_round
                self.eval_x = {}
        return diag

    def _node_evaluation(self, metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        """Mean / min / max of the nodes' own test accuracies (spec 9.17), when every node reports them."""
        n = self.num_clients
        out: dict[str, float] = {}
        if all("test_accuracy" in metrics[i] and "test_loss" in metrics[i] for i in range(n)):
            acc = np.array([float(metrics[i]["test_accuracy"]) for i in range(n)])
            out.update({"test_accuracy": float(acc.mean()),
                        "test_loss": float(np.mean([float(metrics[i]["test_loss"]) for i in range(n)])),
                        "node_test_acc_min": float(acc.min()), "node_test_acc_max": float(acc.max()),
                        "node0_test_acc": float(acc[0])})
        if all("train_accuracy" in metrics[i] for i in range(n)):
            out["node_train_acc_mean"] = float(np.mean([float(metrics[i]["train_accuracy"]) for i in range(n)]))
        return out

    # ------------------------------------------------------------------ records
    def global_model(self) -> FloatArray:
        """The node-average model of the last evaluation upload, else the mean decoded message, else x_0."""
        if self.avg_model is not None:
            return self.avg_model
        if self.z_mean is not None:
            return self.z_mean
        return self.x

    def privacy_summary(self) -> dict[str, float]:
        """The worst node's ledger after the last round: DP-SGD's RDP epsilon (and the server's recomputation), or
        the paper accountant's (cumulative eps, delta_hat) with the rigorous figure (inf) beside it; empty without
        noise."""
        return dict(self.node_privacy)

    def headline_privacy(self, priv: Any) -> tuple[float | None, float | None]:
        """DP-SGD: the worst node's RDP epsilon at the target's delta; the paper's mechanism: Theorem 1's
        (eps, delta_hat) of the worst node's ledger; None without noise."""
        if self.target is not None and isinstance(priv.get("eps_dpsgd"), int | float):
            return float(priv["eps_dpsgd"]), float(self.target.delta)
        if "dpq_eps" in priv and "dpq_delta_hat" in priv:
            return float(priv["dpq_eps"]), float(priv["dpq_delta_hat"])
        return None, None

    def evaluate_round(self, server_round: int) -> RoundRecord:
        """The round's record: bytes and bits, the worst node's privacy, the nodes' evaluation and ``evaluate_fn`` on
        the node-average model uploaded this round (module docstring)."""
        assert self.params is not None
        rec = RoundRecord(round=server_round)
        rec.uplink_bytes, rec.downlink_bytes = int(self._acc.get("up", 0)), int(self._acc.get("down", 0))
        rec.extra.update(self._acc.get("diag", {}))
        if self.params.noise and self.node_privacy:
            rec.epsilon, rec.delta = self.node_privacy["dpq_eps"], self.node_privacy["dpq_delta_hat"]
            rec.extra.update(self.node_privacy)
            rec.extra["dpq_delta_hat_vacuous"] = self.node_privacy["dpq_log_delta_hat"] >= 0.0
        elif self.node_privacy:
            rec.epsilon, rec.delta = self.headline_privacy(self.node_privacy)
            rec.extra.update(self.node_privacy)
        ev = dict(self.node_eval)
        if ev.get("test_accuracy") is not None:
            rec.test_accuracy, rec.test_loss = ev.pop("test_accuracy"), ev.pop("test_loss")
        rec.extra.update(ev)
        if self.evaluate_fn is not None and self.avg_model is not None and self.avg_round == server_round:
            res = self.call_evaluate_fn(server_round)
            for key, value in (dict(res) if res is not None else {}).items():
                name = {"accuracy": "test_accuracy", "loss": "test_loss"}.get(key, key)
                rec.extra[f"avg_model_{name}"] = value
            if rec.test_accuracy is None:  # the nodes did not evaluate themselves: the average model's numbers
                acc, loss = rec.extra.get("avg_model_test_accuracy"), rec.extra.get("avg_model_test_loss")
                rec.test_accuracy = float(acc) if isinstance(acc, int | float) else None
                rec.test_loss = float(loss) if isinstance(loss, int | float) else None
        rec.wall_s = time.perf_counter() - float(self._acc.get("t0", time.perf_counter()))
        self.history.append(rec)
        if self.is_eval_round(server_round):
            eps = "" if rec.epsilon is None else f" {self.privacy_label}={rec.epsilon:.4g}"
            avg = rec.extra.get("avg_model_test_accuracy")
            log(INFO, "[round %d/%d] k=%d mean node test_acc=%s%s%s bits/msg=%.0f (%.2f/coord) up=%.1fkB down=%.1fkB",
                server_round, self.num_rounds, server_round - 2,
                "n/a" if rec.test_accuracy is None else f"{rec.test_accuracy:.4f}",
                "" if avg is None else f" avg-model acc={avg:.4f}", eps, rec.extra.get("bits_per_message", 0.0),
                rec.extra.get("bits_per_coordinate", 0.0), rec.uplink_bytes / 1e3, rec.downlink_bytes / 1e3)
        return rec

    def configure_evaluate(self, server_round: int, arrays: Any, config: Any, grid: Any) -> Any:
        """Client-side evaluation (Flower's ``fraction_evaluate``) of the node-average model, in the rounds that
        formed it (``evaluate_average``); none in other rounds, where the server holds no model: the mean of the
        noisy published messages is not one (spec 7.4 says never to evaluate it). The nodes' own evaluation of their
        x_i is in :attr:`history`."""
        if self.avg_model is None or self.avg_round != server_round:
            self._eval_msgs = []
            return []
        return super().configure_evaluate(server_round, arrays, config, grid)

    def describe(self) -> dict[str, Any]:
        privacy = ("none" if self.target is None and self.paper is None else
                   f"{self.target}" if self.target is not None else f"{self.paper}")
        out = {**super().describe(), "privacy": privacy, "variant": self.variant, "q_step": self.q_step,
               "horizon": self.horizon,
               "sigma_k": f"{self.sigma_scale:g} (k + {self.sigma_offset:g})^{self.sigma_exp:g}",
               "evaluate_average": self.evaluate_average}
        if self.params is not None:
            out.update({"K": self.params.K, "alpha_hat": self.params.alpha_hat, "beta_hat": self.params.beta_hat,
                        "batch": self.params.batch_size})
        return out
