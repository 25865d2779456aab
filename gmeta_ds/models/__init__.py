"""Single-device models."""
