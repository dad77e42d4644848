"""The DP seed algorithms this app can run, by run-config key ``algorithm``: each entry builds the strategy from the
run config and names its client class. Every one gets the same privacy: ``PrivacyTarget`` (record-level DP-SGD on
each device, epsilon for one record of the device's data, against everyone, the server included)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from fedpdm_flower.clients.dpq import DPQClient
from fedpdm_flower.clients.fedpdm import FedPDMClient
from fedpdm_flower.clients.iadmm import IADMMClient
from fedpdm_flower.clients.recal import RecalClient
from fedpdm_flower.fedapp.compression import TopK
from fedpdm_flower.fedapp.privacy import PrivacyTarget

# Every strategy below takes fraction_evaluate=0.0: this app evaluates centrally (evaluate_fn in server_app.py) and
# its nodes hold no test data, so client-side evaluation (Flower's default fraction_evaluate=1.0) would only fail.


def target(rc: Any) -> PrivacyTarget:
    """The run's record-level target: q = batch / records per node, every node every round."""
    return PrivacyTarget(epsilon=float(rc["epsilon"]), delta=1e-5, clip_norm=float(rc["clip-norm"]),
                         sample_rate=int(rc["batch-size"]) / int(rc["samples-per-node"]))


def dp_recal(rc: Any) -> Any:
    """DP-RECAL (seed 001): the baton relayed along a random walk on a ring; each agent's step (12c) is a DP-SGD step
    of its smooth softmax regression (RECAL needs a smooth loss and its Lipschitz constant, so not the CNN); one
    activation per round. C = 30: a record's gradient (p - e_y) x^T has norm ~30 on standardised pixels, so 30 clips
    only the largest (with C = 1 the step alpha_i = 1 / (L_i + 1) ~ 0.008 would barely move the model)."""
    from fedpdm_flower.strategies.recal import DPRECAL

    t = target(rc)
    return DPRECAL(graph="ring", min_available_nodes=int(rc["min-nodes"]), fraction_evaluate=0.0, nu1=0.0, nu2=1e-4, seed=0,
                   privacy=PrivacyTarget(epsilon=t.epsilon, delta=t.delta, clip_norm=30.0, sample_rate=t.sample_rate))


def dpq_dsgd(rc: Any) -> Any:
    """DPQ-DSGD (seed 004): every node every round, messages quantized to a grid of 0.01 (bit-packed levels) and not
    noised; the gradient (5) is a DP-SGD step; alpha_hat = a1 (ln K)^2 / K = 2 at the horizon K = rounds - 2 (a
    clipped gradient has norm <= C, so the step is large); the node-average model comes back (inside the
    guarantee: post-processing of the DP-SGD steps)."""
    import math

    from fedpdm_flower.strategies.dpq import DPQDSGD

    horizon = int(rc["num-server-rounds"]) - 2
    return DPQDSGD(min_available_nodes=int(rc["min-nodes"]), fraction_evaluate=0.0, graph="ring", q_step=0.01, seed=0,
                   a1=2.0 * horizon / math.log(horizon) ** 2, evaluate_average=True, privacy=target(rc))


def bsdp_fedpdm(rc: Any) -> Any:
    """BSDP-FedPDM (Li et al.): DP-SGD steps in (8a), top-50 % up, top-75 % down."""
    from fedpdm_flower.strategies.fedpdm import BSDPFedPDM

    return BSDPFedPDM(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=int(rc["min-nodes"]), rho=0.1, gamma=0.0,
                      eta0=float(rc["lr"]), nu=0.0, max_local_steps=int(rc["local-steps"]),
                      uplink=TopK(0.5), downlink=TopK(0.75), privacy=target(rc))


def recal_client(loader: Any) -> Any:
    """A DP-RECAL agent: the user's softmax regression on its partition, with L_i of its data (task.py)."""
    from dp_seeds.task import SoftmaxRegression, softmax_lipschitz

    return RecalClient(SoftmaxRegression(), loader, loss_fn=nn.CrossEntropyLoss(), lipschitz=softmax_lipschitz(loader))


def objpm(rc: Any) -> Any:
    """DP-IADMM's ObjPM (Ryu & Kim): each of the ``local-steps`` local solves (8) takes one DP-SGD step; the duals,
    proximal terms and the average of the solves are post-processing. The global sample count I is asked from the
    nodes before round 1 with the run's privacy plan. rho and eta are constants (the step of one solve on the
    device's mean gradient is ``(I_p / I) / (1/eta + rho)``, about 0.6 here): the paper's schedules (24) and
    1/sqrt(t) are tuned for 20 000 rounds of a linear model, not 3 rounds of a CNN."""
    from fedpdm_flower.strategies.iadmm import DPIADMM

    return DPIADMM(min_available_nodes=int(rc["min-nodes"]), fraction_evaluate=0.0, local_updates=int(rc["local-steps"]), rho=0.2, eta=3.0,
                   privacy=target(rc))


#: algorithm key -> (strategy builder, client class); other families add their entry here
ALGORITHMS: dict[str, tuple[Callable[[Any], Any], type[Any]]] = {
    "bsdp-fedpdm": (bsdp_fedpdm, FedPDMClient),
    "dp-recal": (dp_recal, RecalClient),
    "dpq-dsgd": (dpq_dsgd, DPQClient),
    "dp-iadmm": (objpm, IADMMClient),
}
#: algorithm key -> how its client is built from the node's DataLoader, where not ``cls(Net(), loader, loss_fn)``
CLIENTS: dict[str, Callable[[Any], Any]] = {"dp-recal": recal_client}


def model(rc: Any) -> nn.Module:
    """The user's network the run config's algorithm trains: the CNN, or the softmax regression for DP-RECAL."""
    from dp_seeds.task import Net, SoftmaxRegression

    return SoftmaxRegression() if str(rc["algorithm"]) == "dp-recal" else Net()


def pick(rc: Any) -> tuple[Callable[[Any], Any], type[Any]]:
    """The run config's algorithm, or a clear error listing the keys."""
    key = str(rc["algorithm"])
    if key not in ALGORITHMS:
        raise ValueError(f"run config 'algorithm' = {key!r}: one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[key]
