"""Ranks of `test_fused_lookup`: ``fused_lookup(DEDUP, BAD_IDS)`` on every rank of the warm test pool
(through `distributed.ranks.run_ranks`).

Every rank looks up its own single-hot ids and bags through two twin collections, one by
`ShardedEmbeddingCollection.lookup_fields` (fields as one tensor), one by the per-feature path
(`tables.lookup_fields`), trains both three steps and checks rows, averaged gradients, tables
and communication counters equal bit for bit."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gmeta_ds.embedding import tables
from gmeta_ds.embedding.plan import ShardingPlan, TablePlan
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import TableConfig
from gmeta_ds.sparse import Jagged

# (table, rows, plan, row owner, optimizer); the last two hold bags, the others one field each.
SPECS = [("user", 53, "row_wise", "modulo", "adagrad"), ("age", 6, "replicated", "modulo", "sgd"),
         ("item", 71, "row_wise", "block", "rowwise_adagrad"), ("city", 19, "table_wise", "modulo", "adam"),
         ("hist", 41, "row_wise", "modulo", "adagrad"), ("tags", 9, "replicated", "modulo", "adagrad")]
FIELDS = ["user", "age", "item", "city"]


def collection(world: int, rank: int, dedup: bool, bad_ids: str) -> ShardedEmbeddingCollection:
    plans = {}
    for name, rows, kind, owner, opt in SPECS:
        table = TableConfig(name, rows, 3, (name,), pooling="mean" if name == "tags" else "sum",
                            optimizer=opt, lr=0.1)
        plans[name] = TablePlan(table, kind, world, owner, owner=world - 1)
    return ShardedEmbeddingCollection(ShardingPlan(plans, world), rank, seed=11, bad_ids=bad_ids, dedup=dedup)


def batch(rank: int, step: int, spread: int):
    """This rank's ids (6, 8, F): more keys than the fields' tables have rows, with repeats
    (beyond the tables with ``spread`` > 1); and its bags."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    sizes = [rows for name, rows, *_ in SPECS if name in FIELDS]
    ids = torch.stack([torch.randint(-(spread > 1) * r, r * spread, (6, 8), generator=g) for r in sizes],
                      dim=-1)

    def bags(rows: int) -> Jagged:
        lengths = torch.randint(0, 3, (48,), generator=g)
        return Jagged(torch.randint(0, rows, (int(lengths.sum()),), generator=g),
                      torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    return ids, {"hist": bags(41), "tags": bags(9)}


def run(coll: ShardedEmbeddingCollection, lookup, rank: int) -> list:
    seen = []
    for step in range(3):
        ids, multi = batch(rank, step, 3 if coll.bad_ids == "hash" else 1)
        rows = lookup(coll, ids, FIELDS, multi if step != 1 else None)
        g = torch.Generator().manual_seed(7 + rank + step)
        (rows * torch.randn(rows.shape, generator=g)).sum().backward()
        coll.finish_gradients()
        seen.append((rows.detach(),
                     {n: p.grad.coalesce() for n, p in coll.shards.items() if p.grad is not None}))
        for name, p in coll.shards.items():
            if p.grad is not None:
                coll.optimizers[name].step()
            p.grad = None
    seen.append({n: p.detach().clone() for n, p in coll.shards.items()})
    seen.append(coll.stats.as_dict())
    return seen


def fused_lookup(dedup_arg: str, bad_ids: str) -> None:
    dedup = dedup_arg == "dedup"
    rank, world = dist.get_rank(), dist.get_world_size()
    fused = run(collection(world, rank, dedup, bad_ids), lambda c, *a: c.lookup_fields(*a), rank)
    per_feature = run(collection(world, rank, dedup, bad_ids), tables.lookup_fields, rank)
    for (rows_a, grads_a), (rows_b, grads_b) in zip(fused[:3], per_feature[:3]):
        assert torch.equal(rows_a, rows_b)
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            assert torch.equal(grads_a[name].indices(), grads_b[name].indices()), name
            assert torch.equal(grads_a[name].values(), grads_b[name].values()), name
    assert all(torch.equal(fused[3][n], per_feature[3][n]) for n in fused[3])
    assert fused[4] == per_feature[4], (fused[4], per_feature[4])
    assert (fused[4] != {}) == (world > 1)
    print("ok", rank)
