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
from gmeta_ds.embedding.plan import modulo
from gmeta_ds.embedding.sharding.base import Request, Sharding


class RowWise(Sharding):
    """Tables whose rows are spread over every rank."""

    def route(self, name: str, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(owner rank, local row) of each global id of table ``name``."""
        p = self.ctx.plan.tables[name]
        if p.row_owner == "modulo":
            return modulo(ids, self.ctx.world)
        return ids // p.block, ids % p.block

    def input_dist(self, name: str, request: Request, exchange) -> None:
        ids = request.ids.to(self.ctx.table_device[name])
        exchange.add(self, name, ids, *self.route(name, ids))

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
        p, ctx = self.ctx.plan.tables[name], self.ctx
        shard = ctx.shards[name]
        if ctx.world == 1:
            return shard.detach().cpu().clone()
        width = max(p.local_rows(r) for r in range(ctx.world))
        padded = torch.zeros(width, p.table.dim, device=shard.device)
        padded[: shard.shape[0]] = shard.detach()
        bucket = ctx.gather(padded, everywhere, name)
        if bucket is None:
            return None
        table = torch.empty(p.table.num_rows, p.table.dim)
        for r in range(ctx.world):
            ids = p.global_ids(r)
            table[ids] = bucket[r][: len(ids)].cpu()
        return table
