"""Differential privacy: the Gaussian mechanism with the paper's calibration, and per-client accountants."""

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

__all__ = [
    "PrivacyLedger",
    "add_gaussian_noise",
    "data_fraction",
    "fedpdm_sensitivity",
    "gaussian_noise_std",
    "local_sgd_sensitivity",
    "per_round_epsilon_eq36",
    "total_privacy_eq36",
]
