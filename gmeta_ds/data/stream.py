"""Meta-IO at scale: an out-of-core task build (DuckDB) into a memory-mapped task store.

The steps are those of `builder` (group by task key, filter by length, split users, build
vocabularies on training users only, order each task and cut support / query), with the
same results bit for bit (``tests/unit/data/test_stream.py`` checks it against the in-memory
path), but no step holds the log in memory:

* the log is read by DuckDB straight from Parquet (one file, a folder of shards, a glob, as
  Spark and Hive write them; only the needed columns), or from CSV staged to Parquet in
  chunks, or from an in-memory `InteractionLog` (the MovieLens and RecBole readers);
* grouping, vocabularies, joins and the final sort are DuckDB queries under
  ``data.memory_limit``, spilling to a temporary folder beside the store;
* the rows come out of the sort in batches and are written straight into the store's
  arrays: raw little-endian files, one per array, described by ``manifest.json``.

Why DuckDB: it reads Parquet/CSV globs with column projection, runs out-of-core sorts,
group-bys and hash joins under an explicit memory limit with a spill folder, is one pip
wheel with no server, and hands results to Arrow in batches. Polars' streaming engine does
the same group-bys but its out-of-core sort and memory limit are less explicit.

The store (``tasks-<cache key>/``) is opened with `numpy.memmap`: every rank of a node maps
the same files, so they share one copy in the page cache, and a rank reads only the rows of
the tasks it collates. It is written into a temporary sibling folder and renamed into place
when complete; ``manifest.json`` records ``STORE_VERSION`` and every array's file, dtype,
shape and checksum, all checked on open with the arrays' values (`store_check`), so a
half-written, damaged, edited or foreign folder is never used. One process builds a store
while the others wait on `store_lock.build_lock`, a bounded wait.
"""
from __future__ import annotations

import contextlib
import glob as globlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from gmeta_ds.config import parse_memory
from gmeta_ds.data.readers import (MISSING, DataError, InteractionLog, LogSchema, check_two_classes,
                                   click_threshold)
from gmeta_ds.data.store_check import HASH, file_digest, read_manifest, verify_split, verify_vocab
from gmeta_ds.data.store_lock import LOCK_WAIT_S, build_lock  # noqa: F401  (build_lock: API of this module)
from gmeta_ds.data.split import TEST, TRAIN, VALID, split_users
from gmeta_ds.data.tasks import TaskData, TaskSet
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.data.vocab import Vocabulary
from gmeta_ds.sparse import string_id

STORE_VERSION = 3  # 3: the vocabularies; 2: a checksum per file and the label kind (older stores are rebuilt)
STATES = ("warm", "user_cold", "item_cold", "user_item_cold")
BATCH_ROWS = 1 << 19
# lowbias32 (Chris Wellons' 32-bit integer hash): the within-task order of data.split: random
_MIX1, _MIX2, _M32 = 0x7FEB352D, 0x846CA68B, 0xFFFFFFFF


def order_seed(seed: int) -> int:
    """The 32-bit offset of `row_order_key` for a run seed."""
    return int(np.random.default_rng([seed, 17]).integers(0, 2**32))


def row_order_key(rows: np.ndarray, seed: int) -> np.ndarray:
    """lowbias32((row mod 2^32) xor offset(seed)): the pseudo-random key that orders the rows
    of a task under ``data.split: random``, ties (rows 2^32 apart) broken by row number. A
    function of the row's position in the log only, so any chunking of the log, any reader
    and any number of ranks give the same order; `_order_key_sql` is the same function in
    SQL (32-bit steps: DuckDB's 128-bit integer arithmetic is ~500x slower)."""
    x = (rows.astype(np.uint64) & np.uint64(_M32)) ^ np.uint64(order_seed(seed))
    m = np.uint64(_M32)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(_MIX1)) & m
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(_MIX2)) & m
    return x ^ (x >> np.uint64(16))


