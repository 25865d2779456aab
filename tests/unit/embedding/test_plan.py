"""Sharding plans: every row has exactly one owner, shard sizes, placement, memory."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gmeta_ds.embedding.plan import TablePlan, plan_tables
from gmeta_ds.embedding.tables import TableConfig

TABLE = TableConfig("t", 103, 4, ("f",))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("row_owner", ["modulo", "block"])
def test_row_wise_owners_and_local_indices_are_a_bijection(world, row_owner):
    plan = TablePlan(TABLE, "row_wise", world, row_owner)
    ids = torch.arange(TABLE.num_rows)
    owners, local = plan.layout.owners(ids), plan.layout.local_index(ids)
    seen = set()
    for rank in range(world):
        mine = plan.layout.global_ids(rank)
        assert len(mine) <= math.ceil(TABLE.num_rows / world)
        assert torch.all(owners[mine] == rank)
        assert torch.equal(local[mine], torch.arange(len(mine)))  # dense local storage
        seen.update(mine.tolist())
    assert seen == set(range(TABLE.num_rows))


def test_table_wise_places_largest_tables_on_least_loaded_ranks():
    tables = [TableConfig(n, rows, 4, (n,)) for n, rows in (("a", 1000), ("b", 900), ("c", 200), ("d", 150))]
    plan = plan_tables(tables, 2, {t.name: "table_wise" for t in tables})
    owners = {n: p.owner for n, p in plan.tables.items()}
    assert owners == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert plan.tables["c"].layout.global_ids(0).numel() == 0 and plan.tables["c"].layout.local_rows(1) == 200


def test_auto_replicates_small_tables_and_shards_large_ones():
    tables = [TableConfig("small", 10, 4, ("s",)), TableConfig("large", 5000, 4, ("l",))]
    plan = plan_tables(tables, 4, {}, replicate_below_rows=100)
    assert plan.tables["small"].kind == "replicated" and plan.tables["large"].kind == "row_wise"


def test_memory_estimate_counts_rows_and_optimizer_state():
    tables = [TableConfig("a", 1000, 8, ("a",), optimizer="adam"),
              TableConfig("b", 1000, 8, ("b",), optimizer="rowwise_adagrad")]
    one = plan_tables(tables, 1, {"a": "row_wise", "b": "row_wise"}).bytes_per_rank()
    two = plan_tables(tables, 2, {"a": "row_wise", "b": "row_wise"}).bytes_per_rank()
    assert one == [4 * (1000 * 8 * 3) + 4 * (1000 * 8 + 1000)]
    assert two == [one[0] // 2, one[0] // 2]


def test_plan_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown table\(s\) \['nope'\]; tables are t"):
        plan_tables([TABLE], 2, {"nope": "row_wise"})
    with pytest.raises(ValueError, match="plan 'diagonal' is not one of row_wise, table_wise, replicated"):
        TablePlan(TABLE, "diagonal", 2)
    with pytest.raises(ValueError, match="owner rank 3 outside world size 2"):
        TablePlan(TABLE, "table_wise", 2, owner=3)


def test_exchange_auto_pools_long_bags_and_keeps_rows_for_short_ones():
    from gmeta_ds.embedding.plan import exchange_bytes
    from gmeta_ds.sparse import BagStats

    table = TableConfig("t", 10_000, 16, ("t",))
    long_bags, short_bags = BagStats(50, 0.4), BagStats(1.5, 0.4)
    # rows: 50 x 0.4 distinct ids x (8 + 8 x 16) B; pooled table-wise: 50 x 16 B + one 16-float sum and gradient
    assert exchange_bytes("table_wise", 2, 16, long_bags) == (50 * 0.4 * 136, 50 * 16 + 128)
    rows, pooled = exchange_bytes("row_wise", 4, 16, short_bags)
    assert pooled == pytest.approx(16 * 1.5 + 4 * (1 - 0.75 ** 1.5) * 128)
    for kind in ("row_wise", "table_wise"):
        plan = plan_tables([table], 4, {"t": kind}, bag_stats={"t": long_bags})
        assert plan.tables["t"].exchange == "pooled" and plan.tables["t"].estimate is not None
        assert "pooled on the owner (est." in plan.describe()
        assert plan_tables([table], 4, {"t": kind}, bag_stats={"t": short_bags}).tables["t"].exchange == "rows"
    # no statistics: rows; a forced choice wins over the estimate
    assert plan_tables([table], 4, {"t": "row_wise"}).tables["t"].exchange == "rows"
    forced = plan_tables([dataclasses.replace(table, exchange="rows")], 4, {"t": "row_wise"},
                         bag_stats={"t": long_bags})
    assert forced.tables["t"].exchange == "rows"


@pytest.mark.parametrize("kind,changes,what", [
    ("replicated", {}, "replicated, static, pooling sum"),
    ("row_wise", {"pooling": "none"}, "pooling none"),
])
def test_exchange_pooled_on_a_table_that_cannot_pool_names_the_table(kind, changes, what):
    table = TableConfig("tags", 5000, 8, ("tags",), exchange="pooled", **changes)
    with pytest.raises(ValueError, match=f"table 'tags': exchange pooled needs .*{what}"):
        plan_tables([table], 2, {"tags": kind})
    with pytest.raises(ValueError, match="exchange 'bag' is not one of auto, rows, pooled"):
        TableConfig("tags", 5000, 8, ("tags",), exchange="bag")


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_modulo_equals_floored_remainder_and_division(world):
    """Row-wise owners and local rows: a mask and a shift for powers of two, as % and //."""
    from gmeta_ds.embedding.layout import modulo

    ids = torch.randint(-2**40, 2**40, (5000,), generator=torch.Generator().manual_seed(world))
    owner, local = modulo(ids, world)
    assert torch.equal(owner, ids % world) and torch.equal(local, torch.div(ids, world, rounding_mode="floor"))


def test_strategy_name_is_the_one_selection_and_every_name_is_registered():
    """A table's strategy comes from `sharding.base.strategy_name` alone (no branch beside
    it in the collection), and every name it gives is in `registry.SHARDINGS`."""
    from gmeta_ds.embedding.sharding.base import strategy_name
    from gmeta_ds.registry import SHARDINGS
    from gmeta_ds.sparse import BagStats

    table = TableConfig("t", 10_000, 16, ("t",))
    pooled = plan_tables([table], 4, {"t": "row_wise"}, bag_stats={"t": BagStats(50, 0.4)}).tables["t"]
    rows = plan_tables([table], 4, {"t": "row_wise"}).tables["t"]
    assert strategy_name(pooled) == "owner_pooled"
    assert strategy_name(pooled, hierarchical=True) == "hierarchical_pooled"
    assert strategy_name(rows) == strategy_name(rows, hierarchical=True) == "row_wise"
    for name in ("owner_pooled", "hierarchical_pooled", "row_wise"):
        assert name in SHARDINGS.names()
