"""Pooling on the owner: the strategy of tables planned with ``exchange: pooled``.

For every group of such tables (one dimension, placement and process group), per micro-batch:

1. input_dist — the requester numbers the bags of all the group's features one after another
   and groups its ids by owner (a stable counting partition: each (bag, owner)'s ids stay one
   run, in feature and bag order). Each owner gets, in one all-to-all, its ids (as local rows)
   followed by one (code, length) pair per bag it holds part of, where code = bag x n_tables
   + table; the sizes go first, in a small all-to-all of (ids, bags) per owner.
2. lookup — plain SGD and Adagrad tables: one ``embedding_bag`` per table straight from its
   shard; other optimizers: the owner finds the distinct rows it was asked for (one unique over
   the group), gathers each once, and sums every pair's rows with one fused ``embedding_bag``;
   either way in the order the pairs arrived.
3. output_dist — the partial sums go back (one all-to-all); the requester knows their order
   (its own runs, per owner) and adds the partial sums of each bag, then divides by the bag's
   length for mean pooling.

The buffers, the requests they carry (`bags.BagRequests`) and the flat exchange over any group
(`OwnerPooled.exchange_over`) are the public pieces a variant builds on (`hierarchical.py`).

Backward is the reverse all-to-all of one gradient per partial sum; the owner's shard gets
one sparse gradient entry per id looked up (plain SGD and Adagrad, `_pool_per_table`) or per
distinct row (other optimizers, `tables.distinct_rows`). Ids and codes travel as
int32 when every table of the group has fewer than 2^31 rows (the table sizes decide it, so
every rank agrees). Long bags move 4-8 B per id plus one vector per (bag, owner) instead of
every distinct row.

Example (world 2, one table, row i on rank i % 2 as local row i // 2): rank 0's bags
[[4, 9, 6], [9]] keep ids 4, 6 (local 2, 3) as its own pair (code 0, length 2) and send rank 1
the buffer [4, 4 | 0, 1 | 1, 1] (local rows of 9 and 9 | codes of bags 0 and 1 | lengths);
rank 1 returns two vectors (row 9, row 9), and bag 0 = (row 4 + row 6) + row 9, bag 1 = row 9.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from gmeta_ds.embedding.comm import Link, all_to_all
from gmeta_ds.embedding.layout import TableLayout
from gmeta_ds.embedding.optim import ROW_UPDATES, plain_update
from gmeta_ds.embedding.sharding.bags import BagRequests, bag_segments, pack_bags, unpack_bags
from gmeta_ds.embedding.sharding.base import ShardContext, Sharding
from gmeta_ds.embedding.sharding.row_wise import RowWise
from gmeta_ds.embedding.tables import FLAGS_RATIO, INT32_LIMIT, check_ids, distinct_rows, unique_keys
from gmeta_ds.sparse import Jagged


@dataclass(frozen=True)
class GroupLayout:
    """One group's tables (sorted names) and features, as small tensors so that the whole
    group's ids are checked, owned and keyed by tensor ops (no per-feature loop over ids).
    Per table t: ``num_rows`` (global), where its rows live (``layouts[t]``, the strategy's
    `layout.TableLayout`), and ``base``: where this rank's shard starts in one key space of all
    the group's local rows (``base[-1]`` keys in all)."""

    names: tuple[str, ...]
    features: tuple[str, ...]
    table_of_feature: Tensor
    num_rows: Tensor
    layouts: tuple[TableLayout, ...]
    base: Tensor
    mean: Tensor  # (F,) bool: the feature's table pools by mean
    router: TableLayout | None = None  # a layout that routes every table's ids alike, if one does
    same_rows: int = 0  # every table's number of rows when they are all equal, else 0
    by_owner: tuple[int, ...] = ()  # whole-table groups: features (indices) in order of owner
    feature_owner: tuple[int, ...] = ()  # each feature's table's one owner rank (-1: spread over ranks)

    @property
    def wire_dtype(self) -> torch.dtype:
        """The integer type ids and codes travel as (`bags`): int32 below 2^31 rows per table."""
        return torch.int32 if int(self.num_rows.max()) <= INT32_LIMIT else torch.int64

    @property
    def whole_tables(self) -> bool:
        """Every table of the group lives whole on one rank (each feature has one owner)."""
        return all(layout.owner is not None for layout in self.layouts)

    @staticmethod
    def of(strategy: Sharding, features: tuple[str, ...], device: torch.device) -> GroupLayout:
        ctx = strategy.ctx
        names = tuple(sorted({ctx.by_feature[f].name for f in features}))
        layouts = tuple(strategy.layout(n) for n in names)
        shard_rows = torch.tensor([0] + [ctx.shards[n].shape[0] for n in names])

        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)

        table_of = [names.index(ctx.by_feature[f].name) for f in features]
        rows = {layout.table.num_rows for layout in layouts}
        owner = [-1 if layouts[t].owner is None else layouts[t].owner for t in table_of]
        routings = {layout.routing for layout in layouts}
        return GroupLayout(names, features, tensor(table_of), tensor([layout.table.num_rows for layout in layouts]),
                           layouts, shard_rows.cumsum(0).to(device),
                           tensor([ctx.by_feature[f].pooling == "mean" for f in features], torch.bool),
                           layouts[0] if len(routings) == 1 else None, rows.pop() if len(rows) == 1 else 0,
                           tuple(sorted(range(len(features)), key=lambda k: owner[k])), tuple(owner))


