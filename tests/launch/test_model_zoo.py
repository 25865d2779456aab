"""Every zoo model (``model.name``) trains the same model on 2 ranks through the real
``deepspeed`` launcher as in one process, with sharded tables (row-wise, one replicated).
Each model runs a different algorithm so all four are covered; two_tower also adapts item rows."""
from __future__ import annotations

import pytest
from conftest import assert_same_model, one_and_two_ranks

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]

SHARDED = {"sharding": "sharded", "plan": "row_wise", "tables": {"gender": {"plan": "replicated"}}}
CASES = {
    "dcn_v2": ({"cross_layers": 2}, {"algorithm": "maml"}),
    "deepfm": ({}, {"algorithm": "fomaml"}),
    "wide_deep": ({}, {"algorithm": "reptile", "adapt": ["wide.*", "mlp.*"]}),
    "dlrm": ({"bottom_hidden": [4]}, {"algorithm": "metasgd"}),
    "two_tower": ({"tower_hidden": [8, 4]}, {"algorithm": "maml", "adapt": ["user_tower.*", "embedding.item_id"]}),
}


# The default run keeps two cases (second-order MAML, and row adaptation); CI's test-slow runs
# the other three (same path, other models and algorithms), to keep `make test` near 20 min.
DEFAULT_RUN = ("dcn_v2", "two_tower")


@pytest.mark.parametrize("name", [n if n in DEFAULT_RUN else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(CASES)])
def test_zoo_model_two_ranks_equal_one_process(tmp_path, name):
    model, meta = CASES[name]
    sections = {"model": {"name": name, **model}, "meta": meta, "embedding": SHARDED,
                "train": {"meta_steps": 3, "tensorboard": False}}
    one, two = one_and_two_ranks(tmp_path, **sections)
    assert one["config"]["model"]["name"] == two["config"]["model"]["name"] == name
    assert_same_model(two, one)
