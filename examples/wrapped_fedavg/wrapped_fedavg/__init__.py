"""A user's Flower app on Flower's own FedAvg, with our wrappers and mods for robust, secure and compressed
aggregation; the model, data and training loop are the user's."""
