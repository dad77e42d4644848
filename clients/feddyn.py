"""FedDyn client (Acar et al., ICLR 2021, Alg. 1), a baseline of arXiv 2310.19558 Figs. 7-8.

State in `context.state`: the linear-term state grad L_i (float64, zero-initialised) and the privacy ledger.

* Local problem ``f_i(th) + gamma ||th||_1 - <grad L_i, th> + (alpha/2)||th - th_server||^2`` (the l1 term is
  [OURS], spec 6.4), solved by Q SGD steps of :func:`fedapp.algorithms.local_sgd.local_sgd` with prox = alpha
  (run config ``feddyn-alpha``) and linear = grad L_i; then ``grad L_i -= alpha (th_i - th_server)``.
* [OURS] DP: the released vector is th_i with the noise of :meth:`LocalSGDClient.release`, contraction alpha. The
  state update uses the NOISY th_i (the value the server also uses for h), so it is post-processing and next
  round's linear term does not depend on the data beyond what was released.
* [OURS] Sparse variant: th_i is top_k / rand_k sparsified (k = alpha-up d) and grad L_i changes only on the sent
  indices, which keeps the server's h = (1/N) sum_i grad L_i. th_server is the received (zero-padded top_k')
  model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from clients.fedavg import Fit, LocalSGDClient
from fedapp.algorithms.local_sgd import feddyn_linear_update
from fedapp.compression.payload import FORMAT_KEY

LINEAR = "feddyn.linear"


class FedDynClient(LocalSGDClient):
    """Dynamically regularised local steps, linear-term update, upload th_i."""

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        alpha = self.cfg.feddyn_alpha
        server_round = int(config["server-round"])
        theta_s = self.receive(parameters, config)
        grad_l = self.load_vector(LINEAR)
        if grad_l is None:
            grad_l = np.zeros(self.model.dim)
        res, eta = self.local_steps(theta_s, server_round, prox=alpha, linear=grad_l)
        idx = self.uplink_indices(res.x, server_round)
        values, metrics = self.release_local(res.x[idx], server_round, eta=eta, steps=res.steps, contraction=alpha)
        grad_l[idx] = feddyn_linear_update(grad_l[idx], values, theta_s[idx], alpha)  # from the released th_i
        self.save_vector(LINEAR, grad_l)
        metrics.update(self.round_metrics(res, len(idx)))
        metrics["linear_norm"] = float(np.linalg.norm(grad_l))
        arrays, metrics[FORMAT_KEY] = self.encode(idx, values)
        return arrays, len(self.data), metrics


class SparseFedDynClient(FedDynClient):
    """FedDyn with top_k / rand_k uplink sparsification before the noise (Fig. 8, [OURS])."""

    sparse_uplink = True
