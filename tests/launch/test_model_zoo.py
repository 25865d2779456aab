"""Every zoo model (``model.name``) trains the same model on 2 ranks through the real
``deepspeed`` launcher as in one process, with sharded tables (row-wise, one replicated).
Each model runs a different algorithm so all four are covered; two_tower also adapts item rows."""
from __future__ import annotations

import pytest
from conftest import BIN, assert_same_model, deepspeed_cmd, run, summary, tiny_config

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]

SHARDED = {"sharding": "sharded", "plan": "row_wise", "tables": {"gender": {"plan": "replicated"}}}
CASES = {
    "dcn_v2": ({"cross_layers": 2}, {"algorithm": "maml"}),
    "deepfm": ({}, {"algorithm": "fomaml"}),
    "wide_deep": ({}, {"algorithm": "reptile", "adapt": ["wide.*", "mlp.*"]}),
    "dlrm": ({"bottom_hidden": [4]}, {"algorithm": "metasgd"}),
    "two_tower": ({"tower_hidden": [8, 4]}, {"algorithm": "maml", "adapt": ["user_tower.*", "embedding.item_id"]}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_model_two_ranks_equal_one_process(tmp_path, name):
    model, meta = CASES[name]
    sections = {"model": {"name": name, **model}, "meta": meta, "embedding": SHARDED,
                "train": {"meta_steps": 3, "tensorboard": False}}
    single = tiny_config(tmp_path / "one", **sections)
    run([str(BIN / "gmeta-ds"), "train", "--config", str(single)])
    double = tiny_config(tmp_path / "two", **sections)
    run(deepspeed_cmd(2, str(BIN / "gmeta-ds"), "train", "--config", str(double)))
    one, two = summary(single), summary(double)
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["config"]["model"]["name"] == two["config"]["model"]["name"] == name
    assert_same_model(two, one)
