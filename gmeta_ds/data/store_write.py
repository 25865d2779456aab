"""Building a task store (`stream`): the `stream_build.StoreBuild` steps run under DuckDB in a
temporary sibling folder, the manifest written, the folder renamed into place.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from gmeta_ds.config import parse_memory
from gmeta_ds.data.readers import DataError, LogSchema
from gmeta_ds.data.store_files import STORE_VERSION, fsync_tree, write_array
from gmeta_ds.data.stream_build import StoreBuild
from gmeta_ds.data.stream_sources import Source, check_parquet, stage_csv

def estimate_bytes(rows: int, n_fields: int, n_multi: int) -> int:
    """Disk a build needs at most: the store (ids, labels, bags at ~3 tokens) plus DuckDB's
    spill of the sort (about the rows' width twice)."""
    store = rows * (4 * n_fields + 4 + n_multi * (8 + 12))
    return int(store * 3 + (64 << 20))


def build_store(source: Source, schema: LogSchema, cfg, seed: int, store: Path) -> Path:
    """Build the tasks of ``source`` into ``store`` (a folder; atomically: written into a
    temporary sibling and renamed into place). Returns ``store``. Call it holding
    `build_lock`: it first removes the temporary folders of builds of the same store that were
    killed before they could clean up (DuckDB's spill can be gigabytes)."""
    _check_column_names(schema)
    for stale in store.parent.glob(f"{store.name}.tmp-*"):  # a killed build's leftovers (the lock is ours)
        shutil.rmtree(stale, ignore_errors=True)
    work = store.with_name(f"{store.name}.tmp-{os.getpid()}")
    try:
        work.mkdir(parents=True)
        source = _prepared_source(source, schema, cfg, work, store)
        b, splits = _run_build(source, schema, cfg, seed, work)
        shutil.rmtree(work / "spill", ignore_errors=True)
        shutil.rmtree(work / "staged", ignore_errors=True)
        _write_manifest(work, b, splits)
        _move_into_place(work, store)
        return store
    except OSError as exc:  # ENOSPC, EACCES, ... while writing the store or DuckDB's spill
        raise DataError(f"data.cache_dir: cannot write the task store {store} ({exc.strerror or exc}); "
                        "free some disk or set data.cache_dir to a writable directory with room") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_column_names(schema: LogSchema) -> None:
    """Column names are quoted in the build's SQL, so none may hold a double quote."""
    quoted = [c for c in schema.columns() if '"' in c]
    if quoted:
        raise DataError(f"data.schema: column name(s) {', '.join(map(repr, quoted))} contain a double quote; "
                        "rename the column(s) in the log")


def _prepared_source(source: Source, schema: LogSchema, cfg, work: Path, store: Path) -> Source:
    """``source`` ready for DuckDB: CSV staged to Parquet under ``work``, every Parquet footer
    checked (readable, one schema), and enough free disk beside ``store`` for the build."""
    if source.files is not None and source.fmt == "csv":
        staged = stage_csv(source.files, schema.columns(), cfg.sep, work / "staged", source.filesystem)
        source = Source(source.what, staged, origins=source.files, partitions=source.partitions)
    if source.files is not None:  # footers first: readable, one schema
        check_parquet(source.files, schema.columns(), source.filesystem, source.partitions)
    need = estimate_bytes(source.rows(), len(schema.columns()), len(schema.multi_hot))
    free = shutil.disk_usage(store.parent).free
    if need > free:
        raise DataError(f"data.cache_dir {store.parent}: the task build needs about "
                        f"{need / 2**30:.1f} GiB of disk and {free / 2**30:.1f} GiB are free; "
                        "point data.cache_dir at a larger disk")
    return source


def _run_build(source: Source, schema: LogSchema, cfg, seed: int, work: Path) -> tuple[StoreBuild, dict]:
    """The build's steps on a DuckDB connection under ``data.memory_limit``, spilling into
    ``work``; returns the finished `StoreBuild` and each split's files. A DuckDB error (e.g. a
    damaged data page behind an intact footer) becomes a `DataError` naming the source."""
    import duckdb

    try:
        memory = parse_memory(cfg.memory_limit)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    con = duckdb.connect(config={"memory_limit": memory,
                                 "temp_directory": str(work / "spill"), "threads": build_threads(),
                                 "preserve_insertion_order": False})
    try:
        started = time.perf_counter()
        b = StoreBuild(source, schema, cfg, seed, work, con)
        splits = _run_phases(b, work)
        _label_stats(b)
        b.stats["build_s"] = round(time.perf_counter() - started, 3)
        return b, splits
    except duckdb.Error as exc:  # e.g. a damaged data page behind an intact footer
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        # an error of a URL's filesystem comes through DuckDB as a Python traceback: its last line
        line = lines[-1] if lines[0].startswith("Traceback") else lines[0]
        raise DataError(f"{source.what}: the task build failed while reading the log: {line}") from None
    finally:
        con.close()


def _run_phases(b: StoreBuild, work: Path) -> dict:
    """Run the build's steps in order, timing each into ``stats["build_phases_s"]``; returns
    each split's files. A train or test split left without tasks is an error."""
    phases = b.stats["build_phases_s"] = {}

    def phase(name, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        phases[name] = round(time.perf_counter() - t0, 3)
        return out
    phase("check", b.view)
    phase("tasks", b.tasks)
    phase("labels", b.labels)
    phase("vocabularies", b.vocabularies)
    splits = {}
    for name in b.masks:
        part = phase(f"write {name}", b.write_split, name, work)
        splits[name] = part["files"]
        b.stats[f"{name}_tasks"] = part["tasks"]
        if part["dropped"]:
            b.stats[f"{name}_tasks_without_support"] = part["dropped"]
        if part["tasks"] == 0 and name in ("train", "test"):
            raise DataError(f"{b.source.what}: no {name} task keeps more than data.query_size "
                            f"({b.cfg.query_size}) interactions after the split")
    return splits


def _label_stats(b: StoreBuild) -> None:
    """The mean label (regression) or click rate of the kept rows, into the build's stats;
    ``b.cfg`` carries the threshold that applies (`click_threshold`)."""
    label, cfg = b.schema.label, b.cfg
    rate = b.con.sql(f"SELECT avg(CASE WHEN \"{label}\" >= CAST({float(cfg.threshold)!r} AS FLOAT) "
                     f"THEN 1.0 ELSE 0.0 END), avg(\"{label}\") FROM j").fetchall()[0]
    if cfg.label == "regression":
        b.stats["mean_label"] = float(rate[1])
    else:
        b.stats["click_rate"] = float(rate[0])


def _write_manifest(work: Path, b: StoreBuild, splits: dict) -> None:
    """The vocabularies' files and ``manifest.json`` (format, version, label kind, fields,
    stats, every array file), then every file of ``work`` synced to disk."""
    vocab = {c: {"data": write_array(work, f"vocab.{n}.data", v.data),
                 "offsets": write_array(work, f"vocab.{n}.offsets", v.offsets)}
             for n, (c, v) in enumerate(b.vocab.items())}
    manifest = {"format": "gmeta_ds task store", "version": STORE_VERSION, "label": b.cfg.label,
                "fields": [asdict(f) for f in b.fields], "stats": b.stats, "splits": splits,
                "vocab": vocab}
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
    fsync_tree(work)


def _move_into_place(work: Path, store: Path) -> None:
    """Rename the finished ``work`` folder to ``store``; losing the race to another process
    that finished the same store first is fine."""
    try:
        work.rename(store)
    except OSError:
        if not (store / "manifest.json").is_file():  # not another process's finished store
            raise


def build_threads() -> int:
    """The CPUs this process may run on: DuckDB's thread count."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
