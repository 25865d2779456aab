"""The ids of one lookup to their owners and the rows back, whatever the tables' strategies:
what ``input_dist`` and output_dist share.

Requests: each table's ids checked and deduplicated into one `Request` (`table_requests`: one
unique across tables where that is linear), or, for single-hot fields kept as one (N, F)
tensor, deduplicated by one unique of table-offset keys (`FieldTables`, `field_requests`).

The row exchange: strategies whose rows live on owner ranks (row-wise, table-wise, dynamic) add
each table's request to the `RowExchange` of the lookup (`Sharding.input_dist`: the ids, each
id's owner and local row, and, for dynamic tables, its occurrences). `RowExchange.rows` then
runs, for each group of tables of one dimension, placement and process group (support and
query ids of a micro-batch together):

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

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from gmeta_ds.embedding.comm import all_to_all
from gmeta_ds.embedding.sharding.base import Request, ShardContext, Sharding
from gmeta_ds.embedding.sharding.hierarchical_rows import applies, hierarchical_rows
from gmeta_ds.embedding.tables import FLAGS_RATIO, TableConfig, check_ids, unique_keys
from gmeta_ds.sparse import Jagged


@dataclass(frozen=True)
class FieldTables:
    """The tables of `ShardedEmbeddingCollection.lookup_fields`'s single-hot fields, one table
    per field and no two fields (or a field and a bag) on one table. Field c's ids are offset by
    ``base[c]`` (the rows of the tables before it) into one key space of ``total`` rows, so one
    tensor op checks, deduplicates and gathers the ids of every field."""

    tables: tuple[TableConfig, ...]
    num_rows: Tensor  # (F,) rows of each field's table
    base: Tensor      # (F,) first key of each field's table
    bounds: Tensor    # (F + 1,) base, then total
    total: int

    @staticmethod
    def of(by_feature: dict[str, TableConfig], fields: tuple[str, ...],
           bags: tuple[str, ...], apart: frozenset = frozenset()) -> FieldTables | None:
        """The layout of single-hot ``fields`` next to multi-hot ``bags``, or None where the
        fused lookup does not apply: no fields, an unknown feature, a table serving two of them,
        a table in ``apart`` (dynamic: its ids are counted; pooled on its owner), or tables of
        different dimensions."""
        if not fields or any(f not in by_feature for f in fields + bags):
            return None
        tables = tuple(by_feature[f] for f in fields)
        if apart & {t.name for t in tables}:
            return None
        names = {t.name for t in tables}
        if len(names) < len(fields) or names & {by_feature[b].name for b in bags} or \
                len({t.dim for t in tables}) > 1:
            return None
        num_rows = torch.tensor([t.num_rows for t in tables])
        bounds = torch.cat([torch.zeros(1, dtype=torch.long), num_rows.cumsum(0)])
        return FieldTables(tables, num_rows, bounds[:-1], bounds, int(bounds[-1]))

    def on(self, device: torch.device) -> FieldTables:
        """This layout with its tensors on ``device`` (where the ids are)."""
        if self.num_rows.device == device:
            return self
        return FieldTables(self.tables, self.num_rows.to(device), self.base.to(device),
                           self.bounds.to(device), self.total)


def field_requests(layout: FieldTables, flat: Tensor, dedup: bool) -> tuple[dict[str, Request], Tensor]:
    """Checked single-hot ids ``flat`` (N, F) of ``layout``'s tables -> a `Request` per table
    (ids only) and the (N, F) index of every id into the tables' requested ids, concatenated
    in field order: one unique of table-offset keys with ``dedup``, else every id as asked."""
    if dedup:
        keys, inverse = unique_keys(flat + layout.base, layout.total)
        counts = torch.searchsorted(keys, layout.bounds).diff()
        table_ids = keys - layout.base.repeat_interleave(counts, output_size=len(keys))
        sizes = counts.tolist()
    else:
        n, n_fields = flat.shape
        table_ids = flat.t().reshape(-1)
        inverse = torch.arange(n * n_fields, device=flat.device).view(n_fields, n).t()
        sizes = [n] * n_fields
    names = [t.name for t in layout.tables]
    return {n: Request(i, None) for n, i in zip(names, torch.split(table_ids, sizes))}, inverse


def _requests_of_group(names: list[str], ids: list[Tensor], num_rows: list[int]) -> dict[str, Request]:
    """Per table, what ``torch.unique(ids, return_inverse=True)`` gives, from one unique over
    the tables' ids offset into one key space (`tables.unique_keys`: linear flags over the
    key space, used when the tables are small next to the ids) instead of one sort per table."""
    device = ids[0].device
    sizes = [len(i) for i in ids]
    base = [0]
    for rows in num_rows:
        base.append(base[-1] + rows)
    offset = torch.repeat_interleave(torch.tensor(base[:-1], device=device), torch.tensor(sizes, device=device),
                                     output_size=sum(sizes))
    distinct, inverse = unique_keys(torch.cat(ids) + offset, base[-1], FLAGS_RATIO)
    counts = torch.searchsorted(distinct, torch.tensor(base, device=device)).diff().tolist()
    first = [0]
    for c in counts:
        first.append(first[-1] + c)
    return {name: Request(part - base[t], inv - first[t])
            for t, (name, part, inv) in enumerate(zip(names, torch.split(distinct, counts),
                                                      torch.split(inverse, sizes)))}


def table_requests(ctx: ShardContext, features: dict[str, Jagged], counted: frozenset) -> dict[str, Request]:
    """Per table: the ids to fetch, the index of each value of its features (concatenated)
    into them, and (tables in ``counted``: dynamic) each id's number of occurrences."""
    per_table = defaultdict(list)
    for feature, jagged in features.items():
        table = ctx.by_feature[feature]
        per_table[table.name].append(check_ids(jagged.values, feature, table, ctx.bad_ids))
    out = {}
    static = [name for name in per_table if name not in counted]
    # one unique for the group where it is linear (flags); a sort of all the ids together
    # is slower than one small sort per table
    if ctx.dedup and len(static) > 1 and sum(ctx.plan.tables[n].table.num_rows for n in static) <= \
            FLAGS_RATIO * sum(len(i) for n in static for i in per_table[n]):
        out.update(_requests_of_group(static, [torch.cat(per_table[n]) for n in static],
                                      [ctx.plan.tables[n].table.num_rows for n in static]))
    for name, parts in per_table.items():
        if name in out:
            continue
        ids = torch.cat(parts)
        count = name in counted
        if ctx.dedup:
            out[name] = Request(*torch.unique(ids, return_inverse=True, return_counts=count))
        else:
            out[name] = Request(ids, torch.arange(len(ids), device=ids.device), torch.ones_like(ids) if count else None)
    return out


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