def long_task_chunks(lengths: np.ndarray, long: np.ndarray, max_interactions: int) -> np.ndarray:
    """Chunks per task under ``data.long_tasks: train``: a task with n > max_interactions rows
    (``long``) is cut into ceil(n / max_interactions) training tasks, row r going to chunk
    ``row_order_key(r) mod chunks``; every other task is one chunk."""
    return np.where(long, -(-lengths // max_interactions), 1).astype(np.int64)


def _order_key_sql(seed: int) -> tuple[str, list[str]]:
    """(final expression, helper columns) of `row_order_key` over the column ``_row``."""
    m = _M32
    return "xor(z4, z4 >> 16)", [
        f"xor(CAST(_row & {m} AS UBIGINT), CAST({order_seed(seed)} AS UBIGINT)) AS z0",
        "xor(z0, z0 >> 16) AS z1", f"((z1 * {_MIX1}) & {m}) AS z2",
        "xor(z2, z2 >> 15) AS z3", f"((z3 * {_MIX2}) & {m}) AS z4"]


# ---------------------------------------------------------------- sources
@dataclass
class Source:
    """Where the rows come from: Parquet ``files`` (in this order: row numbers run across
    them), or an Arrow ``table`` in memory. ``what`` names it in messages."""

    what: str
    files: list[Path] | None = None
    table: pa.Table | None = None
    fmt: str = "parquet"
    origins: list[Path] | None = None  # CSV: the files that ``files`` were staged from

    def rows(self) -> int:
        if self.table is not None:
            return self.table.num_rows
        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)


def _files(path: str | Path, fmt: str) -> tuple[list[Path], str]:
    """The files behind ``data.path``: a file, a folder of shards (every ``*.parquet`` /
    ``*.pq`` or ``*.csv`` / ``*.tsv`` / ``*.txt`` file in it, recursively, hidden and ``_``
    files skipped as Spark writes ``_SUCCESS``), or a glob; sorted by path."""
    text = str(path)
    p = Path(text).expanduser()
    if any(ch in text for ch in "*?["):
        files = sorted(Path(f) for f in globlib.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(f"data.path: the glob {text!r} matches no file")
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith((".", "_"))
                       and f.suffix.lower() in (".parquet", ".pq", ".csv", ".tsv", ".txt"))
        if not files:
            raise DataError(f"{p}: the folder holds no .parquet, .pq, .csv, .tsv or .txt file")
    elif p.is_file():
        files = [p]
    else:
        raise DataError(f"{p}: file does not exist (data.path)")
    kinds = {"parquet" if f.suffix.lower() in (".parquet", ".pq") else "csv" for f in files}
    if fmt == "auto":
        if len(kinds) > 1:
            raise DataError(f"data.path {text}: mixes Parquet and CSV files; set data.format or "
                            "keep one kind per folder")
        fmt = kinds.pop()
    if fmt not in ("csv", "parquet"):
        raise DataError(f"data.format: {fmt!r} is not one of auto, csv, parquet")
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(f"{f}: file is empty")
    return files, fmt


def _check_parquet(files: list[Path], columns: list[str]) -> dict[str, pa.DataType]:
    """Every file's schema (footer only): readable, has ``columns``, same types as the first
    file; returns the types."""
    first: dict[str, pa.DataType] | None = None
    for f in files:
        try:
            schema = pq.read_schema(f)
        except (OSError, ValueError) as exc:
            raise DataError(f"{f}: cannot read as Parquet ({exc}); is the file truncated?") from None
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise DataError(f"{f}: missing column(s) {', '.join(missing)}; columns found: "
                            f"{', '.join(schema.names)}")
        types = {c: _plain(schema.field(c).type) for c in columns}
        if first is None:
            first, first_file = types, f
        else:
            for c in columns:
                if _kind(types[c]) != _kind(first[c]):
                    raise DataError(f"{f}: column {c!r} is {types[c]}, but {first[c]} in "
                                    f"{first_file}; every file of the log must have one schema")
    return first


def _short(exc: Exception, limit: int = 160) -> str:
    """An exception's message for a user: one line, printable characters, at most ``limit``."""
    text = " ".join(str(exc).split())
    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return text if len(text) <= limit else text[:limit] + "..."


def _plain(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _kind(t: pa.DataType) -> str:
    """What a column holds, for comparing files: widths and string flavours may differ
    between shards (DuckDB casts them to the first file's type), kinds may not."""
    for kind in ("string", "large_string", "integer", "floating", "boolean", "list", "large_list",
                 "timestamp", "date"):
        if getattr(pa.types, f"is_{kind}")(t):
            return kind.replace("large_", "")
    return str(t)


def _stage_csv(files: list[Path], columns: list[str], sep: str, out: Path) -> list[Path]:
    """CSV files -> Parquet shards of string columns under ``out`` (bounded memory: one
    block at a time). Rows whose every cell is empty are dropped, as the in-memory reader
    does; blank lines are skipped."""
    out.mkdir(parents=True, exist_ok=True)
    staged = []
    for n, f in enumerate(files):
        try:
            header = pacsv.open_csv(f, parse_options=pacsv.ParseOptions(delimiter=sep),
                                    read_options=pacsv.ReadOptions(block_size=1 << 16)).schema.names
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{f}: cannot read as CSV ({_short(exc)}); expected UTF-8 text with a header "
                            "line") from None
        if len(header) < 2:
            raise DataError(f"{f}: expected columns separated by {'tabs' if sep == chr(9) else repr(sep)}, "
                            f"found one column (header {header[0][:200]!r}; wrong separator?)")
        missing = [c for c in columns if c not in header]
        if missing:
            raise DataError(f"{f}: missing column(s) {', '.join(missing)}; columns found: {', '.join(header)}")
        convert = pacsv.ConvertOptions(column_types={c: pa.string() for c in header},
                                       strings_can_be_null=False)
        target = out / f"part-{n:05d}.parquet"
        try:
            reader = pacsv.open_csv(f, parse_options=pacsv.ParseOptions(delimiter=sep),
                                    read_options=pacsv.ReadOptions(block_size=1 << 24),
                                    convert_options=convert)
            with pq.ParquetWriter(target, pa.schema([(c, pa.string()) for c in columns])) as writer:
                for batch in reader:
                    empty = None
                    for c in header:
                        e = pc.equal(batch.column(c), "")
                        empty = e if empty is None else pc.and_(empty, e)
                    table = pa.Table.from_batches([batch]).filter(pc.invert(empty))
                    writer.write_table(table.select(columns))
        except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
            raise DataError(f"{f}: cannot read as CSV ({_short(exc)}); check the separator, "
                            "quoting and encoding (UTF-8)") from None
        staged.append(target)
    return staged


# ---------------------------------------------------------------- SQL for column types
def check_raw_ids(cfg: DataConfig, multi: dict | list, single: list[str], what: str) -> None:
    """``data.raw_ids`` must name single-hot feature columns of the log."""
    for name in cfg.raw_ids:
        if name in multi:
            raise DataError(f"data.raw_ids: {name!r} is a multi-hot column of {what}; raw ids (dynamic "
                            "tables) apply to single-hot columns")
        if name not in single:
            raise DataError(f"data.raw_ids: {name!r} is not a feature column of {what} (its single-hot "
                            f"feature columns: {', '.join(single) or 'none'})")


def raw_id_sql(v: str, integer: bool) -> str:
    """SQL for the int64 ids of raw-id values ``v`` (an SQL expression): an integer column as
    it is (NULL: the id of MISSING); other columns, held in their string form, by `value_id`
    (a canonical decimal int64 is that integer, anything else its `string_id`, whose 63 bits
    of MD5 are the low bits of DuckDB's md5_number)."""
    if integer:
        return f"COALESCE(CAST({v} AS BIGINT), {string_id(MISSING)})"
    return (f"CASE WHEN regexp_full_match({v}, '0|-?[1-9][0-9]*') AND TRY_CAST({v} AS BIGINT) IS NOT NULL "
            f"THEN CAST({v} AS BIGINT) ELSE CAST(md5_number({v}) & {(1 << 63) - 1}::UHUGEINT AS BIGINT) END")


def _categorical_sql(c: str, t: pa.DataType, integral: bool) -> str:
    """A categorical column as the in-memory reader types it: strings, missing/empty ->
    MISSING, integral floats without ".0", booleans "True"/"False"."""
    q = f'"{c}"'
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return f"CASE WHEN {q} IS NULL OR {q} = '' THEN '{MISSING}' ELSE {q} END"
    if pa.types.is_integer(t):
        return f"COALESCE(CAST({q} AS VARCHAR), '{MISSING}')"
    if pa.types.is_floating(t):
        if integral:
            return f"CASE WHEN {q} IS NULL OR isnan({q}) THEN '{MISSING}' ELSE CAST(CAST({q} AS HUGEINT) AS VARCHAR) END"
        return f"CASE WHEN {q} IS NULL OR isnan({q}) THEN '{MISSING}' ELSE CAST({q} AS VARCHAR) END"
    if pa.types.is_boolean(t):
        return f"CASE WHEN {q} IS NULL THEN '{MISSING}' WHEN {q} THEN 'True' ELSE 'False' END"
    raise DataError(f"column {c!r} has type {t}; expected strings, integers or booleans")


def _number_sql(c: str, t: pa.DataType) -> tuple[str, str]:
    """(value as DOUBLE, condition for a bad value) of a numeric column."""
    q = f'"{c}"'
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        v = f"CAST({q} AS DOUBLE)"
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        v = f"TRY_CAST(NULLIF(trim({q}), '') AS DOUBLE)"
    elif pa.types.is_timestamp(t) or pa.types.is_date(t):
        v = f"CAST(epoch({q}) AS DOUBLE)"
    else:
        raise DataError(f"column {c!r} has type {t}; expected numbers")
    return v, f"({v} IS NULL OR isnan({v}))"


def _multi_sql(c: str, t: pa.DataType, sep: str) -> str:
    q = f'"{c}"'
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        s = sep.replace("'", "''")
        return f"COALESCE(list_filter(string_split({q}, '{s}'), lambda x: x <> ''), [])"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"COALESCE(list_transform({q}, lambda x: CAST(x AS VARCHAR)), [])"
    raise DataError(f"multi-hot column {c!r} has type {t}; expected strings or lists")


# ---------------------------------------------------------------- the build
def _table(con, query: str) -> pa.Table:
    """A query's result as an Arrow table (DuckDB 2 names it to_arrow_table, 1.x arrow)."""
    rel = con.sql(query)
    return rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()


def _batches(con, query: str, rows: int):
    """A query's result as Arrow record batches of ``rows`` rows, streamed."""
    rel = con.sql(query)
    if hasattr(rel, "to_arrow_reader"):
        return rel.to_arrow_reader(rows)
    return rel.fetch_arrow_reader(rows)


class _Build:
    def __init__(self, source: Source, schema: LogSchema, cfg, seed: int, work: Path, con) -> None:
        self.source, self.schema, self.cfg, self.seed, self.work, self.con = source, schema, cfg, seed, work, con
        self.stats: dict = {"source": source.what}

    # -- the normalised view: one row per interaction, typed as the readers type it
    def view(self) -> None:
        s = self.schema
        cols = s.columns()
        if self.source.table is not None:
            table = self.source.table.select(cols)
            table = table.append_column("_row", pa.array(np.arange(table.num_rows, dtype=np.int64)))
            self.con.register("src_table", table)
            types = {c: _plain(table.schema.field(c).type) for c in cols}
            src = "src_table"
        else:
            types = _check_parquet(self.source.files, cols)
            offsets = np.concatenate([[0], np.cumsum([pq.ParquetFile(f).metadata.num_rows
                                                      for f in self.source.files])])
            self.con.register("src_files", pa.table({
                "filename": [str(f) for f in self.source.files], "_offset": offsets[:-1].astype(np.int64)}))
            listing = ", ".join("'" + str(f).replace("'", "''") + "'" for f in self.source.files)
            names = ", ".join(f'p."{c}"' for c in cols)
            src = (f"(SELECT {names}, CAST(p.file_row_number + o._offset AS BIGINT) AS _row FROM "
                   f"read_parquet([{listing}], filename=true, file_row_number=true) p "
                   f"JOIN src_files o ON p.filename = o.filename)")
        self.types = types
        exprs, checks = {}, []
        self.int_cols: set[str] = set()
        for key in (s.task_key, s.item_key):
            t = types[key]
            q = f'"{key}"'
            if pa.types.is_string(t) or pa.types.is_large_string(t):
                checks.append((f"{q} IS NULL OR {q} = ''", f"column {key!r} is empty; expected a value", None))
            else:
                checks.append((f"{q} IS NULL", f"column {key!r} is empty; expected a value", None))
        integral = self._integral_floats(src, [c for c in cols if c not in self._typed()])
        for c in cols:
            if c in self._typed():
                continue
            if pa.types.is_integer(types[c]):  # kept as integers: joins and sorts on them are cheaper;
                exprs[c] = f'"{c}"'             # their string form (vocabulary order) is taken where needed
                self.int_cols.add(c)
            else:
                exprs[c] = _categorical_sql(c, types[c], c in integral)
        v, bad = _number_sql(s.label, types[s.label])
        exprs[s.label] = f"CAST({v} AS FLOAT)"
        checks.append((bad, f"column {s.label!r} must be a number", s.label))
        if s.timestamp:
            v, bad = _number_sql(s.timestamp, types[s.timestamp])
            exprs[s.timestamp] = f"CAST(floor({v}) AS BIGINT)"
            checks.append((bad, f"column {s.timestamp!r} must be an integer timestamp (e.g. Unix seconds)",
                           s.timestamp))
        self.raw_multi = {}  # string multi-hot columns: split after the sort (a list payload sorts 2.6x slower)
        for c, sep in s.multi_hot.items():
            if pa.types.is_string(types[c]) or pa.types.is_large_string(types[c]):
                exprs[c] = f'"{c}"'
                self.raw_multi[c] = sep
            else:
                exprs[c] = _multi_sql(c, types[c], sep)
        self._check(src, checks)
        select = ", ".join(f'{e} AS "{c}"' for c, e in exprs.items())
        self.con.execute(f"CREATE TEMP VIEW n AS SELECT {select}, _row FROM {src}")
        self.src = src

    def _typed(self) -> set[str]:
        s = self.schema
        return {s.label, s.timestamp, *s.multi_hot, *s.dense} - {None}

    def _integral_floats(self, src: str, cols: list[str]) -> set[str]:
        floats = [c for c in cols if pa.types.is_floating(self.types[c])]
        if not floats:
            return set()
        aggs = ", ".join(f'bool_and("{c}" = trunc("{c}")) FILTER (WHERE NOT isnan("{c}"))' for c in floats)
        values = self.con.sql(f"SELECT {aggs} FROM {src}").fetchall()[0]
        return {c for c, ok in zip(floats, values) if ok is None or ok}

    def _check(self, src: str, checks: list[tuple[str, str, str | None]]) -> None:
        """One scan for every per-row check; the first failing one (in column order) raises
        naming the file and row of its first bad row, and the value found there."""
        aggs = ", ".join(f"count(*) FILTER (WHERE {cond}), min(_row) FILTER (WHERE {cond})"
                         for cond, _, _ in checks)
        values = self.con.sql(f"SELECT {aggs} FROM {src}").fetchall()[0]
        for i, (_, problem, column) in enumerate(checks):
            count, row = values[2 * i], values[2 * i + 1]
            if count:
                got = ""
                if column is not None:
                    value = self.con.sql(f'SELECT "{column}" FROM {src} WHERE _row = {int(row)}').fetchall()[0][0]
                    got = f", got {_short(repr(value), 60) if value is not None else 'an empty cell'}"
                raise DataError(f"{self.where(int(row))}: {problem}{got} ({count} such row(s) in all)")

    def where(self, row: int) -> str:
        if self.source.files is None:
            return f"{self.source.what}: row {row + 1}"
        for k, f in enumerate(self.source.files):
            n = pq.ParquetFile(f).metadata.num_rows
            if row < n:
                if self.source.origins:
                    return f"{self.source.origins[k]}: row {row + 1} below the header"
                return f"{f}: row {row + 1}"
            row -= n
        return self.source.what

    # -- tasks: group, filter, split users
    def tasks(self) -> None:
        cfg, s = self.cfg, self.schema
        total = self.con.sql("SELECT count(*) FROM n").fetchall()[0][0]
        if total == 0:
            raise DataError(f"{self.source.what}: the log holds no interactions")
        self.stats["interactions_read"] = int(total)
        order_by = "CAST(t AS VARCHAR)" if s.task_key in self.int_cols else "t"  # tasks in string order
        groups = _table(self.con, f'SELECT "{s.task_key}" AS t, count(*) AS c FROM n GROUP BY 1 '
                                  f"ORDER BY {order_by}")
        keys, lengths = groups.column("t"), groups.column("c").to_numpy().astype(np.int64)
        short = lengths < cfg.min_interactions
        if cfg.short_tasks == "error" and short.any():
            examples = ", ".join(map(str, keys.filter(pa.array(short)).slice(0, 5).to_pylist()))
            raise DataError(f"{self.source.what}: {int(short.sum())} task(s) have fewer than "
                            f"{cfg.min_interactions} interactions (data.min_interactions), e.g. "
                            f"{s.task_key} {examples}; set data.short_tasks: skip to drop them")
        keep = ~short & (lengths <= cfg.max_interactions)
        long = (lengths > cfg.max_interactions) if cfg.long_tasks == "train" else np.zeros_like(keep)
        self.stats.update(tasks_read=len(lengths), tasks_too_short=int(short.sum()),
                          tasks_too_long=int((lengths > cfg.max_interactions).sum()),
                          tasks_kept=int(keep.sum()))
        if long.any():
            self.stats["long_tasks_trained"] = int(long.sum())
        if not keep.any():
            raise DataError(f"{self.source.what}: no task has between {cfg.min_interactions} and "
                            f"{cfg.max_interactions} interactions ({len(lengths)} tasks read); "
                            "adjust data.min_interactions / data.max_interactions")
        if cfg.split == "time" and not s.timestamp:
            raise DataError(f"{self.source.what}: data.split 'time' needs a timestamp column, and this "
                            "log has none (data.schema.timestamp); use data.split: random")

        kept = np.flatnonzero(keep)
        split = split_users(kept, cfg.test_fraction, cfg.valid_fraction, self.seed)
        chunked = bool(long.any())
        if chunked:  # data.long_tasks: train -- long tasks join the training split in chunks
            chunks = long_task_chunks(lengths, long, cfg.max_interactions)
            width = int(chunks.max())
            both = np.flatnonzero(keep | long)
            split = np.full(len(both), TRAIN, dtype=np.int8)
            split[np.isin(both, kept)] = split_users(kept, cfg.test_fraction, cfg.valid_fraction, self.seed)
            self.con.register("task_split", pa.table({
                "t": keys.filter(pa.array(keep | long)), "task": pa.array(both.astype(np.int64) * width),
                "split": pa.array(split), "chunks": pa.array(chunks[both].astype(np.int64))}))
        else:
            self.con.register("task_split", pa.table({
                "t": keys.filter(pa.array(keep)), "task": pa.array(kept.astype(np.int64)),
                "split": pa.array(split.astype(np.int8))}))
        new_item = "FALSE"
        if cfg.four_state:
            y = s.release_year
            if y is None:
                raise DataError(f"{self.source.what}: data.four_state needs item release years, and "
                                "this log has no release-year column")
            new_item = (f"(regexp_full_match(CAST(n.\"{y}\" AS VARCHAR), '[0-9]+') AND "
                        f"TRY_CAST(n.\"{y}\" AS HUGEINT) >= {int(cfg.new_item_year)})")
        if chunked:  # a long task's rows go to chunk (row order key mod chunks), as `long_task_chunks`
            key, steps = _order_key_sql(self.seed)
            keyed = f"SELECT *, {', '.join(steps)}, {key} AS _chunk_key FROM n"
            self.con.execute(
                f'CREATE TEMP VIEW j AS SELECT n.* EXCLUDE (z0, z1, z2, z3, z4, _chunk_key), '
                f'ts.task + CAST(n._chunk_key % ts.chunks AS BIGINT) AS task, ts.split, {new_item} AS new_item '
                f'FROM ({keyed}) n JOIN task_split ts ON n."{s.task_key}" = ts.t')
        else:
            self.con.execute(f'CREATE TEMP VIEW j AS SELECT n.*, ts.task, ts.split, {new_item} AS new_item '
                             f'FROM n JOIN task_split ts ON n."{s.task_key}" = ts.t')
        self.masks = {"train": f"split = {TRAIN}", "valid": f"split = {VALID}", "test": f"split = {TEST}"}
        if cfg.four_state:
            m = self.masks
            self.masks = {"train": f"{m['train']} AND NOT new_item", "valid": f"{m['valid']} AND NOT new_item",
                          "test": f"{m['test']} AND NOT new_item",
                          "warm": f"{m['train']} AND NOT new_item", "user_cold": f"{m['test']} AND NOT new_item",
                          "item_cold": f"{m['train']} AND new_item", "user_item_cold": f"{m['test']} AND new_item"}

    # -- the click threshold that applies to this log's labels
    def labels(self) -> None:
        """``cfg.threshold`` as `click_threshold` applies it to the kept rows' labels (a 0/1
        column is clicks), checked to leave both classes (`check_two_classes`)."""
        if self.cfg.label == "regression":
            return
        q = f'"{self.schema.label}"'
        rows, other = self.con.sql(f"SELECT count(*), count(*) FILTER (WHERE {q} NOT IN (0, 1)) "
                                   "FROM j").fetchall()[0]
        threshold = click_threshold(self.cfg.threshold, other == 0)
        clicks = self.con.sql(f"SELECT count(*) FILTER (WHERE {q} >= CAST({threshold!r} AS FLOAT)) "
                              "FROM j").fetchall()[0][0]
        check_two_classes(self.source.what, self.schema.label, threshold, int(clicks), int(rows))
        self.cfg = replace(self.cfg, threshold=threshold)

    # -- vocabularies from training rows only
    def vocabularies(self) -> None:
        s, cfg = self.schema, self.cfg
        user = [c for c in s.user_features if c not in s.multi_hot]
        item = [s.item_key] + [c for c in s.item_features if c not in s.multi_hot]
        self.single = [(c, "user") for c in user] + [(c, "item") for c in item]
        self.multi = [(c, "user" if c in s.user_features else "item") for c in s.multi_hot]
        check_raw_ids(cfg, s.multi_hot, user + item, self.source.what)
        train = self.masks["train"]
        self.fields, self.multi_vocab, self.null_id, self.vocab = [], {}, {}, {}
        coded = [c for c, _ in self.single if c not in cfg.raw_ids]
        if coded:  # one scan for every single-hot field with a vocabulary: GROUPING SETS
            cols = ", ".join(f'"{c}"' for c in coded)
            sets = ", ".join(f'("{c}")' for c in coded)
            counts = _table(self.con, f"SELECT {cols}, GROUPING({cols}) AS g, count(*) AS cnt FROM j "
                                      f"WHERE {train} GROUP BY GROUPING SETS ({sets})")
        for n, (c, side) in enumerate(self.single):
            if c in cfg.raw_ids:  # no vocabulary: the column's own values (`raw_id_sql`)
                distinct = _table(self.con, f"SELECT count(DISTINCT {self.raw_id_sql(c)}) AS n FROM j AS r "
                                            f"WHERE {train}").column("n")[0].as_py()
                self.fields.append(FieldSpec(c, int(distinct), side, raw=True))
                continue
            bit = 1 << (len(coded) - 1 - coded.index(c))  # GROUPING(): 0 bit for the grouped column
            mine = counts.filter(pc.equal(counts.column("g"), (1 << len(coded)) - 1 - bit))
            mine = mine.filter(pc.greater_equal(mine.column("cnt"), int(cfg.min_count)))
            text = mine.column(c)
            if c in self.int_cols:  # the reader's string form: decimal digits, a missing value MISSING
                text = pc.fill_null(pc.cast(text, pa.string()), MISSING)
            order = pc.sort_indices(pa.table({"cnt": mine.column("cnt"), "s": text}),
                                    sort_keys=[("cnt", "descending"), ("s", "ascending")])
            values = mine.column(c).take(order)
            ids = np.arange(1, len(values) + 1, dtype=np.int32)
            missing = np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))
            self.null_id[n] = int(ids[missing[0]]) if len(missing) else 0  # a NULL never joins
            self.con.register(f"v{n}", pa.table({"v": values, "id": pa.array(ids)}))
            self.fields.append(FieldSpec(c, len(values) + 1, side))
            self.vocab[c] = Vocabulary.from_arrow(text.take(order))
        for c, side in self.multi:
            vocab = _table(self.con, (
                f'SELECT v FROM (SELECT unnest({self._bags(c)}) AS v FROM j WHERE {train}) GROUP BY 1 '
                f'HAVING count(*) >= {int(cfg.min_count)} ORDER BY count(*) DESC, v')).column("v")
            self.multi_vocab[c] = vocab.combine_chunks() if vocab.num_chunks else pa.array([], pa.string())
            self.fields.append(FieldSpec(c, len(vocab) + 1, side, multi_hot=True))
            self.vocab[c] = Vocabulary.from_arrow(self.multi_vocab[c])
        self.stats["vocab"] = {f.name: f.num_ids for f in self.fields}

    def raw_id_sql(self, c: str) -> str:
        """SQL for the int64 ids of raw column ``c`` of a row ``r`` of view ``j``."""
        return raw_id_sql(f'r."{c}"', c in self.int_cols)

    def _bags(self, c: str) -> str:
        """SQL for the bags (lists of strings) of multi-hot column ``c`` of view ``j``."""
        return _multi_sql(c, pa.string(), self.raw_multi[c]) if c in self.raw_multi else f'"{c}"'

    # -- one split: tasks long enough, rows ordered, written to the store
    def write_split(self, name: str, out: Path) -> dict:
        cfg, s = self.cfg, self.schema
        mask = self.masks[name]
        lengths = _table(self.con, (f"SELECT task, count(*) AS c FROM j WHERE {mask} GROUP BY 1 "
                                   "ORDER BY 1"))
        tasks = lengths.column("task").to_numpy().astype(np.int64)
        counts = lengths.column("c").to_numpy().astype(np.int64)
        long_enough = counts > cfg.query_size
        dropped = int((~long_enough).sum())
        tasks, counts = tasks[long_enough], counts[long_enough]
        self.con.register(f"keep_{name}", pa.table({"task": tasks}))
        n_rows = int(counts.sum())
        arrays = {"offsets": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                  "support_len": (counts - cfg.query_size).astype(np.int64), "task_keys": tasks}
        files = {k: _write_array(out, f"{name}.{k}", v) for k, v in arrays.items()}
        n_single = len(self.single)
        raw = [c for c, _ in self.single if c in cfg.raw_ids]
        ids = _Writer(out, f"{name}.ids", np.int64 if raw else np.int32, (n_rows, n_single))
        labels = _Writer(out, f"{name}.labels", np.float32, (n_rows,))
        multi = {c: (_Appender(out, f"{name}.multi.{c}.values", np.int32),
                     _Writer(out, f"{name}.multi.{c}.offsets", np.int64, (n_rows + 1,))) for c, _ in self.multi}
        time_order = bool(s.timestamp) and cfg.split == "time"
        names = [c for c, _ in self.single] + [c for c, _ in self.multi]
        picked = "".join(f', "{c}"' for c in names)
        if time_order:
            extra, order = f', "{s.timestamp}" AS k', "r.k, r._row"
        else:
            key, steps = _order_key_sql(self.seed)
            extra, order = "".join(f", {x}" for x in steps) + f", {key} AS k", "r.k, r._row"
        inner = (f'SELECT task, _row, "{s.label}" AS label{picked}{extra} FROM j '
                 f"SEMI JOIN keep_{name} USING (task) WHERE {mask}")
        joins = " ".join(f'LEFT JOIN v{n} ON r."{c}" = v{n}.v' for n, (c, _) in enumerate(self.single)
                         if c not in raw)
        idcols = "".join(f", {self.raw_id_sql(c)} AS f{n}" if c in raw else
                         f", COALESCE(v{n}.id, 0) AS f{n}" if not self.null_id[n] else
                         f', COALESCE(v{n}.id, CASE WHEN r."{c}" IS NULL THEN {self.null_id[n]} ELSE 0 END) AS f{n}'
                         for n, (c, _) in enumerate(self.single))
        mcols = "".join(f', r."{c}"' for c, _ in self.multi)
        query = (f"SELECT r.label{idcols}{mcols} FROM ({inner}) r {joins} ORDER BY r.task, {order}")
        reader = _batches(self.con, query, BATCH_ROWS)
        pos, bag_base = 0, {c: 0 for c, _ in self.multi}
        label_sum = 0.0
        threshold = np.float32(cfg.threshold)
        for batch in reader:
            n = batch.num_rows
            if n_single:
                ids.put(pos, np.stack([batch.column(f"f{k}").to_numpy() for k in range(n_single)], axis=1))
            ratings = batch.column("label").to_numpy().astype(np.float32)
            y = ratings if cfg.label == "regression" else (ratings >= threshold).astype(np.float32)
            labels.put(pos, y)
            label_sum += float(y.sum(dtype=np.float64))
            for c, _ in self.multi:
                values, offsets = multi[c]
                tokens, lens = _split_bags(batch.column(c), self.raw_multi.get(c))
                found = pc.index_in(tokens, value_set=self.multi_vocab[c])
                values.append(pc.fill_null(pc.add(found, 1), 0).to_numpy(zero_copy_only=False))
                start = 1 if pos > 0 else 0
                off = np.concatenate([[0], np.cumsum(lens)]) + bag_base[c]
                offsets.put(pos + start, off[start:])
                bag_base[c] = int(off[-1])
            pos += n
        if pos != n_rows:
            raise DataError(f"{self.source.what}: the task build wrote {pos} rows of split {name}, "
                            f"expected {n_rows} (a file changed during the build?)")
        files["ids"], files["labels"] = ids.close(), labels.close()
        for c, (values, offsets) in multi.items():
            if n_rows == 0:
                offsets.put(0, np.zeros(1, dtype=np.int64))
            files[f"multi.{c}.values"], files[f"multi.{c}.offsets"] = values.close(), offsets.close()
        return {"files": files, "tasks": len(tasks), "dropped": dropped, "rows": n_rows,
                "label_sum": label_sum}


