"""On a CUDA GPU: few-shot text meta-training as one process (DeepSpeed on NCCL, world 1) in
bf16 + ZeRO-3 and in fp16 (dynamic loss scaling) + ZeRO-2 — finite losses, close to the
float32 run on the CPU. Skipped without CUDA; run by benchmarks/gpu_check.sh."""
from __future__ import annotations

import json
import os

import pytest
import torch
from launch.conftest import BIN, run, summary, text_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def train(path, cuda: bool) -> dict:
    env = {} if cuda else {"CUDA_VISIBLE_DEVICES": ""}
    run([str(BIN / "gmeta-ds"), "train", "--config", str(path)], env={**env, "PATH": f"{BIN}:{os.environ['PATH']}"})
    return summary(path)


@pytest.mark.parametrize("ds", ["zero3_bf16", "zero2_fp16"])
def test_half_precision_on_cuda_trains_close_to_fp32_on_cpu(tmp_path, ds):
    reference = train(text_config(tmp_path / "cpu", "maml", "zero0"), cuda=False)
    result = train(text_config(tmp_path / "gpu", "maml", ds), cuda=True)
    records = [json.loads(line) for line in (tmp_path / "gpu" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["query_loss"] == r["query_loss"] for r in records)  # no NaN
    assert result["final_query_loss"] == pytest.approx(reference["final_query_loss"], rel=5e-2)
