"""DP-RECAL agent (Algorithm 1 of the seed-001 paper; spec shared/specs/dp_recal.md 2.3, 7.3): one agent per node.

DP-RECAL needs of each agent a **smooth local loss** f_i on its own data -- its value and gradient (Assumption 1)
-- and **L_i**, the Lipschitz constant of grad f_i: L_i bounds the stepsize (Assumption 2, alpha_i < 2/(L_i + 1))
and enters the sensitivity of Lemma 4. The nonsmooth part is the global regulariser r = nu1 ||x||_1 + nu2 ||x||^2,
whose prox the agent applies with the (nu1, nu2) the strategy sends. An agent's local problem is either

* an object bound to the agent's data with ``dim``, ``value(y)`` and ``grad(y)`` on the flat vector y (and
  optionally ``lipschitz``), e.g. the paper's least squares :class:`fedpdm_flower.fedapp.algorithms.recal.LocalLeastSquares`
  (B_i, b_i), or a user's own smooth numpy objective; or
* a model -- a numpy model with ``dim``, ``grad(x, inputs, targets)`` and ``loss(x, inputs, targets)``, or a torch
  ``nn.Module`` with a smooth ``loss_fn`` (e.g. MSE; ReLU networks are not smooth and fall outside the analysis) --
  plus the agent's data: f_i is the mean loss on all of it and its gradient the full-batch gradient.

L_i comes from ``lipschitz=`` or the objective's ``lipschitz`` attribute; the constructor names what is missing.

``register`` (message ``query.register``, once, before iteration 1)
    y_i = x^1, lambda_i = 0, tau_i = 0 (I1), alpha_i = alpha_scale 2/(L_i + 1) with the strategy's alpha_scale
    (spec 2.6); report (L_i, alpha_i, m_i): the server needs alpha_max and L_max for Lemma 4's Delta.
``fit`` (message ``train``, when this agent holds the baton)
    S1-S8 on the received baton (x, u~[, u]) with :func:`fedpdm_flower.fedapp.algorithms.recal.dprecal_step`; the noise is drawn
    here, before the baton leaves the node, from the device's randomness (``seed``; None: OS entropy). Reply: the
    new baton and (t = tau_i, sigma, rho of this activation, the agent's own zCDP so far, f_i(y_i)).

The agent's private state (y_i, lambda_i, tau_i, alpha_i and its activation ledger) lives in ``context.state``.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
from flwr.app import ConfigRecord, Context
from numpy.typing import NDArray

from fedpdm_flower.clients.base import DIM_KEY, MessageConfig, as_flat_model
from fedpdm_flower.clients.decentralized import AgentClient, load_state, save_state
from fedpdm_flower.fedapp.algorithms.recal import MODES, AgentState, Baton, RecalConfig, alpha_for, dprecal_step
from fedpdm_flower.fedapp.localdata import as_local_data
from fedpdm_flower.fedapp.privacy.zcdp import ActivationLedger

#: message type of the registration exchange (fedpdm_flower/strategies/recal.py; the client does not import the server module)
REGISTER = "query.register"
STATE, SETTINGS, LEDGER = "dprecal", "dprecal-settings", "dprecal-ledger"

FloatArray = NDArray[np.float64]

__all__ = ["FullBatchObjective", "LocalObjective", "LocalProblemAgent", "RecalClient", "local_objective"]


@runtime_checkable
class LocalObjective(Protocol):
    """Agent i's smooth local loss f_i on its own data, as a function of the flat vector y (d entries)."""

    @property
    def dim(self) -> int:
        """d."""
        ...

    def value(self, y: FloatArray) -> float:
        """f_i(y)."""
        ...

    def grad(self, y: FloatArray) -> FloatArray:
        """grad f_i(y), d entries."""
        ...


class FullBatchObjective:
    """f_i(y) = a model's mean loss on all of the agent's data, with the full-batch gradient.

    Parameters
    ----------
    model
        A flat model (:func:`fedpdm_flower.clients.base.as_flat_model`): ``dim``, ``grad(x, inputs, targets)``,
        ``loss(x, inputs, targets)``.
    data
        The agent's data (:func:`fedpdm_flower.fedapp.localdata.as_local_data`), loaded whole.
    """

    def __init__(self, model: Any, data: Any) -> None:
        self.model = model
        self.data = as_local_data(data)
        self.inputs, self.targets = self.data.all()

    @property
    def dim(self) -> int:
        return int(self.model.dim)

    @property
    def m(self) -> int:
        """m_i, the number of samples."""
        return len(self.data)

    def value(self, y: FloatArray) -> float:
        return float(self.model.loss(y, self.inputs, self.targets))

    def grad(self, y: FloatArray) -> FloatArray:
        return np.asarray(self.model.grad(y, self.inputs, self.targets), dtype=np.float64)


