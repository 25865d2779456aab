"""Dynamic tables: the id -> row map (admission, LRU/LFU eviction, capacity), stable hashing,
owner-independent initial rows, the unsharded twin, and world-1 training through the collection."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gmeta_ds.embedding.dynamic import CapacityError, DynamicIndex, init_dynamic_rows, mix64, owner_of
from gmeta_ds.sparse import hash_strings
from gmeta_ds.embedding.plan import plan_tables
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import EmbeddingCollection, TableConfig
from gmeta_ds.sparse import Jagged

M64 = (1 << 64) - 1


def splitmix_reference(x: int, salt: int) -> int:
    """splitmix64's finaliser in Python integers (the reference for the int64 tensor version)."""
    z = (x + salt * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def test_mix64_equals_the_python_reference_on_extreme_ids():
    ids = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345, -987654321]
    got = mix64(torch.tensor(ids), 7).tolist()
    assert got == [splitmix_reference(i & M64, 7) for i in ids]
    assert all(0 <= g < 2**63 for g in got)


def test_string_hash_is_stable_and_distinguishes():
    ids = hash_strings(["item-1", "item-2", "item-1"])
    assert ids[0] == ids[2] != ids[1]
    assert int(hash_strings(["item-1"])[0]) == 8346134991837929334  # fixed forever: ids in checkpoints


def test_owner_spreads_ids_and_initial_rows_do_not_depend_on_who_asks():
    ids = torch.arange(10_000) * 7919
    counts = torch.bincount(owner_of(ids, 4), minlength=4)
    assert counts.min() > 2300  # ~2500 each
    rows = init_dynamic_rows("t", 8, 0.05, 3, ids[:50])
    again = init_dynamic_rows("t", 8, 0.05, 3, ids[:50].flip(0)).flip(0)
    assert torch.equal(rows, again)
    big = init_dynamic_rows("t", 16, 1.0, 3, torch.arange(20_000))
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 1.0) < 0.01
    assert not torch.equal(rows, init_dynamic_rows("t", 8, 0.05, 4, ids[:50]))


def test_admission_after_a_count_then_lru_eviction_keeps_recent_rows():
    index = DynamicIndex("t", capacity=3, admit_after=2, eviction="lru")
    rows, admitted = index.lookup(torch.tensor([10, 20]), torch.tensor([1, 2]))
    assert rows.tolist()[0] == 0 and rows.tolist()[1] > 0  # 10 seen once: default row; 20 twice
    assert admitted.ids.tolist() == [20]
    rows, _ = index.lookup(torch.tensor([10, 30]), torch.tensor([1, 2]))  # 10 now seen twice
    assert (rows > 0).all() and index.occupancy == 3
    # full: 50 needs a row; 20 (used at lookup 1) is less recent than 10 (lookup 2)
    before = {int(k): int(r) for k, r in zip(index.keys, index.rows)}
    rows, admitted = index.lookup(torch.tensor([50, 30]), torch.tensor([2, 1]))
    assert admitted.evicted == 1 and int(index.find(torch.tensor([20]))) == 0
    assert int(rows[0]) == before[20]  # 50 took 20's row
    assert index.counters["evictions"] == 1 and index.counters["admissions"] == 4


def test_lfu_eviction_keeps_frequent_rows():
    index = DynamicIndex("t", capacity=2, eviction="lfu")
    index.lookup(torch.tensor([1, 2]), torch.tensor([5, 1]))
    index.lookup(torch.tensor([1]), torch.tensor([1]))  # 2 is the most recent but least frequent
    index.lookup(torch.tensor([3]), torch.tensor([1]))
    assert index.find(torch.tensor([1, 2, 3])).gt(0).tolist() == [True, False, True]


def test_one_lookup_needing_more_rows_than_the_capacity_names_the_table():
    index = DynamicIndex("items", capacity=2)
    with pytest.raises(CapacityError, match="table 'items'.*capacity is 2.*embedding.tables.items.capacity"):
        index.lookup(torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.long))


