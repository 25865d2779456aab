"""Sparse optimizers update exactly the touched rows, as their dense counterparts would."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gmeta_ds.embedding.optim import RowWiseAdagrad, build_sparse_optimizer


def sparse_step(name: str, steps: int = 3):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(6, 3))
    start = weight.detach().clone()
    opt = build_sparse_optimizer(name, weight, lr=0.1)
    grads = []
    for _ in range(steps):
        ids = torch.tensor([1, 4, 4])
        loss = (nn.functional.embedding(ids, weight, sparse=True) * torch.randn(3, 3)).sum()
        loss.backward()
        grads.append(weight.grad.to_dense().clone())
        opt.step()
        weight.grad = None
    return start, weight.detach(), grads


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_untouched_rows_never_move(name):
    start, end, _ = sparse_step(name)
    untouched = [0, 2, 3, 5]
    torch.testing.assert_close(end[untouched], start[untouched])
    assert not torch.allclose(end[[1, 4]], start[[1, 4]])


@pytest.mark.parametrize("name, dense", [("sgd", torch.optim.SGD), ("adagrad", torch.optim.Adagrad)])
def test_sparse_matches_dense_optimizer(name, dense):
    start, end, grads = sparse_step(name)
    w = nn.Parameter(start.clone())
    opt = dense([w], lr=0.1)
    for g in grads:
        w.grad = g
        opt.step()
    torch.testing.assert_close(end, w.detach())


def test_rowwise_adagrad_closed_form():
    start, end, grads = sparse_step("rowwise_adagrad", steps=2)
    expected, acc = start.clone(), torch.zeros(6)
    for g in grads:
        acc += g.pow(2).mean(1)
        touched = g.abs().sum(1) > 0
        expected[touched] -= 0.1 * g[touched] / (acc[touched].sqrt().unsqueeze(1) + 1e-10)
    torch.testing.assert_close(end, expected)


def test_rowwise_adagrad_rejects_dense_gradients_and_unknown_names():
    w = nn.Parameter(torch.zeros(2, 2))
    w.grad = torch.ones(2, 2)
    with pytest.raises(ValueError, match="expects sparse row gradients"):
        RowWiseAdagrad([w]).step()
    with pytest.raises(ValueError, match="'lamb' is not one of sgd, adagrad, rowwise_adagrad, adam"):
        build_sparse_optimizer("lamb", w, 0.1)


def test_adagrad_rows_is_torchs_sparse_adagrad():
    from gmeta_ds.embedding.optim import adagrad_rows

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(50, 4))
    b = torch.nn.Parameter(a.detach().clone())
    torch_adagrad, ours = torch.optim.Adagrad([a], lr=0.05), torch.optim.Adagrad([b], lr=0.05)
    for _ in range(4):  # repeated rows in one gradient, rows touched again later
        grad = torch.sparse_coo_tensor(torch.randint(0, 50, (1, 30)), torch.randn(30, 4), (50, 4))
        a.grad, b.grad = grad.clone(), grad.clone()
        torch_adagrad.step()
        adagrad_rows(ours, b)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # (x * -lr then add vs torch's fused alpha)
        # a repeated row's entries are summed in another order (index_add, not coalesce's sort)
        torch.testing.assert_close(torch_adagrad.state[a]["sum"], ours.state[b]["sum"], rtol=1e-6, atol=1e-7)
        assert torch.equal(torch_adagrad.state[a]["step"], ours.state[b]["step"])
    ours.load_state_dict(torch_adagrad.state_dict())  # the same state layout both ways


@pytest.mark.parametrize("num_rows", [20, 500])  # rows by flags (linear) / by a sort
def test_summed_rows_is_coalesce_and_adagrad_rows_divides_by_the_world(num_rows):
    from gmeta_ds.embedding.optim import adagrad_rows, summed_rows

    torch.manual_seed(2)
    index = torch.randint(0, num_rows, (1, 40))
    grad = torch.sparse_coo_tensor(index, torch.randn(40, 3), (num_rows, 3))
    rows, values = summed_rows(grad)
    reference = grad.coalesce()
    assert torch.equal(rows, reference.indices()[0])
    torch.testing.assert_close(values, reference.values())
    assert summed_rows(reference)[1].data_ptr() == reference._values().data_ptr()  # coalesced: as it is
    a = nn.Parameter(torch.randn(num_rows, 3))
    b = nn.Parameter(a.detach().clone())
    torch_adagrad, ours = torch.optim.Adagrad([a], lr=0.1), torch.optim.Adagrad([b], lr=0.1)
    a.grad, b.grad = grad.coalesce() / 3, grad.clone()  # summed over 3 ranks: ours divides
    torch_adagrad.step()
    adagrad_rows(ours, b, world=3)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch_adagrad.state[a]["sum"], ours.state[b]["sum"])


def test_fast_updates_match_torchs_sgd_and_apply_only_to_plain_optimizers():
    from gmeta_ds.embedding.optim import fast_update, sgd_rows

    torch.manual_seed(1)
    a = nn.Parameter(torch.randn(20, 3))
    b = nn.Parameter(a.detach().clone())
    torch_sgd, ours = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
    grad = torch.sparse_coo_tensor(torch.tensor([[3, 7, 3, 0]]), torch.randn(4, 3), (20, 3))  # row 3 twice
    a.grad, b.grad = grad.clone(), grad.clone()
    assert fast_update(ours, b) == "sgd"
    torch_sgd.step()
    sgd_rows(ours, b, world=1)
    torch.testing.assert_close(a, b)
    b.grad = None
    assert fast_update(ours, b) is None  # no gradient
    b.grad = grad.to_dense()
    assert fast_update(ours, b) is None  # dense gradient: torch's own step
    b.grad = grad.clone()
    for other in (torch.optim.SGD([b], lr=0.1, momentum=0.9), torch.optim.Adagrad([b], lr_decay=0.1),
                  torch.optim.SparseAdam([b])):
        assert fast_update(other, b) is None
    assert fast_update(torch.optim.Adagrad([b]), b) == "adagrad"


def test_apply_update_dispatches_by_name_and_divides_a_summed_gradient_by_the_world():
    """The step's row updates come from `optim.ROW_UPDATES` by name (no string branches in the
    collection): each equals torch's step on the gradient averaged over ``world`` ranks; no
    name means the optimizer's own step."""
    from gmeta_ds.embedding.optim import ROW_UPDATES, apply_update

    assert sorted(ROW_UPDATES) == ["adagrad", "sgd"]
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 4, 1]]), torch.randn(3, 2), (6, 2))
    for make, how in ((torch.optim.SGD, "sgd"), (torch.optim.Adagrad, "adagrad"), (torch.optim.SGD, None)):
        a = nn.Parameter(torch.randn(6, 2))
        b = nn.Parameter(a.detach().clone())
        reference, ours = make([a], lr=0.1), make([b], lr=0.1)
        world = 1 if how is None else 4
        a.grad, b.grad = (grad / world).coalesce(), grad.clone()
        reference.step()
        apply_update(ours, b, how, world)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
