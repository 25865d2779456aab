"""Meta-IO at scale: an out-of-core task build (DuckDB) into a memory-mapped task store.

The steps are those of `builder` (group by task key, filter by length, split users, build
vocabularies on training users only, order each task and cut support / query), with the
same results bit for bit (``tests/unit/data/test_stream.py`` checks it against the in-memory
path), but no step holds the log in memory:

* the log is read by DuckDB straight from Parquet (one file, a folder of shards, a glob, as
  Spark and Hive write them, local or behind an ``s3://``, ``gs://``, ``abfs://`` or
  ``hdfs://`` URL; only the needed columns), or from CSV staged to Parquet in
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

The code lives in: `stream_sources` (the log's files, CSV staging), `remote` (a URL's
objects through pyarrow's filesystems, handed to DuckDB), `partitions` (Hive ``key=value``
folders, ``data.filter``), `delta` (a Delta Lake table's snapshot: its files and partition
values), `stream_sql` (the row
order key, column types as SQL), `stream_build` (the build's steps), `store_files` (the raw
array files), `store_write` (`build_store`) and `store_read` (`open_store`, `StoreArray`);
this module keeps their names importable from one place.
"""
from gmeta_ds.data.store_files import STORE_VERSION, Appender, fsync_tree, write_array, ArrayWriter  # noqa: F401
from gmeta_ds.data.store_lock import LOCK_WAIT_S, build_lock  # noqa: F401  (build_lock: API of this module)
from gmeta_ds.data.store_read import (STATES, StoreArray, task_rows, in_memory_mib, mapped_store_mib,  # noqa: F401
                                      open_store, store_version)
from gmeta_ds.data.store_write import build_threads, build_store, estimate_bytes  # noqa: F401
from gmeta_ds.data.stream_build import BATCH_ROWS, StoreBuild, split_bags  # noqa: F401
from gmeta_ds.data.stream_sources import (Source, check_parquet, source_files, source_kind, plain_path, short_path,  # noqa: F401
                                          stage_csv, file_source, log_source)
from gmeta_ds.data.stream_sql import (M32, MIX1, MIX2, arrow_batches, categorical_sql, multi_sql,  # noqa: F401
                                      number_sql, order_key_sql, sql_table, check_raw_ids, long_task_chunks,
                                      order_seed, raw_id_sql, row_order_key)