def _split_bags(col, sep: str | None) -> tuple[pa.Array, np.ndarray]:
    """(tokens, bag length per row) of a batch's multi-hot column: a list column as it is, a
    string column split on ``sep`` with empty pieces dropped and a missing cell an empty bag
    (what `_multi_sql` does in SQL and the in-memory reader in pandas)."""
    if sep is None:
        lens = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        return pc.list_flatten(col), lens
    lists = pc.split_pattern(pc.fill_null(col, ""), sep)
    pieces = pc.list_flatten(lists)
    per_row = pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)
    keep = pc.not_equal(pieces, "").to_numpy(zero_copy_only=False)
    row_of_piece = np.repeat(np.arange(len(per_row)), per_row)
    lens = np.bincount(row_of_piece[keep], minlength=len(per_row)).astype(np.int64)
    return pieces.filter(pa.array(keep)), lens


class _Writer:
    """A raw array file of known shape, filled by row ranges with ``pwrite`` (not a memory
    map: written pages then stay in the page cache without counting in this process's
    resident memory)."""

    def __init__(self, folder: Path, name: str, dtype, shape: tuple) -> None:
        self.path, self.dtype, self.shape = folder / f"{name}.bin", np.dtype(dtype), shape
        self.row_bytes = int(np.prod(shape[1:])) * self.dtype.itemsize
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, int(np.prod(shape)) * self.dtype.itemsize)

    def put(self, start: int, values: np.ndarray) -> None:
        if len(values):
            data = np.ascontiguousarray(values, dtype=self.dtype).data
            offset = start * self.row_bytes
            view = memoryview(data).cast("B")
            while len(view):
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n

    def close(self) -> dict:
        os.close(self.fd)
        return {"file": self.path.name, "dtype": self.dtype.str, "shape": list(self.shape),
                HASH: file_digest(self.path)}


