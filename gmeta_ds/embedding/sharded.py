"""The sharded twin of `EmbeddingCollection`: rows live on their owner ranks, outside DeepSpeed.

`ShardedEmbeddingCollection` is a thin dispatcher over its tables' sharding strategies
(`gmeta_ds.embedding.sharding`, one file each: row-wise, table-wise, replicated, dynamic,
pooled on the owner; `registry.SHARDINGS` names them, `sharding.base.strategy_name` picks a
table's). One forward call (support and query ids of a micro-batch together):

1. input_dist — every table's ids checked and deduplicated (`sharding.exchange`'s requests:
   one unique across tables where that is linear); each strategy sends its tables' ids to
   their owners by adding them to the lookup's one `RowExchange` (`sharding.exchange`: two
   all-to-alls of counts and ids for all tables of one dimension, placement and process group
   together), or looks them up where they are asked for (replicated);
2. lookup — each owner reads its shards through the table's strategy (dynamic tables map ids
   to rows first, admitting and evicting);
3. output_dist — rows go back by all-to-all and are scattered to every occurrence through the
   inverse index of the deduplication, then pooled per feature. Tables planned with
   ``exchange: pooled`` pool on the owner instead (`sharding.owner_pooled`).

Backward sends row gradients to their owners (the reverse all-to-all, one call per group).
`finish_gradients` asks each strategy for the mean over ranks (sharded rows: divided by the
world size, as DeepSpeed averages dense gradients; replicated tables: all-reduced together).
World size 1 issues no collectives.

Placement (`TableConfig.device`, resolved by `resolve_placement`): ``accelerator`` tables live
on the rank's device and exchange over the default group (NCCL on CUDA); ``host`` tables live
in host memory (pinned where CUDA is available) and exchange over a gloo group of their own,
their rows moved to the device after the exchange (and their gradients back by autograd).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gmeta_ds.embedding.optim import apply_update, build_sparse_optimizer, fast_update
from gmeta_ds.embedding.plan import ShardingPlan
from gmeta_ds.embedding.sharding.base import Request, ShardContext, Sharding, strategy_name
from gmeta_ds.embedding.sharding.exchange import FieldTables, RowExchange, field_requests, table_requests
from gmeta_ds.engine.dist import on_wire
from gmeta_ds.engine.hosts import topology_groups
from gmeta_ds.embedding.tables import check_fields, check_width, feature_tables, lookup_fields, pool
from gmeta_ds.registry import SHARDINGS
from gmeta_ds.sparse import Jagged

__all__ = ["FieldTables", "Request", "ShardedEmbeddingCollection", "accelerator_device", "resolve_placement"]

SHARDINGS.bind({  # one file each; a strategy's module is imported when a table first needs it
    "row_wise": "gmeta_ds.embedding.sharding.row_wise:RowWise",
    "table_wise": "gmeta_ds.embedding.sharding.table_wise:TableWise",
    "replicated": "gmeta_ds.embedding.sharding.replicated:Replicated",
    "dynamic": "gmeta_ds.embedding.sharding.dynamic:Dynamic",
    "owner_pooled": "gmeta_ds.embedding.sharding.owner_pooled:OwnerPooled",
    "hierarchical_pooled": "gmeta_ds.embedding.sharding.hierarchical:HierarchicalPooled",
})


def accelerator_device() -> torch.device | None:
    """This rank's accelerator (CUDA, by LOCAL_RANK), or None on a machine without one."""
    if not torch.cuda.is_available():
        return None
    import os

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def resolve_placement(plan: ShardingPlan, rank: int, device: torch.device | None = None,
                      budget_fraction: float = 0.5) -> dict[str, str]:
    """``accelerator`` or ``host`` for every table. ``auto``: on the accelerator when there is
    one and the tables placed there fit ``budget_fraction`` of its memory by `TableLayout.bytes_on`
    (largest first), else on the host. ``accelerator`` without one is an error naming the table."""
    device = device if device is not None else accelerator_device()
    on_accelerator = device is not None and device.type != "cpu"
    placed = {}
    for name, p in plan.tables.items():
        if p.table.device == "accelerator" and not on_accelerator:
            raise ValueError(f"table {name!r}: device accelerator, but this rank has no accelerator "
                             f"(torch.cuda.is_available() is False); set embedding.tables.{name}.device "
                             "to host or auto")
        if p.table.device != "auto":
            placed[name] = p.table.device
    budget = 0
    if on_accelerator:
        budget = budget_fraction * torch.cuda.get_device_properties(device).total_memory
        budget -= sum(plan.tables[n].layout.bytes_on(rank) for n, d in placed.items() if d == "accelerator")
    for name, p in sorted(plan.tables.items(), key=lambda item: -item[1].layout.bytes_on(rank)):
        if name in placed:
            continue
        cost = p.layout.bytes_on(rank)
        placed[name] = "accelerator" if on_accelerator and cost <= budget else "host"
        budget -= cost if placed[name] == "accelerator" else 0
    return {name: placed[name] for name in plan.tables}


