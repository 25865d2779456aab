"""The steps of a task build (`stream`) as DuckDB queries: the normalised view, tasks
(group, filter, split users), the click threshold, vocabularies, and each split written.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gmeta_ds.data.readers import DataError, LogSchema, check_two_classes, click_threshold
from gmeta_ds.data.remote import PROTOCOL, duckdb_filesystem
from gmeta_ds.data.user_split import TEST, TRAIN, VALID, split_users
from gmeta_ds.data.store_files import Appender, write_array, ArrayWriter
from gmeta_ds.data.stream_sources import Source, check_parquet, plain_path, short_path
from gmeta_ds.data.stream_sql import (arrow_batches, categorical_sql, multi_sql, number_sql, order_key_sql, sql_table,
                                      check_raw_ids, long_task_chunks, raw_id_sql)
from gmeta_ds.data.vocab import MISSING, Vocabulary
from gmeta_ds.sparse import FieldSpec

BATCH_ROWS = 1 << 19


class StoreBuild:
    def __init__(self, source: Source, schema: LogSchema, cfg, seed: int, work: Path, con) -> None:
        self.source, self.schema, self.cfg, self.seed, self.work, self.con = source, schema, cfg, seed, work, con
        self.stats: dict = {"source": source.what}
        if source.snapshot is not None:  # a Delta table's version read (summary.json's data_snapshot)
            self.stats["snapshot"] = source.snapshot

    # -- the normalised view: one row per interaction, typed as the readers type it
    def view(self) -> None:
        """View ``n``: one row per interaction with its row number ``_row``, every column typed
        as the in-memory readers type it, after one scan checking keys, labels and timestamps."""
        s = self.schema
        cols = s.columns()
        src, types = self._source_sql(cols)
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
                exprs[c] = categorical_sql(c, types[c], c in integral)
        v, bad = number_sql(s.label, types[s.label])
        exprs[s.label] = f"CAST({v} AS FLOAT)"
        checks.append((bad, f"column {s.label!r} must be a number", s.label))
        # inf or 1e300 would reach the loss, or the store check that blames the store
        checks.append((f"(NOT isfinite({v}) OR abs({v}) > 3.4e38)",
                       f"column {s.label!r} must be a finite number within float32 (a label)", s.label))
        if s.timestamp:
            v, bad = number_sql(s.timestamp, types[s.timestamp])
            exprs[s.timestamp] = f"CAST(floor({v}) AS BIGINT)"
            checks.append((bad, f"column {s.timestamp!r} must be an integer timestamp (e.g. Unix seconds)",
                           s.timestamp))
        self.raw_multi = {}  # string multi-hot columns: split after the sort (a list payload sorts 2.6x slower)
        for c, sep in s.multi_hot.items():
            if pa.types.is_string(types[c]) or pa.types.is_large_string(types[c]):
                exprs[c] = f'"{c}"'
                self.raw_multi[c] = sep
            else:
                exprs[c] = multi_sql(c, types[c], sep)
        self._check(src, checks)
        select = ", ".join(f'{e} AS "{c}"' for c, e in exprs.items())
        self.con.execute(f"CREATE TEMP VIEW n AS SELECT {select}, _row FROM {src}")
        self.src = src

    def _source_sql(self, cols: list[str]) -> tuple[str, dict[str, pa.DataType]]:
        """(SQL relation of the source's ``cols`` with each row's number ``_row``, the
        columns' Arrow types): the in-memory table registered, or the Parquet files read
        with their row numbers running across the files."""
        if self.source.table is not None:
            table = self.source.table.select(cols)
            table = table.append_column("_row", pa.array(np.arange(table.num_rows, dtype=np.int64)))
            self.con.register("src_table", table)
            types = {c: plain_path(table.schema.field(c).type) for c in cols}
            src = "src_table"
        else:
            src, types = self._files_sql(cols)
        return src, types

    def _files_sql(self, cols: list[str]) -> tuple[str, dict[str, pa.DataType]]:
        """`_source_sql` for Parquet files: local, or read through the URL's filesystem
        (`remote.duckdb_filesystem`); a column no file holds comes from the files' Hive
        partition folders (joined per file, as its row-number offset is)."""
        source = self.source
        types = check_parquet(source.files, cols, source.filesystem, source.partitions)
        in_files = set(pq.read_schema(source.files[0], filesystem=source.filesystem).names)
        from_folders = [c for c in cols if c not in in_files]
        names = [f"{PROTOCOL}://{f}" if source.filesystem is not None else str(f) for f in source.files]
        if source.filesystem is not None:
            self.con.register_filesystem(duckdb_filesystem(source.filesystem))
        offsets = np.concatenate([[0], np.cumsum(source.file_rows())])
        self.con.register("src_files", pa.table({
            "filename": names, "_offset": offsets[:-1].astype(np.int64),
            **{c: source.partitions[c] for c in from_folders}}))
        listing = ", ".join("'" + f.replace("'", "''") + "'" for f in names)
        picked = ", ".join(f'o."{c}"' if c in from_folders else f'p."{c}"' for c in cols)
        src = (f"(SELECT {picked}, CAST(p.file_row_number + o._offset AS BIGINT) AS _row FROM "
               f"read_parquet([{listing}], filename=true, file_row_number=true, hive_partitioning=false) p "
               f"JOIN src_files o ON p.filename = o.filename)")
        return src, types

    def _typed(self) -> set[str]:
        """The columns with a type of their own (label, timestamp, multi-hot, dense): not categorical."""
        s = self.schema
        return {s.label, s.timestamp, *s.multi_hot, *s.dense} - {None}

    def _integral_floats(self, src: str, cols: list[str]) -> set[str]:
        """The float columns among ``cols`` whose values are all whole numbers (written without ".0")."""
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
                    got = f", got {short_path(repr(value), 60) if value is not None else 'an empty cell'}"
                raise DataError(f"{self.where(int(row))}: {problem}{got} ({count} such row(s) in all)")

    def where(self, row: int) -> str:
        """Where row ``row`` of the log is, for messages: its file (the CSV it was staged from)
        and row there."""
        if self.source.files is None:
            return f"{self.source.what}: row {row + 1}"
        for k, (f, n) in enumerate(zip(self.source.files, self.source.file_rows())):
            if row < n:
                if self.source.origins:
                    return f"{self.source.origins[k]}: row {row + 1} below the header"
                return f"{f}: row {row + 1}"
            row -= n
        return self.source.what

    # -- tasks: group, filter, split users
    def tasks(self) -> None:
        """Group the rows into tasks, keep those of an allowed length, split their users into
        train / valid / test (`split_users`) and join each row to its task and split: view ``j``."""
        keys, lengths = self._task_lengths()
        keep, long = self._kept_tasks(keys, lengths)
        chunked = self._register_split(keys, lengths, keep, long)
        self._join_tasks(chunked, self._new_item_sql())
        self.masks = self._split_masks()

    def _task_lengths(self) -> tuple[pa.ChunkedArray, np.ndarray]:
        """(task keys, rows per task), tasks in the string order of their keys."""
        s = self.schema
        total = self.con.sql("SELECT count(*) FROM n").fetchall()[0][0]
        if total == 0:
            raise DataError(f"{self.source.what}: the log holds no interactions")
        self.stats["interactions_read"] = int(total)
        order_by = "CAST(t AS VARCHAR)" if s.task_key in self.int_cols else "t"  # tasks in string order
        groups = sql_table(self.con, f'SELECT "{s.task_key}" AS t, count(*) AS c FROM n GROUP BY 1 '
                                  f"ORDER BY {order_by}")
        return groups.column("t"), groups.column("c").to_numpy().astype(np.int64)

    def _kept_tasks(self, keys: pa.ChunkedArray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(kept, long) masks over the tasks: kept between data.min_interactions and
        data.max_interactions, long ones trained in chunks under ``data.long_tasks: train``."""
        cfg, s = self.cfg, self.schema
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
        return keep, long

    def _register_split(self, keys: pa.ChunkedArray, lengths: np.ndarray, keep: np.ndarray,
                        long: np.ndarray) -> bool:
        """Register table ``task_split`` (task key -> task number, split, and under
        ``data.long_tasks: train`` the chunks of each task); returns whether tasks are chunked."""
        cfg = self.cfg
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
        return chunked

    def _new_item_sql(self) -> str:
        """SQL for whether a row's item is new (released in or after data.new_item_year) under
        ``data.four_state``; FALSE otherwise."""
        cfg, s = self.cfg, self.schema
        if not cfg.four_state:
            return "FALSE"
        y = s.release_year
        if y is None:
            raise DataError(f"{self.source.what}: data.four_state needs item release years, and "
                            "this log has no release-year column")
        return (f"(regexp_full_match(CAST(n.\"{y}\" AS VARCHAR), '[0-9]+') AND "
                f"TRY_CAST(n.\"{y}\" AS HUGEINT) >= {int(cfg.new_item_year)})")

    def _join_tasks(self, chunked: bool, new_item: str) -> None:
        """View ``j``: view ``n`` joined to ``task_split``, with each row's task, split and
        new-item flag."""
        s = self.schema
        if chunked:  # a long task's rows go to chunk (row order key mod chunks), as `long_task_chunks`
            key, steps = order_key_sql(self.seed)
            keyed = f"SELECT *, {', '.join(steps)}, {key} AS _chunk_key FROM n"
            self.con.execute(
                f'CREATE TEMP VIEW j AS SELECT n.* EXCLUDE (z0, z1, z2, z3, z4, _chunk_key), '
                f'ts.task + CAST(n._chunk_key % ts.chunks AS BIGINT) AS task, ts.split, {new_item} AS new_item '
                f'FROM ({keyed}) n JOIN task_split ts ON n."{s.task_key}" = ts.t')
        else:
            self.con.execute(f'CREATE TEMP VIEW j AS SELECT n.*, ts.task, ts.split, {new_item} AS new_item '
                             f'FROM n JOIN task_split ts ON n."{s.task_key}" = ts.t')

    def _split_masks(self) -> dict[str, str]:
        """SQL conditions on view ``j`` selecting each split's rows (and under
        ``data.four_state`` the four cold-start states)."""
        masks = {"train": f"split = {TRAIN}", "valid": f"split = {VALID}", "test": f"split = {TEST}"}
        if self.cfg.four_state:
            m = masks
            masks = {"train": f"{m['train']} AND NOT new_item", "valid": f"{m['valid']} AND NOT new_item",
                     "test": f"{m['test']} AND NOT new_item",
                     "warm": f"{m['train']} AND NOT new_item", "user_cold": f"{m['test']} AND NOT new_item",
                     "item_cold": f"{m['train']} AND new_item", "user_item_cold": f"{m['test']} AND new_item"}
        return masks

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
        """The fields and their vocabularies, from the training rows only: single-hot values by
        count (ties by string form) at least data.min_count, raw-id columns none, bags by token."""
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
            counts = sql_table(self.con, f"SELECT {cols}, GROUPING({cols}) AS g, count(*) AS cnt FROM j "
                                      f"WHERE {train} GROUP BY GROUPING SETS ({sets})")
        for n, (c, side) in enumerate(self.single):
            if c in cfg.raw_ids:  # no vocabulary: the column's own values (`raw_id_sql`)
                distinct = sql_table(self.con, f"SELECT count(DISTINCT {self.raw_id_sql(c)}) AS n FROM j AS r "
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
            vocab = sql_table(self.con, (
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
        return multi_sql(c, pa.string(), self.raw_multi[c]) if c in self.raw_multi else f'"{c}"'

    # -- one split: tasks long enough, rows ordered, written to the store
    def write_split(self, name: str, out: Path) -> dict:
        """Write split ``name`` into folder ``out``: its tasks with more than data.query_size
        rows, each task's rows in order (time or `row_order_key`), their ids, labels and bags.
        Returns the split's files (manifest entries) and counts."""
        tasks, counts, dropped = self._split_tasks(name)
        n_rows = int(counts.sum())
        arrays = {"offsets": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                  "support_len": (counts - self.cfg.query_size).astype(np.int64), "task_keys": tasks}
        files = {k: write_array(out, f"{name}.{k}", v) for k, v in arrays.items()}
        raw = [c for c, _ in self.single if c in self.cfg.raw_ids]
        ids = ArrayWriter(out, f"{name}.ids", np.int64 if raw else np.int32, (n_rows, len(self.single)))
        labels = ArrayWriter(out, f"{name}.labels", np.float32, (n_rows,))
        multi = {c: (Appender(out, f"{name}.multi.{c}.values", np.int32),
                     ArrayWriter(out, f"{name}.multi.{c}.offsets", np.int64, (n_rows + 1,))) for c, _ in self.multi}
        reader = arrow_batches(self.con, self._rows_query(name, raw), BATCH_ROWS)
        pos, label_sum = self._write_rows(reader, ids, labels, multi)
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

    def _split_tasks(self, name: str) -> tuple[np.ndarray, np.ndarray, int]:
        """(task numbers, rows per task, tasks dropped) of split ``name``: its tasks with more
        than data.query_size rows, in order, registered as table ``keep_<name>``."""
        lengths = sql_table(self.con, (f"SELECT task, count(*) AS c FROM j WHERE {self.masks[name]} GROUP BY 1 "
                                   "ORDER BY 1"))
        tasks = lengths.column("task").to_numpy().astype(np.int64)
        counts = lengths.column("c").to_numpy().astype(np.int64)
        long_enough = counts > self.cfg.query_size
        dropped = int((~long_enough).sum())
        tasks, counts = tasks[long_enough], counts[long_enough]
        self.con.register(f"keep_{name}", pa.table({"task": tasks}))
        return tasks, counts, dropped

    def _rows_query(self, name: str, raw: list[str]) -> str:
        """SQL for the rows of split ``name`` in store order (task, then time or row order
        key, then row): the label, each single-hot field's id (``f<n>``), each bag column."""
        cfg, s = self.cfg, self.schema
        names = [c for c, _ in self.single] + [c for c, _ in self.multi]
        picked = "".join(f', "{c}"' for c in names)
        if bool(s.timestamp) and cfg.split == "time":
            extra, order = f', "{s.timestamp}" AS k', "r.k, r._row"
        else:
            key, steps = order_key_sql(self.seed)
            extra, order = "".join(f", {x}" for x in steps) + f", {key} AS k", "r.k, r._row"
        inner = (f'SELECT task, _row, "{s.label}" AS label{picked}{extra} FROM j '
                 f"SEMI JOIN keep_{name} USING (task) WHERE {self.masks[name]}")
        joins = " ".join(f'LEFT JOIN v{n} ON r."{c}" = v{n}.v' for n, (c, _) in enumerate(self.single)
                         if c not in raw)
        idcols = "".join(f", {self.raw_id_sql(c)} AS f{n}" if c in raw else
                         f", COALESCE(v{n}.id, 0) AS f{n}" if not self.null_id[n] else
                         f', COALESCE(v{n}.id, CASE WHEN r."{c}" IS NULL THEN {self.null_id[n]} ELSE 0 END) AS f{n}'
                         for n, (c, _) in enumerate(self.single))
        mcols = "".join(f', r."{c}"' for c, _ in self.multi)
        return f"SELECT r.label{idcols}{mcols} FROM ({inner}) r {joins} ORDER BY r.task, {order}"

    def _write_rows(self, reader, ids: ArrayWriter, labels: ArrayWriter, multi: dict) -> tuple[int, float]:
        """Write the batches of ``reader`` (`_rows_query`) into the split's files: ids, labels
        (clicks at the threshold, or the ratings under regression), bag tokens and offsets.
        Returns (rows written, sum of labels)."""
        n_single = len(self.single)
        pos, bag_base = 0, {c: 0 for c, _ in self.multi}
        label_sum = 0.0
        threshold = np.float32(self.cfg.threshold)
        for batch in reader:
            if n_single:
                ids.put(pos, np.stack([batch.column(f"f{k}").to_numpy() for k in range(n_single)], axis=1))
            ratings = batch.column("label").to_numpy().astype(np.float32)
            y = ratings if self.cfg.label == "regression" else (ratings >= threshold).astype(np.float32)
            labels.put(pos, y)
            label_sum += float(y.sum(dtype=np.float64))
            for c, _ in self.multi:
                values, offsets = multi[c]
                tokens, lens = split_bags(batch.column(c), self.raw_multi.get(c))
                found = pc.index_in(tokens, value_set=self.multi_vocab[c])
                values.append(pc.fill_null(pc.add(found, 1), 0).to_numpy(zero_copy_only=False))
                start = 1 if pos > 0 else 0
                off = np.concatenate([[0], np.cumsum(lens)]) + bag_base[c]
                offsets.put(pos + start, off[start:])
                bag_base[c] = int(off[-1])
            pos += batch.num_rows
        return pos, label_sum


def split_bags(col, sep: str | None) -> tuple[pa.Array, np.ndarray]:
    """(tokens, bag length per row) of a batch's multi-hot column: a list column as it is, a
    string column split on ``sep`` with empty pieces dropped and a missing cell an empty bag
    (what `multi_sql` does in SQL and the in-memory reader in pandas)."""
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
