"""The bring-your-own-model example (examples/custom_model/train.py, written only against the
public API): one plain process and two ranks under the deepspeed launcher train the same
weights and print the same cold-start AUC. The other runs of the script use warm ranks of the
test pool (tests/pool.py)."""
from __future__ import annotations

import re

import pytest
from conftest import REPO, deepspeed_cmd, run, script_ranks
from safetensors.torch import load_file

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]

SCRIPT = str(REPO / "examples" / "custom_model" / "train.py")


def _auc(out: str) -> tuple[float, float]:
    found = re.search(r"cold-start AUC on \d+ new users: ([\d.]+) adapted, ([\d.]+) without", out)
    assert found, out[-3000:]
    return float(found[1]), float(found[2])


def _assert_same_weights(a_dir, b_dir) -> None:
    a = load_file(str(a_dir / "model.safetensors"))
    b = load_file(str(b_dir / "model.safetensors"))
    assert set(a) == set(b)
    # the sharded tables come back under the unsharded names, next to the DCN-v2's layers
    assert {"net.embedding.weights.tags", "net.cross.1.weight", "net.head.weight"} <= set(a)
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5 * (a[name].abs().max() + 1e-6), name


def test_custom_model_two_ranks_equal_one_process_and_resume_at_another_world_size(tmp_path):
    """6 meta-steps in one process == 6 on two ranks == 3 on two ranks then 3 more resumed in
    one process (ZeRO-2 partitions converted through DeepSpeed's universal checkpoint, the
    row-wise shards resharded by global id)."""
    one = script_ranks(1, SCRIPT, "--steps", "6", "--out", tmp_path / "one")
    two = run(deepspeed_cmd(2, SCRIPT, "--steps", "6", "--out", str(tmp_path / "two")))
    _assert_same_weights(tmp_path / "one", tmp_path / "two")
    assert _auc(one.stdout) == pytest.approx(_auc(two.stdout), abs=1e-4)
    script_ranks(2, SCRIPT, "--steps", "3", "--out", tmp_path / "split")
    assert (tmp_path / "split" / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    resumed = script_ranks(1, SCRIPT, "--steps", "6", "--resume", "--out", tmp_path / "split")
    _assert_same_weights(tmp_path / "one", tmp_path / "split")
    assert _auc(one.stdout) == pytest.approx(_auc(resumed.stdout), abs=1e-4)
