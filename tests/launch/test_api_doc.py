"""docs/api.md runs as written: its complete example (one process and two ranks, on warm ranks
of the test pool; a user's script under the real deepspeed launcher: test_custom_model) and its
registration example."""
from __future__ import annotations

import re

import pytest
from conftest import BIN, REPO, run, script_ranks

pytestmark = [pytest.mark.launcher]

DOC = REPO / "docs" / "api.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_complete_example_runs_on_one_and_two_ranks(tmp_path):
    (tmp_path / "train_mine.py").write_text(_blocks()[0])
    one = script_ranks(1, "train_mine.py", cwd=tmp_path)
    two = script_ranks(2, "train_mine.py", cwd=tmp_path)
    aucs = [re.search(r"AUC ([\d.]+) adapted, ([\d.]+) without adaptation", p.stdout) for p in (one, two)]
    assert all(aucs), one.stdout[-2000:] + two.stdout[-2000:]
    assert aucs[0].groups() == aucs[1].groups()
    assert (tmp_path / "runs" / "mine" / "checkpoints" / "step_00000020" / "manifest.json").is_file()
    # The baselines and the saved model read back (its tables gathered from 2 ranks' shards)
    # give the same numbers on 1 and 2 ranks; a value outside the vocabulary still scores.
    for pattern in (r"baselines: non-meta ([\d.]+), popularity ([\d.]+)", r"logits \[(-?[\d.]+), (-?[\d.]+)\]"):
        found = [re.search(pattern, p.stdout) for p in (one, two)]
        assert all(found), (pattern, one.stdout[-2000:])
        assert found[0].groups() == found[1].groups(), pattern
    assert sorted(p.name for p in (tmp_path / "runs" / "mine" / "model").iterdir()) == [
        "model.json", "model.json.sha256", "model.safetensors", "vocab.safetensors"]


def test_the_registration_example_makes_a_new_algorithm_name_valid(tmp_path):
    script = _blocks()[1] + """
from gmeta_ds.config import config_from_dict
cfg = config_from_dict({"meta": {"algorithm": "maml_clipped", "inner_lr": 0.5}})
from torch import nn
learner = gm.meta_learner(nn.Sequential(nn.Linear(4, 1)), "maml_clipped", inner_lr=0.5, adapt=["0.*"])
print("rates", sorted(set(learner.learning_rates().values())))
"""
    (tmp_path / "register.py").write_text(script)
    out = run([str(BIN / "python"), "register.py"], cwd=tmp_path).stdout
    assert "rates [0.05]" in out