class ShardedEmbeddingCollection:
    """Each rank's shards of every table (``shards[name]``: (local rows, dim) parameters).

    Same forward contract as `EmbeddingCollection`:
    ``forward({feature: Jagged}) -> {feature: (N, d) pooled | (nnz, d)}``, rows on ``device``
    (the dense model's; default: this rank's accelerator if any, else the host). Collective:
    every rank must call forward (and later backward) once per micro-batch, with its own ids;
    construction is collective too when a table is placed on the host next to a default
    group that is not gloo, or explicitly (it creates the host tables' gloo group).
    ``strategy[name]``: table ``name``'s `Sharding`; ``strategies``: one per strategy name.

    Args:
        plan: the `ShardingPlan` of every table over the ranks (`plan_tables`).
        rank: this process's rank in the default group.
        seed: the seed of the rows' initialisation (the same rows as an unsharded twin's).
        bad_ids: an out-of-range id is an ``error`` (naming feature, table and id) or
            ``hash``ed by modulo into the table's rows.
        dedup: look up each distinct id once per call (rows and gradients are the same).
        device: where looked-up rows are returned; None: this rank's accelerator if any,
            else the host.
        timeout_s: seconds the creation of the host-topology groups may wait (plans of
            several hosts with a hierarchical exchange); None: the default group's timeout.
    """

    def __init__(self, plan: ShardingPlan, rank: int, seed: int = 0, bad_ids: str = "error",
                 dedup: bool = True, device: torch.device | str | None = None, timeout_s: int | None = None):
        self.plan, self.rank, self.world = plan, rank, plan.world_size
        self.bad_ids, self.dedup, self.seed = bad_ids, dedup, seed
        device = torch.device(device) if device is not None else accelerator_device()
        self.device = device if device is not None else torch.device("cpu")
        self.placement = resolve_placement(plan, rank, self.device)
        self.table_device = {name: self.device if where == "accelerator" else torch.device("cpu")
                             for name, where in self.placement.items()}
        self.groups = self._groups()
        self.by_feature = feature_tables([p.table for p in plan.tables.values()])
        self.ctx = ShardContext(plan, rank, seed, bad_ids, dedup, self.device, self.table_device, self.groups,
                                self.by_feature)
        self._topology(timeout_s)
        self.strategies, self.strategy = self._strategies()
        self.dynamic = {name: index for s in self.strategies.values() for name, index in s.indexes.items()}
        self.shards, self.optimizers, self.stats = self.ctx.shards, self.ctx.optimizers, self.ctx.stats
        for name in plan.tables:
            self.shards[name] = nn.Parameter(self._initial_rows(name))
        for name, p in plan.tables.items():
            self.optimizers[name] = build_sparse_optimizer(p.table.optimizer, self.shards[name], p.table.lr)
        self._field_tables: dict[tuple, FieldTables | None] = {}
        self.pooled = frozenset(name for name, s in self.strategy.items() if s.pools_on_owner)
        self._counted = frozenset(name for name, s in self.strategy.items() if s.counts)
        # Called with (table, its shard) in `step` before the table's update, its gradient
        # averaged: the outer synchronisation across sites keeps the anchors of touched rows.
        self.before_update = None

    def _groups(self) -> dict[str, object]:
        """The process group of each table's exchange (None: the default group). Host tables
        get a gloo group of their own when the default one is not gloo, or when ``host`` was
        asked for explicitly (so that path runs, and is tested, on CPU machines too)."""
        groups = {name: None for name in self.plan.tables}
        if self.world == 1 or not dist.is_initialized():
            return groups
        default_gloo = dist.get_backend() == "gloo"
        own = [name for name, where in self.placement.items() if where == "host" and
               (not default_gloo or self.plan.tables[name].table.device == "host")]
        if own:
            host_group = dist.new_group(backend="gloo")
            groups.update({name: host_group for name in own})
        return groups

    def _topology(self, timeout_s: int | None) -> None:
        """On a plan of several hosts: which ranks are on another host (the counters' cross-host
        bytes) and, for a hierarchical exchange, the intra- and inter-host groups (created
        once, collectively, with ``timeout_s``; `engine.hosts.topology_groups`)."""
        topology = self.plan.topology
        if topology is None or self.world == 1:
            return
        self.ctx.remote = topology.remote(self.rank)
        if (self.plan.hierarchical or self.plan.hierarchical_rows) and dist.is_initialized():
            self.ctx.tiers = topology_groups(topology, self.rank, timeout_s)

    def _strategies(self) -> tuple[dict[str, Sharding], dict[str, Sharding]]:
        """One `Sharding` (`registry.SHARDINGS`) per strategy name over its tables (in plan
        order), and each table's, as `strategy_name` picks them."""
        names = defaultdict(list)
        for name, p in self.plan.tables.items():
            names[strategy_name(p, self.plan.hierarchical)].append(name)
        strategies = {kind: SHARDINGS[kind](self.ctx, tuple(tables)) for kind, tables in names.items()}
        of = {name: s for s in strategies.values() for name in s.names}
        return strategies, {name: of[name] for name in self.plan.tables}

    def _initial_rows(self, name: str) -> Tensor:
        """Table ``name``'s first rows on this rank (its strategy's), on the table's device;
        host rows pinned where CUDA is available (faster copies to the device)."""
        rows = self.strategy[name].initial_rows(name).to(self.table_device[name])
        if rows.device.type == "cpu" and torch.cuda.is_available():
            rows = rows.pin_memory()
        return rows

    def parameters(self) -> list[nn.Parameter]:
        return list(self.shards.values())

    # ------------------------------------------------------------------ forward
    def __call__(self, features: dict[str, Jagged]) -> dict[str, Tensor]:
        return self.forward(features)

    def forward(self, features: dict[str, Jagged]) -> dict[str, Tensor]:
        """Every feature's rows through the three stages (input_dist, lookup, output_dist);
        collective: every rank calls it once per micro-batch with its own ids.

        Args:
            features: feature name -> its ids as a `Jagged` (one bag per sample).

        Returns:
            feature -> rows on ``device``: (N, d) pooled by the feature's table (sum or mean;
            single-hot ids give their row), or (nnz, d) for ``pooling="none"``.

        Raises:
            ValueError: an id out of range of its table with ``bad_ids="error"``, naming the
                feature, the table and the id.
        """
        by_rows, by_owner = self._split_pooled(features)
        requests = self._requests(by_rows)
        out = self._per_feature(by_rows, requests, self._rows(requests))
        out.update(self._owner_pooled(by_owner))
        return {feature: out[feature] for feature in features}

    def _split_pooled(self, features: dict[str, Jagged]) -> tuple[dict, dict]:
        """``features`` split into those looked up by rows and those pooled on their owners."""
        if not self.pooled:
            return features, {}
        by_owner = {f: j for f, j in features.items() if self.by_feature[f].name in self.pooled}
        return {f: j for f, j in features.items() if f not in by_owner}, by_owner

    def lookup_fields(self, ids: Tensor, fields: list[str], multi: dict | None = None) -> Tensor:
        """Single-hot ids (..., F) (+ multi-hot bags) -> rows (..., F + M, d) in one fused lookup.

        The rows, gradients, requests and traffic of `tables.lookup_fields` (one `Jagged.single`
        per field through `forward`), bit for bit, with the single-hot fields kept as one (N, F)
        tensor: their ids checked in one op (`check_fields`), every table's request
        deduplicated by one unique of table-offset keys (`FieldTables`), their rows gathered by
        one index. (With several threads the per-field path's accumulating index is not
        deterministic; this one is, and equals its one-thread result.) Bags keep the
        per-feature path; fields sharing a table (with each other or a bag), unknown features,
        dynamic tables or tables of different dimensions take `tables.lookup_fields` as a whole.

        Args:
            ids: this rank's (..., F) single-hot ids (column f: field ``fields[f]``).
            fields: the names of the F columns of ``ids``.
            multi: bags of multi-hot features (feature -> `Jagged`, prod(...) bags); None: none.

        Returns:
            Rows (..., F + M, d) on ``device``: the F single-hot fields, then ``multi``'s M
            pooled features in its order.

        Raises:
            ValueError: a width of ``ids`` other than len(fields), or (``bad_ids="error"``)
                an id outside its table.
        """
        multi = multi or {}
        check_width(ids, fields)
        signature = (tuple(fields), tuple(multi))
        if signature not in self._field_tables:
            self._field_tables[signature] = FieldTables.of(self.by_feature, *signature,
                                                           self.pooled | self._counted)
        layout = self._field_tables[signature]
        if layout is None:
            return lookup_fields(self, ids, fields, multi)
        if layout.num_rows.device != ids.device:  # the ids' device from now on (one copy)
            layout = self._field_tables[signature] = layout.on(ids.device)
        flat = check_fields(ids.reshape(-1, len(fields)).long(), fields, layout.tables, layout.num_rows,
                            self.bad_ids)
        requests, inverse = field_requests(layout, flat, self.dedup)
        names = list(requests)
        by_rows, by_owner = self._split_pooled(multi)
        bags = self._requests(by_rows)
        rows = self._rows({**requests, **bags})
        # index_select, not indexing: as fast again, and its backward sums each row's
        # gradients serially in the order of `inverse`, as the per-field indexing does
        out = torch.cat([rows[name] for name in names]).index_select(0, inverse.reshape(-1))
        out = out.view(*inverse.shape, -1)  # (N, F, d)
        if multi:
            pooled = self._per_feature(by_rows, bags, rows) | self._owner_pooled(by_owner)
            out = torch.cat([out, torch.stack([pooled[f] for f in multi], dim=1)], dim=1)
        return out.reshape(*ids.shape[:-1], out.shape[1], -1)

    def _requests(self, features: dict[str, Jagged]) -> dict[str, Request]:
        """Per table: the ids to fetch, the index of each value of its features (concatenated)
        into them, and (tables whose strategy counts them: dynamic) each id's occurrences."""
        return table_requests(self.ctx, features, self._counted)

    def _rows(self, requests: dict[str, Request]) -> dict[str, Tensor]:
        """Rows of every table's requested ids, on ``self.device``: each table's strategy looks
        them up at once or adds them to the lookup's one `RowExchange` (one exchange per group
        of tables of one dimension, placement and process group)."""
        exchange, rows = RowExchange(self.ctx), {}
        for name, request in requests.items():
            local = self.strategy[name].input_dist(name, request, exchange)
            if local is not None:
                rows[name] = local
        rows.update(exchange.rows())
        return {name: r.to(self.device) for name, r in rows.items()}

    def _owner_pooled(self, features: dict[str, Jagged]) -> dict[str, Tensor]:
        """Pooled rows (N, d) of features whose tables pool on their owners (`OwnerPooled.pool`)."""
        by_strategy = defaultdict(dict)
        for feature, jagged in features.items():
            by_strategy[self.strategy[self.by_feature[feature].name]][feature] = jagged
        out = {}
        for strategy, part in by_strategy.items():
            out.update(strategy.pool(part))
        return out

    def _per_feature(self, features, requests, rows) -> dict[str, Tensor]:
        out, cursor = {}, defaultdict(int)
        for feature, jagged in features.items():
            name = self.by_feature[feature].name
            inverse = requests[name].inverse
            start = cursor[name]
            cursor[name] += len(jagged.values)
            values = rows[name][inverse[start:cursor[name]].to(self.device)]
            out[feature] = pool(values, jagged, self.plan.tables[name].table.pooling)
        return out

    # ------------------------------------------------------------------ training
    def finish_gradients(self, leave: frozenset = frozenset()) -> None:
        """Average row gradients over ranks, each strategy for its tables: sharded rows arrived
        summed over ranks (divided by the world size); replicated tables are all-reduced
        together, one collective per group. Sharded tables in ``leave`` keep their summed,
        uncoalesced gradient (`step` scales it).

        Args:
            leave: names of sharded tables whose gradient stays summed and uncoalesced.
        """
        if self.world == 1:
            return
        for strategy in self.strategies.values():
            strategy.finish_gradients(leave)

    def step(self) -> None:
        """Average gradients, apply each table's sparse optimizer, clear gradients. Plain SGD
        (no momentum, weight decay or maximize) on a sparse gradient is applied as one
        ``index_add`` of the uncoalesced gradient, scaled by lr / W: adding the entries of a row
        one by one is the same update, without coalescing (a sort of every entry). Plain
        Adagrad takes `adagrad_rows`, torch's arithmetic by index ops (`optim.fast_update`),
        on the summed gradient (`optim.summed_rows`: linear time on small tables) divided by W.
        Which tables take these on the summed gradient is their strategy's `Sharding.direct_update`;
        `optim.apply_update` dispatches through `optim.ROW_UPDATES`."""
        direct = {name: how for name, strategy in self.strategy.items() if (how := strategy.direct_update(name))}
        self.finish_gradients(leave=frozenset(direct))
        for name, p in self.shards.items():
            if self.before_update is not None:
                self.before_update(name, p)
            optimizer = self.optimizers[name]
            how = direct.get(name) or fast_update(optimizer, p)  # (averaged gradients now)
            apply_update(optimizer, p, how, self.world if name in direct else 1)
            p.grad = None

    # ------------------------------------------------------------------ reporting
    def _sum_on_host(self, values: list[float]) -> list[float]:
        """float64 sums over ranks of per-rank host numbers: over gloo (the default group or
        the host tables'), else through the default group on the device."""
        total = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            host = next((g for g in self.groups.values() if g is not None), None)
            if host is None:
                total = on_wire(total)  # the default group (NCCL takes device tensors only)
            dist.all_reduce(total, group=host)
        return total.cpu().tolist()

    def checksum(self) -> float:
        """float64 sum of every table's rows, each row counted once over all ranks (dynamic
        tables: the rows of admitted ids plus the mean of the ranks' default rows, so a run
        equals its one-process twin whenever their default rows do); each strategy gives its
        tables' terms (`Sharding.checksum`), added in table order."""
        local = 0.0
        for name, strategy in self.strategy.items():
            for term in strategy.checksum(name):
                local += term
        return self._sum_on_host([local])[0]

    def dynamic_counters(self) -> dict[str, dict[str, int]]:
        """This rank's dynamic-table counters (cumulative) and occupancy, per table."""
        return {name: {**index.counters, "occupancy": index.occupancy, "capacity": index.capacity}
                for name, index in self.dynamic.items()}

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict[str, Tensor]:
        """This rank's checkpoint entries of every table (`Sharding.state`: rows by global id,
        sparse-optimizer state; dynamic tables their map too), flat; not collective."""
        return {key: value for name in self.plan.tables for key, value in self.strategy[name].state(name).items()}

    def load_state(self, files: list[dict[str, Tensor]]) -> None:
        """Every table's rows and optimizer state from every saved rank's `state` (any old world
        size or plan: each strategy takes the rows its layout gives this rank); not collective.

        Args:
            files: the `state` dicts of every rank of the saved run, in rank order.
        """
        for name in self.plan.tables:
            self.strategy[name].load_state(name, files)

    # ------------------------------------------------------------------ export
    def gather_tables(self, everywhere: bool = False) -> dict[str, Tensor]:
        """Full static tables on rank 0 (every rank with ``everywhere``; {} elsewhere);
        collective. Dynamic tables are in `gather_state`.

        Args:
            everywhere: return the tables on every rank, not only on rank 0.

        Returns:
            Table name -> its full (num_rows, dim) rows; {} on ranks that get nothing.
        """
        full = {}
        for name, strategy in self.strategy.items():
            table = strategy.gather_table(name, everywhere)
            if table is not None:
                full[name] = table
        return full if everywhere or self.rank == 0 else {}

    def gather_state(self, everywhere: bool = False) -> dict[str, Tensor]:
        """Every table as `EmbeddingCollection` state-dict entries (``weights.<table>``; dynamic
        tables: ``dynamic.<table>.ids`` (sorted admitted ids), ``.rows`` and ``.defaults``, every
        rank's default row), on rank 0 or everywhere; collective.

        Args:
            everywhere: return the state on every rank, not only on rank 0.

        Returns:
            State-dict key -> tensor, as an `EmbeddingCollection` of the same tables holds
            them; {} on ranks that get nothing.
        """
        state = {f"weights.{name}": t for name, t in self.gather_tables(everywhere).items()}
        for strategy in self.strategies.values():
            state.update(strategy.gather_state(everywhere))
        return state if everywhere or self.rank == 0 else {}
