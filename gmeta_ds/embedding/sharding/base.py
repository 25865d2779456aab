"""What every sharding strategy shares: the rank's tables (`ShardContext`) and the methods
`ShardedEmbeddingCollection` calls on each strategy (`Sharding`).

A strategy owns the tables planned with it (`strategy_name` of their `TablePlan`) and answers,
for them, the same questions in the same order as TorchRec's sharded modules:

- storage: `Sharding.initial_rows` (this rank's shard of a table);
- forward: ``input_dist`` (where each requested id goes), ``lookup`` (an owner's rows),
  output_dist (rows back). Strategies that look rows up (``pools_on_owner`` False) get one
  deduplicated `Request` per table and add their part to the one `RowExchange` of the lookup
  (`exchange.py`: one all-to-all per group of tables for every strategy together) or answer
  locally; a strategy that pools on the owner gets the raw bags (`OwnerPooled.pool`);
- gradients: `Sharding.finish_gradients` (the mean over ranks) and `Sharding.direct_update`
  (which tables take the index-op optimizer step);
- placement: `Sharding.layout` (a table's `layout.TableLayout`: owners, local rows, global ids
  per rank, bytes), through which the strategy routes, builds, exports and checkpoints;
- state: `Sharding.checksum`, `Sharding.gather_table`, `Sharding.gather_state`, and the
  checkpoint's `Sharding.state` / `Sharding.load_state` (`state.py`'s format).

To add a strategy: one file in this folder with a subclass of `Sharding`, and its name in
`gmeta_ds.registry.SHARDINGS` (plus, for a plan users can ask for, in `registry.PLANS` and,
for a new placement, a `layout.TableLayout` that `layout.layout_of` builds for its kind).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gmeta_ds.embedding.comm import CommStats, Link
from gmeta_ds.embedding.layout import TableLayout
from gmeta_ds.embedding.plan import ShardingPlan, TablePlan
from gmeta_ds.embedding.sharding.state import load_rows, rows_state
from gmeta_ds.embedding.tables import TableConfig, init_rows


class Request(NamedTuple):
    """One table's lookup request: the ids to fetch (deduplicated unless ``dedup`` is off),
    the index of each looked-up value into them, and how often each occurs (dynamic tables:
    admission counts occurrences)."""

    ids: Tensor
    inverse: Tensor
    counts: Tensor | None = None


@dataclass
class ShardContext:
    """One rank's sharded tables and what their strategies need to look them up: the plan,
    this rank and the world size, the collection's settings, each table's device and process
    group (None: the default group), its shard and sparse optimizer, and the traffic counters;
    on a run of several hosts, which ranks are on another host (``remote``) and, for the
    hierarchical exchange, this rank's intra-host and inter-host groups (``tiers``,
    `engine.hosts.TopologyGroups`)."""

    plan: ShardingPlan
    rank: int
    seed: int
    bad_ids: str
    dedup: bool
    device: torch.device
    table_device: dict[str, torch.device]
    groups: dict[str, object]
    by_feature: dict[str, TableConfig]
    shards: dict[str, nn.Parameter] = field(default_factory=dict)
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    stats: CommStats = field(default_factory=CommStats)
    remote: tuple[bool, ...] | None = None
    tiers: object = None

    @property
    def world(self) -> int:
        return self.plan.world_size

    def link(self, name: str) -> Link:
        """The whole world's exchange of table ``name`` (its process group)."""
        return Link(self.groups[name], self.world, self.rank, self.remote)

    def gather(self, x: Tensor, everywhere: bool, name: str) -> list[Tensor] | None:
        """Every rank's ``x`` (same shape on all) on rank 0, or everywhere; table ``name``'s group."""
        group = self.groups[name]
        receives = everywhere or self.rank == 0
        bucket = [torch.zeros_like(x) for _ in range(self.world)] if receives else None
        if everywhere:
            dist.all_gather(bucket, x, group=group)
        else:
            dist.gather(x, bucket, dst=0, group=group)
        return bucket


def strategy_name(plan: TablePlan, hierarchical: bool = False) -> str:
    """The strategy (a name in `registry.SHARDINGS`) of a planned table: its plan kind, or for
    a table planned with ``exchange: pooled`` ``owner_pooled`` (``hierarchical_pooled`` in a
    ``hierarchical`` plan: pooled on the owner across hosts in two levels)."""
    if plan.exchange == "pooled":
        return "hierarchical_pooled" if hierarchical else "owner_pooled"
    return plan.kind


