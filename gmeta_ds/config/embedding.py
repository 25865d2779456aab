"""``embedding``: where embedding tables live, per-table overrides, and their checks."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Union

from gmeta_ds.config.checks import (AUTO, BAD_ID_POLICIES, EXCHANGE_TOPOLOGIES, EXCHANGES, ROW_OWNERS,
                                    TABLE_DEVICES, one_of, check_positive)
from gmeta_ds.registry import PLANS, SPARSE_OPTIMIZERS


@dataclass
class TableOverride:
    """Per-table settings under ``embedding.tables.<name>`` (unset = the section's default)."""

    plan: str = "auto"                     # auto | row_wise | table_wise | replicated; auto: embedding.plan
    optimizer: Union[str, None] = None     # unset: embedding.optimizer
    lr: Union[float, None] = None          # unset: embedding.lr
    # static: a vocabulary of ids 0..V-1 from the task build; dynamic: any int64 id (the
    # field's raw values, strings hashed), `capacity` rows per rank, an id's own row after
    # `admit_after` lookups (rarer ids share a default row), `eviction` lru | lfu when full.
    kind: str = "static"
    capacity: Union[int, None] = None      # dynamic: rows per rank (required for kind: dynamic)
    admit_after: int = 1                   # dynamic: lookups before an id gets its own row
    eviction: str = "lru"                  # dynamic: lru | lfu, which row a full table gives up
    device: Union[str, None] = None           # auto | accelerator | host; unset: embedding.device
    exchange: Union[str, None] = None         # auto | rows | pooled; unset: embedding.exchange


@dataclass
class EmbeddingConfig:
    """Where embedding tables live.

    ``dense``: plain tables inside the DeepSpeed engine (dense gradients all-reduced; the
    DMAML-like baseline). ``sharded``: gmeta_ds's own sharded tables outside DeepSpeed, looked
    up by all-to-all, trained by sparse optimizers on owned rows.
    """

    # Dense: tables inside DeepSpeed (old spelling: replicated) | sharded: ours.
    sharding: str = "dense"
    # Sharded mode: plan kind for tables without an override; "auto" replicates tables with
    # fewer than replicate_below_rows rows and shards the rest row-wise.
    plan: str = "auto"
    # Row-wise plans: the owner of id i is i % world (modulo) or a block of ids.
    row_owner: str = "modulo"
    replicate_below_rows: int = 1024       # plan auto: tables with fewer rows are replicated, others sharded
    # Sparse optimizer of owned rows: sgd | adagrad | rowwise_adagrad | adam (lazy).
    optimizer: str = "adagrad"
    lr: float = 0.05                       # learning rate of the sparse optimizer
    init_std: float = 0.05                 # rows start from N(0, init_std^2)
    # An out-of-range id: error (naming feature, table, value) or hash (modulo rows).
    bad_ids: str = "error"
    # Look up each distinct id once per meta-step (the fused support+query lookup).
    dedup: bool = True
    # Where sharded tables live: accelerator (the rank's GPU; exchanges over the default group,
    # NCCL there), host (host memory, its own gloo group, rows moved to the device after the
    # exchange) or auto (the accelerator when the tables fit half its memory, else the host).
    device: str = "auto"
    # What sharded lookups of multi-hot (pooled) fields send back: rows (every distinct row,
    # pooled by the requester), pooled (each owner's partial sum per bag), or auto (by the
    # expected bytes of each, from the training data's bag lengths and distinct ids).
    exchange: str = "auto"
    # The run's hosts: 0 takes them from the launcher (LOCAL_WORLD_SIZE / LOCAL_SIZE ranks per
    # host); N splits the ranks into N hosts of equal size (one machine can pretend to be several).
    # With sites.count S > 1 the sites share them: each site N / S hosts (or one, when a host holds
    # whole sites).
    hosts: int = 0
    # How the exchanges cross hosts: flat (one all-to-all over every rank), hierarchical (inside
    # each host, then once per host pair: tables pooled on their owners send one partial sum per
    # bag and host, the row exchange each distinct id of a host once), auto (each exchange
    # hierarchical when there are several hosts of several ranks and it is expected to send
    # fewer bytes across hosts; `gmeta-ds validate` prints the estimates).
    exchange_topology: str = "flat"
    # Per-table overrides of the keys below, by table (field) name.
    tables: dict[str, TableOverride] = field(default_factory=dict)


# The old spelling of embedding.sharding: dense, read from configs, checkpoints and saved models
# written before the rename (it read like embedding.plan: replicated, copies outside DeepSpeed).
OLD_SHARDING = "replicated"


def renew_sharding(data: Any, warn: bool = True) -> Any:
    """``data`` (a whole config as a dict) with ``embedding.sharding: replicated`` read as
    ``dense``, warning once when ``warn`` (a `FutureWarning`, shown once per place by Python's
    default filter, on every rank as every rank reads the config; not for a stored config that
    is only compared); ``data`` itself is not changed."""
    emb = data.get("embedding") if isinstance(data, dict) else None
    if not isinstance(emb, dict) or emb.get("sharding") != OLD_SHARDING:
        return data
    if warn:
        warnings.warn("embedding.sharding: 'replicated' is now spelled 'dense' (tables inside the DeepSpeed "
                      "engine); the old spelling still works", FutureWarning, stacklevel=3)
    return {**data, "embedding": {**emb, "sharding": "dense"}}


def validate_embedding(emb: EmbeddingConfig, problems: list[str]) -> None:
    """``embedding.*``: choices, rates, every table, and what applies only when sharded."""
    one_of(problems, "embedding.plan", emb.plan, (AUTO, *PLANS.names()))
    one_of(problems, "embedding.row_owner", emb.row_owner, ROW_OWNERS)
    one_of(problems, "embedding.optimizer", emb.optimizer, SPARSE_OPTIMIZERS.names())
    one_of(problems, "embedding.bad_ids", emb.bad_ids, BAD_ID_POLICIES)
    check_positive(problems, "embedding.lr", emb.lr)
    check_positive(problems, "embedding.init_std", emb.init_std)
    one_of(problems, "embedding.device", emb.device, TABLE_DEVICES)
    one_of(problems, "embedding.exchange", emb.exchange, EXCHANGES)
    one_of(problems, "embedding.exchange_topology", emb.exchange_topology, EXCHANGE_TOPOLOGIES)
    if emb.replicate_below_rows < 0:
        problems.append(f"embedding.replicate_below_rows: {emb.replicate_below_rows!r} must be an integer "
                        ">= 0 (plan auto replicates tables with fewer rows; 0: none)")
    if isinstance(emb.hosts, bool) or not isinstance(emb.hosts, int) or emb.hosts < 0:
        problems.append(f"embedding.hosts: expected an integer >= 0 (0: the launcher's hosts), got {emb.hosts!r}")
    for name, table in emb.tables.items():
        _validate_table(name, table, problems)
    if emb.sharding != "dense":
        return
    if any(t.kind == "dynamic" for t in emb.tables.values()):
        problems.append("embedding.tables: dynamic tables need embedding.sharding: sharded (they live "
                        "outside the DeepSpeed engine, on their owner ranks)")
    elif emb.tables or emb.plan != "auto":
        problems.append("embedding.plan / embedding.tables apply to embedding.sharding: sharded; "
                        "with 'dense' every table lives inside the DeepSpeed engine")
    if emb.exchange != AUTO:
        problems.append("embedding.exchange applies to embedding.sharding: sharded; dense tables "
                        "are looked up inside the DeepSpeed engine, with no exchange")
    if emb.exchange_topology != "flat":
        problems.append("embedding.exchange_topology applies to embedding.sharding: sharded; dense tables "
                        "are looked up inside the DeepSpeed engine, with no exchange")
    if emb.device != AUTO:
        problems.append("embedding.device applies to embedding.sharding: sharded; dense tables "
                        "live inside the DeepSpeed engine, on its device")


def _validate_table(name: str, table: TableOverride, problems: list[str]) -> None:
    """``embedding.tables.<name>``: a static or dynamic table's own settings."""
    key = f"embedding.tables.{name}"
    one_of(problems, f"{key}.kind", table.kind, ("static", "dynamic"))
    if table.device is not None:
        one_of(problems, f"{key}.device", table.device, TABLE_DEVICES)
    if table.exchange is not None:
        one_of(problems, f"{key}.exchange", table.exchange, EXCHANGES)
    if table.kind == "dynamic":
        if not isinstance(table.capacity, int) or isinstance(table.capacity, bool) or table.capacity < 1:
            problems.append(f"{key}.capacity: a dynamic table needs its rows per rank as an integer "
                            f">= 1, got {table.capacity!r}")
        if not isinstance(table.admit_after, int) or table.admit_after < 1:
            problems.append(f"{key}.admit_after: expected an integer >= 1 (lookups before an id gets "
                            f"its own row), got {table.admit_after!r}")
        one_of(problems, f"{key}.eviction", table.eviction, ("lru", "lfu"))
        if table.plan not in (AUTO, "dynamic"):
            problems.append(f"{key}.plan: {table.plan!r}, but a dynamic table's rows are placed by a "
                            "hash of the id; leave plan at auto")
    elif table.capacity is not None:
        problems.append(f"{key}.capacity applies to kind: dynamic (a static table has one row per "
                        "vocabulary id)")
    if table.kind != "dynamic":
        one_of(problems, f"{key}.plan", table.plan, (AUTO, *PLANS.names()))
    if table.optimizer is not None:
        one_of(problems, f"{key}.optimizer", table.optimizer, SPARSE_OPTIMIZERS.names())
    if table.lr is not None:
        check_positive(problems, f"{key}.lr", table.lr)