def local_objective(model: Any, data: Any = None, loss_fn: Any = None) -> LocalObjective:
    """The agent's f_i from what the user passes (module docstring); errors name what is missing."""
    if isinstance(model, LocalObjective) and not hasattr(model, "loss"):
        if data is not None or loss_fn is not None:
            raise ValueError(f"{type(model).__name__} is a local objective bound to its own data (dim, value(y), "
                             "grad(y)): do not pass data or loss_fn")
        return model
    try:
        flat = as_flat_model(model, loss_fn)
    except TypeError:
        missing = [a for a in ("dim", "value", "grad") if not hasattr(model, a)]
        raise TypeError(f"DP-RECAL needs a smooth local loss f_i with its gradient: {type(model).__name__} lacks "
                        f"{', '.join(missing) or 'a usable interface'}. Pass an objective with dim, value(y) and "
                        "grad(y) (e.g. fedpdm_flower.fedapp.algorithms.recal.LocalLeastSquares(B_i, b_i)), or a model with dim, "
                        "grad(x, inputs, targets) and loss(x, inputs, targets) -- or a torch nn.Module with a smooth "
                        "loss_fn -- together with its data") from None
    if data is None:
        raise ValueError(f"DP-RECAL's f_i is the mean loss of {type(model).__name__} on the agent's own data: pass "
                         "data=(inputs, targets) or a torch Dataset / DataLoader")
    if getattr(flat, "has_float_buffers", False):
        raise ValueError(f"DP-RECAL is differentially private, and the model has floating-point buffers "
                         f"{flat.buffer_names[:3]} (state computed from the data outside the gradient, such as "
                         "BatchNorm's running statistics), which no privacy analysis covers. Differentially private "
                         "training refuses them, as Opacus's validator does; the one-line fix swaps BatchNorm for "
                         "GroupNorm: model = opacus.validators.ModuleValidator.fix(model)")
    return FullBatchObjective(flat, data)


