"""A user's app: their own small CNN, MNIST loading and evaluation; our DPQ-DSGD strategy and nodes over a ring."""
