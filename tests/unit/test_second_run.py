"""Two trainings in one process (a notebook, a sweep in one script): the second starts as the
first did. DeepSpeed caches the groups it derives from the world; torch's teardown alone left
them pointing at the destroyed group and the second ``deepspeed.initialize`` failed with
"Group ... is not registered" (`ds_internals.destroy_world`)."""
from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
import yaml

from gmeta_ds.cli import main

REPO = Path(__file__).resolve().parents[2]


def tiny_config(folder: Path) -> Path:
    cfg = {"output_dir": str(folder / "run"), "seed": 3, "model": {"embed_dim": 4, "hidden": [8]},
           "meta": {"tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
           "data": {"synthetic": {"num_users": 60, "num_items": 40, "max_interactions": 25}},
           "train": {"meta_steps": 2, "log_every": 1, "progress": False}, "eval": {"enabled": False},
           "deepspeed": str(REPO / "ds_configs" / "zero0.json")}
    folder.mkdir(parents=True)
    (folder / "c.yaml").write_text(yaml.safe_dump(cfg))
    return folder / "c.yaml"


def test_a_second_training_in_the_same_process_trains_the_same_model(tmp_path):
    first, second = tiny_config(tmp_path / "a"), tiny_config(tmp_path / "b")
    assert main(["train", "--config", str(first)]) == 0
    assert not dist.is_initialized()
    assert main(["train", "--config", str(second)]) == 0
    assert not dist.is_initialized()
    a, b = (json.loads((p.parent / "run" / "summary.json").read_text()) for p in (first, second))
    assert a["dense_checksum"] == b["dense_checksum"] and a["embedding_checksum"] == b["embedding_checksum"]
