"""A Flower user's app for the parity test: the user's model, data, train / evaluate and main live only here."""
