"""On a CUDA GPU: the inner loop on the device equals the CPU, and a one-process DeepSpeed run
(NCCL backend, world 1) trains the same model as on the CPU. Skipped without CUDA; run by
benchmarks/gpu_check.sh (``pytest -m gpu``)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import tiny_batch, tiny_melu
from launch.conftest import BIN, REPO, run, summary, tiny_config

from gmeta_ds.algorithms import MetaLearner, build_algorithm
from gmeta_ds.config import MetaConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _to(batch, device):
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device)
                                         for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})


@pytest.mark.parametrize("vectorize", [True, False])
def test_inner_loop_on_cuda_equals_cpu(vectorize):
    """Second-order MAML, 2 inner steps: outer loss and every meta-gradient, CUDA vs CPU."""
    meta = MetaConfig(algorithm="maml", inner_steps=2, inner_lr=0.3, vectorize=vectorize)
    results = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        learner = MetaLearner(tiny_melu(), build_algorithm(meta, "binary")).to(device)
        out = learner(_to(tiny_batch(tasks=5, seed=3), device))
        out.loss.backward()
        results[device] = (out.loss.detach().cpu(),
                           {n: p.grad.detach().cpu() for n, p in learner.named_parameters() if p.grad is not None})
    (loss_cpu, grads_cpu), (loss_gpu, grads_gpu) = results["cpu"], results["cuda"]
    torch.testing.assert_close(loss_gpu, loss_cpu, rtol=1e-5, atol=1e-6)
    assert grads_cpu.keys() == grads_gpu.keys() and grads_cpu
    for name in grads_cpu:
        torch.testing.assert_close(grads_gpu[name], grads_cpu[name], rtol=1e-4, atol=1e-6, msg=name)


def test_one_process_deepspeed_on_nccl_equals_cpu(tmp_path):
    """``gmeta-ds train`` as one plain process: with the GPU visible (DeepSpeed on NCCL, world 1)
    and hidden (gloo, CPU); same final loss and checksums (1e-4 relative). torch's Adam on both
    (``torch_adam``): no fused-op build, the same update rule."""
    ds = json.loads((REPO / "ds_configs" / "zero0.json").read_text())
    ds["optimizer"]["params"]["torch_adam"] = True
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    runs = {}
    for name, env in (("cuda", {}), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        config = tiny_config(tmp_path / name, embedding={"sharding": "dense"},
                             deepspeed=str(tmp_path / "ds.json"))
        run([str(BIN / "gmeta-ds"), "train", "--config", str(config)], env=env)
        runs[name] = summary(config)
    for key in ("final_query_loss", "dense_checksum", "embedding_checksum"):
        assert runs["cuda"][key] == pytest.approx(runs["cpu"][key], rel=1e-4, abs=1e-6), key
