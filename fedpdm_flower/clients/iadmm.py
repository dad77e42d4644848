"""DP-IADMM (ObjP / ObjPM, Algorithm 1 lines 11-24) and OutP agents on the user's model and data.

Ryu & Kim, "Differentially Private Federated Learning via Inexact ADMM with Multiple Local Updates" (seed 002);
spec ``shared/specs/dp_iadmm.md`` sections 2.3, 4, 5.2, 9.2, 9.4 and 9.7.

State in ``context.state`` (float64): the dual lambda_p (``iadmm.dual``), the start point of the next round
(``iadmm.z``: z_p^{t,E+1} for ObjP/ObjPM, the noisy iterate for OutP), ``iadmm.meta`` (local solves so far, the
Laplace releases, OutP's pending dual update) and the device's DP-SGD ledger (``iadmm.dpsgd``, also in
``ledger_path`` when given, so that the spend accumulates across runs). Round 1 starts from the received model with
lambda_p = 0 (Algorithm 1 lines 2-3). In the replicated form the agent updates its dual with exactly the
float32-rounded array the server decodes (:func:`fedpdm_flower.fedapp.compression.codec.wire_round`), so both copies
of (4c) stay bit-identical (spec 9.8); an agent that lost its state after round 1 refuses to go on (its dual cannot
be rebuilt), which stops the run naming it. In the mean form (:class:`fedpdm_flower.strategies.iadmm.IADMMMean`) the
agent keeps the only copy of its dual and uploads its term of (4a), ``z_p - lambda_p / rho^{t+1}``, in the model's
own arrays.

**The device's privacy** (``max_epsilon`` at ``delta``): before anything is trained, and for the whole run before
round 1 (the strategy's plan check), the agent refuses a message that asks for no noise, for a calibration that is
not a bound (the paper's data-dependent Delta, OutP's unchecked reference constant or its sigma^2 bug), or whose
releases would take it past its floor. Its spend composes every release it ever made: the DP-SGD steps (and OutP's
Gaussian outputs, sample rate 1) in the core's Renyi-DP ledger (:class:`fedpdm_flower.fedapp.privacy.dpsgd.DPSGDLedger`),
the Laplace solves by their pure composition, and the two families by basic composition.

Everything algorithmic arrives in the message config (the strategy is the single source of truth), checked by
:class:`fedpdm_flower.clients.base.MessageConfig`:

=======================  ====================================================================================
key                      meaning
=======================  ====================================================================================
``iadmm-algorithm``      "dp-iadmm" or "outp": the client must match
``iadmm-form``           "replicated" (default) or "mean" (IADMMMean; DP-IADMM only)
``rho``, ``rho-next``    rho^t of (24) (> 0); rho^{t+1} (mean form: the agent's term of the next (4a))
``eta``                  eta^t (DP-IADMM; > 0)
``local-updates``        E (DP-IADMM)
``dp``                   whether to perturb; then ``dp-mechanism``:
``dp-mechanism``         "dp-sgd": ``dp-noise-multiplier`` z, ``dp-sample-rate`` q, ``clip`` C, ``dp-steps``
                         (= the solves of the round), ``dp-delta``; "laplace-objective" (DP-IADMM's paper
                         mechanism): ``epsilon`` per solve, ``sensitivity-mode`` ("paper", "bounded", "clipped"),
                         ``clip``; "gaussian-output" (OutP's): ``epsilon``, ``delta`` per step,
                         ``sensitivity-mode`` ("reference", "clipped"), ``clip``, ``noise-std``
``box``                  radius B of W = [-B, B]^d (absent: unconstrained)
``beta``, ``num-agents``, ``total-samples``   beta, P and I of f_p (2c)
``eta-scale``, ``order``, ``grad-scale``   OutP's options (fedpdm_flower.strategies.iadmm.OutP)
``dp-plan-rounds``       (whoami, before round 1) the rounds of the run whose privacy plan the device checks
=======================  ====================================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from numpy.typing import NDArray

from fedpdm_flower.clients.base import FedClient, MessageConfig, _pick
from fedpdm_flower.clients.dpsgd import DeviceAccount
from fedpdm_flower.fedapp.algorithms.iadmm import (
    DEVICES,
    OUTP_SENSITIVITY_MODES,
    SENSITIVITY_MODES,
    DPSGDObjective,
    LocalObjective,
    agent_round,
    consensus_term,
    dual_fingerprint,
    dual_update,
    local_objective,
    outp_inv_eta,
    outp_noise_std,
    outp_sigma,
    outp_step,
    sensitivity_clipped,
)
from fedpdm_flower.fedapp.compression.codec import decode_vector, encode_dense, wire_round
from fedpdm_flower.fedapp.compression.payload import FORMAT_KEY, from_arrays, to_arrays
from fedpdm_flower.fedapp.layout import ArrayLayout, FloatArray
from fedpdm_flower.fedapp.models.multinomial import MultinomialLogistic
from fedpdm_flower.fedapp.privacy.dpsgd import DPSGDLedger, DPSGDMechanism, DPSGDStep, device_rng
from fedpdm_flower.fedapp.privacy.laplace import compose_laplace
from fedpdm_flower.fedapp.wire import named_record, to_numpy

__all__ = ["IADMMClient", "OutPClient"]

DUAL, START, META = "iadmm.dual", "iadmm.z", "iadmm.meta"
#: the RNG stream of the paper mechanisms' noise (Laplace / Gaussian output)
STREAM_NOISE = 1
#: config keys shared with fedpdm_flower/strategies/iadmm.py (a client does not import server code)
ALGORITHM_KEY, FORM_KEY, PLAN_KEY, WEIGHT_KEY = "iadmm-algorithm", "iadmm-form", "dp-plan-rounds", "iadmm-weight"
PLAN_STEPS_KEY = "dp-plan-steps-per-round"
Fit = tuple[list[NDArray[Any]], int, dict[str, Any]]


@dataclass(frozen=True)
class Request:
    """The privacy a message asks for: ``kind`` "none", "dp-sgd", "laplace-objective" or "gaussian-output"."""

    kind: str
    mechanism: DPSGDMechanism | None = None  #: DP-SGD's (z, q, C, steps)
    epsilon: float = math.inf  #: epsilon-bar per solve / step (the paper's mechanisms)
    delta: float = 0.0  #: delta-bar per step (OutP's Gaussian)
    mode: str = ""  #: sensitivity mode (the paper's mechanisms)
    clip: float = 0.0  #: C1 / C of a clipped sensitivity mode
    noise_std: str = "sigma"  #: OutP's noise std mode
    report_delta: float = 1e-5  #: the delta the strategy's target / report uses (``dp-delta``)

    @property
    def private(self) -> bool:
        return self.kind != "none"


class IADMMClient(FedClient):
    """Agent p of Algorithm 1: E perturbed inexact solves (8), send their average, update lambda_p (4c).

    Parameters
    ----------
    model
        The user's model. What each privacy setting (chosen by the strategy) needs:

        * DP-SGD (``PrivacyTarget``): per-record gradients: a torch ``nn.Module`` (with ``loss_fn``), the
          multinomial model, or a numpy model with ``per_sample_grads``;
        * the paper's ``"paper"`` and ``"bounded"`` sensitivities are closed forms of its multinomial logistic model
          (63): a :class:`fedpdm_flower.fedapp.models.MultinomialLogistic` (``bias=False`` is the paper's model);
          ``"clipped"`` needs per-record gradients;
        * without privacy any model with ``dim``, ``grad`` and ``loss`` works.

        A message that asks for what the model does not support is refused with an error naming what is missing.
        A model with BatchNorm trains without privacy (its buffers travel beside the vector,
        :mod:`fedpdm_flower.clients.base`); a private round refuses it (swap BatchNorm for GroupNorm, e.g. with
        Opacus's ``ModuleValidator.fix``).
    data
        The local data D_p: ``(x, y)`` arrays or a torch ``Dataset`` / ``DataLoader``. The paper's mechanism and the
        non-private solver use the full local data set in every solve; DP-SGD a Poisson sample of it.
    loss_fn
        The torch model's per-batch mean loss (default cross-entropy); f_p' is ``(I_p / I)`` times its gradient on
        D_p plus ``(2 beta / P) z``.
    context
        The node's Flower Context (bound per message by :meth:`client_app`).
    seed
        The device's seed for the paper's mechanisms' noise (Laplace, OutP's Gaussian), for reproductions; None
        (default): the operating system's entropy. DP-SGD's samples and noise always come from the operating system's
        entropy (the core's ``device_rng``), whatever the seed.
    noise_seed
        An extra seed of the noise streams only (default 0): the reproduction varies it to repeat a run with fresh
        noise and everything else equal.
    device
        Where the multinomial model's full-batch gradient runs: "cpu" (default), "cuda" or "auto". float64.
    max_epsilon
        The device owner's privacy floor: the largest epsilon (at ``delta``) over every release this device ever
        makes (None: no floor). With a floor the device also refuses releases without noise and calibrations that
        are not bounds (module docstring).
    delta
        The delta of the floor (default 1e-5).
    ledger_path
        A file that keeps this device's DP-SGD ledger across runs (None: ``context.state`` only, one run).
    chunk_size
        Samples per full-batch gradient evaluation of a model other than the multinomial one (default 256).
    secure_noise
        Draw DP-SGD's Gaussian noise from ``os.urandom`` (the core's ``gaussian_noise(secure=True)``).
    test_data, test_fn
        Flower's federated evaluation (:meth:`fedpdm_flower.clients.base.FedClient.evaluate`).

    Examples
    --------
    >>> def client_fn(context):
    ...     return IADMMClient(Net(), train_loader, loss_fn=nn.CrossEntropyLoss(), max_epsilon=8.0)
    >>> app = IADMMClient.client_app(client_fn)
    """

    #: the algorithm this client runs (the message's ``iadmm-algorithm`` must match)
    algorithm: ClassVar[str] = "dp-iadmm"
    #: the paper's mechanism of this algorithm and its sensitivity modes
    paper_mechanism: ClassVar[str] = "laplace-objective"
    sensitivity_modes: ClassVar[tuple[str, ...]] = SENSITIVITY_MODES

    def __init__(self, model: Any, data: Any, loss_fn: Any = None, *, context: Any = None, seed: int | None = None,
                 noise_seed: int = 0, device: str = "cpu", max_epsilon: float | None = None, delta: float = 1e-5,
                 ledger_path: str | Path | None = None, chunk_size: int = 256, secure_noise: bool = False,
                 test_data: Any = None, test_fn: Any = None) -> None:
        super().__init__(model, data, loss_fn, context=context, seed=seed, test_data=test_data, test_fn=test_fn)
        if self.data is None:
            raise ValueError(f"{type(self).__name__} needs the agent's local data")
        if isinstance(noise_seed, bool) or not isinstance(noise_seed, int) or noise_seed < 0:
            raise ValueError(f"noise_seed must be an integer >= 0, got {noise_seed!r}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {list(DEVICES)}, got {device!r}")
        if max_epsilon is not None and not (math.isfinite(max_epsilon) and max_epsilon > 0):
            raise ValueError(f"max_epsilon must be a finite number > 0 or None, got {max_epsilon!r}")
        if not 0.0 < delta < 1.0:
            raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
        if max_epsilon is not None:  # the device trains only with noise, so never with buffers
            self.refuse_buffers_under_dp(f"this device sets a privacy floor (max_epsilon = {max_epsilon})")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        self.noise_seed, self.device, self.max_epsilon, self.delta = noise_seed, device, max_epsilon, float(delta)
        self.chunk_size, self.secure_noise = chunk_size, bool(secure_noise)
        self.ledger_path = Path(ledger_path) if ledger_path is not None else None
        #: the core's device ledger (context.state key "dpsgd", shared with the device's other DP-SGD clients); the
        #: floor is checked here, over the ledger and the Laplace solves together (:meth:`guard`)
        self.account = DeviceAccount(ledger_path=self.ledger_path)
        self._objective: tuple[tuple[Any, ...], LocalObjective] | None = None

    # ---------------------------------------------------------------- messages
    def handle(self, message_type: str, content: RecordDict) -> RecordDict:
        """Also: whoami with the run's privacy plan (checked against the floor), and the mean form's train."""
        ckey = _pick(content.config_records, "config")
        config: dict[str, Any] = dict(content.config_records[ckey]) if ckey else {}
        if message_type == "query.whoami":
            return RecordDict({"info": ConfigRecord(self.get_properties(config))})
        if message_type == "train" and config.get(FORM_KEY) == "mean":
            return self.fit_mean(content, config)
        return super().handle(message_type, content)

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        """Also I_p (``num-examples``: a strategy without ``total_samples`` sums them into I before round 1); with
        ``dp-plan-rounds``, the whole run's privacy plan is checked against this device's floor first."""
        if PLAN_KEY in config:
            cfg = MessageConfig(config)
            rounds = cfg.integer(PLAN_KEY, lo=1)
            steps = cfg.integer(PLAN_STEPS_KEY, lo=1, hi=100_000) if PLAN_STEPS_KEY in cfg else None
            self.check_algorithm(cfg, plan=True)
            req = self.request(cfg, steps)
            self.guard(req, rounds, steps)
        floor = {} if self.max_epsilon is None else {"dp-max-epsilon": self.max_epsilon}
        return {**super().get_properties(config), "num-examples": self.num_examples, **floor}

    def check_algorithm(self, cfg: MessageConfig, *, plan: bool = False) -> None:
        """The message must be meant for this client's algorithm (a plan check may omit the key)."""
        got = cfg.config.get(ALGORITHM_KEY)
        if plan and got is None:
            return
        if got != self.algorithm:
            raise ValueError(f"message config {ALGORITHM_KEY!r} = {got!r}, but {type(self).__name__} runs "
                             f"{self.algorithm!r} (DP-IADMM pairs with IADMMClient, OutP with OutPClient)")

    def request(self, cfg: MessageConfig, steps: int | None) -> Request:
        """The privacy the message asks for (``steps``: the solves of a round, which DP-SGD's ``dp-steps`` must be)."""
        if not cfg.flag("dp"):
            return Request("none")
        kind = cfg.choice("dp-mechanism", ("dp-sgd", self.paper_mechanism))
        report = cfg.number("dp-delta", 1e-5, lo=0.0, hi=1.0, lo_open=True, hi_open=True)
        if kind == "dp-sgd":
            mech = DPSGDMechanism.from_config(cfg.config)
            if steps is not None and mech.steps != steps:
                raise ValueError(f"message config 'dp-steps' = {mech.steps} differs from the {steps} local solve(s) of "
                                 "the round: each solve takes one DP-SGD step, and the device charges what it takes")
            return Request(kind, mechanism=mech, report_delta=report)
        eps = cfg.number("epsilon", lo=0.0, lo_open=True)
        mode = cfg.choice("sensitivity-mode", self.sensitivity_modes)
        clip = cfg.number("clip", lo=0.0, lo_open=True) if mode in ("bounded", "clipped") else 0.0
        if kind == "gaussian-output":
            return Request(kind, epsilon=eps, delta=cfg.number("delta", lo=0.0, hi=1.0, lo_open=True, hi_open=True),
                           mode=mode, clip=clip, noise_std=cfg.choice("noise-std", ("sigma", "sigma-squared")),
                           report_delta=report)
        return Request(kind, epsilon=eps, mode=mode, clip=clip, report_delta=report)

    # ---------------------------------------------------------------- the device's privacy
    def load_ledger(self) -> DPSGDLedger:
        """The device's Renyi-DP ledger (the core's :class:`fedpdm_flower.clients.dpsgd.DeviceAccount`: the file
        when the device has one, else ``context.state``)."""
        return self.account.load(self.node_context)

    @staticmethod
    def laplace_history(meta: dict[str, Any]) -> list[tuple[float, int]]:
        """The Laplace solves so far as ``[(epsilon-bar, count), ...]``."""
        flat = [float(v) for v in meta.get("laplace", [])]
        return [(flat[i], int(flat[i + 1])) for i in range(0, len(flat) - 1, 2)]

    @staticmethod
    def gaussian_equivalent(req: Request, steps: int) -> DPSGDMechanism | None:
        """OutP's per-step Gaussian output as a ledger entry: noise multiplier sigma / Delta_2, sample rate 1."""
        if req.kind != "gaussian-output":
            return None
        z = math.sqrt(2.0 * math.log(1.25 / req.delta)) / req.epsilon
        return DPSGDMechanism(noise_multiplier=z, sample_rate=1.0, clip_norm=1.0, steps=steps)

    def spend_after(self, req: Request, solves: int, meta: dict[str, Any], delta: float) -> float:
        """This device's epsilon at ``delta`` were ``solves`` more solves of ``req`` released: the Renyi-DP ledger
        (DP-SGD steps, OutP's Gaussian outputs) plus the Laplace solves' pure composition (basic composition of the
        two)."""
        ledger = self.load_ledger()
        extra: DPSGDMechanism | None = None
        if req.kind == "dp-sgd":
            assert req.mechanism is not None
            m = req.mechanism
            extra = DPSGDMechanism(m.noise_multiplier, m.sample_rate, m.clip_norm, solves)
        elif req.kind == "gaussian-output":
            extra = self.gaussian_equivalent(req, solves)
        gauss = ledger.epsilon_after(extra, delta) if extra is not None else ledger.epsilon(delta)
        laplace = sum(e * n for e, n in self.laplace_history(meta))
        if req.kind == "laplace-objective":
            laplace += solves * req.epsilon
        return gauss + laplace

    def guard(self, req: Request, rounds: int = 1, steps: int | None = None) -> None:
        """The device's floor (module docstring): refuse before anything is trained, naming why."""
        if self.max_epsilon is None:
            return
        if not req.private:
            raise ValueError(f"refused: the server asks for a release without noise, and this device allows at most "
                             f"epsilon = {self.max_epsilon} (max_epsilon)")
        if req.kind == "laplace-objective" and req.mode == "paper":
            raise ValueError("refused: sensitivity mode 'paper' is data-dependent, not a rigorous bound (spec A2); "
                             "this device has a privacy floor (max_epsilon) and accepts 'bounded', 'clipped' or DP-SGD")
        if req.kind == "gaussian-output" and req.mode == "reference":
            raise ValueError("refused: OutP's 'reference' calibration assumes Huang's gradient bound, which this "
                             "device does not check; it has a privacy floor (max_epsilon) and accepts 'clipped' or "
                             "DP-SGD")
        if req.kind == "gaussian-output" and req.noise_std != "sigma":
            raise ValueError("refused: noise-std 'sigma-squared' is not the calibrated Gaussian mechanism (spec A9); "
                             "this device has a privacy floor (max_epsilon)")
        per_round = steps if steps is not None else (req.mechanism.steps if req.mechanism is not None else 1)
        meta = self.load_meta() if self.node_context is not None else {}
        eps = self.spend_after(req, per_round * rounds, meta, self.delta)
        if eps > self.max_epsilon * (1 + 1e-9):
            what = f"the run's {rounds} round(s)" if rounds > 1 else "this round"
            raise ValueError(f"refused: {what} would take this device to epsilon = {eps:.4g} at delta = "
                             f"{self.delta:g} > its floor max_epsilon = {self.max_epsilon}")

    def charge(self, req: Request, solves: int, meta: dict[str, Any]) -> dict[str, float]:
        """Record this round's releases before they can leave: DP-SGD's steps (and OutP's Gaussian outputs, sample
        rate 1) in the device's ledger, the Laplace solves in meta. Returns the ledger's metrics."""
        if req.kind in ("dp-sgd", "gaussian-output"):
            mech = req.mechanism if req.kind == "dp-sgd" else self.gaussian_equivalent(req, solves)
            assert mech is not None
            return self.account.charge(self.node_context, self.load_ledger(), mech, req.report_delta)
        if req.kind == "laplace-objective":
            hist = dict(self.laplace_history(meta))
            hist[req.epsilon] = hist.get(req.epsilon, 0) + solves
            meta["laplace"] = [float(v) for e, n in sorted(hist.items()) for v in (e, n)]
        return {}

    def privacy_metrics(self, req: Request, charged: dict[str, float], meta: dict[str, Any],
                        per_round: int) -> dict[str, Any]:
        """Cumulative figures of this device: DP-SGD's ledger (``eps_dpsgd``, z, q, steps), or the paper mechanism's
        per-solve epsilon-bar with the Renyi-DP and basic compositions over every solve so far (A4, A5)."""
        out: dict[str, Any] = {"participations": int(meta["rounds"]) + 1}
        if req.kind == "dp-sgd":
            out.update(charged)
        elif req.kind == "laplace-objective":
            hist = self.laplace_history(meta)
            out.update({"eps_iter": req.epsilon, "eps_round": per_round * req.epsilon,
                        "eps_basic": sum(e * n for e, n in hist), "delta_basic": 0.0,
                        "local_solves": sum(n for _, n in hist), "eps_rdp": compose_laplace(hist, req.report_delta),
                        "sensitivity_rigorous": float(req.mode != "paper")})
        elif req.kind == "gaussian-output":
            steps = int(meta["solves"])
            out.update({"eps_iter": req.epsilon, "delta_iter": req.delta, "eps_round": req.epsilon,
                        "eps_basic": steps * req.epsilon, "delta_basic": steps * req.delta, "local_solves": steps,
                        "eps_rdp": charged["eps_dpsgd"],
                        "sensitivity_rigorous": float(req.mode != "reference" and req.noise_std == "sigma")})
        return out

    # ---------------------------------------------------------------- what the message says
    def dp_rng(self, t: int) -> np.random.Generator:
        """DP-SGD's generator (samples and noise): always the core's ``device_rng`` (the operating system's entropy),
        never ``seed``: a seed somebody else knows (the reproduction app passes the server's run seed) would let them
        recompute the samples and subtract the noise."""
        return device_rng()

    def objective(self, cfg: MessageConfig, *, mode: str | None, clip: float, norm: int,
                  local_scale: bool) -> LocalObjective:
        """f_p of (2c) for this model (built once for each set of constants; the data do not change)."""
        total = cfg.integer("total-samples", lo=1)
        beta = cfg.number("beta", lo=0.0)
        agents = cfg.integer("num-agents", lo=1)
        data = self.require_data()
        if total < len(data):
            raise ValueError(f"message config 'total-samples' = {total} is smaller than this agent's {len(data)}")
        key = (total, beta, agents, mode, clip, norm, local_scale)
        if self._objective is None or self._objective[0] != key:
            obj = local_objective(self.model, data, total=total, beta=beta, num_agents=agents, sensitivity=mode,
                                  clip=clip, norm=norm, normaliser=float(len(data)) if local_scale else None,
                                  device=self.device, chunk=self.chunk_size)
            self._objective = (key, obj)
        return self._objective[1]

    def dpsgd_objective(self, cfg: MessageConfig, req: Request, t: int, *, local_scale: bool) -> DPSGDObjective:
        """The solve's gradient as the DP-SGD release (:class:`fedpdm_flower.fedapp.algorithms.iadmm.DPSGDObjective`)."""
        assert req.mechanism is not None
        data = self.require_data()
        total = cfg.integer("total-samples", lo=1)
        if total < len(data):
            raise ValueError(f"message config 'total-samples' = {total} is smaller than this agent's {len(data)}")
        step = DPSGDStep(self.model, data, req.mechanism, self.dp_rng(t), secure=self.secure_noise)
        return DPSGDObjective(step, float(len(data)) if local_scale else float(total), cfg.number("beta", lo=0.0),
                              cfg.integer("num-agents", lo=1))

    def receive(self, parameters: list[NDArray[Any]], cfg: MessageConfig) -> FloatArray:
        """The dense vector the server broadcast, decoded to float64 (exactly the server's wire-rounded copy)."""
        self.check_model(cfg)
        code = cfg.integer(FORMAT_KEY, lo=0)
        return decode_vector(from_arrays(parameters, code), self.model.dim).to_dense()

    # ---------------------------------------------------------------- state
    def load_meta(self) -> dict[str, Any]:
        """Round bookkeeping kept in context.state (local solves so far, Laplace releases, OutP's pending dual)."""
        rec = self.state.config_records.get(META)
        base: dict[str, Any] = {"solves": 0, "rounds": 0, "pending": False, "rho_prev": 0.0, "laplace": []}
        return base if rec is None else {**base, **dict(rec)}

    def load_state(self, server_round: int, w: FloatArray) -> tuple[FloatArray, FloatArray, dict[str, Any]]:
        """(lambda_p, start point, meta): lambda = 0 and the received model in round 1 (Algorithm 1 lines 2-3)."""
        lam, start = self.load_vector(DUAL), self.load_vector(START)
        if lam is None or start is None:
            if server_round > 1:
                raise ValueError(f"this agent has no IADMM state (context.state) in round {server_round}: its dual "
                                 "lambda_p was lost with the node's state and cannot be rebuilt (Algorithm 1 needs "
                                 "the agent from round 1 on)")
            return np.zeros(self.model.dim), w.copy(), self.load_meta()
        if lam.shape != w.shape or start.shape != w.shape:
            raise ValueError(f"this agent's IADMM state has {lam.size} entries, the server's model {w.size}")
        return lam, start, self.load_meta()

    def save_state(self, lam: FloatArray, start: FloatArray, meta: dict[str, Any]) -> None:
        self.save_vector(DUAL, lam)
        self.save_vector(START, start)
        meta["rounds"] = int(meta["rounds"]) + 1
        self.state[META] = ConfigRecord(meta)

    def finish(self, t: int, z_send: FloatArray, lam: FloatArray, start: FloatArray, meta: dict[str, Any],
               metrics: dict[str, Any]) -> Fit:
        """Persist the state and build the reply (the dual CRC lets the server check its replica)."""
        self.save_state(lam, start, meta)
        arrays, metrics[FORMAT_KEY] = to_arrays(encode_dense(z_send))
        metrics.update({"dual_crc": dual_fingerprint(lam), "dual_sqnorm": float(np.dot(lam, lam)), "round": t})
        return arrays, self.num_examples, metrics

    # ---------------------------------------------------------------- one round
    def local_solves(self, cfg: MessageConfig, w: FloatArray, t: int) -> tuple[Any, FloatArray, dict[str, Any], dict[str, Any], float]:
        """Algorithm 1 lines 15-21: load the state, check the floor, charge, run the E perturbed solves.

        Returns the round's result, lambda_p^t, meta, the metrics so far, and rho^t.
        """
        rho = cfg.number("rho", lo=0.0, lo_open=True)
        eta = cfg.number("eta", lo=0.0, lo_open=True)
        e_count = cfg.integer("local-updates", lo=1, hi=100_000)
        box = cfg.number("box", 0.0, lo=0.0)
        req = self.request(cfg, e_count)
        if req.private:  # a buffer (BatchNorm's statistics) is outside every privacy analysis
            self.refuse_buffers_under_dp()
        lam, start, meta = self.load_state(t, w)
        self.guard(req, 1, e_count)
        if req.kind == "dp-sgd":
            objective: LocalObjective = self.dpsgd_objective(cfg, req, t, local_scale=False)
        else:
            mode = req.mode if req.kind == "laplace-objective" else None
            # without noise the closed-form sensitivities of model (63) are not needed, so any model runs
            closed_form = mode in ("paper", "bounded") and not isinstance(self.model, MultinomialLogistic)
            objective = self.objective(cfg, mode=None if closed_form and not req.private else mode, clip=req.clip,
                                       norm=1, local_scale=False)
        charged = self.charge(req, e_count, meta)  # the releases are computed next: charged before they can leave
        meta["solves"] = int(meta["solves"]) + e_count
        res = agent_round(objective, start, w, lam, rho=rho, eta=eta, local_updates=e_count,
                          epsilon=req.epsilon if req.kind == "laplace-objective" else math.inf,
                          rng=self.rng(t, STREAM_NOISE, self.noise_seed), box=box)
        metrics: dict[str, Any] = {
            "delta_mean": float(np.mean(res.sensitivities)), "delta_max": float(np.max(res.sensitivities)),
            "lap_scale_mean": float(np.mean(res.scales)), "noise_abs_mean": res.noise_abs_mean,
            **self.privacy_metrics(req, charged, meta, e_count),
        }
        if isinstance(objective, DPSGDObjective):
            std = objective.noise_std()
            metrics.update({"dp_noise_std": std, "noise_abs_mean": std * math.sqrt(2.0 / math.pi),
                            "dp_batch_mean": objective.step.sampled / max(objective.step.taken, 1)})
        return res, lam, meta, metrics, rho

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        """Algorithm 1 lines 15-23 (replicated form)."""
        cfg = MessageConfig(config)
        self.check_algorithm(cfg)
        t = cfg.integer("server-round", lo=1)
        w = self.receive(parameters, cfg)
        res, lam, meta, metrics, rho = self.local_solves(cfg, w, t)
        z_send = wire_round(res.z_avg)  # line 21, as the server will decode it
        if not np.all(np.isfinite(z_send)):
            raise ValueError(f"the local solves diverged (non-finite z) at rho={rho}: nothing is sent")
        lam = dual_update(lam, w, z_send, rho)  # line 23
        return self.finish(t, z_send, lam, res.z_last, meta, metrics)

    def fit_mean(self, content: RecordDict, config: dict[str, Any]) -> RecordDict:
        """Algorithm 1 lines 15-23 in the mean form: upload ``z_p^{t+1} - lambda_p^{t+1} / rho^{t+1}`` in the
        model's own arrays (the server's (4a) is the mean of these; the dual stays here only)."""
        cfg = MessageConfig(config)
        self.check_algorithm(cfg)
        key = _pick(content.array_records, "arrays")
        if key is None:
            raise ValueError("the train message carries no model arrays")
        named = {k: to_numpy(v) for k, v in content.array_records[key].items()}
        layout = ArrayLayout.of(named)
        if layout.dim != self.model.dim:
            raise ValueError(f"received {layout.dim} parameters, this client's model has {self.model.dim}")
        w = layout.flatten(named)
        t = cfg.integer("server-round", lo=1)
        rho_next = cfg.number("rho-next", lo=0.0, lo_open=True)
        res, lam, meta, metrics, rho = self.local_solves(cfg, w, t)
        if not np.all(np.isfinite(res.z_avg)):
            raise ValueError(f"the local solves diverged (non-finite z) at rho={rho}: nothing is sent")
        lam = dual_update(lam, w, res.z_avg, rho)  # line 23, with the agent's exact z (no replica to match)
        upload = consensus_term(res.z_avg, lam, rho_next)  # its term of the next (4a)
        self.save_state(lam, res.z_last, meta)
        reply = named_record(layout.unflatten(upload, named))
        return RecordDict({key: reply, "metrics": MetricRecord({
            **{k: v for k, v in metrics.items() if isinstance(v, int | float)}, WEIGHT_KEY: 1.0,
            "num-examples": self.num_examples, "round": t})})


class OutPClient(IADMMClient):
    """OutP agent: one inexact step (5), then noise (spec 5.2); the noisy iterate is kept.

    In Huang's order (the default) the dual update of round r uses the W that only arrives in round r+1, so it is
    applied at the start of the next fit (``pending`` in ``iadmm.meta``, spec 9.7).

    Under DP-SGD (``privacy=PrivacyTarget``) the step's gradient is the DP-SGD release; by linearity of the step this
    is output noise of std ``z C / (q n (1/eta + rho))`` (:class:`fedpdm_flower.strategies.iadmm.OutP`), reported as
    ``sigma``. Huang's proximity is then the non-private ``0.25 I_p / a``.

    Parameters
    ----------
    model
        The user's model. OutP's ``"reference"`` noise calibration (Huang's bound, the paper's reference code) is
        defined for the paper's multinomial logistic model (63) only (:class:`fedpdm_flower.fedapp.models.MultinomialLogistic`);
        ``"clipped"`` and DP-SGD need per-record gradients (a torch ``nn.Module``, the multinomial model, or a numpy
        model with ``per_sample_grads``); without privacy any model works.
    data, loss_fn, context, seed, noise_seed, device, max_epsilon, delta, ledger_path, chunk_size, secure_noise
        As :class:`IADMMClient`.
    """

    algorithm: ClassVar[str] = "outp"
    paper_mechanism: ClassVar[str] = "gaussian-output"
    sensitivity_modes: ClassVar[tuple[str, ...]] = OUTP_SENSITIVITY_MODES

    def fit_mean(self, content: RecordDict, config: dict[str, Any]) -> RecordDict:
        raise ValueError("OutP runs in the replicated form only (message config 'iadmm-form' = 'mean' is IADMMMean's, "
                         "which runs DP-IADMM)")

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        """One OutP step (spec 5.2) in Huang's order or Algorithm 1's."""
        cfg = MessageConfig(config)
        self.check_algorithm(cfg)
        t = cfg.integer("server-round", lo=1)
        rho = cfg.number("rho", lo=0.0, lo_open=True)
        scale = cfg.number("eta-scale", lo=0.0, lo_open=True)
        order = cfg.choice("order", ("huang", "alg1"))
        local_scale = cfg.choice("grad-scale", ("local", "global")) == "local"
        req = self.request(cfg, 1)
        if req.private:
            self.refuse_buffers_under_dp()
        w = self.receive(parameters, cfg)
        lam, z, meta = self.load_state(t, w)
        self.guard(req, 1, 1)
        if req.kind == "gaussian-output" and req.mode == "reference" and not isinstance(self.model, MultinomialLogistic):
            raise TypeError(f"OutP's 'reference' noise calibration (Huang's bound, spec 5.2) is defined for the "
                            f"paper's multinomial logistic model (63) only; for {type(self.model).__name__} use "
                            "sensitivity_mode='clipped' with a per-record gradient clipping bound clip=C, or DP-SGD")
        if req.kind == "dp-sgd":
            objective: LocalObjective = self.dpsgd_objective(cfg, req, t, local_scale=local_scale)
        else:
            objective = self.objective(cfg, mode="clipped" if req.mode == "clipped" else None, clip=req.clip, norm=2,
                                       local_scale=local_scale)
        if meta["pending"]:  # lambda_p^{k} = lambda_p^{k-1} + rho_{k-1} (W^k - z~_p^k), W^k just received
            lam = dual_update(lam, w, z, float(meta["rho_prev"]))
        eps, delta = (req.epsilon, req.delta) if req.kind == "gaussian-output" else (math.inf, 1e-6)
        inv_eta = outp_inv_eta(t, objective.size, eps, delta, scale)
        n = objective.size if local_scale else cfg.integer("total-samples", lo=1)
        charged = self.charge(req, 1, meta)
        meta["solves"] = int(meta["solves"]) + 1
        if req.kind == "gaussian-output":
            sens = sensitivity_clipped(req.clip, n) if req.mode == "clipped" else 2.0
            sigma = outp_sigma(rho, inv_eta, eps, delta, sens)
            std = outp_noise_std(sigma, req.noise_std)
        else:  # DP-SGD: the noise is in the gradient (the same output noise, by linearity)
            std = 0.0
            sigma = objective.noise_std() / (rho + inv_eta) if isinstance(objective, DPSGDObjective) else 0.0
        noisy, noise_abs = outp_step(objective, z, w, lam, rho=rho, inv_eta=inv_eta, std=std,
                                     rng=self.rng(t, STREAM_NOISE, self.noise_seed))
        z_send = wire_round(noisy)
        if not np.all(np.isfinite(z_send)):
            raise ValueError(f"the local step diverged (non-finite z) at rho={rho}: nothing is sent")
        if order == "alg1":
            lam = dual_update(lam, w, z_send, rho)
            meta["pending"] = False
        else:
            meta["pending"], meta["rho_prev"] = True, rho
        metrics: dict[str, Any] = {
            "sigma": sigma, "noise_std": std, "inv_eta": inv_eta,
            "noise_abs_mean": noise_abs if req.kind != "dp-sgd" else sigma * math.sqrt(2.0 / math.pi),
            **self.privacy_metrics(req, charged, meta, 1),
        }
        return self.finish(t, z_send, lam, z_send, meta, metrics)
