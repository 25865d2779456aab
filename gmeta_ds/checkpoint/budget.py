"""What a save writes, as a bound on what a load may hash: the file names a checkpoint of
world size W holds and, per file, the most bytes a save of that model can write into it
(`Budget`), from the tables, dense shapes and dynamic capacities of the model (the loading
run's, when it is known; see `manifest.verify`).

The bounds are generous (a few times what a save writes: every optimizer's state, the outer
synchronisation's copies, pickling and header overhead) but proportional to the model, so a
file planted in a checkpoint and listed in its manifest, or a real file grown to hundreds of
gigabytes, is refused by name and size before any byte of it is read."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gmeta_ds.embedding.dynamic import SKETCH_DEPTH, sketch_width

# DeepSpeed's files of one checkpoint tag (no model or pipeline parallelism, so mp_rank 00):
# ZeRO-0-2's model states, ZeRO-3's per-rank model states, ZeRO-1-3's optimizer partitions.
_DEEPSPEED = re.compile(r"mp_rank_00_model_states\.pt|zero_pp_rank_([0-9]+)_mp_rank_00_model_states\.pt"
                        r"|(?:bf16_)?zero_pp_rank_([0-9]+)_mp_rank_00_optim_states\.pt")
_RANK = re.compile(r"rank([0-9]{5})\.safetensors")
DENSE = "dense.safetensors"

_WORD = 4           # bytes of an fp32 value, the widest a save writes for weights and states
_DS_COPIES = 8      # DeepSpeed per dense value: weights, fp32 master, two Adam moments, and room
_ROW_COPIES = 6     # per embedding value in a rank file: row, up to three optimizer states, outer anchor, room
_ROW_IDS = 5        # int64 per row: global id, outer anchor id, dynamic slot, last use, uses
_OUTER_COPIES = 3   # per dense value in a rank file: the outer synchronisation's anchor, momentum, residual
_FILE_SLACK = 1 << 20     # per file: headers, pickled config and names, RNG states
_ENTRY_SLACK = 4096       # per tensor or table entry of a file: its name and metadata


def _numel(shape) -> int:
    """Values in a tensor of ``shape`` (a list of sizes)."""
    return math.prod(shape) if shape else 1


@dataclass(frozen=True)
class Budget:
    """The files a save of one model at world size ``world`` writes and their size bounds, in
    bytes: ``dense`` for ``dense.safetensors``, ``rank`` for each ``rankNNNNN.safetensors``,
    ``deepspeed`` for each of DeepSpeed's files and ``total`` for all of them together."""

    world: int
    dense: int
    rank: int
    deepspeed: int
    total: int

    def bound(self, name: str) -> int | None:
        """The most bytes a save writes into file ``name``; None for a name a save never writes."""
        if name == DENSE:
            return self.dense
        match = _RANK.fullmatch(name)
        if match:
            return self.rank if int(match.group(1)) < self.world else None
        match = _DEEPSPEED.fullmatch(name)
        if match:
            rank = match.group(1) or match.group(2)
            return self.deepspeed if rank is None or int(rank) < self.world else None
        return None

    def problems(self, sizes: dict[str, int], where) -> list[str]:
        """One line per file of ``sizes`` (name -> bytes on disk) that a save of this model
        does not write, or holds more bytes than it writes; then the total."""
        problems = []
        for name, size in sorted(sizes.items()):
            bound = self.bound(name)
            if bound is None:
                problems.append(f"{where / name}: not a file a checkpoint of world_size={self.world} "
                                f"writes (expected {DENSE}, rankNNNNN.safetensors or DeepSpeed's "
                                "*_model_states.pt / *_optim_states.pt of a rank below the world size); "
                                "refused unread")
            elif size > bound:
                problems.append(f"{where / name}: {size} bytes, more than a save of this model writes "
                                f"there (at most {bound} bytes from the tables and dense shapes); refused unread")
        total = sum(sizes.values())
        if not problems and total > self.total:
            problems.append(f"{where}: its files hold {total} bytes, more than a checkpoint of this model "
                            f"at world_size={self.world} (at most {self.total} bytes); refused unread")
        return problems


def capacities(sharded) -> dict[str, int]:
    """Rows per rank of each dynamic table of the sharded collection ``sharded`` (None: none),
    as a checkpoint's meta records them for `budget`."""
    return {name: int(index.capacity) for name, index in (getattr(sharded, "dynamic", None) or {}).items()}


def budget(tables: dict, dense_shapes: dict, capacities: dict, world: int) -> Budget:
    """The `Budget` of a checkpoint at world size ``world`` of a model with ``tables`` ({name:
    [rows or "dynamic", dim]}), ``dense_shapes`` ({parameter: [sizes]}) and ``capacities``
    ({dynamic table: rows per rank}); a dynamic table without a capacity is bounded by its
    largest (`config.BOUNDS`' 2**31 - 1 rows per rank)."""
    dense_values = sum(_numel(s) for s in dense_shapes.values())
    entries = len(dense_shapes)
    dense = _FILE_SLACK + entries * _ENTRY_SLACK + _WORD * dense_values
    deepspeed = _FILE_SLACK + entries * _ENTRY_SLACK + _WORD * _DS_COPIES * dense_values
    rank = _FILE_SLACK + _WORD * _OUTER_COPIES * dense_values
    for name, (rows, dim) in tables.items():
        if rows == "dynamic":
            rows = int(capacities.get(name) or 2**31 - 1)
            rank += _WORD * SKETCH_DEPTH * sketch_width(rows)
        # a rank may own every row (replicated or table-wise plans)
        rank += 8 * _ENTRY_SLACK + rows * (8 * _ROW_IDS + _WORD * _ROW_COPIES * dim)
    # DeepSpeed writes at most one model-states file and two files per rank
    total = dense + world * rank + (1 + 2 * world) * deepspeed
    return Budget(world, dense, rank, deepspeed, total)
