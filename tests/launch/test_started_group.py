"""``gm.initialize`` and ``gmeta_ds.cli.main`` on a process group that is already up (the
user's own ``init_process_group``, Accelerate's ``Accelerator()``, a test harness): the group
gives the ranks and the world size, nothing starts a second one or ends it, and a batch key
that fits another world size is named with where the world size came from. On warm ranks of the test pool (a `call`
job runs between the pool's own gloo ``init_process_group`` and a barrier); ~2-4 s a job on
2 shared cores."""
from __future__ import annotations

import json

import pytest
from conftest import REPO, assert_same_model, script_ranks, summary, tiny_config
from pool import pool

pytestmark = [pytest.mark.launcher]

JOB = REPO / "tests" / "launch" / "started_group_jobs.py"


def _call(function: str, *args, world: int = 2):
    result = pool().run({"kind": "call", "module": "launch.started_group_jobs", "function": function,
                         "args": [str(a) for a in args]}, world, cwd=REPO, label=f"started_group_jobs.{function}")
    assert result.codes == [0] * world, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def _records(folder, world: int = 2) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


# torch's group only (a harness: was "the process group has 2 ranks but WORLD_SIZE said 1"), and
# DeepSpeed's communication started on it too (Accelerate's DeepSpeed plugin: was DeepSpeed's
# "4 != 4 * 1 * 2", its config parser reading the group's world size against keys for one rank).
@pytest.mark.parametrize("deepspeed_comm", ["", "yes"], ids=["torch", "deepspeed"])
def test_initialize_on_a_started_group_trains_as_the_script_does(tmp_path, deepspeed_comm):
    started, script = tmp_path / "started", tmp_path / "script"
    started.mkdir()
    script.mkdir()
    result = _call("train_on_started_group", started, deepspeed_comm)
    script_ranks(2, JOB, script, cwd=tmp_path)
    on_group, on_launch = _records(started), _records(script)
    assert [r["world"] for r in on_group] == [2, 2]  # from the group: no launcher variable was left
    # The same losses on every rank and the same model as gm.initialize starting the group itself.
    assert [r["losses"] for r in on_group] == [r["losses"] for r in on_launch]
    assert on_group[0]["checksums"] == pytest.approx(on_launch[0]["checksums"], rel=1e-6)
    # The group's rank 0 says the threads once, its 2 ranks sharing this host's cores (the
    # environment no longer names the ranks on this host nor tells them apart).
    assert "/ 2 rank(s) on this host" in result.rank_stderr[0], result.rank_stderr[0][-2000:]
    assert "gmeta_ds.initialize:" not in result.rank_stderr[1]


def test_a_batch_key_for_one_rank_on_a_started_two_rank_group_names_the_group(tmp_path):
    _call("batch_for_one_rank", tmp_path)
    for rank in range(2):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert ("meta.tasks_per_meta_step (8) must be a multiple of meta.tasks_per_micro_batch (8) x world "
                "size (2) = 16") in message
        assert "W from the existing process group" in message
        assert "set deepspeed.train_batch_size to a multiple of 16" in message


def test_gmeta_ds_train_called_on_a_started_group_trains_on_it_and_leaves_it_up(tmp_path, reference_run):
    # gmeta_ds.cli.main in a script that started a group and DeepSpeed's communication (no
    # launcher variables): was DeepSpeed's "4 != 4 * 1 * 2" (after the world from WORLD_SIZE:
    # "process group has 2 ranks but WORLD_SIZE said 1"), and the group torn down.
    config = tiny_config(tmp_path)
    _call("cli_train_on_started_group", config)
    two = summary(config)
    assert two["world_size"] == 2
    assert_same_model(reference_run, two)  # the same global tasks per meta-step as one process
