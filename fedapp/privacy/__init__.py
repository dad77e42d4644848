"""Differential privacy: the Gaussian mechanism with the paper's calibration, the Laplace mechanism, accountants."""

from fedapp.privacy.accountants import PrivacyLedger
from fedapp.privacy.gaussian import (
    add_gaussian_noise,
    data_fraction,
    fedpdm_sensitivity,
    gaussian_noise_std,
    local_sgd_sensitivity,
    per_round_epsilon_eq36,
    total_privacy_eq36,
)
from fedapp.privacy.laplace import advanced_composition, basic_composition, laplace_noise, laplace_scale

__all__ = [
    "PrivacyLedger",
    "add_gaussian_noise",
    "advanced_composition",
    "basic_composition",
    "data_fraction",
    "fedpdm_sensitivity",
    "gaussian_noise_std",
    "laplace_noise",
    "laplace_scale",
    "local_sgd_sensitivity",
    "per_round_epsilon_eq36",
    "total_privacy_eq36",
]
