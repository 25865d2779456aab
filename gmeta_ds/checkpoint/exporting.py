"""Export: a checkpoint as one safetensors file of the unsharded model (no DeepSpeed needed)."""
from __future__ import annotations

from pathlib import Path

import torch

from gmeta_ds.algorithms.base import EMBEDDING_PREFIX
from gmeta_ds.checkpoint.manifest import read_manifest
from gmeta_ds.engine.ds_engine import save_weights
from gmeta_ds.errors import ConfigError


def _export_dynamic(name: str, files: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A dynamic table's `DynamicRows` state from every rank's file: the admitted ids (sorted)
    with their rows, and each rank's default row."""
    ids = torch.cat([f[f"table.{name}.ids"] for f in files])
    rows = torch.cat([f[f"table.{name}.rows"] for f in files])
    order = torch.argsort(ids)
    key = f"{EMBEDDING_PREFIX}dynamic.{name}"
    return {f"{key}.ids": ids[order], f"{key}.rows": rows[order],
            f"{key}.defaults": torch.cat([f[f"dynamic.{name}.default"] for f in files])}


def export(ckpt: Path, out: Path) -> Path:
    """One safetensors file with the dense weights and every full table, under the names of the
    unsharded model (loads without DeepSpeed or a process group)."""
    from safetensors.torch import load_file

    manifest = read_manifest(ckpt)
    state = load_file(str(ckpt / "dense.safetensors"))
    files = [load_file(str(ckpt / f"rank{r:05d}.safetensors")) for r in range(manifest["world_size"])]
    for name, (rows, dim) in manifest.get("tables", {}).items():
        if rows == "dynamic":
            state.update(_export_dynamic(name, files))
            continue
        table = torch.empty(rows, dim)
        seen = torch.zeros(rows, dtype=torch.bool)
        for f in files:
            ids = f[f"table.{name}.ids"]
            table[ids] = f[f"table.{name}.rows"]
            seen[ids] = True
        if not bool(seen.all()):
            raise ConfigError([f"{ckpt}: table {name!r} is missing rows"])
        state[f"{EMBEDDING_PREFIX}weights.{name}"] = table
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_weights(state, out)
