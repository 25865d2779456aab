"""A table's checkpoint entries, as every strategy writes them (`Sharding.state`) and reads them
back at any world size or plan (`Sharding.load_state`).

Per table, in each rank's file (flat names, safetensors): ``table.<name>.ids`` (the global ids
of the rows saved, int64), ``table.<name>.rows`` (those rows, in the same order),
``table.<name>.row_state.<key>`` (the sparse optimizer's per-row state, same order) and
``table.<name>.scalar_state.<key>`` (its scalars, e.g. a step count, as one float64). A table
with a fixed vocabulary saves the rows its layout gives the rank (`TableLayout.global_ids`) and
loads each of its rows from whichever file holds that id; a dynamic table adds
``dynamic.<name>.*`` entries (its strategy's, `sharding.dynamic`). Example, 5 rows saved by 2
ranks row-wise modulo: rank 0's file holds ids [0, 2, 4], rank 1's [1, 3]; a world-1 load
takes rows 0, 2, 4 from the first file and 1, 3 from the second.
"""
from __future__ import annotations

import torch
from torch import Tensor

from gmeta_ds.errors import ConfigError


def optimizer_state(name: str, shard: Tensor, optimizer: torch.optim.Optimizer
                    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A table's sparse-optimizer state: ({key: per-row tensor}, {``table.<name>.scalar_state.<key>``:
    its value as a float64 tensor})."""
    per_row, scalars = {}, {}
    for key, value in optimizer.state.get(shard, {}).items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == shard.shape[0]:
            per_row[key] = value.detach()
        elif value is not None:
            scalars[f"table.{name}.scalar_state.{key}"] = torch.tensor([float(value)], dtype=torch.float64)
    return per_row, scalars


def restore_scalars(state: dict, name: str, files: list[dict[str, Tensor]]) -> None:
    """Lazy optimizers count steps per shard; after resharding take the largest."""
    scalar_state: dict[str, float] = {}
    prefix = f"table.{name}.scalar_state."
    for f in files:
        for key in [k for k in f if k.startswith(prefix)]:
            short = key[len(prefix):]
            scalar_state[short] = max(scalar_state.get(short, 0.0), float(f[key][0]))
    for key, value in scalar_state.items():
        old = state.get(key)
        if torch.is_tensor(old):
            state[key] = torch.tensor(value, dtype=old.dtype, device=old.device)
        elif isinstance(old, int) or key == "step":  # a lazy optimizer's counter (SparseAdam's int step)
            state[key] = int(value)
        else:
            state[key] = torch.tensor(value)


def rows_state(name: str, ids: Tensor, shard: Tensor, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The entries of a shard whose rows are the global ids ``ids``, in local order."""
    out = {f"table.{name}.ids": ids.to(torch.int64), f"table.{name}.rows": shard.detach().cpu().clone()}
    per_row, scalars = optimizer_state(name, shard, optimizer)
    out.update({f"table.{name}.row_state.{k}": v.cpu().clone() for k, v in per_row.items()})
    out.update(scalars)
    return out


def load_rows(name: str, num_rows: int, mine: Tensor, shard: Tensor, optimizer: torch.optim.Optimizer,
              files: list[dict[str, Tensor]]) -> None:
    """Fill a shard holding the global ids ``mine`` (of a table of ``num_rows`` rows) and its
    optimizer state from every saved rank's file: each row from the file that holds its id."""
    position = torch.full((num_rows,), -1, dtype=torch.int64)
    position[mine] = torch.arange(len(mine))
    rows = torch.empty_like(shard.data)
    filled = torch.zeros(len(mine), dtype=torch.bool)
    row_state: dict[str, Tensor] = {}
    for f in files:
        ids, saved = _saved_rows(name, num_rows, shard, f)
        where = position[ids]
        keep = where >= 0
        rows[where[keep]] = saved[keep]
        filled[where[keep]] = True
        prefix = f"table.{name}.row_state."
        for key in [k for k in f if k.startswith(prefix)]:
            value = f[key]
            state = row_state.setdefault(key[len(prefix):], torch.zeros((len(mine), *value.shape[1:]),
                                                                      dtype=value.dtype))
            state[where[keep]] = value[keep]
    if not bool(filled.all()):
        raise ConfigError([f"checkpoint is missing {int((~filled).sum())} row(s) of table {name!r}"])
    with torch.no_grad():
        shard.copy_(rows)
    state = optimizer.state[shard]
    for key, value in row_state.items():
        state[key] = value.to(shard.device)
    restore_scalars(state, name, files)


def _saved_rows(name: str, num_rows: int, shard: Tensor, f: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """One file's (ids, rows) of a static table, checked against the table the config builds."""
    if f"table.{name}.ids" not in f:
        raise ConfigError([f"checkpoint has no embedding table {name!r}"])
    if f"dynamic.{name}.default" in f:
        raise ConfigError([(f"checkpoint table {name!r} is dynamic; the config makes it static "
                           f"(set embedding.tables.{name}.kind: dynamic to resume it)")])
    ids = f[f"table.{name}.ids"]
    saved = f[f"table.{name}.rows"]
    if saved.shape[1:] != shard.shape[1:] or (len(ids) and int(ids.max()) >= num_rows):
        raise ConfigError([(f"checkpoint table {name!r} has rows of shape {tuple(saved.shape[1:])} "
                           f"and ids up to {int(ids.max()) if len(ids) else -1}; the config "
                           f"builds {num_rows} x {shard.shape[1]}")])
    return ids, saved