class OwnerPooled(RowWise):
    """Row-wise or table-wise tables planned with ``exchange: pooled``: their features come
    as raw bags (`pool`), pooled on the owners; gradients and state are row-wise's (the
    plan's owners and local rows, whichever its kind)."""

    pools_on_owner = True

    def __init__(self, ctx: ShardContext, names: tuple[str, ...]):
        super().__init__(ctx, names)
        self.groups: dict[tuple, GroupLayout] = {}  # per (features, device): built once

    def pool(self, features: dict[str, Jagged]) -> dict[str, Tensor]:
        """{feature: (N, d)} for features of this strategy's tables, one exchange per group of
        tables of one dimension, placement and process group (`_pooled_group`): input_dist
        (`_by_id_owner`, `_by_table_owner`, then `exchange`), lookup (`_pool`), output_dist
        (`exchange`'s last all-to-all, then the sum of each bag's partial sums)."""
        ctx, by_group = self.ctx, defaultdict(list)
        for feature in features:
            name = ctx.by_feature[feature].name
            by_group[(ctx.plan.tables[name].table.dim, str(ctx.table_device[name]),
                      id(ctx.groups[name]))].append(feature)
        out = {}
        for group in by_group.values():
            device = ctx.table_device[ctx.by_feature[group[0]].name]
            key = (tuple(group), str(device))
            if key not in self.groups:
                self.groups[key] = GroupLayout.of(self, tuple(group), device)
            out.update(_pooled_group(ctx, self.groups[key], [features[f] for f in group], self.exchange))
        return out

    def exchange(self, layout: GroupLayout, requests: BagRequests) -> tuple[Tensor, Tensor]:
        """The partial sums of this rank's ``requests`` (one per pair, (pairs, d)) and the code
        of each (bag x n_tables + table), by which the requester adds them per bag. Here the
        flat exchange over the tables' group (`exchange_over`); a strategy that reaches the
        owners another way overrides this (`hierarchical.HierarchicalPooled`)."""
        return self.exchange_over(layout, requests, self.ctx.link(layout.names[0])), requests.codes

    def exchange_over(self, layout: GroupLayout, requests: BagRequests, link: Link, stage: str = "") -> Tensor:
        """One round over the ranks of ``link`` (``requests`` grouped by its members, in its
        rank order): input_dist (the sizes, then one `bags.pack_bags` buffer per member),
        each member pools what it received from its shards (`_pool`), output_dist (one
        partial sum per pair back). Returns (pairs, d) in the order of ``requests``; the
        traffic is counted under ``stage`` + ``input_dist`` / ``output_dist``. Collective
        over ``link``'s group."""
        ctx, size, group, remote = self.ctx, link.size, link.group, link.remote
        sizes = torch.stack([requests.n_ids, requests.n_pairs], dim=1)  # (size, 2)
        recv_sizes = all_to_all(sizes, [1] * size, [1] * size, ctx.stats, link.rank, stage + "input_dist", group,
                                remote)
        send = pack_bags(requests, layout.wire_dtype)
        recv_splits = (recv_sizes[:, 0] + 2 * recv_sizes[:, 1]).tolist()
        received = all_to_all(send, requests.buffer_sizes.tolist(), recv_splits, ctx.stats, link.rank,
                              stage + "input_dist", group, remote)
        got = unpack_bags(received.long(), recv_sizes[:, 0], recv_sizes[:, 1])
        partial = _pool(ctx, layout, got.local, got.codes, got.lengths)
        return all_to_all(partial, recv_sizes[:, 1].tolist(), requests.n_pairs.tolist(), ctx.stats, link.rank,
                          stage + "output_dist", group, remote)


