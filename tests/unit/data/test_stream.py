"""The out-of-core task build (DuckDB -> memory-mapped store) gives exactly the in-memory
builder's tasks, vocabularies, splits and statistics; the store is atomic and verified."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import write_ml100k

from gmeta_ds.config import DataConfig, SchemaConfig
from gmeta_ds.data.builder import build_tasks, read_log, store_path, tasks_from_log
from gmeta_ds.data.readers import DataError, LogSchema, log_from_frame
from gmeta_ds.data.stream import StoreArray, open_store, row_order_key

SCHEMA = dict(task_key="user", item_key="item", label="rating", timestamp="ts",
              user_features=["age"], item_features=["cat"], multi_hot={"tags": "|"})


def frame(n_users: int = 60, seed: int = 0) -> pd.DataFrame:
    """A log with every awkward case: string and integer keys, missing and empty values, rare
    values, ties in time, empty bags, unicode."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(5, 40, n_users)
    user = np.repeat(np.arange(n_users), lens)
    n = len(user)
    item = rng.zipf(1.3, n) % 300
    return pd.DataFrame({
        "user": [f"u{u}" if u % 3 else f"ü{u}" for u in user],
        "item": item.astype(np.int64),
        "rating": rng.integers(1, 6, n).astype(np.float32),
        "ts": rng.integers(0, 50, n),  # many ties within a user
        "age": np.where(rng.random(n) < 0.05, "", rng.choice(["a", "b", "c", "zz"], n)),
        "cat": rng.choice(["x", "y", "w", "v"], n),
        "tags": np.where(rng.random(n) < 0.1, "", ["|".join(rng.choice(list("pqrst"), rng.integers(1, 4)))
                                                    for _ in range(n)]),
    })


def assert_same(a, b, skip=("cache", "build_s", "build_phases_s")) -> None:
    assert a.fields == b.fields
    for name in ("train", "valid", "test", *a.states):
        x = getattr(a, name, None) if name in ("train", "valid", "test") else a.states[name]
        y = getattr(b, name, None) if name in ("train", "valid", "test") else b.states[name]
        for attr in ("ids", "labels", "offsets", "support_len", "task_keys"):
            np.testing.assert_array_equal(np.asarray(getattr(x, attr)), np.asarray(getattr(y, attr)),
                                          err_msg=f"{name}.{attr}")
        for f, (v, o) in x.multi.items():
            np.testing.assert_array_equal(v, y.multi[f][0], err_msg=f"{name}.{f}.values")
            np.testing.assert_array_equal(o, y.multi[f][1], err_msg=f"{name}.{f}.offsets")
    assert set(a.states) == set(b.states)
    for k, v in a.stats.items():
        if k in skip:
            continue
        if isinstance(v, float):
            assert b.stats[k] == pytest.approx(v, rel=1e-6), k
        else:
            assert b.stats[k] == v, k


def table_cfg(path, tmp_path, **kw) -> DataConfig:
    base = dict(source="table", path=str(path), cache_dir=str(tmp_path / "cache"), schema=SchemaConfig(**SCHEMA),
                min_interactions=8, max_interactions=35, query_size=4, test_fraction=0.25)
    return DataConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [
    {}, {"split": "time"}, {"min_count": 3, "valid_fraction": 0.2}, {"label": "regression"},
    {"short_tasks": "skip", "min_interactions": 13, "threshold": 3.5},
])
def test_parquet_store_equals_in_memory_builder(tmp_path, kw):
    path = tmp_path / "log.parquet"
    frame().to_parquet(path)
    cfg = table_cfg(path, tmp_path, **kw)
    reference = tasks_from_log(read_log(cfg), cfg, seed=3)
    assert_same(reference, build_tasks(cfg, seed=3))
    again = build_tasks(cfg, seed=3)  # from the store
    assert "cache" in again.stats and isinstance(again.train.ids, StoreArray)
    assert_same(reference, again)


