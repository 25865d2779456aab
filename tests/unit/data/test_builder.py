"""Meta-IO task building from an ml-100k-format log: filters, splits, vocabularies, cache."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import write_ml100k

from gmeta_ds.config import DataConfig
from gmeta_ds.data.builder import build_tasks
from gmeta_ds.data.readers import DataError


def config(tmp_path, **kw) -> DataConfig:
    write_ml100k(tmp_path / "ml")
    base = dict(source="movielens-100k", path=str(tmp_path / "ml"), cache_dir=str(tmp_path / "cache"),
                min_interactions=20, max_interactions=35, query_size=5)
    return DataConfig(**{**base, **kw})


def test_tasks_are_filtered_split_and_encoded(tmp_path):
    data = build_tasks(config(tmp_path), seed=0)
    s = data.stats
    assert s["tasks_kept"] == s["tasks_read"] - s["tasks_too_short"] - s["tasks_too_long"] > 0
    assert len(data.train) + len(data.test) == s["tasks_kept"]
    assert set(data.train.task_keys).isdisjoint(data.test.task_keys)
    for ts in (data.train, data.test):
        lengths = np.diff(ts.offsets)
        assert lengths.min() >= 20 and lengths.max() <= 35
        assert np.all(lengths - ts.support_len == 5)
    names = [f.name for f in data.fields]
    assert names == ["age", "gender", "occupation", "zip3", "item_id", "release_year", "genres"]
    genres = data.fields[-1]
    assert genres.multi_hot and genres.num_ids <= 20
    for j, f in enumerate(data.fields[:-1]):
        assert data.train.ids[:, j].max() < f.num_ids
    assert (data.train.ids[:, 0] > 0).all()  # every training value is in the vocabulary
    assert 0.0 < s["click_rate"] < 1.0


def test_vocabularies_come_from_training_users_only(tmp_path):
    data = build_tasks(config(tmp_path, min_count=2), seed=0)
    for j, f in enumerate(data.fields[:-1]):
        train_ids, test_ids = set(data.train.ids[:, j]), set(data.test.ids[:, j])
        assert test_ids - {0} <= train_ids, f.name  # a non-OOV test id was seen in training
        counts = np.bincount(data.train.ids[:, j])
        assert np.all(counts[1:] >= 2), f.name     # min_count applies to training rows
    everything_oov = build_tasks(config(tmp_path, min_count=10**6), seed=0)
    assert all(f.num_ids == 1 for f in everything_oov.fields)
    assert not everything_oov.train.ids.any()


def test_second_build_comes_from_the_cache_until_the_log_changes(tmp_path):
    cfg = config(tmp_path)
    first = build_tasks(cfg, seed=0)
    second = build_tasks(cfg, seed=0)
    assert "cache" in second.stats and "cache" not in first.stats
    np.testing.assert_array_equal(first.train.ids, second.train.ids)
    np.testing.assert_array_equal(first.test.multi["genres"][0], second.test.multi["genres"][0])
    other = build_tasks(cfg, seed=1)
    assert "cache" not in other.stats
    assert not np.array_equal(other.train.task_keys, first.train.task_keys)
    write_ml100k(tmp_path / "ml", seed=5)  # new files: a new key, not stale tasks
    assert "cache" not in build_tasks(cfg, seed=0).stats


def test_time_split_and_random_split_differ_only_in_order(tmp_path):
    by_time = build_tasks(config(tmp_path, split="time"), seed=0)
    shuffled = build_tasks(config(tmp_path), seed=0)
    np.testing.assert_array_equal(by_time.train.task_keys, shuffled.train.task_keys)
    np.testing.assert_array_equal(by_time.train.offsets, shuffled.train.offsets)
    # the fixture rates items in increasing time, so by time a task's rows follow u.data order
    assert not np.array_equal(by_time.train.ids, shuffled.train.ids)
    assert sorted(map(tuple, by_time.train.ids)) == sorted(map(tuple, shuffled.train.ids))


def test_empty_result_after_filtering_names_the_bounds(tmp_path):
    with pytest.raises(DataError, match=r"no task has between 90 and 100 interactions"):
        build_tasks(config(tmp_path, min_interactions=90, max_interactions=100), seed=0)


def test_short_tasks_can_be_an_error_naming_examples(tmp_path):
    with pytest.raises(DataError, match=r"\d+ task\(s\) have fewer than 20 interactions "
                                        r"\(data.min_interactions\), e.g. user_id \d+"):
        build_tasks(config(tmp_path, short_tasks="error"), seed=0)


def test_four_state_split_by_release_year(tmp_path):
    cfg = config(tmp_path, four_state=True, new_item_year=1996, min_interactions=15, max_interactions=40)
    data = build_tasks(cfg, seed=0)
    assert sorted(data.states) == ["item_cold", "user_cold", "user_item_cold", "warm"]
    item = [f.name for f in data.fields].index("item_id")
    # the fixture's years are 1990 + i % 9 (item 4 has none): training never sees a new item,
    # so every item-cold row maps to the OOV item id
    for name in ("item_cold", "user_item_cold"):
        assert len(data.states[name]) > 0 and (data.states[name].ids[:, item] == 0).all(), name
    assert (data.states["user_cold"].ids[:, item] > 0).mean() > 0.9
    assert np.array_equal(data.states["warm"].task_keys, data.train.task_keys)
    assert set(data.states["user_cold"].task_keys).isdisjoint(data.train.task_keys)
    assert np.array_equal(data.test.task_keys, data.states["user_cold"].task_keys)
    cached = build_tasks(cfg, seed=0)
    assert "cache" in cached.stats and sorted(cached.states) == sorted(data.states)
    np.testing.assert_array_equal(cached.states["item_cold"].ids, data.states["item_cold"].ids)


def test_validation_users_are_a_third_disjoint_group(tmp_path):
    cfg = config(tmp_path, min_interactions=15, max_interactions=40)
    plain = build_tasks(cfg, seed=0)
    cfg.valid_fraction = 0.2
    data = build_tasks(cfg, seed=0)
    keys = [set(ts.task_keys) for ts in (data.train, data.valid, data.test)]
    assert all(len(k) > 0 for k in keys)
    assert keys[0].isdisjoint(keys[1]) and keys[0].isdisjoint(keys[2]) and keys[1].isdisjoint(keys[2])
    np.testing.assert_array_equal(data.test.task_keys, plain.test.task_keys)  # same test users
    assert len(plain.valid) == 0
    item = [f.name for f in data.fields].index("item_id")
    assert set(data.valid.ids[:, item]) - {0} <= set(data.train.ids[:, item])  # vocab: train only
