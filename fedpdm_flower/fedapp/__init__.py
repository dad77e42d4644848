"""Flower app and shared library for the privacy-preserving / communication-efficient FL algorithms."""
