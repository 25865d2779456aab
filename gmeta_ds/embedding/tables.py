"""Embedding tables: configs, deterministic initialisation, jagged ids, and the unsharded
`EmbeddingCollection` — the single-process twin and correctness oracle of the sharded one.

Ids come per feature as a `Jagged` (EmbeddingBag layout). Example, 3 samples of a multi-hot
feature::

    values  = [4, 9, 9, 1]     # sample 0 -> [4, 9], sample 1 -> [], sample 2 -> [9, 1]
    offsets = [0, 2, 2, 4]     # (N + 1,)
    pooling sum  -> (3, d): rows[4] + rows[9], zeros, rows[9] + rows[1]
    pooling none -> (4, d): one row per id
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gmeta_ds.sparse import Jagged
from gmeta_ds.embedding.dynamic import default_row, owner_of

POOLINGS = ("sum", "mean", "none")
TABLE_KINDS = ("static", "dynamic")
DEVICES = ("auto", "accelerator", "host")
EXCHANGES = ("auto", "rows", "pooled")
INIT_BLOCK_ROWS = 1 << 16
INT32_LIMIT = 2**31 - 1  # ids, rows and offsets up to this go on the wire as int32


@dataclass(frozen=True)
class TableConfig:
    """One table: ``num_rows`` x ``dim``, used by ``features``; multi-hot features pool by
    ``pooling``; rows start N(0, init_std); ``optimizer``/``lr`` train its rows (sharded mode).

    ``kind="dynamic"`` (sharded mode only; `gmeta_ds.embedding.dynamic`): any int64 id, no
    vocabulary; each rank holds ``capacity`` rows for the ids it owns (plus a default row),
    gives an id its own row after ``admit_after`` lookups and evicts by ``eviction`` (lru | lfu)
    when full. ``num_rows`` is then ignored (set to ``capacity``).

    Args:
        name: the table's name.
        num_rows: rows of a static table (ids 0..num_rows-1).
        dim: the rows' width d.
        features: the features looked up in this table.
        pooling: how a multi-hot bag's rows combine: ``sum``, ``mean`` or ``none``.
        init_std: the standard deviation of the rows' N(0, init_std^2) start.
        optimizer: the sparse optimizer of its rows (sgd, adagrad, rowwise_adagrad, adam).
        lr: that optimizer's learning rate.
        kind: ``static`` or ``dynamic``.
        capacity: a dynamic table's rows per rank (None for a static table).
        admit_after: lookups of a dynamic id before it gets a row of its own.
        eviction: ``lru`` or ``lfu``, which row a full dynamic table gives up.
        device: where sharded rows live: ``host``, ``accelerator`` or ``auto``.
        exchange: what a sharded lookup of pooled features sends back: ``rows``, ``pooled``
            or ``auto``.
    """

    name: str
    num_rows: int
    dim: int
    features: tuple[str, ...]
    pooling: str = "sum"
    init_std: float = 0.05
    optimizer: str = "adagrad"
    lr: float = 0.05
    kind: str = "static"
    capacity: int | None = None
    admit_after: int = 1
    eviction: str = "lru"
    # host | accelerator | auto: where a sharded table's rows live (`gmeta_ds.embedding.placement`)
    device: str = "auto"
    # What a sharded lookup sends back for pooled (multi-hot) features: ``rows`` (each distinct
    # row, pooled by the requester), ``pooled`` (each owner pools its part of every bag and
    # sends one partial sum per bag), or ``auto`` (the planner picks by expected bytes,
    # `gmeta_ds.embedding.plan.choose_exchange`).
    exchange: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in TABLE_KINDS:
            raise ValueError(f"table {self.name!r}: kind {self.kind!r} is not one of {', '.join(TABLE_KINDS)}")
        if self.kind == "dynamic":
            if not isinstance(self.capacity, int) or self.capacity < 1:
                raise ValueError(f"table {self.name!r}: a dynamic table needs capacity (rows per rank) "
                                 f">= 1, got {self.capacity!r}")
            if self.admit_after < 1:
                raise ValueError(f"table {self.name!r}: admit_after must be >= 1, got {self.admit_after}")
            if self.eviction not in ("lru", "lfu"):
                raise ValueError(f"table {self.name!r}: eviction {self.eviction!r} is not one of lru, lfu")
            object.__setattr__(self, "num_rows", self.capacity)
        if self.device not in DEVICES:
            raise ValueError(f"table {self.name!r}: device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"table {self.name!r}: exchange {self.exchange!r} is not one of "
                             f"{', '.join(EXCHANGES)}")
        if self.num_rows <= 0 or self.dim <= 0:
            raise ValueError(f"table {self.name!r}: num_rows and dim must be positive, got "
                             f"{self.num_rows} x {self.dim}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name!r}: pooling {self.pooling!r} is not one of "
                             f"{', '.join(POOLINGS)}")


def _block_seed(seed: int, table: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{table}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def init_rows(table: TableConfig, seed: int, ids: Tensor) -> Tensor:
    """Initial rows for global row ids ``ids`` (any order): (len(ids), dim) float32.

    Rows are drawn in fixed blocks seeded by (seed, table name, block), so a row's initial value
    does not depend on which rank owns it or how the table is sharded; memory stays bounded
    by one block beyond the result.
    """
    out = torch.empty(len(ids), table.dim)
    if len(ids) == 0:
        return out
    # Sort once and walk the blocks in order: linear in len(ids) + rows generated.
    order = torch.argsort(ids)
    sorted_ids = ids[order]
    blocks, counts = torch.unique_consecutive(sorted_ids // INIT_BLOCK_ROWS, return_counts=True)
    cursor = 0
    for block, count in zip(blocks.tolist(), counts.tolist()):
        g = torch.Generator().manual_seed(_block_seed(seed, table.name, block))
        start = block * INIT_BLOCK_ROWS
        size = min(INIT_BLOCK_ROWS, table.num_rows - start)
        rows = torch.randn(size, table.dim, generator=g) * table.init_std
        picked = slice(cursor, cursor + count)
        out[order[picked]] = rows[sorted_ids[picked] - start]
        cursor += count
    return out


def check_ids(values: Tensor, feature: str, table: TableConfig, policy: str) -> Tensor:
    """Ids checked against the table's rows: ``error`` names the feature, table and value;
    ``hash`` maps every id into range by modulo. Nothing is silently clamped. Dynamic
    tables take any integer id."""
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"feature {feature!r}: ids of table {table.name!r} must be integers, got "
                         f"{values.dtype}; map strings to ids with gmeta_ds.hash_strings")
    if table.kind == "dynamic":
        return values.long()
    if policy == "hash":
        return torch.remainder(values, table.num_rows)
    if len(values):
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= table.num_rows:
            raise _out_of_range(feature, table, low if low < 0 else high)
    return values


def check_fields(ids: Tensor, fields: Sequence[str], tables: Sequence[TableConfig], num_rows: Tensor,
                 policy: str) -> Tensor:
    """`check_ids` of every column of single-hot ids (N, F) in one tensor op: column c holds
    feature ``fields[c]`` of table ``tables[c]`` (``num_rows``: (F,) their row counts). Same
    ids, and the same error as checking the columns one by one (the first bad column's)."""
    if policy == "hash":
        return torch.remainder(ids, num_rows)
    if len(ids):
        low, high = torch.aminmax(ids, dim=0)
        bad = (low < 0) | (high >= num_rows)
        if bad.any():
            c = int(bad.nonzero()[0])
            raise _out_of_range(fields[c], tables[c], int(low[c]) if low[c] < 0 else int(high[c]))
    return ids


def _out_of_range(feature: str, table: TableConfig, bad: int) -> ValueError:
    return ValueError(f"feature {feature!r}: id {bad} is out of range for table {table.name!r} with "
                      f"{table.num_rows} rows (valid: 0..{table.num_rows - 1}); "
                      "set embedding.bad_ids: hash to map ids by modulo")


def pool(rows: Tensor, jagged: Jagged, pooling: str) -> Tensor:
    """Pool looked-up rows (nnz, d) per sample: (N, d) for sum/mean, unchanged for none (and
    for single-hot ids, where the sum or mean of one row is that row)."""
    if pooling == "none" or jagged.one_per_sample:
        return rows
    out = rows.new_zeros(jagged.num_samples, rows.shape[1])
    out = out.index_add(0, jagged.segment_ids(), rows)
    if pooling == "mean":
        lengths = (jagged.offsets[1:] - jagged.offsets[:-1]).clamp(min=1)
        out = out / lengths.unsqueeze(1).to(rows.dtype)
    return out


# `unique_keys` by flags over the key space up to this many keys per id, else by a sort.
FLAGS_RATIO = 4.0


def unique_keys(keys: Tensor, bound: int, ratio: float = 1.0) -> tuple[Tensor, Tensor]:
    """``torch.unique(keys, return_inverse=True)`` (sorted) of keys in [0, bound): by marking
    the keys present in a table of ``bound`` flags when that is no larger than ``ratio`` times
    ``keys`` (linear time, no sort), else by torch's sort."""
    if bound > ratio * keys.numel():
        return torch.unique(keys, return_inverse=True)
    flat = keys.reshape(-1)
    present = torch.zeros(bound, dtype=torch.bool, device=keys.device).index_fill_(0, flat, True)
    return present.nonzero().squeeze(1), present.cumsum(0).sub_(1).index_select(0, flat).view_as(keys)


class _DistinctRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: Tensor, ids: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.shape = weight.shape
        return weight.index_select(0, ids)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        return torch.sparse_coo_tensor(ids.unsqueeze(0), grad, ctx.shape, is_coalesced=True), None


def distinct_rows(weight: Tensor, ids: Tensor) -> Tensor:
    """``weight[ids]`` for sorted, distinct ``ids`` (e.g. from ``torch.unique``), whose gradient
    reaches ``weight`` as a sparse tensor of one entry per distinct row (``embedding(...,
    sparse=True)`` makes one per occurrence, which the optimizer's coalesce must then sort)."""
    return _DistinctRows.apply(weight, ids)


def feature_tables(tables: list[TableConfig]) -> dict[str, TableConfig]:
    """feature name -> its table; a feature used by two tables is an error."""
    owners: dict[str, TableConfig] = {}
    for table in tables:
        for feature in table.features:
            if feature in owners:
                raise ValueError(f"feature {feature!r} is assigned to tables {owners[feature].name!r} "
                                 f"and {table.name!r}")
            owners[feature] = table
    return owners


class DynamicRows(nn.Module):
    """The unsharded form of a trained dynamic table: ``ids`` (n,) sorted admitted ids, their
    ``rows`` (n, d), and ``defaults`` (W, d), the default row of each of the W ranks it was
    trained on. An id not in ``ids`` (not admitted, evicted, or never seen, as a new item at
    evaluation) reads the default row of the rank that would own it, exactly as in training.
    Loading a state dict resizes the three to the saved ones."""

    def __init__(self, table: TableConfig, seed: int = 0):
        super().__init__()
        self.table = table
        self.register_buffer("ids", torch.zeros(0, dtype=torch.long))
        self.rows = nn.Parameter(torch.zeros(0, table.dim))
        self.defaults = nn.Parameter(default_row(table.name, table.dim, table.init_std, seed))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("ids", "rows", "defaults"):
            saved = state_dict.get(prefix + name)
            if saved is not None and saved.shape != getattr(self, name).shape:
                if saved.dim() < 1 or (name != "ids" and saved.shape[-1] != self.table.dim):
                    break  # torch's own loader reports the mismatch
                if name == "ids":
                    self.ids = torch.zeros(saved.shape, dtype=torch.long)
                else:
                    setattr(self, name, nn.Parameter(torch.zeros_like(saved)))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, ids: Tensor) -> Tensor:
        n = len(self.ids)
        index = owner_of(ids, len(self.defaults)) + n
        if n:
            pos = torch.searchsorted(self.ids, ids.contiguous()).clamp_(max=n - 1)
            index = torch.where(self.ids[pos] == ids, pos, index)
        return torch.nn.functional.embedding(index, torch.cat([self.rows, self.defaults]))


