"""``model.item_popularity`` on 2 ranks through the real ``deepspeed`` launcher: sharded and
replicated tables train the same model as one process (the counts come from the training
tasks every rank builds alike), and ``gmeta-ds eval`` of the saved weights (counts included)
gives the run's own evaluation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import assert_same_model, gmeta_ranks, one_and_two_ranks, summary, tiny_config

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]

POPULARITY = {"model": {"embed_dim": 4, "hidden": [8], "item_popularity": True},
              "meta": {"algorithm": "reptile", "inner_steps": 2, "inner_lr": 0.3,
                       "adapt": ["mlp.*", "popularity.*"], "tasks_per_micro_batch": 4,
                       "tasks_per_meta_step": 8},
              "train": {"meta_steps": 3, "tensorboard": False}}


# The sharded variant in the default run; replicated (the simpler path) in the slow suite.
@pytest.mark.parametrize("sharding", [pytest.param("dense", marks=pytest.mark.slow), "sharded"])
def test_popularity_offset_two_ranks_equal_one_process(tmp_path, sharding):
    sections = {**POPULARITY, "embedding": {"sharding": sharding}}
    one, two = one_and_two_ranks(tmp_path, **sections)
    assert one["config"]["model"]["item_popularity"] is True
    assert_same_model(two, one)


def test_eval_of_saved_weights_uses_the_saved_counts(tmp_path):
    config = tiny_config(tmp_path, **POPULARITY)
    cfg = yaml.safe_load(config.read_text())
    cfg["eval"] = {"enabled": True, "baseline": False, "tasks_per_batch": 8}
    config.write_text(yaml.safe_dump(cfg))
    gmeta_ranks(1, "train", "--config", str(config))
    gmeta_ranks(1, "eval", "--config", str(config))
    out = Path(cfg["output_dir"])
    trained = summary(config)["eval"]
    evaluated = json.loads((out / "eval.json").read_text())
    assert evaluated["auc"] == pytest.approx(trained["auc"], rel=1e-6)
    assert evaluated["auc_no_adapt"] == pytest.approx(trained["auc_no_adapt"], rel=1e-6)
