"""Sparse optimizers for embedding rows: only the rows a step touched are read and written.

``sgd``, ``adagrad`` and ``adam`` (lazy, per-row moments) are torch's own sparse-capable
optimizers (`torch.optim.SGD`, `torch.optim.Adagrad`, `torch.optim.SparseAdam`);
``rowwise_adagrad`` (DLRM/FBGEMM's memory saver: one accumulator per row, not per element)
is written here because torch has none.
"""
from __future__ import annotations

import torch
from torch import nn

from gmeta_ds.embedding.tables import FLAGS_RATIO, unique_keys
from gmeta_ds.registry import SPARSE_OPTIMIZERS


class RowWiseAdagrad(torch.optim.Optimizer):
    """Adagrad with one accumulator per row: ``s_i += mean(g_i^2)``, ``w_i -= lr g_i / (sqrt(s_i) + eps)``.

    Expects sparse (COO) gradients over rows of 2-D parameters.
    """

    def __init__(self, params, lr: float = 0.05, eps: float = 1e-10):
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not p.grad.is_sparse:
                    raise ValueError("RowWiseAdagrad expects sparse row gradients")
                state = self.state[p]
                if not state:
                    state["sum"] = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                grad = p.grad.coalesce()
                rows, values = grad.indices()[0], grad.values()
                state["sum"][rows] += values.pow(2).mean(dim=1)
                scale = state["sum"][rows].sqrt().add_(group["eps"]).reciprocal_().mul_(group["lr"])
                p.index_add_(0, rows, -values * scale.unsqueeze(1))


def fast_update(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> str | None:
    """``"sgd"`` or ``"adagrad"`` when ``param`` has a sparse gradient and ``optimizer`` is
    torch's plain SGD (no momentum, weight decay or maximize) or plain Adagrad (no lr decay,
    weight decay or maximize): their update is then applied by `sgd_rows` / `adagrad_rows`,
    with index ops instead of torch's sparse-tensor arithmetic. Else None: ``optimizer.step()``."""
    grad = param.grad
    if grad is None or not grad.is_sparse:
        return None
    return plain_update(optimizer)


def plain_update(optimizer: torch.optim.Optimizer) -> str | None:
    """``"sgd"`` for torch's plain SGD (no momentum, weight decay or maximize), ``"adagrad"``
    for plain Adagrad (no lr decay, weight decay or maximize), else None."""
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adagrad):
        return None
    group = optimizer.param_groups[0]
    if group["weight_decay"] or group.get("maximize"):
        return None
    if type(optimizer) is torch.optim.SGD:
        return None if group["momentum"] else "sgd"
    return None if group["lr_decay"] else "adagrad"


@torch.no_grad()
def sgd_rows(optimizer: torch.optim.SGD, param: nn.Parameter, world: int = 1) -> None:
    """SGD on ``param``'s sparse gradient divided by ``world`` (the world size, when the
    gradient arrived summed over ranks): one ``index_add`` of its entries,
    uncoalesced (adding a row's entries one by one is the same update, with no sort); the
    gradient is scaled first, as ``index_add_``'s ``alpha`` path is several times slower on CPU."""
    grad, lr = param.grad, optimizer.param_groups[0]["lr"]
    param.index_add_(0, grad._indices()[0], grad._values() * (-lr * (1 / world)))


def summed_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, values) of a sparse COO row gradient with one entry per touched row, rows
    sorted: ``grad.coalesce()``'s indices and values. An uncoalesced gradient (owner-side
    pooling sends one entry per id looked up) is summed by one ``index_add`` over the rows of
    `tables.unique_keys`, which finds them by flags in linear time when the table is small
    next to the entries (no sort of every entry, as coalesce does)."""
    if grad.is_coalesced():
        return grad._indices()[0], grad._values()
    index, values = grad._indices()[0], grad._values()
    rows, inverse = unique_keys(index, grad.shape[0], FLAGS_RATIO)
    return rows, values.new_zeros((len(rows), *values.shape[1:])).index_add_(0, inverse, values)


@torch.no_grad()
def adagrad_rows(optimizer: torch.optim.Adagrad, param: nn.Parameter, world: int = 1) -> None:
    """`torch.optim.Adagrad`'s sparse step for ``param`` (its state ``sum`` and ``step`` kept,
    so checkpoints and torch's own step stay interchangeable), on the touched rows by index
    ops: ``s_i += g_i^2``, ``w_i -= lr g_i / (sqrt(s_i) + eps)``, with ``g_i`` the row's
    summed gradient (`summed_rows`) divided by ``world`` (the world size, when the gradient
    arrived summed over ranks). The same arithmetic as torch's, without its
    sparse-tensor temporaries (sparse_mask, sparse adds)."""
    group = optimizer.param_groups[0]
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0)
        state["sum"] = torch.full_like(param, group["initial_accumulator_value"],
                                       memory_format=torch.preserve_format)
    state["step"] += 1
    rows, values = summed_rows(param.grad)
    if world != 1:
        values = values / world
    total = state["sum"].index_select(0, rows).add_(values * values)
    state["sum"].index_copy_(0, rows, total)
    param.index_add_(0, rows, values.div(total.sqrt_().add_(group["eps"])).mul_(-group["lr"]))


# The row updates by index ops, by the name `fast_update` / `plain_update` give: each takes
# (optimizer, param, world) and divides a gradient summed over ``world`` ranks itself.
ROW_UPDATES = {"sgd": sgd_rows, "adagrad": adagrad_rows}


def apply_update(optimizer: torch.optim.Optimizer, param: nn.Parameter, how: str | None,
                 world: int = 1) -> None:
    """One sparse step of ``param``: the row update ``how`` (a `ROW_UPDATES` name) on its
    gradient summed over ``world`` ranks, else ``optimizer.step()`` when it has a gradient."""
    if how is not None:
        ROW_UPDATES[how](optimizer, param, world)
    elif param.grad is not None:
        optimizer.step()


def build_sparse_optimizer(name: str, param: nn.Parameter, lr: float) -> torch.optim.Optimizer:
    """The optimizer ``name`` (sgd | adagrad | rowwise_adagrad | adam) over one table shard."""
    # torch's sparse optimizers build COO tensors and warn unless invariant checks are chosen
    # explicitly: keep torch's default (off: the indices come from our own lookups).
    torch.sparse.check_sparse_tensor_invariants.disable()
    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(f"embedding optimizer {name!r} is not one of {', '.join(SPARSE_OPTIMIZERS.names())}")
    return SPARSE_OPTIMIZERS[name]([param], lr=lr)


SPARSE_OPTIMIZERS.bind({"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": RowWiseAdagrad,
                        "adam": torch.optim.SparseAdam})