def test_bad_dynamic_table_configs_name_the_table():
    with pytest.raises(ValueError, match="table 'u'.*capacity"):
        TableConfig("u", 0, 4, ("u",), kind="dynamic")
    with pytest.raises(ValueError, match="table 'u'.*eviction 'fifo'"):
        TableConfig("u", 0, 4, ("u",), kind="dynamic", capacity=8, eviction="fifo")
    with pytest.raises(ValueError, match="table 'u'.*kind 'hashed'"):
        TableConfig("u", 8, 4, ("u",), kind="hashed")
    table = TableConfig("u", 0, 4, ("u",), kind="dynamic", capacity=8)
    with pytest.raises(ValueError, match="table 'u' is dynamic.*plan must be auto"):
        plan_tables([table], 2, {"u": "row_wise"})


def test_float_ids_are_refused_naming_the_table():
    table = TableConfig("u", 0, 4, ("u",), kind="dynamic", capacity=8)
    emb = ShardedEmbeddingCollection(plan_tables([table], 1, {}), 0)
    with pytest.raises(ValueError, match="feature 'u'.*table 'u' must be integers, got torch.float32"):
        emb({"u": Jagged.single(torch.tensor([1.0, 2.0]))})


def test_accelerator_placement_without_one_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has an accelerator")
    table = TableConfig("u", 100, 4, ("u",), device="accelerator")
    with pytest.raises(ValueError, match="table 'u': device accelerator, but this rank has no accelerator"):
        ShardedEmbeddingCollection(plan_tables([table], 1, {}), 0)


def _dynamic_collection(capacity=64, admit_after=1, eviction="lru", optimizer="adagrad"):
    tables = [TableConfig("u", 0, 4, ("u", "u_bag"), kind="dynamic", capacity=capacity,
                          admit_after=admit_after, eviction=eviction, optimizer=optimizer, lr=0.1),
              TableConfig("s", 50, 4, ("s",))]
    return tables, ShardedEmbeddingCollection(plan_tables(tables, 1, {}), 0, seed=3)


def test_world_one_dynamic_lookups_match_the_twin_and_train_only_their_rows():
    tables, emb = _dynamic_collection(admit_after=2)
    ids = torch.tensor([2**40 + 5, -7, 2**40 + 5, 99])
    feats = {"u": Jagged.single(ids), "u_bag": Jagged(torch.tensor([99, -7, 3]), torch.tensor([0, 2, 3])),
             "s": Jagged.single(torch.tensor([1, 2, 1, 3]))}
    out = emb(feats)
    index = emb.dynamic["u"]
    assert sorted(index.keys.tolist()) == [-7, 99, 2**40 + 5]  # 3 was looked up once
    expected = init_dynamic_rows("u", 4, 0.05, 3, ids)
    torch.testing.assert_close(out["u"], expected)
    twin = EmbeddingCollection(tables, seed=3)
    twin.load_state_dict({**{f"weights.s": emb.gather_tables()["s"]},
                          **{k: v for k, v in emb.gather_state().items() if k.startswith("dynamic.")}})
    for name, value in twin(feats).items():
        torch.testing.assert_close(value, out[name], msg=name)
    sum(v.sum() for v in out.values()).backward()
    grad = emb.shards["u"].grad.coalesce()
    touched = sorted(grad.indices()[0].tolist())
    assert touched == sorted([0, *index.find(torch.tensor([-7, 99, 2**40 + 5])).tolist()])
    before = emb.shards["u"].detach().clone()
    emb.step()
    changed = (emb.shards["u"].detach() != before).any(1).nonzero().squeeze(1).tolist()
    assert changed == touched


