"""DPQ-DSGD nodes on Flower (seed 004, spec dp_quantized.md 2.3, 7.2-7.7; server side :mod:`fedpdm_flower.strategies.dpq`).

Each node runs Algorithm 1 with the per-node functions of :mod:`fedpdm_flower.fedapp.algorithms.dpq` on the user's model and the
user's data (:func:`fedpdm_flower.fedapp.algorithms.dpq.local_objective`), adds the privacy noise and quantizes before anything
leaves the node, and keeps its state in ``context.state``:

* ``"dpq"`` (ArrayRecord): ``x`` = x_{i,k} (float64, bit for bit) and ``m`` = its own message of iteration k (int64
  levels, or the float32 vector of the unquantized variants), needed for the ``a_ii z_{i,k}`` self term of (6);
* ``"dpq-meta"`` (ConfigRecord): ``k`` (the iteration of the stored x and m) and ``t`` (messages published);
* ``"dpq-run"`` (ConfigRecord): the run constants of the bootstrap message; a later message with other constants is
  refused (the schedule is fixed for the run, spec 9.19, and the ledger is built on it);
* ``"dpq-ledger"`` (ConfigRecord): the node's :class:`fedpdm_flower.fedapp.privacy.dpq.DPQLedger` (the sigma of every release
  x_{i,k+1} + n_{i,k+1} and its eps_k; only with noise).

A train message of round r carries the run constants and ``dpq-k`` = r - 2 (keys of :mod:`fedpdm_flower.strategies.dpq`):

* r = 1 (bootstrap): x_{i,0} = the common x_0 the message carries (one float32 / float64 vector of d values);
  publish m_{i,0} (sigma_0; data-independent, no privacy cost).
* r >= 2: k = r - 2; the neighbours' m_{j,k} (checked against this node's graph neighbours and mixing row by
  :class:`fedpdm_flower.clients.decentralized.SyncAgentClient`, each decoded and range-checked: a message that cannot be decoded is
  refused, and nothing of it is mixed); :func:`fedpdm_flower.fedapp.algorithms.dpq.node_round` (gradient (5) on the minibatch of
  ``default_rng([seed, 52, i, k])``, update (6), then m_{i,k+1} with sigma_{k+1}); record eps_k.

The reply is one array: :func:`fedpdm_flower.fedapp.compression.quantize.encode_levels` of the levels (uint8, spec 7.7's integer
upload) or :func:`~fedpdm_flower.fedapp.compression.quantize.encode_float32` of x + n; ``num_examples`` = the batch size gamma_hat.
Metrics (scalars outside the DP guarantee, spec 7.4): ``t``, ``k``, the minibatch ``train_loss``, the ledger's
``dpq_eps`` (sum eps_k), ``dpq_log_delta_hat``, ``dpq_eps_k_max``, and in evaluation rounds the node's own
``test_accuracy`` / ``test_loss`` (with ``test_data``) and ``train_accuracy``. When the server asks for it and the
device allows it (``share_model``), an evaluation round's reply also carries x_{i,k+1} (float64) for the server's
node-average model -- evaluation only, not private.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context
from numpy.typing import NDArray

from fedpdm_flower.clients.base import ROUND_KEY, MessageConfig
from fedpdm_flower.clients.decentralized import MSG_ROUND, SyncAgentClient
from fedpdm_flower.fedapp.algorithms import dpq
from fedpdm_flower.fedapp.compression import quantize
from fedpdm_flower.fedapp.compression.codec import MalformedPayload
from fedpdm_flower.fedapp.localdata import ArrayData, TorchData
from fedpdm_flower.fedapp.privacy.dpq import DPQLedger, Lemma3Warning
from fedpdm_flower.strategies.dpq import (
    ALPHA_KEY,
    BATCH_KEY,
    BETA_KEY,
    C_KEY,
    DELTA_EXP_KEY,
    DELTA_SHIFT_KEY,
    EVAL_KEY,
    HORIZON_KEY,
    K_KEY,
    NOISE_KEY,
    QSTEP_KEY,
    RUN_KEYS,
    SELF_TERM_KEY,
    SHARE_KEY,
    SIGMA_EXP_KEY,
    SIGMA_OFFSET_KEY,
    SIGMA_SCALE_KEY,
)

STATE, META, RUN, LEDGER = "dpq", "dpq-meta", "dpq-run", "dpq-ledger"

__all__ = ["LEDGER", "META", "RUN", "STATE", "DPQClient"]

Fit = tuple[list[NDArray[Any]], int, dict[str, Any]]


class DPQClient(SyncAgentClient):
    """One DPQ-DSGD node: Algorithm 1's lines 2-5 on the user's model and data (module docstring).

    Parameters
    ----------
    model
        The user's model: a torch ``nn.Module`` (with ``loss_fn``) or a numpy model object with ``dim``,
        ``grad(x, inputs, targets)`` (the mean per-sample gradient, eq. (5)) and ``loss(x, inputs, targets)``. A
        torch model's buffers (BatchNorm's running statistics) stay beside x, never noised, quantized or mixed: they
        are the node's own, kept in ``context.state`` (and averaged by the server only when the node shares its
        model, ``share_model``); a run with privacy noise refuses them (as Opacus's validator does).
    data
        Node i's local data D_i: ``(x, y)`` arrays or a torch ``Dataset`` / ``DataLoader`` (its sampler is not
        used: the minibatch B_{i,k} of gamma_hat samples is drawn by index without replacement, spec 1.4).
    loss_fn
        The torch model's loss with mean reduction (default cross-entropy); f_i is its mean over the minibatch.
    context, seed
        As :class:`fedpdm_flower.clients.base.FedClient`. The device's ``seed`` drives the noise, quantizer and minibatch streams
        ``default_rng([seed, 50|51|52, i, k])`` (spec 7.6); None (default) draws from the OS.
    neighbours
        The device's own list of its graph neighbours; None trusts the server's routing.
    test_data
        Optional held-out data (arrays or a torch Dataset) on which the node evaluates its own x_i in evaluation
        rounds (``test_accuracy`` / ``test_loss``, spec 9.17).
    eval_samples
        The train accuracy of evaluation rounds uses the first ``eval_samples`` local samples (None: all).
    share_model
        The device allows uploading its exact x_i when the server asks (``DPQDSGD(evaluate_average=True)``), for a
        node-average model outside the DP guarantee. Default False: such a request is refused.
    max_epsilon
        The device's privacy floor: the largest cumulative epsilon of the paper accountant (Theorem 1, sum eps_k)
        it accepts to spend. A message without noise, or a release that would pass the floor, is refused. None
        (default) sets none.
    max_abs_message
        The largest |z_j| coordinate accepted in a neighbour's message (default 1e6): an honest z_j is x_j + n_j
        rounded to the grid, so a value beyond any plausible weight plus noise is refused before it is mixed. None
        accepts any finite value.

    Examples
    --------
    >>> def client_fn(context):
    ...     return DPQClient(Net(), train_loader, loss_fn=nn.CrossEntropyLoss(), test_data=test_set)
    >>> app = DPQClient.client_app(client_fn)
    """

    def __init__(self, model: Any, data: Any, loss_fn: Any = None, *, context: Context | None = None,
                 seed: int | None = None, neighbours: Any = None, test_data: Any = None,
                 eval_samples: int | None = None, share_model: bool = False, max_epsilon: float | None = None,
                 max_abs_message: float | None = 1e6) -> None:
        if model is None or data is None:
            raise ValueError("DPQClient trains the user's model on the node's data: pass a torch nn.Module (and "
                             "loss_fn) or a numpy model with dim / grad / loss, and the local data")
        super().__init__(model, data, loss_fn, context=context, seed=seed, neighbours=neighbours, test_data=test_data)
        self.objective = dpq.local_objective(self.model, self.require_data())
        if eval_samples is not None and (isinstance(eval_samples, bool) or not isinstance(eval_samples, int)
                                         or eval_samples < 1):
            raise ValueError(f"eval_samples must be None or an integer >= 1, got {eval_samples!r}")
        self.eval_samples = eval_samples
        self.share_model = bool(share_model)
        if max_epsilon is not None and not (math.isfinite(max_epsilon) and max_epsilon > 0):
            raise ValueError(f"max_epsilon must be a finite number > 0 or None, got {max_epsilon!r}")
        if max_epsilon is not None:  # the device publishes only noisy messages, so never trains buffers
            self.refuse_buffers_under_dp(f"this device sets a privacy floor (max_epsilon = {max_epsilon})")
        self.max_epsilon = max_epsilon
        if max_abs_message is not None and not max_abs_message > 0:
            raise ValueError(f"max_abs_message must be > 0 or None, got {max_abs_message!r}")
        self.max_abs_message = max_abs_message

    # ------------------------------------------------------------------ the message's run constants
    def params_of(self, cfg: MessageConfig) -> dpq.DPQParams:
        """The run constants of the message (type- and range-checked) with this device's seed."""
        p = dpq.DPQParams(
            alpha_hat=cfg.number(ALPHA_KEY, lo=0.0), beta_hat=cfg.number(BETA_KEY, lo=0.0, hi=1.0),
            batch_size=cfg.integer(BATCH_KEY, lo=1), q_step=cfg.number(QSTEP_KEY, lo=0.0), noise=cfg.flag(NOISE_KEY),
            sigma_exp=cfg.number(SIGMA_EXP_KEY), sigma_offset=cfg.number(SIGMA_OFFSET_KEY, lo=0.0, lo_open=True),
            sigma_scale=cfg.number(SIGMA_SCALE_KEY, lo=0.0), seed=self.seed,
            self_term=cfg.choice(SELF_TERM_KEY, ("z", "x")), K=cfg.integer(HORIZON_KEY, lo=2),
            float_messages="float32",  # the wire form of unquantized messages (spec 3: 32 d bits)
        )
        assert p.K is not None
        if cfg.integer(K_KEY, lo=-1) > p.K:
            raise ValueError(f"update k = {cfg.config[K_KEY]} lies beyond the horizon K = {p.K}")
        return p

    def new_ledger(self, cfg: MessageConfig, p: dpq.DPQParams) -> DPQLedger:
        """An empty ledger on the run's constants (Lemma 2's sensitivity, Theorem 1's delta_k)."""
        assert p.batch_size is not None
        return DPQLedger(alpha_hat=p.alpha_hat, beta_hat=p.beta_hat, batch_size=p.batch_size,
                         dp_C=cfg.number(C_KEY, lo=0.0, lo_open=True), sigma_exp=p.sigma_exp,
                         delta_exp=cfg.number(DELTA_EXP_KEY, lo=0.0, lo_open=True), sigma_offset=p.sigma_offset,
                         sigma_scale=p.sigma_scale, delta_shift=cfg.integer(DELTA_SHIFT_KEY, lo=0, hi=1))

    # ------------------------------------------------------------------ wire format
    def encode_message(self, p: dpq.DPQParams, msg: dpq.Message) -> NDArray[Any]:
        """The one array a message travels as: bit-packed levels, or float32 x + n."""
        if p.quantized:
            return quantize.encode_levels(msg)["qlevels"]
        return quantize.encode_float32(msg)["dense"]

    def decode_neighbour(self, p: dpq.DPQParams, sender: int, raw: NDArray[Any]) -> dpq.Message:
        """Neighbour j's message as :func:`fedpdm_flower.fedapp.algorithms.dpq.node_update` mixes it (int64 levels or the float
        values), after the checks of a message from a node that may lie: form, canonical header, count d, padding,
        finiteness and ``|z| <= max_abs_message``."""
        d = self.model.dim
        try:
            if p.quantized:
                levels = quantize.decode_levels({"qlevels": np.asarray(raw)}, count=d)
                peak = p.q_step * max(abs(int(levels.min())), abs(int(levels.max()))) if d else 0.0
                msg: dpq.Message = levels
            else:
                msg = quantize.decode_float32({"dense": np.asarray(raw)}, count=d)
                peak = float(np.max(np.abs(msg))) if d else 0.0
        except MalformedPayload as err:
            raise ValueError(f"refused neighbour {sender}'s message: {err}") from None
        if self.max_abs_message is not None and not peak <= self.max_abs_message:
            raise ValueError(f"refused neighbour {sender}'s message: |z| reaches {peak:.3g}, above this device's "
                             f"max_abs_message = {self.max_abs_message:g}")
        return msg

    def initial_state(self, parameters: list[Any]) -> dpq.FloatArray:
        """x_0 from the bootstrap message: one float32 / float64 vector of d finite values."""
        if len(parameters) != 1:
            raise ValueError(f"the bootstrap message must carry x_0 as one vector, got {len(parameters)} arrays")
        x = np.asarray(parameters[0])
        if x.dtype not in (np.float32, np.float64) or x.shape != (self.model.dim,) or not np.all(np.isfinite(x)):
            raise ValueError(f"x_0 must be {self.model.dim} finite float32/float64 values, got {x.dtype} {x.shape}")
        return x.astype(np.float64)

    # ------------------------------------------------------------------ state
    def load(self, k: int, cfg: MessageConfig) -> tuple[dpq.FloatArray, dpq.Message, int, DPQLedger | None]:
        """(x_{i,k}, own m_{i,k}, publications, ledger) from ``context.state``; the stored k must be the server's and
        the run constants the bootstrap's."""
        state = self.state
        if STATE not in state.array_records:
            raise ValueError(f"node {self.agent_id} has no DPQ state: round {k + 2} needs the bootstrap round first")
        meta = state.config_records[META]
        stored = int(meta["k"])  # type: ignore[arg-type]
        if stored != k:
            raise ValueError(f"node {self.agent_id} holds iteration {stored}, the server runs iteration {k}")
        run = dict(state.config_records[RUN])
        changed = sorted(key for key in RUN_KEYS if cfg.config.get(key) != run.get(key))
        if changed:
            raise ValueError(f"refused: the server changed the run constants {changed} after the bootstrap (the "
                             "schedule is fixed for a run, and this node's privacy ledger is built on it)")
        rec = state.array_records[STATE]
        x = np.asarray(rec["x"].numpy(), dtype=np.float64)
        m = rec["m"].numpy()
        ledger = DPQLedger.from_record(dict(state.config_records[LEDGER])) if LEDGER in state.config_records else None
        return x, m, int(meta["t"]), ledger  # type: ignore[arg-type]

    def save(self, x: dpq.FloatArray, m: dpq.Message, k: int, t: int, ledger: DPQLedger | None) -> None:
        """Store x_{i,k} (float64), the own message of iteration k, k, t and the ledger."""
        state = self.state
        state[STATE] = ArrayRecord({"x": Array(np.ascontiguousarray(x, dtype=np.float64)),
                                    "m": Array(np.ascontiguousarray(m))})
        state[META] = ConfigRecord({"k": int(k), "t": int(t)})
        if ledger is not None:
            state[LEDGER] = ConfigRecord(ledger.to_record())  # type: ignore[arg-type]

    def charge(self, ledger: DPQLedger, k: int, sigma: float) -> None:
        """Record the release after update k (noise std ``sigma``); refuse it if it would pass ``max_epsilon``."""
        with warnings.catch_warnings():  # eps_k >= 1 is reported (dpq_lemma3_violations), not raised
            warnings.simplefilter("ignore", Lemma3Warning)
            ledger.record(k, sigma)  # the release x_{k+1} + n_{k+1} (spec 4.1)
        eps = ledger.eps_total
        if self.max_epsilon is not None and not eps <= self.max_epsilon:
            raise ValueError(f"refused: this release would take the device's epsilon (Theorem 1) to {eps:.4g} > its "
                             f"floor max_epsilon = {self.max_epsilon}")

    # ------------------------------------------------------------------ one round
    def fit(self, parameters: list[Any], config: dict[str, Any]) -> Fit:
        """Bootstrap (round 1) or STEP(k) of spec 7.2 (round k + 2)."""
        cfg = MessageConfig(config)
        r = cfg.integer(ROUND_KEY, lo=1)
        k = cfg.integer(K_KEY, lo=-1)
        if k != r - 2:
            raise ValueError(f"round {r} must run update k = {r - 2}, the server sent {K_KEY} = {k}")
        self.check_model(cfg)
        p = self.params_of(cfg)
        if p.noise:
            self.refuse_buffers_under_dp("this run adds privacy noise to the nodes' messages")
        self._share_buffers = cfg.flag(SHARE_KEY, False) and self.share_model
        i = self.agent_id
        metrics: dict[str, Any] = {"agent_id": i, "k": k}
        if r == 1:
            self.check_addressed(cfg)
            if cfg.integer(MSG_ROUND) != 0:
                raise ValueError(f"round 1 carries no neighbours' messages, got round {cfg.config[MSG_ROUND]}'s")
            self.neighbours(cfg)  # a device with pinned neighbours refuses another graph from the start
            if STATE in self.state.array_records:
                raise ValueError(f"node {i} is already initialised (bootstrap round twice?)")
            if self.max_epsilon is not None and not p.noise:
                raise ValueError(f"refused: the server asks for messages without privacy noise, and this device "
                                 f"allows at most epsilon = {self.max_epsilon}")
            x = self.initial_state(parameters)
            m = dpq.node_message(p, i, 0, x)  # z_{i,0}: data-independent, costs no privacy
            t = 1
            ledger = self.new_ledger(cfg, p) if p.noise else None
            self.state[RUN] = ConfigRecord({key: config[key] for key in RUN_KEYS})
        else:
            _, inbox = self.inbox(parameters, cfg)
            w_self, w_nbrs = self.mixing_row(cfg)
            x, own, t, ledger = self.load(k, cfg)
            if ledger is not None:
                self.charge(ledger, k, p.sigma(k + 1))
            received = [self.decode_neighbour(p, j, inbox[j][0]) for j in w_nbrs]
            x, m_next = dpq.node_round(p, i, k, x, own, w_self, list(w_nbrs.values()), received, self.objective)
            assert m_next is not None
            m, t = m_next, t + 1
            if math.isfinite(self.objective.last_loss):
                metrics["train_loss"] = self.objective.last_loss
        self.save(x, m, k + 1, t, ledger)
        metrics["t"] = t
        if ledger is not None:
            budget = ledger.budget()
            metrics.update({"dpq_eps": budget.eps_total, "dpq_eps_k_max": budget.eps_max,
                            "dpq_lemma3_violations": budget.lemma3_violations})
            if math.isfinite(budget.log_delta_hat):
                metrics["dpq_log_delta_hat"] = budget.log_delta_hat
        arrays = [self.encode_message(p, m)]
        if cfg.flag(EVAL_KEY, False):
            metrics.update(self.evaluate_state(x))
        if cfg.flag(SHARE_KEY, False):
            if not self.share_model:
                raise ValueError("refused: the server asks for this node's exact model x_i (evaluation only, outside "
                                 "the DP guarantee); build the client with share_model=True to allow it")
            arrays.append(np.asarray(x, dtype=np.float64))
        return arrays, (p.batch_size or 0) if r > 1 else 0, metrics

    # ------------------------------------------------------------------ evaluation
    def _scores(self, x: dpq.FloatArray, data: ArrayData | TorchData, limit: int | None) -> tuple[float, float]:
        """(accuracy, loss) of x on the first ``limit`` samples of ``data`` (all for None)."""
        n = len(data) if limit is None else min(limit, len(data))
        inputs, targets = data.batch(np.arange(n, dtype=np.int64))
        if hasattr(self.model, "evaluate"):  # a torch model: one forward pass for both
            acc, loss = self.model.evaluate(x, inputs, targets)
            return float(acc), float(loss)
        acc = float(self.model.accuracy(x, inputs, targets)) if hasattr(self.model, "accuracy") else math.nan
        return acc, float(self.model.loss(x, inputs, targets))

    def evaluate_state(self, x: dpq.FloatArray) -> dict[str, float]:
        """This node's own x_i on its test data (if any) and on its first ``eval_samples`` local samples."""
        out: dict[str, float] = {}
        if self.test is not None:
            acc, loss = self._scores(x, self.test, None)
            out.update({"test_accuracy": acc, "test_loss": loss})
        out["train_accuracy"] = self._scores(x, self.require_data(), self.eval_samples)[0]
        return {key: v for key, v in out.items() if math.isfinite(v)}
