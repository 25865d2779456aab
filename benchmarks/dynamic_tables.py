"""Dynamic tables against static ones: lookup + backward + sparse step time, and memory at a
fixed capacity while the distinct ids grow past it.

1. **Time** (world 1 and 2, gloo, one thread per rank): per rank, micro-batches of 2,048
   Zipf ids (exponent 1.1) of one single-hot feature, through `ShardedEmbeddingCollection`
   (`forward` -> weighted sum -> backward -> Adagrad step). Same capacity: a static row-wise
   table of ``C x W`` rows against a dynamic one of ``C`` rows per rank fed the same ids
   (scattered over int64 by a fixed odd multiplier, so they are not 0..N-1), after a warm-up
   that admits them all (``steady``: no admission or eviction in the timed steps; ids from 90%
   of the static rows so that every owner's hash share fits its C); and a full dynamic table
   fed Zipf ids from a space 10x its capacity (``churn``: admissions and LRU evictions every
   step, `admit_after` 2). The variants alternate step by step for ``--rounds`` rounds; the
   reported ratio is the median over rounds of dynamic / static time (same round).
2. **Memory** (world 1): a dynamic table of capacity C (Adagrad, admit_after 2) fed blocks of
   fresh ids until the distinct ids seen reach 10x C: the bytes of every tensor it holds
   (rows, optimizer state, map, sketch) and the process's resident size after each block.

3. ``--placements OUT_JSON`` (a CUDA machine, `gpu_check.sh`): world 1, static and dynamic
   1M-row tables on the accelerator and on the host, ms per lookup + backward + step.

Writes ``benchmarks/results/dynamic_tables.json``.

    python benchmarks/dynamic_tables.py [--capacity 100000] [--rounds 7] [--steps 20]
    python benchmarks/dynamic_tables.py --placements OUT/placements.json   # CUDA only
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, rank_main, run_ranks  # first: sets OMP_WAIT_POLICY before torch loads

# isort: split

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from gmeta_ds.embedding.plan import plan_tables
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.embedding.tables import TableConfig
from gmeta_ds.sparse import Jagged

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "dynamic_tables.json"
BATCH, DIM, SCATTER = 2048, 16, 0x9E3779B1  # ids -> id * SCATTER: spread over int64


def _zipf(n: int, high: int, g: torch.Generator) -> torch.Tensor:
    """``n`` ids in [0, high) with P(k) ~ 1 / (k + 1)^1.1 (inverse-CDF on a grid)."""
    weights = 1.0 / torch.arange(1, high + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(weights, n, replacement=True, generator=g)


def _collection(kind: str, capacity: int, world: int, rank: int) -> ShardedEmbeddingCollection:
    if kind == "static":
        table = TableConfig("t", capacity * world, DIM, ("f",), optimizer="adagrad")
        return ShardedEmbeddingCollection(plan_tables([table], world, {"t": "row_wise"}), rank, seed=1)
    table = TableConfig("t", 0, DIM, ("f",), optimizer="adagrad", kind="dynamic", capacity=capacity,
                        admit_after=2 if kind == "churn" else 1)
    return ShardedEmbeddingCollection(plan_tables([table], world, {}), rank, seed=1)


def _step(emb: ShardedEmbeddingCollection, ids: torch.Tensor, weight: torch.Tensor) -> None:
    out = emb({"f": Jagged.single(ids)})["f"]
    (out * weight).sum().backward()
    emb.step()


def time_worker(capacity: str, rounds: str, steps: str) -> dict:
    capacity, rounds, steps = int(capacity), int(rounds), int(steps)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(10 + rank)
    # ids drawn from 90% of the static table's C x W rows: the owners' hash shares then fit C
    space = int(0.9 * capacity * world)
    variants = {k: _collection(k, capacity, world, rank) for k in ("static", "steady", "churn")}
    weight = torch.randn(BATCH, DIM, generator=g)

    def ids_for(kind: str) -> torch.Tensor:
        if kind == "churn":  # 10x the total capacity of distinct ids, as raw int64 values
            return _zipf(BATCH, 10 * capacity * world, g) * SCATTER
        base = _zipf(BATCH, space, g)
        return base if kind == "static" else base * SCATTER

    for block in torch.split(torch.arange(space), BATCH):  # warm-up: every steady id admitted
        _step(variants["steady"], block * SCATTER, weight[: len(block)])
        _step(variants["static"], block, weight[: len(block)])
    churn = variants["churn"].dynamic["t"]
    for _ in range(10_000):  # warm-up: the churn table full (its own row for every id it holds)
        _step(variants["churn"], ids_for("churn"), weight)
        full = torch.tensor([float(churn.occupancy == churn.capacity)])
        dist.all_reduce(full, op=dist.ReduceOp.MIN)
        if full.item():
            break
    before = {k: dict(variants[k].dynamic["t"].counters) for k in ("steady", "churn")}
    per_round = {k: [] for k in variants}
    for _ in range(rounds):
        spent = dict.fromkeys(variants, 0.0)
        for _ in range(steps):
            for kind, emb in variants.items():  # alternate step by step
                batch = ids_for(kind)
                dist.barrier()
                start = time.perf_counter()
                _step(emb, batch, weight)
                spent[kind] += time.perf_counter() - start
        for kind in variants:
            per_round[kind].append(1e3 * spent[kind] / steps)
    timed = {k: {c: variants[k].dynamic["t"].counters[c] - before[k][c] for c in before[k]}
             for k in ("steady", "churn")}
    return {"ms_per_step": per_round, "while_timed": timed, "churn_occupancy": churn.occupancy}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory_run(capacity: int, blocks: int = 20) -> dict:
    """Held bytes and RSS of one dynamic table while fresh ids (each seen twice) stream in."""
    torch.set_num_threads(1)
    table = TableConfig("t", 0, DIM, ("f",), optimizer="adagrad", kind="dynamic", capacity=capacity, admit_after=2)
    emb = ShardedEmbeddingCollection(plan_tables([table], 1, {}), 0, seed=1)
    index = emb.dynamic["t"]
    g = torch.Generator().manual_seed(0)
    per_block = 10 * capacity // blocks
    rows = []
    for block in range(blocks):
        fresh = torch.randint(0, 2**62, (per_block,), generator=g)
        for chunk in torch.split(fresh, BATCH // 2):
            _step(emb, chunk.repeat(2), torch.ones(len(chunk) * 2, DIM))
        shard = emb.shards["t"]
        tensors = [shard, index.keys, index.rows, index.taken, index.last_used, index.uses, index.sketch,
                   *[v for v in emb.optimizers["t"].state[shard].values() if torch.is_tensor(v)]]
        rows.append({"distinct_ids_seen": (block + 1) * per_block, "occupancy": index.occupancy,
                     "held_bytes": sum(t.numel() * t.element_size() for t in tensors if t is not None),
                     "rss_mib": _rss_mib()})
    full = [r for r in rows if r["occupancy"] == capacity]
    held = [r["held_bytes"] for r in full]
    rss = [r["rss_mib"] for r in full]
    return {"capacity": capacity, "blocks": rows,
            "held_bytes_max_over_min_once_full": max(held) / min(held),
            "rss_max_over_min_once_full": max(rss) / min(rss),
            "evictions": index.counters["evictions"]}


def placement_run(rounds: int, steps: int, out: Path) -> dict:
    """World 1 on CUDA (gpu_check.sh): a static 1M x 16 table and a dynamic one of the same
    capacity, each placed on the accelerator and on the host (rows moved to the GPU after the
    lookup): ms per lookup + backward + Adagrad step, alternated, medians over rounds."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    variants = {}
    for device in ("accelerator", "host"):
        static = TableConfig("t", 1_000_000, DIM, ("f",), optimizer="adagrad", device=device)
        dynamic = TableConfig("t", 0, DIM, ("f",), optimizer="adagrad", kind="dynamic", capacity=1_000_000,
                              device=device)
        variants[f"static_{device}"] = ShardedEmbeddingCollection(plan_tables([static], 1, {}), 0, seed=1, device="cuda")
        variants[f"dynamic_{device}"] = ShardedEmbeddingCollection(plan_tables([dynamic], 1, {}), 0, seed=1,
                                                                   device="cuda")
    weight = torch.randn(BATCH, DIM, generator=g).cuda()
    for emb in variants.values():
        for _ in range(5):
            _step(emb, _zipf(BATCH, 900_000, g), weight)
    per_round = {k: [] for k in variants}
    for _ in range(rounds):
        spent = dict.fromkeys(variants, 0.0)
        for _ in range(steps):
            batch = _zipf(BATCH, 900_000, g)
            for kind, emb in variants.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                _step(emb, batch, weight)
                torch.cuda.synchronize()
                spent[kind] += time.perf_counter() - start
        for kind in variants:
            per_round[kind].append(1e3 * spent[kind] / steps)
    report = {"device": torch.cuda.get_device_name(0), "batch_ids": BATCH, "rows": 1_000_000, "dim": DIM,
              "ms_per_step_median": {k: statistics.median(v) for k, v in per_round.items()},
              "ms_per_step": per_round}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["ms_per_step_median"]))
    return report


