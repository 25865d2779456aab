"""Per-rank state: each rank's embedding rows by global id with their sparse-optimizer state
and RNG states, and their reloading at any world size or plan (resharding)."""
from __future__ import annotations

import numpy as np
import torch

from gmeta_ds.errors import ConfigError


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
    """This rank's embedding rows (with global ids) and sparse-optimizer state, flat; dynamic
    tables the rows of their admitted ids, plus their default row and map (`_dynamic_state`)."""
    out: dict[str, torch.Tensor] = {}
    if sharded is None:
        return out
    for name, param in sharded.shards.items():
        plan = sharded.plan.tables[name]
        if plan.kind == "dynamic":
            out.update(_dynamic_state(sharded, name))
            continue
        out[f"table.{name}.ids"] = plan.global_ids(sharded.rank).to(torch.int64)
        out[f"table.{name}.rows"] = param.detach().cpu().clone()
        per_row, scalars = _optimizer_state(sharded, name)
        out.update({f"table.{name}.row_state.{k}": v.cpu().clone() for k, v in per_row.items()})
        out.update(scalars)
    return out


def _optimizer_state(sharded, name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A table's sparse-optimizer state: ({key: per-row tensor}, {``table.<name>.scalar_state.<key>``:
    its value as a float64 tensor})."""
    param = sharded.shards[name]
    per_row, scalars = {}, {}
    for key, value in sharded.optimizers[name].state.get(param, {}).items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == param.shape[0]:
            per_row[key] = value.detach()
        elif value is not None:
            scalars[f"table.{name}.scalar_state.{key}"] = torch.tensor([float(value)], dtype=torch.float64)
    return per_row, scalars


def _dynamic_state(sharded, name: str) -> dict[str, torch.Tensor]:
    """A dynamic table's admitted ids with their rows and optimizer state (``table.<name>.*``,
    as static tables), its default row (``dynamic.<name>.default*``) and its map: rows, last
    use, uses, clock, counters and admission sketch (``dynamic.<name>.*``)."""
    param, index = sharded.shards[name], sharded.dynamic[name]
    slots = index.rows
    out = {f"table.{name}.ids": index.keys.cpu().clone(),
           f"table.{name}.rows": param.detach()[slots].cpu(),
           f"dynamic.{name}.default": param.detach()[:1].cpu()}
    per_row, scalars = _optimizer_state(sharded, name)
    for key, value in per_row.items():
        out[f"table.{name}.row_state.{key}"] = value[slots].cpu()
        out[f"dynamic.{name}.default_state.{key}"] = value[:1].cpu()
    out.update(scalars)
    out.update({f"dynamic.{name}.{k}": v.cpu() for k, v in index.state().items() if k != "ids"})
    out[f"dynamic.{name}.capacity"] = torch.tensor([index.capacity])
    return out


def _load_dynamic(sharded, name: str, files: list[dict[str, torch.Tensor]]) -> None:
    """Refill a dynamic table from every saved rank: this rank takes the ids it owns at its
    world size. At the saving world size and capacity everything comes back as it was (rows,
    map, sketch, counters); elsewhere ids get rows in order (the most recently or frequently
    used kept if they exceed the capacity), the default row and its optimizer state are the
    mean of the saved ones, the sketches (same capacity) are summed and counters restart."""
    param, index = sharded.shards[name], sharded.dynamic[name]
    _check_dynamic_files(name, sharded.plan.tables[name].table.dim, files)
    same = (len(files) == sharded.world and
            all(int(f[f"dynamic.{name}.capacity"][0]) == index.capacity for f in files))
    own = files[sharded.rank] if same else None
    joined, states = _owned_entries(sharded, name, files)
    kept = _restore_map(index, name, files, joined, own).cpu()
    default = own[f"dynamic.{name}.default"] if same else torch.stack(
        [f[f"dynamic.{name}.default"] for f in files]).mean(0)
    with torch.no_grad():
        param.zero_()
        param[:1] = default.to(param.device)
        param[index.rows] = joined["rows"][kept].to(param.device)
    state = sharded.optimizers[name].state[param]
    _restore_dynamic_row_state(state, param, index, name, files, states, kept, sharded.rank if same else None)
    _restore_scalars(state, name, files)


def _check_dynamic_files(name: str, dim: int, files: list[dict[str, torch.Tensor]]) -> None:
    """Every saved rank holds ``name`` as a dynamic table with rows of dimension ``dim``."""
    for f in files:
        if f"dynamic.{name}.default" not in f:
            raise ConfigError([f"checkpoint table {name!r} is not dynamic; the config makes it "
                               f"dynamic (embedding.tables.{name}.kind)"])
        if f[f"dynamic.{name}.default"].shape[1] != dim:
            raise ConfigError([f"checkpoint table {name!r} has rows of dimension "
                               f"{f[f'dynamic.{name}.default'].shape[1]}; the config builds {dim}"])


def _owned_entries(sharded, name: str, files: list[dict[str, torch.Tensor]]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
    """The saved entries of the ids this rank owns at its world size, in file order: ({ids,
    rows, last_used, uses, slots: one tensor each}, {``table.<name>.row_state.<key>``: its
    per-file parts})."""
    from gmeta_ds.embedding.dynamic import owner_of

    parts = {k: [] for k in ("ids", "rows", "last_used", "uses", "slots")}
    state_keys = sorted({k for f in files for k in f if k.startswith(f"table.{name}.row_state.")})
    states = {k: [] for k in state_keys}
    for f in files:
        ids = f[f"table.{name}.ids"]
        mine = owner_of(ids, sharded.world) == sharded.rank
        parts["ids"].append(ids[mine])
        parts["rows"].append(f[f"table.{name}.rows"][mine])
        parts["last_used"].append(f[f"dynamic.{name}.last_used"][mine])
        parts["uses"].append(f[f"dynamic.{name}.uses"][mine])
        parts["slots"].append(f[f"dynamic.{name}.rows"][mine])
        for k in state_keys:
            states[k].append(f[k][mine])
    return {k: torch.cat(v) for k, v in parts.items()}, states


def _restore_map(index, name: str, files: list[dict[str, torch.Tensor]], joined: dict[str, torch.Tensor],
                 own: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """Rebuild the table's map from ``joined``; returns the positions in ``joined`` that were
    kept. ``own`` is this rank's saved file when the world size and capacity are unchanged
    (slots, counters and sketch as saved), else None (slots anew, counters restart, the
    sketches of the same shape summed)."""
    key = lambda k: f"dynamic.{name}.{k}"  # noqa: E731
    same = own is not None
    counters = ({k: int(v) for k, v in zip(sorted(index.counters), own[key("counters")].tolist())}
                if same else {k: 0 for k in index.counters})
    sketch = own.get(key("sketch")) if same else None
    if not same and index.sketch is not None:
        saved = [f[key("sketch")] for f in files if key("sketch") in f]
        if saved and all(s.shape == index.sketch.shape for s in saved):
            sketch = torch.stack(saved).sum(0).clamp(max=2**31 - 1).int()
    device = index.keys.device
    return index.restore(joined["ids"].to(device), joined["slots"].to(device) if same else None,
                         joined["last_used"].to(device), joined["uses"].to(device),
                         max(int(f[key("clock")][0]) for f in files),
                         sketch.to(device) if sketch is not None else None, counters)


def _restore_dynamic_row_state(state: dict, param: torch.Tensor, index, name: str,
                               files: list[dict[str, torch.Tensor]], states: dict[str, list[torch.Tensor]],
                               kept: torch.Tensor, own_rank: int | None) -> None:
    """The sparse optimizer's per-row state of a dynamic table: the default row's from
    ``files[own_rank]`` (the mean of the saved ones when ``own_rank`` is None, i.e. resharded),
    the kept ids' at their new rows, zeros elsewhere."""
    for k, parts in states.items():
        short = k[len(f"table.{name}.row_state."):]
        saved_default = [f[f"dynamic.{name}.default_state.{short}"] for f in files]
        value = torch.zeros((param.shape[0], *saved_default[0].shape[1:]), dtype=saved_default[0].dtype)
        value[:1] = saved_default[own_rank] if own_rank is not None else torch.stack(saved_default).mean(0)
        value[index.rows.cpu()] = torch.cat(parts)[kept]
        state[short] = value.to(param.device)


