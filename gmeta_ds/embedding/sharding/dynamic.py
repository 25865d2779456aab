"""Dynamic tables (``kind="dynamic"``, `gmeta_ds.embedding.dynamic`): any int64 id, owned by
rank ``mix64(id) % W``, on a shard of ``capacity + 1`` rows per rank (row 0: the default row).

input_dist sends each id with its number of occurrences through the lookup's `RowExchange`;
lookup on the owner maps ids to rows with its `DynamicIndex` first (admitting and evicting);
gradients are row-wise's. State: the rows of admitted ids and every rank's default row
(`gather_state`'s ``dynamic.<table>.*`` entries), no full table.
"""
from __future__ import annotations

import torch
from torch import Tensor

from gmeta_ds.embedding.dynamic import DynamicIndex, default_row, init_dynamic_rows
from gmeta_ds.embedding.sharding.base import Request, ShardContext
from gmeta_ds.embedding.sharding.row_wise import RowWise


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
        """Each id to its owner by hash, with its occurrences (admission counts them)."""
        ids = request.ids.to(self.ctx.table_device[name])
        exchange.add(self, name, ids, self.ctx.plan.tables[name].owners(ids), ids,
                     request.counts.to(self.ctx.table_device[name]))

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
