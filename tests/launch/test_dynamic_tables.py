"""Dynamic tables through the real CLI: a Parquet log with string item ids (no vocabulary),
trained under ``deepspeed --num_gpus 2`` with the item table dynamic, equal to one process;
checkpointed, resumed at world 1, re-evaluated and exported."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import assert_same_model, gmeta_ranks, summary, tiny_config

from gmeta_ds.sparse import string_id

pytestmark = [pytest.mark.launcher]
DYNAMIC = {"item_id": {"kind": "dynamic", "capacity": 500, "admit_after": 1, "eviction": "lru"}}


def _log(path: Path) -> set[str]:
    rng = np.random.default_rng(4)
    rows = []
    for user in range(48):
        for _ in range(int(rng.integers(14, 26))):
            item = int(rng.zipf(1.4)) % 400
            rows.append((user, f"sku-{item:05d}", float(rng.integers(1, 6)), f"c{item % 7}"))
    df = pd.DataFrame(rows, columns=["user_id", "item_id", "rating", "category"])
    df.to_parquet(path)
    return set(df["item_id"])


def _config(root: Path, world_tag: str, log: Path, **train) -> Path:
    return tiny_config(root / world_tag, data={
        "source": "table", "path": str(log), "cache_dir": str(root / "cache"), "query_size": 4,
        "min_interactions": 10, "max_interactions": 30, "test_fraction": 0.25,
        "schema": {"task_key": "user_id", "item_key": "item_id", "label": "rating",
                   "item_features": ["category"]}},
        embedding={"sharding": "sharded", "tables": DYNAMIC},
        train={"meta_steps": 4, "log_every": 2, "checkpoint_every": 4, "tensorboard": False, **train},
        eval={"enabled": True, "baseline": False})


def test_dynamic_item_table_on_two_ranks_equals_one_process_and_resumes_at_world_one(tmp_path):
    log = tmp_path / "log.parquet"
    items = _log(log)
    two, one = _config(tmp_path, "w2", log), _config(tmp_path, "w1", log)
    gmeta_ranks(2, "train", "--config", str(two), timeout=400)
    gmeta_ranks(1, "train", "--config", str(one), timeout=400)
    s2, s1 = summary(two), summary(one)
    assert_same_model(s2, s1)  # admit_after 1: every id has its own row at both world sizes
    assert s2["eval"]["auc"] == pytest.approx(s1["eval"]["auc"], abs=1e-6)
    out = Path(yaml.safe_load(two.read_text())["output_dir"])
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    table = record["dynamic_tables"]["item_id"]
    assert table["capacity"] == 1000 and 0 < table["occupancy"] <= 1000 and table["evictions"] == 0
    assert table["admissions"] == table["occupancy"] and 0 < table["hit_rate"] <= 1
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    ids = set(weights["net.embedding.dynamic.item_id.ids"].tolist())
    assert ids and ids <= {string_id(i) for i in items}  # raw (hashed) ids, not vocabulary ids
    assert weights["net.embedding.dynamic.item_id.defaults"].shape == (2, 4)
    assert "net.embedding.weights.category" in weights  # a static table next to it
    # resume the two-rank checkpoint in one process, train on; re-evaluate; export = weights
    resumed = _config(tmp_path, "w2", log, meta_steps=6, resume="auto")
    gmeta_ranks(1, "train", "--config", str(resumed), timeout=400)
    s = summary(resumed)
    assert s["resumed_from"]["world_size"] == 2 and s["meta_steps"] == 6
    proc = gmeta_ranks(1, "eval", "--config", str(resumed), timeout=400)
    assert json.loads(proc.stdout[proc.stdout.index("{"):])["auc"] == pytest.approx(s["eval"]["auc"], abs=1e-9)
    exported = tmp_path / "export.safetensors"
    gmeta_ranks(1, "export", str(out / "checkpoints"), str(exported))
    a, b = load_file(str(exported)), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
