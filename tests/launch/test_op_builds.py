"""A first run on a fresh machine compiles no DeepSpeed op unless its config needs one: Adam
without optimizer offload is torch's AdamW handed to DeepSpeed (`ds_engine.with_torch_adam`),
not DeepSpeed's JIT-built FusedAdam; offload keeps DeepSpeed's CPU Adam."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import BIN, REPO, run, summary, tiny_config

pytestmark = [pytest.mark.launcher]

# The public API on a tiny log: one meta-step, then the classes of the engine's optimizer
# (the ZeRO / bf16 wrapper) and of the optimizer it wraps.
API_SCRIPT = """
import json, sys
import numpy as np, pandas as pd, torch
from torch import nn
import gmeta_ds as gm

rng = np.random.default_rng(0)
log = pd.DataFrame([(f"u{u}", f"i{i}", float(rng.random() < 0.4)) for u in range(24)
                    for i in rng.choice(30, size=16, replace=False)], columns=["user", "item", "click"])
data = gm.build_tasks(log, task_key="user", item_key="item", label="click", label_kind="binary",
                      threshold=0.5, query_size=4, seed=0)

class Tower(nn.Module):
    row_fields = [f.name for f in gm.single_fields(data.fields)]
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(4 * len(data.fields), 8), nn.Linear(8, 1)
    def forward(self, rows):
        return self.head(torch.relu(self.body(rows.flatten(start_dim=-2)))).squeeze(-1)

torch.manual_seed(0)
learner = gm.meta_learner(Tower(), "maml", inner_steps=1, adapt=["head.*"])
engine = gm.initialize(learner, sys.argv[1], tables=gm.tables_for(data.fields, 4),
                       tasks_per_micro_batch=4, tasks_per_meta_step=4, lr=1e-2)
engine.meta_step(engine.batches(data.train, 0))
outer = engine.engine.optimizer
inner = getattr(outer, "optimizer", outer)
print("RESULT", json.dumps({"outer": type(outer).__module__ + "." + type(outer).__name__,
                            "inner": type(inner).__module__ + "." + type(inner).__name__,
                            "torch": isinstance(inner, torch.optim.Optimizer)}))
"""


def _built(extensions: Path) -> list[str]:
    """What DeepSpeed's JIT builds left in TORCH_EXTENSIONS_DIR (nothing at all expected)."""
    return sorted(str(p.relative_to(extensions)) for p in extensions.rglob("*"))


@pytest.mark.parametrize("ds_file", ["zero0", "zero3", "zero0_bf16"])
def test_a_run_without_offload_builds_no_deepspeed_op_and_steps_torchs_adamw(tmp_path, ds_file):
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    script = tmp_path / "one_step.py"
    script.write_text(API_SCRIPT)
    proc = run([str(BIN / "python"), str(script), str(REPO / "ds_configs" / f"{ds_file}.json")],
               env={"TORCH_EXTENSIONS_DIR": str(extensions), "CUDA_VISIBLE_DEVICES": ""}, cwd=tmp_path)
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["torch"] and result["inner"] == "torch.optim.adamw.AdamW", result
    assert _built(extensions) == [], "DeepSpeed JIT-built an op"


def test_gmeta_ds_train_on_zero2_builds_no_deepspeed_op(tmp_path):
    """The CLI path (trainer), ZeRO-2 as in the demo: nothing lands in TORCH_EXTENSIONS_DIR."""
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    config = tiny_config(tmp_path, deepspeed=str(REPO / "ds_configs" / "zero2.json"),
                         train={"meta_steps": 2})
    run([str(BIN / "gmeta-ds"), "train", "--config", str(config)],
        env={"TORCH_EXTENSIONS_DIR": str(extensions), "CUDA_VISIBLE_DEVICES": ""})
    assert summary(config)["meta_steps"] == 2
    assert _built(extensions) == [], "DeepSpeed JIT-built an op"


def _ds(name: str) -> dict:
    return json.loads((REPO / "ds_configs" / f"{name}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("ds_file", ["zero0", "zero0_bf16"])
def test_a_zero0_checkpoint_written_by_fused_adam_resumes_exactly(tmp_path, ds_file):
    """A checkpoint of gmeta_ds before torch's Adam became the default (FusedAdam, built on
    first use: slow on a fresh machine) resumes exactly: 3 + 3 meta-steps == 6."""
    ds = _ds(ds_file)
    ds["optimizer"]["params"]["torch_adam"] = False
    (tmp_path / "fused.json").write_text(json.dumps(ds))
    train = {"log_every": 1, "checkpoint_every": 3, "lr": 0.01}
    fused = str(tmp_path / "fused.json")
    full = tiny_config(tmp_path / "full", deepspeed=fused, train={**train, "meta_steps": 6})
    run([str(BIN / "gmeta-ds"), "train", "--config", str(full)], timeout=600)
    part = tiny_config(tmp_path / "part", deepspeed=fused, train={**train, "meta_steps": 3})
    run([str(BIN / "gmeta-ds"), "train", "--config", str(part)], timeout=600)
    default = str(REPO / "ds_configs" / f"{ds_file}.json")
    run([str(BIN / "gmeta-ds"), "train", "--config", str(part), "--set", "train.meta_steps=6",
         "--set", "train.resume=auto", "--set", f"deepspeed={default}"], timeout=600)
    resumed, uninterrupted = summary(part), summary(full)
    assert resumed["resumed_from"]["step"] == 3 and resumed["resumed_from"]["optimizer_restored"]
    for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-6), key