class EmbeddingCollection(nn.Module):
    """Unsharded tables (``weights.<table>``: (num_rows, dim)), one per `TableConfig`; dynamic
    tables as `DynamicRows` (``dynamic.<table>``).

    forward(features: {feature: Jagged}) -> {feature: (N, d) pooled or (nnz, d) for none}.
    `lookup_fields` is the single-hot shortcut the CTR model uses.

    Args:
        tables: one `TableConfig` per table.
        seed: the seed of the rows' initialisation (the same rows as a sharded twin's).
        bad_ids: an out-of-range id is an ``error`` (naming feature, table and id) or
            ``hash``ed by modulo into the table's rows.
    """

    def __init__(self, tables: list[TableConfig], seed: int = 0, bad_ids: str = "error"):
        super().__init__()
        self.tables = {t.name: t for t in tables}
        self.by_feature = feature_tables(tables)
        self.bad_ids = bad_ids
        self.weights = nn.ParameterDict({
            t.name: nn.Parameter(init_rows(t, seed, torch.arange(t.num_rows)))
            for t in tables if t.kind == "static"
        })
        self.dynamic = nn.ModuleDict({t.name: DynamicRows(t, seed) for t in tables if t.kind == "dynamic"})

    def forward(self, features: dict[str, Jagged]) -> dict[str, Tensor]:
        """Every feature's rows, each from its table, pooled per sample.

        Args:
            features: feature name -> its ids as a `Jagged` (one bag per sample).

        Returns:
            feature -> rows: (N, d) pooled by the feature's table (sum or mean; single-hot
            ids give their row), or (nnz, d) for ``pooling="none"``.

        Raises:
            ValueError: an id out of range of its table with ``bad_ids="error"``, naming the
                feature, the table and the id.
        """
        out = {}
        for feature, jagged in features.items():
            table = self.by_feature[feature]
            ids = check_ids(jagged.values, feature, table, self.bad_ids)
            if table.kind == "dynamic":
                rows = self.dynamic[table.name](ids)
            else:
                rows = torch.nn.functional.embedding(ids, self.weights[table.name])
            out[feature] = pool(rows, jagged, table.pooling)
        return out

    def lookup_fields(self, ids: Tensor, fields: list[str], multi: dict | None = None) -> Tensor:
        """Single-hot ids (..., F) for ``fields`` (+ pooled multi-hot bags) -> rows (..., F + M, d).

        Args:
            ids: (..., F) single-hot ids, column f of field ``fields[f]``.
            fields: the F single-hot fields, in the columns' order.
            multi: multi-hot feature -> `Jagged` with one bag per row of ``ids``; None: none.

        Returns:
            (..., F + M, d) rows: the single-hot fields first, then the M pooled bags in
            ``multi``'s order.

        Raises:
            ValueError: ``ids`` without one column per field, or an id out of range with
                ``bad_ids="error"``.
        """
        return lookup_fields(self, ids, fields, multi)


def lookup_fields(collection, ids: Tensor, fields: list[str], multi: dict | None = None) -> Tensor:
    """One lookup call for every field, over any collection with ``forward({feature: Jagged})``.

    ids (..., F) single-hot ids of ``fields``; ``multi``: multi-hot feature -> `Jagged` with one
    bag per row of ids (prod(...) bags), pooled by its table. Returns rows (..., F + M, d):
    single-hot fields first, then the multi-hot ones in ``multi``'s order.
    """
    check_width(ids, fields)
    lead = ids.shape[:-1]
    flat = ids.reshape(-1, len(fields))
    features = {f: Jagged.single(flat[:, i]) for i, f in enumerate(fields)}
    features.update(multi or {})
    rows = collection(features)
    names = list(fields) + list(multi or {})
    return torch.stack([rows[f] for f in names], dim=1).reshape(*lead, len(names), -1)


def check_width(ids: Tensor, fields: list[str]) -> None:
    """Single-hot ids (..., F) must have one column per field of ``fields``."""
    if ids.shape[-1] != len(fields):
        raise ValueError(f"ids have {ids.shape[-1]} fields, expected {len(fields)} ({', '.join(fields)})")
