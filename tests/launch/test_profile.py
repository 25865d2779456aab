"""``train.profile_steps``: the per-phase breakdown of profiled meta-steps, per rank, written
to OUTPUT_DIR/profile.json; profiling changes what is timed, never what is trained."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_same_model, gmeta_ranks, summary, tiny_config

from gmeta_ds.run.profiling import PHASES

pytestmark = [pytest.mark.launcher]


def _train(path: Path, *sets: str, world: int = 1):
    return gmeta_ranks(world, "train", "--config", path, *[a for s in sets for a in ("--set", s)])


def _profile(path: Path) -> dict:
    return json.loads((path.parent / "run" / "profile.json").read_text())


def test_profile_at_world_one_times_every_phase_and_trains_the_same_model(tmp_path, reference_run):
    path = tiny_config(tmp_path, train={"meta_steps": 4, "log_every": 2, "lr": 0.01, "progress": True,
                                        "profile_steps": 2, "profile_warmup": 1})
    proc = _train(path)
    assert_same_model(summary(path), reference_run)
    assert "per-phase time of 2 profiled meta-steps" in proc.stdout
    report = _profile(path)
    assert report["world_size"] == 1 and len(report["ranks"]) == 1
    rank = report["ranks"][0]
    assert rank["steps"] == 2 and rank["step_ms"] > 0
    phases = rank["phases"]
    # 2 micro-batches per meta-step: lookup, forward, backward and step per micro-batch
    # (replicated tables: the lookup is inside the learner, so its region is empty), no sparse
    # step; the non-finite check: each loss, then once the flag of the meta-step
    for name in ("lookup", "inner_loop", "outer_backward", "optimizer_step"):
        assert phases[name]["calls"] == 2, (name, phases[name])
    assert phases["nonfinite_check"]["calls"] == 3
    assert phases["data"]["calls"] == 1 and phases["sparse_step"]["calls"] == 0
    assert set(PHASES) <= set(phases)
    assert sum(p["ms"] for p in phases.values()) <= rank["step_ms"] * 1.001
    assert phases["inner_loop"]["ms"] > 0 and phases["outer_backward"]["ms"] > 0
    assert rank["collectives"] == {}  # one process: no collective at all (ZeRO-0, no_sync)
    records = [json.loads(line) for line in (path.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["cpu_s_per_task"] > 0 for r in records)


@pytest.mark.slow
@pytest.mark.distributed
def test_profile_at_world_two_reports_both_ranks_and_their_collectives(tmp_path):
    path = tiny_config(tmp_path, embedding={"sharding": "sharded", "tables": {"item_id": {"plan": "row_wise"}}},
                       train={"meta_steps": 5, "log_every": 5, "lr": 0.01, "progress": False,
                              "profile_steps": 3, "profile_warmup": 1})
    _train(path, "meta.tasks_per_micro_batch=2", world=2)
    report = _profile(path)
    assert report["world_size"] == 2 and [r["steps"] for r in report["ranks"]] == [3, 3]
    for rank in report["ranks"]:
        phases = rank["phases"]
        for name in ("lookup", "inner_loop", "outer_backward", "optimizer_step"):
            assert phases[name]["calls"] == 2, (name, phases[name])
        assert phases["sparse_step"]["calls"] == 1
        # The lookup's all-to-alls (ids, rows) and the gradients' all-reduce are seen and
        # placed in their phases; the row gradients go back to their owners in the backward.
        assert rank["collectives"]["gloo:all_to_all"]["calls"] > 0
        assert rank["collectives"]["gloo:all_reduce"]["calls"] > 0
        assert phases["lookup"]["collective_ms"] > 0 and phases["outer_backward"]["collective_ms"] > 0
    assert summary(path)["world_size"] == 2


def test_bad_profile_settings_are_config_errors(tmp_path):
    path = tiny_config(tmp_path)
    proc = gmeta_ranks(1, "train", "--config", str(path), "--set", "train.profile_steps=-1",
                "--set", "train.profile_warmup=x", expect_ok=False)
    assert proc.returncode == 2
    assert "train.profile_steps: -1 must be an integer >= 0" in proc.stderr
    assert "train.profile_warmup" in proc.stderr and "Traceback" not in proc.stderr
