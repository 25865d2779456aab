"""Sharding plans: every row has exactly one owner, shard sizes, placement, memory."""
from __future__ import annotations

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
    owners, local = plan.owners(ids), plan.local_index(ids)
    seen = set()
    for rank in range(world):
        mine = plan.global_ids(rank)
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
    assert plan.tables["c"].global_ids(0).numel() == 0 and plan.tables["c"].local_rows(1) == 200


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
