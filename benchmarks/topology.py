"""Flat vs hierarchical pooled exchange on an emulated cluster (issue 37 items 4-5).

H hosts x R ranks (`emulated_cluster`: network namespaces, the links between hosts limited by
tbf), each rank a process started with the launcher's variables (RANK, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK: the topology comes from them, `engine.topology.resolve_topology`),
gloo over the namespace's interface. Every rank looks up a CTR-shaped micro-batch of bags in
sharded row-wise tables pooled on their owners (the traffic of a configuration whose sharded
tables dominate: no dense model), backward, sparse step; per exchange it reports steps/s,
tasks/s (``bags_per_task`` bags make one task; median of ``reps`` repetitions, the exchanges
interleaved) and the bytes it sent across hosts per step
(the counters', `comm.CommStats.total_cross_host`).

    python benchmarks/topology.py                     # 2 x 2 at 1gbit and 100mbit, and 1 x 4
    python benchmarks/topology.py --check             # only: hierarchical equals flat on 2 x 2

Root only (namespaces). ``--worker`` is the per-rank entry point the driver starts.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (sets OMP_WAIT_POLICY before torch; puts the checkout on sys.path)
from emulated_cluster import emulated_cluster  # noqa: E402

PORT = 29512
SETTINGS = dict(tables=2, rows=200_000, dim=64, bags=512, length=32, steps=6, warmup=1, reps=5, bags_per_task=32)


def _tables(n: int, rows: int, dim: int):
    from gmeta_ds.embedding.tables import TableConfig

    return [TableConfig(f"t{k}", rows, dim, (f"f{k}",), pooling="sum", exchange="pooled", optimizer="sgd")
            for k in range(n)]


def _bags(rank: int, step: int, s: dict):
    """Each rank's bags: ``length`` ids per bag, skewed (ids drawn as rows * u^3)."""
    import torch

    from gmeta_ds.sparse import Jagged

    g = torch.Generator().manual_seed(1000 * rank + step)
    offsets = torch.arange(0, s["bags"] * s["length"] + 1, s["length"])
    return {f"f{k}": Jagged((s["rows"] * torch.rand(s["bags"] * s["length"], generator=g) ** 3).long(), offsets)
            for k in range(s["tables"])}


def _collections(s: dict, timeout_s: int):
    """A flat and a hierarchical collection of the same tables on the launcher's topology."""
    import torch.distributed as dist

    from gmeta_ds.embedding.plan import plan_tables, with_topology
    from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
    from gmeta_ds.engine.topology import resolve_topology

    rank, world = dist.get_rank(), dist.get_world_size()
    base = plan_tables(_tables(s["tables"], s["rows"], s["dim"]), world, {})
    topology = resolve_topology(0, world)
    return {how: ShardedEmbeddingCollection(with_topology(base, topology, how), rank, seed=3, device="cpu",
                                            timeout_s=timeout_s)
            for how in ("flat", "hierarchical")}