class LocalProblemAgent(AgentClient):
    """An agent of the DP-RECAL family (DP-RECAL and its Table V baselines): its f_i, L_i and registration.

    Parameters
    ----------
    model
        The agent's local problem (module docstring): an objective with ``dim``, ``value(y)``, ``grad(y)``, or a
        model (numpy with ``dim``/``grad``/``loss``, or a torch ``nn.Module`` with a smooth ``loss_fn``) with data.
    data
        The agent's data when ``model`` is a model: ``(inputs, targets)`` arrays or a torch Dataset / DataLoader.
    loss_fn
        A torch model's smooth loss (mean reduction).
    lipschitz
        L_i, the Lipschitz constant of grad f_i (Assumption 1); default: the objective's ``lipschitz``
        attribute. Required one way or the other.
    context, seed
        As :class:`fedpdm_flower.clients.base.FedClient`: the node's Context (state) and the device's seed for the DP noise
        (None: OS entropy; the server cannot choose it).
    **kwargs
        Further arguments of the agent class (e.g. a synchronous agent's pinned ``neighbours``).
    """

    actions: ClassVar[tuple[str, ...]] = (REGISTER,)

    def __init__(self, model: Any, data: Any = None, loss_fn: Any = None, *, lipschitz: float | None = None,
                 context: Context | None = None, seed: int | None = None, **kwargs: Any) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be an integer >= 0 or None, got {seed!r}")
        super().__init__(None, context=context, seed=seed, **kwargs)
        self.objective = local_objective(model, data, loss_fn)
        lip = getattr(self.objective, "lipschitz", None) if lipschitz is None else lipschitz
        if lip is None:
            raise ValueError("DP-RECAL needs L_i, the Lipschitz constant of grad f_i (Assumption 1: it bounds the "
                             "stepsize alpha_i < 2/(L_i + 1) and enters the sensitivity of Lemma 4): pass "
                             "lipschitz=L_i (least squares: lambda_max(B_i^T B_i) / m_i), or give the objective a "
                             "'lipschitz' attribute")
        if isinstance(lip, bool) or not isinstance(lip, int | float) or not (math.isfinite(lip) and lip > 0):
            raise ValueError(f"lipschitz must be a finite number > 0, got {lip!r}")
        self.lipschitz = float(lip)
        self.m = int(getattr(self.objective, "m", 0)) or 1

    @property
    def num_examples(self) -> int:
        """m_i (1 for an objective that does not say)."""
        return self.m

    @property
    def dim(self) -> int:
        """d, the entries of y."""
        return int(self.objective.dim)

    def noise_seed(self) -> int:
        """The seed of this release's noise stream: the device's seed, or fresh OS entropy without one."""
        return self.seed if self.seed is not None else secrets.randbits(63)

    def check_dim(self, cfg: MessageConfig) -> None:
        """The server's model must have this local problem's d."""
        d = cfg.integer(DIM_KEY, lo=1)
        if d != self.dim:
            raise ValueError(f"the server's model has d = {d} entries, this agent's local problem has {self.dim}")

    def vector(self, value: Any, what: str) -> FloatArray:
        """A received vector: finite float64 of d entries (ValueError otherwise)."""
        if value is None:
            raise ValueError(f"{what} is missing")
        arr = np.asarray(value)
        if arr.dtype != np.float64 or arr.shape != (self.dim,) or not np.all(np.isfinite(arr)):
            raise ValueError(f"{what} must be {self.dim} finite float64 values, got {arr.dtype} {arr.shape}")
        return arr

    # ---------------------------------------------------------------- registration
    def register(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], dict[str, Any]]:
        """Store the common start (forgetting any earlier state); report L_i, m_i and :meth:`on_register`'s."""
        cfg = MessageConfig(config)
        self.check_dim(cfg)
        x1 = self.vector(parameters[0] if len(parameters) == 1 else None, "the start x^1")
        extra = self.on_register(x1.copy(), cfg)
        return [], {"L": self.lipschitz, "m": self.m, **extra}

    def on_register(self, x1: FloatArray, cfg: MessageConfig) -> dict[str, Any]:
        """Initialise the algorithm's state from x^1; return extra report entries."""
        raise NotImplementedError

    def evaluate(self, parameters: list[Any], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        """f_i of a flat model x."""
        x = self.vector(parameters[0] if parameters else None, "the model")
        return float(self.objective.value(x)), self.m, {}


class RecalClient(LocalProblemAgent):
    """A DP-RECAL agent: S1-S8 when it holds the baton; (y_i, lambda_i, tau_i) in ``context.state``.

    Parameters are :class:`LocalProblemAgent`'s.

    Examples
    --------
    >>> def client_fn(context):
    ...     B, b = load_my_rows(context.node_config["partition-id"])
    ...     return RecalClient(LocalLeastSquares(B, b))         # L_i = lambda_max(B^T B)/m from the data
    >>> app = RecalClient.client_app(client_fn)                  # train, evaluate, query.whoami, query.register
    """

    def on_register(self, x1: FloatArray, cfg: MessageConfig) -> dict[str, Any]:
        """I1: y_i = x^1, lambda_i = 0, tau_i = 0; alpha_i = alpha_scale 2/(L_i + 1) (Assumption 2)."""
        alpha = alpha_for(self.lipschitz, cfg.number("alpha-scale", lo=0.0, hi=1.0, lo_open=True, hi_open=True))
        save_state(self.state, STATE, AgentState.initial(x1))
        self.state[SETTINGS] = ConfigRecord({"alpha": alpha})
        self.state[LEDGER] = ConfigRecord(ActivationLedger(sensitivity=0.0).to_record())  # type: ignore[arg-type]
        return {"alpha": alpha}

    def fit(self, parameters: list[Any], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        """S0-S8 on the baton; the reply is the new (noisy) baton."""
        cfg = MessageConfig(config)
        self.check_addressed(cfg)
        self.check_dim(cfg)
        mode = cfg.choice("mode", MODES)
        want = 3 if mode == "exact" else 2
        if len(parameters) != want:
            raise ValueError(f"the baton carries {want} arrays in {mode} mode, got {len(parameters)}")
        x, ut, *u = (self.vector(p, name) for p, name in zip(parameters, ("x", "u~", "u"), strict=False))
        state = load_state(self.state, STATE, AgentState)
        if state is None:
            raise ValueError(f"agent {self.agent_id} was not registered (no y_i, lambda_i in its state)")
        alpha = float(self.state.config_records[SETTINGS]["alpha"])  # type: ignore[arg-type]
        ledger = ActivationLedger.from_record(dict(self.state.config_records[LEDGER]))
        if ledger.sensitivity == 0.0:  # the server's Delta arrives with the first activation
            ledger = ActivationLedger(sensitivity=cfg.number("sensitivity", lo=0.0))
        rc = RecalConfig(n=cfg.integer("n", lo=1), nu1=cfg.number("nu1", lo=0.0), nu2=cfg.number("nu2", lo=0.0),
                         sigma1=cfg.number("sigma1", lo=0.0), R=cfg.number("R", lo=1.0), mode=mode,
                         noise_seed=self.noise_seed(), beta=cfg.number("beta", lo=0.0, hi=0.5, lo_open=True))
        res = dprecal_step(Baton(x=x, ut=ut, u=u[0] if u else None), state, self.objective.grad, alpha, rc,
                           self.agent_id)
        out = [res.baton.x, res.baton.ut] + ([res.baton.u] if res.baton.u is not None else [])
        loss = float(self.objective.value(res.state.y))
        if not (math.isfinite(loss) and all(np.all(np.isfinite(a)) for a in out)):
            # Checked before the state is saved, so the server's retry finds the agent as it was.
            cause = ("without noise" if res.sigma <= 0
                     else f"with noise std sigma = {res.sigma:.3g}: lower the strategy's sigma1 or raise its epsilon")
            raise ValueError(f"agent {self.agent_id}: activation {res.state.tau} overflowed float64 (local loss "
                             f"{loss:.3g}) {cause}")
        rho = ledger.record(res.sigma) if res.sigma > 0 and ledger.sensitivity > 0 else 0.0
        save_state(self.state, STATE, res.state)
        self.state[LEDGER] = ConfigRecord(ledger.to_record())  # type: ignore[arg-type]
        metrics = {"t": res.state.tau, "sigma": res.sigma, "rho_step": rho, "rho_total": ledger.rho,
                   "local_loss": loss}
        return out, self.m, metrics