def test_csv_and_sharded_parquet_equal_one_file(tmp_path):
    df = frame(seed=1)
    df.to_csv(tmp_path / "log.csv", index=False)
    cfg = table_cfg(tmp_path / "log.csv", tmp_path)
    reference = tasks_from_log(read_log(cfg), cfg, seed=0)
    assert_same(reference, build_tasks(cfg, seed=0))
    shards = tmp_path / "shards"
    shards.mkdir()
    for k, part in enumerate(np.array_split(np.arange(len(df)), 3)):  # row numbers run across files
        pq.write_table(pa.Table.from_pandas(df.iloc[part], preserve_index=False), shards / f"part-{k:05d}.parquet")
    (shards / "_SUCCESS").write_text("")
    one = tmp_path / "one.parquet"
    df.to_parquet(one)
    single = build_tasks(table_cfg(one, tmp_path), seed=0)
    skip = ("cache", "build_s", "build_phases_s", "source")  # names the path
    assert_same(single, build_tasks(table_cfg(shards, tmp_path), seed=0), skip)
    assert_same(single, build_tasks(table_cfg(str(shards / "part-*.parquet"), tmp_path), seed=0), skip)


def test_reader_logs_and_four_states_equal_in_memory_builder(tmp_path):
    write_ml100k(tmp_path / "ml")
    cfg = DataConfig(source="movielens-100k", path=str(tmp_path / "ml"), cache_dir=str(tmp_path / "c"),
                     min_interactions=20, max_interactions=35, query_size=5, four_state=True,
                     new_item_year=1996)
    reference = tasks_from_log(read_log(cfg), cfg, seed=0)
    built = build_tasks(cfg, seed=0)
    assert set(built.states) == {"warm", "user_cold", "item_cold", "user_item_cold"}
    assert_same(reference, built)


def test_row_order_key_is_a_bijection_and_sql_computes_the_same(tmp_path):
    import duckdb

    from gmeta_ds.data.stream import order_key_sql, sql_table

    rows = np.concatenate([np.arange(10_000), [2**31, 2**32 - 1, 2**32 + 7, 10**12 + 3]]).astype(np.int64)
    keys = row_order_key(rows, seed=5)
    assert len(np.unique(keys[:10_000])) == 10_000
    assert not np.array_equal(np.argsort(keys[:10_000]), np.arange(10_000))
    assert not np.array_equal(keys, row_order_key(rows, seed=6))
    con = duckdb.connect()
    con.register("r", pa.table({"_row": rows}))
    key, steps = order_key_sql(5)
    sql = sql_table(con, f"SELECT {', '.join(steps)}, {key} AS k FROM r").column("k").to_numpy()
    np.testing.assert_array_equal(sql.astype(np.uint64), keys)


def test_store_is_atomic_and_verified(tmp_path):
    path = tmp_path / "log.parquet"
    frame().to_parquet(path)
    cfg = table_cfg(path, tmp_path)
    store = store_path(cfg, 0)
    build_tasks(cfg, seed=0)
    assert sorted(p.name for p in store.parent.iterdir()) == [store.name, f"{store.name}.lock"]
    manifest = json.loads((store / "manifest.json").read_text())
    victim = store / manifest["splits"]["train"]["ids"]["file"]
    victim.write_bytes(victim.read_bytes()[:-4])
    with pytest.raises(DataError, match="damaged"):
        open_store(store)
    # a killed build's temporary folder is removed by the next build of the same store
    stale = store.with_name(f"{store.name}.tmp-999999")
    (stale / "spill").mkdir(parents=True)
    import shutil as _shutil
    _shutil.rmtree(store)
    build_tasks(cfg, seed=0)
    assert not stale.exists() and (store / "manifest.json").is_file()
    # a build that fails leaves nothing behind that a later run would open
    bad = frame()
    bad.loc[7, "rating"] = np.nan
    bad.to_parquet(tmp_path / "bad.parquet")
    cfg_bad = table_cfg(tmp_path / "bad.parquet", tmp_path)
    with pytest.raises(DataError, match=r"bad.parquet: row 8: column 'rating' must be a number"):
        build_tasks(cfg_bad, seed=0)
    assert not store_path(cfg_bad, 0).exists()
    assert not [p for p in store.parent.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.drop(columns=["cat"]), r"missing column\(s\) cat"),
    (lambda d: d.assign(rating=["x"] + ["4"] * (len(d) - 1)), r"row 1: column 'rating' must be a number"),
    (lambda d: d.assign(user=[None] * 3 + list(d.user[3:])), r"row 1: column 'user' is empty"),
])
def test_bad_logs_name_the_file_and_row(tmp_path, mutate, message):
    path = tmp_path / "log.parquet"
    mutate(frame()).to_parquet(path)
    with pytest.raises(DataError, match=message):
        build_tasks(table_cfg(path, tmp_path), seed=0)