def _check(colls: dict, s: dict) -> None:
    """Forward, then row gradients averaged over ranks, equal between the two exchanges."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    outs = {}
    for how, coll in colls.items():
        outs[how] = coll(_bags(rank, 0, s))
        g = torch.Generator().manual_seed(rank)
        sum((v * torch.randn(v.shape, generator=g)).sum() for _, v in sorted(outs[how].items())).backward()
        coll.finish_gradients()
    for name in outs["flat"]:
        torch.testing.assert_close(outs["hierarchical"][name], outs["flat"][name], msg=f"forward {name}")
    for name, shard in colls["flat"].shards.items():
        torch.testing.assert_close(colls["hierarchical"].shards[name].grad.to_dense(), shard.grad.to_dense(),
                                   msg=f"gradient {name}")
    print(json.dumps({"rank": rank, "check": "ok"}), flush=True)


def _timed(coll, s: dict, rank: int, rep: int) -> float:
    """Seconds of ``steps`` steps after ``warmup`` ones (the slowest rank's), counters reset."""
    import torch
    import torch.distributed as dist

    for step in range(s["warmup"] + s["steps"]):
        if step == s["warmup"]:
            dist.barrier()
            coll.stats.reset()
            start = time.perf_counter()
        out = coll(_bags(rank, 100 * rep + step, s))
        sum(v.sum() for v in out.values()).backward()
        coll.step()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _bench(colls: dict, s: dict) -> None:
    """Steps/s (median over ``reps`` repetitions, the two exchanges interleaved) and cross-host
    bytes per step of each exchange."""
    import statistics

    import torch.distributed as dist

    rank = dist.get_rank()
    times = {how: [] for how in colls}
    for rep in range(s["reps"]):
        for how, coll in colls.items():
            times[how].append(_timed(coll, s, rank, rep))
    result = {"rank": rank}
    for how, coll in colls.items():
        steps_s = s["steps"] / statistics.median(times[how])
        result[how] = {"steps_per_s": steps_s, "tasks_per_s": steps_s * s["bags"] / s["bags_per_task"] *
                       dist.get_world_size(), "cross_host_bytes_per_step": coll.stats.total_cross_host() / s["steps"],
                       "cross_host_by_stage": {k: v / s["steps"] for k, v in sorted(coll.stats.cross.items()) if v},
                       "step_s": times[how]}
    print(json.dumps(result), flush=True)


def worker(mode: str, settings: dict) -> None:
    """One rank: the launcher's variables in the environment (see the module docstring)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        colls = _collections(settings, 120)
        (_check if mode == "check" else _bench)(colls, settings)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def id_overlap(s: dict, ranks_per_host: int, step: int = 0) -> float:
    """The ids' overlap between the ranks of one host, per table and averaged: the sum of the
    ranks' distinct ids over the distinct ids of their union (what a hierarchical row exchange,
    deduplicating a host's requests before they cross, would divide the flat row bytes by)."""
    import torch

    ratios = []
    for k in range(s["tables"]):
        ids = [_bags(rank, step, s)[f"f{k}"].values.unique() for rank in range(ranks_per_host)]
        ratios.append(sum(len(i) for i in ids) / len(torch.cat(ids).unique()))
    return sum(ratios) / len(ratios)


def launch(hosts, ranks_per_host: int, mode: str, settings: dict, timeout: float = 300) -> list[dict]:
    """Start ``ranks_per_host`` ranks on each emulated host (`Host`), wait, return each rank's
    JSON line; raises with every rank's output when one fails."""
    world = len(hosts) * ranks_per_host
    procs = []
    for rank in range(world):
        host = hosts[rank // ranks_per_host]
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % ranks_per_host),
               "LOCAL_WORLD_SIZE": str(ranks_per_host), "GROUP_RANK": str(rank // ranks_per_host),
               "MASTER_ADDR": hosts[0].address, "MASTER_PORT": str(PORT), "GLOO_SOCKET_IFNAME": host.interface,
               "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, __file__, "--worker", mode, "--settings", json.dumps(settings)]
        procs.append(subprocess.Popen(host.command(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(f"--- rank {r} (exit {p.returncode})\n{o[-2000:]}\n{e[-3000:]}"
                                     for r, (p, (o, e)) in enumerate(zip(procs, outs))))
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("check", "bench"))
    parser.add_argument("--settings", default=json.dumps(SETTINGS))
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "topology.json"))
    args = parser.parse_args()
    settings = {**SETTINGS, **json.loads(args.settings)}
    if args.worker:
        return worker(args.worker, settings)
    if args.check:
        with emulated_cluster(2) as hosts:
            print(launch(hosts, 2, "check", settings))
        return None
    runs = []
    for hosts_n, ranks, rate in ((2, 2, "1gbit"), (2, 2, "100mbit"), (1, 4, None)):
        with emulated_cluster(hosts_n, rate) as hosts:
            first = launch(hosts, ranks, "bench", settings)[0]
        run = {"hosts": hosts_n, "ranks_per_host": ranks, "rate": rate or "loopback", **first}
        run.pop("rank")
        runs.append(run)
        print(json.dumps(run), flush=True)
    overlap = id_overlap(settings, 2)
    print(f"ids' overlap between the 2 ranks of a host: {overlap:.3f}", flush=True)
    Path(args.out).write_text(json.dumps({"settings": settings, "runs": runs, "id_overlap_2_ranks": overlap},
                                         indent=2) + "\n")
    return None


if __name__ == "__main__":
    main()
