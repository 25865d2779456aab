"""Sharding plans: how each table is placed (its `TablePlan.layout`, a `layout.TableLayout`,
says which rank owns which rows).

- ``row_wise``: every rank owns a slice of the rows — by ``modulo`` (row i on rank i % W,
  local index i // W) or contiguous ``block`` (ceil(rows / W) rows per rank). At most
  ceil(rows / W) rows per rank either way.
- ``table_wise``: a whole table on one rank (tables placed largest first on the least loaded rank).
- ``replicated``: every rank holds the whole (small) table; gradients are all-reduced.
- ``dynamic``: the plan of every ``kind="dynamic"`` table: id i on rank ``mix64(i) % W``, which
  maps it to one of its ``capacity`` rows (`gmeta_ds.embedding.dynamic`).

`plan_tables` turns per-table requests (or ``auto``: replicate tables below a row count,
row-wise for the rest) into a validated `ShardingPlan`. No communication.

Each sharded static table with sum/mean pooling also gets an exchange (`choose_exchange`):
``rows`` (the requester deduplicates its ids, owners send each distinct row back, the requester
pools) or ``pooled`` (owners pool their part of every bag and send one partial sum per (bag,
owner); the requester adds them up). ``auto`` picks the one with fewer expected bytes from the
table's `BagStats` (mean bag length, distinct ids per id looked up); without statistics it
keeps ``rows``, which single-hot features always use.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from gmeta_ds.embedding.layout import TableLayout, layout_of
from gmeta_ds.embedding.tables import INT32_LIMIT, TableConfig
from gmeta_ds.embedding.topology import Topology, choose_row_topology, choose_topology, host_overlap
from gmeta_ds.errors import ConfigError
from gmeta_ds.registry import PLANS
from gmeta_ds.sparse import BagStats

KINDS = (*PLANS.names(), "dynamic")  # row_wise, table_wise, replicated (the registry) + dynamic


def exchange_bytes(kind: str, world_size: int, dim: int, stats: BagStats) -> tuple[float, float]:
    """Expected bytes per bag and micro-batch (ids out, rows back, row gradients out again) of
    the ``rows`` and the ``pooled`` exchange. rows: the distinct ids (8 B) and their rows and
    gradients (2 x 4d B); pooled: every (id, bag) pair (16 B) and one partial sum and its
    gradient per owner holding part of the bag (table-wise 1; row-wise, ids spread evenly over
    W owners, W(1 - (1 - 1/W)^L))."""
    length = stats.mean_length
    rows = length * stats.distinct_ratio * (8 + 8 * dim)
    owners = 1.0 if kind == "table_wise" else world_size * (1 - (1 - 1 / world_size) ** length)
    return rows, 16 * length + owners * 8 * dim


def can_pool(table: TableConfig, kind: str) -> bool:
    """Whether a table planned as ``kind`` can pool on its owners: sharded, static, pooled."""
    return kind in ("row_wise", "table_wise") and table.kind == "static" and table.pooling != "none"


def choose_exchange(table: TableConfig, kind: str, world_size: int,
                    stats: BagStats | None) -> tuple[str, tuple[float, float] | None]:
    """``rows`` or ``pooled`` for one table (see the module docstring), and the byte estimate
    it was chosen by (None when nothing was estimated)."""
    poolable = can_pool(table, kind)
    if table.exchange == "pooled" and not poolable:
        raise ValueError(f"table {table.name!r}: exchange pooled needs a row_wise or table_wise static "
                         f"table with sum or mean pooling, and this one is {kind}, {table.kind}, pooling "
                         f"{table.pooling}; set its exchange to rows or auto")
    estimate = exchange_bytes(kind, world_size, table.dim, stats) if poolable and stats else None
    if table.exchange != "auto":
        return table.exchange, estimate
    return ("pooled" if estimate and estimate[1] < estimate[0] else "rows"), estimate


@dataclass(frozen=True)
class TablePlan:
    """Where one table's rows live; ``owner`` is set for table-wise tables; ``exchange``: what
    its pooled lookups send back (`choose_exchange`), ``estimate`` the bytes per bag it was
    chosen by (rows, pooled), if any."""

    table: TableConfig
    kind: str
    world_size: int
    row_owner: str = "modulo"
    owner: int = 0
    exchange: str = "rows"
    estimate: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"table {self.table.name!r}: plan {self.kind!r} is not one of {', '.join(KINDS)}")
        if not 0 <= self.owner < self.world_size:
            raise ValueError(f"table {self.table.name!r}: owner rank {self.owner} outside world size "
                             f"{self.world_size}")
        if self.exchange not in ("rows", "pooled"):
            raise ValueError(f"table {self.table.name!r}: exchange {self.exchange!r} is not one of rows, pooled")
        if self.exchange == "pooled":
            choose_exchange(dataclasses.replace(self.table, exchange="pooled"), self.kind, self.world_size, None)

    @cached_property
    def layout(self) -> TableLayout:
        """Where the table's rows live (`layout.TableLayout`: owners, local rows, global ids per
        rank, bytes), the one answer every strategy, checkpoint and estimate asks."""
        return layout_of(self.kind, self.table, self.world_size, self.row_owner, self.owner)


@dataclass(frozen=True)
class ShardingPlan:
    """A `TablePlan` per table, all for the same world size; the run's hosts (`Topology`; None:
    one host) and how tables pooled on their owners and the deduplicated row exchange cross
    them (``flat`` or ``hierarchical`` each, `with_topology`), with the cross-host bytes per bag
    each was chosen by (rows: and the ids' expected overlap between the ranks of a host).

    Args:
        tables: table name -> its `TablePlan`, in the tables' order.
        world_size: the ranks the tables are placed on.
        topology: the run's hosts; None: one host.
        exchange_topology: ``flat`` or ``hierarchical``, how tables pooled on their owners
            exchange across hosts.
        cross_host: its estimate, (flat, hierarchical) cross-host bytes per bag; None: not
            estimated.
        row_exchange_topology: ``flat`` or ``hierarchical``, how the deduplicated row
            exchange crosses hosts.
        cross_host_rows: its estimate, (flat, hierarchical) cross-host bytes per bag and the
            ids' overlap between a host's ranks; None: not estimated.
    """

    tables: dict[str, TablePlan]
    world_size: int
    topology: Topology | None = None
    exchange_topology: str = "flat"
    cross_host: tuple[float, float] | None = None
    row_exchange_topology: str = "flat"
    cross_host_rows: tuple[float, float, float] | None = None

    @property
    def hierarchical(self) -> bool:
        return self.exchange_topology == "hierarchical" and self.world_size > 1

    @property
    def hierarchical_rows(self) -> bool:
        return self.row_exchange_topology == "hierarchical" and self.world_size > 1

    def bytes_per_rank(self) -> list[int]:
        return [sum(p.layout.bytes_on(r) for p in self.tables.values()) for r in range(self.world_size)]

    def describe(self) -> str:
        lines = []
        for name, p in self.tables.items():
            where = p.layout.describe()
            if p.table.device != "auto":
                where += f", on the {p.table.device}"
            if p.exchange == "pooled" or p.estimate:
                where += ", pooled on the owner" if p.exchange == "pooled" else ", rows to the requester"
                if p.estimate:
                    where += f" (est. {p.estimate[0]:,.0f} B per bag as rows, {p.estimate[1]:,.0f} B pooled)"
            size = f"any int64 ids x {p.table.dim}" if p.kind == "dynamic" else f"{p.table.num_rows} x {p.table.dim}"
            lines.append(f"  {name}: {size}, {where}, "
                         f"{p.table.optimizer} lr {p.table.lr}")
        per_rank = ", ".join(f"rank {r}: {b / 2**20:.2f} MiB" for r, b in enumerate(self.bytes_per_rank()))
        lines.append(f"  memory (rows, optimizer state, dynamic maps): {per_rank}")
        if self.topology is not None:
            lines.append(self._describe_topology())
        return "\n".join(lines)

    def _describe_topology(self) -> str:
        """The topology line: hosts, each exchange's topology and the estimates it was chosen by."""
        line = f"  topology: {self.topology.describe()}, {self.exchange_topology} pooled exchange"
        if self.cross_host and any(p.exchange == "pooled" for p in self.tables.values()):
            line += (f" (est. cross-host {self.cross_host[0]:,.0f} B per bag flat, "
                     f"{self.cross_host[1]:,.0f} B hierarchical)")
        line += f", {self.row_exchange_topology} row exchange"
        if self.cross_host_rows and self.cross_host_rows[0]:
            flat, hier, overlap = self.cross_host_rows
            line += (f" (est. cross-host {flat:,.0f} B per bag flat, {hier:,.0f} B hierarchical, "
                     f"ids' overlap in a host {overlap:.2f})")
        return line


def with_topology(plan: ShardingPlan, topology: Topology, mode: str,
                  bag_stats: dict[str, BagStats] | None = None) -> ShardingPlan:
    """``plan`` on the hosts of ``topology``, its pooled tables and its row exchange each
    crossing hosts ``flat``, ``hierarchical`` or (``auto``) whichever crosses with fewer
    expected bytes (`topology.choose_topology`, `topology.choose_row_topology`, from the
    tables' bag statistics when known). Dynamic tables (their exchange carries occurrence
    counts) are not counted among the row exchange's: they keep the flat one."""
    if topology.world != plan.world_size:
        raise ValueError(f"topology of {topology.world} ranks for a plan of {plan.world_size}")
    stats = {name: (bag_stats or {}).get(name, BagStats(1.0, 1.0)) for name in plan.tables}
    pooled = [(p.kind, p.table.dim, stats[name].mean_length, 4 if p.table.num_rows <= INT32_LIMIT else 8)
              for name, p in plan.tables.items() if p.exchange == "pooled"]
    rows = [(p.table.dim, stats[name].mean_length, stats[name].distinct_ratio,
             host_overlap(stats[name].distinct_ratio, stats[name].host_distinct_ratio))
            for name, p in plan.tables.items() if p.exchange != "pooled" and p.kind in ("row_wise", "table_wise")]
    chosen, estimate = choose_topology(mode, topology, pooled)
    row_chosen, row_estimate = choose_row_topology(mode, topology, rows)
    return dataclasses.replace(plan, topology=topology, exchange_topology=chosen, cross_host=estimate,
                               row_exchange_topology=row_chosen, cross_host_rows=row_estimate)


def plan_tables(tables: list[TableConfig], world_size: int, kinds: dict[str, str],
                row_owner: str = "modulo", replicate_below_rows: int = 1024,
                bag_stats: dict[str, BagStats] | None = None,
                default_exchange: str = "auto") -> ShardingPlan:
    """Plan every table. ``kinds`` maps table name -> plan kind or ``auto``; missing = auto.
    ``bag_stats`` (table name -> `BagStats`) lets ``exchange: auto`` tables choose by bytes;
    ``default_exchange`` applies to tables left at ``auto`` (``pooled``: those that can pool).

    Args:
        tables: every table's `TableConfig`.
        world_size: the ranks to place them on, >= 1.
        kinds: table name -> ``row_wise``, ``table_wise``, ``replicated``, ``dynamic`` or
            ``auto`` (a static table under ``replicate_below_rows`` rows is replicated, else
            row-wise; a dynamic table is always ``dynamic``).
        row_owner: ``modulo`` (id i on rank i mod W) or ``block`` (contiguous blocks of ids).
        replicate_below_rows: the rows under which ``auto`` replicates a table.
        bag_stats: table name -> its `BagStats`, for ``exchange: auto``; None: none.
        default_exchange: ``auto``, ``rows`` or ``pooled``, for tables left at ``auto``.

    Returns:
        The `ShardingPlan` (table-wise tables balanced over the ranks by size).

    Raises:
        ValueError: a world size under 1, a table ``kinds`` names that does not exist, or a
            plan kind a table cannot take (a dynamic table's must be ``auto``).
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    unknown = set(kinds) - {t.name for t in tables}
    if unknown:
        raise ValueError(f"embedding.tables: unknown table(s) {sorted(unknown)}; tables are "
                         f"{', '.join(t.name for t in tables)}")
    chosen = {}
    for t in tables:
        kind = kinds.get(t.name, "auto")
        if t.kind == "dynamic":
            if kind not in ("auto", "dynamic"):
                raise ValueError(f"table {t.name!r} is dynamic: its rows are placed by a hash of the "
                                 f"id, so its plan must be auto, not {kind!r}")
            kind = "dynamic"
        elif kind == "dynamic":
            raise ValueError(f"table {t.name!r}: plan dynamic needs kind: dynamic and a capacity")
        if kind == "auto":  # a table asked to pool on its owners is sharded, however small
            small = t.num_rows < replicate_below_rows and t.exchange != "pooled"
            kind = "replicated" if small else "row_wise"
        chosen[t.name] = kind
    load = [0] * world_size
    plans = {}
    for t in sorted(tables, key=lambda t: -t.num_rows * t.dim):
        owner = 0
        if chosen[t.name] == "table_wise":
            owner = min(range(world_size), key=lambda r: load[r])
            load[owner] += t.num_rows * t.dim
        if t.exchange == "auto" and (default_exchange == "rows" or
                                     (default_exchange == "pooled" and can_pool(t, chosen[t.name]))):
            t = dataclasses.replace(t, exchange=default_exchange)
        exchange, estimate = choose_exchange(t, chosen[t.name], world_size, (bag_stats or {}).get(t.name))
        plans[t.name] = TablePlan(t, chosen[t.name], world_size, row_owner, owner, exchange, estimate)
    return ShardingPlan({t.name: plans[t.name] for t in tables}, world_size)


def plan_from_config(tables: list[TableConfig], cfg, world_size: int,
                     bag_stats: dict[str, BagStats] | None = None) -> ShardingPlan:
    """The plan an `EmbeddingConfig` asks for: ``tables.<name>.plan``, else ``plan``."""
    unknown = sorted(set(cfg.tables) - {t.name for t in tables})
    if unknown:
        raise ConfigError([f"embedding.tables: unknown table(s) {unknown}; tables are "
                           f"{', '.join(t.name for t in tables)}"])
    kinds = {name: o.plan for name, o in cfg.tables.items() if o.plan != "auto"}
    default = cfg.plan
    if default != "auto":
        kinds = {**{t.name: default for t in tables if t.kind != "dynamic"}, **kinds}
    return plan_tables(tables, world_size, kinds, cfg.row_owner, cfg.replicate_below_rows, bag_stats,
                       cfg.exchange)
