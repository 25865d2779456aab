"""The unsharded twin against torch's own nn.Embedding / nn.EmbeddingBag; ids; init."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gmeta_ds.embedding import tables
from gmeta_ds.embedding.tables import EmbeddingCollection, TableConfig, check_ids, init_rows, lookup_fields
from gmeta_ds.sparse import Jagged


def bag_reference(weight: torch.Tensor, jagged: Jagged, mode: str) -> torch.Tensor:
    bag = nn.EmbeddingBag(weight.shape[0], weight.shape[1], mode=mode)
    bag.weight.data.copy_(weight)
    return bag(jagged.values, jagged.offsets[:-1])


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_pooled_lookup_and_gradient_match_embedding_bag(pooling):
    table = TableConfig("t", 13, 5, ("f",), pooling=pooling)
    ec = EmbeddingCollection([table], seed=1)
    jagged = Jagged(torch.tensor([4, 9, 9, 1, 12, 0]), torch.tensor([0, 2, 2, 5, 6]))  # one empty bag
    out = ec({"f": jagged})["f"]
    weight = ec.weights["t"].detach().clone().requires_grad_()
    bag = nn.EmbeddingBag(13, 5, mode=pooling, _weight=weight)
    ref = bag(jagged.values, jagged.offsets[:-1])
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(ec.weights["t"].grad, bag.weight.grad)
    assert torch.all(out[1] == 0)


def test_unpooled_and_single_hot_match_embedding():
    tables = [TableConfig("a", 7, 3, ("x", "y"), pooling="none"), TableConfig("b", 5, 3, ("z",))]
    ec = EmbeddingCollection(tables, seed=2)
    ids = torch.tensor([[1, 6, 4], [1, 0, 0]])
    rows = lookup_fields(ec, ids, ["x", "y", "z"])
    assert rows.shape == (2, 3, 3)
    torch.testing.assert_close(rows[:, 0], nn.functional.embedding(ids[:, 0], ec.weights["a"]))
    torch.testing.assert_close(rows[:, 2], nn.functional.embedding(ids[:, 2], ec.weights["b"]))
    seq = ec({"x": Jagged(torch.tensor([3, 3, 2]), torch.tensor([0, 3]))})["x"]
    torch.testing.assert_close(seq, ec.weights["a"][[3, 3, 2]])


def test_init_depends_only_on_seed_table_and_row():
    table = TableConfig("big", 200_000, 2, ("f",))
    ids = torch.tensor([199_999, 5, 70_000, 5])
    rows = init_rows(table, 3, ids)
    torch.testing.assert_close(rows[1], rows[3])
    torch.testing.assert_close(rows[0], init_rows(table, 3, torch.tensor([199_999]))[0])
    full = init_rows(table, 3, torch.arange(200_000))
    torch.testing.assert_close(full[ids], rows)
    assert not torch.equal(init_rows(table, 4, ids), rows)
    assert full.std().item() == pytest.approx(0.05, rel=0.05)


def test_out_of_range_ids_name_feature_table_and_value():
    table = TableConfig("item", 10, 2, ("item_id",))
    with pytest.raises(ValueError, match=r"feature 'item_id': id 10 is out of range for table 'item' "
                                         r"with 10 rows \(valid: 0\.\.9\)"):
        check_ids(torch.tensor([3, 10]), "item_id", table, "error")
    with pytest.raises(ValueError, match="id -2 is out of range"):
        EmbeddingCollection([table])({"item_id": Jagged.single(torch.tensor([-2, 1]))})
    torch.testing.assert_close(check_ids(torch.tensor([-2, 13, 4]), "item_id", table, "hash"),
                               torch.tensor([8, 3, 4]))


def test_bad_table_configs_are_rejected():
    with pytest.raises(ValueError, match="pooling 'max' is not one of sum, mean, none"):
        TableConfig("t", 3, 2, ("f",), pooling="max")
    with pytest.raises(ValueError, match="must be positive"):
        TableConfig("t", 0, 2, ("f",))
    with pytest.raises(ValueError, match="feature 'f' is assigned to tables 'a' and 'b'"):
        EmbeddingCollection([TableConfig("a", 3, 2, ("f",)), TableConfig("b", 3, 2, ("f",))])


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_single_hot_pooling_shortcut_is_exact(pooling):
    """`Jagged.single` ids skip pooling; the result and the gradient equal pooling the same
    ids as one-element bags (the index_add path) exactly."""
    ids = torch.tensor([3, 0, 3, 7, 1])
    rows = torch.randn(5, 4, requires_grad=True)
    bags = Jagged(ids, torch.arange(6))
    assert Jagged.single(ids).one_per_sample and not bags.one_per_sample
    fast, slow = tables.pool(rows, Jagged.single(ids), pooling), tables.pool(rows, bags, pooling)
    assert torch.equal(fast, slow)
    weights = torch.randn(5, 4)
    grad_fast, = torch.autograd.grad((fast * weights).sum(), rows)
    grad_slow, = torch.autograd.grad((slow * weights).sum(), rows)
    assert torch.equal(grad_fast, grad_slow)
