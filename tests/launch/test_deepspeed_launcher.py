"""The real ``deepspeed`` launcher with 2 CPU ranks gives the same model as one process."""
from __future__ import annotations

import json

import pytest
from conftest import BIN, REPO, deepspeed_cmd, run, summary, tiny_config

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]


def assert_same_model(a: dict, b: dict) -> None:
    for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    assert a["tasks_seen"] == b["tasks_seen"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    path = tiny_config(tmp_path_factory.mktemp("single"))
    run([str(BIN / "python"), "-m", "gmeta_ds.cli", "train", "--config", str(path)])
    result = summary(path)
    assert result["world_size"] == 1 and result["batch"].startswith("4 tasks/micro-batch x 2")
    return result


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_two_ranks_equal_one_process(tmp_path, single_process, stage):
    path = tiny_config(tmp_path, deepspeed=str(REPO / "ds_configs" / f"zero{stage}.json"))
    run(deepspeed_cmd(2, str(BIN / "gmeta-ds"), "train", "--config", str(path)))
    result = summary(path)
    assert result["world_size"] == 2 and result["batch"].startswith("4 tasks/micro-batch x 1")
    assert result["ds_config"]["zero_optimization"]["stage"] == stage
    assert_same_model(result, single_process)


def test_deepspeed_module_form_with_reptile(tmp_path):
    """``deepspeed --module gmeta_ds.cli`` (the launcher inserts --local_rank first)."""
    overrides = {"meta": {"algorithm": "reptile", "tasks_per_micro_batch": 4, "tasks_per_meta_step": 8}}
    single = tiny_config(tmp_path / "one", **overrides)
    run([str(BIN / "gmeta-ds"), "train", "--config", str(single)])
    double = tiny_config(tmp_path / "two", **overrides)
    run(deepspeed_cmd(2, "--module", "gmeta_ds.cli", "train", "--config", str(double)))
    assert_same_model(summary(double), summary(single))


SHARDED = {"sharding": "sharded", "plan": "row_wise",
           "tables": {"gender": {"plan": "replicated"}, "price": {"plan": "table_wise", "optimizer": "adam"},
                      "age": {"optimizer": "rowwise_adagrad"}, "region": {"optimizer": "sgd"}}}


# Item rows adapt per task too (deduplicated rows of the fused lookup, functional/rows.py).
ROW_ADAPT = {"adapt": ["mlp.*", "embedding.item_id"]}


@pytest.fixture(scope="module")
def single_process_sharded(tmp_path_factory):
    path = tiny_config(tmp_path_factory.mktemp("single_sharded"), embedding=SHARDED, meta=ROW_ADAPT)
    run([str(BIN / "gmeta-ds"), "train", "--config", str(path)])
    return summary(path)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_sharded_tables_two_ranks_equal_one_process(tmp_path, single_process_sharded, stage):
    """Row-wise/table-wise/replicated tables outside DeepSpeed + ZeRO for the dense part,
    with item rows adapted in the inner loop."""
    path = tiny_config(tmp_path, embedding=SHARDED, meta=ROW_ADAPT,
                       deepspeed=str(REPO / "ds_configs" / f"zero{stage}.json"))
    run(deepspeed_cmd(2, str(BIN / "gmeta-ds"), "train", "--config", str(path)))
    result = summary(path)
    assert_same_model(result, single_process_sharded)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    comm = records[-1]["embedding_comm"]
    assert comm["input_dist"]["collectives"] == 2 * 2 * 1  # counts + ids, 2 steps, 1 micro-batch each
    assert comm["output_dist"]["bytes_sent"] > 0 and comm["output_dist_backward"]["collectives"] == 2
    assert records[-1]["embedding_comm_bytes"] == sum(s["bytes_sent"] for s in comm.values())
