"""`gm.build_tasks` on the logs the toolkit writes (a folder of shards, a glob, one file) builds
through the CLI's out-of-core task store and gives the in-memory build's tasks; a 0/1 label
column is read as clicks, and a label set left with one class is an error naming the column."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import gmeta_ds as gm
from gmeta_ds.config import DataConfig
from gmeta_ds.data.readers import DEFAULT_THRESHOLD
from gmeta_ds.data.stream import StoreArray
from gmeta_ds.data.parquet_log import synthesize_log

KEYS = dict(task_key="user_id", item_key="item_id", label="rating", user_features=["age", "gender"],
            item_features=["category"], multi_hot={"tags": "|"}, query_size=4, seed=1)


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    out = tmp_path_factory.mktemp("api_paths") / "log"
    synthesize_log(out, 3000, shards=3, seed=5)
    return out


def assert_same(a, b) -> None:
    assert a.fields == b.fields
    for name in ("train", "valid", "test"):
        x, y = getattr(a, name), getattr(b, name)
        for attr in ("ids", "labels", "offsets", "support_len", "task_keys"):
            np.testing.assert_array_equal(np.asarray(getattr(x, attr)), np.asarray(getattr(y, attr)),
                                          err_msg=f"{name}.{attr}")
        for f, (v, o) in x.multi.items():
            np.testing.assert_array_equal(np.asarray(v), np.asarray(y.multi[f][0]), err_msg=f"{name}.{f}")
            np.testing.assert_array_equal(np.asarray(o), np.asarray(y.multi[f][1]), err_msg=f"{name}.{f}")
    for key in ("click_rate", "train_tasks", "test_tasks", "vocab", "tasks_kept"):
        assert a.stats[key] == pytest.approx(b.stats[key]), key


def test_folder_glob_and_file_equal_the_in_memory_build(log, tmp_path):
    cache = str(tmp_path / "cache")
    reference = gm.build_tasks(pq.read_table(log), **KEYS)
    folder = gm.build_tasks(log, **KEYS, cache_dir=cache)
    assert isinstance(folder.train.ids, StoreArray)  # out of core, from the task store
    assert_same(reference, folder)
    assert_same(reference, gm.build_tasks(str(log / "part-*.parquet"), **KEYS, cache_dir=cache))
    assert "cache" in gm.build_tasks(log, **KEYS, cache_dir=cache).stats  # reused, not rebuilt
    one = tmp_path / "one.parquet"
    pq.write_table(pq.read_table(log), one)
    assert_same(reference, gm.build_tasks(one, **KEYS, cache_dir=cache))


def test_a_click_column_is_read_as_clicks(log, tmp_path):
    table = pq.read_table(log)
    clicks = table.append_column("click", pc.cast(pc.greater_equal(table["rating"], 4.0), pa.float32()))
    pq.write_table(clicks, tmp_path / "clicks.parquet")
    keys = {**KEYS, "label": "click"}
    expected = float(np.mean(clicks["click"].to_numpy()))
    for source in (clicks, tmp_path / "clicks.parquet"):  # in memory and out of core
        data = gm.build_tasks(source, **keys, cache_dir=str(tmp_path / "cache"))
        assert 0.3 < data.stats["click_rate"] < 0.7
        assert data.stats["click_rate"] == pytest.approx(expected, abs=0.05)
    assert DEFAULT_THRESHOLD == DataConfig().threshold


def test_a_single_class_label_is_an_error_naming_the_column(log, tmp_path):
    table = pq.read_table(log)
    ones = table.append_column("click", pa.array(np.ones(table.num_rows, dtype=np.float32)))
    pq.write_table(ones, tmp_path / "ones.parquet")
    keys = {**KEYS, "label": "click"}
    for source in (ones, tmp_path / "ones.parquet"):
        with pytest.raises(gm.DataError, match=r"every label is 1 .*column 'click' at data.threshold 1"):
            gm.build_tasks(source, **keys, cache_dir=str(tmp_path / "cache"))
    for source in (table, log):  # ratings 1-5 above every one of them: no click
        with pytest.raises(gm.DataError, match=r"every label is 0 .*column 'rating' at data.threshold 6"):
            gm.build_tasks(source, **KEYS, threshold=6.0, cache_dir=str(tmp_path / "cache"))


def test_missing_paths_name_the_path(tmp_path):
    with pytest.raises(gm.DataError, match="matches no file"):
        gm.build_tasks(str(tmp_path / "none-*.parquet"), **KEYS, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(gm.DataError, match="file does not exist"):
        gm.build_tasks(tmp_path / "none.parquet", **KEYS, cache_dir=str(tmp_path / "cache"))


def test_the_run_configs_data_path_reads_a_click_column_as_clicks(log, tmp_path):
    from gmeta_ds.config import SchemaConfig
    from gmeta_ds.data.builder import build_tasks

    table = pq.read_table(log)
    clicks = table.append_column("click", pc.cast(pc.greater_equal(table["rating"], 4.0), pa.float32()))
    pq.write_table(clicks, tmp_path / "clicks.parquet")
    schema = SchemaConfig(task_key="user_id", item_key="item_id", label="click")
    cfg = DataConfig(source="table", path=str(tmp_path / "clicks.parquet"), schema=schema,
                     cache_dir=str(tmp_path / "cache"), query_size=4)
    assert 0.3 < build_tasks(cfg, seed=0).stats["click_rate"] < 0.7  # data.threshold left at 4.0
    explicit = DataConfig(**{**cfg.__dict__, "threshold": 2.0})  # a set threshold applies as given
    with pytest.raises(gm.DataError, match=r"every label is 0 .*column 'click' at data.threshold 2"):
        build_tasks(explicit, seed=0)
