"""SCAFFOLD server side (Karimireddy et al., ICML 2020, Alg. 1 option II, global step 1): a baseline of arXiv
2310.19558, Figs. 7-8 (the paper's [26]).

The server keeps x and the control variate c (zero-initialised). Each round it sends x and c to the sampled
clients (one message, one index set: :mod:`fedpdm_flower.fedapp.compression.paired`), receives (Delta y_i, Delta c_i) and applies
``x += mean Delta y`` and ``c += (|S|/N) mean Delta c`` (:func:`fedpdm_flower.fedapp.algorithms.local_sgd.scaffold_server_update`).

[OURS] (spec 6.4) With a sparse downlink the server sends x and c on the indices of top_k'(x) and receives
Delta y_i top_k / rand_k sparsified with Delta c_i on the same indices; Delta y is averaged element-wise over the
senders of each coordinate and a coordinate nobody sent keeps its value. Under DP the clients compute Delta c_i
from their noisy Delta y_i (post-processing, see fedpdm_flower/clients/scaffold.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.algorithms.local_sgd import scaffold_server_update
from fedpdm_flower.fedapp.compression.codec import SparseVector
from fedpdm_flower.fedapp.compression.paired import pair_from_arrays, pair_to_arrays
from fedpdm_flower.fedapp.compression.payload import FORMAT_KEY
from fedpdm_flower.strategies.broadcast import round_diagnostics
from fedpdm_flower.strategies.fedavg import LocalSGDStrategy

__all__ = ["Scaffold"]


class Scaffold(LocalSGDStrategy):
    """SCAFFOLD: broadcast (x, c), apply the mean model change and the (|S|/N)-scaled mean control change.

    Parameters are :class:`fedpdm_flower.strategies.fedavg.LocalSGDStrategy`'s.
    """

    #: the server control variate c carries from round to round (checkpoints)
    CHECKPOINT_ATTRS = ("c",)

    def on_initialize(self) -> None:
        self.c = np.zeros(self.dim)

    def encode_downlink(self, idx: NDArray[np.int64]) -> tuple[list[NDArray[Any]], int]:
        """x and c at ``idx`` (the top_k'(x) indices when sparse) in one paired payload."""
        v = SparseVector(indices=idx, values=self.x[idx], dim=self.dim)
        return pair_to_arrays(v, self.c[idx], sparse=len(idx) < self.dim)

    def decode_update(
        self, server_round: int, client: int, arrays: list[NDArray[Any]], metrics: dict[str, Any]
    ) -> tuple[SparseVector, SparseVector]:
        k = self.upload_k
        dy, dc = pair_from_arrays(arrays, metrics.get(FORMAT_KEY), self.dim, max_k=k)
        if dy.k != k:
            raise ValueError(f"expected k={k} uploaded values, got {dy.k}")
        return dy, dc

    def update_vector(self, server_round: int, client: int, update: Any) -> Any:
        """Delta y_i (on its support): SCAFFOLD's clients upload the change itself."""
        return np.asarray(update[0].values, dtype=np.float64)

    def aggregate(self, server_round: int, updates: dict[int, Any], metrics: dict[int, dict[str, Any]]) -> dict[str, float]:
        pids = sorted(updates)
        self.x, self.c, counts = scaffold_server_update(
            self.x, self.c, [updates[p][0] for p in pids], [updates[p][1] for p in pids], self.num_clients
        )
        return {**round_diagnostics(counts, metrics), "control_norm": float(np.linalg.norm(self.c))}
