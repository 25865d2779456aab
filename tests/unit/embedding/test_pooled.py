"""Pooling on the owner (`exchange: pooled`) in one process: equal to the unsharded twin in
forward, gradients and updates, with the row exchange's errors for bad ids. (Real ranks:
tests/distributed/test_sharded_embedding.py.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gmeta_ds.embedding.plan import plan_tables
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import EmbeddingCollection, TableConfig
from gmeta_ds.sparse import Jagged

TABLES = [TableConfig("tags", 50, 4, ("tags", "tags_too"), pooling="mean", exchange="pooled", optimizer="sgd"),
          TableConfig("cats", 9, 4, ("cats",), pooling="sum", exchange="pooled", optimizer="sgd"),
          TableConfig("deep", 7, 3, ("deep",), pooling="sum", exchange="pooled", optimizer="sgd")]


def bags(lengths: list[int], rows: int, seed: int) -> Jagged:
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return Jagged(torch.randint(0, rows, (int(offsets[-1]),), generator=g), offsets)


def features() -> dict[str, Jagged]:
    return {"tags": bags([3, 0, 5, 1], 50, 1), "tags_too": bags([2, 2], 50, 2), "cats": bags([4, 4, 0], 9, 3),
            "deep": bags([6], 7, 4)}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("kind", ["row_wise", "table_wise"])
def test_pooled_lookup_gradients_and_step_equal_the_unsharded_twin(kind, optimizer):
    tables = [dataclasses.replace(t, optimizer=optimizer) for t in TABLES]
    plan = plan_tables(tables, 1, {t.name: kind for t in tables})
    sharded, twin = ShardedEmbeddingCollection(plan, 0, seed=3), EmbeddingCollection(tables, seed=3)
    assert sharded.pooled == {"tags", "cats", "deep"}
    feats = features()
    out_s, out_u = sharded(feats), twin(feats)
    assert list(out_s) == list(feats)
    weights = {f: torch.randn(v.shape, generator=torch.Generator().manual_seed(len(f))) for f, v in out_u.items()}
    for f in feats:
        torch.testing.assert_close(out_s[f], out_u[f], msg=f)
    sum((out_s[f] * w).sum() for f, w in weights.items()).backward()
    sum((out_u[f] * w).sum() for f, w in weights.items()).backward()
    for name, weight in twin.weights.items():
        grad = sharded.shards[name].grad
        used = torch.cat([feats[f].values for f in feats if sharded.by_feature[f].name == name])
        # one entry per id looked up: SGD adds them one by one, Adagrad sums each row's first
        assert grad.is_sparse and torch.equal(grad._indices()[0].sort()[0], used.sort()[0])
        torch.testing.assert_close(grad.to_dense(), weight.grad, msg=name)
    sharded.step()
    with torch.no_grad():
        for name, weight in twin.weights.items():
            g = weight.grad
            step = g if optimizer == "sgd" else g / (g.abs() + 1e-10)  # Adagrad's first step
            torch.testing.assert_close(sharded.shards[name], weight - 0.05 * step, msg=name)


def test_bad_ids_name_the_feature_and_hash_maps_them():
    plan = plan_tables(TABLES, 1, {})
    sharded = ShardedEmbeddingCollection(plan, 0)
    feats = features()
    feats["cats"] = Jagged(torch.tensor([1, 9, 2]), torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match="feature 'cats': id 9 is out of range for table 'cats' with 9 rows"):
        sharded(feats)
    feats["cats"] = Jagged(torch.tensor([1.0, 2.0]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="feature 'cats': ids of table 'cats' must be integers"):
        sharded(feats)
    hashed = ShardedEmbeddingCollection(plan, 0, bad_ids="hash")
    twin = EmbeddingCollection(TABLES, bad_ids="hash")
    feats["cats"] = Jagged(torch.tensor([1, 9, -2]), torch.tensor([0, 2, 3]))
    torch.testing.assert_close(hashed(feats)["cats"], twin(feats)["cats"])


def test_a_group_without_ids_still_returns_every_bag():
    plan = plan_tables(TABLES, 1, {})
    sharded = ShardedEmbeddingCollection(plan, 0)
    empty = {"tags": Jagged(torch.zeros(0, dtype=torch.long), torch.zeros(4, dtype=torch.long))}
    out = sharded(empty)["tags"]
    assert out.shape == (3, 4) and out.abs().sum() == 0 and out.requires_grad


@pytest.mark.parametrize("world", [2, 3, 8, 9, 12])
def test_partition_by_owner_is_a_stable_sort(world):
    from gmeta_ds.embedding.sharding.owner_pooled import partition_bags

    owners = torch.randint(0, world, (1000,), generator=torch.Generator().manual_seed(world))
    owners[:5] = 0  # runs of one owner, and owners that hold nothing
    owners[owners == world - 1] = 0
    values = torch.arange(1000) * 7
    expected = values[torch.argsort(owners, stable=True)]
    assert torch.equal(partition_bags(values, owners, world, torch.bincount(owners, minlength=world)), expected)


def test_requests_and_their_buffer_are_the_documented_wire():
    """`bags`' worked example, built by the strategy: world 2, row i on rank i % 2; rank 0's
    bags [[4, 9, 6], [9]] are local rows [2, 3, 4, 4] grouped by owner, one (code, length) per
    (bag, owner), and owner 1's buffer is [4, 4 | 0, 1 | 1, 1] (int32); unpacking gives them back."""
    from gmeta_ds.embedding.sharding.bags import pack_bags, unpack_bags

    table = TableConfig("t", 10, 4, ("t",), pooling="sum", exchange="pooled", optimizer="sgd")
    emb = ShardedEmbeddingCollection(plan_tables([table], 2, {"t": "row_wise"}), 0)
    sent = []
    emb.strategy["t"].exchange = lambda layout, requests: (sent.append((layout, requests)) or
                                                           (torch.zeros(len(requests.codes), 4), requests.codes))
    emb({"t": Jagged(torch.tensor([4, 9, 6, 9]), torch.tensor([0, 3, 4]))})
    layout, requests = sent[0]
    assert [r.tolist() for r in requests] == [[2, 3, 4, 4], [0, 0, 1], [2, 1, 1], [2, 2], [1, 2]]
    buffer = pack_bags(requests, layout.wire_dtype)
    assert buffer.dtype == torch.int32 and buffer.tolist() == [2, 3, 0, 2, 4, 4, 0, 1, 1, 1]
    back = unpack_bags(buffer.long(), requests.n_ids, requests.n_pairs)
    assert all(torch.equal(a, b) for a, b in zip(back, requests))
