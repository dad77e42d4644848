"""Experiment drivers, paper-figure definitions, sweeps and benchmarks."""
