"""Meta-IO: turn an `InteractionLog` (HF `datasets`, Arrow) into cold-start tasks.

Steps, all deterministic given the config and seed:
1. read the log (`readers.py`), label clicks (rating >= ``threshold``; a 0/1 column under the
   default threshold is read as clicks, `readers.click_threshold`; one class left is an error);
2. group interactions by task key (one task per user), drop tasks outside
   [``min_interactions``, ``max_interactions``] (counted in ``stats``);
3. split users into train and test (user cold-start, ``test_fraction``, seeded);
4. build categorical vocabularies from the **training** users' rows only: id 0 is the
   out-of-vocabulary bucket (values seen fewer than ``min_count`` times, and values only
   held-out users have, e.g. new items); columns in ``raw_ids`` keep their own values as
   int64 ids instead (integers as they are, other values by `raw_ids`), for dynamic tables;
5. order each task's rows (by `stream.row_order_key`, a seeded hash of the row number, or by
   time) and put the last ``query_size`` rows in the query, the rest in the support.
`tasks_from_log` runs the steps in memory on a log already read (frames from the Python API,
and the reference the out-of-core path is tested against); `build_tasks` runs them out of core
(`stream.py`) into a task store under ``cache_dir``, keyed by the data config, the seed and the
log files' names, sizes, modification times and content (`store_check.content_fingerprint`:
a tool can restore a changed file's size and mtime), or a URL's objects' sizes, times and
ETags or versions (`remote.object_stamps`), so a later run skips steps 1-5.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gmeta_ds.config import DataConfig
from gmeta_ds.data.readers import (DataError, InteractionLog, LogSchema, check_two_classes, click_threshold,
                                   get_reader)
from gmeta_ds.data.user_split import TEST, TRAIN, VALID, split_users
from gmeta_ds.data.store_check import content_fingerprint
from gmeta_ds.data.store_lock import STALL_S, build_lock
from gmeta_ds.data.stream import (STORE_VERSION, Source, build_store, check_raw_ids, file_source, log_source,
                                  long_task_chunks, open_store, row_order_key, store_version)
from gmeta_ds.data.tasks import TaskData, TaskSet, take_rows
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.data.vocab import Vocabulary

# 7: the store keeps the vocabularies; 6: a 0/1 label under the default threshold is clicks
# (`readers.click_threshold`); 5: the key sees the log's content; 4: within-task order by
# `stream.row_order_key`
CACHE_VERSION = 7

DEFAULT_CACHE_DIR = DataConfig().cache_dir


def read_log(cfg: DataConfig) -> InteractionLog:
    """The configured reader applied to ``cfg.path``."""
    reader = get_reader(cfg.source)
    if cfg.source == "recbole":
        return reader(cfg.path, cfg.dataset_name)
    if cfg.source == "table":
        return reader(cfg.path, table_schema(cfg), cfg.format, cfg.sep)
    return reader(cfg.path)


def table_source(cfg: DataConfig, stamps: bool = False) -> Source:
    """The files of ``data.path`` (``source: table``) as `stream.file_source` finds them under
    ``data.format``, ``data.storage_options``, ``data.filter`` and a Delta table's pinned version."""
    return file_source(cfg.path, cfg.format, cfg.storage_options, stamps=stamps, where=cfg.filter,
                       version=cfg.version_as_of, timestamp=cfg.timestamp_as_of)


