"""The DP seed algorithms this app can run, by run-config key ``algorithm``: each entry builds the strategy from the
run config and names its client class. Every one gets the same privacy: ``PrivacyTarget`` (record-level DP-SGD on
each device, epsilon for one record of the device's data, against everyone, the server included)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedpdm_flower.clients.fedpdm import FedPDMClient
from fedpdm_flower.clients.iadmm import IADMMClient
from fedpdm_flower.fedapp.compression import TopK
from fedpdm_flower.fedapp.privacy import PrivacyTarget


def target(rc: Any) -> PrivacyTarget:
    """The run's record-level target: q = batch / records per node, every node every round."""
    return PrivacyTarget(epsilon=float(rc["epsilon"]), delta=1e-5, clip_norm=float(rc["clip-norm"]),
                         sample_rate=int(rc["batch-size"]) / int(rc["samples-per-node"]))


def bsdp_fedpdm(rc: Any) -> Any:
    """BSDP-FedPDM (seed 000): DP-SGD steps in (8a), top-50 % up, top-75 % down."""
    from fedpdm_flower.strategies.fedpdm import BSDPFedPDM

    return BSDPFedPDM(fraction_train=1.0, min_available_nodes=int(rc["min-nodes"]), rho=0.1, gamma=0.0,
                      eta0=float(rc["lr"]), nu=0.0, max_local_steps=int(rc["local-steps"]),
                      uplink=TopK(0.5), downlink=TopK(0.75), privacy=target(rc))


def objpm(rc: Any) -> Any:
    """DP-IADMM's ObjPM (seed 002): each of the ``local-steps`` local solves (8) takes one DP-SGD step; the duals,
    proximal terms and the average of the solves are post-processing. The global sample count I is asked from the
    nodes before round 1 with the run's privacy plan. rho and eta are constants (the step of one solve on the
    device's mean gradient is ``(I_p / I) / (1/eta + rho)``, about 0.6 here): the paper's schedules (24) and
    1/sqrt(t) are tuned for 20 000 rounds of a linear model, not 3 rounds of a CNN."""
    from fedpdm_flower.strategies.iadmm import DPIADMM

    return DPIADMM(min_available_nodes=int(rc["min-nodes"]), local_updates=int(rc["local-steps"]), rho=0.2, eta=3.0,
                   privacy=target(rc))


#: algorithm key -> (strategy builder, client class); other families add their entry here
ALGORITHMS: dict[str, tuple[Callable[[Any], Any], type[Any]]] = {
    "bsdp-fedpdm": (bsdp_fedpdm, FedPDMClient),
    "dp-iadmm": (objpm, IADMMClient),
}


def pick(rc: Any) -> tuple[Callable[[Any], Any], type[Any]]:
    """The run config's algorithm, or a clear error listing the keys."""
    key = str(rc["algorithm"])
    if key not in ALGORITHMS:
        raise ValueError(f"run config 'algorithm' = {key!r}: one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[key]
