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
from fedpdm_flower.fedapp.privacy.gaussian import Calibration, Eq36Calibration, GaussianTarget
from fedpdm_flower.fedapp.privacy.protocol import privacy_guard
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
        :class:`fedpdm_flower.fedapp.privacy.gaussian.Eq36Calibration` for the paper's Gaussian mechanism, or None (no noise).
    accountant
        Server-side accounting of each client's releases with Flower's privacy protocol, with a budget that stops
        the run before a release would pass it (:meth:`~fedpdm_flower.strategies.base.RoundBookkeeping.set_accountant`); None
        (default): :meth:`privacy_spent` reports the RDP figure of the clients' own ledgers.
    **federation
        :class:`fedpdm_flower.strategies.base.FederatedStrategy`'s arguments (fraction_train, min_available_nodes, seed, ...).
    """

    PRIVACY_KEYS = ("eps_eq36", "eps_gdp", "eps_rdp", "eps_basic", "delta_basic")
    RIGOROUS_PRIVACY = ("eps_gdp", "gdp (device ledgers)")
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
        if privacy is not None and not isinstance(privacy, Eq36Calibration | GaussianTarget):
            raise TypeError(f"privacy must be GaussianTarget(...) or Eq36Calibration(...), got {type(privacy).__name__}")
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
        if p is not None:
            cfg.update(p.message_config(self.num_rounds, self.sample_size() / self.num_clients))
        return cfg

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
        v = decode_vector(from_arrays(arrays, metrics.get(FORMAT_KEY)), self.dim, max_k=k)
        if v.k != k:
            raise ValueError(f"expected k={k} uploaded values, got {v.k}")
        return v

    def update_vector(self, server_round: int, client: int, update: Any) -> FloatArray | None:
        """The uploaded entries minus the global model's there (y_i - x on the upload's support)."""
        return np.asarray(update.values - self.x[update.indices], dtype=np.float64)

    def headline_privacy(self, priv: Any) -> tuple[float | None, float | None]:
        """results.json's (epsilon, delta): the worst client's figure of the calibration's own accountant (the
        exact GDP epsilon for a GaussianTarget, eq. (36) for the paper's calibration)."""
        key = "eps_gdp" if isinstance(self.privacy, GaussianTarget) else "eps_eq36"
        if self.privacy is not None and key in priv:
            return float(priv[key]), self.privacy.delta
        return None, None

    @property
    def privacy_label(self) -> str:  # type: ignore[override]
        return "eps(gdp)" if isinstance(self.privacy, GaussianTarget) else "eps(36)"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "eta0": self.eta0, "max_local_steps": self.max_local_steps,
                "batch_size": self.batch_size, "uplink": self.uplink, "downlink": self.downlink,
                "privacy": self.privacy}
