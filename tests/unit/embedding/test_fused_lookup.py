"""`ShardedEmbeddingCollection.lookup_fields` (single-hot fields as one tensor) against the
per-feature path it replaces (`tables.lookup_fields`, one `Jagged.single` per field through
``forward``) at world 1: rows, gradients, optimizer updates and errors equal bit for bit."""
from __future__ import annotations

import pytest
import torch

from gmeta_ds.embedding import tables
from gmeta_ds.embedding.plan import ShardingPlan, TablePlan
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import TableConfig, unique_keys
from gmeta_ds.sparse import Jagged

# One table per single-hot field (every plan kind and optimizer), then the bags' tables.
SINGLE = [("age", 7, "replicated", "sgd"), ("item", 500, "row_wise", "adagrad"),
          ("brand", 90, "row_wise", "rowwise_adagrad"), ("city", 40, "table_wise", "adam"),
          ("price", 3, "replicated", "adagrad")]
TABLES = [TableConfig(name, rows, 4, (name,) + (("item_again",) if name == "item" else ()), optimizer=opt,
                      lr=0.1) for name, rows, _, opt in SINGLE] + [
    TableConfig("tags", 30, 4, ("tags", "genres"), pooling="mean"),
    TableConfig("hist", 60, 4, ("hist",), pooling="sum", optimizer="rowwise_adagrad"),
]
KINDS = {name: kind for name, _, kind, _ in SINGLE} | {"tags": "replicated", "hist": "row_wise"}
FIELDS = [name for name, *_ in SINGLE]


def collection(dedup: bool, bad_ids: str = "error") -> ShardedEmbeddingCollection:
    plan = ShardingPlan({t.name: TablePlan(t, KINDS[t.name], 1, "block" if t.name == "brand" else "modulo")
                         for t in TABLES}, 1)
    return ShardedEmbeddingCollection(plan, 0, seed=3, bad_ids=bad_ids, dedup=dedup)


def batch(seed: int, shape=(4, 9), spread: int = 1):
    """Single-hot ids (*shape, F) with many repeats (ids beyond a table with ``spread`` > 1)
    and bags of ``tags``, ``genres``, ``hist`` for its prod(shape) rows, some empty."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(-(spread > 1) * rows, rows * spread, shape, generator=g)
                       for _, rows, *_ in SINGLE], dim=-1)
    n = ids[..., 0].numel()

    def bags(rows: int) -> Jagged:
        lengths = torch.randint(0, 4, (n,), generator=g)
        return Jagged(torch.randint(0, rows, (int(lengths.sum()),), generator=g),
                      torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
    return ids, {"tags": bags(30), "hist": bags(60), "genres": bags(30)}


def train(coll: ShardedEmbeddingCollection, lookup, steps: int = 3, fields=FIELDS, bags=True, ids=None,
          shape=(4, 9)):
    """Rows and (coalesced) gradients of each step's lookup, then the tables after ``steps``
    updates; ids of `batch` (or ``ids``, every step)."""
    seen = []
    for step in range(steps):
        step_ids, multi = batch(step, shape, spread=3 if coll.bad_ids == "hash" else 1)
        rows = lookup(coll, step_ids if ids is None else ids, fields, multi if bags else None)
        g = torch.Generator().manual_seed(50 + step)
        (rows * torch.randn(rows.shape, generator=g)).sum().backward()
        seen.append((rows.detach(),
                     {n: p.grad.coalesce() for n, p in coll.shards.items() if p.grad is not None}))
        coll.step()
    return seen, {n: p.detach().clone() for n, p in coll.shards.items()}


def fused(coll, ids, fields, multi):
    return coll.lookup_fields(ids, fields, multi)


def assert_same(a, b):
    (seen_a, tables_a), (seen_b, tables_b) = a, b
    for (rows_a, grads_a), (rows_b, grads_b) in zip(seen_a, seen_b):
        assert torch.equal(rows_a, rows_b)
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            assert torch.equal(grads_a[name].indices(), grads_b[name].indices()), name
            assert torch.equal(grads_a[name].values(), grads_b[name].values()), name
    assert all(torch.equal(tables_a[n], tables_b[n]) for n in tables_a)


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("bad_ids", ["error", "hash"])
@pytest.mark.parametrize("bags", [True, False])
@pytest.mark.parametrize("shape", [(4, 9), (8, 40)])  # fewer keys than table rows, then more
def test_fused_lookup_equals_per_feature_path(dedup, bad_ids, bags, shape):
    assert_same(train(collection(dedup, bad_ids), fused, bags=bags, shape=shape),
                train(collection(dedup, bad_ids), tables.lookup_fields, bags=bags, shape=shape))
    assert collection(dedup).stats.as_dict() == {}


def test_fields_sharing_a_table_take_the_per_feature_path():
    """Two fields on one table (its gradient is the sum of one sum per field): the per-feature
    path, so the same result; the demo's layout (a table per field) takes the fused one."""
    ids, _ = batch(0)
    ids = torch.cat([ids, ids[..., 1:2].flip(0)], dim=-1)
    fields = FIELDS + ["item_again"]
    coll = collection(True)
    assert_same(train(coll, fused, fields=fields, bags=False, ids=ids),
                train(collection(True), tables.lookup_fields, fields=fields, bags=False, ids=ids))
    assert coll._field_tables == {(tuple(fields), ()): None}
    coll.lookup_fields(ids[..., :-1], FIELDS)
    assert coll._field_tables[(tuple(FIELDS), ())] is not None