def _checked(ctx: ShardContext, layout: GroupLayout, values: Tensor, order: tuple[int, ...],
             sizes: list[int]) -> Tensor:
    """`tables.check_ids` of the ids of features ``order`` (indices into ``layout.features``,
    ``sizes`` ids each, concatenated in ``values``) at once: the same errors and ``hash``.
    Tables of one size are checked against one bound (a min and a max), others per id."""
    values = values.long()
    if layout.same_rows:
        bound = layout.same_rows
    else:
        table = layout.table_of_feature.index_select(0, torch.tensor(order, device=values.device))
        bound = layout.num_rows.index_select(0, torch.repeat_interleave(
            table, torch.tensor(sizes, device=values.device), output_size=len(values)))
    if ctx.bad_ids == "hash":
        return torch.remainder(values, bound)
    if not len(values):
        return values
    if layout.same_rows:
        low, high = torch.aminmax(values)
        if int(low) >= 0 and int(high) < bound:
            return values
    bad = (values < 0) | (values >= bound)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        f = layout.features[order[int(torch.searchsorted(torch.tensor(sizes).cumsum(0), i, right=True))]]
        check_ids(values[i:i + 1], f, ctx.by_feature[f], ctx.bad_ids)  # raises, naming it
    return values


def _route(layout: GroupLayout, values: Tensor, sizes: list[int]) -> tuple[Tensor, Tensor]:
    """Owner rank and local row of every id (its table's `TableLayout.route`; ``values``: the
    features' ids back to back, ``sizes`` per feature): in one call when every table of the
    group routes alike (the usual case), else feature by feature."""
    if layout.router is not None:
        return layout.router.route(values)
    tables = layout.table_of_feature.tolist()
    routed = [layout.layouts[t].route(part) for t, part in zip(tables, torch.split(values, sizes))]
    return torch.cat([owners for owners, _ in routed]), torch.cat([local for _, local in routed])


def _pooled_group(ctx: ShardContext, layout: GroupLayout, jaggeds: list[Jagged], exchange) -> dict[str, Tensor]:
    n_tables, world = len(layout.names), ctx.world
    device = layout.base.device
    bags_per = [j.num_samples for j in jaggeds]
    n_bags = sum(bags_per)
    span = max(1, n_bags * n_tables)  # codes are < span
    if span > INT32_LIMIT:
        raise ValueError(f"tables {', '.join(layout.names)}: {n_bags} bags in one lookup; at most "
                         f"{INT32_LIMIT // n_tables} can be pooled on their owners (exchange: rows)")
    for feature, jagged in zip(layout.features, jaggeds):
        if not torch.is_tensor(jagged.values) or jagged.values.is_floating_point() or \
                jagged.values.is_complex() or jagged.values.dtype == torch.bool:
            check_ids(jagged.values, feature, ctx.by_feature[feature], ctx.bad_ids)  # raises, naming it
    bag_len = torch.cat([j.offsets.diff() for j in jaggeds]).to(device)
    if world > 1 and layout.whole_tables:
        requests = _by_table_owner(ctx, layout, jaggeds, bags_per, bag_len)
    else:
        requests = _by_id_owner(ctx, layout, jaggeds, bags_per, bag_len)
    if world == 1:
        partial, codes = _pool(ctx, layout, requests.local, requests.codes, requests.lengths), requests.codes
    else:
        partial, codes = exchange(layout, requests)
    bag_of = torch.div(codes, n_tables, rounding_mode="floor").to(partial.device)
    summed = partial.new_zeros(n_bags, partial.shape[1]).index_add(0, bag_of, partial)
    if bool(layout.mean.any()):
        divide = torch.repeat_interleave(layout.mean.to(summed.device), torch.tensor(bags_per, device=summed.device),
                                         output_size=n_bags)
        scale = torch.where(divide, bag_len.clamp(min=1).to(summed), torch.ones_like(bag_len, dtype=summed.dtype))
        summed = summed / scale.unsqueeze(1)
    summed = summed.to(ctx.device)
    return dict(zip(layout.features, torch.split(summed, bags_per)))


