"""Dynamic tables (``kind="dynamic"``, `gmeta_ds.embedding.dynamic`): any int64 id, owned by
rank ``mix64(id) % W``, on a shard of ``capacity + 1`` rows per rank (row 0: the default row).

input_dist sends each id with its number of occurrences through the lookup's `RowExchange`;
lookup on the owner maps ids to rows with its `DynamicIndex` first (admitting and evicting);
gradients are row-wise's. State: the rows of admitted ids and every rank's default row
(`gather_state`'s ``dynamic.<table>.*`` entries), no full table. Checkpoint (`state`,
`load_state`): the admitted ids' rows and optimizer state as static tables save theirs
(``table.<name>.*``, `sharding.state`), plus the default row, its optimizer state and the map
(``dynamic.<name>.default``, ``.default_state.<key>``, ``.rows``, ``.last_used``, ``.uses``,
``.clock``, ``.counters``, ``.sketch``, ``.capacity``); reloaded at any world size and capacity.
"""
from __future__ import annotations

import torch
from torch import Tensor

from gmeta_ds.embedding.dynamic import DynamicIndex, default_row, init_dynamic_rows, owner_of
from gmeta_ds.embedding.sharding.base import Request, ShardContext
from gmeta_ds.embedding.sharding.row_wise import RowWise
from gmeta_ds.embedding.sharding.state import optimizer_state, restore_scalars
from gmeta_ds.errors import ConfigError