class _Appender:
    """A raw 1-D array file of unknown length, appended to."""

    def __init__(self, folder: Path, name: str, dtype) -> None:
        self.path, self.dtype, self.n = folder / f"{name}.bin", np.dtype(dtype), 0
        self.fh = open(self.path, "wb")

    def append(self, values: np.ndarray) -> None:
        self.fh.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.n += len(values)

    def close(self) -> dict:
        self.fh.close()
        return {"file": self.path.name, "dtype": self.dtype.str, "shape": [self.n], HASH: file_digest(self.path)}


def _write_array(folder: Path, name: str, values: np.ndarray) -> dict:
    w = _Writer(folder, name, values.dtype, values.shape)
    w.put(0, values)
    return w.close()


# ---------------------------------------------------------------- store: build, open
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
    import duckdb

    quoted = [c for c in schema.columns() if '"' in c]
    if quoted:
        raise DataError(f"data.schema: column name(s) {', '.join(map(repr, quoted))} contain a double quote; "
                        "rename the column(s) in the log")
    for stale in store.parent.glob(f"{store.name}.tmp-*"):  # a killed build's leftovers (the lock is ours)
        shutil.rmtree(stale, ignore_errors=True)
    work = store.with_name(f"{store.name}.tmp-{os.getpid()}")
    try:
        work.mkdir(parents=True)
        if source.files is not None and source.fmt == "csv":
            source = Source(source.what, _stage_csv(source.files, schema.columns(), cfg.sep, work / "staged"),
                            origins=source.files)
        if source.files is not None:
            _check_parquet(source.files, schema.columns())  # footers first: readable, one schema
        need = estimate_bytes(source.rows(), len(schema.columns()), len(schema.multi_hot))
        free = shutil.disk_usage(store.parent).free
        if need > free:
            raise DataError(f"data.cache_dir {store.parent}: the task build needs about "
                            f"{need / 2**30:.1f} GiB of disk and {free / 2**30:.1f} GiB are free; "
                            "point data.cache_dir at a larger disk")
        try:
            memory = parse_memory(cfg.memory_limit)
        except ValueError as exc:
            raise DataError(str(exc)) from None
        con = duckdb.connect(config={"memory_limit": memory,
                                     "temp_directory": str(work / "spill"), "threads": _threads(),
                                     "preserve_insertion_order": False})
        try:
            started = time.perf_counter()
            b = _Build(source, schema, cfg, seed, work, con)
            phases = b.stats["build_phases_s"] = {}

            def phase(name, fn, *args):
                t0 = time.perf_counter()
                out = fn(*args)
                phases[name] = round(time.perf_counter() - t0, 3)
                return out
            phase("check", b.view)
            phase("tasks", b.tasks)
            phase("labels", b.labels)
            cfg = b.cfg  # the threshold that applies (`click_threshold`)
            phase("vocabularies", b.vocabularies)
            splits = {}
            for name in b.masks:
                part = phase(f"write {name}", b.write_split, name, work)
                splits[name] = part["files"]
                b.stats[f"{name}_tasks"] = part["tasks"]
                if part["dropped"]:
                    b.stats[f"{name}_tasks_without_support"] = part["dropped"]
                if part["tasks"] == 0 and name in ("train", "test"):
                    raise DataError(f"{source.what}: no {name} task keeps more than data.query_size "
                                    f"({cfg.query_size}) interactions after the split")
            rate = con.sql(f"SELECT avg(CASE WHEN \"{schema.label}\" >= CAST({float(cfg.threshold)!r} AS FLOAT) "
                               f"THEN 1.0 ELSE 0.0 END), avg(\"{schema.label}\") FROM j").fetchall()[0]
            if cfg.label == "regression":
                b.stats["mean_label"] = float(rate[1])
            else:
                b.stats["click_rate"] = float(rate[0])
            b.stats["build_s"] = round(time.perf_counter() - started, 3)
        except duckdb.Error as exc:  # e.g. a damaged data page behind an intact footer
            raise DataError(f"{source.what}: the task build failed while reading the log: "
                            f"{str(exc).splitlines()[0]}") from None
        finally:
            con.close()
        shutil.rmtree(work / "spill", ignore_errors=True)
        shutil.rmtree(work / "staged", ignore_errors=True)
        vocab = {c: {"data": _write_array(work, f"vocab.{n}.data", v.data),
                     "offsets": _write_array(work, f"vocab.{n}.offsets", v.offsets)}
                 for n, (c, v) in enumerate(b.vocab.items())}
        manifest = {"format": "gmeta_ds task store", "version": STORE_VERSION, "label": cfg.label,
                    "fields": [asdict(f) for f in b.fields], "stats": b.stats, "splits": splits,
                    "vocab": vocab}
        (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _fsync_tree(work)
        try:
            work.rename(store)
        except OSError:
            if not (store / "manifest.json").is_file():  # not another process's finished store
                raise
        return store
    except OSError as exc:  # ENOSPC, EACCES, ... while writing the store or DuckDB's spill
        raise DataError(f"data.cache_dir: cannot write the task store {store} ({exc.strerror or exc}); "
                        "free some disk or set data.cache_dir to a writable directory with room") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


class StoreArray:
    """A read-only array in a task-store file that reads the rows asked for with ``pread``.

    Collating a micro-batch asks for a few runs of rows (one per task); reading them with
    ``pread`` puts exactly those bytes in this process's memory, while the file's pages stay in
    the kernel's page cache, shared by every rank of the node. (Through a memory map the kernel
    maps whole folios around each touched row: after 640 tasks of a 10M-interaction store a
    rank had 92 of its 122 MB of ids resident.) Row slices and 1-D integer index arrays are
    read directly; anything else (``ids[:, j]``, ``np.asarray``, arithmetic) goes through a
    read-only `numpy.memmap` of the whole file."""

    def __init__(self, path: Path, dtype: np.dtype, shape: tuple) -> None:
        self.path, self.dtype, self.shape = path, np.dtype(dtype), tuple(shape)
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize
        self.row_bytes = int(np.prod(self.shape[1:])) * self.dtype.itemsize
        self._fd: int | None = None
        self._map: np.memmap | None = None

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"StoreArray({self.path.name}, {self.dtype}, {list(self.shape)})"

    def __getstate__(self) -> dict:  # picklable (DataLoader workers, spawn): reopen lazily
        return {**self.__dict__, "_fd": None, "_map": None}

    def _read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, *self.shape[1:]), self.dtype)
        if stop > start:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
            offset = start * self.row_bytes
            n = os.preadv(self._fd, [out], offset)
            if n == out.nbytes:
                return out
            view, offset = memoryview(out).cast("B")[max(n, 0):], offset + max(n, 0)
            while len(view):
                n = os.preadv(self._fd, [view], offset)
                if n <= 0:
                    raise DataError(f"{self.path}: the task store file ended early (truncated after it was opened?)")
                view, offset = view[n:], offset + n
        return out

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(self.shape[0])
            return self._read(start, max(start, stop))
        if isinstance(key, (int, np.integer)):
            k = int(key) + (self.shape[0] if key < 0 else 0)
            if not 0 <= k < self.shape[0]:
                raise IndexError(f"index {key} out of range for {self!r}")
            return self._read(k, k + 1)[0]
        if isinstance(key, np.ndarray) and key.ndim == 1 and key.dtype.kind in "iu" and len(key):
            if key.min() < 0 or key.max() >= self.shape[0]:
                raise IndexError(f"index out of range for {self!r}")
            breaks = np.flatnonzero(np.diff(key) != 1) + 1  # runs of consecutive rows
            starts = np.concatenate([[0], breaks])
            ends = np.concatenate([breaks, [len(key)]])
            lo, hi = int(key.min()), int(key.max()) + 1
            if len(starts) > 8 and hi - lo <= 4 * len(key):  # many short runs close together: one read
                return self._read(lo, hi)[key - lo]
            return np.concatenate([self._read(int(key[a]), int(key[b - 1]) + 1) for a, b in zip(starts, ends)])
        return self.array()[key]

    def array(self) -> np.ndarray:
        """The whole array as a read-only memory map."""
        if self._map is None:
            self._map = np.memmap(self.path, self.dtype, "r", shape=self.shape)
        return self._map

    def __array__(self, dtype=None, copy=None):
        a = self.array()
        return a if dtype is None else a.astype(dtype)

    def astype(self, dtype, **kw) -> np.ndarray:
        return self.array().astype(dtype, **kw)

    def __getattr__(self, name):  # .max(), .sum(), .T, ...: on the memory map
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.array(), name)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)