def _by_id_owner(ctx: ShardContext, layout: GroupLayout, jaggeds, bags_per, bag_len) -> BagRequests:
    """The requests of a group whose ids' owners depend on the id (row-wise, or world 1):
    (local rows grouped by owner, each (bag, owner) pair's code and number of ids, ids and
    pairs per owner). No sort: the pairs are the non-zero cells of one count of ids per
    (owner, bag) (owner-major, so in the order the owner's ids are sent), and the ids are put
    in order of owner by a stable counting partition (`partition_bags`), which keeps each (bag,
    owner)'s ids one run, in feature and bag order."""
    n_tables, world, device = len(layout.names), ctx.world, layout.base.device
    order = tuple(range(len(jaggeds)))
    sizes = [len(j.values) for j in jaggeds]
    n_bags = sum(bags_per)
    values = _checked(ctx, layout, torch.cat([j.values for j in jaggeds]).to(device), order, sizes)
    bag_table = torch.repeat_interleave(layout.table_of_feature, torch.tensor(bags_per, device=device),
                                        output_size=n_bags)
    if world == 1:
        pair_bag = bag_len.nonzero().squeeze(1)  # empty bags are no pair
        return BagRequests(values, pair_bag * n_tables + bag_table.index_select(0, pair_bag),
                           bag_len.index_select(0, pair_bag), torch.tensor([len(values)], device=device),
                           torch.tensor([len(pair_bag)], device=device))
    owners, local = _route(layout, values, sizes)
    bag = torch.repeat_interleave(torch.arange(n_bags, device=device), bag_len, output_size=len(values))
    counts = torch.bincount(owners * n_bags + bag, minlength=world * n_bags)
    pair = counts.nonzero().squeeze(1)
    pair_owner = torch.div(pair, n_bags, rounding_mode="floor")
    pair_bag = pair - pair_owner * n_bags
    n_ids = counts.view(world, n_bags).sum(1)
    return BagRequests(partition_bags(local, owners, world, n_ids),
                       pair_bag * n_tables + bag_table.index_select(0, pair_bag), counts.index_select(0, pair), n_ids,
                       torch.bincount(pair_owner, minlength=world))


def partition_bags(values: Tensor, owners: Tensor, world: int, per_owner: Tensor) -> Tensor:
    """``values`` stably grouped by ``owners`` (``per_owner[w]`` of owner w): each value's place
    is its owner's start plus its rank among that owner's values (one cumsum at world 2; a
    nonzero per owner up to 8 owners; else torch's stable sort, ~2x slower on CPU at 25,600 ids)."""
    if world == 2:
        second = owners.bool()
        rank = second.cumsum(0)
        place = torch.where(second, rank + (per_owner[0] - 1), torch.arange(len(values), device=values.device) - rank)
        return torch.empty_like(values).index_copy_(0, place, values)
    if world <= 8:
        return values.index_select(0, torch.cat([(owners == w).nonzero().squeeze(1) for w in range(world)]))
    return values.index_select(0, torch.argsort(owners, stable=True))


