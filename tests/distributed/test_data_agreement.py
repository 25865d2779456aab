"""Ranks agree on the tasks they read (`workloads.base.check_ranks_read_the_same`), on 2 gloo
ranks of the warm pool: stores of the same content in different folders (another cache key:
per-host copies of a log with other modification times) pass; a log rewritten between the
ranks' builds fails on every rank with one message naming data.path and each rank's store.
Cost: ~1 s on warm ranks."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch.distributed as dist

from distributed.ranks import run_ranks
from gmeta_ds.config import config_from_dict
from gmeta_ds.data.builder import build_tasks
from gmeta_ds.data.readers import DataError
from gmeta_ds.workloads.base import check_ranks_read_the_same

pytestmark = [pytest.mark.distributed]


def write_log(path: Path, flip: bool = False) -> None:
    rng = np.random.default_rng(3)
    user = np.repeat(np.arange(30), 12)
    rating = rng.integers(1, 6, len(user)).astype(np.float32)
    pd.DataFrame({"user": user, "item": rng.integers(0, 50, len(user)),
                  "rating": 6 - rating if flip else rating}).to_parquet(path)


def run_config(path: Path, cache: Path):
    return config_from_dict({"data": {
        "source": "table", "path": str(path), "cache_dir": str(cache), "query_size": 4, "min_interactions": 8,
        "schema": {"task_key": "user", "item_key": "item", "label": "rating"}}}, "test")


def stores_compared(folder: str) -> None:
    """Worker: each rank builds its own store; same content passes, a rewrite between the builds fails."""
    rank, root = dist.get_rank(), Path(folder)
    copy = root / f"host{rank}" / "log.parquet"  # a per-host copy: same rows, another mtime
    copy.parent.mkdir()
    write_log(copy)
    os.utime(copy, ns=(10**18 + rank, 10**18 + rank))
    cfg = run_config(copy, root / f"cache{rank}")
    data = build_tasks(cfg.data, seed=0)
    check_ranks_read_the_same(cfg, data)  # another cache key, the same tasks: no error
    shared = root / "log.parquet"
    for turn in range(2):  # rank 0 builds, then rank 1 rewrites the log and builds
        if turn == rank:
            write_log(shared, flip=rank == 1)
            cfg = run_config(shared, root / "cache")
            data = build_tasks(cfg.data, seed=0)
        dist.barrier()
    with pytest.raises(DataError) as err:
        check_ranks_read_the_same(cfg, data)
    text = str(err.value)
    assert text.startswith(f"data.path {shared}: the ranks read different data (rank 0: task store tasks-"), text
    assert "; rank 1: task store tasks-" in text and "train again once the writes are done" in text, text
    assert data.store.name in text and "\n" not in text


def test_ranks_pass_with_the_same_tasks_and_fail_alike_on_a_log_rewritten_between_their_builds(tmp_path):
    run_ranks("stores_compared", 2, str(tmp_path), module="distributed.test_data_agreement")
