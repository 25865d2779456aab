"""Sparse optimizers for embedding rows: only the rows a step touched are read and written.

``sgd``, ``adagrad`` and ``adam`` (lazy, per-row moments) are torch's own sparse-capable
optimizers (`torch.optim.SGD`, `torch.optim.Adagrad`, `torch.optim.SparseAdam`);
``rowwise_adagrad`` (DLRM/FBGEMM's memory saver: one accumulator per row, not per element)
is written here because torch has none.
"""
from __future__ import annotations

import torch
from torch import nn


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


def build_sparse_optimizer(name: str, param: nn.Parameter, lr: float) -> torch.optim.Optimizer:
    """The optimizer ``name`` (sgd | adagrad | rowwise_adagrad | adam) over one table shard."""
    # torch's sparse optimizers build COO tensors and warn unless invariant checks are chosen
    # explicitly: keep torch's default (off: the indices come from our own lookups).
    torch.sparse.check_sparse_tensor_invariants.disable()
    from gmeta_ds.registry import SPARSE_OPTIMIZERS

    if name not in SPARSE_OPTIMIZERS:
        raise ValueError(f"embedding optimizer {name!r} is not one of {', '.join(SPARSE_OPTIMIZERS.names())}")
    return SPARSE_OPTIMIZERS[name]([param], lr=lr)