class Dynamic(RowWise):
    """Dynamic tables: a `DynamicIndex` per table (``indexes``) maps the ids this rank owns to rows."""

    counts = True

    def __init__(self, ctx: ShardContext, names: tuple[str, ...]):
        super().__init__(ctx, names)
        self._indexes = {}
        for name in names:
            t = ctx.plan.tables[name].table
            self._indexes[name] = DynamicIndex(name, t.capacity, t.admit_after, t.eviction, ctx.table_device[name])

    @property
    def indexes(self) -> dict[str, DynamicIndex]:
        return self._indexes

    def initial_rows(self, name: str) -> Tensor:
        """Zero rows for ids to come, and the default row (row 0)."""
        t = self.ctx.plan.tables[name].table
        rows = torch.zeros(t.capacity + 1, t.dim)
        rows[0] = default_row(t.name, t.dim, t.init_std, self.ctx.seed)[0]
        return rows

    def input_dist(self, name: str, request: Request, exchange) -> None:
        """Each id to its owner by hash (`layout.HashedIds`: the id itself travels), with its
        occurrences (admission counts them)."""
        ids = request.ids.to(self.ctx.table_device[name])
        exchange.add(self, name, ids, *self.layout(name).route(ids), request.counts.to(self.ctx.table_device[name]))

    def lookup(self, name: str, local: Tensor, counts: Tensor | None) -> Tensor:
        """The rows of the ids (mapped by `admit`)."""
        return super().lookup(name, self.admit(name, local, counts), None)

    def admit(self, name: str, ids: Tensor, counts: Tensor) -> Tensor:
        """Rows of a dynamic table's ids on this owner; rows given to new ids start at their
        initial value with zeroed optimizer state, and lose any gradient pending for the id
        that held them."""
        rows, admitted = self._indexes[name].lookup(ids, counts)
        if len(admitted.slots):
            t, shard = self.ctx.plan.tables[name].table, self.ctx.shards[name]
            with torch.no_grad():
                shard[admitted.slots] = init_dynamic_rows(t.name, t.dim, t.init_std, self.ctx.seed,
                                                          admitted.ids.cpu()).to(shard.device)
            for value in self.ctx.optimizers[name].state.get(shard, {}).values():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == shard.shape[0]:
                    value[admitted.slots] = 0
            if shard.grad is not None and admitted.evicted:
                grad = shard.grad.coalesce()
                keep = ~torch.isin(grad.indices()[0], admitted.slots)
                shard.grad = torch.sparse_coo_tensor(grad.indices()[:, keep], grad.values()[keep],
                                                     shard.shape, check_invariants=False)
        return rows

    def checksum(self, name: str) -> tuple[float, ...]:
        """The rows of admitted ids plus the mean of the ranks' default rows, so a run equals
        its one-process twin whenever their default rows do."""
        rows = self.ctx.shards[name].detach()
        return (rows[self._indexes[name].rows].double().sum().item(),
                rows[0].double().sum().item() / self.ctx.world)

    def gather_table(self, name: str, everywhere: bool) -> None:
        """None: a dynamic table has no fixed vocabulary (its rows are in `gather_state`)."""
        return None

    def gather_state(self, everywhere: bool) -> dict[str, Tensor]:
        """``dynamic.<table>.ids`` (sorted admitted ids), ``.rows`` and ``.defaults`` (every
        rank's default row), on rank 0 or everywhere; collective."""
        state, ctx = {}, self.ctx
        receives = everywhere or ctx.rank == 0
        for name, index in self._indexes.items():
            shard = ctx.shards[name].detach()
            ids, rows = index.keys.cpu(), shard[index.rows].cpu()
            defaults = shard[:1].cpu()
            if ctx.world > 1:
                ids, rows, defaults = self._gather_ragged(name, ids, rows, defaults, everywhere)
                if not receives:
                    continue
            order = torch.argsort(ids)
            state[f"dynamic.{name}.ids"] = ids[order].clone()
            state[f"dynamic.{name}.rows"] = rows[order].clone()
            state[f"dynamic.{name}.defaults"] = defaults.clone()
        return state

    def _gather_ragged(self, name, ids, rows, defaults, everywhere):
        """Every rank's admitted (ids, rows) and default row, concatenated in rank order."""
        ctx = self.ctx
        wire = ctx.shards[name].device  # where the table's collectives take tensors
        sizes = ctx.gather(torch.tensor([len(ids)], device=wire), everywhere, name)
        width = ctx.plan.tables[name].table.capacity
        padded_ids = torch.zeros(width, dtype=torch.long, device=wire)
        padded_ids[: len(ids)] = ids
        padded_rows = torch.zeros(width + 1, rows.shape[1], device=wire)
        padded_rows[: len(ids)] = rows
        padded_rows[width] = defaults[0]
        all_ids = ctx.gather(padded_ids, everywhere, name)
        all_rows = ctx.gather(padded_rows, everywhere, name)
        if all_ids is None:
            return None, None, None
        n = [int(s) for s in torch.cat(sizes).tolist()]
        return (torch.cat([i[:k].cpu() for i, k in zip(all_ids, n)]),
                torch.cat([r[:k].cpu() for r, k in zip(all_rows, n)]),
                torch.stack([r[width].cpu() for r in all_rows]))

    # ------------------------------------------------------------------ checkpoint
    def state(self, name: str) -> dict[str, Tensor]:
        """The admitted ids with their rows and optimizer state (``table.<name>.*``, as static
        tables), the default row (``dynamic.<name>.default*``) and the map: rows, last use,
        uses, clock, counters and admission sketch (``dynamic.<name>.*``)."""
        param, index = self.ctx.shards[name], self._indexes[name]
        slots = index.rows
        out = {f"table.{name}.ids": index.keys.cpu().clone(),
               f"table.{name}.rows": param.detach()[slots].cpu(),
               f"dynamic.{name}.default": param.detach()[:1].cpu()}
        per_row, scalars = optimizer_state(name, param, self.ctx.optimizers[name])
        for key, value in per_row.items():
            out[f"table.{name}.row_state.{key}"] = value[slots].cpu()
            out[f"dynamic.{name}.default_state.{key}"] = value[:1].cpu()
        out.update(scalars)
        out.update({f"dynamic.{name}.{k}": v.cpu() for k, v in index.state().items() if k != "ids"})
        out[f"dynamic.{name}.capacity"] = torch.tensor([index.capacity])
        return out

    def load_state(self, name: str, files: list[dict[str, Tensor]]) -> None:
        """Refill the table from every saved rank: this rank takes the ids it owns at its
        world size. At the saving world size and capacity everything comes back as it was
        (rows, map, sketch, counters); elsewhere ids get rows in order (the most recently or
        frequently used kept if they exceed the capacity), the default row and its optimizer
        state are the mean of the saved ones, the sketches (same capacity) are summed and
        counters restart."""
        ctx = self.ctx
        param, index = ctx.shards[name], self._indexes[name]
        _check_dynamic_files(name, ctx.plan.tables[name].table.dim, files)
        same = (len(files) == ctx.world and
                all(int(f[f"dynamic.{name}.capacity"][0]) == index.capacity for f in files))
        own = files[ctx.rank] if same else None
        joined, states = _owned_entries(name, ctx.rank, ctx.world, files)
        kept = _restore_map(index, name, files, joined, own).cpu()
        default = own[f"dynamic.{name}.default"] if same else torch.stack(
            [f[f"dynamic.{name}.default"] for f in files]).mean(0)
        with torch.no_grad():
            param.zero_()
            param[:1] = default.to(param.device)
            param[index.rows] = joined["rows"][kept].to(param.device)
        state = ctx.optimizers[name].state[param]
        _restore_dynamic_row_state(state, param, index, name, files, states, kept, ctx.rank if same else None)
        restore_scalars(state, name, files)


