"""Where a table's rows live: one `TableLayout` per planned table, the one place placement is
written down (TorchRec's row-wise sharding keeps its block sizes next to its exchange; here the
strategies of `embedding.sharding` route, store, export and checkpoint through the layout).

A layout answers, for its table at one world size:

- ``route(ids) -> (owners, local)``: the rank holding each global id and its row there;
- ``global_ids(rank)``: the global ids of rank ``rank``'s rows, in local order (the rows
  `Sharding.initial_rows` builds, `Sharding.state` saves and `gather_table` puts back);
- ``local_rows(rank)`` and ``bytes_on(rank)``: the shard's rows and what it costs in memory
  (rows, optimizer state, a dynamic table's map), which the plan and the placement read.

The layouts: `RowModulo` (row i on rank i % W, local row i // W), `RowBlock` (ceil(rows / W)
contiguous rows per rank), `WholeTable` (every row on one rank, as its own local row),
`Copies` (every rank holds every row; nothing is routed) and `HashedIds` (a dynamic table: id i
on rank ``mix64(i) % W``, whose map turns it into one of ``capacity`` rows). Example, 5 rows
on 2 ranks: `RowModulo` routes ids [0, 1, 4] to owners [0, 1, 0] as local rows [0, 0, 2];
`RowBlock` (block 3) to owners [0, 0, 1] as local rows [0, 1, 1]. Pure torch.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from gmeta_ds.embedding.dynamic import SKETCH_DEPTH, owner_of, sketch_width
from gmeta_ds.embedding.tables import TableConfig

# Optimizer state per row, in floats per embedding dimension (row-wise Adagrad: one per row).
STATE_FLOATS = {"sgd": 0.0, "adagrad": 1.0, "adam": 2.0}


def modulo(ids: Tensor, world: int) -> tuple[Tensor, Tensor]:
    """(ids % world, ids // world), floored as Python's; by a mask and a shift when ``world``
    is a power of two (int64 division is ~15x slower than a bitwise op on CPU)."""
    if world & (world - 1) == 0:
        shift = world.bit_length() - 1
        return ids & (world - 1), ids >> shift
    return ids % world, torch.div(ids, world, rounding_mode="floor")


@dataclass(frozen=True)
class TableLayout(ABC):
    """Where the rows of ``table`` live on ``world_size`` ranks (see the module docstring)."""

    table: TableConfig
    world_size: int

    @abstractmethod
    def route(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(owner rank, local row on the owner) of each global id, both shaped like ``ids``."""

    @abstractmethod
    def global_ids(self, rank: int) -> Tensor:
        """Global ids of the rows rank ``rank`` stores, in local order."""

    @abstractmethod
    def describe(self) -> str:
        """Where the rows are, in words (`ShardingPlan.describe`)."""

    @property
    def routing(self) -> tuple:
        """Layouts with equal ``routing`` route every id alike (a group of tables routed by one
        of them, `owner_pooled`): their kind and what their routes depend on."""
        return (type(self).__name__, self.world_size, self.owner)

    @property
    def owner(self) -> int | None:
        """The one rank holding every row of the table, or None."""
        return None

    def owners(self, ids: Tensor) -> Tensor:
        """Owning rank of each global id."""
        return self.route(ids)[0]

    def local_index(self, ids: Tensor) -> Tensor:
        """Row of each global id inside its owner's shard."""
        return self.route(ids)[1]

    def local_rows(self, rank: int) -> int:
        """Rows of rank ``rank``'s shard."""
        return len(self.global_ids(rank))

    def index_bytes(self, rows: int) -> int:
        """Bytes beyond rows and optimizer state per shard of ``rows`` rows (a map); none here."""
        return 0

    def bytes_on(self, rank: int) -> int:
        """Parameter + optimizer-state bytes this table costs rank ``rank`` (float32)."""
        rows, dim = self.local_rows(rank), self.table.dim
        if self.table.optimizer == "rowwise_adagrad":
            state = rows
        else:
            state = rows * dim * STATE_FLOATS[self.table.optimizer]
        return int(4 * (rows * dim + state) + self.index_bytes(rows))


@dataclass(frozen=True)
class RowModulo(TableLayout):
    """Row i on rank i % W, as local row i // W."""

    def route(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        return modulo(ids, self.world_size)

    def global_ids(self, rank: int) -> Tensor:
        return torch.arange(rank, self.table.num_rows, self.world_size)

    def describe(self) -> str:
        return f"row-wise (modulo, <= {math.ceil(self.table.num_rows / self.world_size)} rows/rank)"


@dataclass(frozen=True)
class RowBlock(TableLayout):
    """``block`` = ceil(rows / W) contiguous rows per rank: row i on rank i // block."""

    @property
    def block(self) -> int:
        return math.ceil(self.table.num_rows / self.world_size)

    @property
    def routing(self) -> tuple:
        return ("RowBlock", self.block)

    def route(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        return ids // self.block, ids % self.block

    def global_ids(self, rank: int) -> Tensor:
        return torch.arange(rank * self.block, min(self.table.num_rows, (rank + 1) * self.block))

    def describe(self) -> str:
        return f"row-wise (block, <= {self.block} rows/rank)"


@dataclass(frozen=True)
class WholeTable(TableLayout):
    """Every row on rank ``on``, as its own local row (table-wise)."""

    on: int = 0

    @property
    def owner(self) -> int:
        return self.on

    def route(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        return torch.full_like(ids, self.on), ids

    def global_ids(self, rank: int) -> Tensor:
        return torch.arange(self.table.num_rows) if rank == self.on else torch.arange(0)

    def describe(self) -> str:
        return f"table-wise on rank {self.on}"


@dataclass(frozen=True)
class Copies(TableLayout):
    """Every rank holds every row (replicated): a lookup stays local, nothing is routed."""

    def route(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        raise ValueError(f"replicated table {self.table.name!r} has no single owner: every rank "
                         "looks its rows up in its own copy")

    def global_ids(self, rank: int) -> Tensor:
        return torch.arange(self.table.num_rows)

    def describe(self) -> str:
        return "replicated on every rank"


@dataclass(frozen=True)
class HashedIds(TableLayout):
    """A dynamic table: any int64 id, on rank ``mix64(id) % W``; the id travels as is and the
    owner's map (`dynamic.DynamicIndex`) turns it into one of ``capacity`` rows (+ row 0, the
    default row)."""

    def route(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        owners = owner_of(ids, self.world_size) if self.world_size > 1 else torch.zeros_like(ids)
        return owners, ids

    def global_ids(self, rank: int) -> Tensor:
        raise ValueError(f"dynamic table {self.table.name!r} has no fixed ids per rank")

    def local_rows(self, rank: int) -> int:
        return self.table.capacity + 1  # + the default row

    def index_bytes(self, rows: int) -> int:
        """id, row, last use, uses (int64) + a flag per row; the admission sketch."""
        sketch = 4 * SKETCH_DEPTH * sketch_width(self.table.capacity) if self.table.admit_after > 1 else 0
        return 33 * rows + sketch

    def describe(self) -> str:
        t = self.table
        return (f"dynamic (owner by hash of id, {t.capacity} rows/rank + a default row, admit after "
                f"{t.admit_after}, {t.eviction})")


def layout_of(kind: str, table: TableConfig, world_size: int, row_owner: str = "modulo",
              owner: int = 0) -> TableLayout:
    """The layout of a table planned as ``kind`` (row_wise by ``row_owner``, table_wise on
    ``owner``, replicated, dynamic)."""
    if kind == "row_wise":
        return (RowModulo if row_owner == "modulo" else RowBlock)(table, world_size)
    if kind == "table_wise":
        return WholeTable(table, world_size, owner)
    if kind == "replicated":
        return Copies(table, world_size)
    if kind == "dynamic":
        return HashedIds(table, world_size)
    raise ValueError(f"table {table.name!r}: plan {kind!r} has no layout; it is one of row_wise, "
                     "table_wise, replicated, dynamic")
