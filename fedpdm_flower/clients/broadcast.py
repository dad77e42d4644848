"""What the clients of broadcast algorithms share (DP-FedPDM / BSDP-FedPDM and the FedAvg-family baselines).

The server broadcasts its model x_0^t (dense, or top_k' sparse), the client runs Q local steps on its own data,
optionally sparsifies (top_k / rand_k, eq. 18) and privatises (Gaussian mechanism (11)/(19)) what it uploads.
Everything algorithmic arrives in the message config, checked by :class:`fedpdm_flower.clients.base.MessageConfig`:

======================  =====================================================================================
key                     meaning
======================  =====================================================================================
``payload-format``      layout of the downlink arrays (absent: the model's own arrays, e.g. from Flower's FedAvg)
``eta``                 step size eta^t of this round (> 0)
``batch-size``          mini-batch size b (absent: the batch size of the client's DataLoader)
``max-steps``           upper bound on Q (Q b < |D_i| is enforced on top, spec A6)
``clip``                clip norm G of every mini-batch gradient (0: no clipping)
``uplink`` / ``k-up``   "dense", "topk" or "randk", and k
``dp``                  whether the release is private: record-level DP-SGD when ``dp-mechanism`` is "dp-sgd"
                        (:mod:`fedpdm_flower.clients.dpsgd`: ``dp-noise-multiplier`` z, ``dp-sample-rate`` q,
                        ``clip`` C, ``dp-steps`` charged, ``dp-delta``), else the paper's Gaussian noise on the
                        upload, calibrated by ``dp-calibration``:
``dp-calibration``      "gdp": z = sqrt(T) / mu*(epsilon, delta), so that T releases are exactly (epsilon,
                        delta)-DP for one record of this client (:mod:`fedpdm_flower.fedapp.privacy.gdp`); "eq36" (default,
                        the paper's): (36) inverted for the per-round epsilon, then (32)
``dp-epsilon``,         epsilon (epsbar of (36)), delta, and T (the most releases the run asks of this client)
``dp-delta``,
``dp-horizon``
``dp-c0``,              eq36 only: c0 and the q exponent of (36), and p = K/N
``dp-q-power``,
``dp-participation``
======================  =====================================================================================

The device keeps the last word on its privacy (``max_epsilon``): it refuses a message without noise, a DP-SGD
message whose steps would take its RDP ledger past the floor (checked before any training), and an upload release
that would take its exact (GDP) epsilon past it. With node config ``privacy-ledger`` (a file path) the ledgers
persist on the device across runs (the DP-SGD ledger beside it, in ``<path>.dpsgd.json``), so the floor bounds the
device's total spend under each mechanism.

A model with BatchNorm trains without DP: its buffers travel beside the vector (:mod:`fedpdm_flower.clients.base`); a
round with ``dp`` true, or a device with a floor, refuses it (:meth:`~fedpdm_flower.clients.base.FedClient.refuse_buffers_under_dp`).
Without DP the batches come from one pass of the loader's own sampler when it has one
(:meth:`~fedpdm_flower.clients.base.FedClient.training_data`); with DP from the uniform permutation (36) assumes, or,
under record-level DP-SGD, from the device's own Poisson sampling of its records.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flwr.app import ConfigRecord
from numpy.typing import NDArray

from fedpdm_flower.clients.base import DIM_KEY, FedClient, MessageConfig
from fedpdm_flower.clients.dpsgd import DeviceAccount, mechanism_of
from fedpdm_flower.fedapp.compression.codec import FLOAT32_MAX, SparseVector, decode_vector, encode_dense, encode_sparse
from fedpdm_flower.fedapp.compression.payload import FORMAT_KEY, from_arrays, to_arrays
from fedpdm_flower.fedapp.compression.sparsify import rand_k, top_k
from fedpdm_flower.fedapp.layout import ArrayLayout, FloatArray
from fedpdm_flower.fedapp.privacy import gdp
from fedpdm_flower.fedapp.privacy.accountants import PrivacyLedger
from fedpdm_flower.fedapp.privacy.dpsgd import DPSGDLedger, DPSGDMechanism, DPSGDStep, device_rng
from fedpdm_flower.fedapp.privacy.gaussian import (
    add_gaussian_noise,
    data_fraction,
    gaussian_noise_std,
    per_round_epsilon_eq36,
    total_privacy_eq36,
)

# RNG streams of a client round; stream 0 draws the mini-batch permutation
STREAM_NOISE, STREAM_RANDK = 1, 2
LEDGER = "privacy"
UPLINKS = ("dense", "topk", "randk")

Fit = tuple[list[NDArray[Any]], int, dict[str, Any]]


class BroadcastClient(FedClient):
    """Downlink decoding, local-loop settings, uplink sparsification, the Gaussian release and encoding.

    Parameters
    ----------
    model, data, loss_fn, context, seed, test_data, test_fn
        As :class:`fedpdm_flower.clients.base.FedClient`.
    max_epsilon
        The device owner's privacy floor: the largest RDP epsilon (at the message's delta, composing every release
        of this device without subsampling amplification) the device accepts to spend. None (default) sets none.
        With a floor, a message that asks for no noise is refused too.
    """

    def __init__(self, model: Any, data: Any = None, loss_fn: Any = None, *, context: Any = None,
                 seed: int | None = None, max_epsilon: float | None = None, test_data: Any = None,
                 test_fn: Any = None) -> None:
        super().__init__(model, data, loss_fn, context=context, seed=seed, test_data=test_data, test_fn=test_fn)
        if max_epsilon is not None and not (math.isfinite(max_epsilon) and max_epsilon > 0):
            raise ValueError(f"max_epsilon must be a finite number > 0 or None, got {max_epsilon!r}")
        if max_epsilon is not None:  # the device trains only with noise, so never with buffers
            self.refuse_buffers_under_dp(f"this device sets a privacy floor (max_epsilon = {max_epsilon})")
        self.max_epsilon = max_epsilon
        self._plain: list[NDArray[Any]] | None = None  # the downlink arrays when they were the model's own layout
        # this message's admitted DP-SGD participation: (mechanism, delta, ledger, step), charged by release()
        self._dpsgd: tuple[DPSGDMechanism, float, DPSGDLedger, DPSGDStep] | None = None

    def get_properties(self, config: dict[str, Any]) -> dict[str, Any]:
        """:meth:`FedClient.get_properties`, plus the device's privacy floor ``dp-max-epsilon`` when it has one: the
        strategy refuses to start a run whose target the device would refuse (before round 1)."""
        props = super().get_properties(config)
        if self.max_epsilon is not None:
            props["dp-max-epsilon"] = float(self.max_epsilon)
        return props

    # ---------------------------------------------------------------- downlink and local-loop settings
    def private(self, cfg: MessageConfig) -> bool:
        """Whether the round asks for DP noise (``dp``); a private round refuses a model with buffers."""
        private = cfg.flag("dp", False)
        if private:
            self.refuse_buffers_under_dp()
        return private

    def receive(self, parameters: list[NDArray[Any]], cfg: MessageConfig) -> FloatArray:
        """x_0^t dense: decoded from the codec arrays, or taken from the model's own arrays (no format key; a torch
        model's buffers are loaded from them too)."""
        if FORMAT_KEY not in cfg:  # a plain strategy (e.g. Flower's FedAvg) sent the model as it is
            self._plain = [np.asarray(a) for a in parameters]
            x = self.split_arrays(self._plain)
            if x is None:  # a numpy model: its floating-point arrays in order
                x = ArrayLayout.of({str(i): a for i, a in enumerate(self._plain)}).flatten(
                    {str(i): a for i, a in enumerate(self._plain)})
            if x.shape != (self.model.dim,):
                raise ValueError(f"received {x.size} parameters, this client's model has {self.model.dim}")
            return x
        self._plain = None
        if DIM_KEY in cfg:
            self.check_model(cfg)
        return decode_vector(from_arrays(parameters, cfg.config[FORMAT_KEY]), self.model.dim).to_dense()

    def batch_size(self, cfg: MessageConfig) -> int:
        """b from the message, else the batch size of the client's DataLoader."""
        data = self.require_data()
        if "batch-size" in cfg:
            return cfg.integer("batch-size", lo=1)
        if data.default_batch_size:
            return int(data.default_batch_size)
        raise ValueError("the strategy was built with batch_size=None (each client's DataLoader batch size), and this "
                         "client's data has none: give the client a DataLoader, or pass batch_size=... to the strategy")

    @staticmethod
    def eta(cfg: MessageConfig) -> float:
        """eta^t of this round."""
        return cfg.number("eta", lo=0.0, lo_open=True)

    @staticmethod
    def clip(cfg: MessageConfig) -> float | None:
        """G, or None for no clipping."""
        g = cfg.number("clip", 0.0, lo=0.0)
        return g if g > 0 else None

    # ---------------------------------------------------------------- uplink: sparsify, privatise, encode
    def uplink_indices(self, v: FloatArray, cfg: MessageConfig, server_round: int) -> NDArray[np.int64]:
        """All d indices, or top_k(v) / rand_k (eq. 18) with the message's k, ascending (spec 10.12)."""
        d = len(v)
        kind = cfg.choice("uplink", UPLINKS, "dense")
        if kind == "dense":
            return np.arange(d, dtype=np.int64)
        k = cfg.integer("k-up", lo=1, hi=d)
        if kind == "topk":
            return top_k(v, k)
        return rand_k(d, k, self.rng(server_round, STREAM_RANDK))

    def ledger_path(self) -> str | None:
        """The device's ledger file (node config ``privacy-ledger``), or None (the ledger lives in context.state)."""
        path = self.node_context.node_config.get("privacy-ledger") if self.node_context is not None else None
        return str(path) if path else None

    def load_ledger(self, delta: float) -> PrivacyLedger:
        """This client's privacy ledger: its file when the device has one, else context.state."""
        path = self.ledger_path()
        if path is not None:
            return PrivacyLedger.load(path, delta)
        rec = self.state.config_records.get(LEDGER)
        if rec is None:
            return PrivacyLedger(delta=delta, eps_rounds=[], noise_multipliers=[])
        return PrivacyLedger.from_record(dict(rec))

    def save_ledger(self, ledger: PrivacyLedger) -> None:
        """Persist the ledger: in context.state, and in the device's file when it has one."""
        self.state[LEDGER] = ConfigRecord(ledger.to_record())  # type: ignore[arg-type]
        path = self.ledger_path()
        if path is not None:
            ledger.save(path)

    def dpsgd_account(self) -> DeviceAccount:
        """The device's DP-SGD ledger place and floor: context.state, and ``<privacy-ledger>.dpsgd.json``."""
        path = self.ledger_path()
        return DeviceAccount(self.max_epsilon, None if path is None else f"{path}.dpsgd.json")

    def dpsgd_oracle(self, cfg: MessageConfig) -> DPSGDStep | None:
        """When the message asks for record-level DP-SGD: the noisy gradient oracle of this participation, after the
        device's floor admitted its steps (ValueError before any training otherwise); None for other messages.

        The records' Poisson samples and the noise come from :func:`~fedpdm_flower.fedapp.privacy.dpsgd.device_rng`
        (the operating system's entropy), never from the client's ``seed``: a seed the server knows (the
        reproduction app's) would let it subtract the noise. :meth:`release` charges the steps to the ledger.
        """
        self._dpsgd = None
        asked = mechanism_of(cfg.config)
        if asked is None:
            mech_name = cfg.config.get("dp-mechanism")
            if mech_name is not None:
                raise ValueError(f"message config 'dp-mechanism' = {mech_name!r} is not one this client runs (\"dp-sgd\")")
            return None
        if not cfg.flag("dp", False):
            raise ValueError("message config asks for DP-SGD with 'dp' = false")
        mech, delta = asked
        ledger = self.dpsgd_account().admit(self.node_context, mech, delta)
        step = DPSGDStep(self.model, self.require_data(), mech, device_rng())
        self._dpsgd = (mech, delta, ledger, step)
        return step

    def release(self, values: FloatArray, server_round: int, cfg: MessageConfig, *, sensitivity: float, steps: int,
                batch_size: int) -> tuple[FloatArray, dict[str, Any]]:
        """The private release of the uploaded values, by the message's mechanism; the values unchanged without DP.

        * Record-level DP-SGD (:meth:`dpsgd_oracle` ran the steps): the values are post-processing and go as they
          are; the participation's charged steps are recorded in the device's ledger (RDP of the subsampled
          Gaussian, every step ever) and reported (``eps_dpsgd``, z, q, steps).
        * The paper's Gaussian mechanism on the upload: the round's epsilon inverts the paper's (36) with
          q = Q b / |D_i| from the actual Q (spec A3) and p = K/N; the noise std is (32) for the caller's L2
          ``sensitivity`` ((35) for FedPDM, (B.2) for local SGD). The ledger in context.state records the round
          and yields the three cumulative figures.
        """
        if self._dpsgd is not None:
            mech, dp_delta, dp_ledger, step = self._dpsgd
            self._dpsgd = None
            metrics = self.dpsgd_account().charge(self.node_context, dp_ledger, mech, dp_delta)
            return values, {**metrics, "participations": float(dp_ledger.participations),
                            "dp_steps_taken": float(step.taken), "dp_records_sampled": float(step.sampled)}
        if not cfg.flag("dp", False):
            if self.max_epsilon is not None:
                raise ValueError(f"refused: the server asks for a release without noise, and this device allows at "
                                 f"most epsilon = {self.max_epsilon}")
            return values, {}
        eps_total = cfg.number("dp-epsilon", lo=0.0, lo_open=True)
        delta = cfg.number("dp-delta", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
        horizon = cfg.integer("dp-horizon", lo=1)
        calibration = cfg.choice("dp-calibration", ("eq36", "gdp"), "eq36")
        q = data_fraction(steps, batch_size, self.num_examples)
        if calibration == "gdp":  # T releases exactly (epsilon, delta)-DP for one record (fedpdm_flower.fedapp.privacy.gdp)
            z = gdp.noise_multiplier_for(eps_total, delta, horizon)
            sigma = z * sensitivity
            eps_round = math.sqrt(2.0 * (math.log(1.25) - math.log(delta))) / z  # (32)'s figure for the same noise, reported
            paper: dict[str, Any] = {}
        else:
            c0 = cfg.number("dp-c0", lo=0.0, lo_open=True)
            q_power = cfg.number("dp-q-power", lo=0.0, lo_open=True)
            p = cfg.number("dp-participation", lo=0.0, hi=1.0, lo_open=True)
            eps_round = per_round_epsilon_eq36(eps_total, c0, q, p, horizon, q_power=q_power)
            sigma = gaussian_noise_std(sensitivity, eps_round, delta)
            paper = {"eps_eq36": total_privacy_eq36(eps_round, c0, q, p, min(server_round, horizon), q_power=q_power)}
        if not sigma < FLOAT32_MAX:  # the noisy upload would be inf on the float32 wire: say what set sigma
            raise ValueError(
                f"DP noise std sigma = {sigma:.3g} is beyond the float32 range of the upload ({FLOAT32_MAX:.3g}): "
                f"sensitivity {sensitivity:.3g} (clip_norm {self.clip(cfg) or 0:g}, {steps} local step(s)) over the "
                f"per-round epsilon {eps_round:.3g} (epsilon {eps_total:g}, q = {q:.3g}, delta {delta:g}): lower the "
                "privacy calibration's clip_norm or raise its epsilon")
        ledger = self.load_ledger(delta)
        z_used = sigma / sensitivity if sensitivity > 0 else 0.0
        ledger.record(eps_round, z_used)
        eps_gdp = ledger.gdp_epsilon(delta)
        if self.max_epsilon is not None and not eps_gdp <= self.max_epsilon:
            raise ValueError(f"refused: this release would take the device's epsilon to {eps_gdp:.4g} (exact, GDP) > "
                             f"its floor max_epsilon = {self.max_epsilon} (delta = {delta})")
        noisy = add_gaussian_noise(values, sigma, self.rng(server_round, STREAM_NOISE))  # (11)/(19)
        self.save_ledger(ledger)
        eps_basic, delta_basic = ledger.basic_composition()
        return noisy, {
            "q": q, "eps_round": eps_round, "sensitivity": sensitivity, "sigma": sigma, "noise_multiplier": z_used,
            "sample_rate": 1.0,  # no amplification is claimed: the server knows who takes part (module docstring)
            "eps_round_gt_1": int(eps_round > 1.0),  # Lemma 1 needs eps < 1 (spec caveat 1)
            **paper, "eps_gdp": eps_gdp, "eps_rdp": ledger.rdp_epsilon(delta), "eps_basic": eps_basic,
            "delta_basic": delta_basic, "participations": len(ledger.eps_rounds),
        }

    def encode(self, idx: NDArray[np.int64], values: FloatArray) -> tuple[list[NDArray[Any]], int | None]:
        """Wire arrays and format code: k values plus compact indices when sparse, else the dense vector.

        After a plain downlink (Flower's FedAvg) a dense upload goes back in the model's own arrays (names,
        shapes and dtypes as received) with no format code, so the plain strategy can aggregate it.
        """
        d = self.model.dim
        largest = float(np.max(np.abs(values))) if len(values) else 0.0
        if not largest <= FLOAT32_MAX:
            raise ValueError(f"the upload has values up to {largest:.3g}, beyond the float32 range of the wire format "
                             f"({FLOAT32_MAX:.3g}): the local update diverged (lower the step size) or the noise "
                             "overflowed")
        if len(idx) < d:
            return to_arrays(encode_sparse(SparseVector(indices=idx, values=values, dim=d)))
        if self._plain is not None:
            layout = getattr(self.model, "layout", None)
            if layout is not None and len(layout.entries) == len(self._plain):  # the trained model, buffers included
                model = layout.unflatten(values, self.model.get_buffers())
                return [np.asarray(v, dtype=a.dtype) for v, a in zip(model.values(), self._plain, strict=True)], None
            named = {str(i): a for i, a in enumerate(self._plain)}
            return list(ArrayLayout.of(named).unflatten(values, named).values()), None
        return to_arrays(encode_dense(values))

    def data_loss(self, x: FloatArray) -> float:
        """The model's loss at x on the whole local data (the train_loss metric)."""
        return float(self.model.loss(x, *self.require_data().all()))

    def finish(self, arrays_code: tuple[list[NDArray[Any]], int | None], metrics: dict[str, Any]) -> Fit:
        """The fit reply: arrays, |D_i| and the metrics with the format code (when there is one)."""
        arrays, code = arrays_code
        if code is not None:
            metrics[FORMAT_KEY] = code
        return arrays, self.num_examples, metrics
