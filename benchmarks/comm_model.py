"""Communication volume per meta-step and rank: an analytic model, checked against the
sharded collection's own counters on W = 1..4 real gloo ranks.

Setup (as the trainer runs it): a global meta-batch of ``--tasks`` tasks (default 96), each with
``--ids-per-task`` item ids (40 support + 10 query), split over W ranks (B/W tasks each, one
micro-batch); one R x d float32 table (default 1M x 32), row-wise modulo; ids Zipf(1.1) over
popularity ranks mapped through a seeded permutation of the rows (so owners are uniform).

Model, bytes each rank sends to other ranks per micro-batch (s = dtype bytes, i = id bytes,
8 for int64), sharded fused+dedup lookup, with U = the rank's unique ids in its micro-batch:

    counts   8 x n_tables x (W - 1)          (one all-to-all of per-(rank, table) counts)
    ids      i x U x (W - 1)/W               (its unique ids owned by other ranks)
    rows     d x s x U x (W - 1)/W           (rows it serves to the others, by symmetry)
    grads    d x s x U x (W - 1)/W           (row gradients back to their owners)

E[U] for n ids drawn from truncated Zipf(a) on R rows is sum_k 1 - (1 - p_k)^n. The replicated
baseline (DeepSpeed all-reduces the table's dense gradient once per meta-step, ring):
2 (W - 1)/W x R x d x s, independent of the batch. gloo and DeepSpeed do not count bytes, so
the replicated side is the model only; the sharded side is checked: "exact" uses each rank's
actual unique/remote counts (must equal the counters), "expected" uses E[U] only.

    python benchmarks/comm_model.py [--rows 1000000] [--dim 32] [--worlds 1 2 3 4]
                                    (-> benchmarks/results/comm_model.json)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # first: sets OMP_WAIT_POLICY before torch loads
    LaunchFailure,
    machine,
    rank_main,
    run_ranks,
)

# isort: split

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]

from gmeta_ds.embedding.plan import plan_tables
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import TableConfig
from gmeta_ds.sparse import Jagged

RESULTS = ROOT / "benchmarks" / "results" / "comm_model.json"
ZIPF, ID_BYTES, DTYPE_BYTES, N_TABLES = 1.1, 8, 4, 1


# ------------------------------------------------------------------ the model
def zipf_probs(rows: int, a: float = ZIPF) -> np.ndarray:
    p = np.arange(1, rows + 1, dtype=np.float64) ** -a
    return p / p.sum()


def expected_unique(n: int, probs: np.ndarray) -> float:
    """E[#distinct values] among n iid draws with probabilities ``probs``."""
    return float(np.sum(-np.expm1(n * np.log1p(-probs))))


def sharded_bytes(world: int, unique: float, dim: int, dtype_bytes: int = DTYPE_BYTES,
                  id_bytes: int = ID_BYTES, n_tables: int = N_TABLES, remote: float | None = None,
                  served: float | None = None) -> dict:
    """Bytes one rank sends per micro-batch, by stage (fused+dedup lookup). ``remote`` (its
    unique ids owned elsewhere) and ``served`` (rows it sends to others) default to their
    expectations U (W-1)/W under uniform owners."""
    if world == 1:
        return {"input_dist": 0, "output_dist": 0, "output_dist_backward": 0, "total": 0}
    frac = (world - 1) / world
    remote = unique * frac if remote is None else remote
    served = unique * frac if served is None else served
    out = {"input_dist": 8 * n_tables * (world - 1) + id_bytes * remote,
           "output_dist": dim * dtype_bytes * served,
           "output_dist_backward": dim * dtype_bytes * remote}
    out["total"] = sum(out.values())
    return out


def replicated_bytes(world: int, rows: int, dim: int, dtype_bytes: int = DTYPE_BYTES) -> float:
    """Ring all-reduce of the dense R x d gradient, bytes sent per rank per meta-step."""
    return 2 * (world - 1) / world * rows * dim * dtype_bytes


# ------------------------------------------------------------------ the measurement
def global_ids(rows: int, tasks: int, per_task: int, seed: int = 0) -> torch.Tensor:
    """(tasks, per_task) Zipf ids; popularity rank k -> perm[k - 1]."""
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    rng, n = np.random.default_rng(seed), tasks * per_task
    ranks = np.empty(0, dtype=np.int64)
    while len(ranks) < n:  # truncated Zipf by rejection: exact on 1..rows
        draw = rng.zipf(ZIPF, 2 * n)
        ranks = np.concatenate([ranks, draw[draw <= rows]])
    return perm[torch.from_numpy(ranks[:n] - 1)].view(tasks, per_task)


def rank_ids(ids: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank r's micro-batch: tasks r*B/W ... (r+1)*B/W - 1, flattened."""
    per = len(ids) // world
    return ids[rank * per:(rank + 1) * per].reshape(-1)


def counter_worker(ids_path: str, rows: str, dim: str) -> dict:
    """One fused lookup + backward + step; the collection's counters and this rank's counts."""
    rank, world, rows, dim = dist.get_rank(), dist.get_world_size(), int(rows), int(dim)
    ids = rank_ids(torch.load(ids_path), world, rank)
    table = TableConfig("items", rows, dim, ("items",), pooling="none", optimizer="adagrad")
    coll = ShardedEmbeddingCollection(plan_tables([table], world, {"items": "row_wise"}, row_owner="modulo"),
                                      rank, seed=0)
    out = coll({"items": Jagged.single(ids)})["items"]
    out.sum().backward()
    coll.step()
    unique = torch.unique(ids)
    return {"stages": coll.stats.as_dict(), "ids": len(ids), "unique": len(unique),
            "remote_unique": int((unique % world != rank).sum())}


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--tasks", type=int, default=96, help="global tasks per meta-step (divisible by each W)")
    ap.add_argument("--ids-per-task", type=int, default=50)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--model-worlds", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 96])
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    probs = zipf_probs(args.rows)
    ids = global_ids(args.rows, args.tasks, args.ids_per_task)
    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ids.pt")
        torch.save(ids, path)
        for world in args.worlds:
            try:
                ranks = run_ranks(__file__, "counters", world, path, str(args.rows), str(args.dim),
                                  timeout=args.timeout)
            except LaunchFailure as e:
                print(f"FAILED: {e}", file=sys.stderr)
                return 1
            n = args.tasks // world * args.ids_per_task
            expected = sharded_bytes(world, expected_unique(n, probs), args.dim)
            for r in ranks:
                measured = {s: v["bytes_sent"] for s, v in r["stages"].items()}
                measured["total"] = sum(measured.values())
                served = measured.get("output_dist", 0) / (args.dim * DTYPE_BYTES)
                exact = sharded_bytes(world, r["unique"], args.dim, remote=r["remote_unique"], served=served)
                checks.append({"world": world, "rank": r["rank"], "ids": r["ids"], "unique": r["unique"],
                               "expected_unique": expected_unique(n, probs),
                               "remote_unique": r["remote_unique"], "measured": measured,
                               "exact_model": exact, "expected_model": expected,
                               "exact_matches": all(abs(exact[k] - measured.get(k, 0)) < 0.5 for k in exact),
                               "expected_error": (expected["total"] / measured["total"] - 1)
                               if measured["total"] else 0.0})
    print(f"\nsharded fused+dedup lookup: bytes sent to other ranks per meta-step, per rank "
          f"({args.tasks} tasks x {args.ids_per_task} ids per meta-step over W ranks, "
          f"{args.rows:,} x {args.dim} fp32, Zipf {ZIPF})")
    print(f"{'W':>2} {'rank':>4} {'ids':>5} {'unique':>6} {'E[U]':>7} {'remote':>6} {'measured B':>11} "
          f"{'exact model':>11} {'expected model':>14} {'error':>6}")
    for c in checks:
        print(f"{c['world']:>2} {c['rank']:>4} {c['ids']:>5} {c['unique']:>6} {c['expected_unique']:>7.0f} "
              f"{c['remote_unique']:>6} {c['measured']['total']:>11,} {c['exact_model']['total']:>11,.0f} "
              f"{c['expected_model']['total']:>14,.0f} {c['expected_error']:>+6.1%}")
    exact_ok = all(c["exact_matches"] for c in checks)
    print(f"exact model == counters on every rank: {exact_ok}")
    model = []
    for world in args.model_worlds:
        if args.tasks % world:
            continue
        n = args.tasks // world * args.ids_per_task
        sh = sharded_bytes(world, expected_unique(n, probs), args.dim)["total"]
        rep = replicated_bytes(world, args.rows, args.dim)
        model.append({"world": world, "ids_per_rank": n, "sharded_bytes": sh, "replicated_bytes": rep,
                      "replicated_over_sharded": rep / sh if sh else None})
    print(f"\nmodel, bytes per rank per meta-step ({args.tasks} global tasks; worlds that divide it)")
    print(f"{'W':>3} {'ids/rank':>8} {'sharded':>12} {'replicated':>14} {'replicated/sharded':>18}")
    for m in model:
        ratio = f"{m['replicated_over_sharded']:,.0f}x" if m["replicated_over_sharded"] else "-"
        print(f"{m['world']:>3} {m['ids_per_rank']:>8} {m['sharded_bytes']:>12,.0f} {m['replicated_bytes']:>14,.0f} "
              f"{ratio:>18}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "parameters": {**vars(args), "zipf": ZIPF,
                                                                        "id_bytes": ID_BYTES,
                                                                        "dtype_bytes": DTYPE_BYTES},
                                   "checks": checks, "exact_model_matches": exact_ok, "model": model,
                                   "runtime_s": time.perf_counter() - start}, indent=2) + "\n")
    print(f"total {time.perf_counter() - start:.0f}s; wrote {RESULTS}")
    return 0 if exact_ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(rank_main({"counters": counter_worker}, sys.argv[2], sys.argv[3:]))
    sys.exit(main())