def _restore_scalars(state: dict, name: str, files: list[dict[str, torch.Tensor]]) -> None:
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


def load_shard_state(sharded, files: list[dict[str, torch.Tensor]]) -> None:
    """Fill this rank's rows and optimizer state from every saved rank's file (any old world
    size or plan): each row comes from the file that holds its global id."""
    for name, param in sharded.shards.items():
        plan = sharded.plan.tables[name]
        if plan.kind == "dynamic":
            _load_dynamic(sharded, name, files)
            continue
        mine = plan.global_ids(sharded.rank)
        position = torch.full((plan.table.num_rows,), -1, dtype=torch.int64)
        position[mine] = torch.arange(len(mine))
        rows = torch.empty_like(param.data)
        filled = torch.zeros(len(mine), dtype=torch.bool)
        row_state: dict[str, torch.Tensor] = {}
        for f in files:
            if f"table.{name}.ids" not in f:
                raise ConfigError([f"checkpoint has no embedding table {name!r}"])
            if f"dynamic.{name}.default" in f:
                raise ConfigError([f"checkpoint table {name!r} is dynamic; the config makes it static "
                                   f"(set embedding.tables.{name}.kind: dynamic to resume it)"])
            ids = f[f"table.{name}.ids"]
            saved = f[f"table.{name}.rows"]
            if saved.shape[1:] != param.shape[1:] or (len(ids) and int(ids.max()) >= plan.table.num_rows):
                raise ConfigError([f"checkpoint table {name!r} has rows of shape {tuple(saved.shape[1:])} "
                                   f"and ids up to {int(ids.max()) if len(ids) else -1}; the config "
                                   f"builds {plan.table.num_rows} x {plan.table.dim}"])
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
            param.copy_(rows)
        optimizer = sharded.optimizers[name]
        state = optimizer.state[param]
        for key, value in row_state.items():
            state[key] = value.to(param.device)
        _restore_scalars(state, name, files)