class Sharding(ABC):
    """The tables ``names`` of one strategy on this rank (see the module docstring).

    Class attributes: ``pools_on_owner`` (features come as raw bags to ``pool``, not as
    requests), ``counts`` (requests carry each id's occurrences, and the single-hot fields of
    its tables take the per-feature path)."""

    pools_on_owner: ClassVar[bool] = False
    counts: ClassVar[bool] = False

    def __init__(self, ctx: ShardContext, names: tuple[str, ...]):
        self.ctx, self.names = ctx, names
        self.layouts = {name: ctx.plan.tables[name].layout for name in names}

    def layout(self, name: str) -> TableLayout:
        """Where table ``name``'s rows live (`layout.TableLayout`): this strategy routes its
        ids, builds, exports and checkpoints its shard through it, and nothing else."""
        return self.layouts[name]

    @property
    def indexes(self) -> dict:
        """Per-table maps from ids to rows (dynamic tables); none here."""
        return {}

    # ------------------------------------------------------------------ storage
    def initial_rows(self, name: str) -> Tensor:
        """This rank's rows of table ``name`` at start: the rows of its global ids."""
        return init_rows(self.ctx.plan.tables[name].table, self.ctx.seed, self.layout(name).global_ids(self.ctx.rank))

    # ------------------------------------------------------------------ forward
    @abstractmethod
    def input_dist(self, name: str, request: Request, exchange) -> Tensor | None:
        """Send ``request``'s ids to their owners by adding them to ``exchange`` (a
        `RowExchange`) with each id's owner and local row, and return None (the rows come back
        from the exchange); or return the rows at once (looked up where they are asked for)."""

    def lookup(self, name: str, local: Tensor, counts: Tensor | None) -> Tensor:
        """Rows of the local shard of ``name`` for local row ids (on the owner), with a sparse
        gradient; ``counts`` (occurrences) matter to dynamic tables only."""
        return torch.nn.functional.embedding(local, self.ctx.shards[name], sparse=True)

    # ------------------------------------------------------------------ gradients
    @abstractmethod
    def finish_gradients(self, leave: frozenset) -> None:
        """Make the gradients of this strategy's tables the mean over ranks, except tables in
        ``leave`` (their summed gradient is scaled by the step). Called at world size > 1 only."""

    @abstractmethod
    def direct_update(self, name: str) -> str | None:
        """``"sgd"`` or ``"adagrad"`` when table ``name``'s step can take its gradient still
        summed over ranks (`optim.sgd_rows` / `optim.adagrad_rows` scale it), else None."""

    # ------------------------------------------------------------------ state
    @abstractmethod
    def checksum(self, name: str) -> tuple[float, ...]:
        """This rank's terms of the float64 sum of table ``name``'s rows (each row counted once
        over all ranks), in the order the collection adds them to its running total."""

    @abstractmethod
    def gather_table(self, name: str, everywhere: bool) -> Tensor | None:
        """The full table ``name`` (num_rows, dim) on rank 0, or everywhere (None elsewhere, and
        for tables without a fixed vocabulary); collective."""

    def gather_state(self, everywhere: bool) -> dict[str, Tensor]:
        """State-dict entries beyond the full tables (`gather_table`); collective. None here."""
        return {}

    # ------------------------------------------------------------------ checkpoint
    def state(self, name: str) -> dict[str, Tensor]:
        """This rank's checkpoint entries of table ``name`` (`sharding.state`'s format): the
        rows of its layout's global ids, with their sparse-optimizer state. Not collective."""
        ctx = self.ctx
        return rows_state(name, self.layout(name).global_ids(ctx.rank), ctx.shards[name], ctx.optimizers[name])

    def load_state(self, name: str, files: list[dict[str, Tensor]]) -> None:
        """Refill table ``name``'s shard and optimizer state from every saved rank's `state`
        entries (``files``, one dict per saving rank, any world size or plan); a file that
        does not match the table is a `ConfigError` naming it. Not collective."""
        ctx = self.ctx
        load_rows(name, ctx.plan.tables[name].table.num_rows, self.layout(name).global_ids(ctx.rank),
                  ctx.shards[name], ctx.optimizers[name], files)
