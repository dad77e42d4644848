"""Differential privacy: record-level DP-SGD and the one target type (``PrivacyTarget``), the Gaussian mechanism with
the paper's calibration, the Laplace mechanism, the distributed Skellam mechanism, accountants."""

from typing import TYPE_CHECKING

from fedpdm_flower.fedapp.lazy import lazy_exports

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.privacy.accountants import (
        PrivacyLedger as PrivacyLedger,
    )
    from fedpdm_flower.fedapp.privacy.dpsgd import (
        DPSGDLedger as DPSGDLedger,
    )
    from fedpdm_flower.fedapp.privacy.dpsgd import (
        DPSGDMechanism as DPSGDMechanism,
    )
    from fedpdm_flower.fedapp.privacy.dpsgd import (
        DPSGDStep as DPSGDStep,
    )
    from fedpdm_flower.fedapp.privacy.gaussian import (
        Eq36Calibration as Eq36Calibration,
    )
    from fedpdm_flower.fedapp.privacy.gaussian import (
        GaussianTarget as GaussianTarget,
    )
    from fedpdm_flower.fedapp.privacy.gaussian import (
        add_gaussian_noise as add_gaussian_noise,
    )
    from fedpdm_flower.fedapp.privacy.gaussian import (
        data_fraction as data_fraction,
    )
    from fedpdm_flower.fedapp.privacy.gaussian import (
        fedpdm_sensitivity as fedpdm_sensitivity,
    )
    from fedpdm_flower.fedapp.privacy.gaussian import (
        gaussian_noise_std as gaussian_noise_std,
    )
    from fedpdm_flower.fedapp.privacy.gaussian import (
        local_sgd_sensitivity as local_sgd_sensitivity,
    )
    from fedpdm_flower.fedapp.privacy.gaussian import (
        per_round_epsilon_eq36 as per_round_epsilon_eq36,
    )
    from fedpdm_flower.fedapp.privacy.gaussian import (
        total_privacy_eq36 as total_privacy_eq36,
    )
    from fedpdm_flower.fedapp.privacy.laplace import (
        advanced_composition as advanced_composition,
    )
    from fedpdm_flower.fedapp.privacy.laplace import (
        basic_composition as basic_composition,
    )
    from fedpdm_flower.fedapp.privacy.laplace import (
        laplace_noise as laplace_noise,
    )
    from fedpdm_flower.fedapp.privacy.laplace import (
        laplace_scale as laplace_scale,
    )
    from fedpdm_flower.fedapp.privacy.protocol import (
        SkellamAccountant as SkellamAccountant,
    )
    from fedpdm_flower.fedapp.privacy.protocol import (
        SkellamPrivacyEvent as SkellamPrivacyEvent,
    )
    from fedpdm_flower.fedapp.privacy.target import (
        PrivacyNotChosen as PrivacyNotChosen,
    )
    from fedpdm_flower.fedapp.privacy.target import (
        PrivacyTarget as PrivacyTarget,
    )

__getattr__, __all__ = lazy_exports(__name__, {
    "accountants": ["PrivacyLedger"],
    "dpsgd": ["DPSGDLedger", "DPSGDMechanism", "DPSGDStep"],
    "gaussian": ["Eq36Calibration", "GaussianTarget", "add_gaussian_noise", "data_fraction", "fedpdm_sensitivity", "gaussian_noise_std",
                 "local_sgd_sensitivity", "per_round_epsilon_eq36", "total_privacy_eq36"],
    "laplace": ["advanced_composition", "basic_composition", "laplace_noise", "laplace_scale"],
    "protocol": ["SkellamAccountant", "SkellamPrivacyEvent"],
    "target": ["PrivacyNotChosen", "PrivacyTarget"],
})
