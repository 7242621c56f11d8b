"""Ratchet: recursive self-improvement of deployed model-harness pairs under an HCP contract."""

__version__ = "0.1.0"
