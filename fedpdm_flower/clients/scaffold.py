"""SCAFFOLD client (Karimireddy et al., ICML 2020, Alg. 1 option II), a baseline of arXiv 2310.19558 Figs. 7-8.

State in `context.state`: the control variate c_i (float64, zero-initialised) and the privacy ledger. The
downlink carries x and the server control variate c on one index set (:mod:`fedpdm_flower.fedapp.compression.paired`); the
uplink carries Delta y_i = y_i - x and Delta c_i on one index set.

* Local steps: ``y <- y - eta^t (clip(grad f_i(y; B) + gamma sign(y)) + c - c_i)``, Q times (the l1 subgradient is
  [OURS], spec 6.4).
* [OURS] DP: the released vector is Delta y_i with the noise of :meth:`LocalSGDClient.release` (contraction 0:
  the correction c - c_i is the same on neighbouring datasets). Delta c_i = -c - Delta y_i / (Q eta) is computed
  from the NOISY Delta y_i, so it and the client's new c_i are post-processing of the release: no extra privacy
  cost, and next round's correction does not depend on the data beyond what was released.
* [OURS] Sparse variant: Delta y_i is top_k / rand_k sparsified (the message's k), Delta c_i is sent on the same
  indices and c_i changes only there, which keeps the server's c = (1/N) sum_i c_i. The downlink sends x and c on
  the indices of top_k'(x) (k' = alpha-down d), zero-padded at the client.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.clients.base import DIM_KEY, MessageConfig
from fedpdm_flower.clients.broadcast import Fit
from fedpdm_flower.clients.fedavg import LocalSGDClient
from fedpdm_flower.fedapp.algorithms.local_sgd import scaffold_control_delta
from fedpdm_flower.fedapp.compression.codec import SparseVector
from fedpdm_flower.fedapp.compression.paired import pair_from_arrays, pair_to_arrays
from fedpdm_flower.fedapp.compression.payload import FORMAT_KEY

CONTROL = "scaffold.control"

__all__ = ["ScaffoldClient"]


class ScaffoldClient(LocalSGDClient):
    """Corrected local steps, option-II control-variate update, upload (Delta y_i, Delta c_i)."""

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        d = self.model.dim
        cfg = MessageConfig(config)
        server_round = cfg.integer("server-round", lo=1)
        if DIM_KEY in cfg:
            self.check_model(cfg)
        xv, cv = pair_from_arrays(parameters, cfg.integer(FORMAT_KEY), d)
        x0, c = xv.to_dense(), cv.to_dense()
        ci = self.load_vector(CONTROL)
        if ci is None or ci.shape != (d,):
            ci = np.zeros(d)
        res, eta, b = self.local_steps(x0, server_round, cfg, correction=c - ci)
        dy = res.x - x0
        idx = self.uplink_indices(dy, cfg, server_round)
        dy_up, metrics = self.release_local(dy[idx], server_round, cfg, eta=eta, steps=res.steps, contraction=0.0,
                                            batch_size=b)
        dc_up = scaffold_control_delta(c[idx], dy_up, res.steps, eta)  # from the released Delta y: post-processing
        ci[idx] += dc_up
        self.save_vector(CONTROL, ci)
        metrics.update(self.round_metrics(res, len(idx), private="eps_dpsgd" in metrics))
        metrics["control_norm"] = float(np.linalg.norm(ci))
        sparse = cfg.choice("uplink", ("dense", "topk", "randk"), "dense") != "dense"
        arrays, metrics[FORMAT_KEY] = pair_to_arrays(SparseVector(indices=idx, values=dy_up, dim=d), dc_up, sparse=sparse)
        return arrays, self.num_examples, metrics
