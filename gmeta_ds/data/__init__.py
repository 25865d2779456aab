"""Tasks: storage, batching, sampling, synthetic data."""
