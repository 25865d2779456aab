"""Collectives for sharded embeddings: an autograd-aware all-to-all and traffic counters.

`all_to_all` sends ``x[rows for rank r]`` to rank r; its backward is the reverse all-to-all
(row gradients travel back to where the rows came from, coalesced in one call). gloo supports
only the single-tensor form, with uneven splits and zero-length ones. Given which peers are on
another host (``remote``, from the run's `Topology`), the counters also count the bytes sent
across hosts (``cross_host_bytes_sent`` per stage).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class CommStats:
    """Bytes sent/received to/from *other* ranks and collectives issued, per named stage;
    ``cross``: bytes sent to ranks on other hosts, per stage (counted where the exchange knows
    the hosts)."""

    sent: dict = field(default_factory=lambda: defaultdict(int))
    received: dict = field(default_factory=lambda: defaultdict(int))
    calls: dict = field(default_factory=lambda: defaultdict(int))
    cross: dict = field(default_factory=lambda: defaultdict(int))

    def record(self, stage: str, send_splits: list[int], recv_splits: list[int],
               bytes_per_row: int, rank: int, remote: tuple[bool, ...] | None = None) -> None:
        self.sent[stage] += bytes_per_row * (sum(send_splits) - send_splits[rank])
        self.received[stage] += bytes_per_row * (sum(recv_splits) - recv_splits[rank])
        self.calls[stage] += 1
        if remote is not None:
            self.cross[stage] += bytes_per_row * sum(n for n, far in zip(send_splits, remote) if far)

    def record_bytes(self, stage: str, sent: int, received: int) -> None:
        self.sent[stage] += sent
        self.received[stage] += received
        self.calls[stage] += 1

    def as_dict(self) -> dict:
        stages = sorted(set(self.sent) | set(self.calls))
        return {s: {"bytes_sent": self.sent[s], "bytes_received": self.received[s],
                    "collectives": self.calls[s],
                    **({"cross_host_bytes_sent": self.cross[s]} if s in self.cross else {})} for s in stages}

    def total_sent(self) -> int:
        return sum(self.sent.values())

    def total_cross_host(self) -> int:
        """Bytes this rank sent to other hosts, every stage together."""
        return sum(self.cross.values())

    def reset(self) -> None:
        self.sent.clear()
        self.received.clear()
        self.calls.clear()
        self.cross.clear()


class Link(NamedTuple):
    """The process group an exchange runs over (``group``; None: the default one), its
    ``size``, this rank's place in it, and which members are on another host (``remote``;
    None where the run's hosts are not known)."""

    group: object
    size: int
    rank: int
    remote: tuple[bool, ...] | None = None


def _row_bytes(x: Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def _exchange(x: Tensor, send_splits: list[int], recv_splits: list[int], group=None) -> Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, stats, rank, stage, group, remote):
        ctx.splits, ctx.stats, ctx.rank, ctx.stage = (send_splits, recv_splits), stats, rank, stage
        row_bytes = _row_bytes(x)
        ctx.row_bytes, ctx.group, ctx.remote = row_bytes, group, remote
        stats.record(stage, send_splits, recv_splits, row_bytes, rank, remote)
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        ctx.stats.record(ctx.stage + "_backward", recv_splits, send_splits, ctx.row_bytes, ctx.rank, ctx.remote)
        return _exchange(grad, recv_splits, send_splits, ctx.group), None, None, None, None, None, None, None


def all_to_all(x: Tensor, send_splits: list[int], recv_splits: list[int], stats: CommStats,
               rank: int, stage: str, group=None, remote: tuple[bool, ...] | None = None) -> Tensor:
    """Differentiable all-to-all of rows of ``x`` (splits along dim 0) over ``group`` (None:
    the default group), counted in ``stats`` (bytes to members flagged ``remote`` also as
    cross-host); ``rank``: this rank's place in ``group``."""
    if x.requires_grad:
        return _AllToAll.apply(x, send_splits, recv_splits, stats, rank, stage, group, remote)
    stats.record(stage, send_splits, recv_splits, _row_bytes(x), rank, remote)
    return _exchange(x, send_splits, recv_splits, group)
