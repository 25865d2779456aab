"""Per-step Python overhead of the embedding lookup: per-field single-hot ids, before/after.

`ShardedEmbeddingCollection.lookup_fields` used to go through the per-feature path
(`tables.lookup_fields`, still there: the fallback and the unsharded twin's lookup): one
`Jagged.single` and one `check_ids` per field, one `torch.unique` and one concatenation per
table, one index per field and a stack of the per-field rows. It now keeps the single-hot
fields as one (N, F) tensor: one check, one unique of table-offset keys (linear, no sort, for
small tables), one `index_select` of every field's rows. Both paths are timed side by side in one
process, interleaved, with one thread (what each of 2 ranks gets on 2 cores), world 1 (no
collectives: pure overhead):

1. the lookup alone: `ShardedEmbeddingCollection.lookup_fields` of one micro-batch of the demo
   (32 tasks, support + query, 8 fields, the demo's plan) + backward of a fixed weighted sum;
   outputs and gradients are checked equal (bit for bit) first;
2. the trainer's real `meta_step` on the demo config (world 1, ZeRO-2, 2 micro-batches), with
   `ShardedEmbeddingCollection.lookup_fields` patched to the per-feature path for "before".

Reported: medians and the median of paired ratios (before / after of neighbouring
repetitions). Writes ``benchmarks/results/lookup.json``.

    python benchmarks/lookup.py [--reps 300] [--steps 60]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, machine  # first: sets OMP_WAIT_POLICY before torch loads

# isort: split

import argparse
import json
import os
import statistics
import time
from contextlib import contextmanager

import torch

ROOT = Path(__file__).resolve().parents[1]

from gmeta_ds.embedding import tables
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection

RESULTS = ROOT / "benchmarks" / "results" / "lookup.json"
_FUSED = ShardedEmbeddingCollection.lookup_fields


@contextmanager
def per_feature(on: bool):
    """While ``on``: `ShardedEmbeddingCollection.lookup_fields` is the per-feature path (the old one)."""
    if on:
        ShardedEmbeddingCollection.lookup_fields = tables.lookup_fields
    try:
        yield
    finally:
        ShardedEmbeddingCollection.lookup_fields = _FUSED


def setup():
    from gmeta_ds.config import load_config
    from gmeta_ds.data.loader import TaskLoader
    from gmeta_ds.data.sampler import MetaBatchSampler
    from gmeta_ds.sparse import single_fields
    from gmeta_ds.config.deepspeed import resolve_ds_config
    from gmeta_ds.engine import ds_engine
    from gmeta_ds.engine.dist import skip_deepspeed_shm_op
    from gmeta_ds.workloads.ctr import build_data, build_learner, build_sharded

    skip_deepspeed_shm_op()
    cfg = load_config(ROOT / "examples/synthetic/config.yaml", [])
    ds, plan = resolve_ds_config(cfg, 1)
    data = build_data(cfg)
    sharded = build_sharded(cfg, data, 0, 1)
    engine = ds_engine.initialize(build_learner(cfg, data.fields, with_tables=False), ds)
    loader = TaskLoader(data.train, MetaBatchSampler(len(data.train), plan.tasks_per_micro_batch,
                                                     plan.grad_accum_steps, 1, 0, cfg.seed), prefetch=False)
    return engine, sharded, loader, [f.name for f in single_fields(data.fields)], plan


def paired(before: list[float], after: list[float]) -> dict:
    return {"before_ms": 1e3 * statistics.median(before), "after_ms": 1e3 * statistics.median(after),
            "paired_speedup": statistics.median(b / a for b, a in zip(before, after))}


def lookup_part(sharded, fields, batch, reps: int) -> dict:
    from gmeta_ds.algorithms.base import embed_batch

    def once():
        for p in sharded.parameters():
            p.grad = None
        start = time.perf_counter()
        sup, qry = embed_batch(lambda ids, multi: sharded.lookup_fields(ids, fields, multi), batch)
        (sup * weights[0]).sum().add((qry * weights[1]).sum()).backward()
        return time.perf_counter() - start, (sup.detach(), qry.detach()), [
            p.grad.to_dense() if p.grad is not None else None for p in sharded.parameters()]

    g = torch.Generator().manual_seed(0)
    sup, qry = embed_batch(lambda ids, multi: sharded.lookup_fields(ids, fields, multi), batch)
    weights = (torch.randn(sup.shape, generator=g), torch.randn(qry.shape, generator=g))
    with per_feature(True):
        _, out_old, grads_old = once()
    _, out_new, grads_new = once()
    same = all(torch.equal(a, b) for a, b in zip(out_old, out_new)) and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(grads_old, grads_new))
    before, after = [], []
    for _ in range(reps):
        with per_feature(True):
            before.append(once()[0])
        after.append(once()[0])
    return {**paired(before, after), "outputs_and_grads_equal": same}


def step_part(engine, sharded, fields, loader, steps: int, tasks: int) -> dict:
    from gmeta_ds.meta_engine import step_micro_batches as meta_step

    for _ in range(3):
        meta_step(engine, sharded, fields, loader.next())
    before, after = [], []
    for _ in range(steps):
        for old, times in ((True, before), (False, after)):
            batches = loader.next()
            with per_feature(old):
                start = time.perf_counter()
                meta_step(engine, sharded, fields, batches)
                times.append(time.perf_counter() - start)
    res = paired(before, after)
    res.update(before_tasks_per_s=tasks / res["before_ms"] * 1e3, after_tasks_per_s=tasks / res["after_ms"] * 1e3)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=300, help="lookup repetitions per path")
    ap.add_argument("--steps", type=int, default=60, help="meta-steps per path")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    engine, sharded, loader, fields, plan = setup()
    look = lookup_part(sharded, fields, loader.next()[0], args.reps)
    step = step_part(engine, sharded, fields, loader, args.steps, plan.tasks_per_meta_step)
    loader.close()
    print("\nfields as one tensor (after) vs one Jagged.single per field (before), 1 thread, world 1")
    print(f"{'what':<44} {'before ms':>10} {'after ms':>9} {'paired speed-up':>16}")
    print(f"{'lookup + backward, 1 micro-batch (32 tasks)':<44} {look['before_ms']:>10.2f} "
          f"{look['after_ms']:>9.2f} {look['paired_speedup']:>15.3f}x")
    print(f"{'meta_step, demo config (64 tasks)':<44} {step['before_ms']:>10.2f} {step['after_ms']:>9.2f} "
          f"{step['paired_speedup']:>15.3f}x")
    print(f"outputs and gradients equal: {look['outputs_and_grads_equal']}; tasks/s "
          f"{step['before_tasks_per_s']:.0f} -> {step['after_tasks_per_s']:.0f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "parameters": vars(args), "lookup": look,
                                   "meta_step": step, "runtime_s": time.perf_counter() - start}, indent=2) + "\n")
    print(f"total {time.perf_counter() - start:.0f}s; wrote {RESULTS}")
    sys.stdout.flush()
    os._exit(0 if look["outputs_and_grads_equal"] else 1)  # no gloo/DeepSpeed teardown at exit


if __name__ == "__main__":
    main()
