"""Server side of broadcast algorithms: DP-FedPDM / BSDP-FedPDM and the FedAvg-family baselines of seed 000.

The server broadcasts its model x (dense, or ``top_k'(x)`` with a sparse downlink, eq. 27), sends every
algorithmic value in the message config (the keys of :mod:`fedpdm_flower.clients.broadcast`), and decodes uploads of k entries.
Subclasses implement ``aggregate`` and may add config or a second downlink vector.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.algorithms.fedpdm import step_size
from fedpdm_flower.fedapp.compression.codec import SparseVector, decode_vector, encode_dense, encode_sparse
from fedpdm_flower.fedapp.compression.payload import FORMAT_KEY, from_arrays, to_arrays
from fedpdm_flower.fedapp.compression.sparsify import RandK, TopK
from fedpdm_flower.fedapp.layout import FloatArray
from fedpdm_flower.fedapp.privacy.dpsgd import DPSGDMechanism
from fedpdm_flower.fedapp.privacy.gaussian import Calibration, Eq36Calibration, GaussianTarget
from fedpdm_flower.fedapp.privacy.protocol import privacy_guard
from fedpdm_flower.fedapp.privacy.target import PrivacyTarget
from fedpdm_flower.strategies.base import FederatedStrategy, Scalar

__all__ = ["BroadcastStrategy", "round_diagnostics"]


def round_diagnostics(counts: NDArray[np.int64], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
    """Coverage of the aggregated coordinates, mean Q and training loss, and mean sigma / eps_round under DP."""
    diag = {
        "coverage": float(np.mean(counts > 0)),
        "mean_Q": float(np.mean([m.get("Q", np.nan) for m in metrics.values()])),
        "mean_train_loss": float(np.mean([m.get("train_loss", np.nan) for m in metrics.values()])),
    }
    sig = [m["sigma"] for m in metrics.values() if "sigma" in m]
    if sig:
        diag["mean_sigma"] = float(np.mean(sig))
        diag["mean_eps_round"] = float(np.mean([m.get("eps_round", np.nan) for m in metrics.values()]))
        # what another library needs to recompute every figure: the mechanism's z = sigma / S, its sample rate
        # (1: no amplification claimed) and the most releases any client made so far
        zs = [m["noise_multiplier"] for m in metrics.values() if "noise_multiplier" in m]
        if zs:
            diag["noise_multiplier"] = float(min(zs))  # the least noise of the round: the worst client's
            diag["sample_rate"] = float(max(m.get("sample_rate", 1.0) for m in metrics.values()))
            diag["releases"] = float(max(m.get("participations", 0) for m in metrics.values()))
    return diag


class BroadcastStrategy(FederatedStrategy):
    """Broadcast x, run Q local steps on the clients, decode their (sparse, noisy) uploads.

    Parameters
    ----------
    eta0
        Step size scale: eta^t = eta0 / sqrt(1 + t) in round t (0-based; Section V-C). Default 0.04.
    max_local_steps
        Upper bound on the local steps Q (default 10); the clients also keep Q b < |D_i| (spec A6).
    batch_size
        Mini-batch size b (default None: each client's DataLoader batch size).
    uplink
        ``TopK(alpha_U)`` or ``RandK(alpha_U)`` to sparsify what clients upload (eq. 18), or None (dense).
    downlink
        ``TopK(alpha_D)`` to broadcast only top_k'(x) (eq. 27), or None (dense).
    privacy
        :class:`fedpdm_flower.fedapp.privacy.target.PrivacyTarget` for record-level DP-SGD on every device (the
        local steps are DP-SGD steps: z calibrated once for ``max_local_steps`` steps a participation over the
        target's horizon, sent with q, C and the steps in every message);
        :class:`fedpdm_flower.fedapp.privacy.gaussian.Eq36Calibration` for the paper's Gaussian mechanism on the
        upload (the reproduction setting); ``GaussianTarget`` for that mechanism at an exact GDP target; None: no
        noise.
    accountant
        Server-side accounting of each client's releases with Flower's privacy protocol, with a budget that stops
        the run before a release would pass it (:meth:`~fedpdm_flower.strategies.base.RoundBookkeeping.set_accountant`); None
        (default): :meth:`privacy_spent` reports the RDP figure of the clients' own ledgers.
    **federation
        :class:`fedpdm_flower.strategies.base.FederatedStrategy`'s arguments (fraction_train, min_available_nodes, seed, ...).
    """

    PRIVACY_KEYS = ("eps_dpsgd", "eps_eq36", "eps_gdp", "eps_rdp", "eps_basic", "delta_basic")
    PRIVACY_DETAIL_KEYS = ("dp_noise_multiplier", "dp_sample_rate", "dp_steps", "dp_mechanisms")
    #: the server keeps no per-client state (the duals, control variates and ledgers live on the devices, the noise
    #: calibration follows the round's sampling rate): nodes that connect after round 1 join the federation
    admits_new_nodes = True

    def __init__(self, *, eta0: float = 0.04, max_local_steps: int = 10, batch_size: int | None = None,
                 uplink: TopK | None = None, downlink: TopK | None = None, privacy: Calibration | None = None,
                 accountant: Any = None, **federation: Any) -> None:
        super().__init__(**federation)
        if accountant is None and isinstance(privacy, GaussianTarget):
            accountant = privacy_guard(privacy)  # the target is also the budget the run may not pass
        self.set_accountant(accountant)
        if not (isinstance(eta0, int | float) and eta0 > 0 and np.isfinite(eta0)):
            raise ValueError(f"eta0 must be a finite number > 0, got {eta0!r}")
        for name, v in (("max_local_steps", max_local_steps), ("batch_size", batch_size)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if uplink is not None and not isinstance(uplink, TopK):
            raise TypeError(f"uplink must be TopK(...) or RandK(...), got {type(uplink).__name__}")
        if downlink is not None and (not isinstance(downlink, TopK) or isinstance(downlink, RandK)):
            raise TypeError(f"downlink must be TopK(...) (the server sends its largest entries), got {downlink!r}")
        if privacy is not None and not isinstance(privacy, PrivacyTarget | Eq36Calibration | GaussianTarget):
            raise TypeError(f"privacy must be PrivacyTarget(...), Eq36Calibration(...) or GaussianTarget(...), got "
                            f"{type(privacy).__name__}")
        if isinstance(privacy, PrivacyTarget):
            privacy.rate(type(self).__name__)  # DP-SGD needs q: refused here, with what to pass
        self.mechanism: DPSGDMechanism | None = None  # DP-SGD's (z, q, C, steps), calibrated by prepare()
        self.eta0 = float(eta0)
        self.max_local_steps = max_local_steps
        self.batch_size = batch_size
        self.uplink = uplink
        self.downlink = downlink
        self.privacy = privacy
        self._downlink: tuple[int, list[NDArray[Any]], int] | None = None

    @property
    def upload_k(self) -> int:
        """Number of entries each client uploads: k = alpha_U d with a sparse uplink, else d."""
        return self.uplink.k(self.dim) if self.uplink is not None else self.dim

    def downlink_indices(self) -> NDArray[np.int64]:
        """All d indices, or the indices of top_k'(x) (k' = alpha_D d) with a sparse downlink."""
        d = self.dim
        k = self.downlink.k(d) if self.downlink is not None else d
        return self.downlink.indices(self.x) if self.downlink is not None and k < d else np.arange(d, dtype=np.int64)

    def encode_downlink(self, idx: NDArray[np.int64]) -> tuple[list[NDArray[Any]], int]:
        """Codec arrays and format code of x at ``idx`` (sparse only when fewer than d entries)."""
        v = SparseVector(indices=idx, values=self.x[idx], dim=self.dim)
        return to_arrays(encode_sparse(v) if len(idx) < self.dim else encode_dense(v.to_dense()))

    def local_config(self, server_round: int) -> dict[str, Scalar]:
        """The local loop's settings, the uplink and the privacy calibration (keys of :mod:`fedpdm_flower.clients.broadcast`)."""
        cfg: dict[str, Scalar] = {
            "eta": step_size(self.eta0, server_round - 1),  # t is the paper's 0-based round index
            "max-steps": self.max_local_steps,
            "uplink": self.uplink.name if self.uplink is not None else "dense",
        }
        if self.batch_size is not None:
            cfg["batch-size"] = self.batch_size
        if self.uplink is not None:
            cfg["k-up"] = self.upload_k
        p = self.privacy
        cfg["dp"] = p is not None
        if isinstance(p, PrivacyTarget):
            cfg.update(p.message_config(self.dpsgd_mechanism()))
        elif p is not None:
            cfg.update(p.message_config(self.num_rounds, self.sample_size() / self.num_clients))
        return cfg

    def dpsgd_mechanism(self) -> DPSGDMechanism:
        """DP-SGD's (z, q, C, steps) for this run: z calibrated for ``max_local_steps`` steps in each of the
        target's horizon (default: every round) participations, under the RDP accountant."""
        if not isinstance(self.privacy, PrivacyTarget):
            raise RuntimeError(f"{type(self).__name__} runs DP-SGD only with privacy=PrivacyTarget(...)")
        if self.mechanism is None:
            self.mechanism = self.privacy.mechanism(self.max_local_steps, max(1, int(self.num_rounds or 1)),
                                                    owner=type(self).__name__)
        return self.mechanism

    def check_nodes(self, infos: Any) -> None:
        """Refuse, before round 1, a DP-SGD target above the floor a device reported (``dp-max-epsilon``): that
        device would refuse its messages once its spend passes the floor."""
        if not isinstance(self.privacy, PrivacyTarget):
            return
        for cid, info in sorted(infos.items()):
            floor = info.get("dp-max-epsilon")
            if isinstance(floor, int | float) and not isinstance(floor, bool) and floor < self.privacy.epsilon:
                raise ValueError(
                    f"client {cid} (node {self.node_of.get(cid)}) accepts at most epsilon = {floor:g} (its max_epsilon), "
                    f"but PrivacyTarget epsilon = {self.privacy.epsilon:g} would take it there: lower the target's "
                    "epsilon or its horizon, or leave that device out")

    def prepare(self, num_rounds: int, **kwargs: Any) -> None:
        """:meth:`FederatedStrategy.prepare`, then DP-SGD's calibration for this run's length: a target no noise
        can meet is refused here, before round 1, naming the knob."""
        super().prepare(num_rounds, **kwargs)
        self.mechanism = None
        if isinstance(self.privacy, PrivacyTarget):
            self.dpsgd_mechanism()

    def round_config(self) -> dict[str, Scalar]:
        """Algorithm-specific config sent with the model (none for FedAvg)."""
        return {}

    def client_payload(self, server_round: int, client: int) -> tuple[list[NDArray[Any]], dict[str, Scalar]]:
        if self._downlink is None or self._downlink[0] != server_round:  # encode once per round, send to all
            arrays, code = self.encode_downlink(self.downlink_indices())
            self._downlink = (server_round, arrays, code)
        _, arrays, code = self._downlink
        return arrays, {FORMAT_KEY: code, **self.local_config(server_round), **self.round_config()}

    def decode_update(self, server_round: int, client: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]) -> Any:
        k = self.upload_k
        code = metrics.get(FORMAT_KEY)
        if code is None and self.uplink is None and self.downlink is None and self._downlink is not None:
            # dense both ways under SecureBuffers / DistributedDP: the wrapper hands back a buffer's mean upload in
            # the arrays that were sent (the dense downlink's format), with a count as its only metric
            code = self._downlink[2]
        v = decode_vector(from_arrays(arrays, code), self.dim, max_k=k)
        if v.k != k:
            raise ValueError(f"expected k={k} uploaded values, got {v.k}")
        return v

    def update_vector(self, server_round: int, client: int, update: Any) -> FloatArray | None:
        """The uploaded entries minus the global model's there (y_i - x on the upload's support)."""
        return np.asarray(update.values - self.x[update.indices], dtype=np.float64)

    def headline_privacy(self, priv: Any) -> tuple[float | None, float | None]:
        """results.json's (epsilon, delta): the worst client's figure of the calibration's own accountant (RDP of
        every DP-SGD step for a PrivacyTarget, the exact GDP epsilon for a GaussianTarget, eq. (36) for the paper's
        calibration)."""
        key = ("eps_dpsgd" if isinstance(self.privacy, PrivacyTarget)
               else "eps_gdp" if isinstance(self.privacy, GaussianTarget) else "eps_eq36")
        if self.privacy is not None and key in priv:
            return float(priv[key]), self.privacy.delta
        return None, None

    @property
    def RIGOROUS_PRIVACY(self) -> tuple[str, str]:  # type: ignore[override]
        """The rigorous figure the devices report: DP-SGD's RDP, else the exact GDP of the upload noise."""
        if isinstance(self.privacy, PrivacyTarget):
            return ("eps_dpsgd", "rdp of every DP-SGD step (device ledgers)")
        return ("eps_gdp", "gdp (device ledgers)")

    @property
    def privacy_label(self) -> str:  # type: ignore[override]
        if isinstance(self.privacy, PrivacyTarget):
            return "eps(dpsgd)"
        return "eps(gdp)" if isinstance(self.privacy, GaussianTarget) else "eps(36)"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "eta0": self.eta0, "max_local_steps": self.max_local_steps,
                "batch_size": self.batch_size, "uplink": self.uplink, "downlink": self.downlink,
                "privacy": self.privacy}
