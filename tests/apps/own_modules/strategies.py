"""The user's own `strategies` module: it builds the library's strategy (a name the library must not shadow)."""

from __future__ import annotations

from fedpdm_flower.fedapp.compression import TopK
from fedpdm_flower.strategies.fedpdm import BSDPFedPDM


def make_strategy() -> BSDPFedPDM:
    return BSDPFedPDM(privacy=None, fraction_train=1.0, min_available_nodes=3, rho=0.1, gamma=0.0, eta0=0.2,
                      uplink=TopK(0.5), downlink=TopK(0.75))
