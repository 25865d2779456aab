"""Which DeepSpeed configs train with torch's AdamW instead of a JIT-built DeepSpeed Adam
(`ds_engine.with_torch_adam`); the builds themselves are checked in tests/launch/test_op_builds.py."""
from __future__ import annotations

import json
from pathlib import Path

from gmeta_ds.engine.ds_engine import with_torch_adam

REPO = Path(__file__).resolve().parents[2]


def _ds(name: str) -> dict:
    return json.loads((REPO / "ds_configs" / f"{name}.json").read_text())


def test_which_configs_get_torchs_adam():
    for name in ("zero0", "zero1", "zero2", "zero3", "zero0_bf16", "zero2_bf16", "zero3_bf16"):
        ds = _ds(name)
        assert with_torch_adam(ds)["optimizer"]["params"]["torch_adam"] is True, name
        assert "torch_adam" not in ds["optimizer"]["params"], "the input must stay as it was"
    offload = _ds("zero2_offload")
    assert with_torch_adam(offload) == offload  # DeepSpeed's CPU Adam (cpu_adam op) stays
    legacy = {**_ds("zero2"), "zero_optimization": {"stage": 2, "cpu_offload": True}}
    assert with_torch_adam(legacy) == legacy
    for params in ({"lr": 0.1, "torch_adam": False},  # asks for FusedAdam
                   {"lr": 0.1, "bias_correction": False}):  # no torch equivalent
        ds = {**_ds("zero2"), "optimizer": {"type": "Adam", "params": params}}
        assert with_torch_adam(ds) == ds
    sgd = {**_ds("zero2"), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    assert with_torch_adam(sgd) == sgd
    adamw = {**_ds("zero2"), "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.01}}}
    params = with_torch_adam(adamw)["optimizer"]["params"]
    assert params == {"lr": 0.1, "weight_decay": 0.01, "torch_adam": True, "fused": True}
    for chosen in ({"fused": False}, {"foreach": True}):  # the user's choice of kernel stays
        ds = {**_ds("zero2"), "optimizer": {"type": "AdamW", "params": {"lr": 0.1, **chosen}}}
        assert with_torch_adam(ds)["optimizer"]["params"] == {"lr": 0.1, **chosen, "torch_adam": True}


_FUSED_CHECK = """
import json, sys, torch, deepspeed
from torch import nn
from gmeta_ds.engine import ds_engine
from gmeta_ds.engine.dist import destroy_process_group, init_process_group
torch.manual_seed(0)
net, ref = nn.Linear(6, 3), nn.Linear(6, 3)
ref.load_state_dict(net.state_dict())
ds = json.loads(sys.argv[1])
init_process_group(60)
engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                  config=ds_engine.with_torch_adam(ds))
assert isinstance(engine.optimizer, torch.optim.AdamW), type(engine.optimizer)
assert engine.optimizer.defaults["fused"] is True, engine.optimizer.defaults
opt = torch.optim.AdamW(ref.parameters(), lr=0.1, eps=1e-8)  # weight_decay 0.01 as DeepSpeed
x = torch.randn(4, 6)
for _ in range(3):
    engine.backward(engine(x).square().mean())
    engine.step()
    opt.zero_grad()
    ref(x).square().mean().backward()
    opt.step()
for a, b in zip(engine.module.parameters(), ref.parameters()):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
destroy_process_group()
print("fused ok")
"""


def test_the_engine_runs_torchs_fused_adamw_with_the_same_update():
    """DeepSpeed builds the fused AdamW it is handed (no whole-partition temporaries), and
    it updates as the default for-each AdamW does, to float rounding (one process, ZeRO-0)."""
    import subprocess
    import sys

    ds = {**_ds("zero0"), "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "train_batch_size": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 0.1, "betas": [0.9, 0.999], "eps": 1e-8}}}
    done = subprocess.run([sys.executable, "-c", _FUSED_CHECK, json.dumps(ds)], capture_output=True,
                          text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0 and "fused ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_a_zero0_checkpoint_keeps_the_adam_that_wrote_it():
    ds = _ds("zero0")
    fused = {**ds, "optimizer": {**ds["optimizer"], "params": {**ds["optimizer"]["params"], "lr": 0.1}}}
    torch_written = with_torch_adam(fused)
    assert with_torch_adam(ds, written_with=fused) == ds  # written by FusedAdam: stays FusedAdam
    assert with_torch_adam(ds, written_with=torch_written)["optimizer"]["params"]["torch_adam"] is True
    zero2 = _ds("zero2")
    assert with_torch_adam(zero2, written_with=fused)["optimizer"]["params"]["torch_adam"] is True
