"""DP-IADMM (ObjP / ObjPM, Algorithm 1 lines 11-24) and OutP agents on the user's model and data.

Ryu & Kim, "Differentially Private Federated Learning via Inexact ADMM with Multiple Local Updates" (seed 002);
spec ``shared/specs/dp_iadmm.md`` sections 2.3, 4, 5.2, 9.2, 9.4 and 9.7.

State in ``context.state`` (float64): the dual lambda_p (``iadmm.dual``), the start point of the next round
(``iadmm.z``: z_p^{t,E+1} for ObjP/ObjPM, the noisy iterate for OutP) and ``iadmm.meta`` (local solves so far,
OutP's pending dual update). Round 1 starts from the received model with lambda_p = 0 (Algorithm 1 lines 2-3). The
agent updates its dual with exactly the float32-rounded array the server decodes
(:func:`fedpdm_flower.fedapp.compression.codec.wire_round`), so both copies of (4c) stay bit-identical (spec 9.8); an agent that
lost its state after round 1 refuses to go on (its dual cannot be rebuilt), which stops the run naming it.

Everything algorithmic arrives in the message config (the strategy is the single source of truth), checked by
:class:`fedpdm_flower.clients.base.MessageConfig`:

======================  =====================================================================================
key                     meaning
======================  =====================================================================================
``mechanism``           "laplace-objective" (DP-IADMM) or "gaussian-output" (OutP): the client must match
``rho``                 rho^t of (24) (> 0)
``eta``                 eta^t (DP-IADMM; > 0)
``local-updates``       E (DP-IADMM)
``dp``, ``epsilon``     whether to perturb, and epsilon-bar per local solve
``sensitivity-mode``    DP-IADMM: "paper", "bounded" or "clipped"; OutP: "reference" or "clipped"
``clip``                C1 ("bounded") or C ("clipped")
``box``                 radius B of W = [-B, B]^d (absent: unconstrained)
``beta``, ``num-agents``, ``total-samples``   beta, P and I of f_p (2c)
``accounting-delta``    delta' of the reported advanced composition (DP-IADMM)
``delta``, ``eta-scale``, ``order``, ``noise-std``, ``grad-scale``   OutP's options (fedpdm_flower.strategies.iadmm.OutP)
======================  =====================================================================================
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
from flwr.app import ConfigRecord
from numpy.typing import NDArray

from fedpdm_flower.clients.base import FedClient, MessageConfig
from fedpdm_flower.fedapp.algorithms.iadmm import (
    DEVICES,
    OUTP_SENSITIVITY_MODES,
    SENSITIVITY_MODES,
    LocalObjective,
    agent_round,
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
from fedpdm_flower.fedapp.layout import FloatArray
from fedpdm_flower.fedapp.models.multinomial import MultinomialLogistic
from fedpdm_flower.fedapp.privacy.laplace import advanced_composition, basic_composition

__all__ = ["IADMMClient", "OutPClient"]

DUAL, START, META = "iadmm.dual", "iadmm.z", "iadmm.meta"
#: the RNG stream of the DP noise (as the other clients' noise stream)
STREAM_NOISE = 1
Fit = tuple[list[NDArray[Any]], int, dict[str, Any]]


class IADMMClient(FedClient):
    """Agent p of Algorithm 1: E Laplace-perturbed inexact solves (8), send their average, update lambda_p (4c).

    Parameters
    ----------
    model
        The user's model. Which ones each sensitivity mode (chosen by the strategy) supports:

        * ``"paper"`` and ``"bounded"`` are closed forms of the paper's multinomial logistic model (63): they need
          a :class:`fedpdm_flower.fedapp.models.MultinomialLogistic` (numpy; ``bias=False`` is the paper's model);
        * ``"clipped"`` (per-sample gradient clipping) needs per-sample gradients: a torch ``nn.Module`` (with
          ``loss_fn``), the multinomial model, or a numpy model object with ``per_sample_grads(x, inputs,
          targets)``;
        * without privacy (epsilon-bar = inf) any model with ``dim``, ``grad`` and ``loss`` works.

        A message that asks for a mode the model does not support is refused with an error naming what is
        missing. A model with BatchNorm trains without privacy (its buffers travel beside the vector,
        :mod:`fedpdm_flower.clients.base`); a private round refuses it.
    data
        The local data D_p: ``(x, y)`` arrays or a torch ``Dataset`` / ``DataLoader``. Every local solve uses the
        full local data set (no mini-batches, as the paper).
    loss_fn
        The torch model's per-batch mean loss (default cross-entropy); f_p' is ``(I_p / I)`` times its gradient on
        D_p plus ``(2 beta / P) z``.
    context
        The node's Flower Context (bound per message by :meth:`client_app`).
    seed
        The device's seed for the noise (None: OS entropy).
    noise_seed
        An extra seed of the noise stream only (default 0): the reproduction varies it to repeat a run with fresh
        noise and everything else equal.
    device
        Where the multinomial model's gradient runs: "cpu" (default), "cuda" or "auto" (cuda if available).
        float64 on every device.
    max_epsilon
        The device owner's privacy floor: the largest epsilon, by basic composition over every local solve of
        this device, it accepts to spend (None: no floor). With a floor the device also refuses a release without
        noise, and the ``"paper"`` sensitivity (data-dependent, not a rigorous bound).
    chunk_size
        Samples per gradient evaluation of a model other than the multinomial one (per-sample gradients hold
        chunk_size x d floats; default 256).
    test_data, test_fn
        Flower's federated evaluation (:meth:`fedpdm_flower.clients.base.FedClient.evaluate`).

    Examples
    --------
    >>> def client_fn(context):
    ...     return IADMMClient(Net(), train_loader, loss_fn=nn.CrossEntropyLoss(), max_epsilon=50.0)
    >>> app = IADMMClient.client_app(client_fn)
    """

    #: the mechanism this client runs (the message's ``mechanism`` must match)
    mechanism: ClassVar[str] = "laplace-objective"
    sensitivity_modes: ClassVar[tuple[str, ...]] = SENSITIVITY_MODES

    def __init__(self, model: Any, data: Any, loss_fn: Any = None, *, context: Any = None, seed: int | None = None,
                 noise_seed: int = 0, device: str = "cpu", max_epsilon: float | None = None,
                 chunk_size: int = 256, test_data: Any = None, test_fn: Any = None) -> None:
        super().__init__(model, data, loss_fn, context=context, seed=seed, test_data=test_data, test_fn=test_fn)
        if self.data is None:
            raise ValueError(f"{type(self).__name__} needs the agent's local data")
        if isinstance(noise_seed, bool) or not isinstance(noise_seed, int) or noise_seed < 0:
            raise ValueError(f"noise_seed must be an integer >= 0, got {noise_seed!r}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {list(DEVICES)}, got {device!r}")
        if max_epsilon is not None and not (math.isfinite(max_epsilon) and max_epsilon > 0):
            raise ValueError(f"max_epsilon must be a finite number > 0 or None, got {max_epsilon!r}")
        if max_epsilon is not None:  # the device trains only with noise, so never with buffers
            self.refuse_buffers_under_dp(f"this device sets a privacy floor (max_epsilon = {max_epsilon})")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
        self.noise_seed, self.device, self.max_epsilon, self.chunk_size = noise_seed, device, max_epsilon, chunk_size
        self._objective: tuple[tuple[Any, ...], LocalObjective] | None = None

    # ---------------------------------------------------------------- what the message says
    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        """Also I_p (``num-examples``): a strategy without ``total_samples`` sums them into I before round 1."""
        return {**super().get_properties(config), "num-examples": self.num_examples}

    def check_mechanism(self, cfg: MessageConfig) -> None:
        """The message must be meant for this client's mechanism."""
        got = cfg.config.get("mechanism")
        if got != self.mechanism:
            raise ValueError(f"message config 'mechanism' = {got!r}, but {type(self).__name__} runs "
                             f"{self.mechanism!r} (DP-IADMM pairs with IADMMClient, OutP with OutPClient)")

    @staticmethod
    def epsilon(cfg: MessageConfig) -> float:
        """epsilon-bar per local solve (``math.inf`` when the message says ``dp`` is false)."""
        return cfg.number("epsilon", lo=0.0, lo_open=True) if cfg.flag("dp") else math.inf

    def sensitivity(self, cfg: MessageConfig) -> tuple[str, float]:
        """The sensitivity mode and its clipping bound (0 when none)."""
        mode = cfg.choice("sensitivity-mode", self.sensitivity_modes)
        needs_clip = mode in ("bounded", "clipped")
        return mode, cfg.number("clip", lo=0.0, lo_open=True) if needs_clip else 0.0

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

    def receive(self, parameters: list[NDArray[Any]], cfg: MessageConfig) -> FloatArray:
        """The dense vector the server broadcast, decoded to float64 (exactly the server's wire-rounded copy)."""
        self.check_model(cfg)
        code = cfg.integer(FORMAT_KEY, lo=0)
        return decode_vector(from_arrays(parameters, code), self.model.dim).to_dense()

    # ---------------------------------------------------------------- state
    def load_meta(self) -> dict[str, Any]:
        """Round bookkeeping kept in context.state (local solves so far, OutP's pending dual update)."""
        rec = self.state.config_records.get(META)
        return {"solves": 0, "rounds": 0, "pending": False, "rho_prev": 0.0} if rec is None else dict(rec)

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

    def guard(self, solves: int, epsilon: float, delta: float, mode: str) -> None:
        """The device's floor: refuse a noiseless release, the paper's sensitivity, or one past max_epsilon."""
        if self.max_epsilon is None:
            return
        if math.isinf(epsilon):
            raise ValueError(f"refused: the server asks for a release without noise, and this device allows at "
                             f"most epsilon = {self.max_epsilon}")
        if mode == "paper":
            raise ValueError("refused: sensitivity mode 'paper' is data-dependent, not a rigorous bound (spec A2); "
                             "this device has a privacy floor and accepts 'bounded' or 'clipped' only")
        eps, _ = basic_composition(solves, epsilon, delta)
        if eps > self.max_epsilon:
            raise ValueError(f"refused: {solves} local solves at epsilon-bar = {epsilon} would take this device to "
                             f"epsilon = {eps:.4g} (basic composition) > its floor max_epsilon = {self.max_epsilon}")

    @staticmethod
    def privacy(solves: int, epsilon: float, delta: float, per_round: int, delta_prime: float) -> dict[str, Any]:
        """Per-solve, per-round and cumulative (basic and advanced composition) privacy of this agent.

        epsilon-bar (delta-bar for OutP) per local solve (Thm 1); E of them per round (A4); over the k solves run so
        far basic composition (k eps, k delta) and Dwork-Roth's advanced composition at delta' (A5).
        """
        if math.isinf(epsilon):
            return {}
        eps_b, delta_b = basic_composition(solves, epsilon, delta)
        eps_a, delta_a = advanced_composition(solves, epsilon, delta_prime, delta)
        out = {"eps_iter": epsilon, "delta_iter": delta, "eps_round": per_round * epsilon,
               "eps_basic": eps_b, "delta_basic": delta_b, "local_solves": solves}
        if math.isfinite(eps_a):  # e^epsilon overflowed: the bound is vacuous, and the server rejects inf metrics
            out.update({"eps_advanced": eps_a, "delta_advanced": delta_a})
        return out

    def finish(self, t: int, z_send: FloatArray, lam: FloatArray, start: FloatArray, meta: dict[str, Any],
               metrics: dict[str, Any]) -> Fit:
        """Persist the state and build the reply (the dual CRC lets the server check its replica)."""
        self.save_vector(DUAL, lam)
        self.save_vector(START, start)
        meta["rounds"] = int(meta["rounds"]) + 1
        self.state[META] = ConfigRecord(meta)
        arrays, metrics[FORMAT_KEY] = to_arrays(encode_dense(z_send))
        metrics.update({"dual_crc": dual_fingerprint(lam), "dual_sqnorm": float(np.dot(lam, lam)), "round": t})
        return arrays, self.num_examples, metrics

    # ---------------------------------------------------------------- one round
    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        """Algorithm 1 lines 15-23."""
        cfg = MessageConfig(config)
        self.check_mechanism(cfg)
        t = cfg.integer("server-round", lo=1)
        rho = cfg.number("rho", lo=0.0, lo_open=True)
        eta = cfg.number("eta", lo=0.0, lo_open=True)
        e_count = cfg.integer("local-updates", lo=1, hi=100_000)
        eps = self.epsilon(cfg)
        if not math.isinf(eps):
            self.refuse_buffers_under_dp()
        mode, clip = self.sensitivity(cfg)
        box = cfg.number("box", 0.0, lo=0.0)
        delta_prime = cfg.number("accounting-delta", 1e-6, lo=0.0, hi=1.0, lo_open=True, hi_open=True)
        w = self.receive(parameters, cfg)
        lam, start, meta = self.load_state(t, w)
        solves = int(meta["solves"]) + e_count
        self.guard(solves, eps, 0.0, mode)
        # without noise the closed-form sensitivities of model (63) are not needed, so any model runs (the
        # multinomial model still reports its Delta as a diagnostic)
        closed_form = mode in ("paper", "bounded") and not isinstance(self.model, MultinomialLogistic)
        objective = self.objective(cfg, mode=None if closed_form and math.isinf(eps) else mode, clip=clip, norm=1,
                                   local_scale=False)
        res = agent_round(objective, start, w, lam, rho=rho, eta=eta, local_updates=e_count, epsilon=eps,
                          rng=self.rng(t, STREAM_NOISE, self.noise_seed), box=box)
        z_send = wire_round(res.z_avg)  # line 21, as the server will decode it
        if not np.all(np.isfinite(z_send)):
            raise ValueError(f"the local solves diverged (non-finite z) at rho={rho}, eta={eta}: nothing is sent")
        lam = dual_update(lam, w, z_send, rho)  # line 23
        meta["solves"] = solves
        metrics: dict[str, Any] = {
            "delta_mean": float(np.mean(res.sensitivities)), "delta_max": float(np.max(res.sensitivities)),
            "lap_scale_mean": float(np.mean(res.scales)), "noise_abs_mean": res.noise_abs_mean,
            **self.privacy(solves, eps, 0.0, e_count, delta_prime),
        }
        return self.finish(t, z_send, lam, res.z_last, meta, metrics)


class OutPClient(IADMMClient):
    """OutP agent: one noiseless inexact step (5), then Gaussian output noise (spec 5.2); the noisy iterate is kept.

    In Huang's order (the default) the dual update of round r uses the W that only arrives in round r+1, so it is
    applied at the start of the next fit (``pending`` in ``iadmm.meta``, spec 9.7).

    Parameters
    ----------
    model
        The user's model. OutP's ``"reference"`` noise calibration (Huang's bound, the paper's reference code) is
        defined for the paper's multinomial logistic model (63) only (:class:`fedpdm_flower.fedapp.models.MultinomialLogistic`);
        ``"clipped"`` (per-sample L2 clipping) needs per-sample gradients (a torch ``nn.Module``, the multinomial
        model, or a numpy model with ``per_sample_grads``); without privacy any model works.
    data, loss_fn, context, seed, noise_seed, device, max_epsilon, chunk_size
        As :class:`IADMMClient`. ``max_epsilon`` bounds the basic composition of the (epsilon-bar, delta-bar)
        steps and refuses the ``"reference"`` calibration.
    """

    mechanism: ClassVar[str] = "gaussian-output"
    sensitivity_modes: ClassVar[tuple[str, ...]] = OUTP_SENSITIVITY_MODES

    def guard(self, solves: int, epsilon: float, delta: float, mode: str) -> None:
        if self.max_epsilon is not None and mode == "reference" and not math.isinf(epsilon):
            raise ValueError("refused: OutP's 'reference' calibration assumes Huang's gradient bound, which this "
                             "device cannot check; it has a privacy floor and accepts 'clipped' only")
        super().guard(solves, epsilon, delta, mode)

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        """One OutP step (spec 5.2) in Huang's order or Algorithm 1's."""
        cfg = MessageConfig(config)
        self.check_mechanism(cfg)
        t = cfg.integer("server-round", lo=1)
        rho = cfg.number("rho", lo=0.0, lo_open=True)
        eps = self.epsilon(cfg)
        if not math.isinf(eps):
            self.refuse_buffers_under_dp()
        delta = cfg.number("delta", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
        scale = cfg.number("eta-scale", lo=0.0, lo_open=True)
        order = cfg.choice("order", ("huang", "alg1"))
        noise_mode = cfg.choice("noise-std", ("sigma", "sigma-squared"))
        local_scale = cfg.choice("grad-scale", ("local", "global")) == "local"
        mode, clip = self.sensitivity(cfg)
        w = self.receive(parameters, cfg)
        lam, z, meta = self.load_state(t, w)
        solves = int(meta["solves"]) + 1
        self.guard(solves, eps, delta, mode)
        private = not math.isinf(eps)
        if mode == "reference" and private and not isinstance(self.model, MultinomialLogistic):
            raise TypeError(f"OutP's 'reference' noise calibration (Huang's bound, spec 5.2) is defined for the "
                            f"paper's multinomial logistic model (63) only; for {type(self.model).__name__} use "
                            "sensitivity_mode='clipped' with a per-sample gradient clipping bound clip=C")
        objective = self.objective(cfg, mode="clipped" if mode == "clipped" else None, clip=clip, norm=2,
                                   local_scale=local_scale)
        if meta["pending"]:  # lambda_p^{k} = lambda_p^{k-1} + rho_{k-1} (W^k - z~_p^k), W^k just received
            lam = dual_update(lam, w, z, float(meta["rho_prev"]))
        inv_eta = outp_inv_eta(t, objective.size, eps, delta, scale)
        n = objective.size if local_scale else cfg.integer("total-samples", lo=1)
        sens = sensitivity_clipped(clip, n) if mode == "clipped" else 2.0
        sigma = outp_sigma(rho, inv_eta, eps, delta, sens)
        std = outp_noise_std(sigma, noise_mode)
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
        meta["solves"] = solves
        metrics: dict[str, Any] = {
            "sigma": sigma, "noise_std": std, "inv_eta": inv_eta, "noise_abs_mean": noise_abs,
            **self.privacy(solves, eps, delta if private else 0.0, 1, delta),
        }
        return self.finish(t, z_send, lam, z_send, meta, metrics)
