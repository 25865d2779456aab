"""Dynamic tables: ids from an unbounded int64 space on a bounded number of rows per rank.

A dynamic table (``TableConfig(kind="dynamic", capacity=C, admit_after=k, eviction=...)``)
has no vocabulary. Any int64 id is owned by rank ``mix64(id) % W``; each owner keeps a shard of
``C + 1`` rows and a `DynamicIndex` mapping the ids it admitted onto rows 1..C. Row 0 is the
shard's *default row*: ids not (yet) admitted share it, as the OOV row of a static vocabulary.

- **Admission**: an id gets its own row once it has been looked up ``admit_after`` times
  (occurrences, summed over every requesting rank), counted by a count-min sketch of fixed size
  (2 x ``sketch_width(C)`` int32): memory stays flat however many distinct ids arrive; the
  sketch can only over-count, so an id may be admitted early, never late.
- **Eviction** when all C rows are taken: the least recently used (``lru``: the lookup call of
  its last use) or least frequently used (``lfu``: occurrences since admission) rows among
  those the current lookup does not use; ties go to the lowest row. A row given to a new id
  starts from that id's own initial value (`init_dynamic_rows`: a function of (seed, table,
  id) alone, so independent of owner, world size and history) with zeroed optimizer state.
- The map is two sorted arrays (admitted ids and their rows): lookups are one
  ``searchsorted``; admissions and evictions rewrite them in one linear pass.

The id -2^63 (`PAD_ID`) is reserved for padding rows. Strings become ids through `hash_strings` (`string_id`: 63 bits of MD5, stable across
processes and machines, unlike Python's ``hash``; DuckDB computes the same id in SQL).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from gmeta_ds.sparse import PAD_ID

EVICTIONS = ("lru", "lfu")
SKETCH_DEPTH = 2
OWNER_SALT = 0x5EED  # the hash stream that picks a dynamic id's owner rank
_MASK63 = (1 << 63) - 1
_KEY_MAX = (1 << 63) - 1  # an eviction key no row can have


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _C1, _C2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(ids: Tensor, salt: int) -> Tensor:
    """splitmix64's finaliser of ``ids + salt * golden`` (two's-complement wrapping), as a
    non-negative int64 (63 bits). Stable across processes, platforms and torch versions."""
    x = ids.long() + _signed((salt * _GOLDEN) & ((1 << 64) - 1))
    x = (x ^ _shr(x, 30)) * _C1
    x = (x ^ _shr(x, 27)) * _C2
    return (x ^ _shr(x, 31)) & _MASK63


def owner_of(ids: Tensor, world: int) -> Tensor:
    """The rank owning each id of a dynamic table."""
    return mix64(ids, OWNER_SALT) % world


def _table_salt(seed: int, table: str) -> int:
    digest = hashlib.blake2b(f"dynamic/{seed}/{table}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


def init_dynamic_rows(name: str, dim: int, init_std: float, seed: int, ids: Tensor) -> Tensor:
    """Initial rows (len(ids), dim) float32 of dynamic-table ids: N(0, init_std) by Box-Muller
    over counter-based hashes of (seed, table, id, column), so an id's first value is the same
    whichever rank owns it and whenever it is admitted."""
    salt = _table_salt(seed, name)
    base = mix64(ids.long(), salt).unsqueeze(1) * (2 * dim) + torch.arange(2 * dim)
    bits = _shr(mix64(base, salt + 1), 11).double()  # 52 random bits
    uniform = (bits + 0.5) / float(1 << 52)          # in (0, 1)
    u1, u2 = uniform[:, :dim], uniform[:, dim:]
    normal = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)
    return (normal * init_std).float()


def default_row(name: str, dim: int, init_std: float, seed: int) -> Tensor:
    """The initial default row (1, dim) of every shard of a dynamic table."""
    return init_dynamic_rows(name + "/default", dim, init_std, seed, torch.zeros(1, dtype=torch.long))


def sketch_width(capacity: int) -> int:
    """Columns of the admission sketch: a power of two >= 8x the capacity, in [2^10, 2^24]."""
    return 1 << min(24, max(10, math.ceil(math.log2(8 * capacity))))


class CapacityError(RuntimeError):
    """More distinct ids must hold rows at once than a dynamic table's capacity."""


@dataclass
class Admitted:
    """What one `DynamicIndex.lookup` changed: rows given to new ids (and those ids), and how
    many rows it took from evicted ids."""

    slots: Tensor
    ids: Tensor
    evicted: int