def test_mixed_schemas_empty_and_truncated_files(tmp_path):
    shards = tmp_path / "s"
    shards.mkdir()
    df = frame()
    df.iloc[:100].to_parquet(shards / "a.parquet")
    df.iloc[100:].assign(item=df.item[100:].astype(str)).to_parquet(shards / "b.parquet")
    with pytest.raises(DataError, match=r"b.parquet: column 'item' is \w*string, but int64 in .*a.parquet"):
        build_tasks(table_cfg(shards, tmp_path), seed=0)
    (shards / "b.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"b.parquet: file is empty"):
        build_tasks(table_cfg(shards, tmp_path), seed=0)
    whole = (shards / "a.parquet").read_bytes()
    (shards / "b.parquet").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"b.parquet: cannot read as Parquet"):
        build_tasks(table_cfg(shards, tmp_path), seed=0)


def test_not_enough_disk_is_refused_before_work(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    path = tmp_path / "log.parquet"
    frame().to_parquet(path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(DataError, match=r"needs about .* GiB of disk and 0.0 GiB are free"):
        build_tasks(table_cfg(path, tmp_path), seed=0)


def test_csv_errors_name_the_csv_file_and_row(tmp_path):
    df = frame()
    df["rating"] = df["rating"].astype(object)
    df.loc[4, "rating"] = "four"
    df.to_csv(tmp_path / "log.csv", index=False)
    with pytest.raises(DataError, match=r"log.csv: row 5 below the header: column 'rating' must be a number"):
        build_tasks(table_cfg(tmp_path / "log.csv", tmp_path), seed=0)
    (tmp_path / "semi.csv").write_text("user;item;rating\nu1;i1;4\n")
    with pytest.raises(DataError, match=r"semi.csv: expected columns separated by ','"):
        build_tasks(table_cfg(tmp_path / "semi.csv", tmp_path), seed=0)


def _build_in_child(args):
    path, cache = args
    from gmeta_ds.config import DataConfig, SchemaConfig
    from gmeta_ds.data.builder import build_tasks

    cfg = DataConfig(source="table", path=path, cache_dir=cache, schema=SchemaConfig(**SCHEMA),
                     min_interactions=8, max_interactions=35, query_size=4, test_fraction=0.25)
    data = build_tasks(cfg, seed=0)
    return "cache" in data.stats, np.asarray(data.train.ids).tobytes()


def test_concurrent_processes_build_the_store_once(tmp_path):
    import multiprocessing as mp

    path = tmp_path / "log.parquet"
    frame(n_users=400).to_parquet(path)
    with mp.get_context("spawn").Pool(3) as pool:
        results = pool.map_async(_build_in_child, [(str(path), str(tmp_path / "cache"))] * 3).get(timeout=120)
    assert sorted(hit for hit, _ in results) == [False, True, True]  # one built, two opened its store
    assert len({ids for _, ids in results}) == 1


def test_store_arrays_read_only_what_is_asked(tmp_path):
    from gmeta_ds.data.loader import TaskLoader, task_lengths
    from gmeta_ds.data.sampler import MetaBatchSampler
    from gmeta_ds.data.stream import mapped_store_mib
    from gmeta_ds.data.tasks import collate

    path = tmp_path / "log.parquet"
    frame(n_users=300).to_parquet(path)
    cfg = table_cfg(path, tmp_path)
    reference = tasks_from_log(read_log(cfg), cfg, seed=0)
    data = build_tasks(cfg, seed=0)
    ids, values = data.train.ids, data.train.multi["tags"][0]
    full = np.asarray(ids)
    rng = np.random.default_rng(0)
    for key in (slice(3, 40), slice(None), 5, -1, np.array([7, 8, 9, 30, 31, 2]),
                np.sort(rng.choice(len(full), 50, replace=False)), rng.integers(0, len(full), 20)):
        np.testing.assert_array_equal(ids[key], full[key])
    np.testing.assert_array_equal(values[np.arange(10, 20)], np.asarray(values)[10:20])
    with pytest.raises(IndexError):
        ids[np.array([len(full)])]
    for a, b in zip(collate(reference.train, [0, 5, 9]).__dict__.values(), collate(data.train, [0, 5, 9]).__dict__.values()):
        if isinstance(a, dict):
            assert all(np.array_equal(a[k].values, b[k].values) and np.array_equal(a[k].offsets, b[k].offsets) for k in a)
        else:
            np.testing.assert_array_equal(a, b)
    fresh = build_tasks(cfg, seed=0)  # no memory map yet: collating reads rows, maps nothing
    loader = TaskLoader(fresh.train, MetaBatchSampler(len(fresh.train), 8, 2, 1, 0, 0, task_lengths(fresh.train)),
                        prefetch=False)
    for _ in range(5):
        loader.next()
    assert mapped_store_mib() in (None, 0.0) or all(
        getattr(a, "_map", None) is None for a in (fresh.train.ids, fresh.train.labels))


def test_list_typed_multi_hot_and_float_ids_equal_in_memory_builder(tmp_path):
    df = frame(seed=2)
    df["tags"] = [[t for t in s.split("|") if t] if i % 7 else None for i, s in enumerate(df.tags)]
    df["cat"] = np.where(np.arange(len(df)) % 11 == 0, np.nan, np.arange(len(df)) % 5).astype(float)
    df["user"] = pd.factorize(df["user"])[0].astype(np.int64) * 37 - 500  # integer task keys: string order
    df["age"] = pd.array([None if i % 13 == 0 else (i * 7) % 12 - 3 for i in range(len(df))], dtype="Int64")
    path = tmp_path / "log.parquet"
    df.to_parquet(path)
    cfg = table_cfg(path, tmp_path)
    assert_same(tasks_from_log(read_log(cfg), cfg, seed=1), build_tasks(cfg, seed=1))


def test_disk_full_during_the_build_is_a_clear_error_and_leaves_no_store(tmp_path, monkeypatch):
    import errno

    from gmeta_ds.data import stream

    path = tmp_path / "log.parquet"
    frame().to_parquet(path)
    cfg = table_cfg(path, tmp_path)

    def full(self, start, values):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(stream.ArrayWriter, "put", full)
    with pytest.raises(DataError, match=r"data.cache_dir: cannot write the task store .*No space left on device"):
        build_tasks(cfg, seed=0)
    assert [p.name for p in store_path(cfg, 0).parent.iterdir()] == [f"{store_path(cfg, 0).name}.lock"]


def test_raw_id_columns_keep_their_values_in_memory_and_out_of_core(tmp_path):
    """data.raw_ids: an integer column keeps its values, a string column gets `string_id`s
    (DuckDB's md5_number computes the same), other columns keep their vocabularies."""
    from gmeta_ds.data.readers import MISSING
    from gmeta_ds.sparse import string_id

    df = frame()
    df["item"] = df["item"] * 1_000_003 + 2**40  # ids far outside any vocabulary
    path = tmp_path / "log.parquet"
    df.to_parquet(path)
    cfg = table_cfg(path, tmp_path, raw_ids=["item", "age"], min_count=2)
    reference = tasks_from_log(read_log(cfg), cfg, seed=3)
    stored = build_tasks(cfg, seed=3)
    assert_same(reference, stored)
    names = [f.name for f in stored.fields if not f.multi_hot]
    raw = {f.name: f.raw for f in stored.fields}
    assert raw == {"age": True, "item": True, "cat": False, "tags": False}
    ids = np.asarray(stored.train.ids)
    assert ids.dtype == np.int64
    items = set(ids[:, names.index("item")].tolist())
    assert items <= set(df["item"].tolist()) and min(items) >= 2**40
    ages = set(ids[:, names.index("age")].tolist())
    assert ages <= {string_id(v) for v in ["a", "b", "c", "zz", MISSING]}
    assert set(ids[:, names.index("cat")].tolist()) <= {0, 1, 2, 3, 4}  # vocabulary ids
    with pytest.raises(DataError, match="data.raw_ids: 'tags' is a multi-hot column"):
        tasks_from_log(read_log(cfg), table_cfg(path, tmp_path, raw_ids=["tags"]), seed=3)
    with pytest.raises(DataError, match="data.raw_ids: 'price' is not a feature column"):
        build_tasks(table_cfg(path, tmp_path, raw_ids=["price"]), seed=3)


@pytest.mark.parametrize("kw", [{}, {"split": "time"}, {"valid_fraction": 0.2}])
def test_long_tasks_train_chunks_long_users_into_training_only(tmp_path, kw):
    """data.long_tasks: train keeps the users above max_interactions for training only, each cut
    into ceil(n / max) chunks; the held-out users and their rows are those of skip, and the
    out-of-core build equals the in-memory one."""
    path = tmp_path / "log.parquet"
    df = frame(n_users=80, seed=2)
    df.to_parquet(path)
    skip_cfg = table_cfg(path, tmp_path, max_interactions=20, **kw)
    cfg = table_cfg(path, tmp_path, max_interactions=20, long_tasks="train", **kw)
    reference = tasks_from_log(read_log(cfg), cfg, seed=3)
    assert_same(reference, build_tasks(cfg, seed=3))
    skipped = build_tasks(skip_cfg, seed=3)
    lengths = df.groupby("user").size()
    long_users = lengths[lengths > 20]
    assert len(long_users) and reference.stats["long_tasks_trained"] == len(long_users)
    # held-out users: the same tasks, the same rows, labels and order as with skip

    for name in ("test", "valid"):
        a, b = getattr(skipped, name), getattr(reference, name)
        if a is None:
            continue
        np.testing.assert_array_equal(np.asarray(a.labels), np.asarray(b.labels))
        np.testing.assert_array_equal(np.asarray(a.offsets), np.asarray(b.offsets))
        np.testing.assert_array_equal(np.asarray(a.support_len), np.asarray(b.support_len))

    # training: every row of every long user is in it, in tasks of at most ~max rows
    train = reference.train
    extra_rows = train.num_interactions - skipped.train.num_interactions
    assert extra_rows == int(long_users.sum())
    chunk_tasks = len(train) - len(skipped.train)
    assert chunk_tasks == int(sum(-(-n // 20) for n in long_users))  # no chunk too short here
    assert np.diff(np.asarray(train.offsets)).max() <= 2 * 20


def test_long_tasks_skip_keeps_the_cache_key_and_resample_does_not_enter_it(tmp_path):
    from gmeta_ds.data.builder import cache_key

    path = tmp_path / "log.parquet"
    frame().to_parquet(path)
    base = table_cfg(path, tmp_path)
    assert cache_key(table_cfg(path, tmp_path, resample=True), 0) == cache_key(base, 0)
    assert cache_key(table_cfg(path, tmp_path, long_tasks="train"), 0) != cache_key(base, 0)


def test_long_tasks_with_four_states_equal_in_memory_builder(tmp_path):
    write_ml100k(tmp_path / "ml")
    cfg = DataConfig(source="movielens-100k", path=str(tmp_path / "ml"), cache_dir=str(tmp_path / "c"),
                     min_interactions=15, max_interactions=25, query_size=5, four_state=True,
                     new_item_year=1996, long_tasks="train")
    reference = tasks_from_log(read_log(cfg), cfg, seed=0)
    assert reference.stats["long_tasks_trained"] > 0
    assert_same(reference, build_tasks(cfg, seed=0))
