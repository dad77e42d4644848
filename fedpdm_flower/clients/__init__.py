"""Client side of each algorithm: one NumPyClient subclass per paper / baseline."""