def test_a_reused_row_starts_fresh_and_loses_the_evicted_ids_gradient():
    _, emb = _dynamic_collection(capacity=2, optimizer="adagrad")
    emb({"u": Jagged.single(torch.tensor([1, 2]))})["u"].sum().backward()
    emb.step()
    sum_state = emb.optimizers["u"].state[emb.shards["u"]]["sum"]
    assert sum_state[1:].abs().sum() > 0
    emb({"u": Jagged.single(torch.tensor([1]))})["u"].sum().backward()  # pending gradient for 1
    emb({"u": Jagged.single(torch.tensor([3, 2]))})  # 1 is the LRU: evicted, its row goes to 3
    row = int(emb.dynamic["u"].find(torch.tensor([3])))
    torch.testing.assert_close(emb.shards["u"].detach()[row], init_dynamic_rows("u", 4, 0.05, 3, torch.tensor([3]))[0])
    assert float(sum_state[row].abs().sum()) == 0.0
    assert row not in emb.shards["u"].grad.coalesce().indices()[0].tolist()


def test_memory_of_a_dynamic_table_stays_flat_while_ids_grow_past_its_capacity():
    _, emb = _dynamic_collection(capacity=1000, admit_after=2)

    def held_bytes():
        index = emb.dynamic["u"]
        tensors = [emb.shards["u"], index.keys, index.rows, index.taken, index.last_used, index.uses, index.sketch,
                   *[v for v in emb.optimizers["u"].state.get(emb.shards["u"], {}).values() if torch.is_tensor(v)]]
        return sum(t.numel() * t.element_size() for t in tensors)

    sizes = []
    g = torch.Generator().manual_seed(0)
    for step in range(40):  # 40 x 500 fresh ids each seen twice: 20x the capacity
        ids = torch.randint(0, 2**62, (500,), generator=g).repeat(2)
        emb({"u": Jagged.single(ids)})["u"].sum().backward()
        emb.step()
        sizes.append(held_bytes())
    index = emb.dynamic["u"]
    assert index.occupancy == 1000 and index.counters["evictions"] >= 19_000 - 1000
    assert max(sizes[2:]) <= 1.05 * sizes[2]


def _filled_shards(world: int, capacity: int, seed_ids: int = 0):
    """World-``world`` dynamic shards (built in one process: no lookups cross ranks here) whose
    owners admitted ~60 ids each by the owner-side map, with Adagrad state after a step."""
    from gmeta_ds.embedding.dynamic import owner_of

    table = TableConfig("u", 0, 4, ("u",), kind="dynamic", capacity=capacity, admit_after=2, eviction="lfu")
    plan = plan_tables([table], world, {})
    ids = torch.randint(-2**60, 2**60, (400,), generator=torch.Generator().manual_seed(seed_ids))
    shards = []
    for rank in range(world):
        emb = ShardedEmbeddingCollection(plan, rank, seed=1)
        mine = ids[owner_of(ids, world) == rank]
        rows = emb.strategy["u"].admit("u", mine, torch.full_like(mine, 2))
        torch.nn.functional.embedding(rows, emb.shards["u"], sparse=True).sum().backward()
        emb.step()
        emb.strategy["u"].admit("u", mine[:5], torch.ones(5, dtype=torch.long))  # some use counts differ
        shards.append(emb)
    return table, shards


def _entries(shards) -> dict[int, tuple]:
    """id -> (row, Adagrad state row) over every rank."""
    out = {}
    for emb in shards:
        index, shard = emb.dynamic["u"], emb.shards["u"].detach()
        state = emb.optimizers["u"].state[emb.shards["u"]]["sum"]
        for key, row in zip(index.keys.tolist(), index.rows.tolist()):
            out[key] = (shard[row], state[row])
    return out


