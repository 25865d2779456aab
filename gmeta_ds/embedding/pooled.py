"""Pooling on the owner: the lookup of tables planned with ``exchange: pooled``.

For every group of such tables (one dimension, placement and process group), per micro-batch:

1. input_dist — the requester numbers the bags of all the group's features one after another
   and groups its ids by owner (keeping feature and bag order). Each owner gets, in one all-to-all, its ids (as
   local rows) followed by one (code, length) pair per bag it holds part of, where code = bag x
   n_tables + table; the sizes go first in a small all-to-all of (ids, bags) per owner.
2. lookup — the owner gathers each distinct row it was asked for once per table, then adds
   every id's row into its (sender, bag) partial sum in one ``index_add``, in the order the
   pairs arrived.
3. output_dist — the partial sums go back (one all-to-all); the requester knows their order
   (its own sorted pairs per owner) and adds the partial sums of each bag, then divides by the
   bag's length for mean pooling.

Backward is the reverse all-to-all of one gradient per partial sum; the owner's shard gets
one sparse gradient entry per distinct row (`tables.distinct_rows`), already coalesced. Ids and codes travel as int32 when
every table of the group has fewer than 2^31 rows (the sizes decide it, so every rank agrees).
Long bags move 4-8 B per id plus one vector per (bag, owner) instead of every distinct row.

Example (world 2, one table, row i on rank i % 2 as local row i // 2): rank 0's bags
[[4, 9, 6], [9]] keep ids 4, 6 (local 2, 3) as its own pair (code 0, length 2) and send rank 1
the buffer [4, 4 | 0, 1 | 1, 1] (local rows of 9 and 9 | codes of bags 0 and 1 | lengths);
rank 1 returns two vectors (row 9, row 9), and bag 0 = (row 4 + row 6) + row 9, bag 1 = row 9.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from gmeta_ds.embedding.comm import all_to_all
from gmeta_ds.embedding.tables import Jagged, check_ids, distinct_rows, unique_keys

INT32_LIMIT = 2**31 - 1
# Distinct rows by flags over the shard (linear) up to this many rows per id, else by a sort.
FLAGS_RATIO = 3.0


def owner_pooled(coll, features: dict[str, Jagged]) -> dict[str, Tensor]:
    """{feature: (N, d)} for features of pooled tables of ``coll`` (a
    `ShardedEmbeddingCollection`); one exchange per group of tables."""
    by_group = defaultdict(list)
    for feature in features:
        name = coll.by_feature[feature].name
        by_group[(coll.plan.tables[name].table.dim, str(coll.table_device[name]),
                  id(coll.groups[name]))].append(feature)
    out = {}
    for group in by_group.values():
        out.update(_pooled_group(coll, {f: features[f] for f in group}))
    return out


def _pooled_group(coll, features: dict[str, Jagged]) -> dict[str, Tensor]:
    names = sorted({coll.by_feature[f].name for f in features})
    n_tables = len(names)
    device = coll.table_device[names[0]]
    local, codes, owners, first = [], [], [], [0]
    for feature, jagged in features.items():
        table = coll.by_feature[feature]
        plan = coll.plan.tables[table.name]
        ids = check_ids(jagged.values, feature, table, coll.bad_ids).to(device)
        owners.append(plan.owners(ids))
        local.append(plan.local_index(ids))
        bags = jagged.segment_ids().to(device) + first[-1]
        codes.append(bags * n_tables + names.index(table.name))
        first.append(first[-1] + jagged.num_samples)
    span = max(1, first[-1] * n_tables)  # codes are < span
    if span > INT32_LIMIT:
        raise ValueError(f"tables {', '.join(names)}: {first[-1]} bags in one lookup; at most "
                         f"{INT32_LIMIT // n_tables} can be pooled on their owners (exchange: rows)")
    # Grouped by owner (stable: each bag's ids for one owner stay together, in feature and bag
    # order), so the (owner, code) pairs are runs: no sort by code needed.
    owners = torch.cat(owners)
    order = torch.argsort(owners, stable=True)
    pairs, lengths = torch.unique_consecutive((owners * span + torch.cat(codes))[order], return_counts=True)
    local = torch.cat(local)[order]
    pair_owner = torch.div(pairs, span, rounding_mode="floor")
    pair_code = pairs - pair_owner * span
    if coll.world == 1:
        partial = _pool(coll, names, local, pair_code, lengths)
    else:
        partial = _exchange(coll, names, local, pair_code, lengths, owners, pair_owner)
    bag_of = torch.div(pair_code, n_tables, rounding_mode="floor").to(partial.device)
    summed = partial.new_zeros(first[-1], partial.shape[1]).index_add(0, bag_of, partial)
    out = {}
    for (feature, jagged), start, end in zip(features.items(), first, first[1:]):
        pooled = summed[start:end]
        if coll.by_feature[feature].pooling == "mean":
            sizes = (jagged.offsets[1:] - jagged.offsets[:-1]).clamp(min=1).to(pooled)
            pooled = pooled / sizes.unsqueeze(1)
        out[feature] = pooled.to(coll.device)
    return out


def _wire_dtype(coll, names: list[str]) -> torch.dtype:
    rows = max(coll.plan.tables[n].table.num_rows for n in names)
    return torch.int32 if rows <= INT32_LIMIT else torch.int64


def _exchange(coll, names, local: Tensor, pair_code: Tensor, lengths: Tensor, owners: Tensor,
              pair_owner: Tensor) -> Tensor:
    """input_dist of [ids | codes | lengths] per owner, the owners' pooling, output_dist."""
    world, group = coll.world, coll.groups[names[0]]
    n_ids = torch.bincount(owners, minlength=world)
    n_pairs = torch.bincount(pair_owner, minlength=world)
    sizes = torch.stack([n_ids, n_pairs], dim=1)  # (W, 2)
    recv_sizes = all_to_all(sizes, [1] * world, [1] * world, coll.stats, coll.rank, "input_dist", group)
    dtype = _wire_dtype(coll, names)
    send = _pack(local, pair_code, lengths, n_ids, n_pairs, dtype)
    send_splits = (n_ids + 2 * n_pairs).tolist()
    recv_splits = (recv_sizes[:, 0] + 2 * recv_sizes[:, 1]).tolist()
    received = all_to_all(send, send_splits, recv_splits, coll.stats, coll.rank, "input_dist", group)
    ids, codes, counts = _unpack(received.long(), recv_sizes[:, 0], recv_sizes[:, 1])
    partial = _pool(coll, names, ids, codes, counts)
    return all_to_all(partial, recv_sizes[:, 1].tolist(), n_pairs.tolist(), coll.stats, coll.rank,
                      "output_dist", group)


