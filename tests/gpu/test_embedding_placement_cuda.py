"""On a CUDA GPU, one process on NCCL (world 1): sharded tables placed on the accelerator and on
the host (pinned, rows moved to the GPU after the lookup) give the CPU's rows, gradients and
updated rows, static, dynamic and pooled on the owner (issue 20); and `gmeta-ds train` with sharded tables on each placement
trains the CPU's model. World 1 issues no all-to-all (one GPU cannot hold two NCCL ranks): the
exchange over NCCL and the host gloo group at W >= 2 are covered on CPU only. Skipped without
CUDA; run by benchmarks/gpu_check.sh (``pytest -m gpu``)."""
from __future__ import annotations

import pytest
import torch
from launch.conftest import BIN, run, summary, tiny_config

from gmeta_ds.embedding.plan import plan_tables
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import TableConfig
from gmeta_ds.sparse import Jagged

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _tables(device: str) -> list[TableConfig]:
    return [TableConfig("s", 5000, 8, ("s",), device=device),
            TableConfig("u", 0, 8, ("u",), kind="dynamic", capacity=4000, admit_after=1, device=device),
            TableConfig("p", 3000, 8, ("p",), pooling="mean", exchange="pooled", device=device)]


def _round(emb: ShardedEmbeddingCollection, seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    feats = {"s": Jagged.single(torch.randint(0, 5000, (512,), generator=g)),
             "u": Jagged(torch.randint(-2**40, 2**40, (700,), generator=g), torch.tensor([0, 300, 700])),
             "p": Jagged(torch.randint(0, 3000, (400,), generator=g), torch.arange(0, 401, 20))}  # pooled on the owner
    out = emb(feats)
    weights = {k: torch.randn(v.shape, generator=g).to(v.device) for k, v in out.items()}
    sum((out[k] * weights[k]).sum() for k in out).backward()
    grads = {k: p.grad.to_dense().cpu() for k, p in emb.shards.items()}
    emb.step()
    return {k: v.detach().cpu() for k, v in out.items()}, grads


@pytest.mark.parametrize("device", ["accelerator", "host"])
def test_placed_tables_on_cuda_equal_the_cpu(device):
    cpu = ShardedEmbeddingCollection(plan_tables(_tables("auto"), 1, {}), 0, seed=2, device="cpu")
    gpu = ShardedEmbeddingCollection(plan_tables(_tables(device), 1, {}), 0, seed=2, device="cuda")
    assert all(p.device.type == ("cuda" if device == "accelerator" else "cpu") for p in gpu.shards.values())
    for seed in range(3):
        (out_c, grad_c), (out_g, grad_g) = _round(cpu, seed), _round(gpu, seed)
        for k in out_c:
            torch.testing.assert_close(out_g[k], out_c[k], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grad_g[k], grad_c[k], rtol=1e-5, atol=1e-6)
    for k in cpu.shards:
        torch.testing.assert_close(gpu.shards[k].detach().cpu(), cpu.shards[k].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["accelerator", "host"])
def test_sharded_training_on_nccl_with_placed_tables_equals_cpu(tmp_path, device):
    sections = dict(embedding={"sharding": "sharded", "device": device,
                               "tables": {"item_id": {"kind": "dynamic", "capacity": 500}}})
    gpu = tiny_config(tmp_path / "gpu", **sections)
    cpu = tiny_config(tmp_path / "cpu", embedding={"sharding": "sharded",
                                                   "tables": {"item_id": {"kind": "dynamic", "capacity": 500}}})
    run([str(BIN / "deepspeed"), "--num_gpus", "1", str(BIN / "gmeta-ds"), "train", "--config", str(gpu)])
    run([str(BIN / "gmeta-ds"), "train", "--config", str(cpu)], env={"CUDA_VISIBLE_DEVICES": ""})
    a, b = summary(gpu), summary(cpu)
    for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-4), key