def _by_table_owner(ctx: ShardContext, layout: GroupLayout, jaggeds, bags_per, bag_len) -> BagRequests:
    """`_by_id_owner` for a group of table-wise tables at world > 1: each feature has one
    owner, so the features are put in order of owner (no sort of ids), and every non-empty
    bag is one pair (no search for runs)."""
    world, n_tables, device = ctx.world, len(layout.names), layout.base.device
    order = layout.by_owner
    sizes = [len(jaggeds[k].values) for k in order]
    local = _checked(ctx, layout, torch.cat([jaggeds[k].values for k in order]).to(device), order, sizes)
    starts = [0]
    for n in bags_per:
        starts.append(starts[-1] + n)
    bag_table = torch.repeat_interleave(layout.table_of_feature, torch.tensor(bags_per, device=device),
                                        output_size=starts[-1])
    codes = torch.arange(starts[-1], device=device) * n_tables + bag_table
    lengths = bag_len
    if order != tuple(range(len(order))):
        perm = torch.cat([torch.arange(starts[k], starts[k + 1], device=device) for k in order])
        codes, lengths = codes.index_select(0, perm), lengths.index_select(0, perm)
    n_ids, n_pairs = [0] * world, [0] * world
    for k, size in zip(order, sizes):
        n_ids[layout.feature_owner[k]] += size
        n_pairs[layout.feature_owner[k]] += bags_per[k]
    n_ids, n_pairs = torch.tensor(n_ids, device=device), torch.tensor(n_pairs, device=device)
    if len(lengths) and not bool(lengths.all()):  # empty bags are no pair
        keep = lengths > 0
        owner_of_bag = torch.repeat_interleave(
            torch.tensor([layout.feature_owner[k] for k in order], device=device),
            torch.tensor([bags_per[k] for k in order], device=device), output_size=len(lengths))
        n_pairs = torch.bincount(owner_of_bag[keep], minlength=world)
        codes, lengths = codes[keep], lengths[keep]
    return BagRequests(local, codes, lengths, n_ids, n_pairs)


