"""A realistic synthetic interaction log as Parquet shards, for users and benchmarks.

    gmeta-ds data synthesize --interactions N --out DIR [--shards K] [--seed S] [--items M]

writes exactly N rows as ``DIR/part-00000.parquet`` ... ``part-{K-1:05d}.parquet`` (as Spark or
Hive write a table), plus ``DIR/_schema.yaml``, the ``data:`` block of a run config that reads
it. The leading underscore makes Spark, Hive, pyarrow.dataset and the glob ``DIR/*.parquet``
skip it, as they skip ``_SUCCESS``.

Columns (one row per interaction):

| column | type | what |
|---|---|---|
| ``user_id`` | int64 | 1 .. users, consecutive across shards; each user's rows are together, in one shard |
| ``item_id`` | int64 | 1 .. M; Zipf popularity (exponent 1.1) over a random permutation of the ids |
| ``rating`` | float32 | 1 .. 5, whole numbers; about 48% are >= 4 |
| ``timestamp`` | int64 | Unix seconds, increasing along each user's history (first ones 2015 .. 2023, then a personal pace of minutes to days) |
| ``age`` | string | per user, 7 buckets (MovieLens': ``under-18``, ``18-24``, ... ``56+``) |
| ``gender`` | string | per user, ``F`` / ``M`` |
| ``category`` | string | per item, 30 values ``cat00`` .. ``cat29`` |
| ``tags`` | string | per item, 1-3 distinct tags of 50 joined by ``|`` (``tag07|tag31``) |

The strings are written as dictionary-encoded Parquet columns (no per-row string is ever
built) and read back as plain strings (pyarrow ``string``, DuckDB ``VARCHAR``).

How a rating is drawn: ``score = user bias + item bias + affinity + noise``, cut at fixed
quantiles into 1..5 (6% 1, 11% 2, 35% 3, 30% 4, 18% 5). The item bias grows with popularity;
the affinity is low-rank (rank 8): a user's taste vector (partly given by age and gender)
dotted with the item's category vector, so features and history both carry signal.
Each user has 13-100 interactions (uniform), a start time and a personal pace.

Determinism: the log depends only on (N, seed, M); the number of shards only moves the
file boundaries (the rows, in order, are the same for any ``--shards``), and the files are
byte-identical for the same (N, seed, M, shards). Users are generated in fixed blocks of
``USERS_PER_BLOCK``, each from its own seeded stream, so memory is bounded by one block
(about 0.9M rows) plus the item tables (about 13 bytes per item), whatever N is.

(user, item) pairs may repeat within a user (a popular item can be drawn twice), as in
re-consumption logs; nothing downstream assumes they are unique.
"""
from __future__ import annotations

import os
import shutil
import time
from itertools import combinations
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MIN_LEN, MAX_LEN = 13, 100
USERS_PER_BLOCK = 16_384
ZIPF_EXPONENT = 1.1
RANK = 8
AGES = ("under-18", "18-24", "25-34", "35-44", "45-49", "50-55", "56+")
AGE_P = (0.04, 0.18, 0.35, 0.20, 0.09, 0.08, 0.06)
GENDERS = ("F", "M")
N_CATEGORIES, N_TAGS = 30, 50
# Cumulative share of ratings 1, 2, 3, 4 (the rest are 5): P(rating >= 4) = 0.48.
RATING_CDF = (0.06, 0.17, 0.52, 0.82)
T_START, T_END = 1_420_070_400, 1_672_531_200  # 2015-01-01 .. 2023-01-01 (first interactions)
# Measured on disk (snappy): 11.6 bytes a row at 10M, 11.9 at 100M; the free-space check asks for 14.
BYTES_PER_ROW_ESTIMATE = 14
SCHEMA_FILE = "_schema.yaml"
DATA_SCHEMA = {"task_key": "user_id", "item_key": "item_id", "label": "rating", "timestamp": "timestamp",
               "user_features": ["age", "gender"], "item_features": ["category"], "multi_hot": {"tags": "|"}}
ARROW_SCHEMA = pa.schema([("user_id", pa.int64()), ("item_id", pa.int64()), ("rating", pa.float32()),
                          ("timestamp", pa.int64()), ("age", pa.dictionary(pa.int8(), pa.string())),
                          ("gender", pa.dictionary(pa.int8(), pa.string())),
                          ("category", pa.dictionary(pa.int8(), pa.string())),
                          ("tags", pa.dictionary(pa.int32(), pa.string()))])

_LENS_KEY, _ITEMS_KEY, _BLOCK_KEY, _PILOT_KEY = 0, 1, 2, 3


