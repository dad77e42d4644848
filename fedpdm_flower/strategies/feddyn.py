"""FedDyn server side (Acar et al., ICLR 2021, Alg. 1): a baseline of arXiv 2310.19558, Figs. 7-8 ([46]).

The server keeps th (the model) and h (zero-initialised). Each round it broadcasts th, receives the local models
th_i and applies ``h -= alpha (1/N) sum_{i in S} (th_i - th)`` and ``th = mean(th_i) - h / alpha``
(:func:`fedpdm_flower.fedapp.algorithms.local_sgd.feddyn_server_update`), alpha = the ``alpha`` argument.

[OURS] (spec 6.4) With sparse codecs the server broadcasts top_k'(th) and receives top_k / rand_k
sparsified th_i; the h update uses the model as the clients received it (zero-padded, float32 on the wire) and
runs over the senders of each coordinate; the mean is element-wise, 0 where nobody sent (FedPDM's rule, A11).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.algorithms.local_sgd import feddyn_server_update
from fedpdm_flower.strategies.base import Scalar
from fedpdm_flower.strategies.broadcast import round_diagnostics
from fedpdm_flower.strategies.fedavg import LocalSGDStrategy

__all__ = ["FedDyn"]


class FedDyn(LocalSGDStrategy):
    """FedDyn: broadcast th, update h from the received local models, th = mean - h/alpha.

    Parameters
    ----------
    alpha
        FedDyn's regularisation weight (default 10.0); sent to the clients as "feddyn-alpha". For a neural network
        use 0.1 with ``eta0=0.2`` (docs/models-and-data.md).
    **kwargs
        :class:`fedpdm_flower.strategies.fedavg.LocalSGDStrategy`'s arguments.
    """

    #: the linear-term state h carries from round to round (``sent`` is reset by every broadcast; checkpoints)
    CHECKPOINT_ATTRS = ("h",)

    def __init__(self, *, alpha: float = 10.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not (isinstance(alpha, int | float) and alpha > 0):
            raise ValueError(f"alpha must be > 0, got {alpha!r}")
        self.alpha = float(alpha)

    def on_initialize(self) -> None:
        self.h = np.zeros(self.dim)
        self.sent = np.zeros(self.dim)  # th^{t-1} as this round's clients received it

    def round_config(self) -> dict[str, Scalar]:
        return {**super().round_config(), "feddyn-alpha": self.alpha}

    def encode_downlink(self, idx: NDArray[np.int64]) -> tuple[list[NDArray[Any]], int]:
        """As the base class, and remember the broadcast (zero-padded, float32-rounded) for the h update."""
        self.sent = np.zeros(self.dim)
        self.sent[idx] = self.x[idx].astype(np.float32)
        return super().encode_downlink(idx)

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        thetas = [updates[p] for p in sorted(updates)]
        self.x, self.h, counts = feddyn_server_update(self.h, thetas, self.sent, self.alpha, self.num_clients)
        return {**round_diagnostics(counts, metrics), "h_norm": float(np.linalg.norm(self.h))}
