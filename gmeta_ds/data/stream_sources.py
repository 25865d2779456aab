"""Where a task build's rows come from (`stream`): the files behind ``data.path`` (local, or
the objects behind a URL, `remote`), their Hive ``key=value`` folders as columns, their
Parquet footers checked, CSV staged to Parquet, or an in-memory `InteractionLog`.
"""
from __future__ import annotations

import glob as globlib
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from gmeta_ds.data import delta, remote
from gmeta_ds.data.partitions import hive_partitions, partition_filter
from gmeta_ds.data.readers import DataError, InteractionLog
from gmeta_ds.files import data_file_problem, not_a_file

_PARQUET, _CSV = (".parquet", ".pq"), (".csv", ".tsv", ".txt")


@dataclass
class Source:
    """Where the rows come from: Parquet ``files`` (in this order: row numbers run across
    them), or an Arrow ``table`` in memory. ``what`` names it in messages. Files behind a URL
    are paths in ``filesystem`` (a pyarrow filesystem; None: local files), ``stamps`` their
    identities (`remote.object_stamps`; a Delta table: its id and version); ``partitions``
    holds each file's Hive partition values (`hive_partitions`, or a Delta table's log)."""

    what: str
    files: list | None = None
    table: pa.Table | None = None
    fmt: str = "parquet"
    origins: list | None = None  # CSV: the files that ``files`` were staged from
    filesystem: object = None
    partitions: dict[str, pa.Array] = field(default_factory=dict)
    stamps: list | None = None
    snapshot: dict | None = None  # a Delta table's version read (`delta.Snapshot.info`)
    _rows: list[int] | None = None

    def file_rows(self) -> list[int]:
        """Each file's number of rows (Parquet footers, read once)."""
        if self._rows is None:
            self._rows = [pq.ParquetFile(f, filesystem=self.filesystem).metadata.num_rows for f in self.files]
        return self._rows

    def rows(self) -> int:
        """The number of rows (Parquet footers only)."""
        if self.table is not None:
            return self.table.num_rows
        return sum(self.file_rows())


def source_files(path: str | Path, fmt: str) -> tuple[list[Path], str]:
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
        files = sorted(f for f in p.rglob("*") if f.is_file() and _log_file(f.name))
        if not files:
            raise DataError(f"{p}: the folder holds no .parquet, .pq, .csv, .tsv or .txt file")
    elif not_a_file(p) in (None, "is empty"):
        files = [p]
    else:
        raise DataError(f"{p}: {data_file_problem(not_a_file(p))} (data.path)")
    fmt = _format(files, fmt, text)
    for f in files:
        what = not_a_file(f)
        if what is not None:
            raise DataError(f"{f}: {data_file_problem(what)}")
    return files, fmt


def _log_file(name: str) -> bool:
    """Whether a file in a folder of shards is part of the log (not hidden, not ``_SUCCESS``)."""
    return not name.startswith((".", "_")) and Path(name).suffix.lower() in _PARQUET + _CSV


def _format(files: list, fmt: str, text: str) -> str:
    """``data.format`` of ``files``: ``auto`` resolved from their suffixes, one kind only."""
    kinds = {"parquet" if Path(str(f)).suffix.lower() in _PARQUET else "csv" for f in files}
    if fmt == "auto":
        if len(kinds) > 1:
            raise DataError(f"data.path {text}: mixes Parquet and CSV files; set data.format or "
                            "keep one kind per folder")
        fmt = kinds.pop()
    if fmt not in ("csv", "parquet"):
        raise DataError(f"data.format: {fmt!r} is not one of auto, csv, parquet")
    return fmt


def _base(path: str | Path, files: list[Path]) -> str:
    """The folder a local ``data.path``'s Hive partition folders are read below: the folder
    itself, a glob's folder before its first pattern, a file's own folder."""
    p = Path(str(path)).expanduser()
    if any(ch in str(path) for ch in "*?["):
        parts = p.parts
        return str(Path(*parts[:next(k for k, x in enumerate(parts) if any(ch in x for ch in "*?["))]))
    return str(p) if p.is_dir() else str(p.parent)


def check_parquet(files: list[Path], columns: list[str], filesystem=None,
                  partitions: dict[str, pa.Array] | None = None) -> dict[str, pa.DataType]:
    """Every file's schema (footer only): readable, has ``columns`` (or a Hive partition
    folder does), same types as the first file; returns the types."""
    first: dict[str, pa.DataType] | None = None
    partitions = partitions or {}
    for f in files:
        try:
            schema = pq.read_schema(f, filesystem=filesystem)
        except (OSError, ValueError) as exc:
            raise DataError(f"{f}: cannot read as Parquet ({short_path(exc, 300)}); is the file truncated?") from None
        missing = [c for c in columns if c not in schema.names and c not in partitions]
        if missing:
            found = ", ".join(schema.names + [f"{k} (partition folder)" for k in partitions])
            raise DataError(f"{f}: missing column(s) {', '.join(missing)}; columns found: {found}")
        types = {c: plain_path(schema.field(c).type) if c in schema.names else partitions[c].type
                 for c in columns}
        if first is None:
            first, first_file = types, f
        else:
            for c in columns:
                if source_kind(types[c]) != source_kind(first[c]):
                    raise DataError(f"{f}: column {c!r} is {types[c]}, but {first[c]} in "
                                    f"{first_file}; every file of the log must have one schema")
    return first


def short_path(exc: Exception, limit: int = 160) -> str:
    """An exception's message for a user: one line, printable characters, at most ``limit``."""
    text = " ".join(str(exc).split())
    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return text if len(text) <= limit else text[:limit] + "..."


def plain_path(t: pa.DataType) -> pa.DataType:
    """The value type of a dictionary-encoded column, any other type as it is."""
    return t.value_type if pa.types.is_dictionary(t) else t