class DynamicIndex:
    """One rank's map from the ids it owns to rows 1..capacity of its shard (0: default)."""

    def __init__(self, table: str, capacity: int, admit_after: int = 1, eviction: str = "lru",
                 device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"table {table!r}: capacity must be >= 1, got {capacity}")
        if admit_after < 1:
            raise ValueError(f"table {table!r}: admit_after must be >= 1, got {admit_after}")
        if eviction not in EVICTIONS:
            raise ValueError(f"table {table!r}: eviction {eviction!r} is not one of {', '.join(EVICTIONS)}")
        self.table, self.capacity, self.admit_after, self.eviction = table, capacity, admit_after, eviction
        long = dict(dtype=torch.long, device=device)
        self.keys = torch.empty(0, **long)    # admitted ids, sorted
        self.rows = torch.empty(0, **long)    # row of keys[i]
        self.taken = torch.zeros(capacity + 1, dtype=torch.bool, device=device)
        self.taken[0] = True                  # the default row is never given to an id
        self.last_used = torch.zeros(capacity + 1, **long)
        self.uses = torch.zeros(capacity + 1, **long)
        self.sketch = (torch.zeros(SKETCH_DEPTH, sketch_width(capacity), dtype=torch.int32, device=device)
                       if admit_after > 1 else None)
        self.clock = 0
        self.counters = {"lookups": 0, "hits": 0, "admissions": 0, "evictions": 0}

    @property
    def occupancy(self) -> int:
        return len(self.keys)

    def find(self, ids: Tensor) -> Tensor:
        """Row of each id (0 where not admitted); changes nothing."""
        if not len(self.keys):
            return torch.zeros_like(ids)
        pos = torch.searchsorted(self.keys, ids.contiguous()).clamp_(max=len(self.keys) - 1)
        return torch.where(self.keys[pos] == ids, self.rows[pos], 0)

    def _counted(self, ids: Tensor, counts: Tensor) -> Tensor:
        """Add ``counts`` to the sketch; each id's estimated total count."""
        width = self.sketch.shape[1]
        estimate = None
        for d in range(SKETCH_DEPTH):
            cell = mix64(ids, d + 1) & (width - 1)
            self.sketch[d].index_add_(0, cell, counts.to(torch.int32))
            seen = self.sketch[d][cell]
            estimate = seen if estimate is None else torch.minimum(estimate, seen)
        return estimate

    def lookup(self, ids: Tensor, counts: Tensor) -> tuple[Tensor, Admitted]:
        """Rows for ``ids`` (any order, repeats allowed) looked up ``counts`` times each:
        admits the ids that reach ``admit_after``, evicting if full. Returns (row per id, what
        was admitted). Ids found in the map cost one ``searchsorted``; only the others are
        deduplicated and counted."""
        counts = counts.long()
        self.clock += 1
        row = self.find(ids)
        real = ids != PAD_ID
        missing = (row == 0) & real
        evicted, new_ids, new_rows = 0, ids.new_empty(0), ids.new_empty(0)
        if bool(missing.any()):
            candidates, inverse = torch.unique(ids[missing], return_inverse=True)
            total = torch.zeros(len(candidates), dtype=torch.long, device=ids.device)
            total.index_add_(0, inverse, counts[missing])
            admit = torch.ones(len(candidates), dtype=torch.bool, device=ids.device)
            if self.sketch is not None:
                admit = self._counted(candidates, total) >= self.admit_after
            new_ids = candidates[admit]
            if len(new_ids):
                new_rows, evicted = self._rows_for(len(new_ids), row[row > 0])
                self._insert(new_ids, new_rows)
                row_of_candidate = torch.zeros_like(candidates)
                row_of_candidate[admit] = new_rows
                row[missing] = row_of_candidate[inverse]
        self.last_used[row] = self.clock
        self.uses.index_add_(0, row, torch.where(real, counts, 0))
        self.counters["lookups"] += int(counts[real].sum())
        self.counters["hits"] += int(counts[real & ~missing].sum())
        self.counters["admissions"] += len(new_ids)
        self.counters["evictions"] += evicted
        return row, Admitted(new_rows, new_ids, evicted)

    def _rows_for(self, needed: int, in_use: Tensor) -> tuple[Tensor, int]:
        """``needed`` rows for new ids (sorted): free ones first, then rows taken from the
        least recently (lru) or frequently (lfu) used ids not in ``in_use``, lowest row first
        among ties; returns (rows, how many were evicted). Linear in the capacity (no sort)."""
        free = self.capacity - len(self.keys)
        if free >= needed:
            return (~self.taken).nonzero().squeeze(1)[:needed], 0
        short = needed - free
        width = self.capacity + 1
        priority = self.last_used if self.eviction == "lru" else self.uses
        # unique (priority, row) keys: topk's pick is exact and deterministic
        key = priority.clamp(max=(1 << 62) // width) * width + torch.arange(width, device=priority.device)
        key.masked_fill_(~self.taken, _KEY_MAX)
        key[0] = _KEY_MAX
        key[in_use] = _KEY_MAX
        picked = torch.topk(key, short, largest=False, sorted=False)
        if bool((picked.values == _KEY_MAX).any()):
            raise CapacityError(
                f"table {self.table!r}: one lookup needs rows for {len(torch.unique(in_use)) + needed} distinct ids "
                f"on this rank but its capacity is {self.capacity}; raise "
                f"embedding.tables.{self.table}.capacity or use smaller micro-batches")
        evicted = picked.indices
        rows = evicted if free == 0 else torch.cat([(~self.taken).nonzero().squeeze(1), evicted])
        self._remove(evicted)
        return torch.sort(rows).values, short

    def _remove(self, rows: Tensor) -> None:
        gone = torch.zeros_like(self.taken)
        gone[rows] = True
        keep = (~gone[self.rows]).nonzero().squeeze(1)
        self.keys, self.rows = self.keys.index_select(0, keep), self.rows.index_select(0, keep)
        self.taken[rows] = False

    def _insert(self, ids: Tensor, rows: Tensor) -> None:
        """Merge sorted new ``ids`` (absent from keys) with their ``rows`` into the map."""
        n_old = len(self.keys)
        at_new = torch.searchsorted(self.keys, ids) + torch.arange(len(ids), device=ids.device)
        at_old = torch.searchsorted(ids, self.keys) + torch.arange(n_old, device=ids.device)
        keys, slots = self.keys.new_empty(n_old + len(ids)), self.rows.new_empty(n_old + len(ids))
        keys[at_new], slots[at_new] = ids, rows
        keys[at_old], slots[at_old] = self.keys, self.rows
        self.keys, self.rows = keys, slots
        self.taken[rows] = True
        self.last_used[rows] = 0
        self.uses[rows] = 0

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Tensor]:
        """Admitted ids with their rows, last use and use count; clock, sketch and counters."""
        out = {"ids": self.keys.clone(), "rows": self.rows.clone(), "last_used": self.last_used[self.rows],
               "uses": self.uses[self.rows],
               "clock": torch.tensor([self.clock]),
               "counters": torch.tensor([self.counters[k] for k in sorted(self.counters)])}
        if self.sketch is not None:
            out["sketch"] = self.sketch.clone()
        return out

    def restore(self, ids: Tensor, rows: Tensor | None, last_used: Tensor, uses: Tensor, clock: int,
                sketch: Tensor | None, counters: dict[str, int]) -> Tensor:
        """Refill from saved entries (ids unique): their own ``rows`` where given (the same
        world size and capacity), else rows 1..n in order of id. Keeps the ``capacity`` most
        recently (lru) or frequently (lfu) used if there are more. Returns the position in
        ``ids`` of each kept entry, in the order of the returned map's rows."""
        if len(ids) > self.capacity:
            priority = last_used if self.eviction == "lru" else uses
            keep = torch.argsort(priority, descending=True, stable=True)[: self.capacity]
            self.counters["evictions"] += len(ids) - self.capacity
            rows = None
        else:
            keep = torch.arange(len(ids))
        if rows is None:
            keep = keep[torch.argsort(ids[keep])]
            rows = torch.arange(1, len(keep) + 1)
        else:
            rows = rows[keep]
        order = torch.argsort(ids[keep])
        self.keys, self.rows = ids[keep][order].clone(), rows[order].clone()
        self.taken.zero_()
        self.taken[0] = True
        self.taken[self.rows] = True
        self.last_used.zero_()
        self.uses.zero_()
        self.last_used[self.rows] = last_used[keep][order]
        self.uses[self.rows] = uses[keep][order]
        self.clock = clock
        if self.sketch is not None and sketch is not None and sketch.shape == self.sketch.shape:
            self.sketch.copy_(sketch)
        self.counters.update(counters)
        return keep[order]
