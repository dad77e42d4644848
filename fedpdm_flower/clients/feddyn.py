"""FedDyn client (Acar et al., ICLR 2021, Alg. 1), a baseline of arXiv 2310.19558 Figs. 7-8.

State in `context.state`: the linear-term state grad L_i (float64, zero-initialised) and the privacy ledger.

* Local problem ``f_i(th) + gamma ||th||_1 - <grad L_i, th> + (alpha/2)||th - th_server||^2`` (the l1 term is
  [OURS], spec 6.4), solved by Q SGD steps of :func:`fedpdm_flower.fedapp.algorithms.local_sgd.local_sgd` with prox = alpha
  (the message's ``feddyn-alpha``) and linear = grad L_i; then ``grad L_i -= alpha (th_i - th_server)``.
* [OURS] DP: the released vector is th_i with the noise of :meth:`LocalSGDClient.release`, contraction alpha. The
  state update uses the NOISY th_i (the value the server also uses for h), so it is post-processing and next
  round's linear term does not depend on the data beyond what was released.
* [OURS] Sparse variant: th_i is top_k / rand_k sparsified (the message's k) and grad L_i changes only on the sent
  indices, which keeps the server's h = (1/N) sum_i grad L_i. th_server is the received (zero-padded top_k')
  model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.clients.base import MessageConfig
from fedpdm_flower.clients.broadcast import Fit
from fedpdm_flower.clients.fedavg import LocalSGDClient
from fedpdm_flower.fedapp.algorithms.local_sgd import feddyn_linear_update

LINEAR = "feddyn.linear"

__all__ = ["FedDynClient"]


class FedDynClient(LocalSGDClient):
    """Dynamically regularised local steps, linear-term update, upload th_i."""

    def fit(self, parameters: list[NDArray[Any]], config: dict[str, Any]) -> Fit:
        cfg = MessageConfig(config)
        alpha = cfg.number("feddyn-alpha", lo=0.0, lo_open=True)
        server_round = cfg.integer("server-round", lo=1)
        theta_s = self.receive(parameters, cfg)
        grad_l = self.load_vector(LINEAR)
        if grad_l is None or grad_l.shape != theta_s.shape:
            grad_l = np.zeros(self.model.dim)
        res, eta, b = self.local_steps(theta_s, server_round, cfg, prox=alpha, linear=grad_l)
        idx = self.uplink_indices(res.x, cfg, server_round)
        values, metrics = self.release_local(res.x[idx], server_round, cfg, eta=eta, steps=res.steps,
                                             contraction=alpha, batch_size=b)
        grad_l[idx] = feddyn_linear_update(grad_l[idx], values, theta_s[idx], alpha)  # from the released th_i
        self.save_vector(LINEAR, grad_l)
        metrics.update(self.round_metrics(res, len(idx), private="eps_dpsgd" in metrics))
        metrics["linear_norm"] = float(np.linalg.norm(grad_l))
        return self.finish(self.encode(idx, values), metrics)
