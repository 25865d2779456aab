"""Flat vs hierarchical exchanges on an emulated cluster (issue 37 items 4-5).

H hosts x R ranks (`emulated_cluster`: network namespaces, the links between hosts limited by
tbf), each rank a process started with the launcher's variables (RANK, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK: the topology comes from them, `engine.hosts.resolve_topology`),
gloo over the namespace's interface. Every rank looks up a CTR-shaped micro-batch of bags in
sharded row-wise tables (the traffic of a configuration whose sharded tables dominate: no dense
model), pooled on their owners (``exchange: pooled``) or by the requester after the
deduplicated row exchange (``exchange: rows``), backward, sparse step; per exchange it reports
steps/s, tasks/s (``bags_per_task`` bags make one task; median of ``reps`` repetitions, the
exchanges interleaved) and the bytes it sent across hosts per step (the counters',
`comm.CommStats.total_cross_host`); row runs also the ids' measured overlap between the ranks
of a host (`id_overlap`).

    python benchmarks/topology.py                     # pooled and rows: 2 x 2 at 1gbit and 100mbit, 1 x 4
    python benchmarks/topology.py --check             # only: hierarchical equals flat on 2 x 2
    python benchmarks/topology.py --prefix gmx --subnet 9   # namespaces of another name (see emulated_cluster)
    python benchmarks/topology.py --links             # only: the links' all-to-all curves (kept runs)

The links' curves (``links`` in the results, used by topology_model.py): on each limited link,
the seconds of one bare inter-host all-to-all (no tables: ``torch.distributed.all_to_all_single``,
both hosts sending at once, as the exchanges do) for a sweep of the bytes a rank sends across
hosts, in the flat pattern (every rank to every rank) and the gateway pattern (each rank to its
peer of the same local index on the other hosts: the hierarchical exchanges' inter-host step).

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
from emulated_cluster import PREFIX, emulated_cluster  # noqa: E402

PORT = 29512
SETTINGS = dict(tables=2, rows=200_000, dim=64, bags=512, length=32, steps=6, warmup=1, reps=5, bags_per_task=32,
                exchange="pooled")
# (hosts, ranks per host, inter-host rate, settings changed) of a full run
RUNS = [(2, 2, "1gbit", {}), (2, 2, "100mbit", {}), (1, 4, None, {}),
        (2, 2, "1gbit", {"exchange": "rows"}), (2, 2, "100mbit", {"exchange": "rows"}), (1, 4, None, {"exchange": "rows"}),
        (2, 2, "100mbit", {"exchange": "rows", "rows": 20_000}), (1, 4, None, {"exchange": "rows", "rows": 20_000})]


def _tables(n: int, rows: int, dim: int, exchange: str = "pooled"):
    from gmeta_ds.embedding.tables import TableConfig

    return [TableConfig(f"t{k}", rows, dim, (f"f{k}",), pooling="sum", exchange=exchange, optimizer="sgd")
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
    from gmeta_ds.engine.hosts import resolve_topology

    rank, world = dist.get_rank(), dist.get_world_size()
    base = plan_tables(_tables(s["tables"], s["rows"], s["dim"], s["exchange"]), world, {})
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


# Bytes a rank sends across hosts in one all-to-all, swept by the links' curves.
LINK_BYTES = (62_500, 125_000, 250_000, 500_000, 1_000_000, 2_000_000, 4_000_000)


def _links(s: dict) -> None:
    """Seconds (median of ``reps``, the slowest rank's) of one inter-host all-to-all per pattern
    and size (see the module docstring): a curve of what the link carries, not the nominal rate."""
    import statistics

    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    per_host = int(os.environ["LOCAL_WORLD_SIZE"])
    hosts, local = world // per_host, rank % per_host
    curves = {}
    for pattern in ("flat", "gateway"):
        curve = []
        for nbytes in LINK_BYTES:
            if pattern == "flat":  # uniform: the same to each rank, (W - R) of them on other hosts
                splits = [nbytes // 4 // (world - per_host)] * world
            else:
                splits = [nbytes // 4 // (hosts - 1) if (r % per_host == local and r // per_host != rank // per_host)
                          else 0 for r in range(world)]
            send, recv = torch.zeros(sum(splits)), torch.empty(sum(splits))
            times = []
            for rep in range(s["warmup"] + s["reps"] + 2):
                dist.barrier()
                start = time.perf_counter()
                dist.all_to_all_single(recv, send, splits, splits)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(float(elapsed))
            curve.append([nbytes, statistics.median(times[s["warmup"]:])])
        curves[pattern] = curve
    print(json.dumps({"rank": rank, "links": curves}), flush=True)


def worker(mode: str, settings: dict) -> None:
    """One rank: the launcher's variables in the environment (see the module docstring)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        if mode == "links":
            _links(settings)
        else:
            colls = _collections(settings, 120)
            (_check if mode == "check" else _bench)(colls, settings)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def id_overlap(s: dict, ranks_per_host: int, step: int = 0) -> tuple[float, float]:
    """The ids' overlap between the ranks of one host, per table and averaged: the sum of the
    ranks' distinct ids over the distinct ids of their union (what the hierarchical row
    exchange, deduplicating a host's requests before they cross, divides the flat row bytes by);
    and a rank's distinct ids per id looked up (`sparse.BagStats.distinct_ratio`)."""
    import torch

    ratios, distinct = [], []
    for k in range(s["tables"]):
        ids = [_bags(rank, step, s)[f"f{k}"].values.unique() for rank in range(ranks_per_host)]
        ratios.append(sum(len(i) for i in ids) / len(torch.cat(ids).unique()))
        distinct.append(len(ids[0]) / (s["bags"] * s["length"]))
    return sum(ratios) / len(ratios), sum(distinct) / len(distinct)


def launch(hosts, ranks_per_host: int, mode: str, settings: dict, timeout: float = 300,
           script: str = __file__) -> list[dict]:
    """Start ``ranks_per_host`` ranks of ``script --worker mode`` on each emulated host (`Host`),
    wait, return each rank's JSON line; raises with every rank's output when one fails."""
    world = len(hosts) * ranks_per_host
    procs = []
    for rank in range(world):
        host = hosts[rank // ranks_per_host]
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % ranks_per_host),
               "LOCAL_WORLD_SIZE": str(ranks_per_host), "GROUP_RANK": str(rank // ranks_per_host),
               "MASTER_ADDR": hosts[0].address, "MASTER_PORT": str(PORT), "GLOO_SOCKET_IFNAME": host.interface,
               "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, script, "--worker", mode, "--settings", json.dumps(settings)]
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


def _run(hosts_n: int, ranks: int, rate: str | None, settings: dict, prefix: str, subnet: int) -> dict:
    """One emulated cluster, one benchmark on it: rank 0's result, with the run's shape and,
    for the row exchange, the ids' measured overlap between the ranks of a host."""
    with emulated_cluster(hosts_n, rate, prefix, subnet) as hosts:
        first = launch(hosts, ranks, "bench", settings)[0]
    run = {"hosts": hosts_n, "ranks_per_host": ranks, "rate": rate or "loopback", "exchange": settings["exchange"],
           "rows": settings["rows"], **first}
    run.pop("rank")
    if settings["exchange"] == "rows":
        run["id_overlap"], run["distinct_ratio"] = id_overlap(settings, ranks)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("check", "bench", "links"))
    parser.add_argument("--settings", default=json.dumps(SETTINGS))
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--links", action="store_true", help="only measure the links' all-to-all curves")
    parser.add_argument("--prefix", default=PREFIX, help="name prefix of the namespaces (unique per user)")
    parser.add_argument("--subnet", type=int, default=1, help="third octet of the hosts' 10.233.S.0/24")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "topology.json"))
    args = parser.parse_args()
    settings = {**SETTINGS, **json.loads(args.settings)}
    if args.worker:
        return worker(args.worker, settings)
    if args.check:
        for exchange in ("pooled", "rows"):
            with emulated_cluster(2, None, args.prefix, args.subnet) as hosts:
                print(launch(hosts, 2, "check", {**settings, "exchange": exchange}))
        return None
    out = Path(args.out)
    links = {}
    for rate in sorted({run[2] for run in RUNS if run[2]}):
        with emulated_cluster(2, rate, args.prefix, args.subnet) as hosts:
            links[rate] = launch(hosts, 2, "links", settings)[0]["links"]
        print(json.dumps({"links": rate, **links[rate]}), flush=True)
    if args.links:
        kept = json.loads(out.read_text())
        out.write_text(json.dumps({**kept, "links": links}, indent=2) + "\n")
        return None
    runs = []
    for hosts_n, ranks, rate, changed in RUNS:
        runs.append(_run(hosts_n, ranks, rate, {**settings, **changed}, args.prefix, args.subnet))
        print(json.dumps(runs[-1]), flush=True)
    out.write_text(json.dumps({"settings": settings, "runs": runs, "links": links}, indent=2) + "\n")
    return None


if __name__ == "__main__":
    main()