class NotEnoughDisk(OSError):
    """The free space where the log would go is below the estimate of its size (nothing written)."""


def default_items(interactions: int) -> int:
    return max(1000, interactions // 100)


def user_lengths(interactions: int, seed: int) -> np.ndarray:
    """Interactions per user (13..100 each) summing to exactly ``interactions`` (>= 13)."""
    if interactions < MIN_LEN:
        raise ValueError(f"interactions: {interactions} is fewer than one user's minimum of {MIN_LEN}")
    rng = np.random.default_rng([seed, _LENS_KEY])
    mean = (MIN_LEN + MAX_LEN) / 2
    lens = rng.integers(MIN_LEN, MAX_LEN + 1, size=int(interactions / mean * 1.05) + 16).astype(np.int16)
    while int(lens.sum(dtype=np.int64)) < interactions:
        lens = np.concatenate([lens, rng.integers(MIN_LEN, MAX_LEN + 1, size=len(lens) // 8 + 16).astype(np.int16)])
    lens = lens[:int(np.searchsorted(np.cumsum(lens, dtype=np.int64), interactions, side="right"))]
    rest = interactions - int(lens.sum(dtype=np.int64))  # 0 <= rest < MAX_LEN
    if rest >= MIN_LEN:
        return np.concatenate([lens, np.array([rest], np.int16)])
    for i in range(len(lens) - 1, -1, -1):  # the last users with room take the rest (< 13 rows)
        if not rest:
            break
        add = min(rest, MAX_LEN - int(lens[i]))
        lens[i] += add
        rest -= add
    if rest:  # every user is full (100): the last one and the rest become two users
        total = int(lens[-1]) + rest
        lens = np.concatenate([lens[:-1], np.array([total // 2, total - total // 2], np.int16)])
    return lens


class _Items:
    """Per-item tables, indexed by popularity rank (0 = most popular)."""

    def __init__(self, n_items: int, seed: int):
        rng = np.random.default_rng([seed, _ITEMS_KEY])
        self.n = n_items
        self.ids = (rng.permutation(n_items) + 1).astype(np.int64)        # rank -> item_id
        self.category = rng.integers(0, N_CATEGORIES, n_items).astype(np.int8)
        combos = ["|".join(f"tag{t:02d}" for t in c)
                  for k in (1, 2, 3) for c in combinations(range(N_TAGS), k)]
        sizes = np.array([len(list(combinations(range(N_TAGS), k))) for k in (1, 2, 3)])
        k = rng.integers(0, 3, n_items)                                 # 1, 2 or 3 tags, uniform
        start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self.tags = (start[k] + (rng.random(n_items) * sizes[k]).astype(np.int64)).astype(np.int32)
        self.tag_names = pa.array(combos, pa.string())
        logpop = -np.log1p(np.arange(n_items))
        z = (logpop - logpop.mean()) / (logpop.std() or 1.0)
        self.bias = (0.35 * z + 0.3 * rng.standard_normal(n_items)).astype(np.float32)
        self.cat_factors = rng.standard_normal((N_CATEGORIES, RANK)).astype(np.float32)
        self.age_factors = 0.6 * rng.standard_normal((len(AGES), RANK)).astype(np.float32)
        self.gender_factors = 0.6 * rng.standard_normal((len(GENDERS), RANK)).astype(np.float32)
        # Zipf over ranks 1..n: exact for the head, the continuous inverse CDF for the tail.
        s, head = ZIPF_EXPONENT, min(n_items, 256)
        w = np.arange(1, head + 1, dtype=np.float64) ** -s
        self._head_cdf = np.cumsum(w)
        a, b = head + 0.5, n_items + 0.5
        self._a1s = a ** (1 - s)
        tail = (self._a1s - b ** (1 - s)) / (s - 1) if n_items > head else 0.0
        self._total = self._head_cdf[-1] + tail

    def draw_ranks(self, rng: np.random.Generator, n: int) -> np.ndarray:
        u = rng.random(n) * self._total
        ranks = np.searchsorted(self._head_cdf, u, side="right")  # 0-based; == head in the tail
        tail = ranks >= len(self._head_cdf)
        if tail.any():
            s = ZIPF_EXPONENT
            v = u[tail] - self._head_cdf[-1]
            x = np.maximum(self._a1s - v * (s - 1), 1e-300) ** (1 / (1 - s))
            ranks[tail] = np.clip(np.rint(x).astype(np.int64) - 1, len(self._head_cdf), self.n - 1)
        return ranks


def _block(items: _Items, lens: np.ndarray, rng: np.random.Generator, thresholds: np.ndarray | None):
    """Rows of consecutive users with ``lens`` interactions: (columns, scores)."""
    nu = len(lens)
    n = int(lens.sum(dtype=np.int64))
    owner = np.repeat(np.arange(nu, dtype=np.int32), lens)
    age = rng.choice(len(AGES), nu, p=AGE_P).astype(np.int8)
    gender = (rng.random(nu) < 0.5).astype(np.int8)
    taste = items.age_factors[age] + items.gender_factors[gender] + 0.8 * rng.standard_normal((nu, RANK), np.float32)
    affinity = (taste @ items.cat_factors.T) * np.float32(0.8 / np.sqrt(RANK))   # (users, categories)
    user_bias = 0.5 * rng.standard_normal(nu, np.float32)
    ranks = items.draw_ranks(rng, n)
    cat = items.category[ranks]
    score = (user_bias[owner] + items.bias[ranks]
             + affinity.ravel()[owner.astype(np.int64) * N_CATEGORIES + cat]
             + 0.6 * rng.standard_normal(n, np.float32))
    if thresholds is None:
        return None, score
    rating = (np.searchsorted(thresholds, score) + 1).astype(np.float32)
    # Time: a start per user, then exponential gaps at a personal pace (median 1 day, <= 7 days).
    start = rng.integers(T_START, T_END, nu)
    pace = np.clip(np.exp(rng.normal(np.log(86_400), 0.8, nu)), 60, 7 * 86_400)
    gaps = (rng.standard_exponential(n, np.float32) * pace[owner]).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(lens[:-1], dtype=np.int64)])
    cum = np.cumsum(gaps)
    ts = cum - (cum[first] - gaps[first])[owner] + start[owner]
    cols = {"owner": owner, "item_id": items.ids[ranks], "rating": rating, "timestamp": ts,
            "age": age[owner], "gender": gender[owner], "category": cat, "tags": items.tags[ranks]}
    return cols, score


def _thresholds(items: _Items, seed: int) -> np.ndarray:
    """Score cut points that give RATING_CDF, from a fixed pilot sample."""
    rng = np.random.default_rng([seed, _PILOT_KEY])
    lens = rng.integers(MIN_LEN, MAX_LEN + 1, 4096).astype(np.int16)
    _, score = _block(items, lens, rng, None)
    return np.quantile(score, RATING_CDF).astype(np.float32)


def _shard_table(cols: dict, first_user: int, lo: int, hi: int, items: _Items) -> pa.Table:
    def dic(codes, names):
        return pa.DictionaryArray.from_arrays(pa.array(codes[lo:hi]), names)
    ages, genders = pa.array(AGES, pa.string()), pa.array(GENDERS, pa.string())
    cats = pa.array([f"cat{c:02d}" for c in range(N_CATEGORIES)], pa.string())
    return pa.Table.from_arrays([
        pa.array(cols["owner"][lo:hi].astype(np.int64) + (first_user + 1)),
        pa.array(cols["item_id"][lo:hi]), pa.array(cols["rating"][lo:hi]), pa.array(cols["timestamp"][lo:hi]),
        dic(cols["age"], ages), dic(cols["gender"], genders), dic(cols["category"], cats),
        dic(cols["tags"], items.tag_names)], schema=ARROW_SCHEMA)


def schema_yaml(out: str | Path) -> str:
    """The ``data:`` block of a run config that reads the log in ``out``."""
    s = DATA_SCHEMA
    return (f"data:\n  source: table\n  path: {Path(out).resolve()}\n  format: parquet\n  schema:\n"
            f"    task_key: {s['task_key']}\n    item_key: {s['item_key']}\n    label: {s['label']}\n"
            f"    timestamp: {s['timestamp']}\n    user_features: [{', '.join(s['user_features'])}]\n"
            f"    item_features: [{', '.join(s['item_features'])}]\n    multi_hot: {{tags: \"|\"}}\n")


def synthesize_log(out: str | Path, interactions: int, shards: int = 1, seed: int = 0,
                   items: int | None = None, overwrite: bool = False) -> dict:
    """Write exactly ``interactions`` rows as ``out/part-*.parquet`` (see the module docstring).

    The files are written into a sibling ``<out>.tmp-<pid>`` and renamed into place at the end,
    so ``out`` is either absent / untouched or complete. Raises FileExistsError if ``out`` is a
    non-empty directory (or a file) and not ``overwrite``, ValueError on bad sizes, NotEnoughDisk
    (an OSError, ENOSPC) if the free space is below an estimate of the output. Returns a summary dict."""
    t0 = time.perf_counter()
    out = Path(out)
    n_items = default_items(interactions) if items is None else int(items)
    parent = _check_request(out, interactions, shards, n_items, overwrite)
    lens = user_lengths(interactions, seed)
    n_users = len(lens)
    cum, bounds = _shard_bounds(lens, interactions, shards)
    item_tables = _Items(n_items, seed)
    thresholds = _thresholds(item_tables, seed)

    tmp = parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_shards(tmp, lens, cum, bounds, seed, item_tables, thresholds)
        (tmp / SCHEMA_FILE).write_text(schema_yaml(out))
        files = sorted(tmp.glob("part-*.parquet"))
        size = sum(f.stat().st_size for f in files)
        _replace_folder(tmp, out, parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    return {"path": str(out), "rows": interactions, "users": n_users, "items": n_items, "shards": shards,
            "files": [str(out / f.name) for f in files], "bytes": size, "mb": size / 2**20,
            "bytes_per_row": size / interactions, "seconds": seconds, "rows_per_s": interactions / seconds,
            "seed": seed}


def _check_request(out: Path, interactions: int, shards: int, n_items: int, overwrite: bool) -> Path:
    """Check the sizes, ``out`` and the free disk before any work; returns ``out``'s parent
    folder (created)."""
    if interactions < MIN_LEN:
        raise ValueError(f"--interactions {interactions}: must be >= {MIN_LEN} (one user's minimum)")
    if shards < 1:
        raise ValueError(f"--shards {shards}: must be >= 1")
    if n_items < 1:
        raise ValueError(f"--items {n_items}: must be >= 1")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {str(out)!r} exists and is a file; expected a directory to create")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"--out {str(out)!r} exists and is not empty; pass --overwrite to replace it")
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    need, free = interactions * BYTES_PER_ROW_ESTIMATE, shutil.disk_usage(parent).free
    if need > free:
        raise NotEnoughDisk(28, f"not enough free disk for {interactions:,} rows in {str(out)!r}: about "
                          f"{need / 2**20:,.0f} MB needed, {free / 2**20:,.0f} MB free", str(parent))
    return parent


def _shard_bounds(lens: np.ndarray, interactions: int, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(cumulative rows per user, shard bounds): shard k holds users [bounds[k], bounds[k+1]),
    about interactions/shards rows each, and at least one user."""
    n_users = len(lens)
    if shards > n_users:
        raise ValueError(f"--shards {shards}: more than the {n_users} users of {interactions} interactions "
                         "(each shard holds whole users)")
    cum = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    bounds = np.searchsorted(cum, np.arange(shards + 1) * interactions / shards, side="left")
    bounds[0], bounds[-1] = 0, n_users
    bounds = np.maximum.accumulate(bounds)
    for k in range(1, shards):  # every shard gets at least one user
        bounds[k] = min(max(bounds[k], bounds[k - 1] + 1), n_users - (shards - k))
    return cum, bounds


def _write_shards(tmp: Path, lens: np.ndarray, cum: np.ndarray, bounds: np.ndarray, seed: int,
                  item_tables: _Items, thresholds: np.ndarray) -> None:
    """Draw the users block by block (seeded per block, so the rows do not depend on the
    shard count) and write them into ``tmp/part-*.parquet``, cut at the shard bounds."""
    n_users = len(lens)
    shard, writer, open_shard = 0, None, -1
    for b0 in range(0, n_users, USERS_PER_BLOCK):
        b1 = min(b0 + USERS_PER_BLOCK, n_users)
        rng = np.random.default_rng([seed, _BLOCK_KEY, b0 // USERS_PER_BLOCK])
        cols, _ = _block(item_tables, lens[b0:b1], rng, thresholds)
        u = b0
        while u < b1:  # this block's users, cut at shard boundaries
            while bounds[shard + 1] <= u:
                shard += 1
            if open_shard != shard:
                if writer is not None:
                    writer.close()
                writer = pq.ParquetWriter(tmp / f"part-{shard:05d}.parquet", ARROW_SCHEMA,
                                          compression="snappy", store_schema=False)
                open_shard = shard
            end = min(b1, int(bounds[shard + 1]))
            lo, hi = int(cum[u] - cum[b0]), int(cum[end] - cum[b0])
            writer.write_table(_shard_table(cols, b0, lo, hi, item_tables), row_group_size=hi - lo)
            u = end
        del cols
    writer.close()


def _replace_folder(tmp: Path, out: Path, parent: Path) -> None:
    """Rename the finished ``tmp`` folder to ``out``, replacing an old ``out`` (moved aside
    first, then removed) or an empty one."""
    if out.exists():
        if any(out.iterdir()):  # overwrite: move the old one aside, then drop it
            old = parent / f"{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            out.rmdir()
            tmp.rename(out)
    else:
        tmp.rename(out)
