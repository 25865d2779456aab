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

Placement (`TableConfig.device`, resolved by `resolve_placement`): ``accelerator`` tables live
on the rank's device and exchange over the default group (NCCL on CUDA); ``host`` tables live
in host memory (pinned where CUDA is available) and exchange over a gloo group of their own,
their rows moved to the device after the exchange (and their gradients back by autograd).
Dynamic tables (``kind="dynamic"``, `gmeta_ds.embedding.dynamic`) send each id with its number
of occurrences; the owner maps ids to rows (admitting and evicting) before its lookup.

Tables planned with ``exchange: pooled`` (`gmeta_ds.embedding.plan.choose_exchange`) pool on
the owner instead: input_dist sends every (id, bag) pair to the id's owner, the owner adds up
its rows of each bag into one partial sum per (requesting rank, bag), and output_dist returns
those; the requester adds the partial sums of each bag (and divides by the bag's length for
mean pooling). Long bags then move one vector per bag and owner instead of every distinct row.
Its backward is the same reverse all-to-all, of one gradient per partial sum.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gmeta_ds.embedding.comm import CommStats, all_to_all
from gmeta_ds.embedding.dynamic import DynamicIndex, default_row, init_dynamic_rows
from gmeta_ds.embedding.optim import adagrad_rows, build_sparse_optimizer, fast_update, sgd_rows
from gmeta_ds.embedding.plan import ShardingPlan
from gmeta_ds.embedding.pooled import owner_pooled
from gmeta_ds.engine.dist import on_wire
from gmeta_ds.embedding.tables import FLAGS_RATIO, TableConfig, check_fields, check_ids, check_width, feature_tables, init_rows, lookup_fields, pool, unique_keys
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
           bags: tuple[str, ...], pooled: frozenset = frozenset()) -> FieldTables | None:
        """The layout of single-hot ``fields`` next to multi-hot ``bags``, or None where the
        fused lookup does not apply: no fields, an unknown feature, a table serving two of them,
        a dynamic table, a table pooled on its owner (in ``pooled``), or tables of different
        dimensions."""
        if not fields or any(f not in by_feature for f in fields + bags):
            return None
        tables = tuple(by_feature[f] for f in fields)
        if any(t.kind == "dynamic" for t in tables) or pooled & {t.name for t in tables}:
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


class Request(NamedTuple):
    """One table's lookup request: the ids to fetch (deduplicated unless ``dedup`` is off),
    the index of each looked-up value into them, and how often each occurs (dynamic tables:
    admission counts occurrences)."""

    ids: Tensor
    inverse: Tensor
    counts: Tensor | None = None


def accelerator_device() -> torch.device | None:
    """This rank's accelerator (CUDA, by LOCAL_RANK), or None on a machine without one."""
    if not torch.cuda.is_available():
        return None
    import os

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def resolve_placement(plan: ShardingPlan, rank: int, device: torch.device | None = None,
                      budget_fraction: float = 0.5) -> dict[str, str]:
    """``accelerator`` or ``host`` for every table. ``auto``: on the accelerator when there is
    one and the tables placed there fit ``budget_fraction`` of its memory by `TablePlan.bytes_on`
    (largest first), else on the host. ``accelerator`` without one is an error naming the table."""
    device = device if device is not None else accelerator_device()
    on_accelerator = device is not None and device.type != "cpu"
    placed = {}
    for name, p in plan.tables.items():
        if p.table.device == "accelerator" and not on_accelerator:
            raise ValueError(f"table {name!r}: device accelerator, but this rank has no accelerator "
                             f"(torch.cuda.is_available() is False); set embedding.tables.{name}.device "
                             "to host or auto")
        if p.table.device != "auto":
            placed[name] = p.table.device
    budget = 0
    if on_accelerator:
        budget = budget_fraction * torch.cuda.get_device_properties(device).total_memory
        budget -= sum(plan.tables[n].bytes_on(rank) for n, d in placed.items() if d == "accelerator")
    for name, p in sorted(plan.tables.items(), key=lambda item: -item[1].bytes_on(rank)):
        if name in placed:
            continue
        cost = p.bytes_on(rank)
        placed[name] = "accelerator" if on_accelerator and cost <= budget else "host"
        budget -= cost if placed[name] == "accelerator" else 0
    return {name: placed[name] for name in plan.tables}


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


