"""The row exchange of one lookup: one all-to-all per group of tables, whatever their strategy.

Strategies whose rows live on owner ranks (row-wise, table-wise, dynamic) add each table's
request to the `RowExchange` of the lookup (`Sharding.input_dist`: the ids, each id's owner and
local row, and, for dynamic tables, its occurrences). `RowExchange.rows` then runs, for each
group of tables of one dimension, placement and process group (support and query ids of a
micro-batch together):

1. input_dist — the ids bucketed by (owner rank, table); one all-to-all of the per-(rank, table)
   counts and one of the ids (with their occurrences when a table of the group counts them);
2. lookup — each owner asks each table's strategy for its rows (`Sharding.lookup`: dynamic
   tables map ids to rows first, admitting and evicting);
3. output_dist — rows go back by one all-to-all, in request order.

Backward sends row gradients to their owners (the reverse all-to-all, one call per group),
where they arrive as sparse gradients of the shard. World size 1 issues no collectives. On a
plan whose row exchange is hierarchical, groups without occurrence counts on the default group
go through the host's gateways instead (`hierarchical_rows`: each distinct id a host asks for
crosses hosts once).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from gmeta_ds.embedding.comm import all_to_all
from gmeta_ds.embedding.sharding.base import ShardContext, Sharding
from gmeta_ds.embedding.sharding.hierarchical_rows import applies, hierarchical_rows


class Routed(NamedTuple):
    """One table's ids (on its device) with each id's owner rank, local row and occurrences."""

    strategy: Sharding
    ids: Tensor
    owners: Tensor
    local: Tensor
    counts: Tensor | None


class RowExchange:
    """The tables of one lookup whose rows travel to their requesters, grouped by (dimension,
    placement, process group); `rows` runs one exchange per group."""

    def __init__(self, ctx: ShardContext):
        self.ctx = ctx
        self.groups: dict[tuple, dict[str, Routed]] = {}

    def add(self, strategy: Sharding, name: str, ids: Tensor, owners: Tensor, local: Tensor,
            counts: Tensor | None = None) -> None:
        """Table ``name``'s ``ids`` go to ``owners``, where ``strategy.lookup`` reads ``local``."""
        ctx = self.ctx
        key = (ctx.plan.tables[name].table.dim, str(ctx.table_device[name]), id(ctx.groups[name]))
        self.groups.setdefault(key, {})[name] = Routed(strategy, ids, owners, local, counts)

    def rows(self) -> dict[str, Tensor]:
        """Rows of every added table's ids, in request order, on each table's device."""
        out = {}
        for tables in self.groups.values():
            out.update(self._group_rows(tables))
        return out

    def _group_rows(self, tables: dict[str, Routed]) -> dict[str, Tensor]:
        """input_dist -> lookup -> output_dist for tables of one dimension and group."""
        names, world = list(tables), self.ctx.world
        n_tables, device = len(names), self.ctx.table_device[names[0]]
        routed = list(tables.values())
        table_of = torch.cat([torch.full((len(r.ids),), t, device=device) for t, r in enumerate(routed)])
        owners = torch.cat([r.owners for r in routed])
        local = torch.cat([r.local for r in routed])
        counts = None
        if any(r.counts is not None for r in routed):  # occurrences travel with the ids
            counts = torch.cat([r.counts if r.counts is not None else torch.ones_like(r.ids) for r in routed])
        order = torch.argsort(owners * n_tables + table_of, stable=True)
        per_owner = torch.bincount(owners * n_tables + table_of, minlength=world * n_tables)
        sent_counts = counts[order] if counts is not None else None
        if world == 1:
            fetched = self._lookup(tables, local[order], table_of[order], sent_counts)
        elif applies(self.ctx, names[0], sent_counts):
            fetched = hierarchical_rows(self.ctx, n_tables, local[order], per_owner,
                                        lambda ids, table: self._lookup(tables, ids, table))
        else:
            fetched = self._exchange(tables, local[order], sent_counts, per_owner)
        rows = fetched[torch.argsort(order)]  # back to request order
        return dict(zip(names, torch.split(rows, [len(r.ids) for r in routed])))

    def _exchange(self, tables: dict[str, Routed], send_ids: Tensor, send_counts: Tensor | None,
                  per_owner: Tensor) -> Tensor:
        ctx = self.ctx
        n_tables, world, link = len(tables), ctx.world, ctx.link(next(iter(tables)))
        recv_per_owner = all_to_all(per_owner, [n_tables] * world, [n_tables] * world,
                                    ctx.stats, ctx.rank, "input_dist", link.group, link.remote)
        send_splits = per_owner.view(world, n_tables).sum(1).tolist()
        recv_splits = recv_per_owner.view(world, n_tables).sum(1).tolist()
        payload = send_ids if send_counts is None else torch.stack([send_ids, send_counts], dim=1)
        received = all_to_all(payload, send_splits, recv_splits, ctx.stats, ctx.rank, "input_dist",
                              link.group, link.remote)
        recv_ids, recv_counts = (received, None) if send_counts is None else received.unbind(1)
        recv_table = torch.repeat_interleave(torch.arange(n_tables, device=received.device).repeat(world),
                                             recv_per_owner)
        rows = self._lookup(tables, recv_ids, recv_table, recv_counts)
        return all_to_all(rows, recv_splits, send_splits, ctx.stats, ctx.rank, "output_dist", link.group,
                          link.remote)

    @staticmethod
    def _lookup(tables: dict[str, Routed], local_ids: Tensor, table_of: Tensor,
                counts: Tensor | None = None) -> Tensor:
        """Rows of local shards for (local id, table) pairs, in the given order, each table's
        from its strategy (`Sharding.lookup`)."""
        picks, parts = [], []
        for t, (name, routed) in enumerate(tables.items()):
            where = torch.nonzero(table_of == t).squeeze(1)
            picks.append(where)
            parts.append(routed.strategy.lookup(name, local_ids[where], None if counts is None else counts[where]))
        rows = torch.cat(parts)
        return rows[torch.argsort(torch.cat(picks))]
