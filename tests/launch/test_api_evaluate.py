"""`MetaEngine.evaluate` of a user's script on real ranks (the warm pool, gloo): the held-out
users split over the ranks and gathered once give every rank the same result, the curves and
baselines included, equal to one process's (float rounding of the training aside), and
``out=DIR`` writes one run folder (rank 0) with the world's summary.json and per_user.csv as
`gmeta-ds train` does (gmeta_ds/evaluation/held_out.py). About 10 s on 2 warm ranks."""
from __future__ import annotations

import json

import pytest
from conftest import script_ranks

SCRIPT = '''
import json, sys
import numpy as np, torch
from torch import nn
import gmeta_ds as gm

class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.row_fields = ["city", "item"]
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, rows):
        return self.head(torch.relu(self.body(rows.flatten(start_dim=-2)))).squeeze(-1)

out = sys.argv[1]
rng = np.random.default_rng(0)
users = np.repeat(np.arange(40), 16)  # 40 users of 16 interactions, as a dict of columns
columns = {"user": users, "city": users % 3, "item": rng.integers(0, 15, users.size),
           "click": (rng.random(users.size) < 0.4).astype(float)}
data = gm.build_tasks(columns, task_key="user", item_key="item", label="click", user_features=["city"],
                      label_kind="binary", threshold=0.5, query_size=4, seed=0)
torch.manual_seed(0)
learner = gm.meta_learner(Tower(), "maml", inner_steps=1, inner_lr=0.1, adapt=["head.*"])
engine = gm.initialize(learner, tables=gm.tables_for(data.fields, 4), tasks_per_micro_batch=4,
                       tasks_per_meta_step=8, lr=1e-2, seed=0)
for step in range(2):
    engine.meta_step(engine.batches(data.train, step))
scores = engine.evaluate(data.test, baselines=["non_meta", "popularity"], train=data.train, few_shot=[1],
                         steps_curve=[0, 1], bootstrap_resamples=20, out=out)
with open(f"{out}-rank{engine.rank}.json", "w") as f:
    json.dump(scores, f, sort_keys=True)
'''


def test_two_ranks_evaluate_alike_and_write_one_run_folder(tmp_path):
    (tmp_path / "evaluate_mine.py").write_text(SCRIPT)
    script_ranks(1, "evaluate_mine.py", "w1", cwd=tmp_path)
    script_ranks(2, "evaluate_mine.py", "w2", cwd=tmp_path)
    one = json.loads((tmp_path / "w1-rank0.json").read_text())
    two = [json.loads((tmp_path / f"w2-rank{r}.json").read_text()) for r in (0, 1)]
    assert two[0] == two[1]  # every rank returns the same dict
    for key in ("auc", "auc_per_task", "baseline_auc", "baseline_popularity_auc"):
        assert two[0][key] == pytest.approx(one[key], abs=1e-6), key
    assert two[0]["few_shot"]["support"] == [1, "all"] and two[0]["inner_steps_curve"]["inner_steps"] == [0, 1]
    summary = json.loads((tmp_path / "w2" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["meta_steps"] == 2 and summary["tasks_seen"] == 16
    assert summary["eval"] == two[0]
    rows = (tmp_path / "w2" / "per_user.csv").read_text().splitlines()
    assert rows[0].startswith("task,query_rows,meta_auc,meta_no_adapt_auc") and len(rows) == two[0]["tasks"] + 1
    assert sorted(p.name for p in (tmp_path / "w2").iterdir()) == ["per_user.csv", "summary.json"]
