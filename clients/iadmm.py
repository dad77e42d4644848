"""DP-IADMM (ObjP / ObjPM, Algorithm 1 lines 11-24) and OutP agents.

Ryu & Kim, "Differentially Private Federated Learning via Inexact ADMM with Multiple Local Updates" (seed 002);
spec ``shared/specs/dp_iadmm.md`` sections 2.3, 5.2, 9.2, 9.4 and 9.7.

State in ``context.state`` (float64): the dual lambda_p (``iadmm.dual``), the start point of the next round
(``iadmm.z``: z_p^{t,E+1} for ObjP/ObjPM, the noisy iterate for OutP), ``iadmm.meta`` (local solves so far,
OutP's pending dual update) and ``iadmm.row_l1`` (||x_i||_1 of the agent's samples, fixed by its data). The agent updates its dual with exactly the float32-rounded array the server decodes
(:func:`fedapp.compression.codec.wire_round`), so both copies of (4c) stay bit-identical (spec 9.8).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flwr.app import ConfigRecord
from numpy.typing import NDArray

from fedapp.algorithms.iadmm import (
    AgentData,
    agent_round,
    clip_rows_l1,
    dual_fingerprint,
    dual_update,
    epsilon_of,
    local_updates_of,
    outp_inv_eta,
    outp_noise_std,
    outp_sigma,
    outp_step,
    row_l1,
)
from fedapp.client_base import STREAM_NOISE, FedClient
from fedapp.compression.codec import decode_vector, wire_round
from fedapp.compression.payload import FORMAT_KEY, from_arrays
from fedapp.models.base import FloatArray
from fedapp.models.multinomial import MultinomialLogistic
from fedapp.privacy.laplace import advanced_composition, basic_composition

DUAL, START, META, L1 = "iadmm.dual", "iadmm.z", "iadmm.meta", "iadmm.row_l1"


class IADMMClient(FedClient):
    """Agent p of Algorithm 1: E Laplace-perturbed inexact solves (8), send their average, update lambda_p (4c)."""

    def agent_data(self, total: int) -> AgentData:
        """X_p without the bias column (model (63)), L1-clipped to C1 in the bounded-sensitivity mode (spec 4.6)."""
        model = self.model
        if not isinstance(model, MultinomialLogistic):
            raise TypeError(f"DP-IADMM needs a multinomial model, got {model.name!r}")
        inputs = model.inputs(self.data.x)  # a view: BLAS reads the strided rows without a copy
        if self.cfg.sensitivity_mode == "bounded":
            inputs = clip_rows_l1(inputs, self.cfg.clip_l1)
        l1 = self.load_vector(L1)  # ||x_i||_1 is fixed by the data: computed once, kept in context.state
        if l1 is None or len(l1) != len(inputs):
            l1 = row_l1(inputs)
            self.save_vector(L1, l1)
        return AgentData(inputs, self.data.y, model.num_classes, total, self.cfg.iadmm_beta, self.cfg.num_clients, l1,
                         self.cfg.device)

    def load_meta(self) -> dict[str, Any]:
        """Round bookkeeping kept in context.state (local solves so far, OutP's pending dual update)."""
        rec = self.node_context.state.config_records.get(META)
        return {"solves": 0, "rounds": 0, "pending": False, "rho_prev": 0.0} if rec is None else dict(rec)

    def save_meta(self, meta: dict[str, Any]) -> None:
        self.node_context.state[META] = ConfigRecord(meta)

    def received(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> FloatArray:
        """The dense vector the server broadcast, decoded to float64 (exactly the server's wire-rounded copy)."""
        return decode_vector(from_arrays(parameters, config.get(FORMAT_KEY, 0)), self.model.dim).to_dense()

    def state(self, server_round: int) -> tuple[FloatArray, FloatArray, dict[str, Any], int]:
        """(lambda_p, start point, meta, state_reset): zeros in round 1 (spec A7); a lost state is reported."""
        lam, start, meta = self.load_vector(DUAL), self.load_vector(START), self.load_meta()
        reset = int((lam is None or start is None) and server_round > 1)
        zeros = np.zeros(self.model.dim)
        return (zeros if lam is None else lam), (zeros.copy() if start is None else start), meta, reset

    def privacy(self, meta: dict[str, Any], epsilon: float, delta: float, per_round: int) -> dict[str, Any]:
        """Per-iteration, per-round and cumulative (basic and advanced composition) privacy of this agent.

        epsilon-bar (delta-bar for OutP) per local solve (Thm 1); E of them per round (A4); over the k solves run so
        far basic composition (k eps, k delta) and Dwork-Roth's advanced composition at delta' = ``outp-delta`` (A5).
        """
        if math.isinf(epsilon):
            return {}
        k = int(meta["solves"])
        eps_b, delta_b = basic_composition(k, epsilon, delta)
        eps_a, delta_a = advanced_composition(k, epsilon, self.cfg.outp_delta, delta)
        out = {"eps_iter": epsilon, "delta_iter": delta, "eps_round": per_round * epsilon,
               "eps_basic": eps_b, "delta_basic": delta_b, "local_solves": k}
        if math.isfinite(eps_a):  # e^epsilon overflowed: the bound is vacuous, and the server rejects inf metrics
            out.update({"eps_advanced": eps_a, "delta_advanced": delta_a})
        return out

    def finish(self, t: int, z_send: FloatArray, lam: FloatArray, start: FloatArray, meta: dict[str, Any],
               metrics: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        """Persist the state and build the reply (the dual CRC lets the server check its replica)."""
        self.save_vector(DUAL, lam)
        self.save_vector(START, start)
        meta["rounds"] = int(meta["rounds"]) + 1
        self.save_meta(meta)
        arrays, metrics[FORMAT_KEY] = self.encode(np.arange(self.model.dim, dtype=np.int64), z_send)
        metrics.update({"dual_crc": dual_fingerprint(lam), "dual_sqnorm": float(np.dot(lam, lam)), "round": t})
        return arrays, len(self.data), metrics

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        cfg = self.cfg
        t, rho, eta = int(config["server-round"]), float(config["rho"]), float(config["eta"])
        data = self.agent_data(int(config["total-samples"]))
        shape = data.shape
        w = self.received(parameters, config)
        lam, start, meta, reset = self.state(t)
        e_count, eps = local_updates_of(cfg), epsilon_of(cfg)
        res = agent_round(
            data, start.reshape(shape), w.reshape(shape), lam.reshape(shape), rho=rho, eta=eta,
            local_updates=e_count, epsilon=eps, rng=self.rng(t, STREAM_NOISE, cfg.noise_seed),
            sensitivity_mode=cfg.sensitivity_mode, clip_l1=cfg.clip_l1,
        )
        z_send = wire_round(res.z_avg.ravel())  # line 21, as the server will decode it
        lam = dual_update(lam, w, z_send, rho)  # line 23
        meta["solves"] = int(meta["solves"]) + e_count
        metrics: dict[str, Any] = {
            "delta_mean": float(np.mean(res.sensitivities)), "delta_max": float(np.max(res.sensitivities)),
            "lap_scale_mean": float(np.mean(res.scales)), "noise_abs_mean": res.noise_abs_mean,
            "state_reset": reset, **self.privacy(meta, eps, 0.0, e_count),
        }
        return self.finish(t, z_send, lam, res.z_last.ravel(), meta, metrics)


class OutPClient(IADMMClient):
    """OutP agent: one noiseless inexact step, then Gaussian output noise (spec 5.2); the noisy iterate is kept.

    In Huang's order (default) the dual update of round r uses the W that only arrives in round r+1, so it is
    applied at the start of the next fit (``pending`` in ``iadmm.meta``, spec 9.7).
    """

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> tuple[list[NDArray[Any]], int, dict[str, Any]]:
        cfg = self.cfg
        t, rho = int(config["server-round"]), float(config["rho"])
        data = self.agent_data(int(config["total-samples"]))
        shape = data.shape
        w = self.received(parameters, config)
        lam, z, meta, reset = self.state(t)
        if meta["pending"]:  # lambda_p^{k} = lambda_p^{k-1} + rho_{k-1} (W^k - z~_p^k), W^k just received
            lam = dual_update(lam, w, z, float(meta["rho_prev"]))
        eps = epsilon_of(cfg)
        inv_eta = outp_inv_eta(t, data.size, eps, cfg.outp_delta)
        sigma = outp_sigma(rho, inv_eta, eps, cfg.outp_delta)
        std = outp_noise_std(sigma, cfg.outp_noise_std)
        noisy, noise_abs = outp_step(
            data, z.reshape(shape), w.reshape(shape), lam.reshape(shape), rho=rho, inv_eta=inv_eta, std=std,
            rng=self.rng(t, STREAM_NOISE, cfg.noise_seed), normaliser=data.size if cfg.outp_grad_scale == "local" else None,
        )
        z_send = wire_round(noisy.ravel())
        if cfg.outp_order == "alg1":
            lam = dual_update(lam, w, z_send, rho)
            meta["pending"] = False
        else:
            meta["pending"], meta["rho_prev"] = True, rho
        meta["solves"] = int(meta["solves"]) + 1
        metrics: dict[str, Any] = {
            "sigma": sigma, "noise_std": std, "inv_eta": inv_eta, "noise_abs_mean": noise_abs, "state_reset": reset,
            **self.privacy(meta, eps, cfg.outp_delta if not math.isinf(eps) else 0.0, 1),
        }
        return self.finish(t, z_send, lam, z_send, meta, metrics)