def open_store(store: Path):
    """The `TaskData` of a finished store, its per-row arrays read on demand (`StoreArray`),
    once `store_check` has verified the manifest and every file (names, dtypes, shapes,
    checksums, values)."""
    manifest, fields = read_manifest(store, STORE_VERSION)
    parts = {}
    for name, entries in manifest["splits"].items():  # per-task arrays in memory, per-row ones read on demand
        a = verify_split(store, name, entries, fields, manifest["label"])
        multi = {f.name: (_rows(a[f"multi.{f.name}.values"]), _rows(a[f"multi.{f.name}.offsets"]))
                 for f in fields if f.multi_hot}
        parts[name] = TaskSet(fields, _rows(a["ids"]), _rows(a["labels"]), a["offsets"], a["support_len"],
                              a["task_keys"], multi)
    states = {k: v for k, v in parts.items() if k in STATES}
    vocab = verify_vocab(store, manifest.get("vocab"), fields)
    return TaskData(fields, parts["train"], parts["test"], {**manifest["stats"], "cache": str(store)},
                    states, parts.get("valid"), vocab)


def _rows(layout: tuple) -> StoreArray | np.ndarray:
    """A verified per-row file (path, dtype, shape), read on demand."""
    path, dtype, shape = layout
    return StoreArray(path, dtype, shape) if int(np.prod(shape)) else np.zeros(shape, dtype)


