"""Row-wise sharding: every rank owns a slice of a table's rows, by ``modulo`` (row i on rank
i % W, local row i // W) or contiguous ``block`` (ceil(rows / W) rows per rank).

input_dist sends each distinct id to its owner through the lookup's `RowExchange` (one
all-to-all per group of tables); the owner's rows come back with a sparse gradient that
backward returns to the owner summed over ranks. The base of the other strategies whose rows
live on one owner each (table-wise, dynamic, pooled on the owner).
"""
from __future__ import annotations

import torch
from torch import Tensor

from gmeta_ds.embedding.optim import ROW_UPDATES, fast_update
from gmeta_ds.embedding.sharding.base import Request, Sharding


class RowWise(Sharding):
    """Tables whose rows are spread over every rank."""

    def input_dist(self, name: str, request: Request, exchange) -> None:
        """Each id to its owner, as its local row there (the table's layout routes it)."""
        ids = request.ids.to(self.ctx.table_device[name])
        exchange.add(self, name, ids, *self.layout(name).route(ids))

    def finish_gradients(self, leave: frozenset) -> None:
        """Rows arrived summed over ranks: divide by the world size."""
        for name in self.names:
            p = self.ctx.shards[name]
            if p.grad is not None and name not in leave:
                p.grad = p.grad.coalesce() / self.ctx.world

    def direct_update(self, name: str) -> str | None:
        how = fast_update(self.ctx.optimizers[name], self.ctx.shards[name])
        return how if how in ROW_UPDATES else None

    def checksum(self, name: str) -> tuple[float, ...]:
        """Every row lives on one rank: the shard's sum."""
        return (self.ctx.shards[name].detach().double().sum().item(),)

    def gather_table(self, name: str, everywhere: bool) -> Tensor | None:
        """Each rank's shard padded to the largest, gathered in one call, and put back in
        global row order."""
        p, layout, ctx = self.ctx.plan.tables[name], self.layout(name), self.ctx
        shard = ctx.shards[name]
        if ctx.world == 1:
            return shard.detach().cpu().clone()
        width = max(layout.local_rows(r) for r in range(ctx.world))
        padded = torch.zeros(width, p.table.dim, device=shard.device)
        padded[: shard.shape[0]] = shard.detach()
        bucket = ctx.gather(padded, everywhere, name)
        if bucket is None:
            return None
        table = torch.empty(p.table.num_rows, p.table.dim)
        for r in range(ctx.world):
            ids = layout.global_ids(r)
            table[ids] = bucket[r][: len(ids)].cpu()
        return table