@pytest.mark.parametrize("new_world", [2, 3, 1])
def test_checkpointed_dynamic_tables_resume_exactly_or_reshard(new_world):
    from gmeta_ds.checkpoint import load_shard_state, shard_state
    from gmeta_ds.embedding.dynamic import owner_of

    table, old = _filled_shards(2, capacity=400)
    files = [shard_state(emb) for emb in old]
    new = []
    for rank in range(new_world):
        emb = ShardedEmbeddingCollection(plan_tables([table], new_world, {}), rank, seed=1)
        load_shard_state(emb, files)
        new.append(emb)
        assert (owner_of(emb.dynamic["u"].keys, new_world) == rank).all()
    before, after = _entries(old), _entries(new)
    assert before.keys() == after.keys()
    for key, (row, state) in before.items():
        assert torch.equal(after[key][0], row) and torch.equal(after[key][1], state)
    if new_world == 2:  # the same world: the map, sketch, counters and default row exactly
        for a, b in zip(old, new):
            ia, ib = a.dynamic["u"], b.dynamic["u"]
            assert torch.equal(ia.keys, ib.keys) and torch.equal(ia.rows, ib.rows)
            assert torch.equal(ia.uses, ib.uses) and torch.equal(ia.last_used, ib.last_used)
            assert torch.equal(ia.sketch, ib.sketch) and ia.counters == ib.counters and ia.clock == ib.clock
            assert torch.equal(a.shards["u"].detach(), b.shards["u"].detach())


def test_resuming_into_a_smaller_capacity_keeps_the_most_used_ids():
    from gmeta_ds.checkpoint import load_shard_state, shard_state

    table, old = _filled_shards(1, capacity=400)
    files = [shard_state(old[0])]
    small = ShardedEmbeddingCollection(plan_tables([dataclasses.replace(table, capacity=10)], 1, {}), 0, seed=1)
    load_shard_state(small, files)
    index = old[0].dynamic["u"]
    most_used = index.keys[torch.argsort(index.uses[index.rows], descending=True, stable=True)[:10]]
    assert sorted(small.dynamic["u"].keys.tolist()) == sorted(most_used.tolist())
    assert small.dynamic["u"].occupancy == 10


def test_a_static_checkpoint_does_not_load_into_a_dynamic_table():
    from gmeta_ds.checkpoint import load_shard_state, shard_state
    from gmeta_ds.errors import ConfigError

    static = ShardedEmbeddingCollection(plan_tables([TableConfig("u", 50, 4, ("u",))], 1, {}), 0)
    _, dynamic = _filled_shards(1, capacity=400)
    with pytest.raises(ConfigError, match="table 'u' is not dynamic"):
        load_shard_state(dynamic[0], [shard_state(static)])
    with pytest.raises(ConfigError, match="table 'u' is dynamic; the config makes it static"):
        load_shard_state(static, [shard_state(dynamic[0])])


def test_value_ids_keep_canonical_integers_and_agree_with_duckdb():
    import duckdb

    from gmeta_ds.sparse import string_id, value_id

    texts = ["42", "-7", "0", "-0", "042", "+1", "²", "9223372036854775807", "9223372036854775808",
             "item-1", "unknown", ""]
    got = [value_id(t) for t in texts]
    assert got[:3] == [42, -7, 0] and got[7] == 2**63 - 1
    assert got[3] == string_id("-0") and got[4] == string_id("042") and got[8] == string_id("9223372036854775808")
    from gmeta_ds.data.stream import raw_id_sql

    sql = (f"SELECT {raw_id_sql('v', integer=False)} "
           "FROM (SELECT unnest(?) AS v, generate_subscripts(?, 1) AS i) ORDER BY i")
    assert [r[0] for r in duckdb.execute(sql, [texts, texts]).fetchall()] == got


def test_padding_ids_read_the_default_row_and_are_never_counted():
    from gmeta_ds.sparse import PAD_ID

    index = DynamicIndex("t", capacity=4, admit_after=1)
    rows, admitted = index.lookup(torch.tensor([PAD_ID, 5, PAD_ID]), torch.tensor([3, 1, 2]))
    assert rows.tolist()[0] == rows.tolist()[2] == 0 and rows.tolist()[1] > 0
    assert admitted.ids.tolist() == [5] and index.counters["lookups"] == 1 and index.occupancy == 1
