"""``data``: where tasks come from (synthetic or a log on disk), and its own checks."""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Union

from gmeta_ds.config.checks import SPLITS, one_of, check_positive
from gmeta_ds.registry import LABEL_KINDS


def parse_memory(text: str) -> str:
    """``data.memory_limit`` ("2GB", "512MiB", bytes) as DuckDB's setting ("2048MB");
    ValueError naming the key for anything else or below 64 MB."""
    units = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    t = str(text).strip().upper().replace("IB", "B")
    num = t.rstrip("KMGTB ")
    unit = t[len(num):].strip()
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(f"data.memory_limit: {text!r} is not a size like 2GB or 512MB") from None
    if not math.isfinite(value):
        raise ValueError(f"data.memory_limit: {text!r} is not a finite size; expected one like 2GB or 512MB")
    if value < 64 * 2**20:
        raise ValueError(f"data.memory_limit: {text!r} is below 64MB; DuckDB needs more to sort")
    return f"{int(value // 2**20)}MB"


SUPPORT_SIZES = ("full", "random")  # data.resample_support


@dataclass
class SyntheticConfig:
    """Synthetic cold-start CTR data: users (tasks) and items with latent preferences."""

    num_users: int = 2000                  # users (tasks) generated
    num_items: int = 500                   # items generated
    latent_dim: int = 8                    # size of the latent user / item vectors behind the clicks
    min_interactions: int = 13             # fewest interactions of a user
    max_interactions: int = 100            # most interactions of a user
    query_size: int = 10                   # query rows per task (the rest is its support)
    zipf_exponent: float = 1.1             # item popularity follows Zipf with this exponent
    test_fraction: float = 0.2             # share of users held out (user cold-start evaluation)
    # How strongly categorical features reveal the latent vectors (0 = pure noise).
    feature_signal: float = 2.0
    # Std of the per-user click propensity that no feature reveals (learned from support).
    user_bias_std: float = 1.0
    preference_scale: float = 2.0          # weight of the latent preference in the click logit
    base_logit: float = -0.5               # click logit of an average user-item pair


@dataclass
class SchemaConfig:
    """Column roles of a generic CSV/Parquet log (``data.source: table``)."""

    task_key: str = "user_id"              # the column that names the task (user)
    item_key: str = "item_id"              # the column that names the item
    label: str = "rating"                  # the label column (clicked or rated)
    timestamp: Union[str, None] = None     # the time column (data.split: time); null = none
    # Categorical user columns, one field each.
    user_features: list[str] = field(default_factory=list)
    # Categorical item columns, one field each.
    item_features: list[str] = field(default_factory=list)
    # multi-hot column -> separator inside a cell, e.g. {genres: "|"}
    multi_hot: dict[str, str] = field(default_factory=dict)


