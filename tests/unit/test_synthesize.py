"""`gmeta-ds data synthesize` / `synthesize_log`: schema, sizes, determinism, atomic writes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gmeta_ds.data import parquet_log as syn
from gmeta_ds.data.parquet_log import synthesize_log, user_lengths

REPO = Path(__file__).resolve().parents[2]
TYPES = {"user_id": pa.int64(), "item_id": pa.int64(), "rating": pa.float32(), "timestamp": pa.int64(),
         "age": pa.string(), "gender": pa.string(), "category": pa.string(), "tags": pa.string()}


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn") / "log"
    summary = synthesize_log(out, 60_000, shards=3, seed=7)
    return out, summary, pq.read_table(out)  # pyarrow skips _schema.yaml


def test_schema_rows_and_users(log):
    out, summary, table = log
    files = sorted(p.name for p in out.iterdir())
    assert files == ["_schema.yaml", "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    for f in out.glob("part-*.parquet"):
        assert {n: t for n, t in zip(pq.read_schema(f).names, pq.read_schema(f).types)} == TYPES
    assert table.num_rows == 60_000 == summary["rows"]
    uid = table.column("user_id").to_numpy()
    assert uid.min() == 1 and uid.max() == summary["users"] and np.all(np.diff(uid) >= 0)
    counts = np.bincount(uid)[1:]
    assert counts.min() >= 13 and counts.max() <= 100
    item = table.column("item_id").to_numpy()
    assert item.min() >= 1 and item.max() <= summary["items"] == 1000
    rating = table.column("rating").to_numpy()
    assert set(np.unique(rating)) == {1.0, 2.0, 3.0, 4.0, 5.0}
    assert 0.40 <= (rating >= 4).mean() <= 0.55
    assert np.bincount(item).max() > 20 * np.median(np.bincount(item)[1:])  # Zipf: a heavy head


def test_features_are_per_user_and_per_item(log):
    df = log[2].to_pandas()
    assert df.groupby("user_id")[["age", "gender"]].nunique().max().max() == 1
    assert df.groupby("item_id")[["category", "tags"]].nunique().max().max() == 1
    assert df["age"].nunique() == 7 and set(df["gender"]) == {"F", "M"} and df["category"].nunique() == 30
    pieces = df["tags"].str.split("|")
    assert pieces.map(len).between(1, 3).all() and pieces.map(lambda p: len(set(p)) == len(p)).all()
    assert len({t for p in pieces for t in p}) == 50
    ts = df.groupby("user_id")["timestamp"].apply(lambda s: bool(np.all(np.diff(s.to_numpy()) >= 0)))
    assert ts.all() and df["timestamp"].min() >= syn.T_START and df["timestamp"].max() < 1_800_000_000


def test_ratings_carry_signal(log):
    """Item popularity and the user/item affinity move the rating: not uniform noise."""
    df = log[2].to_pandas()
    pop = df.groupby("item_id")["rating"].transform("size")
    assert np.corrcoef(np.log(pop), df["rating"])[0, 1] > 0.1
    user_mean = df.groupby("user_id")["rating"].transform("mean")
    assert np.corrcoef(user_mean, df["rating"])[0, 1] > 0.3


def test_duckdb_reads_the_glob(log):
    out = log[0]
    rows = duckdb.sql(f"DESCRIBE SELECT * FROM read_parquet('{out}/*.parquet')").fetchall()
    assert {r[0]: r[1] for r in rows} == {"user_id": "BIGINT", "item_id": "BIGINT", "rating": "FLOAT",
                                          "timestamp": "BIGINT", "age": "VARCHAR", "gender": "VARCHAR",
                                          "category": "VARCHAR", "tags": "VARCHAR"}
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{out}/*.parquet')").fetchall()[0][0] == 60_000
    # whole users per shard
    per = duckdb.sql(f"SELECT count(DISTINCT filename) FROM read_parquet('{out}/*.parquet', filename=true) "
                     "GROUP BY user_id ORDER BY 1 DESC LIMIT 1").fetchall()[0][0]
    assert per == 1


def test_schema_yaml_is_the_data_block(log):
    import yaml

    block = yaml.safe_load((log[0] / "_schema.yaml").read_text())["data"]
    assert block["source"] == "table" and block["format"] == "parquet"
    assert Path(block["path"]) == log[0].resolve() and block["schema"] == syn.DATA_SCHEMA


def test_deterministic_bytes_and_shard_independent_rows(tmp_path, log):
    a = synthesize_log(tmp_path / "a", 60_000, shards=3, seed=7)
    for f in a["files"]:
        assert Path(f).read_bytes() == (log[0] / Path(f).name).read_bytes()
    one = pq.read_table(synthesize_log(tmp_path / "one", 60_000, shards=1, seed=7)["files"][0])
    assert one.equals(log[2])
    other = pq.read_table(synthesize_log(tmp_path / "b", 60_000, shards=1, seed=8)["files"][0])
    assert not other.equals(one)


@pytest.mark.parametrize("n", [13, 14, 99, 100, 101, 112, 113, 5_000, 123_457])
def test_exact_lengths(n):
    lens = user_lengths(n, seed=n)
    assert int(lens.sum()) == n and lens.min() >= 13 and lens.max() <= 100


def test_multi_block_and_uneven_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(syn, "USERS_PER_BLOCK", 50)  # several blocks, cut across shard boundaries
    s = synthesize_log(tmp_path / "x", 20_000, shards=7, seed=1)
    tables = [pq.read_table(f) for f in s["files"]]
    assert len(tables) == 7 and sum(t.num_rows for t in tables) == 20_000
    assert all(t.num_rows > 0 for t in tables)
    ids = np.concatenate([t.column("user_id").to_numpy() for t in tables])
    assert np.array_equal(np.unique(ids), np.arange(1, s["users"] + 1)) and np.all(np.diff(ids) >= 0)
    monkeypatch.setattr(syn, "USERS_PER_BLOCK", 16_384)
    same = pq.read_table(synthesize_log(tmp_path / "y", 20_000, shards=1, seed=1)["files"][0])
    assert same.num_rows == 20_000  # another block size is another (valid) log


def test_refuses_non_empty_and_overwrites_atomically(tmp_path):
    out = tmp_path / "log"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        synthesize_log(out, 1000)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    synthesize_log(out, 1000, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["_schema.yaml", "part-00000.parquet"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]  # no tmp / old siblings left
    empty = tmp_path / "empty"
    empty.mkdir()
    synthesize_log(empty, 1000)  # an empty folder is fine
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        synthesize_log(tmp_path / "file", 1000, overwrite=True)


def test_failure_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(syn, "_shard_table", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        synthesize_log(tmp_path / "log", 1000)
    assert list(tmp_path.iterdir()) == []


def test_not_enough_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(syn.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    with pytest.raises(syn.NotEnoughDisk, match="not enough free disk"):
        synthesize_log(tmp_path / "log", 1000)
    assert list(tmp_path.iterdir()) == []


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "gmeta_ds.cli", "data", "synthesize", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd, env=env, check=False)


def test_cli(tmp_path):
    proc = _cli("--interactions", "5000", "--out", "log", "--shards", "2", "--seed", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 5,000 rows" in proc.stdout and "source: table" in proc.stdout
    assert len(list((tmp_path / "log").glob("part-*.parquet"))) == 2
    again = _cli("--interactions", "5000", "--out", "log", cwd=tmp_path)
    assert again.returncode == 2 and "'log'" in again.stderr and "--overwrite" in again.stderr
    assert _cli("--interactions", "5000", "--out", "log", "--overwrite", cwd=tmp_path).returncode == 0
    for bad in (["--interactions", "12"], ["--interactions", "100", "--shards", "0"],
                ["--interactions", "100", "--shards", "5"], ["--interactions", "ten"]):
        proc = _cli(*bad, "--out", "bad", cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.strip(), (bad, proc.stderr)
    assert not (tmp_path / "bad").exists()
