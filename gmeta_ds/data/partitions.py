"""Hive partition folders (``date=2026-11-30/country=fr/part-0.parquet``): the values each
file's folders give its rows (`hive_partitions`), and ``data.filter`` over them
(`partition_filter`), so that excluded partitions are never read.
"""
from __future__ import annotations

import re
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gmeta_ds.data.readers import DataError

_INT, _DATE = re.compile(r"-?[0-9]{1,18}"), re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def hive_partitions(files: list, base: str) -> dict[str, pa.Array]:
    """Each file's Hive partition values (``date=2026-11-30/part-0.parquet`` below ``base``),
    one array per key that every file has, typed as all its values allow: int64, date32
    (``YYYY-MM-DD``), else string; ``__HIVE_DEFAULT_PARTITION__`` is a missing value."""
    per_file = []
    for f in files:
        rel = str(f).removeprefix(base)
        pairs = (part.split("=", 1) for part in rel.strip("/").split("/")[:-1] if "=" in part)
        per_file.append({unquote(k): unquote(v) for k, v in pairs if k})
    keys = [k for k in (per_file[0] if per_file else {}) if all(k in kv for kv in per_file)]
    return {k: _typed([None if kv[k] == "__HIVE_DEFAULT_PARTITION__" else kv[k] for kv in per_file])
            for k in keys}


def _typed(values: list[str | None]) -> pa.Array:
    present = [v for v in values if v is not None]
    if present and all(_INT.fullmatch(v) for v in present):
        return pa.array([None if v is None else int(v) for v in values], pa.int64())
    if present and all(_DATE.fullmatch(v) for v in present):
        return pc.cast(pa.array(values, pa.string()), pa.date32())
    return pa.array(values, pa.string())


def partition_filter(where: str, partitions: dict[str, pa.Array], what: str) -> pa.Array:
    """Which files ``data.filter`` keeps: ``where`` is a SQL condition on the partition
    columns (``date >= '2026-11-01' AND country = 'fr'``), evaluated by DuckDB once per file
    on its folders' values (no file is read, no external access allowed). Returns a boolean
    mask over the files; a filter that keeps none, or names another column, is an error."""
    import duckdb

    if not partitions:
        raise DataError(f"data.filter {where!r}: the log at {what} has no Hive partition folders (key=value) "
                        "to filter on; remove data.filter or lay the log out in key=value folders")
    n = len(next(iter(partitions.values())))
    con = duckdb.connect(config={"enable_external_access": False})
    try:
        con.register("parts", pa.table({**partitions, "_file": pa.array(np.arange(n, dtype=np.int64))}))
        kept = [r[0] for r in con.sql(f"SELECT _file FROM parts WHERE ({where})").fetchall()]
    except duckdb.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"data.filter {where!r}: {first}; expected a SQL condition on the partition "
                        f"column(s) {', '.join(partitions)}") from None
    finally:
        con.close()
    if not kept:
        raise DataError(f"data.filter {where!r} keeps none of the {n} file(s) of {what}")
    mask = np.zeros(n, dtype=bool)
    mask[kept] = True
    return pa.array(mask)
