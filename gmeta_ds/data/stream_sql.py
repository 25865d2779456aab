"""The SQL of a task build (`stream`): the within-task row order key, the reader's column
types as DuckDB expressions, raw ids, and query results as Arrow.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from gmeta_ds.data.readers import DataError
from gmeta_ds.data.vocab import MISSING
from gmeta_ds.sparse import string_id

if TYPE_CHECKING:
    from gmeta_ds.config import DataConfig

# lowbias32 (Chris Wellons' 32-bit integer hash): the within-task order of data.split: random
MIX1, MIX2, M32 = 0x7FEB352D, 0x846CA68B, 0xFFFFFFFF


def order_seed(seed: int) -> int:
    """The 32-bit offset of `row_order_key` for a run seed."""
    return int(np.random.default_rng([seed, 17]).integers(0, 2**32))


def row_order_key(rows: np.ndarray, seed: int) -> np.ndarray:
    """lowbias32((row mod 2^32) xor offset(seed)): the pseudo-random key that orders the rows
    of a task under ``data.split: random``, ties (rows 2^32 apart) broken by row number. A
    function of the row's position in the log only, so any chunking of the log, any reader
    and any number of ranks give the same order; `order_key_sql` is the same function in
    SQL (32-bit steps: DuckDB's 128-bit integer arithmetic is ~500x slower)."""
    x = (rows.astype(np.uint64) & np.uint64(M32)) ^ np.uint64(order_seed(seed))
    m = np.uint64(M32)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(MIX1)) & m
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(MIX2)) & m
    return x ^ (x >> np.uint64(16))


def long_task_chunks(lengths: np.ndarray, long: np.ndarray, max_interactions: int) -> np.ndarray:
    """Chunks per task under ``data.long_tasks: train``: a task with n > max_interactions rows
    (``long``) is cut into ceil(n / max_interactions) training tasks, row r going to chunk
    ``row_order_key(r) mod chunks``; every other task is one chunk."""
    return np.where(long, -(-lengths // max_interactions), 1).astype(np.int64)


def order_key_sql(seed: int) -> tuple[str, list[str]]:
    """(final expression, helper columns) of `row_order_key` over the column ``_row``."""
    m = M32
    return "xor(z4, z4 >> 16)", [
        f"xor(CAST(_row & {m} AS UBIGINT), CAST({order_seed(seed)} AS UBIGINT)) AS z0",
        "xor(z0, z0 >> 16) AS z1", f"((z1 * {MIX1}) & {m}) AS z2",
        "xor(z2, z2 >> 15) AS z3", f"((z3 * {MIX2}) & {m}) AS z4"]


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


def categorical_sql(c: str, t: pa.DataType, integral: bool) -> str:
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


def number_sql(c: str, t: pa.DataType) -> tuple[str, str]:
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


def multi_sql(c: str, t: pa.DataType, sep: str) -> str:
    """SQL for the bag (a list of strings) of multi-hot column ``c``: a string split on ``sep``,
    empty pieces dropped, a missing cell an empty bag; a list column as strings."""
    q = f'"{c}"'
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        s = sep.replace("'", "''")
        return f"COALESCE(list_filter(string_split({q}, '{s}'), lambda x: x <> ''), [])"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"COALESCE(list_transform({q}, lambda x: CAST(x AS VARCHAR)), [])"
    raise DataError(f"multi-hot column {c!r} has type {t}; expected strings or lists")


def sql_table(con, query: str) -> pa.Table:
    """A query's result as an Arrow table (DuckDB 2 names it to_arrow_table, 1.x arrow)."""
    rel = con.sql(query)
    return rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.arrow()


def arrow_batches(con, query: str, rows: int):
    """A query's result as Arrow record batches of ``rows`` rows, streamed."""
    rel = con.sql(query)
    if hasattr(rel, "to_arrow_reader"):
        return rel.to_arrow_reader(rows)
    return rel.fetch_arrow_reader(rows)