def source_kind(t: pa.DataType) -> str:
    """What a column holds, for comparing files: widths and string flavours may differ
    between shards (DuckDB casts them to the first file's type), kinds may not."""
    for kind in ("string", "large_string", "integer", "floating", "boolean", "list", "large_list",
                 "timestamp", "date"):
        if getattr(pa.types, f"is_{kind}")(t):
            return kind.replace("large_", "")
    return str(t)


def stage_csv(files: list[Path], columns: list[str], sep: str, out: Path, filesystem=None) -> list[Path]:
    """CSV files (local, or paths in a pyarrow ``filesystem``) -> Parquet shards of string
    columns under ``out`` (bounded memory: one block at a time). Rows whose every cell is
    empty are dropped, as the in-memory reader does; blank lines are skipped."""
    out.mkdir(parents=True, exist_ok=True)
    staged = []

    def opened(f):
        return filesystem.open_input_stream(f) if filesystem is not None else f

    for n, f in enumerate(files):
        try:
            header = pacsv.open_csv(opened(f), parse_options=pacsv.ParseOptions(delimiter=sep),
                                    read_options=pacsv.ReadOptions(block_size=1 << 16)).schema.names
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"{f}: cannot read as CSV ({short_path(exc)}); expected UTF-8 text with a header "
                            "line") from None
        if len(header) < 2:
            raise DataError(f"{f}: expected columns separated by {'tabs' if sep == chr(9) else repr(sep)}, "
                            f"found one column (header {header[0][:200]!r}; wrong separator?)")
        missing = [c for c in columns if c not in header]
        if missing:
            raise DataError(f"{f}: missing column(s) {', '.join(missing)}; columns found: {', '.join(header)}")
        twice = sorted({c for c in header if header.count(c) > 1})
        if twice:
            raise DataError(f"{f}: the header names column(s) {', '.join(map(repr, twice))} more than once; "
                            "expected each column name once (which one would the log mean?)")
        convert = pacsv.ConvertOptions(column_types={c: pa.string() for c in header},
                                       strings_can_be_null=False)
        target = out / f"part-{n:05d}.parquet"
        try:
            reader = pacsv.open_csv(opened(f), parse_options=pacsv.ParseOptions(delimiter=sep),
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
            raise DataError(f"{f}: cannot read as CSV ({short_path(exc)}); check the separator, "
                            "quoting and encoding (UTF-8)") from None
        staged.append(target)
    return staged



def log_source(log: InteractionLog) -> Source:
    """An in-memory `InteractionLog` (the MovieLens and RecBole readers) as a `Source`."""
    table = log.frame.data.table if hasattr(log.frame.data, "table") else log.frame.data
    return Source(log.source, table=table)


def file_source(path, fmt: str, options: dict | None = None, stamps: bool = False, where: str = "",
                version: int | None = None, timestamp: str | None = None) -> Source:
    """The files behind ``data.path`` as a `Source`: local files (`source_files`; a ``file://``
    URL is a local path), the objects behind a store's URL (`remote.list_objects`, with
    ``data.storage_options``; their identities too when ``stamps``), with their Hive
    partition values, or a Delta table's files at ``version`` / ``timestamp``
    (`delta.snapshot`: ``data.format: delta``, or a folder holding ``_delta_log/``); under
    ``data.filter`` (``where``) only the files whose partition values pass it
    (`partition_filter`), the others never read."""
    options = dict(options or {})
    scheme = remote.url_scheme(path)
    if fmt == "delta" or (fmt == "auto" and delta.holds_table(path, options)):
        snap = delta.snapshot(path, options, version, timestamp)
        files, parts = _filtered(snap.files, snap.partitions, where, remote.shown(path))
        return Source(f"delta table at {remote.shown(path)}", files=files, filesystem=snap.filesystem,
                      partitions=parts, stamps=[["delta", snap.info["table_id"], snap.info["version"]]],
                      snapshot=snap.info)
    if version is not None or timestamp is not None:
        key = "version_as_of" if version is not None else "timestamp_as_of"
        raise DataError(f"data.{key}: set, but data.path {remote.shown(str(path))} is not a Delta table (no "
                        f"{delta.DELTA_LOG}/ folder there); only a Delta table has versions")
    if scheme == "file":
        path = remote.local_path(path)
    elif scheme is not None:
        fs, base, infos = remote.list_objects(path, options)
        infos = [i for i in infos if _log_file(i.base_name)]
        if not infos:
            raise DataError(f"data.path {remote.shown(path)}: no .parquet, .pq, .csv, .tsv or .txt object there")
        infos, parts = _filtered(infos, hive_partitions([i.path for i in infos], base), where, remote.shown(path))
        files = [i.path for i in infos]
        fmt = _format(files, fmt, remote.shown(path))
        return Source(f"{fmt} table at {remote.shown(path)}", files=files, fmt=fmt, filesystem=fs, partitions=parts,
                      stamps=remote.object_stamps(path, fs, base, infos, options) if stamps else None)
    files, fmt = source_files(path, fmt)
    files, parts = _filtered(files, hive_partitions(files, _base(path, files)), where, str(path))
    return Source(f"{fmt} table at {path}", files=files, fmt=fmt, partitions=parts)


def _filtered(files: list, parts: dict[str, pa.Array], where: str, what: str) -> tuple[list, dict[str, pa.Array]]:
    """``files`` and their partition values, only those ``data.filter`` (``where``) keeps
    (`partition_filter`); all of them without a filter."""
    if not where:
        return files, parts
    keep = partition_filter(where, parts, what)
    return [f for f, k in zip(files, keep) if k], {c: v.filter(keep) for c, v in parts.items()}
