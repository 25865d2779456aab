"""Collectives for sharded embeddings: an autograd-aware all-to-all and traffic counters.

`all_to_all` sends ``x[rows for rank r]`` to rank r; its backward is the reverse all-to-all
(row gradients travel back to where the rows came from, coalesced in one call). gloo supports
only the single-tensor form, with uneven splits and zero-length ones.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class CommStats:
    """Bytes sent/received to/from *other* ranks and collectives issued, per named stage."""

    sent: dict = field(default_factory=lambda: defaultdict(int))
    received: dict = field(default_factory=lambda: defaultdict(int))
    calls: dict = field(default_factory=lambda: defaultdict(int))

    def record(self, stage: str, send_splits: list[int], recv_splits: list[int],
               bytes_per_row: int, rank: int) -> None:
        self.sent[stage] += bytes_per_row * (sum(send_splits) - send_splits[rank])
        self.received[stage] += bytes_per_row * (sum(recv_splits) - recv_splits[rank])
        self.calls[stage] += 1

    def record_bytes(self, stage: str, sent: int, received: int) -> None:
        self.sent[stage] += sent
        self.received[stage] += received
        self.calls[stage] += 1

    def as_dict(self) -> dict:
        stages = sorted(set(self.sent) | set(self.calls))
        return {s: {"bytes_sent": self.sent[s], "bytes_received": self.received[s],
                    "collectives": self.calls[s]} for s in stages}

    def total_sent(self) -> int:
        return sum(self.sent.values())

    def reset(self) -> None:
        self.sent.clear()
        self.received.clear()
        self.calls.clear()


def _row_bytes(x: Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def _exchange(x: Tensor, send_splits: list[int], recv_splits: list[int], group=None) -> Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, stats, rank, stage, group):
        ctx.splits, ctx.stats, ctx.rank, ctx.stage = (send_splits, recv_splits), stats, rank, stage
        row_bytes = _row_bytes(x)
        ctx.row_bytes, ctx.group = row_bytes, group
        stats.record(stage, send_splits, recv_splits, row_bytes, rank)
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        ctx.stats.record(ctx.stage + "_backward", recv_splits, send_splits, ctx.row_bytes, ctx.rank)
        return _exchange(grad, recv_splits, send_splits, ctx.group), None, None, None, None, None, None


def all_to_all(x: Tensor, send_splits: list[int], recv_splits: list[int], stats: CommStats,
               rank: int, stage: str, group=None) -> Tensor:
    """Differentiable all-to-all of rows of ``x`` (splits along dim 0) over ``group`` (None:
    the default group), counted in ``stats``."""
    if x.requires_grad:
        return _AllToAll.apply(x, send_splits, recv_splits, stats, rank, stage, group)
    stats.record(stage, send_splits, recv_splits, _row_bytes(x), rank)
    return _exchange(x, send_splits, recv_splits, group)
