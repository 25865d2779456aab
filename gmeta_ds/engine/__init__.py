"""Distributed plumbing and the one adapter to DeepSpeed."""
