"""Where a task build's rows come from (`stream`): the files behind ``data.path``, their
Parquet footers checked, CSV staged to Parquet, or an in-memory `InteractionLog`.
"""
from __future__ import annotations

import glob as globlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from gmeta_ds.data.readers import DataError, InteractionLog
from gmeta_ds.files import data_file_problem, not_a_file

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
        """The number of rows (Parquet footers only)."""
        if self.table is not None:
            return self.table.num_rows
        return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)


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
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith((".", "_"))
                       and f.suffix.lower() in (".parquet", ".pq", ".csv", ".tsv", ".txt"))
        if not files:
            raise DataError(f"{p}: the folder holds no .parquet, .pq, .csv, .tsv or .txt file")
    elif not_a_file(p) in (None, "is empty"):
        files = [p]
    else:
        raise DataError(f"{p}: {data_file_problem(not_a_file(p))} (data.path)")
    kinds = {"parquet" if f.suffix.lower() in (".parquet", ".pq") else "csv" for f in files}
    if fmt == "auto":
        if len(kinds) > 1:
            raise DataError(f"data.path {text}: mixes Parquet and CSV files; set data.format or "
                            "keep one kind per folder")
        fmt = kinds.pop()
    if fmt not in ("csv", "parquet"):
        raise DataError(f"data.format: {fmt!r} is not one of auto, csv, parquet")
    for f in files:
        what = not_a_file(f)
        if what is not None:
            raise DataError(f"{f}: {data_file_problem(what)}")
    return files, fmt


def check_parquet(files: list[Path], columns: list[str]) -> dict[str, pa.DataType]:
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
        types = {c: plain_path(schema.field(c).type) for c in columns}
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


def stage_csv(files: list[Path], columns: list[str], sep: str, out: Path) -> list[Path]:
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
            raise DataError(f"{f}: cannot read as CSV ({short_path(exc)}); check the separator, "
                            "quoting and encoding (UTF-8)") from None
        staged.append(target)
    return staged



def log_source(log: InteractionLog) -> Source:
    """An in-memory `InteractionLog` (the MovieLens and RecBole readers) as a `Source`."""
    table = log.frame.data.table if hasattr(log.frame.data, "table") else log.frame.data
    return Source(log.source, table=table)


def file_source(path, fmt: str) -> Source:
    """The files behind ``data.path`` (`source_files`) as a `Source`."""
    files, fmt = source_files(path, fmt)
    return Source(f"{fmt} table at {path}", files=files, fmt=fmt)