def _pool(ctx: ShardContext, layout: GroupLayout, ids: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
    """Sums of this owner's rows per (sender, bag) pair, in the pairs' order: ``ids`` are the
    local rows of every pair back to back (``lengths`` of them per pair), ``codes`` say each
    pair's table (code % n_tables). One unique over the group's keys (local row + the table's
    ``base``: linear flags when the shards are small next to the ids, else one sort), one
    gather of each table's distinct rows (their gradient reaches the shard with one entry per
    distinct row, `tables.distinct_rows`), one fused sum per pair (`_BagSum`)."""
    n_tables = len(layout.names)
    if all(plain_update(ctx.optimizers[name]) in ROW_UPDATES for name in layout.names):
        return _pool_per_table(ctx, layout, ids, codes, lengths)
    table = torch.repeat_interleave(codes % n_tables, lengths, output_size=len(ids)) if n_tables > 1 else None
    keys = ids + layout.base.index_select(0, table) if n_tables > 1 else ids
    distinct, inverse = unique_keys(keys, int(layout.base[-1]), FLAGS_RATIO)
    counts = torch.searchsorted(distinct, layout.base).diff().tolist() if n_tables > 1 else [len(distinct)]
    rows = [distinct_rows(ctx.shards[name], part - layout.base[t])
            for t, (name, part) in enumerate(zip(layout.names, torch.split(distinct, counts)))]
    rows = torch.cat(rows) if n_tables > 1 else rows[0]
    return _BagSum.apply(rows, inverse, lengths)


def _pool_per_table(ctx: ShardContext, layout: GroupLayout, ids: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
    """`_pool` for tables whose optimizer is plain SGD or plain Adagrad, whose update needs no
    distinct rows here (`optim.sgd_rows` adds a gradient's entries one by one; `optim.adagrad_rows`
    sums each row's entries first, in linear time on small shards, `optim.summed_rows`): one
    ``embedding_bag`` per table straight from its shard, no unique; each shard's gradient has
    one entry per id looked up.
    The pairs of one table are made one run first (a stable sort of the pairs, not the ids)
    when they arrive in several (from several senders)."""
    n_tables = len(layout.names)
    shards = [ctx.shards[name] for name in layout.names]
    if n_tables == 1 or not len(lengths):
        return _TableBags.apply(ids, lengths, (0,), (len(lengths),), *shards[:1])
    pair_table = codes % n_tables
    runs, counts = torch.unique_consecutive(pair_table, return_counts=True)
    runs, counts = runs.tolist(), counts.tolist()
    if len(runs) == len(set(runs)):
        return _TableBags.apply(ids, lengths, tuple(runs), tuple(counts), *(shards[t] for t in runs))
    order = torch.argsort(pair_table, stable=True)
    starts = torch.cumsum(lengths, 0) - lengths
    lengths = lengths.index_select(0, order)
    ids = ids.index_select(0, bag_segments(starts.index_select(0, order), lengths))
    per_table = torch.bincount(pair_table, minlength=n_tables).tolist()
    present = tuple(t for t in range(n_tables) if per_table[t])
    out = _TableBags.apply(ids, lengths, present, tuple(per_table[t] for t in present),
                           *(shards[t] for t in present))
    return out.index_select(0, torch.argsort(order))


class _TableBags(torch.autograd.Function):
    """Sums per pair of rows of several shards: ``ids`` hold the pairs' ids back to back
    (``lengths`` per pair); the first ``counts[0]`` pairs read ``shards[0]``, the next
    ``counts[1]`` ``shards[1]``, and so on. Forward: one ``embedding_bag`` per shard.
    Backward: each shard's gradient is a sparse tensor of one entry per id (uncoalesced)."""

    @staticmethod
    def forward(ctx, ids: Tensor, lengths: Tensor, tables: tuple, counts: tuple, *shards: Tensor) -> Tensor:
        pair_bounds = [0]
        for c in counts:
            pair_bounds.append(pair_bounds[-1] + c)
        ends = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        starts = ends[:-1]
        id_bounds = ends.index_select(0, torch.tensor(pair_bounds, device=ends.device)).tolist()
        outs = [torch.nn.functional.embedding_bag(ids[id_bounds[b]:id_bounds[b + 1]], shard,
                                                  starts[pair_bounds[b]:pair_bounds[b + 1]] - id_bounds[b],
                                                  mode="sum")
                for b, shard in enumerate(shards)]
        ctx.save_for_backward(ids, lengths)
        ctx.id_bounds, ctx.shapes = id_bounds, [shard.shape for shard in shards]
        return torch.cat(outs) if len(outs) != 1 else outs[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        ids, lengths = ctx.saved_tensors
        per_id = grad.repeat_interleave(lengths.to(grad.device), dim=0, output_size=len(ids))
        bounds = ctx.id_bounds
        grads = [torch.sparse_coo_tensor(ids[bounds[b]:bounds[b + 1]].unsqueeze(0), per_id[bounds[b]:bounds[b + 1]],
                                         shape, check_invariants=False)
                 for b, shape in enumerate(ctx.shapes)]
        return (None, None, None, None, *grads)


class _BagSum(torch.autograd.Function):
    """out[p] = sum of ``rows[inverse[i]]`` over pair p's run of ``lengths[p]`` entries: one
    fused ``embedding_bag`` forward; backward gathers each entry's pair gradient and adds it
    into its row (`index_add`; ``embedding_bag``'s own dense backward sorts, slower on CPU)."""

    @staticmethod
    def forward(ctx, rows: Tensor, inverse: Tensor, lengths: Tensor) -> Tensor:
        offsets = torch.cumsum(lengths, 0) - lengths
        ctx.save_for_backward(inverse, lengths)
        ctx.n_rows = rows.shape[0]
        if len(lengths) == 0:
            return rows.new_zeros(0, rows.shape[1])
        return torch.nn.functional.embedding_bag(inverse, rows, offsets.to(rows.device), mode="sum")

    @staticmethod
    def backward(ctx, grad: Tensor):
        inverse, lengths = ctx.saved_tensors
        pair_of = torch.repeat_interleave(torch.arange(len(lengths), device=grad.device), lengths.to(grad.device),
                                          output_size=len(inverse))
        out = grad.new_zeros(ctx.n_rows, grad.shape[1])
        return out.index_add_(0, inverse.to(grad.device), grad.index_select(0, pair_of)), None, None
