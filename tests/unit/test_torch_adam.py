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
    assert params == {"lr": 0.1, "weight_decay": 0.01, "torch_adam": True}


def test_a_zero0_checkpoint_keeps_the_adam_that_wrote_it():
    ds = _ds("zero0")
    fused = {**ds, "optimizer": {**ds["optimizer"], "params": {**ds["optimizer"]["params"], "lr": 0.1}}}
    torch_written = with_torch_adam(fused)
    assert with_torch_adam(ds, written_with=fused) == ds  # written by FusedAdam: stays FusedAdam
    assert with_torch_adam(ds, written_with=torch_written)["optimizer"]["params"]["torch_adam"] is True
    zero2 = _ds("zero2")
    assert with_torch_adam(zero2, written_with=fused)["optimizer"]["params"]["torch_adam"] is True
