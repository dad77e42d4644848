"""A user's app: their own CNN, MNIST loading and evaluation; our FedREP strategy and client."""