@dataclass
class DataConfig:
    """Where tasks come from: ``synthetic`` (generated), or an interaction log on disk
    (``movielens-100k``, ``movielens-1m``, ``recbole``, ``table``) at ``path``."""

    source: str = "synthetic"              # synthetic | movielens-100k | movielens-1m | recbole | table
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    bucket_by_length: bool = True             # sort each meta-batch by task length: less padding
    prefetch: bool = True                     # collate the next meta-step in a background thread
    path: Union[str, None] = None          # logs: the folder or file to read (null with source: synthetic)
    dataset_name: Union[str, None] = None     # recbole: <name>.inter, .user, .item
    # table: auto | csv | parquet | delta (auto: a folder holding _delta_log/ is a Delta table)
    format: str = "auto"
    sep: str = ","                            # table: CSV separator
    schema: SchemaConfig = field(default_factory=SchemaConfig)
    label: str = "binary"                     # binary: click = rating >= threshold; regression: the rating
    threshold: float = 4.0                 # label binary: click = rating >= threshold
    query_size: int = 10                   # query rows per task (the rest is its support)
    split: str = "random"                     # support/query: random (seeded) or time (query = latest)
    # Episode resampling: each time meta-training draws a task, its support and query are
    # redrawn at random from all its rows (same sizes), keyed by (seed, meta-step); held-out
    # users keep their one split. Needs split: random (a time split's query is the latest rows).
    resample: bool = False
    # With resample: the support's size too. full: the task's own; random: each drawn episode
    # keeps the first k of its redrawn support rows, k log-uniform in [1, its support size], so
    # meta-training also sees the 1-20 row supports a new user brings (the query is unchanged).
    resample_support: str = "full"  # one of SUPPORT_SIZES
    min_interactions: int = 13                # tasks outside [min, max] are dropped and counted
    max_interactions: int = 100            # task-length filter: users with more rows (see data.long_tasks)
    short_tasks: str = "skip"                 # tasks below min_interactions: skip (counted) or error
    # Tasks above max_interactions: skip (counted), or train (the warm users' logs): kept for
    # meta-training only, never held out, each cut into ceil(n / max_interactions) tasks (rows
    # dealt at random by their seeded order key), so they look like the held-out users' tasks.
    # The held-out users are the same as with skip.
    long_tasks: str = "skip"
    min_count: int = 1                        # rarer categorical values share the OOV id 0
    # Single-hot columns kept as raw int64 ids, no vocabulary (strings: 63 bits of their MD5,
    # gmeta_ds.embedding.dynamic.string_id); the CTR workload adds every dynamic table's field.
    raw_ids: list[str] = field(default_factory=list)
    test_fraction: float = 0.2                # held-out (cold-start) users
    valid_fraction: float = 0.0               # further held-out users for tuning (eval.split: valid, eval.finetune_search)
    # MeLU's four states: items released in or after new_item_year are new; training uses
    # existing users x existing items; evaluation reports warm, user_cold, item_cold and
    # user_item_cold (eval.auc is user_cold's).
    four_state: bool = False
    # Data.four_state: items released from this year on are new (item-cold).
    new_item_year: int = 1998
    cache_dir: str = "~/.cache/gmeta_ds"   # where task stores are kept (follows $XDG_CACHE_HOME)
    # Memory the out-of-core task build may use (DuckDB's limit; it spills to disk beyond it).
    # A machine setting like cache_dir: accepted with every source (one list of --set serves
    # all), read only when a log is built (synthetic data is generated in memory).
    memory_limit: str = "1GB"
    # data.path as a URL (s3://, gs://, abfs://, hdfs://): keyword arguments of its pyarrow
    # filesystem (e.g. S3FileSystem's endpoint_override, region, access_key) for what the
    # store's standard chain (AWS_* variables, ~/.aws profiles, instance roles) does not give.
    # Secret values (keys named *key*, *secret*, *token*...) show as *** in summary.json and logs.
    storage_options: dict[str, Union[str, int, float, bool]] = field(default_factory=dict)
    # Table logs in Hive key=value folders: a SQL condition on the partition columns
    # ("date >= '2026-11-01' AND country = 'fr'"); files of other partitions are never read.
    filter: str = ""
    # A Delta Lake table (data.format: delta, or a folder holding _delta_log/): the version to
    # read; null (and no timestamp_as_of): the latest. The version read is in summary.json's
    # data_snapshot and keys the task store.
    version_as_of: Union[int, None] = None
    # A Delta Lake table: the last version committed at or before this time (ISO 8601, e.g.
    # "2026-11-30T08:00:00Z"; without a zone, UTC). Not with version_as_of.
    timestamp_as_of: Union[str, None] = None


def parse_as_of(text: str) -> datetime.datetime:
    """``data.timestamp_as_of`` ("2026-11-30", "2026-11-30T08:00:00Z", "...+02:00") as an aware
    datetime (no zone: UTC); ValueError naming the key for anything else."""
    try:
        when = datetime.datetime.fromisoformat(str(text).strip())
    except ValueError:
        raise ValueError(f"data.timestamp_as_of: {text!r} is not an ISO 8601 time such as 2026-11-30 or "
                         "2026-11-30T08:00:00Z") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)


