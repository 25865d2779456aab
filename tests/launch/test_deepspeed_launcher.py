"""2 CPU ranks give the same model as one process, for every shipped DeepSpeed config: ZeRO-0 and
``--module`` under the real ``deepspeed`` launcher, the other configs on warm ranks of the test pool
(tests/pool.py; the launcher is the same for all of them)."""
from __future__ import annotations

import json

import pytest
from conftest import (BIN, REPO, assert_same_model, deepspeed_cmd, gmeta_ranks, leaked_shm, run, summary,
                      tiny_config, trained_once)

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]


# the same paths as cases kept in the default run (zero2_offload: also tests/launch/test_op_builds.py); CI runs these too
SLOW = pytest.mark.slow


@pytest.mark.parametrize("ds_file", ["zero0", "zero1", "zero2", pytest.param("zero2_offload", marks=SLOW), "zero3"])
def test_two_ranks_equal_one_process(tmp_path, reference_run, ds_file):
    """Every shipped fp32 DeepSpeed config (CPU optimizer offload included) trains the same
    model on 2 ranks as one process, and leaves no shared-memory buffer behind."""
    path = tiny_config(tmp_path, deepspeed=str(REPO / "ds_configs" / f"{ds_file}.json"))
    if ds_file == "zero0":  # the deepspeed launcher itself (its ranks exit, their buffers must go)
        cmd = deepspeed_cmd(2, str(BIN / "gmeta-ds"), "train", "--config", str(path))
        port = int(cmd[cmd.index("--master_port") + 1])
        run(cmd)
    else:  # zero2_offload JIT-builds DeepSpeed's CPU Adam on first use
        port = gmeta_ranks(2, "train", "--config", path, timeout=420).port
    result = summary(path)
    assert result["world_size"] == 2 and result["batch"].startswith("4 tasks/micro-batch x 1")
    expected = json.loads((REPO / "ds_configs" / f"{ds_file}.json").read_text())["zero_optimization"]
    assert result["ds_config"]["zero_optimization"] == expected
    assert_same_model(result, reference_run)
    assert leaked_shm(port) == []


@pytest.mark.parametrize("ds_file", [pytest.param("zero0_bf16", marks=SLOW), "zero2_bf16"])
def test_bf16_configs_train_close_to_fp32(tmp_path, reference_run, ds_file):
    """bf16 (DeepSpeed on CPU supports it) trains on 2 ranks; bf16 rounding moves the result a
    little, not far, from the fp32 run."""
    path = tiny_config(tmp_path, deepspeed=str(REPO / "ds_configs" / f"{ds_file}.json"))
    gmeta_ranks(2, "train", "--config", path)
    result = summary(path)
    assert result["ds_config"]["bf16"]["enabled"] is True
    assert result["dense_checksum"] != reference_run["dense_checksum"]  # bf16 really ran
    assert result["final_query_loss"] == pytest.approx(reference_run["final_query_loss"], abs=0.02)
    assert result["dense_checksum"] == pytest.approx(reference_run["dense_checksum"], abs=0.1)


def test_deepspeed_module_form_with_reptile(tmp_path):
    """``deepspeed --module gmeta_ds.cli`` (the launcher inserts --local_rank first)."""
    overrides = {"meta": {"algorithm": "reptile", "tasks_per_micro_batch": 4, "tasks_per_meta_step": 8}}
    one = trained_once(tiny_config(tmp_path / "one", **overrides), 1)
    double = tiny_config(tmp_path / "two", **overrides)
    run(deepspeed_cmd(2, "--module", "gmeta_ds.cli", "train", "--config", str(double)))
    assert_same_model(summary(double), one)


SHARDED = {"sharding": "sharded", "plan": "row_wise",
           "tables": {"gender": {"plan": "replicated"}, "price": {"plan": "table_wise", "optimizer": "adam"},
                      "age": {"optimizer": "rowwise_adagrad"}, "region": {"optimizer": "sgd"}}}


# Item rows adapt per task too (deduplicated rows of the fused lookup, functional/inner.py).
ROW_ADAPT = {"adapt": ["mlp.*", "embedding.item_id"]}


@pytest.fixture(scope="module")
def single_process_sharded(tmp_path_factory):
    return trained_once(tiny_config(tmp_path_factory.mktemp("single_sharded"), embedding=SHARDED, meta=ROW_ADAPT), 1)


@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=SLOW), 2, pytest.param(3, marks=SLOW)])
def test_sharded_tables_two_ranks_equal_one_process(tmp_path, single_process_sharded, stage):
    """Row-wise/table-wise/replicated tables outside DeepSpeed + ZeRO for the dense part,
    with item rows adapted in the inner loop."""
    path = tiny_config(tmp_path, embedding=SHARDED, meta=ROW_ADAPT,
                       deepspeed=str(REPO / "ds_configs" / f"zero{stage}.json"))
    gmeta_ranks(2, "train", "--config", path)
    result = summary(path)
    if stage < 3:
        assert_same_model(result, single_process_sharded)
    else:
        # ZeRO-3 accumulates the row-adapted table's gradient in its fp32 partitions in another
        # order: ~1e-6 relative after 4 meta-steps, on an embedding checksum that is a near-zero
        # signed sum (so compared absolutely).
        assert result["dense_checksum"] == pytest.approx(single_process_sharded["dense_checksum"], rel=1e-5)
        assert result["embedding_checksum"] == pytest.approx(single_process_sharded["embedding_checksum"], abs=1e-5)
        assert result["final_query_loss"] == pytest.approx(single_process_sharded["final_query_loss"], rel=1e-5)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    comm = records[-1]["embedding_comm"]
    assert comm["input_dist"]["collectives"] == 2 * 2 * 1  # counts + ids, 2 steps, 1 micro-batch each
    assert comm["output_dist"]["bytes_sent"] > 0 and comm["output_dist_backward"]["collectives"] == 2
    assert records[-1]["embedding_comm_bytes"] == sum(s["bytes_sent"] for s in comm.values())
