"""Overlapping the next micro-batch's embedding lookup with the current inner loop: before/after.

On ``--world`` real gloo ranks (default 2), the real trainer pieces (`gmeta_ds.trainer`:
build_data, build_sharded, build_learner, DeepSpeed engine, `meta_step`) on the demo config with
``--gas`` micro-batches of 32 tasks per rank and meta-step (prefetching needs >= 2). One engine
and one `ShardedEmbeddingCollection(overlap=True)` per rank; blocks of ``--block`` meta-steps
alternate between ``sharded.overlap = False`` (sequential lookups) and ``True`` (lookup of
micro-batch i+1 in a background thread, its all-to-alls on their own group) for ``--rounds``
rounds. Reported per mode: median meta-step time (max over ranks of each step), the median time
the lookup call takes on the caller's thread (sequential: the whole lookup; overlapped: the
wait for the prefetched one) and tasks/s; and the median of the paired ratios (sequential /
overlapped time of neighbouring steps), the number robust to load changing under the run.
Writes ``benchmarks/results/overlap.json``.

    python benchmarks/overlap.py [--world 2] [--gas 2 4] [--rounds 40] [--block 1]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import gmeta_ds  # noqa: F401
except ImportError:  # not installed: run from a checkout
    sys.path.insert(0, str(ROOT))
from common import LaunchFailure, machine, rank_main, run_ranks

RESULTS = ROOT / "benchmarks" / "results" / "overlap.json"
MODES = ("sequential", "overlapped")


def worker(gas: str, rounds: str, block: str) -> dict:
    import torch

    from gmeta_ds.config import load_config
    from gmeta_ds.data.loader import TaskLoader
    from gmeta_ds.data.sampler import MetaBatchSampler
    from gmeta_ds.data.tasks import single_fields
    from gmeta_ds.ds_config import resolve_ds_config
    from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
    from gmeta_ds.engine import ds_engine
    from gmeta_ds.engine.dist import skip_deepspeed_shm_op
    from gmeta_ds.trainer import build_data, build_learner, embedding_plan, meta_step

    rank, world, gas, rounds, block = dist.get_rank(), dist.get_world_size(), int(gas), int(rounds), int(block)
    skip_deepspeed_shm_op()
    cfg = load_config(ROOT / "examples/synthetic/config.yaml",
                      [f"meta.tasks_per_meta_step={32 * world * gas}", "meta.tasks_per_micro_batch=32"])
    ds, plan = resolve_ds_config(cfg, world)
    data = build_data(cfg)
    sharded = ShardedEmbeddingCollection(embedding_plan(cfg, data.fields, world), rank, cfg.seed,
                                         cfg.embedding.bad_ids, cfg.embedding.dedup, overlap=True)
    engine = ds_engine.initialize(build_learner(cfg, data.fields, with_tables=False), ds)
    sampler = MetaBatchSampler(len(data.train), plan.tasks_per_micro_batch, plan.grad_accum_steps, world,
                               rank, cfg.seed)
    loader = TaskLoader(data.train, sampler, prefetch=False)
    fields = [f.name for f in single_fields(data.fields)]
    waits = []
    lookup = sharded.lookups

    def timed_lookups(batches, fn):  # time spent on the caller's thread getting each batch's rows
        it = lookup(batches, fn)
        while True:
            start = time.perf_counter()
            try:
                rows = next(it)
            except StopIteration:
                return
            waits.append(time.perf_counter() - start)
            yield rows

    sharded.lookups = timed_lookups
    times = {m: [] for m in MODES}
    lookup_s = {m: [] for m in MODES}
    for _ in range(2):  # warm-up, both modes
        for mode in MODES:
            sharded.overlap = mode == "overlapped"
            meta_step(engine, sharded, fields, loader.next())
    for _ in range(rounds):
        for mode in MODES:
            sharded.overlap = mode == "overlapped"
            for _ in range(block):
                batches = loader.next()
                dist.barrier()
                waits.clear()
                start = time.perf_counter()
                meta_step(engine, sharded, fields, batches)
                step = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(step, op=dist.ReduceOp.MAX)
                times[mode].append(step.item())
                lookup_s[mode].append(sum(waits))
    loader.close()
    return {"step_s": times, "lookup_s": lookup_s, "tasks_per_meta_step": plan.tasks_per_meta_step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--gas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--block", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rows = []
    for gas in args.gas:
        try:
            ranks = run_ranks(__file__, "overlap", args.world, str(gas), str(args.rounds), str(args.block),
                              timeout=args.timeout)
        except LaunchFailure as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
        tasks = ranks[0]["tasks_per_meta_step"]
        res = {"gas": gas, "tasks_per_meta_step": tasks}
        for mode in MODES:
            step = statistics.median(ranks[0]["step_s"][mode])  # already the max over ranks
            res[mode] = {"step_ms": 1e3 * step, "tasks_per_s": tasks / step,
                         "lookup_ms_on_caller": 1e3 * statistics.median(
                             x for r in ranks for x in r["lookup_s"][mode])}
        res["speedup"] = res["sequential"]["step_ms"] / res["overlapped"]["step_ms"]
        pairs = zip(ranks[0]["step_s"]["sequential"], ranks[0]["step_s"]["overlapped"])
        res["paired_speedup"] = statistics.median(a / b for a, b in pairs)
        rows.append(res)
    print(f"\nworld {args.world}, demo config, 32 tasks per micro-batch; median over {args.rounds} x "
          f"{args.block} meta-steps per mode, interleaved")
    print(f"{'GAS':>3} {'mode':<11} {'ms/meta-step':>12} {'tasks/s':>8} {'lookup ms on caller':>20}")
    for r in rows:
        for mode in MODES:
            m = r[mode]
            print(f"{r['gas']:>3} {mode:<11} {m['step_ms']:>12.1f} {m['tasks_per_s']:>8.0f} "
                  f"{m['lookup_ms_on_caller']:>20.2f}")
        print(f"    speed-up (sequential / overlapped time): medians {r['speedup']:.3f}x, "
              f"median of paired steps {r['paired_speedup']:.3f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "parameters": vars(args), "results": rows,
                                   "runtime_s": time.perf_counter() - start}, indent=2) + "\n")
    print(f"total {time.perf_counter() - start:.0f}s; wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(rank_main({"overlap": worker}, sys.argv[2], sys.argv[3:]))
    sys.exit(main())