class ShardedEmbeddingCollection:
    """Each rank's shards of every table (``shards[name]``: (local rows, dim) parameters).

    Same forward contract as `EmbeddingCollection`:
    ``forward({feature: Jagged}) -> {feature: (N, d) pooled | (nnz, d)}``, rows on ``device``
    (the dense model's; default: this rank's accelerator if any, else the host). Collective:
    every rank must call forward (and later backward) once per micro-batch, with its own ids;
    construction is collective too when a table is placed on the host next to a default
    group that is not gloo, or explicitly (it creates the host tables' gloo group).
    """

    def __init__(self, plan: ShardingPlan, rank: int, seed: int = 0, bad_ids: str = "error",
                 dedup: bool = True, device: torch.device | str | None = None):
        self.plan, self.rank, self.world = plan, rank, plan.world_size
        self.bad_ids, self.dedup, self.seed = bad_ids, dedup, seed
        device = torch.device(device) if device is not None else accelerator_device()
        self.device = device if device is not None else torch.device("cpu")
        self.placement = resolve_placement(plan, rank, self.device)
        self.table_device = {name: self.device if where == "accelerator" else torch.device("cpu")
                             for name, where in self.placement.items()}
        self.groups = self._groups()
        tables = [p.table for p in plan.tables.values()]
        self.by_feature = feature_tables(tables)
        self.dynamic = {name: DynamicIndex(name, p.table.capacity, p.table.admit_after, p.table.eviction,
                                           self.table_device[name])
                        for name, p in plan.tables.items() if p.kind == "dynamic"}
        self.shards = {name: nn.Parameter(self._initial_rows(name)) for name in plan.tables}
        self.optimizers = {name: build_sparse_optimizer(p.table.optimizer, self.shards[name], p.table.lr)
                           for name, p in plan.tables.items()}
        self.stats = CommStats()
        self._field_tables: dict[tuple, FieldTables | None] = {}
        self.pooled = frozenset(name for name, p in plan.tables.items() if p.exchange == "pooled")

    def _groups(self) -> dict[str, object]:
        """The process group of each table's exchange (None: the default group). Host tables
        get a gloo group of their own when the default one is not gloo, or when ``host`` was
        asked for explicitly (so that path runs, and is tested, on CPU machines too)."""
        groups = {name: None for name in self.plan.tables}
        if self.world == 1 or not dist.is_initialized():
            return groups
        default_gloo = dist.get_backend() == "gloo"
        own = [name for name, where in self.placement.items() if where == "host" and
               (not default_gloo or self.plan.tables[name].table.device == "host")]
        if own:
            host_group = dist.new_group(backend="gloo")
            groups.update({name: host_group for name in own})
        return groups

    def _initial_rows(self, name: str) -> Tensor:
        p = self.plan.tables[name]
        if p.kind == "dynamic":
            t = p.table
            rows = torch.zeros(t.capacity + 1, t.dim)
            rows[0] = default_row(t.name, t.dim, t.init_std, self.seed)[0]
        else:
            rows = init_rows(p.table, self.seed, p.global_ids(self.rank))
        rows = rows.to(self.table_device[name])
        if rows.device.type == "cpu" and torch.cuda.is_available():
            rows = rows.pin_memory()
        return rows

    def parameters(self) -> list[nn.Parameter]:
        return list(self.shards.values())

    # ------------------------------------------------------------------ forward
    def __call__(self, features: dict[str, Jagged]) -> dict[str, Tensor]:
        return self.forward(features)

    def forward(self, features: dict[str, Jagged]) -> dict[str, Tensor]:
        by_rows, by_owner = self._split_pooled(features)
        requests = self._requests(by_rows)
        out = self._per_feature(by_rows, requests, self._rows(requests))
        out.update(self._owner_pooled(by_owner))
        return {feature: out[feature] for feature in features}

    def _split_pooled(self, features: dict[str, Jagged]) -> tuple[dict, dict]:
        """``features`` split into those looked up by rows and those pooled on their owners."""
        if not self.pooled:
            return features, {}
        by_owner = {f: j for f, j in features.items() if self.by_feature[f].name in self.pooled}
        return {f: j for f, j in features.items() if f not in by_owner}, by_owner

    def lookup_fields(self, ids: Tensor, fields: list[str], multi: dict | None = None) -> Tensor:
        """Single-hot ids (..., F) (+ multi-hot bags) -> rows (..., F + M, d) in one fused lookup.

        The rows, gradients, requests and traffic of `tables.lookup_fields` (one `Jagged.single`
        per field through `forward`), bit for bit, with the single-hot fields kept as one (N, F)
        tensor: their ids checked in one op (`check_fields`), every table's request
        deduplicated by one unique of table-offset keys (`FieldTables`), their rows gathered by
        one index. (With several threads the per-field path's accumulating index is not
        deterministic; this one is, and equals its one-thread result.) Bags keep the
        per-feature path; fields sharing a table (with each other or a bag), unknown features,
        dynamic tables or tables of different dimensions take `tables.lookup_fields` as a whole.
        """
        multi = multi or {}
        check_width(ids, fields)
        signature = (tuple(fields), tuple(multi))
        if signature not in self._field_tables:
            self._field_tables[signature] = FieldTables.of(self.by_feature, *signature, self.pooled)
        layout = self._field_tables[signature]
        if layout is None:
            return lookup_fields(self, ids, fields, multi)
        if layout.num_rows.device != ids.device:  # the ids' device from now on (one copy)
            layout = self._field_tables[signature] = layout.on(ids.device)
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
            inverse = torch.arange(n * len(fields), device=flat.device).view(len(fields), n).t()
            sizes = [n] * len(fields)
        names = [t.name for t in layout.tables]
        by_rows, by_owner = self._split_pooled(multi)
        bags = self._requests(by_rows)
        rows = self._rows({**{n: Request(i, None) for n, i in zip(names, torch.split(table_ids, sizes))},
                           **bags})
        # index_select, not indexing: as fast again, and its backward sums each row's
        # gradients serially in the order of `inverse`, as the per-field indexing does
        out = torch.cat([rows[name] for name in names]).index_select(0, inverse.reshape(-1))
        out = out.view(*inverse.shape, -1)  # (N, F, d)
        if multi:
            pooled = self._per_feature(by_rows, bags, rows) | self._owner_pooled(by_owner)
            out = torch.cat([out, torch.stack([pooled[f] for f in multi], dim=1)], dim=1)
        return out.reshape(*ids.shape[:-1], out.shape[1], -1)

    def _requests(self, features: dict[str, Jagged]) -> dict[str, Request]:
        """Per table: the ids to fetch, the index of each value of its features (concatenated)
        into them, and (dynamic tables) each id's number of occurrences."""
        per_table = defaultdict(list)
        for feature, jagged in features.items():
            table = self.by_feature[feature]
            per_table[table.name].append(check_ids(jagged.values, feature, table, self.bad_ids))
        out = {}
        static = [name for name in per_table if name not in self.dynamic]
        # one unique for the group where it is linear (flags); a sort of all the ids together
        # is slower than one small sort per table
        if self.dedup and len(static) > 1 and sum(self.plan.tables[n].table.num_rows for n in static) <= \
                FLAGS_RATIO * sum(len(i) for n in static for i in per_table[n]):
            out.update(_requests_of_group(static, [torch.cat(per_table[n]) for n in static],
                                          [self.plan.tables[n].table.num_rows for n in static]))
        for name, parts in per_table.items():
            if name in out:
                continue
            ids = torch.cat(parts)
            dynamic = name in self.dynamic
            if self.dedup:
                unique = torch.unique(ids, return_inverse=True, return_counts=dynamic)
                out[name] = Request(*unique)
            else:
                out[name] = Request(ids, torch.arange(len(ids), device=ids.device),
                                    torch.ones_like(ids) if dynamic else None)
        return out

    def _rows(self, requests: dict[str, Request]) -> dict[str, Tensor]:
        """Rows of every table's requested ids, on ``self.device``: replicated tables looked up
        locally, sharded ones through one exchange per group of tables of one dimension,
        placement and process group."""
        rows = {}
        by_group = defaultdict(list)
        for name, request in requests.items():
            if self.plan.tables[name].kind == "replicated":
                ids = request.ids.to(self.table_device[name])
                rows[name] = torch.nn.functional.embedding(ids, self.shards[name], sparse=True)
            else:
                key = (self.plan.tables[name].table.dim, str(self.table_device[name]), id(self.groups[name]))
                by_group[key].append(name)
        for names in by_group.values():
            rows.update(self._sharded_rows(names, {n: requests[n] for n in names}))
        return {name: r.to(self.device) for name, r in rows.items()}

    def _sharded_rows(self, names: list[str], requests: dict[str, Request]) -> dict[str, Tensor]:
        """input_dist -> lookup -> output_dist for tables of one dimension and group."""
        n_tables = len(names)
        device = self.table_device[names[0]]
        ids = {n: requests[n].ids.to(device) for n in names}
        table_of = torch.cat([torch.full((len(ids[n]),), t, device=device) for t, n in enumerate(names)])
        owners = torch.cat([self.plan.tables[n].owners(ids[n]) for n in names])
        local = torch.cat([self.plan.tables[n].local_index(ids[n]) for n in names])
        counts = None
        if any(n in self.dynamic for n in names):  # occurrences travel with the ids
            counts = torch.cat([requests[n].counts.to(device) if n in self.dynamic
                                else torch.ones_like(ids[n]) for n in names])
        order = torch.argsort(owners * n_tables + table_of, stable=True)
        per_owner = torch.bincount(owners * n_tables + table_of, minlength=self.world * n_tables)
        sent_counts = counts[order] if counts is not None else None
        if self.world == 1:
            fetched = self._lookup(names, local[order], table_of[order], sent_counts)
        else:
            fetched = self._exchange(names, local[order], sent_counts, per_owner)
        rows = fetched[torch.argsort(order)]  # back to request order
        sizes = [len(ids[n]) for n in names]
        return dict(zip(names, torch.split(rows, sizes)))

    def _exchange(self, names: list[str], send_ids: Tensor, send_counts: Tensor | None,
                  per_owner: Tensor) -> Tensor:
        n_tables, group = len(names), self.groups[names[0]]
        recv_per_owner = all_to_all(per_owner, [n_tables] * self.world, [n_tables] * self.world,
                                    self.stats, self.rank, "input_dist", group)
        send_splits = per_owner.view(self.world, n_tables).sum(1).tolist()
        recv_splits = recv_per_owner.view(self.world, n_tables).sum(1).tolist()
        payload = send_ids if send_counts is None else torch.stack([send_ids, send_counts], dim=1)
        received = all_to_all(payload, send_splits, recv_splits, self.stats, self.rank, "input_dist", group)
        recv_ids, recv_counts = (received, None) if send_counts is None else received.unbind(1)
        recv_table = torch.repeat_interleave(torch.arange(n_tables, device=received.device).repeat(self.world),
                                             recv_per_owner)
        rows = self._lookup(names, recv_ids, recv_table, recv_counts)
        return all_to_all(rows, recv_splits, send_splits, self.stats, self.rank, "output_dist", group)

    def _lookup(self, names: list[str], local_ids: Tensor, table_of: Tensor,
                counts: Tensor | None = None) -> Tensor:
        """Rows of local shards for (local id, table) pairs, in the given order; dynamic
        tables map their ids to rows first (admitting the ids that qualify)."""
        picks, parts = [], []
        for t, name in enumerate(names):
            where = torch.nonzero(table_of == t).squeeze(1)
            picks.append(where)
            local = local_ids[where]
            if name in self.dynamic:
                local = self._admit(name, local, counts[where])
            parts.append(torch.nn.functional.embedding(local, self.shards[name], sparse=True))
        rows = torch.cat(parts)
        return rows[torch.argsort(torch.cat(picks))]

    def _admit(self, name: str, ids: Tensor, counts: Tensor) -> Tensor:
        """Rows of a dynamic table's ids on this owner; rows given to new ids start at their
        initial value with zeroed optimizer state, and lose any gradient pending for the id
        that held them."""
        rows, admitted = self.dynamic[name].lookup(ids, counts)
        if len(admitted.slots):
            t, shard = self.plan.tables[name].table, self.shards[name]
            with torch.no_grad():
                shard[admitted.slots] = init_dynamic_rows(t.name, t.dim, t.init_std, self.seed,
                                                          admitted.ids.cpu()).to(shard.device)
            for value in self.optimizers[name].state.get(shard, {}).values():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == shard.shape[0]:
                    value[admitted.slots] = 0
            if shard.grad is not None and admitted.evicted:
                grad = shard.grad.coalesce()
                keep = ~torch.isin(grad.indices()[0], admitted.slots)
                shard.grad = torch.sparse_coo_tensor(grad.indices()[:, keep], grad.values()[keep],
                                                     shard.shape, check_invariants=False)
        return rows

    def _owner_pooled(self, features: dict[str, Jagged]) -> dict[str, Tensor]:
        """Pooled rows (N, d) of features whose tables pool on their owners (`pooled.owner_pooled`)."""
        return owner_pooled(self, features) if features else {}

    def _per_feature(self, features, requests, rows) -> dict[str, Tensor]:
        out, cursor = {}, defaultdict(int)
        for feature, jagged in features.items():
            name = self.by_feature[feature].name
            inverse = requests[name].inverse
            start = cursor[name]
            cursor[name] += len(jagged.values)
            values = rows[name][inverse[start:cursor[name]].to(self.device)]
            out[feature] = pool(values, jagged, self.plan.tables[name].table.pooling)
        return out

    # ------------------------------------------------------------------ training
    def finish_gradients(self, leave: frozenset = frozenset()) -> None:
        """Average row gradients over ranks: sharded rows arrived summed over ranks (divide by
        the world size); replicated tables are all-reduced together, one collective per group.
        Sharded tables in ``leave`` keep their summed, uncoalesced gradient (`step` scales it)."""
        if self.world == 1:
            return
        replicated = defaultdict(list)
        for name, p in self.shards.items():
            if self.plan.tables[name].kind == "replicated":
                replicated[(str(p.device), id(self.groups[name]))].append(name)
            elif p.grad is not None and name not in leave:
                p.grad = p.grad.coalesce() / self.world
        for names in replicated.values():
            self._all_reduce_replicated(names)

    def _all_reduce_replicated(self, names: list[str]) -> None:
        """One all-reduce of replicated tables' dense gradients plus a touched-row flag (so
        lazy optimizers update exactly the rows some rank used)."""
        parts = []
        for name in names:
            p = self.shards[name]
            grad = p.grad.to_dense() if p.grad is not None else torch.zeros_like(p)
            touched = torch.zeros(p.shape[0], 1, device=p.device)
            if p.grad is not None:
                touched[p.grad.coalesce().indices()[0]] = 1.0
            parts.append(torch.cat([grad, touched], dim=1).reshape(-1))
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=self.groups[names[0]])
        ring = int(2 * (self.world - 1) / self.world * flat.numel() * flat.element_size())
        self.stats.record_bytes("replicated_allreduce", ring, ring)
        for name, chunk in zip(names, torch.split(flat, [t.numel() for t in parts])):
            p = self.shards[name]
            chunk = chunk.view(p.shape[0], p.shape[1] + 1)
            rows = torch.nonzero(chunk[:, -1]).squeeze(1)
            p.grad = None if len(rows) == 0 else torch.sparse_coo_tensor(
                rows.unsqueeze(0), chunk[rows, :-1] / self.world, p.shape, check_invariants=False)

    def step(self) -> None:
        """Average gradients, apply each table's sparse optimizer, clear gradients. Plain SGD
        (no momentum, weight decay or maximize) on a sparse gradient is applied as one
        ``index_add`` of the uncoalesced gradient, scaled by lr / W: adding the entries of a row
        one by one is the same update, without coalescing (a sort of every entry). Plain
        Adagrad takes `adagrad_rows`, torch's arithmetic by index ops (`optim.fast_update`),
        on the summed gradient (`optim.summed_rows`: linear time on small tables) divided by W."""
        direct = {name: how for name, p in self.shards.items() if self.plan.tables[name].kind != "replicated"
                  and (how := fast_update(self.optimizers[name], p)) in ("sgd", "adagrad")}
        self.finish_gradients(leave=frozenset(direct))
        for name, p in self.shards.items():
            optimizer = self.optimizers[name]
            how = direct.get(name) or fast_update(optimizer, p)  # (averaged gradients now)
            world = self.world if name in direct else 1
            if how == "sgd":
                sgd_rows(optimizer, p, 1 / world)
            elif how == "adagrad":
                adagrad_rows(optimizer, p, world)
            elif p.grad is not None:
                optimizer.step()
            p.grad = None

    # ------------------------------------------------------------------ reporting
    def _sum_on_host(self, values: list[float]) -> list[float]:
        """float64 sums over ranks of per-rank host numbers: over gloo (the default group or
        the host tables'), else through the default group on the device."""
        total = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            host = next((g for g in self.groups.values() if g is not None), None)
            if host is None:
                total = on_wire(total)  # the default group (NCCL takes device tensors only)
            dist.all_reduce(total, group=host)
        return total.cpu().tolist()

    def checksum(self) -> float:
        """float64 sum of every table's rows, each row counted once over all ranks (dynamic
        tables: the rows of admitted ids plus the mean of the ranks' default rows, so a run
        equals its one-process twin whenever their default rows do)."""
        local = 0.0
        for name, p in self.shards.items():
            kind = self.plan.tables[name].kind
            if kind == "dynamic":
                rows = p.detach()
                local += rows[self.dynamic[name].rows].double().sum().item()
                local += rows[0].double().sum().item() / self.world
            elif kind != "replicated" or self.rank == 0:
                local += p.detach().double().sum().item()
        return self._sum_on_host([local])[0]

    def dynamic_counters(self) -> dict[str, dict[str, int]]:
        """This rank's dynamic-table counters (cumulative) and occupancy, per table."""
        return {name: {**index.counters, "occupancy": index.occupancy, "capacity": index.capacity}
                for name, index in self.dynamic.items()}

    # ------------------------------------------------------------------ export
    def gather_tables(self, everywhere: bool = False) -> dict[str, Tensor]:
        """Full static tables on rank 0 (every rank with ``everywhere``; {} elsewhere);
        collective. Dynamic tables are in `gather_state`."""
        full = {}
        receives = everywhere or self.rank == 0
        for name, p in self.shards.items():
            plan = self.plan.tables[name]
            if plan.kind == "dynamic":
                continue
            if plan.kind == "replicated" or self.world == 1:
                full[name] = p.detach().cpu().clone()
                continue
            width = max(plan.local_rows(r) for r in range(self.world))
            padded = torch.zeros(width, plan.table.dim, device=p.device)
            padded[: p.shape[0]] = p.detach()
            bucket = self._gather(padded, everywhere, name)
            if receives:
                table = torch.empty(plan.table.num_rows, plan.table.dim)
                for r in range(self.world):
                    ids = plan.global_ids(r)
                    table[ids] = bucket[r][: len(ids)].cpu()
                full[name] = table
        return full if receives else {}

    def _gather(self, x: Tensor, everywhere: bool, name: str) -> list[Tensor] | None:
        """Every rank's ``x`` (same shape on all) on rank 0, or everywhere; table ``name``'s group."""
        group = self.groups[name]
        receives = everywhere or self.rank == 0
        bucket = [torch.zeros_like(x) for _ in range(self.world)] if receives else None
        if everywhere:
            dist.all_gather(bucket, x, group=group)
        else:
            dist.gather(x, bucket, dst=0, group=group)
        return bucket

    def gather_state(self, everywhere: bool = False) -> dict[str, Tensor]:
        """Every table as `EmbeddingCollection` state-dict entries (``weights.<table>``; dynamic
        tables: ``dynamic.<table>.ids`` (sorted admitted ids), ``.rows`` and ``.defaults``, every
        rank's default row), on rank 0 or everywhere; collective."""
        state = {f"weights.{name}": t for name, t in self.gather_tables(everywhere).items()}
        receives = everywhere or self.rank == 0
        for name, index in self.dynamic.items():
            shard = self.shards[name].detach()
            ids, rows = index.keys.cpu(), shard[index.rows].cpu()
            defaults = shard[:1].cpu()
            if self.world > 1:
                ids, rows, defaults = self._gather_ragged(name, ids, rows, defaults, everywhere)
                if not receives:
                    continue
            order = torch.argsort(ids)
            state[f"dynamic.{name}.ids"] = ids[order].clone()
            state[f"dynamic.{name}.rows"] = rows[order].clone()
            state[f"dynamic.{name}.defaults"] = defaults.clone()
        return state if receives else {}

    def _gather_ragged(self, name, ids, rows, defaults, everywhere):
        """Every rank's admitted (ids, rows) and default row, concatenated in rank order."""
        sizes = self._gather(torch.tensor([len(ids)], device=self._wire(name)), everywhere, name)
        width = self.plan.tables[name].table.capacity
        padded_ids = torch.zeros(width, dtype=torch.long, device=self._wire(name))
        padded_ids[: len(ids)] = ids
        padded_rows = torch.zeros(width + 1, rows.shape[1], device=self._wire(name))
        padded_rows[: len(ids)] = rows
        padded_rows[width] = defaults[0]
        all_ids = self._gather(padded_ids, everywhere, name)
        all_rows = self._gather(padded_rows, everywhere, name)
        if all_ids is None:
            return None, None, None
        n = [int(s) for s in torch.cat(sizes).tolist()]
        return (torch.cat([i[:k].cpu() for i, k in zip(all_ids, n)]),
                torch.cat([r[:k].cpu() for r, k in zip(all_rows, n)]),
                torch.stack([r[width].cpu() for r in all_rows]))

    def _wire(self, name: str) -> torch.device:
        """Where tensors of table ``name``'s collectives must be (its shard's device)."""
        return self.shards[name].device