def _check_snapshot(data: DataConfig, problems: list[str]) -> None:
    """``data.version_as_of`` / ``data.timestamp_as_of``: one of them, each well formed, and
    only where the log may be a Delta table."""
    if data.version_as_of is not None and data.timestamp_as_of is not None:
        problems.append(f"data.version_as_of ({data.version_as_of}) and data.timestamp_as_of "
                        f"({data.timestamp_as_of!r}): both set; a snapshot is pinned by one of them")
    if data.version_as_of is not None and data.version_as_of < 0:
        problems.append(f"data.version_as_of: {data.version_as_of} must be >= 0 (a Delta table's versions "
                        "count from 0)")
    if data.timestamp_as_of is not None:
        try:
            parse_as_of(data.timestamp_as_of)
        except ValueError as exc:
            problems.append(str(exc))
    pinned = [k for k in ("version_as_of", "timestamp_as_of") if getattr(data, k) is not None]
    if pinned and data.format in ("csv", "parquet"):
        problems.append(f"data.{pinned[0]}: set, but data.format is {data.format!r}; only a Delta table has "
                        "versions (data.format: delta or auto)")


def validate_log(data: DataConfig, problems: list[str]) -> None:
    """``data.*`` for an interaction log on disk: where it is, how it is split and labelled."""
    if not data.path:
        problems.append(f"data.path: required for data.source {data.source!r} (the folder or file "
                        "holding the log)")
    if data.source == "recbole" and not data.dataset_name:
        problems.append("data.dataset_name: required for data.source 'recbole' (<name>.inter)")
    one_of(problems, "data.split", data.split, SPLITS)
    if data.source == "table" and data.split == "time" and not data.schema.timestamp:
        problems.append("data.split: 'time' orders each task by its timestamp, but "
                        "data.schema.timestamp names no column; name it, or use 'random'")
    one_of(problems, "data.short_tasks", data.short_tasks, ("skip", "error"))
    one_of(problems, "data.label", data.label, LABEL_KINDS)
    one_of(problems, "data.format", data.format, ("auto", "csv", "parquet", "delta"))
    try:
        parse_memory(data.memory_limit)
    except ValueError as exc:
        problems.append(str(exc))
    if data.source == "table":
        _check_separators(data, problems)
        _check_snapshot(data, problems)
    check_positive(problems, "data.min_count", data.min_count)
    _check_task_sizes(data, "data.", problems)


def _check_separators(data: DataConfig, problems: list[str]) -> None:
    """``data.sep`` one character (the CSV reader's delimiter) and each multi-hot column's
    separator a non-empty string."""
    if len(data.sep) != 1:
        problems.append(f"data.sep: {data.sep!r} must be exactly one character (the CSV separator, "
                        "e.g. ',' or '\\t')")
    for column, sep in data.schema.multi_hot.items():
        if not sep:
            problems.append(f"data.schema.multi_hot.{column}: an empty separator; expected the string "
                            "that separates the values inside a cell, e.g. '|'")


def _check_task_sizes(section, p: str, problems: list[str]) -> None:
    """Task-size keys shared by data and data.synthetic (``p`` is the dotted prefix)."""
    for name in ("min_interactions", "query_size"):
        check_positive(problems, p + name, getattr(section, name))
    if section.min_interactions <= section.query_size:
        problems.append(f"{p}min_interactions: {section.min_interactions} must exceed "
                        f"{p}query_size ({section.query_size}) so every task keeps a support set")
    if section.max_interactions < section.min_interactions:
        problems.append(f"{p}max_interactions: {section.max_interactions} must be >= "
                        f"{p}min_interactions ({section.min_interactions})")
    if not 0.0 < section.test_fraction < 1.0:
        problems.append(f"{p}test_fraction: {section.test_fraction!r} must be in (0, 1)")


def validate_synthetic(syn: SyntheticConfig, problems: list[str]) -> None:
    """``data.synthetic.*``: sizes of the generated users, items and tasks."""
    for name in ("num_users", "num_items", "latent_dim"):
        check_positive(problems, "data.synthetic." + name, getattr(syn, name))
    if syn.num_users == 1:
        problems.append(f"data.synthetic.num_users: {syn.num_users} must be >= 2 (train and test "
                        "each need a user)")
    if syn.zipf_exponent < 0:
        problems.append(f"data.synthetic.zipf_exponent: {syn.zipf_exponent} must be >= 0 (0: every item "
                        "equally popular; larger: a steeper head)")
    if syn.user_bias_std < 0:
        problems.append(f"data.synthetic.user_bias_std: {syn.user_bias_std} must be >= 0")
    _check_task_sizes(syn, "data.synthetic.", problems)
