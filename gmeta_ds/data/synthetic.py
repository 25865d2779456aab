"""Synthetic cold-start CTR data: the embedded default dataset.

Each user is one task. Users and items have latent vectors; a click follows a logistic
model of their scaled dot product plus biases. Categorical features are noisy argmax
readouts of the latents, so a model can partly infer a cold user's taste from features,
while a per-user click propensity that no feature reveals must be learned from the support.

Determinism: the output depends only on ``cfg``, ``seed`` and ``chunk_users``. Per-user
draws (latents, features, items, clicks) come from one RNG stream per chunk of users, so a
different ``chunk_users`` gives a different (equally valid) dataset; task lengths, the
train/test split and everything about items do not depend on it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gmeta_ds.config import SyntheticConfig
from gmeta_ds.data.tasks import TaskSet
from gmeta_ds.sparse import FieldSpec

USER_FIELDS = (("age", 7), ("gender", 2), ("occupation", 21), ("region", 50))
ITEM_FIELDS = (("category", 20), ("brand", 100), ("price", 10))

# SeedSequence spawn keys: one stream for shared draws, one per chunk of users.
_SHARED_KEY, _CHUNK_KEY, _VALID_KEY = 0, 1, 2
# Items are featurised in fixed blocks so item data never depends on chunk_users.
_ITEM_BLOCK = 65_536


def synthetic_fields(cfg: SyntheticConfig) -> list[FieldSpec]:
    """The 8 fields, in id-column order: user fields, then item_id and item fields."""
    user = [FieldSpec(name, card, "user") for name, card in USER_FIELDS]
    item = [FieldSpec(name, card, "item") for name, card in ITEM_FIELDS]
    return user + [FieldSpec("item_id", cfg.num_items, "item")] + item


@dataclass
class SyntheticData:
    """Generated dataset. ``train`` and ``test`` hold disjoint users (user cold-start),
    each sorted by user id (``task_keys``); ids are int32 (N, 8) in `synthetic_fields` order.
    ``valid``: validation users carved out of the training users (`split_valid`), else None."""

    fields: list[FieldSpec]
    train: TaskSet
    test: TaskSet
    valid: TaskSet | None = None


@dataclass
class _Shared:
    """Draws shared by all chunks (I items, U users, k latent dims)."""

    item_latent_t: np.ndarray  # float64 (k, I): transposed so each dim is contiguous
    item_bias: np.ndarray      # float64 (I,)
    item_ids: np.ndarray       # int32 (I, 1 + len(ITEM_FIELDS)): item_id, then item fields
    rank_cdf: np.ndarray       # float64 (I,): cumulative popularity by rank
    rank_to_item: np.ndarray   # int64 (I,)
    user_proj: list[np.ndarray]  # float64 (k, cardinality) per user field
    lengths: np.ndarray        # int64 (U,): interactions per user
    is_test: np.ndarray        # bool (U,)


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def _draw_categorical(rng: np.random.Generator, latent: np.ndarray, proj: np.ndarray,
                 signal: float) -> np.ndarray:
    """Gumbel-max draw: int32 (n,) values in [0, proj.shape[1]) for latent (n, k)."""
    scores = (signal / np.sqrt(latent.shape[1])) * (latent @ proj)
    scores += rng.gumbel(size=scores.shape)
    return scores.argmax(axis=1).astype(np.int32)


def _lengths(rng: np.random.Generator, cfg: SyntheticConfig) -> np.ndarray:
    """Log-uniform task lengths: many short tasks, few long ones."""
    lo, hi = np.log(cfg.min_interactions), np.log(cfg.max_interactions + 1)
    n = np.floor(np.exp(rng.uniform(lo, hi, cfg.num_users))).astype(np.int64)
    return np.clip(n, cfg.min_interactions, cfg.max_interactions)


def _make_shared(cfg: SyntheticConfig, seed: int) -> _Shared:
    rng = _rng(seed, _SHARED_KEY)
    k, n_items = cfg.latent_dim, cfg.num_items
    latent = rng.standard_normal((n_items, k))
    bias = rng.normal(0.0, 0.5, n_items)
    item_proj = [rng.standard_normal((k, card)) for _, card in ITEM_FIELDS]
    item_ids = np.empty((n_items, 1 + len(ITEM_FIELDS)), dtype=np.int32)
    item_ids[:, 0] = np.arange(n_items)
    for start in range(0, n_items, _ITEM_BLOCK):
        block = slice(start, start + _ITEM_BLOCK)
        for col, proj in enumerate(item_proj, start=1):
            item_ids[block, col] = _draw_categorical(rng, latent[block], proj, cfg.feature_signal)
    weights = np.arange(1, n_items + 1, dtype=np.float64) ** -cfg.zipf_exponent
    cdf = np.cumsum(weights)
    user_proj = [rng.standard_normal((k, card)) for _, card in USER_FIELDS]
    lengths = _lengths(rng, cfg)
    # At least one user on each side, so neither TaskSet is empty.
    n_test = min(max(round(cfg.test_fraction * cfg.num_users), 1), cfg.num_users - 1)
    is_test = np.zeros(cfg.num_users, dtype=bool)
    is_test[rng.permutation(cfg.num_users)[:n_test]] = True
    return _Shared(np.ascontiguousarray(latent.T), bias, item_ids, cdf / cdf[-1],
                   rng.permutation(n_items), user_proj, lengths, is_test)


def _chunk(cfg: SyntheticConfig, sh: _Shared, rng: np.random.Generator,
           users: slice) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a contiguous range of users, in user order: ids int32 (n, 8), labels float32 (n,)."""
    lens = sh.lengths[users]
    k, m = cfg.latent_dim, len(lens)
    z = rng.standard_normal((m, k))
    user_bias = rng.normal(0.0, cfg.user_bias_std, m)
    user_ids = np.stack([_draw_categorical(rng, z, p, cfg.feature_signal) for p in sh.user_proj], 1)
    owner = np.repeat(np.arange(m), lens)
    # Items are i.i.d. draws, so each task's rows are already in random order.
    rank = np.searchsorted(sh.rank_cdf, rng.random(len(owner)), side="right")
    items = sh.rank_to_item[np.minimum(rank, cfg.num_items - 1)]
    logit = np.zeros(len(owner))
    z_t = np.ascontiguousarray(z.T)
    for d in range(k):  # one dim at a time: no (rows, k) temporaries on big chunks
        logit += z_t[d][owner] * sh.item_latent_t[d][items]
    logit *= cfg.preference_scale / np.sqrt(k)
    logit += user_bias[owner]
    logit += sh.item_bias[items]
    logit += cfg.base_logit
    prob = 0.5 * (1.0 + np.tanh(0.5 * logit))  # sigmoid without exp overflow
    labels = (rng.random(len(owner)) < prob).astype(np.float32)
    ids = np.empty((len(owner), len(USER_FIELDS) + sh.item_ids.shape[1]), dtype=np.int32)
    ids[:, :len(USER_FIELDS)] = user_ids[owner]
    ids[:, len(USER_FIELDS):] = sh.item_ids[items]
    return ids, labels


