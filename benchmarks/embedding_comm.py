"""Sharded embeddings: bytes moved per meta-step, per-rank memory, and trainer throughput.

1. Bytes per meta-step at world 2 (real gloo ranks): one R x 32 table (R = 1M, 20M), row-wise
   modulo, Adagrad; per rank 32 tasks x (40 support + 10 query) ids (fixed lengths), Zipf(1.1)
   over popularity ranks mapped through a seeded permutation of the row ids, drawn per rank.
   Each variant: forward, backward of ``sum(rows * fixed random weights)``, ``step()``; bytes =
   all `CommStats` stages sent to other ranks. ``fused+dedup`` (support + query in one forward,
   as the trainer), ``(a) no dedup``, ``(b) separate`` (two forwards), ``(c) replicated``
   (DMAML-like: ring all-reduce of the dense gradient, 2(W-1)/W x R x 32 x 4 B/rank, analytic).
   Wall time per variant: median of --reps repetitions, indicative only (2 shared cores).
2. Peak RSS per rank for the 20M x 32 Adagrad table at world 1 vs 2 after build + one step, next
   to a rank that built nothing. ru_maxrss survives exec on Linux (a child starts at its
   launcher's peak), so VmHWM (the process's own peak) is reported too and used for the share.
3. Real trainer (deepspeed launcher, 2 CPU ranks), replicated vs sharded row-wise: median
   ``tasks_per_s`` of ``metrics.jsonl`` after the first record.

Run from the repo root:  python benchmarks/embedding_comm.py   (-> benchmarks/results/embedding_comm.json)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
try:
    import gmeta_ds  # noqa: F401
except ImportError:  # not installed: run from a checkout
    sys.path.insert(0, str(ROOT))
from gmeta_ds.embedding.plan import plan_tables
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import TableConfig
from gmeta_ds.sparse import Jagged

sys.path.insert(0, str(ROOT / "benchmarks"))
from common import LaunchFailure, bench_env, free_port, rank_main, run_group
from common import run_ranks as common_run_ranks

RESULTS = ROOT / "benchmarks" / "results" / "embedding_comm.json"
DIM, TASKS, SUPPORT, QUERY, ZIPF, WORLD = 32, 32, 40, 10, 1.1, 2
VARIANTS = ("fused+dedup", "(a) no dedup", "(b) separate")


class RankFailure(LaunchFailure):
    """A rank or the trainer failed or timed out."""


# ------------------------------------------------------------------ ids and tables
def make_ids(rows: int, world: int, seed: int = 0) -> dict:
    """rank -> {support: (T*S,), query: (T*Q,)} Zipf ids; popularity rank k -> perm[k - 1]."""
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    out = {}
    for rank in range(world):
        rng, n = np.random.default_rng([seed, rank]), TASKS * (SUPPORT + QUERY)
        ranks = np.empty(0, dtype=np.int64)
        while len(ranks) < n:  # truncated Zipf by rejection: exact on 1..rows
            draw = rng.zipf(ZIPF, 2 * n)
            ranks = np.concatenate([ranks, draw[draw <= rows]])
        ids = perm[torch.from_numpy(ranks[:n] - 1)]
        out[rank] = {"support": ids[: TASKS * SUPPORT], "query": ids[TASKS * SUPPORT:]}
    return out


def id_counts(ids: dict, world: int) -> dict:
    """Per rank: ids / unique ids owned by another rank, for support, query and both."""
    out = {}
    for r, d in ids.items():
        parts = {**d, "both": torch.cat([d["support"], d["query"]])}
        parts = {k: v[v % world != r] for k, v in parts.items()}
        out[r] = {"remote_ids": len(parts["both"]), **{f"remote_unique_{k}": len(torch.unique(v))
                                                      for k, v in parts.items()}}
    return out


def build(rows: int, world: int, rank: int, dedup: bool = True) -> ShardedEmbeddingCollection:
    """One R x 32 table (features support, query), row-wise modulo, Adagrad."""
    table = TableConfig("items", rows, DIM, ("support", "query"), pooling="none", optimizer="adagrad")
    plan = plan_tables([table], world, {"items": "row_wise"}, row_owner="modulo")
    return ShardedEmbeddingCollection(plan, rank, seed=0, dedup=dedup)


# ------------------------------------------------------------------ rank workers
def one_step(coll, ids: dict, weights: dict, separate: bool) -> None:
    """Forward (fused or one call per feature), backward of sum(rows * weights), step()."""
    feats = {k: Jagged.single(v) for k, v in ids.items()}
    calls = [{k: feats[k]} for k in feats] if separate else [feats]
    out = {k: v for call in calls for k, v in coll(call).items()}
    sum((out[k] * weights[k]).sum() for k in out).backward()
    coll.step()


def time_variant(coll, ids, weights, separate: bool, reps: int) -> dict:
    coll.stats.reset()
    one_step(coll, ids, weights, separate)  # warm-up; its bytes are the ones reported
    stages = coll.stats.as_dict()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        one_step(coll, ids, weights, separate)
        times.append(time.perf_counter() - start)
    sent = sum(s["bytes_sent"] for s in stages.values())
    return {"bytes_sent": sent, "stages": stages, "median_ms": 1e3 * statistics.median(times)}


def comm_worker(ids_path: str, rows: str, reps: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.load(ids_path)[rank]
    g = torch.Generator().manual_seed(1000 + rank)
    weights = {k: torch.randn(len(v), DIM, generator=g) for k, v in ids.items()}
    res = {}
    for dedup, variants in ((True, VARIANTS[0::2]), (False, VARIANTS[1:2])):
        coll = build(int(rows), world, rank, dedup)
        for v in variants:
            res[v] = time_variant(coll, ids, weights, v == "(b) separate", int(reps))
        del coll
        gc.collect()
    return res


def peaks() -> dict:
    """ru_maxrss and VmHWM (this process's own peak RSS), MiB."""
    hwm = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM:"))
    return {"ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "vmhwm_mib": int(hwm.split()[1]) / 1024}


def rss_worker(rows: str, ids_path: str) -> dict:
    """Peak RSS after building the collection and one step (rows 0: build nothing)."""
    rank, world, rows = dist.get_rank(), dist.get_world_size(), int(rows)
    if not rows:
        return peaks()
    coll = build(rows, world, rank)
    state = coll.optimizers["items"].state[coll.shards["items"]]
    res = {"adagrad_state_eager": "sum" in state,  # allocated by the constructor?
           "adagrad_state_mib": state["sum"].numel() * 4 / 2**20 if "sum" in state else 0.0,
           "shard_mib": coll.shards["items"].numel() * 4 / 2**20, "after_build": peaks()}
    ids = torch.load(ids_path)[rank]
    one_step(coll, ids, {k: torch.ones(len(v), DIM) for k, v in ids.items()}, False)
    return {**res, **peaks()}


def run_ranks(name: str, world: int, *args: str, timeout: float = 300.0) -> list[dict]:
    """This script's worker ``name`` on ``world`` gloo ranks; each rank's RESULT dict."""
    try:
        return common_run_ranks(__file__, name, world, *args, timeout=timeout)
    except LaunchFailure as e:
        raise RankFailure(str(e)) from None


def run_trainer(sharding: list[str], steps: int, timeout: float) -> dict:
    """The real trainer through the deepspeed launcher; median tasks_per_s after the first record."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(ROOT / ".venv/bin/deepspeed"), "--num_gpus", str(WORLD), "--master_port", str(free_port()),
               str(ROOT / ".venv/bin/gmeta-ds"), "train", "--config", "examples/synthetic/config.yaml",
               "--set", f"train.meta_steps={steps}", "--set", "train.log_every=10", "--set", "eval.enabled=false",
               "--set", "train.progress=false", "--set", f"output_dir={out}"]
        cmd += [a for s in sharding for a in ("--set", s)]
        run_group(cmd, timeout, f"trainer {sharding}", env=bench_env())
        recs = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    per_step = lambda k: statistics.median(r[k] / 10 for r in recs[1:])
    return {"tasks_per_s": statistics.median(r["tasks_per_s"] for r in recs[1:]), "records": len(recs),
            "dense_allreduce_bytes_per_step": per_step("dense_allreduce_bytes"),
            "embedding_comm_bytes_per_step": per_step("embedding_comm_bytes")}


# ------------------------------------------------------------------ the three parts
def part_bytes(rows_list, reps, tmp) -> list[dict]:
    print(f"\n1. bytes sent to other ranks per meta-step, world {WORLD}, per rank "
          f"({TASKS} tasks x {SUPPORT}+{QUERY} ids, fixed lengths, Zipf {ZIPF}); time: median of {reps}, "
          "INDICATIVE ONLY (2 shared cores)")
    print(f"{'rows':>10} {'variant':<15} {'rank 0 B':>12} {'rank 1 B':>12} {'total B':>14} {'ms':>8}")
    out = []
    for rows in rows_list:
        ids = make_ids(rows, WORLD)
        path = os.path.join(tmp, f"ids_{rows}.pt")
        torch.save(ids, path)
        ranks = sorted(run_ranks("comm", WORLD, path, str(rows), str(reps)), key=lambda r: r["rank"])
        ring = int(2 * (WORLD - 1) / WORLD * rows * DIM * 4)
        res = {v: {"bytes_per_rank": [r[v]["bytes_sent"] for r in ranks],
                   "median_ms_max_over_ranks": max(r[v]["median_ms"] for r in ranks),
                   "stages_per_rank": [r[v]["stages"] for r in ranks]} for v in VARIANTS}
        res["(c) replicated"] = {"bytes_per_rank": [ring] * WORLD, "median_ms_max_over_ranks": None,
                                 "analytic": "ring all-reduce 2(W-1)/W x R x 32 x 4 B, not run"}
        for v, r in res.items():
            ms = f"{r['median_ms_max_over_ranks']:8.1f}" if r["median_ms_max_over_ranks"] else "analytic"
            print(f"{rows:>10} {v:<15} {r['bytes_per_rank'][0]:>12,} {r['bytes_per_rank'][1]:>12,} "
                  f"{sum(r['bytes_per_rank']):>14,} {ms:>8}")
        tot = {v: sum(r["bytes_per_rank"]) for v, r in res.items()}
        ratios = {"fused+dedup / (b)": tot["fused+dedup"] / tot["(b) separate"],
                  "fused+dedup / (a)": tot["fused+dedup"] / tot["(a) no dedup"],
                  "(c) / fused+dedup": tot["(c) replicated"] / tot["fused+dedup"]}
        print(" " * 11 + "ratios: " + ", ".join(f"{k} = {x:.3g}" for k, x in ratios.items()))
        out.append({"rows": rows, "variants": res, "ratios": ratios, "id_counts": id_counts(ids, WORLD)})
    return out


def part_rss(rows: int, tmp) -> list[dict]:
    path = os.path.join(tmp, f"ids_{rows}.pt")
    if not os.path.exists(path):
        torch.save(make_ids(rows, WORLD), path)
    print(f"\n2. peak RSS per rank (MiB), {rows:,} x {DIM} table + Adagrad, after build + one step; "
          "base = a rank that imported torch, joined gloo, built nothing; share = VmHWM - base VmHWM")
    print(f"{'world':>5} {'rank':>4} {'base maxrss':>11} {'base HWM':>9} {'ru_maxrss':>9} {'VmHWM':>7} "
          f"{'share':>7} {'shard+state':>11}")
    out = []
    for world in (1, WORLD):
        base = {r["rank"]: r for r in run_ranks("rss", world, "0", path)}
        for r in sorted(run_ranks("rss", world, str(rows), path), key=lambda r: r["rank"]):
            b = base[r["rank"]]
            r.update(world=world, baseline=b, table_share_mib=r["vmhwm_mib"] - b["vmhwm_mib"])
            print(f"{world:>5} {r['rank']:>4} {b['ru_maxrss_mib']:>11.0f} {b['vmhwm_mib']:>9.0f} "
                  f"{r['ru_maxrss_mib']:>9.0f} {r['vmhwm_mib']:>7.0f} {r['table_share_mib']:>7.0f} "
                  f"{r['shard_mib'] + r['adagrad_state_mib']:>11.0f}")
            out.append(r)
    w1 = next(r["table_share_mib"] for r in out if r["world"] == 1)
    w2 = max(r["table_share_mib"] for r in out if r["world"] == WORLD)
    print(f"      share at world {WORLD} / world 1 = {w2 / w1:.3f} (aim ~0.5); Adagrad state allocated "
          f"in the constructor: {all(r['adagrad_state_eager'] for r in out)}")
    return out


def part_trainer(steps: int, timeout: float) -> dict:
    print(f"\n3. real trainer, world {WORLD}, {steps} meta-steps, median tasks_per_s (first record skipped)")
    # embedding.tables={}: drop the example's per-table plans (not allowed with replicated; all row-wise)
    res = {"replicated": run_trainer(["embedding.sharding=dense", "embedding.tables={}"], steps, timeout),
           "sharded": run_trainer(["embedding.sharding=sharded", "embedding.plan=row_wise", "embedding.tables={}"],
                                  steps, timeout)}
    res["sharded / replicated"] = res["sharded"]["tasks_per_s"] / res["replicated"]["tasks_per_s"]
    print(f"{'sharding':<12} {'tasks/s':>9} {'dense B/step':>13} {'emb B/step':>11}")
    for k, r in (("replicated", res["replicated"]), ("sharded", res["sharded"])):
        print(f"{k:<12} {r['tasks_per_s']:>9.0f} {r['dense_allreduce_bytes_per_step']:>13,.0f} "
              f"{r['embedding_comm_bytes_per_step']:>11,.0f}")
    print(f"sharded / replicated tasks_per_s = {res['sharded / replicated']:.3f}")
    return res


def write_json(data: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, RESULTS)


def machine() -> dict:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "ram_gib": round(mem / 2**30, 1),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "threads_per_rank": 1}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 20_000_000])
    ap.add_argument("--rss-rows", type=int, default=20_000_000)
    ap.add_argument("--reps", type=int, default=9, help="timed repetitions per variant")
    ap.add_argument("--meta-steps", type=int, default=150)
    ap.add_argument("--trainer-timeout", type=float, default=300.0)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    start, args = time.perf_counter(), parse_args(argv)
    params = {**vars(args), "world": WORLD, "dim": DIM, "tasks": TASKS, "support": SUPPORT,
              "query": QUERY, "lengths": "fixed", "zipf_exponent": ZIPF, "plan": "row_wise modulo",
              "optimizer": "adagrad", "replicated_bytes": "analytic ring all-reduce"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = {"bytes": part_bytes(args.rows, args.reps, tmp), "rss": part_rss(args.rss_rows, tmp)}
        results["trainer"] = part_trainer(args.meta_steps, args.trainer_timeout)
    except RankFailure as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    results["runtime_s"] = time.perf_counter() - start
    write_json({"machine": machine(), "parameters": params, "results": results})
    print(f"\ntotal {results['runtime_s']:.0f}s; wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(rank_main({"comm": comm_worker, "rss": rss_worker}, sys.argv[2], sys.argv[3:]))
    sys.exit(main())
