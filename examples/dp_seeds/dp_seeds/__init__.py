"""A user's Flower app trained by the DP seed algorithms of fedpdm-flower at record-level epsilon 8."""