@pytest.mark.parametrize("bad", [{1: 500}, {3: -1}, {4: 3, 1: -2}])
def test_out_of_range_ids_raise_the_same_error(bad):
    """The error names the first field (in field order) with a bad id, as the per-feature path."""
    ids, multi = batch(0)
    for column, value in bad.items():
        ids[2, 5 - column, column] = value
    errors = []
    for lookup in (fused, tables.lookup_fields):
        with pytest.raises(ValueError) as exc:
            lookup(collection(True), ids, FIELDS, multi)
        errors.append(str(exc.value))
    column = min(bad)
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"feature '{FIELDS[column]}': id {bad[column]} is out of range"), errors[0]
    ids, multi = batch(0)
    multi["hist"].values[0] = 60
    with pytest.raises(ValueError, match="feature 'hist': id 60 is out of range for table 'hist'"):
        fused(collection(True), ids, FIELDS, multi)


def test_unique_keys_matches_torch_unique():
    keys = torch.randint(0, 40, (50, 3), generator=torch.Generator().manual_seed(0))
    for bound in (40, 1000):  # presence table, then sort
        uniq, inverse = unique_keys(keys, bound)
        ref_uniq, ref_inverse = torch.unique(keys, return_inverse=True)
        assert torch.equal(uniq, ref_uniq) and torch.equal(inverse, ref_inverse)
    empty = unique_keys(torch.zeros(0, 3, dtype=torch.long), 0)
    assert empty[0].shape == (0,) and empty[1].shape == (0, 3)



@pytest.mark.parametrize("per_table", [2, 40])
def test_row_requests_take_one_unique_per_group_where_linear_and_equal_torch_unique(per_table, monkeypatch):
    """`_requests`: with small tables next to the ids, one unique of the group (flags) gives
    each table exactly ``torch.unique(ids, return_inverse=True)``; otherwise one per table."""
    from gmeta_ds.embedding.plan import plan_tables
    from gmeta_ds.embedding.sharding import exchange as sharded

    specs = [TableConfig("a", 13, 4, ("a1", "a2")), TableConfig("b", 29, 4, ("b1",)), TableConfig("c", 5, 4, ("c1",))]
    coll = ShardedEmbeddingCollection(plan_tables(specs, 1, {}), 0)
    g = torch.Generator().manual_seed(per_table)
    feats = {f: Jagged(torch.randint(0, t.num_rows, (per_table,), generator=g), torch.arange(per_table + 1))
             for t in specs for f in t.features}
    grouped = []
    original = sharded._requests_of_group
    monkeypatch.setattr(sharded, "_requests_of_group", lambda *a: grouped.append(a[0]) or original(*a))
    requests = coll._requests(feats)
    assert grouped == ([["a", "b", "c"]] if per_table == 40 else [])  # 47 rows <= 4 x 160 ids; not <= 4 x 8
    for t in specs:
        ids = torch.cat([feats[f].values for f in t.features])
        distinct, inverse = torch.unique(ids, return_inverse=True)
        assert torch.equal(requests[t.name].ids, distinct) and torch.equal(requests[t.name].inverse, inverse)
