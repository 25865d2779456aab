"""Replicated tables: every rank holds the whole (small) table.

A lookup reads the rank's own copy (no input_dist, no output_dist); after backward the
gradients of every replicated table of one device and process group are all-reduced in one
collective, with a touched-row flag per row so that lazy optimizers update exactly the rows
some rank used.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor

from gmeta_ds.embedding.sharding.base import Request, Sharding


class Replicated(Sharding):
    """Tables of which every rank holds a full copy."""

    def input_dist(self, name: str, request: Request, exchange) -> Tensor:
        """The rows at once, from this rank's copy (nothing is exchanged)."""
        ids = request.ids.to(self.ctx.table_device[name])
        return self.lookup(name, ids, None)

    def finish_gradients(self, leave: frozenset) -> None:
        """One all-reduce per (device, process group) of the tables' gradients; ``leave`` does
        not apply (a replicated table's step always takes the averaged gradient)."""
        together = defaultdict(list)
        for name in self.names:
            p = self.ctx.shards[name]
            together[(str(p.device), id(self.ctx.groups[name]))].append(name)
        for names in together.values():
            self._all_reduce(names)

    def _all_reduce(self, names: list[str]) -> None:
        """One all-reduce of the tables' dense gradients plus a touched-row flag."""
        ctx, parts = self.ctx, []
        for name in names:
            p = ctx.shards[name]
            grad = p.grad.to_dense() if p.grad is not None else torch.zeros_like(p)
            touched = torch.zeros(p.shape[0], 1, device=p.device)
            if p.grad is not None:
                touched[p.grad.coalesce().indices()[0]] = 1.0
            parts.append(torch.cat([grad, touched], dim=1).reshape(-1))
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=ctx.groups[names[0]])
        ring = int(2 * (ctx.world - 1) / ctx.world * flat.numel() * flat.element_size())
        ctx.stats.record_bytes("replicated_allreduce", ring, ring)
        for name, chunk in zip(names, torch.split(flat, [t.numel() for t in parts])):
            p = ctx.shards[name]
            chunk = chunk.view(p.shape[0], p.shape[1] + 1)
            rows = torch.nonzero(chunk[:, -1]).squeeze(1)
            p.grad = None if len(rows) == 0 else torch.sparse_coo_tensor(
                rows.unsqueeze(0), chunk[rows, :-1] / ctx.world, p.shape, check_invariants=False)

    def direct_update(self, name: str) -> None:
        """Never: the all-reduced gradient is already the mean (the optimizer's own step)."""
        return None

    def checksum(self, name: str) -> tuple[float, ...]:
        """Counted once over all ranks: rank 0's copy."""
        return (self.ctx.shards[name].detach().double().sum().item(),) if self.ctx.rank == 0 else ()

    def gather_table(self, name: str, everywhere: bool) -> Tensor:
        """This rank's copy (every rank has the whole table)."""
        return self.ctx.shards[name].detach().cpu().clone()