def _check_dynamic_files(name: str, dim: int, files: list[dict[str, Tensor]]) -> None:
    """Every saved rank holds ``name`` as a dynamic table with rows of dimension ``dim``."""
    for f in files:
        if f"dynamic.{name}.default" not in f:
            raise ConfigError([(f"checkpoint table {name!r} is not dynamic; the config makes it "
                               f"dynamic (embedding.tables.{name}.kind)")])
        if f[f"dynamic.{name}.default"].shape[1] != dim:
            raise ConfigError([(f"checkpoint table {name!r} has rows of dimension "
                               f"{f[f'dynamic.{name}.default'].shape[1]}; the config builds {dim}")])


def _owned_entries(name: str, rank: int, world: int, files: list[dict[str, Tensor]]
                   ) -> tuple[dict[str, Tensor], dict[str, list[Tensor]]]:
    """The saved entries of the ids ``rank`` owns at world size ``world``, in file order: ({ids,
    rows, last_used, uses, slots: one tensor each}, {``table.<name>.row_state.<key>``: its
    per-file parts})."""
    parts = {k: [] for k in ("ids", "rows", "last_used", "uses", "slots")}
    state_keys = sorted({k for f in files for k in f if k.startswith(f"table.{name}.row_state.")})
    states = {k: [] for k in state_keys}
    for f in files:
        ids = f[f"table.{name}.ids"]
        mine = owner_of(ids, world) == rank
        parts["ids"].append(ids[mine])
        parts["rows"].append(f[f"table.{name}.rows"][mine])
        parts["last_used"].append(f[f"dynamic.{name}.last_used"][mine])
        parts["uses"].append(f[f"dynamic.{name}.uses"][mine])
        parts["slots"].append(f[f"dynamic.{name}.rows"][mine])
        for k in state_keys:
            states[k].append(f[k][mine])
    return {k: torch.cat(v) for k, v in parts.items()}, states


def _restore_map(index: DynamicIndex, name: str, files: list[dict[str, Tensor]], joined: dict[str, Tensor],
                 own: dict[str, Tensor] | None) -> Tensor:
    """Rebuild the table's map from ``joined``; returns the positions in ``joined`` that were
    kept. ``own`` is this rank's saved file when the world size and capacity are unchanged
    (slots, counters and sketch as saved), else None (slots anew, counters restart, the
    sketches of the same shape summed)."""
    def key(k: str) -> str:
        return f"dynamic.{name}.{k}"

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


def _restore_dynamic_row_state(state: dict, param: Tensor, index: DynamicIndex, name: str,
                               files: list[dict[str, Tensor]], states: dict[str, list[Tensor]],
                               kept: Tensor, own_rank: int | None) -> None:
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