def cache_key(cfg: DataConfig, seed: int, source: Source | None = None) -> str:
    """Hash of everything the tasks depend on: data config (not the synthetic section), seed,
    and each log file's name, size, modification time and `content_fingerprint` (a Delta
    table: its id and the version read). ``source``: the table's files (`table_source` with
    stamps) when the caller has them already."""
    settings = {k: v for k, v in dataclasses.asdict(cfg).items()
                if k not in ("synthetic", "cache_dir", "memory_limit", "prefetch", "bucket_by_length", "resample")}
    if settings["long_tasks"] == "skip":  # the key of stores built before long_tasks existed
        settings.pop("long_tasks")
    if not settings["raw_ids"]:  # the key of stores built before raw_ids existed
        settings.pop("raw_ids")
    else:
        settings["raw_ids"] = sorted(settings["raw_ids"])
    settings.pop("storage_options")  # how to reach the store, not what it holds (and may hold secrets)
    if not settings["filter"]:  # the key of stores built before data.filter existed
        settings.pop("filter")
    for key in ("version_as_of", "timestamp_as_of"):  # the version they resolve to is in the stamps
        settings.pop(key)
    path = Path(cfg.path).expanduser()
    if cfg.source == "table":  # a file, a folder of shards, a glob, the objects behind a URL, a Delta table
        source = source if source is not None else table_source(cfg, stamps=True)
        files = [] if source.stamps is not None else source.files
        stamps = source.stamps or []
    else:
        files, stamps = sorted(path.iterdir()) if path.is_dir() else [path], []
    stamps += [(f.name, f.stat().st_size, f.stat().st_mtime_ns, content_fingerprint(f)) for f in files if f.is_file()]
    blob = json.dumps([CACHE_VERSION, settings, seed, stamps], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _vocab(values: np.ndarray, train_rows: np.ndarray, min_count: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted known values, their ids): ids 1..V by descending training count, then value;
    every other value maps to 0."""
    uniq, counts = np.unique(values[train_rows], return_counts=True)
    keep = counts >= min_count
    uniq, counts = uniq[keep], counts[keep]
    ids = np.empty(len(uniq), dtype=np.int32)
    ids[np.lexsort((uniq, -counts))] = np.arange(1, len(uniq) + 1, dtype=np.int32)
    return uniq, ids


def _in_id_order(vocab: tuple[np.ndarray, np.ndarray]) -> Vocabulary:
    """A `_vocab` (sorted values, their ids) as a `Vocabulary` (values in id order)."""
    known, ids = vocab
    return Vocabulary.from_arrow(pa.array(known[np.argsort(ids, kind="stable")], pa.string()))


def raw_ids(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A column's values as int64 ids with no vocabulary, by `value_id` of their string form
    (the form vocabularies use): integers keep their values, other values get their
    `string_id` -- the ids `stream.py` computes in SQL."""
    from gmeta_ds.data.readers import MISSING
    from gmeta_ds.sparse import string_id, value_id

    if pa.types.is_integer(column.type):
        return pc.fill_null(column, string_id(MISSING)).to_numpy(zero_copy_only=False).astype(np.int64)
    text = np.asarray(column.to_numpy(zero_copy_only=False)).astype(str)
    uniq, inverse = np.unique(text, return_inverse=True)
    return np.array([value_id(v) for v in uniq], dtype=np.int64)[inverse.reshape(-1)]


def _encode(values: np.ndarray, vocab: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Vectorized lookup of ``values`` in a `_vocab` (binary search)."""
    known, ids = vocab
    if len(known) == 0:
        return np.zeros(len(values), dtype=np.int32)
    pos = np.clip(np.searchsorted(known, values), 0, len(known) - 1)
    return np.where(known[pos] == values, ids[pos], 0).astype(np.int32)


def _users(log: InteractionLog, cfg: DataConfig, seed: int,
           stats: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows of kept tasks, grouped by task and ordered within it; task id of every row; per
    kept row, whether its task may be held out: not a long task's chunk under
    ``data.long_tasks: train``). Records kept/dropped task counts in ``stats``."""
    keys = np.asarray(log.frame.data.column(log.schema.task_key).to_numpy(zero_copy_only=False)).astype(str)
    uniq, task_of_row = np.unique(keys, return_inverse=True)
    lengths = np.bincount(task_of_row, minlength=len(uniq))
    short = lengths < cfg.min_interactions
    if cfg.short_tasks == "error" and short.any():
        examples = ", ".join(map(str, uniq[short][:5]))
        raise DataError(f"{log.source}: {int(short.sum())} task(s) have fewer than "
                        f"{cfg.min_interactions} interactions (data.min_interactions), e.g. "
                        f"{log.schema.task_key} {examples}; set data.short_tasks: skip to drop them")
    keep = ~short & (lengths <= cfg.max_interactions)
    long = (lengths > cfg.max_interactions) if cfg.long_tasks == "train" else np.zeros_like(keep)
    stats.update(tasks_read=len(uniq), tasks_too_short=int((lengths < cfg.min_interactions).sum()),
                 tasks_too_long=int((lengths > cfg.max_interactions).sum()), tasks_kept=int(keep.sum()))
    if not keep.any():
        raise DataError(f"{log.source}: no task has between {cfg.min_interactions} and "
                        f"{cfg.max_interactions} interactions ({len(uniq)} tasks read); "
                        "adjust data.min_interactions / data.max_interactions")
    if cfg.split == "time" and not log.schema.timestamp:
        raise DataError(f"{log.source}: data.split 'time' needs a timestamp column, and this log has "
                        "none (data.schema.timestamp); use data.split: random")
    if cfg.split == "time":
        within = log.frame.data.column(log.schema.timestamp).to_numpy().astype(np.int64)
    else:
        within = row_order_key(np.arange(len(keys)), seed)
    user_of_row = task_of_row
    if long.any():  # data.long_tasks: train -- each long task becomes `long_task_chunks` tasks
        stats["long_tasks_trained"] = int(long.sum())
        chunks = long_task_chunks(lengths, long, cfg.max_interactions)
        order = within if cfg.split != "time" else row_order_key(np.arange(len(keys)), seed)
        chunk = order % chunks[task_of_row].astype(np.uint64)
        task_of_row = task_of_row.astype(np.int64) * int(chunks.max()) + chunk.astype(np.int64)
    rows = np.lexsort((within, task_of_row))
    rows = rows[(keep | long)[user_of_row[rows]]]
    # the rows of tasks that may be held out (long tasks train only)
    return rows, task_of_row, keep[user_of_row[rows]]


def _fields(log: InteractionLog) -> tuple[list[str], list[str], dict[str, str]]:
    """(user fields, item fields incl. the item id, {multi-hot field: side}). The task key is
    not a feature: held-out users are new, so their id could carry no information."""
    s = log.schema
    user = [c for c in s.user_features if c not in s.multi_hot]
    item = [s.item_key] + [c for c in s.item_features if c not in s.multi_hot]
    return user, item, {c: "user" if c in s.user_features else "item" for c in s.multi_hot}


def build_tasks(cfg: DataConfig, seed: int, timeout_s: float = STALL_S) -> TaskData:
    """Tasks for ``cfg`` from a task store under ``data.cache_dir`` (rows read on demand; built out
    of core by `stream.build_store` the first time, by one process while the others wait, at
    most ``timeout_s`` (the run's ``train.collective_timeout_s``) past the builder's last sign
    of life; reused by later runs with the same cache key); see the module docstring for the steps."""
    # a table's files are found once: a Delta table's latest version, read once, keys and builds the store
    source = table_source(cfg, stamps=True) if cfg.source == "table" else None
    store = store_path(cfg, seed, source)
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"data.cache_dir: cannot make the task cache folder {store.parent} "
                        f"({exc.strerror}); set data.cache_dir to a writable directory") from None
    if _missing(store):
        with build_lock(store, timeout_s):
            if _missing(store):
                if store.exists():  # an older gmeta_ds's store (no checksums) or a folder without manifest
                    shutil.rmtree(store)
                if cfg.source == "table":
                    schema = table_schema(cfg)
                else:
                    log = read_log(cfg)
                    source, schema = log_source(log), log.schema
                build_store(source, schema, cfg, seed, store)
                data = open_store(store)
                data.stats.pop("cache")  # built by this call, not reused
                return data
    return open_store(store)


def _missing(store: Path) -> bool:
    """Whether ``store`` is still to be built: no store, or one of an older `STORE_VERSION`
    (a damaged or newer store is left to `open_store`, which says so)."""
    if not (store / "manifest.json").is_file():
        return True
    version = store_version(store)
    return type(version) is int and version < STORE_VERSION


def cache_root(setting: str) -> Path:
    """The folder ``data.cache_dir`` names: ``~`` expanded, and the default ``~/.cache/gmeta_ds``
    under ``$XDG_CACHE_HOME`` when that is set (as Hugging Face's and torch's caches follow it)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if setting == DEFAULT_CACHE_DIR and xdg:
        return Path(xdg).expanduser() / "gmeta_ds"
    return Path(setting).expanduser()


def store_path(cfg: DataConfig, seed: int, source: Source | None = None) -> Path:
    """The task store of ``cfg`` and ``seed``: ``data.cache_dir/tasks-<cache key>``."""
    return cache_root(cfg.cache_dir) / f"tasks-{cache_key(cfg, seed, source)}"


def table_schema(cfg: DataConfig) -> LogSchema:
    """The column roles of ``data.schema`` (``source: table``)."""
    s = cfg.schema
    return LogSchema(s.task_key, s.item_key, s.label, s.timestamp, list(s.user_features),
                     list(s.item_features), dict(s.multi_hot))


def tasks_from_log(log: InteractionLog, cfg: DataConfig, seed: int) -> TaskData:
    """Steps 2-5 of the module docstring on a log already read (not cached)."""
    if len(log) == 0:
        raise DataError(f"{log.source}: the log holds no interactions")
    stats: dict = {"source": log.source, "interactions_read": len(log)}
    rows, task_of_row, candidate = _users(log, cfg, seed, stats)
    kept_tasks, first = np.unique(task_of_row[rows][candidate], return_index=True)
    kept_tasks = task_of_row[rows][candidate][np.sort(first)]
    split_of_task = np.zeros(task_of_row.max() + 1, dtype=np.int8)
    split_of_task[kept_tasks] = split_users(kept_tasks, cfg.test_fraction, cfg.valid_fraction, seed)
    split_of_row = split_of_task[task_of_row[rows]]
    masks = {"train": split_of_row == TRAIN, "valid": split_of_row == VALID, "test": split_of_row == TEST}
    if cfg.four_state:
        masks = _four_states(log, cfg, rows, masks)
    return _encode_split(log, cfg, rows, task_of_row, masks, stats)


STATES = ("warm", "user_cold", "item_cold", "user_item_cold")


def _four_states(log: InteractionLog, cfg: DataConfig, rows: np.ndarray, masks: dict) -> dict:
    """Row masks of MeLU's states: users are existing (training) or new (held out); items are
    new when released in or after ``new_item_year`` (unknown years count as existing).
    Training uses existing users x existing items, so ``warm`` scores those same tasks."""
    year_col = log.schema.release_year
    if year_col is None:
        raise DataError(f"{log.source}: data.four_state needs item release years, and this log "
                        "has no release-year column")
    years = np.asarray(log.frame.data.column(year_col).to_numpy(zero_copy_only=False)).astype(str)[rows]
    numeric = np.char.isdigit(years)
    new_item = np.zeros(len(rows), dtype=bool)
    new_item[numeric] = years[numeric].astype(np.int64) >= cfg.new_item_year
    train, test = masks["train"], masks["test"]
    return {"train": train & ~new_item, "valid": masks["valid"] & ~new_item, "test": test & ~new_item,
            "warm": train & ~new_item, "user_cold": test & ~new_item,
            "item_cold": train & new_item, "user_item_cold": test & new_item}


def _encode_split(log, cfg, rows, task_of_row, masks, stats) -> TaskData:
    table: pa.Table = log.frame.data.table if hasattr(log.frame.data, "table") else log.frame.data
    test_row = ~masks["train"]  # vocabularies see training rows only (not valid, not test)
    train_rows = np.nonzero(masks["train"])[0]
    user_cols, item_cols, multi_sides = _fields(log)
    fields, columns, multi, vocabularies = [], [], {}, {}
    check_raw_ids(cfg, multi_sides, user_cols + item_cols, log.source)
    for name, side in [(c, "user") for c in user_cols] + [(c, "item") for c in item_cols]:
        if name in cfg.raw_ids:
            values = raw_ids(table.column(name))[rows]
            fields.append(FieldSpec(name, len(np.unique(values[train_rows])), side, raw=True))
            columns.append(values)
            continue
        values = np.asarray(table.column(name).to_numpy(zero_copy_only=False)).astype(str)[rows]
        vocab = _vocab(values, train_rows, cfg.min_count)
        fields.append(FieldSpec(name, len(vocab[0]) + 1, side))
        columns.append(_encode(values, vocab))
        vocabularies[name] = _in_id_order(vocab)
    for name, side in multi_sides.items():
        col = table.column(name).take(pa.array(rows))
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
        tokens = np.asarray(pc.list_flatten(col).to_numpy(zero_copy_only=False)).astype(str)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        token_train = np.repeat(~test_row, lengths)
        vocab = _vocab(tokens, np.nonzero(token_train)[0], cfg.min_count)
        fields.append(FieldSpec(name, len(vocab[0]) + 1, side, multi_hot=True))
        multi[name] = (_encode(tokens, vocab), offsets)
        vocabularies[name] = _in_id_order(vocab)
    ids = np.stack(columns, axis=1) if columns else np.zeros((len(rows), 0), dtype=np.int32)
    ratings = log.frame.data.column(log.schema.label).to_numpy().astype(np.float32)[rows]
    if cfg.label == "regression":
        labels = ratings
        stats.update(mean_label=float(labels.mean()), vocab={f.name: f.num_ids for f in fields})
    else:
        zero_one = bool(np.isin(ratings, (0.0, 1.0)).all())
        threshold = click_threshold(cfg.threshold, zero_one)
        labels = (ratings >= threshold).astype(np.float32)
        check_two_classes(log.source, log.schema.label, threshold, int(labels.sum()), len(labels))
        stats.update(click_rate=float(labels.mean()), vocab={f.name: f.num_ids for f in fields})
    parts = {}
    for split, mask in masks.items():
        parts[split], dropped = _task_set(fields, ids, labels, multi, task_of_row[rows], mask, cfg.query_size)
        stats[f"{split}_tasks"] = len(parts[split])
        if dropped:
            stats[f"{split}_tasks_without_support"] = dropped
        if len(parts[split]) == 0 and split in ("train", "test"):
            raise DataError(f"{log.source}: no {split} task keeps more than data.query_size "
                            f"({cfg.query_size}) interactions after the split")
    states = {k: v for k, v in parts.items() if k in STATES}
    return TaskData(fields, parts["train"], parts["test"], stats, states, parts["valid"], vocabularies)


def _task_set(fields, ids, labels, multi, task_of_row, mask, query_size) -> tuple[TaskSet, int]:
    """Rows selected by ``mask`` (already grouped by task) as a TaskSet, keeping tasks with
    more than ``query_size`` rows; also returns how many tasks were dropped."""
    rows = np.nonzero(mask)[0]
    tasks, starts, lengths = np.unique(task_of_row[rows], return_index=True, return_counts=True)
    long_enough = lengths > query_size
    rows = rows[long_enough[np.searchsorted(tasks, task_of_row[rows])]]
    dropped = int((~long_enough).sum())
    tasks, starts, lengths = np.unique(task_of_row[rows], return_index=True, return_counts=True)
    order = np.argsort(starts)
    offsets = np.concatenate([[0], np.cumsum(lengths[order])]).astype(np.int64)
    sub_multi = {n: take_rows(v, o, rows) for n, (v, o) in multi.items()}
    return TaskSet(fields, ids[rows], labels[rows], offsets, (lengths[order] - query_size).astype(np.int64),
                   tasks[order].astype(np.int64), sub_multi), dropped