def _empty_task_set(fields: list[FieldSpec], lengths: np.ndarray, users: np.ndarray,
                    query_size: int) -> TaskSet:
    """A TaskSet for ``users`` with its ids/labels allocated but not yet filled."""
    lens = lengths[users]
    offsets = np.zeros(len(users) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    n = int(offsets[-1])
    return TaskSet(fields, np.empty((n, len(fields)), dtype=np.int32),
                   np.empty(n, dtype=np.float32), offsets,
                   (lens - query_size).astype(np.int64), users.astype(np.int64))


def _check_args(cfg: SyntheticConfig, seed: int, chunk_users: int) -> None:
    if not isinstance(chunk_users, (int, np.integer)) or chunk_users <= 0:
        raise ValueError(f"chunk_users: {chunk_users!r} must be a positive integer")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: {seed!r} must be a non-negative integer")
    if cfg.num_users < 2:
        raise ValueError(f"data.synthetic.num_users: {cfg.num_users} must be >= 2 "
                         "so that both train and test hold at least one user")
    if cfg.user_bias_std < 0:
        raise ValueError(f"data.synthetic.user_bias_std: {cfg.user_bias_std} must be >= 0")


def generate_synthetic(cfg: SyntheticConfig, seed: int,
                       chunk_users: int = 50_000) -> SyntheticData:
    """Generate the dataset; ``cfg`` is assumed validated (`gmeta_ds.config`).

    Users are generated ``chunk_users`` at a time straight into preallocated outputs, so
    peak memory is about the output (~36 bytes per interaction) plus one chunk's temporaries.
    Same ``cfg``, ``seed`` and ``chunk_users`` -> bit-identical arrays.
    """
    _check_args(cfg, seed, chunk_users)
    fields = synthetic_fields(cfg)
    sh = _make_shared(cfg, seed)
    parts = {side: _empty_task_set(fields, sh.lengths, np.flatnonzero(sh.is_test == side),
                                   cfg.query_size) for side in (False, True)}
    filled = {False: 0, True: 0}
    for index, start in enumerate(range(0, cfg.num_users, chunk_users)):
        users = slice(start, min(start + chunk_users, cfg.num_users))
        ids, labels = _chunk(cfg, sh, _rng(seed, _CHUNK_KEY, index), users)
        row_is_test = np.repeat(sh.is_test[users], sh.lengths[users])
        for side, part in parts.items():
            rows = row_is_test == side
            lo, hi = filled[side], filled[side] + int(rows.sum())
            part.ids[lo:hi], part.labels[lo:hi] = ids[rows], labels[rows]
            filled[side] = hi
    assert all(filled[s] == parts[s].num_interactions for s in parts)
    return SyntheticData(fields, train=parts[False], test=parts[True])


def split_valid(data: SyntheticData, fraction: float, seed: int) -> SyntheticData:
    """``data`` with ``round(fraction * len(train))`` training users (at least one, and at least
    one left to train on; seeded) moved to ``valid`` (``data.valid_fraction``); ``fraction`` 0
    returns ``data`` unchanged, so the default dataset does not depend on this step."""
    if fraction <= 0:
        return data
    n_train = len(data.train)
    if n_train < 2:
        raise ValueError("data.valid_fraction: the synthetic data has fewer than 2 training users "
                         "to split into training and validation users")
    n_valid = min(max(round(fraction * n_train), 1), n_train - 1)
    is_valid = np.zeros(n_train, dtype=bool)
    is_valid[_rng(seed, _VALID_KEY).permutation(n_train)[:n_valid]] = True
    return SyntheticData(data.fields, data.train.subset(np.flatnonzero(~is_valid)), data.test,
                         data.train.subset(np.flatnonzero(is_valid)))
