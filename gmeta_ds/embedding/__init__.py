"""Embedding tables: unsharded twin, sharding plans, sharded collection, sparse optimizers."""