def store_version(store: Path) -> int | None:
    """The version a store's manifest records (None: no readable manifest)."""
    try:
        return json.loads((store / "manifest.json").read_text()).get("version")
    except (OSError, ValueError, AttributeError):
        return None


def mapped_store_mib() -> float | None:
    """Resident MiB of this process's task-store mappings (``tasks-*/*.bin`` in
    /proc/self/smaps): the data a rank holds, pages shared with every rank of its node
    through the page cache. None where /proc is not available."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and not line.endswith("kB"):  # a mapping's header
            path = head[5] if len(head) == 6 else ""
            inside = path.endswith(".bin") and "/tasks-" in path
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total / 1024


def in_memory_mib(data) -> float | None:
    """MiB of the task arrays of ``data`` (a `TaskData`) held in this process's memory (not
    `StoreArray` files); None without data."""
    if data is None:
        return None
    parts = [getattr(data, "train", None), getattr(data, "valid", None), getattr(data, "test", None),
             *getattr(data, "states", {}).values()]
    total = 0
    for ts in parts:
        if ts is None:
            continue
        arrays = [ts.ids, ts.labels, ts.offsets, ts.support_len, ts.task_keys,
                  *[a for pair in ts.multi.values() for a in pair]]
        total += sum(a.nbytes for a in arrays if isinstance(a, np.ndarray) and not isinstance(a, np.memmap))
    return total / 2**20


def log_source(log: InteractionLog) -> Source:
    table = log.frame.data.table if hasattr(log.frame.data, "table") else log.frame.data
    return Source(log.source, table=table)


def file_source(path, fmt: str) -> Source:
    files, fmt = _files(path, fmt)
    return Source(f"{fmt} table at {path}", files=files, fmt=fmt)
