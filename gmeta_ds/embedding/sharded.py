"""The sharded twin of `EmbeddingCollection`: rows live on their owner ranks, outside DeepSpeed.

One forward call (support and query ids of a micro-batch together) runs three stages for each
group of same-dimension sharded tables:

1. input_dist — per table, deduplicate the ids, bucket them by owner rank, exchange the
   per-(rank, table) counts and then the ids (two all-to-alls for all tables together);
2. lookup — each owner gathers the requested rows from its local shards;
3. output_dist — rows go back by all-to-all and are scattered to every occurrence through the
   inverse index of the deduplication, then pooled per feature.

Backward sends row gradients to their owners (the reverse all-to-all, one call), where they
arrive as sparse gradients of the shard. `finish_gradients` divides by the world size so a
row's gradient is the mean over ranks, exactly as DeepSpeed averages dense gradients, and
all-reduces the gradients of replicated tables. World size 1 issues no collectives.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gmeta_ds.embedding.comm import CommStats, all_to_all
from gmeta_ds.embedding.optim import build_sparse_optimizer
from gmeta_ds.embedding.plan import ShardingPlan
from gmeta_ds.embedding.tables import (Jagged, TableConfig, check_fields, check_ids, check_width,
                                       feature_tables, init_rows, lookup_fields, pool)


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
           bags: tuple[str, ...]) -> FieldTables | None:
        """The layout of single-hot ``fields`` next to multi-hot ``bags``, or None where the
        fused lookup does not apply: no fields, an unknown feature, a table serving two of them,
        or tables of different dimensions."""
        if not fields or any(f not in by_feature for f in fields + bags):
            return None
        tables = tuple(by_feature[f] for f in fields)
        names = {t.name for t in tables}
        if len(names) < len(fields) or names & {by_feature[b].name for b in bags} or \
                len({t.dim for t in tables}) > 1:
            return None
        num_rows = torch.tensor([t.num_rows for t in tables])
        bounds = torch.cat([torch.zeros(1, dtype=torch.long), num_rows.cumsum(0)])
        return FieldTables(tables, num_rows, bounds[:-1], bounds, int(bounds[-1]))


def unique_keys(keys: Tensor, bound: int) -> tuple[Tensor, Tensor]:
    """``torch.unique(keys, return_inverse=True)`` (sorted) of keys in [0, bound): by marking
    the keys present in a table of ``bound`` flags when that is no larger than ``keys`` (linear
    time, no sort), else by torch's sort."""
    if bound > keys.numel():
        return torch.unique(keys, return_inverse=True)
    flat = keys.reshape(-1)
    present = torch.zeros(bound, dtype=torch.bool).index_fill_(0, flat, True)
    return present.nonzero().squeeze(1), present.cumsum(0).sub_(1).index_select(0, flat).view_as(keys)


