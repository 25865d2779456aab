"""Per-rank state: each rank's embedding rows by global id with their sparse-optimizer state
(written and read by each table's sharding strategy, `Sharding.state` / `load_state`) and RNG
states, and their reloading at any world size or plan (resharding)."""
from __future__ import annotations

import numpy as np
import torch


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch and NumPy RNG states as tensors (``rng.*``), to save with its rows."""
    state = {"rng.torch": torch.get_rng_state()}
    np_state = np.random.get_state()
    state["rng.numpy.keys"] = torch.from_numpy(np_state[1].astype(np.int64))
    state["rng.numpy.pos"] = torch.tensor([np_state[2]], dtype=torch.int64)
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore the RNG states `rng_state` saved."""
    torch.set_rng_state(state["rng.torch"])
    np.random.set_state(("MT19937", state["rng.numpy.keys"].numpy().astype(np.uint32),
                         int(state["rng.numpy.pos"][0]), 0, 0.0))


def table_meta(sharded) -> dict[str, list]:
    """Per table what a checkpoint must match: [rows, dim] (static), ["dynamic", dim]."""
    if sharded is None:
        return {}
    return {n: ["dynamic" if p.kind == "dynamic" else p.table.num_rows, p.table.dim]
            for n, p in sharded.plan.tables.items()}


def shard_state(sharded) -> dict[str, torch.Tensor]:
    """This rank's embedding rows (with global ids) and sparse-optimizer state, flat, as each
    table's strategy writes them (`ShardedEmbeddingCollection.state`; the format:
    `embedding.sharding.state`); {} without sharded tables."""
    return {} if sharded is None else sharded.state()


def load_shard_state(sharded, files: list[dict[str, torch.Tensor]]) -> None:
    """Fill this rank's rows and optimizer state from every saved rank's file (any old world
    size or plan): each table's strategy takes what its layout gives this rank
    (`ShardedEmbeddingCollection.load_state`)."""
    sharded.load_state(files)
