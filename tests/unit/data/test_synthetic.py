"""Tests for the synthetic cold-start CTR generator (small configs: the file runs in ~1 s)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gmeta_ds.config import SyntheticConfig
from gmeta_ds.data.synthetic import (ITEM_FIELDS, USER_FIELDS, generate_synthetic,
                                     synthetic_fields)

SMALL = SyntheticConfig(num_users=300)
ARRAYS = ("ids", "labels", "offsets", "support_len", "task_keys")


def _both(data):
    return (data.train, data.test)


def test_fields_order_and_cardinalities():
    fields = synthetic_fields(SMALL)
    assert [f.name for f in fields] == ["age", "gender", "occupation", "region",
                                        "item_id", "category", "brand", "price"]
    assert [f.side for f in fields] == ["user"] * 4 + ["item"] * 4
    expected = dict(USER_FIELDS) | dict(ITEM_FIELDS) | {"item_id": SMALL.num_items}
    assert {f.name: f.num_ids for f in fields} == expected


def test_same_seed_is_bit_identical_and_other_seed_differs():
    a, b, c = (generate_synthetic(SMALL, s) for s in (3, 3, 4))
    for name in ARRAYS:
        for x, y in zip(_both(a), _both(b)):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
    assert not np.array_equal(a.train.ids, c.train.ids)
    assert not np.array_equal(a.train.labels, c.train.labels)
    assert not np.array_equal(a.train.task_keys, c.train.task_keys)


def test_train_test_users_disjoint_sorted_and_cover_all():
    data = generate_synthetic(SMALL, 0)
    train, test = data.train.task_keys, data.test.task_keys
    assert len(np.intersect1d(train, test)) == 0
    np.testing.assert_array_equal(np.union1d(train, test), np.arange(SMALL.num_users))
    assert np.all(np.diff(train) > 0) and np.all(np.diff(test) > 0)
    assert len(test) == round(SMALL.test_fraction * SMALL.num_users)


@pytest.mark.parametrize("chunk_users", [7, 50_000])
def test_shapes_dtypes_and_id_ranges(chunk_users):
    data = generate_synthetic(SMALL, 0, chunk_users=chunk_users)
    for ts in _both(data):
        n, u = ts.num_interactions, len(ts)
        assert ts.ids.dtype == np.int32 and ts.ids.shape == (n, len(data.fields))
        assert ts.labels.dtype == np.float32 and ts.labels.shape == (n,)
        assert set(np.unique(ts.labels)) == {0.0, 1.0}
        assert ts.offsets.dtype == np.int64 and ts.offsets.shape == (u + 1,)
        assert ts.offsets[0] == 0 and np.all(np.diff(ts.offsets) > 0)
        assert ts.support_len.dtype == np.int64 and ts.task_keys.dtype == np.int64
        for col, field in enumerate(data.fields):
            assert ts.ids[:, col].min() >= 0 and ts.ids[:, col].max() < field.num_ids
            # Every field varies (no degenerate feature).
            assert len(np.unique(ts.ids[:, col])) > 1, field.name
        starts = ts.offsets[:-1]
        # User fields are constant within a task.
        for col in range(len(USER_FIELDS)):
            assert np.all(ts.ids[:, col] == np.repeat(ts.ids[starts, col], np.diff(ts.offsets)))


def test_task_lengths_and_support_query_split():
    cfg = dataclasses.replace(SMALL, min_interactions=10, max_interactions=120, query_size=5)
    data = generate_synthetic(cfg, 1)
    lengths = np.concatenate([np.diff(ts.offsets) for ts in _both(data)])
    assert lengths.min() == cfg.min_interactions and lengths.max() <= cfg.max_interactions
    # Log-uniform: ~75% of tasks are in the lower half of the range (uniform would give 50%).
    lower_half = np.mean(lengths < (cfg.min_interactions + cfg.max_interactions) / 2)
    assert lower_half > 0.62, lower_half
    for ts in _both(data):
        query = np.diff(ts.offsets) - ts.support_len
        assert np.all(query == cfg.query_size) and np.all(ts.support_len >= 1)


def test_item_popularity_is_zipf_like():
    data = generate_synthetic(SMALL, 0)
    items = np.concatenate([ts.ids[:, 4] for ts in _both(data)])
    counts = np.bincount(items, minlength=SMALL.num_items)
    assert counts.max() > 20 * max(np.median(counts), 1)
    # Popularity ranks are shuffled over ids: no rank correlation between id and count.
    count_rank = np.argsort(np.argsort(counts))
    assert abs(np.corrcoef(np.arange(SMALL.num_items), count_rank)[0, 1]) < 0.3


def _grouped_loglik(keys: np.ndarray, y: np.ndarray) -> float:
    _, inv = np.unique(keys, return_inverse=True)
    n, c = np.bincount(inv), np.bincount(inv, weights=y)
    p = np.clip(c / n, 1e-12, 1 - 1e-12)
    return float((c * np.log(p) + (n - c) * np.log(1 - p)).sum())


def _feature_gain(user_cols: list[np.ndarray], category: np.ndarray, y: np.ndarray) -> float:
    """Likelihood-ratio gain of click rates per (user value, item category) over per-category."""
    base = _grouped_loglik(category, y)
    return sum(2 * (_grouped_loglik(col * 1000 + category, y) - base) for col in user_cols)


@pytest.mark.parametrize("signal, informative", [(2.0, True), (0.0, False)])
def test_user_features_carry_preference_signal(signal, informative):
    # Compare against the same data with user features shuffled across users: that keeps
    # within-user correlation (the shuffle moves whole users), removing only the signal.
    cfg = dataclasses.replace(SMALL, num_users=2000, feature_signal=signal)
    ts = generate_synthetic(cfg, 0).train
    lengths, starts = np.diff(ts.offsets), ts.offsets[:-1]
    category = ts.ids[:, 5].astype(np.int64)
    user_vals = ts.ids[starts, :len(USER_FIELDS)].astype(np.int64)
    real = _feature_gain([np.repeat(user_vals[:, c], lengths) for c in range(4)],
                         category, ts.labels)
    rng = np.random.default_rng(0)
    shuffled = max(_feature_gain([np.repeat(user_vals[rng.permutation(len(ts)), c], lengths)
                                  for c in range(4)], category, ts.labels) for _ in range(3))
    assert (real > 1.5 * shuffled) == informative, (real, shuffled)


def _dispersion(ts) -> float:
    """Pearson chi2 / users of per-user click counts against one shared rate (1 = binomial)."""
    n = np.diff(ts.offsets).astype(np.float64)
    clicks = np.add.reduceat(ts.labels.astype(np.float64), ts.offsets[:-1])
    p = clicks.sum() / n.sum()
    return float(np.mean((clicks - n * p) ** 2 / (n * p * (1 - p))))


def test_user_bias_makes_click_rates_overdispersed():
    assert _dispersion(generate_synthetic(SMALL, 0).train) > 2.0
    # Isolate the bias: without preferences, dispersion comes from user_bias_std alone.
    no_pref = dataclasses.replace(SMALL, preference_scale=0.0)
    assert _dispersion(generate_synthetic(no_pref, 0).train) > 2.0
    no_bias = dataclasses.replace(no_pref, user_bias_std=0.0)
    assert _dispersion(generate_synthetic(no_bias, 0).train) < 1.3


def test_click_rate_is_plausible():
    labels = generate_synthetic(SMALL, 0).train.labels
    assert 0.1 < labels.mean() < 0.9


@pytest.mark.parametrize("kwargs, cfg_change, name", [
    ({"chunk_users": 0}, {}, "chunk_users"),
    ({"seed": -1}, {}, "seed"),
    ({}, {"num_users": 1}, "num_users"),
    ({}, {"user_bias_std": -1.0}, "user_bias_std"),
])
def test_invalid_inputs_raise_naming_the_field(kwargs, cfg_change, name):
    args = {"seed": 0} | kwargs
    with pytest.raises(ValueError, match=name):
        generate_synthetic(dataclasses.replace(SMALL, **cfg_change), **args)
