"""A user's app: their own CNN, MNIST loading and evaluation; our BSDP-FedPDM strategy and client."""