def _segments(starts: Tensor, sizes: Tensor) -> Tensor:
    """Positions ``starts[i] + 0 .. sizes[i] - 1`` for every i, concatenated."""
    total = int(sizes.sum())
    first = torch.cumsum(sizes, 0) - sizes
    return torch.arange(total, device=sizes.device) + torch.repeat_interleave(starts - first, sizes,
                                                                              output_size=total)


def _pack(local, pair_code, lengths, n_ids, n_pairs, dtype) -> Tensor:
    """One buffer, per owner: its ids, then its bags' codes, then their lengths."""
    seg = n_ids + 2 * n_pairs
    start = torch.cumsum(seg, 0) - seg
    out = torch.empty(int(seg.sum()), dtype=dtype, device=local.device)
    out[_segments(start, n_ids)] = local.to(dtype)
    out[_segments(start + n_ids, n_pairs)] = pair_code.to(dtype)
    out[_segments(start + n_ids + n_pairs, n_pairs)] = lengths.to(dtype)
    return out


def _unpack(buffer, n_ids, n_pairs) -> tuple[Tensor, Tensor, Tensor]:
    seg = n_ids + 2 * n_pairs
    start = torch.cumsum(seg, 0) - seg
    return (buffer[_segments(start, n_ids)], buffer[_segments(start + n_ids, n_pairs)],
            buffer[_segments(start + n_ids + n_pairs, n_pairs)])


def _pool(coll, names: list[str], ids: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
    """Sums of this owner's rows per (sender, bag) pair, in the pairs' order: ``ids`` are the
    local rows of every pair back to back (``lengths`` of them per pair), ``codes`` say each
    pair's table (code % n_tables). Per table one gather of its distinct rows (whose gradient
    reaches the shard already coalesced, `tables.distinct_rows`), then one ``index_add`` of
    every id's row into its pair for all tables together (with its gather, faster on CPU in
    both directions than ``embedding_bag``'s dense backward, which sorts)."""
    n_tables = len(names)
    pair_of = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths,
                                      output_size=len(ids))
    table_of = (codes % n_tables)[pair_of] if n_tables > 1 else None
    rows, index = [], torch.empty_like(ids)
    base = 0
    for t, name in enumerate(names):
        shard = coll.shards[name]
        where = torch.nonzero(table_of == t).squeeze(1) if n_tables > 1 else None
        mine = ids[where] if where is not None else ids
        distinct, inverse = unique_keys(mine, shard.shape[0], FLAGS_RATIO)
        rows.append(distinct_rows(shard, distinct.to(shard.device)))
        if where is None:
            index = inverse
        else:
            index[where] = inverse + base
        base += len(distinct)
    rows = torch.cat(rows) if len(rows) > 1 else rows[0]
    out = rows.new_zeros(len(lengths), rows.shape[1])
    return out.index_add(0, pair_of.to(rows.device), rows.index_select(0, index.to(rows.device)))