def summarise(results: list[dict]) -> dict:
    per_round = results[0]["ms_per_step"]  # rank 0 (every rank waits at the same barriers)
    out = {}
    for kind in ("steady", "churn"):
        ratios = [d / s for d, s in zip(per_round[kind], per_round["static"])]
        out[kind] = {"ms_per_step_median": statistics.median(per_round[kind]),
                     "ratio_to_static_median": statistics.median(ratios), "ratios": ratios}
    out["static_ms_per_step_median"] = statistics.median(per_round["static"])
    out["ranks"] = {k: v for k, v in results[0].items() if k != "ms_per_step"}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--placements", metavar="OUT_JSON",
                        help="on a CUDA machine: time accelerator vs host placement at world 1 instead")
    parser.add_argument("--worker")
    args, rest = parser.parse_known_args()
    if args.worker:
        return rank_main({"time": time_worker}, args.worker, rest)
    if args.placements:
        placement_run(args.rounds, args.steps, Path(args.placements))
        return 0
    report = {"machine": machine(), "batch_ids_per_rank": BATCH, "dim": DIM,
              "capacity_per_rank": args.capacity, "rounds": args.rounds, "steps_per_round": args.steps}
    for world in (1, 2):
        results = run_ranks(__file__, "time", world, str(args.capacity), str(args.rounds), str(args.steps),
                            timeout=1800)
        report[f"world_{world}"] = summarise(results)
        print(f"world {world}: static {report[f'world_{world}']['static_ms_per_step_median']:.2f} ms/step; "
              f"dynamic steady {report[f'world_{world}']['steady']['ratio_to_static_median']:.2f}x, "
              f"churn {report[f'world_{world}']['churn']['ratio_to_static_median']:.2f}x", flush=True)
    report["memory"] = memory_run(args.capacity)
    m = report["memory"]
    print(f"memory at capacity {m['capacity']}, ids to 10x: held bytes max/min {m['held_bytes_max_over_min_once_full']:.3f}, "
          f"RSS max/min {m['rss_max_over_min_once_full']:.3f}, {m['evictions']} evictions")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
