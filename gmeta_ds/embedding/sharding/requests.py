"""The first half of input_dist, the same for every strategy that looks rows up: each table's
ids checked and deduplicated into one `Request` (`table_requests`), or, for single-hot fields
kept as one (N, F) tensor, deduplicated by one unique of table-offset keys (`FieldTables`,
`field_requests`)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from gmeta_ds.embedding.sharding.base import Request, ShardContext
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