class ShardedEmbeddingCollection:
    """Each rank's shards of every table (``shards[name]``: (local rows, dim) parameters).

    Same forward contract as `EmbeddingCollection`:
    ``forward({feature: Jagged}) -> {feature: (N, d) pooled | (nnz, d)}``. Collective: every
    rank must call forward (and later backward) once per micro-batch, with its own ids.
    """

    def __init__(self, plan: ShardingPlan, rank: int, seed: int = 0, bad_ids: str = "error",
                 dedup: bool = True):
        self.plan, self.rank, self.world = plan, rank, plan.world_size
        self.bad_ids, self.dedup = bad_ids, dedup
        tables = [p.table for p in plan.tables.values()]
        self.by_feature = feature_tables(tables)
        self.shards = {name: nn.Parameter(init_rows(p.table, seed, p.global_ids(rank)))
                       for name, p in plan.tables.items()}
        self.optimizers = {name: build_sparse_optimizer(p.table.optimizer, self.shards[name], p.table.lr)
                           for name, p in plan.tables.items()}
        self.stats = CommStats()
        self._field_tables: dict[tuple, FieldTables | None] = {}

    def parameters(self) -> list[nn.Parameter]:
        return list(self.shards.values())

    # ------------------------------------------------------------------ forward
    def __call__(self, features: dict[str, Jagged]) -> dict[str, Tensor]:
        return self.forward(features)

    def forward(self, features: dict[str, Jagged]) -> dict[str, Tensor]:
        requests = self._requests(features)                  # table -> (unique ids, inverse)
        rows = self._rows({name: ids for name, (ids, _) in requests.items()})
        return self._per_feature(features, requests, rows)

    def lookup_fields(self, ids: Tensor, fields: list[str], multi: dict | None = None) -> Tensor:
        """Single-hot ids (..., F) (+ multi-hot bags) -> rows (..., F + M, d) in one fused lookup.

        The rows, gradients, requests and traffic of `tables.lookup_fields` (one `Jagged.single`
        per field through `forward`), bit for bit, with the single-hot fields kept as one (N, F)
        tensor: their ids checked in one op (`check_fields`), every table's request
        deduplicated by one unique of table-offset keys (`FieldTables`), their rows gathered by
        one index. (With several threads the per-field path's accumulating index is not
        deterministic; this one is, and equals its one-thread result.) Bags keep the
        per-feature path; fields sharing a table (with each other or a bag), unknown features
        or tables of different dimensions take `tables.lookup_fields` as a whole.
        """
        multi = multi or {}
        check_width(ids, fields)
        signature = (tuple(fields), tuple(multi))
        if signature not in self._field_tables:
            self._field_tables[signature] = FieldTables.of(self.by_feature, *signature)
        layout = self._field_tables[signature]
        if layout is None:
            return lookup_fields(self, ids, fields, multi)
        flat = check_fields(ids.reshape(-1, len(fields)).long(), fields, layout.tables, layout.num_rows,
                            self.bad_ids)
        if self.dedup:
            keys, inverse = unique_keys(flat + layout.base, layout.total)
            counts = torch.searchsorted(keys, layout.bounds).diff()
            table_ids = keys - layout.base.repeat_interleave(counts, output_size=len(keys))
            sizes = counts.tolist()
        else:
            n = len(flat)
            table_ids = flat.t().reshape(-1)
            inverse = torch.arange(n * len(fields)).view(len(fields), n).t()
            sizes = [n] * len(fields)
        names = [t.name for t in layout.tables]
        bags = self._requests(multi)
        rows = self._rows({**dict(zip(names, torch.split(table_ids, sizes))),
                           **{name: bag_ids for name, (bag_ids, _) in bags.items()}})
        # index_select, not indexing: as fast again, and its backward sums each row's
        # gradients serially in the order of `inverse`, as the per-field indexing does
        out = torch.cat([rows[name] for name in names]).index_select(0, inverse.reshape(-1))
        out = out.view(*inverse.shape, -1)  # (N, F, d)
        if multi:
            pooled = self._per_feature(multi, bags, rows)
            out = torch.cat([out, torch.stack([pooled[f] for f in multi], dim=1)], dim=1)
        return out.reshape(*ids.shape[:-1], out.shape[1], -1)

    def _requests(self, features: dict[str, Jagged]) -> dict[str, tuple[Tensor, Tensor]]:
        """Per table: the ids to fetch (deduplicated unless ``dedup`` is off) and, for the
        concatenated values of its features, the index of each value into those ids."""
        per_table = defaultdict(list)
        for feature, jagged in features.items():
            table = self.by_feature[feature]
            per_table[table.name].append(check_ids(jagged.values, feature, table, self.bad_ids))
        out = {}
        for name, parts in per_table.items():
            ids = torch.cat(parts)
            if self.dedup:
                out[name] = torch.unique(ids, return_inverse=True)
            else:
                out[name] = (ids, torch.arange(len(ids)))
        return out

    def _rows(self, ids: dict[str, Tensor]) -> dict[str, Tensor]:
        """Rows of every table's requested ``ids``: replicated tables looked up locally, sharded
        ones through one exchange per group of same-dimension tables."""
        rows = {name: torch.nn.functional.embedding(i, self.shards[name], sparse=True)
                for name, i in ids.items() if self.plan.tables[name].kind == "replicated"}
        by_dim = defaultdict(list)
        for name in ids:
            if self.plan.tables[name].kind != "replicated":
                by_dim[self.plan.tables[name].table.dim].append(name)
        for names in by_dim.values():
            rows.update(self._sharded_rows(names, {n: ids[n] for n in names}))
        return rows

    def _sharded_rows(self, names: list[str], ids: dict[str, Tensor]) -> dict[str, Tensor]:
        """input_dist -> lookup -> output_dist for tables of one dimension."""
        n_tables = len(names)
        table_of = torch.cat([torch.full((len(ids[n]),), t) for t, n in enumerate(names)])
        owners = torch.cat([self.plan.tables[n].owners(ids[n]) for n in names])
        local = torch.cat([self.plan.tables[n].local_index(ids[n]) for n in names])
        order = torch.argsort(owners * n_tables + table_of, stable=True)
        counts = torch.bincount(owners * n_tables + table_of, minlength=self.world * n_tables)
        if self.world == 1:
            fetched = self._lookup(names, local[order], table_of[order])
        else:
            fetched = self._exchange(names, local[order], counts)
        rows = fetched[torch.argsort(order)]  # back to request order
        sizes = [len(ids[n]) for n in names]
        return dict(zip(names, torch.split(rows, sizes)))

    def _exchange(self, names: list[str], send_ids: Tensor, counts: Tensor) -> Tensor:
        n_tables = len(names)
        recv_counts = all_to_all(counts, [n_tables] * self.world, [n_tables] * self.world,
                                 self.stats, self.rank, "input_dist")
        send_splits = counts.view(self.world, n_tables).sum(1).tolist()
        recv_splits = recv_counts.view(self.world, n_tables).sum(1).tolist()
        recv_ids = all_to_all(send_ids, send_splits, recv_splits, self.stats, self.rank, "input_dist")
        recv_table = torch.repeat_interleave(torch.arange(n_tables).repeat(self.world), recv_counts)
        rows = self._lookup(names, recv_ids, recv_table)
        return all_to_all(rows, recv_splits, send_splits, self.stats, self.rank, "output_dist")

    def _lookup(self, names: list[str], local_ids: Tensor, table_of: Tensor) -> Tensor:
        """Rows of local shards for (local id, table) pairs, in the given order."""
        picks, parts = [], []
        for t, name in enumerate(names):
            where = torch.nonzero(table_of == t).squeeze(1)
            picks.append(where)
            parts.append(torch.nn.functional.embedding(local_ids[where], self.shards[name], sparse=True))
        rows = torch.cat(parts)
        return rows[torch.argsort(torch.cat(picks))]

    def _per_feature(self, features, requests, rows) -> dict[str, Tensor]:
        out, cursor = {}, defaultdict(int)
        for feature, jagged in features.items():
            name = self.by_feature[feature].name
            inverse = requests[name][1]
            start = cursor[name]
            cursor[name] += len(jagged.values)
            values = rows[name][inverse[start:cursor[name]]]
            out[feature] = pool(values, jagged, self.plan.tables[name].table.pooling)
        return out

    # ------------------------------------------------------------------ training
    def finish_gradients(self) -> None:
        """Average row gradients over ranks: sharded rows arrived summed over ranks (divide by
        the world size); replicated tables are all-reduced together in one collective."""
        if self.world == 1:
            return
        replicated = [n for n in self.shards if self.plan.tables[n].kind == "replicated"]
        for name, p in self.shards.items():
            if name not in replicated and p.grad is not None:
                p.grad = p.grad.coalesce() / self.world
        if replicated:
            self._all_reduce_replicated(replicated)

    def _all_reduce_replicated(self, names: list[str]) -> None:
        """One all-reduce of every replicated table's dense gradient plus a touched-row flag
        (so lazy optimizers update exactly the rows some rank used)."""
        parts = []
        for name in names:
            p = self.shards[name]
            grad = p.grad.to_dense() if p.grad is not None else torch.zeros_like(p)
            touched = torch.zeros(p.shape[0], 1)
            if p.grad is not None:
                touched[p.grad.coalesce().indices()[0]] = 1.0
            parts.append(torch.cat([grad, touched], dim=1).reshape(-1))
        flat = torch.cat(parts)
        dist.all_reduce(flat)
        ring = int(2 * (self.world - 1) / self.world * flat.numel() * flat.element_size())
        self.stats.record_bytes("replicated_allreduce", ring, ring)
        for name, chunk in zip(names, torch.split(flat, [t.numel() for t in parts])):
            p = self.shards[name]
            chunk = chunk.view(p.shape[0], p.shape[1] + 1)
            rows = torch.nonzero(chunk[:, -1]).squeeze(1)
            p.grad = None if len(rows) == 0 else torch.sparse_coo_tensor(
                rows.unsqueeze(0), chunk[rows, :-1] / self.world, p.shape, check_invariants=False)

    def step(self) -> None:
        """Average gradients, apply each table's sparse optimizer, clear gradients."""
        self.finish_gradients()
        for name, p in self.shards.items():
            if p.grad is not None:
                self.optimizers[name].step()
            p.grad = None

    def checksum(self) -> float:
        """float64 sum of every table's rows, each row counted once over all ranks."""
        local = sum(p.detach().double().sum().item() for n, p in self.shards.items()
                    if self.plan.tables[n].kind != "replicated" or self.rank == 0)
        total = torch.tensor(local, dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(total)
        return total.item()

    def gather_tables(self, everywhere: bool = False) -> dict[str, Tensor]:
        """Full tables on rank 0 (every rank with ``everywhere``; {} elsewhere); collective."""
        full = {}
        for name, p in self.shards.items():
            plan = self.plan.tables[name]
            if plan.kind == "replicated" or self.world == 1:
                full[name] = p.detach().clone()
                continue
            width = max(plan.local_rows(r) for r in range(self.world))
            padded = torch.zeros(width, plan.table.dim)
            padded[: p.shape[0]] = p.detach()
            receives = everywhere or self.rank == 0
            bucket = [torch.zeros_like(padded) for _ in range(self.world)] if receives else None
            if everywhere:
                dist.all_gather(bucket, padded)
            else:
                dist.gather(padded, bucket, dst=0)
            if receives:
                table = torch.empty(plan.table.num_rows, plan.table.dim)
                for r in range(self.world):
                    ids = plan.global_ids(r)
                    table[ids] = bucket[r][: len(ids)]
                full[name] = table
        return full if (everywhere or self.rank == 0) else {}
