"""Resuming: DeepSpeed's dense state (or its universal conversion), the embedding rows
resharded to this world size, and the RNG states at the saving world size."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from gmeta_ds.checkpoint.rows import set_rng_state, load_shard_state
from gmeta_ds.errors import ConfigError


def load(ckpt: Path, manifest: dict, engine, sharded, universal: Path | None = None) -> dict:
    """Restore dense state (DeepSpeed; from ``universal`` when the world size changed under
    ZeRO-1/2), embedding rows and optimizer state (resharded), RNG; ``manifest`` is what
    `verify` returned for ``ckpt`` (call it first: nothing here re-checks the files). Returns
    the manifest with ``optimizer_restored`` (step and loader position inside)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    same_world = manifest["world_size"] == world
    stage = engine.zero_optimization_stage()
    # ZeRO-1/2 optimizer partitions load directly only at the world size that wrote them;
    # elsewhere from the universal conversion (or weights only without it).
    load_optimizer = same_world or stage == 0 or universal is not None
    source = universal if (universal is not None and not same_world) else ckpt
    path, _ = engine.load_checkpoint(str(source.parent), tag=source.name,
                                     load_optimizer_states=load_optimizer,
                                     load_module_only=not load_optimizer)
    if path is None:
        raise ConfigError([f"{ckpt}: DeepSpeed found no checkpoint to load"])
    files = rank_files(ckpt, manifest)
    if sharded is not None:
        load_shard_state(sharded, files)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if same_world:
        set_rng_state(files[rank])
    manifest["optimizer_restored"] = load_optimizer
    return manifest



def rank_files(ckpt: Path, manifest: dict) -> list[dict]:
    """Every saving rank's ``rankNNNNN.safetensors`` of ``ckpt`` (verified first: `verify`)."""
    from safetensors.torch import load_file

    return [load_file(str(ckpt / f"rank{r:05d}.safetensors")) for r in range(manifest["world_size"])]
