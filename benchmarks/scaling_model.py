"""A calibrated model of meta-step time, checked against the W = 2 and 4 runs of
benchmarks/scaling.py, then extrapolated to W = 8 ... 1024 GPUs (NVLink in a node of 8,
InfiniBand or Ethernet between nodes).

Model (one rank, one meta-step; B_r tasks per rank in M micro-batches; nothing overlaps: the
profiles show every collective on the critical path of its phase):

    T(W) = t_1 B_r s + t_fixed s + D_W + T_dense + M T_a2a + T_small,   s = max(1, W / cores)

  t_1      compute per task (lookup, inner loop, outer loss and backward) of a one-thread rank,
           averaged over the ranks (W >= 2 runs one thread per rank)
  t_fixed  per-step work that does not scale with tasks (data, optimizer step, sparse step)
  s        time-sharing when W ranks exceed this machine's cores (1 on GPUs)
  D_W      rank imbalance: the step waits for the slowest rank, E[max_r c_r] - mean_r c_r of the
           per-rank compute c_r. Ranks' compute varies at random (rank r's share of the machine,
           its tasks' sizes), so with spread sigma, D_W = sigma e_W, e_W = E[max of W standard
           normals] (e_2 = 0.564, e_4 = 1.029, e_1024 = 3.2). Charged once per meta-step (the
           W = 2 profile puts the wait at the outer backward's gradient reduction); the check
           also shows M D_W (a wait at every micro-batch's all-to-alls). When ranks exceed
           cores (s > 1) it is 0: a rank that waits blocks in gloo and yields its core to
           another rank, so the waits are filled with work and the step is the total CPU work
           over the cores
  T_dense  the dense gradient under DeepSpeed ZeRO, S = 4 P bytes (P engine parameters):
             stage 0    all-reduce once per meta-step            2 (W-1)/W S
             stage 1    reduce-scatter + all-gather once         2 (W-1)/W S
             stage 2    reduce-scatter per micro-batch + all-gather  (M + 1) (W-1)/W S
             stage 3    + a parameter gather per micro-batch     (2M + 1) (W-1)/W S
  T_a2a    the sharded lookup's 4 all-to-alls per micro-batch (counts, ids, rows, row grads);
           bytes per rank from benchmarks/comm_model.py (E[unique ids] under Zipf)
  T_small  the per-meta-step small all-reduces (non-finite flag, DeepSpeed's step scalar,
           replicated tables' gradient), counted from the profile

Collective times, alpha-beta (alpha per hop, beta bytes/s):
    ring all-reduce of S:   2 (W-1) alpha + 2 (W-1)/W S / beta
    reduce-scatter / all-gather:  (W-1) alpha + (W-1)/W S / beta
    all-to-all sending V:   (W-1) alpha + V / beta
On the GPU cluster (g = 8 GPUs per node, N = W/g nodes) collectives are hierarchical:
    all-reduce  2 (g-1) a_nvl + 2 (g-1)/g S / b_nvl + 2 log2(N) a_net + 2 (N-1)/N (S/g) / b_net
                (reduce-scatter in the node, tree/ring across nodes on 1/g of the data per rail,
                 all-gather in the node; half of it for a reduce-scatter or an all-gather)
    all-to-all  flat: a_net + (W-1) o_peer + max(V (g-1)/(W-1) / b_nvl, V (W-g)/(W-1) / b_net)
                hierarchical (intra-node first): 2 a_nvl + 2 V / b_nvl + a_net + (N-1) o_peer
                + V (W-g)/(W-1) / (o b_net)  (8x fewer, 8x larger inter-node messages; o the
                ids' overlap between the node's g ranks, g E[U(n)] / E[U(g n)] under Zipf: the
                node's gateway deduplicates its requests, `sharding/hierarchical_rows.py`; the
                two-level model of the emulated runs is benchmarks/topology_model.py)
Outer synchronisation every k meta-steps (local-SGD style; it changes the algorithm) divides
T_dense and T_small by k; the all-to-alls cannot be skipped (every lookup needs its rows).

Calibration on this machine (per config of benchmarks/results/scaling.json):
  t_fixed  the world-1 tasks/s (unprofiled), split by the world-1 profile's phase shares
  t_1      the strong W = 2 profile: the ranks' mean non-collective time in the compute phases
           per task, times r (below)
  sigma    the strong W = 2 profile: half the difference of the two ranks' collective time
           (the wait of the rank that arrives first) is E[max] - mean = sigma e_2; times r
  r        the profiler's slow-down of compute, measured on the strong W = 2 run itself: the
           factor that makes the model's step equal the unprofiled run's median step, with
           t_fixed and the collectives fixed (``unprofiled_scale``). The wait is a difference
           of the ranks' compute, so it scales with it; alpha (blocked in gloo) does not
  alpha    the strong W = 2 profile: the collective time of the rank that arrives last (it
           waits least) over the hops it implies, a genuine per-hop cost (the wait is in
           sigma); the idle-link gloo microbenchmark (``--link-bench``, 127.0.0.1) beside it
  beta     the microbenchmark's large-message slope (bytes here are small)
The per-hop time alpha is blocked time, not per-op work, and is taken unscaled. With several profile sets (``scaling.py --profile-repeats N``, or
``--profile-only --append``), each set is calibrated on its own (its W = 1 and W = 2 profiles
ran back to back) and every parameter is the median over the sets: one profiled run is as
exposed to the machine's other load as one unprofiled run. The strong W = 2 run is therefore a calibration run, not a check (its unprofiled tasks/s fixes
r, so the model matches it by construction); weak W = 2 and all W = 4 runs are held out.
On GPUs (s = 1) the spread comes from uneven tasks per rank: a task costs in proportion to its
interactions (log-uniform, coefficient of variation cv), so sigma = t_1 sqrt(B_r) cv (no padding
to the longest task assumed; padded, sigma = 0). Published link figures and the GPU per-task time
(``--gpu-task-us``, not measured here) drive the extrapolation.

    python benchmarks/scaling_model.py [--link-bench] [--gpu-task-us 20] [--gpu-fixed-ms 1]
                                       [--strong-tasks 4096] [--big-rows 20000000]

Two sites over a slow link (issue 38): the inter-site term of benchmarks/sites_model.py.

Reads benchmarks/results/scaling.json, writes benchmarks/results/scaling_model.json (the
microbenchmark's numbers are kept there and reused until ``--link-bench`` reruns it, ~15 s).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, LaunchFailure, rank_main, run_ranks  # first: OMP_WAIT_POLICY

# isort: split

import argparse
import json
import math
import re
import statistics
import time

import numpy as np
from comm_model import expected_unique, sharded_bytes, zipf_probs
from sites_model import two_sites

SCALING = REPO / "benchmarks" / "results" / "scaling.json"
RESULTS = REPO / "benchmarks" / "results" / "scaling_model.json"
COMPUTE_PHASES = ("lookup", "inner_loop", "nonfinite_check", "outer_backward")
GPUS_PER_NODE = 8
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
# Published figures (see docs/performance.md): bandwidth per GPU per direction as NCCL achieves
# it, and per-hop latency.
LINKS = {
    "nvlink": {"bw": 360e9, "alpha": 3e-6,
               "source": "NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional = 450 GB/s per direction; "
                         "nccl-tests all-reduce bus bandwidth ~360-480 GB/s on 8 GPUs; ~2-5 us per hop"},
    "ib": {"bw": 40e9, "alpha": 5e-6, "o_peer": 1e-6,
           "source": "InfiniBand NDR 400 Gb/s = 50 GB/s per GPU (one ConnectX-7 per GPU), ~80% as "
                     "NCCL bus bandwidth; ~1-2 us port-to-port, ~5 us per NCCL hop"},
    "eth100": {"bw": 10e9, "alpha": 15e-6, "o_peer": 3e-6,
               "source": "100 GbE (RoCE) per GPU = 12.5 GB/s line rate, ~80%; ~10-30 us latency"},
    "eth25": {"bw": 3.125e9 / GPUS_PER_NODE * 0.8, "alpha": 30e-6, "o_peer": 5e-6,
              "source": "25 GbE per node (cloud VMs) = 3.1 GB/s shared by 8 GPUs, ~80%; ~30 us"},
}
LINK_SIZES = (4, 4096, 65536, 1048576)


# ------------------------------------------------------------------ link micro-benchmark
def link_worker(iters: str) -> dict:
    """Median seconds of gloo all_reduce / all_to_all / all_gather per size (bytes per rank)."""
    import torch
    import torch.distributed as dist

    world, out = dist.get_world_size(), {}
    for kind in ("all_reduce", "all_to_all", "all_gather"):
        for size in LINK_SIZES:
            n = max(world, size // 4)
            x, outs, times = torch.ones(n), [torch.empty(n) for _ in range(world)], []
            for _ in range(int(iters) + 3):
                dist.barrier()
                start = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(x)
                elif kind == "all_to_all":
                    dist.all_to_all_single(torch.empty(n), x)
                else:
                    dist.all_gather(outs, x)
                times.append(time.perf_counter() - start)
            out[f"{kind}:{size}"] = statistics.median(times[3:])
    return out


def link_bench(worlds=(2, 4), iters: int = 20) -> dict:
    """Per W: each collective's slowest-rank median time, and alpha (per hop, from the
    smallest message) and beta (bytes/s moved per rank, from the largest)."""
    out = {}
    for world in worlds:
        ranks = run_ranks(__file__, "link", world, str(iters), timeout=60)
        t = {k: max(r[k] for r in ranks) for k in ranks[0] if k != "rank"}
        frac, small, big = (world - 1) / world, LINK_SIZES[0], LINK_SIZES[-1]
        ar = t[f"all_reduce:{small}"] / (2 * (world - 1))
        beta = 2 * frac * big / (t[f"all_reduce:{big}"] - t[f"all_reduce:{small}"])
        out[str(world)] = {"seconds": t, "alpha_all_reduce": ar,
                           "alpha_all_to_all": t[f"all_to_all:{small}"] / (world - 1),
                           "alpha_all_gather": t[f"all_gather:{small}"] / (world - 1), "beta": beta}
    return out


# ------------------------------------------------------------------ the model's inputs
def model_facts(config: str, big_rows: int | None = None) -> dict:
    """Engine parameters, replicated-table floats (reduced in the sparse step), sharded
    tables (rows, dim), ids per task and field, from the config (``big_rows``: the item_id
    table grown to that many rows, sharded)."""
    from gmeta_ds.config import load_config
    from gmeta_ds.data.synthetic import synthetic_fields
    from gmeta_ds.workloads.ctr import build_learner, embedding_plan

    cfg = load_config(REPO / config)
    fields = synthetic_fields(cfg.data.synthetic)
    sharded = cfg.embedding.sharding == "sharded"
    params = sum(p.numel() for p in build_learner(cfg, fields, with_tables=not sharded).parameters())
    tables, replicated = [], 0
    if sharded:
        for t in embedding_plan(cfg, fields, 2).tables.values():
            if t.kind == "replicated":
                replicated += t.table.num_rows * (t.table.dim + 1)  # + touched-row flag
            else:
                rows = big_rows if big_rows and t.table.name == "item_id" else t.table.num_rows
                tables.append((rows, t.table.dim))
    syn = cfg.data.synthetic
    lo, hi = syn.min_interactions, syn.max_interactions + 1
    mean, square = (hi - lo) / math.log(hi / lo), (hi * hi - lo * lo) / (2 * math.log(hi / lo))  # log-uniform
    return {"config": config, "dense_params": params, "replicated_floats": replicated,
            "sharded_tables": tables, "ids_per_task": mean, "ids_cv": math.sqrt(square / mean ** 2 - 1)}


def expected_max_normal(world: int) -> float:
    """E[max of ``world`` independent standard normals] (0 for one)."""
    if world <= 1:
        return 0.0
    x = np.linspace(-9.0, 9.0, 36001)
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = np.clip(np.cumsum(pdf) * (x[1] - x[0]), 0.0, 1.0)
    return float(np.sum(x * world * pdf * cdf ** (world - 1)) * (x[1] - x[0]))


_PROBS: dict[int, np.ndarray] = {}


def a2a_bytes(facts: dict, world: int, tasks_per_micro: float) -> list[float]:
    """Bytes one rank sends in each of the 4 all-to-alls of a micro-batch (counts, ids, rows,
    row gradients), from comm_model's expectation over the sharded tables."""
    if world == 1 or not facts["sharded_tables"]:
        return [0.0] * 4
    n = tasks_per_micro * facts["ids_per_task"]
    stages = {"input_dist": 0.0, "output_dist": 0.0, "output_dist_backward": 0.0}
    for rows, dim in facts["sharded_tables"]:
        if rows not in _PROBS:
            _PROBS[rows] = zipf_probs(rows)
        b = sharded_bytes(world, expected_unique(int(n), _PROBS[rows]), dim)
        for k in stages:
            stages[k] += b[k]
    counts = 8 * len(facts["sharded_tables"]) * (world - 1)
    return [counts, stages["input_dist"] - counts, stages["output_dist"], stages["output_dist_backward"]]


def node_overlap(facts: dict, world: int, tasks_per_micro: float) -> float:
    """The ids' overlap between the g ranks of a node (their distinct ids summed over the
    distinct ids of their union, E[U] under Zipf): what the hierarchical row exchange divides
    the inter-node ids, rows and row gradients by (`sharding/hierarchical_rows.py`)."""
    g, _ = _hier(world)
    n = int(tasks_per_micro * facts["ids_per_task"])
    if g == 1 or not facts["sharded_tables"] or n == 0:
        return 1.0
    for rows, _ in facts["sharded_tables"]:
        _PROBS[rows] = _PROBS[rows] if rows in _PROBS else zipf_probs(rows)
    apart = sum(g * expected_unique(n, _PROBS[r]) for r, _ in facts["sharded_tables"])
    return apart / sum(expected_unique(g * n, _PROBS[r]) for r, _ in facts["sharded_tables"])


def dense_bytes(stage: int, params: int, micro: int) -> tuple[float, float]:
    """(all-reduce bytes S, reduce-scatter/all-gather passes over S) of the dense gradient per
    meta-step: stage 0 one all-reduce; 1: one reduce-scatter + all-gather; 2: a reduce-scatter
    per micro-batch + all-gather; 3: + a parameter gather per micro-batch."""
    passes = {0: 2, 1: 2, 2: micro + 1, 3: 2 * micro + 1}[stage]
    return 4.0 * params, passes


# ------------------------------------------------------------------ calibration (this machine)
def parse_micro(batch: str) -> int:
    return int(re.search(r"x (\d+) accumulation", batch).group(1))


def noncollective_ms(rank: dict, phases) -> float:
    return sum(rank["phases"][p]["ms"] - rank["phases"][p]["collective_ms"] for p in phases)


def calibrate(name: str, entry: dict, cores: int, link: dict | None) -> dict | None:
    """The median over the saved profile sets (``profiles``, else the one ``profile``) of each
    parameter of ``calibrate_one``: one profiled run, like one unprofiled run, is at the mercy of
    the machine's other load while it runs; the W = 1 and W = 2 profiles of a set ran back to
    back, so each set's t_1 (profiled W = 2 time less the W = 1 profile's cost) is a pair."""
    sets = [p for p in (entry.get("profiles") or [entry.get("profile", {})]) if "1" in p]
    cals = [c for c in (calibrate_one(name, entry, p, cores, link) for p in sets) if c is not None]
    if not cals:
        return None
    cal = dict(cals[0])
    for key, value in cals[0].items():
        if isinstance(value, float) and all(key in c for c in cals):
            cal[key] = statistics.median(c[key] for c in cals)
    cal["counts"] = {k: statistics.median(c["counts"][k] for c in cals) for k in cals[0]["counts"]}
    cal["profile_sets"] = len(cals)
    cal["per_set"] = [{k: c[k] for k in ("t1_raw_s", "t1_s", "sigma_s", "alpha_s", "t_fixed_s", "profiler_s_per_task")
                       if k in c} for c in cals]
    return cal


def calibrate_one(name: str, entry: dict, prof: dict, cores: int, link: dict | None) -> dict | None:
    """t_fixed from world 1; t_1, sigma and alpha from the strong W = 2 profile of one profile
    set (alpha else the microbenchmark, t_1 else world 1's per-task time x its busy cores)."""
    if "world1" not in entry or "1" not in prof:
        return None
    per_step = int(re.search(r"= (\d+) tasks/meta-step", entry["world1"]["batch"]).group(1))
    step_s = per_step / entry["world1"]["tasks_per_s"]
    r0 = prof["1"]["ranks"][0]
    compute_ms = sum(r0["phases"][p]["ms"] for p in COMPUTE_PHASES)
    inflation = step_s * 1e3 / r0["step_ms"]  # unprofiled / profiled
    cal = {"tasks_per_meta_step": per_step, "world1_step_s": step_s, "profile_scale": inflation,
           "profiler_s_per_task": (r0["step_ms"] * 1e-3 - step_s) / per_step,
           "t_task_s": compute_ms / r0["step_ms"] * step_s / per_step,
           "t_fixed_s": (r0["step_ms"] - compute_ms) / r0["step_ms"] * step_s,
           # cores world 1 keeps busy with its intra-op threads (CPU-seconds per task x tasks/s):
           # a rank of W >= 2 runs one thread, so its compute per task is t_task x this
           "world1_cores": min(float(cores), max(1.0, entry["world1"]["cpu_s_per_task"]
                                                * entry["world1"]["tasks_per_s"]))}
    p2 = next((prof[w] for w in sorted(prof, key=int) if int(w) > 1), None)
    counts = {"a2a_per_micro": 4.0, "small_all_reduce": 3.0, "all_gather": 1.0}
    cal["t1_s"] = cal["t_task_s"] * cal["world1_cores"]  # until a W >= 2 profile says better
    cal["sigma_s"] = 0.0
    if p2 is not None:
        w, micro = p2["world_size"], parse_micro(p2["batch"])
        tasks = int(re.search(r"= (\d+) tasks/meta-step", p2["batch"]).group(1)) // w
        coll = [r["collectives"] for r in p2["ranks"]]
        busy = [sum(v["ms"] for v in c.values()) for c in coll]
        cal["t1_raw_s"] = statistics.mean(noncollective_ms(r, COMPUTE_PHASES) for r in p2["ranks"]) * 1e-3 / tasks
        cal["t1_s"] = cal["t1_raw_s"] - cal["profiler_s_per_task"]
        # mean wait E[max] - mean = (max - min) / 2 at W = 2; at larger W the spread of the ranks' waits
        cal["sigma_s"] = (max(busy) - statistics.mean(busy)) * 1e-3 / expected_max_normal(w)
        calls = lambda kind: statistics.mean(c.get(kind, {}).get("calls", 0.0) for c in coll)
        counts = {"a2a_per_micro": calls("gloo:all_to_all") / micro,
                  "small_all_reduce": calls("gloo:all_reduce") - micro,  # ZeRO-2: one per micro-batch
                  "all_gather": calls("gloo:all_gather")}
        hops = ((counts["small_all_reduce"] + micro) * 2 * (w - 1) + counts["a2a_per_micro"] * micro * (w - 1)
                + counts["all_gather"] * (w - 1))
        cal.update(alpha_fit_world=w, alpha_s=min(busy) * 1e-3 / hops)  # the rank that waits least
    cal["counts"] = counts
    if link:
        cal["alpha_link_s"] = statistics.mean(link["2"][k] for k in ("alpha_all_reduce", "alpha_all_to_all",
                                                                       "alpha_all_gather"))
        cal["beta"] = link["2"]["beta"]
    if "alpha_s" not in cal:
        if "alpha_link_s" not in cal:
            return None
        cal["alpha_s"] = cal["alpha_link_s"]
    cal.setdefault("beta", 1e9)
    return cal


def local_step(cal: dict, facts: dict, world: int, tasks: int, micro: int, alpha: float,
               wait_per_micro: bool = False) -> dict:
    """Predicted seconds per meta-step on this machine (gloo, flat ring / pairwise)."""
    beta, c, frac = cal["beta"], cal["counts"], (world - 1) / world
    s = max(1.0, world / cal["cores"])
    # the slowest rank's lead; filled by other ranks' work when ranks exceed cores
    imbalance = cal["sigma_s"] * expected_max_normal(world) * (micro if wait_per_micro else 1) * (s == 1.0)
    S = 4.0 * facts["dense_params"]  # gloo ZeRO-2: an all-reduce per micro-batch + an all-gather
    dense = micro * (2 * (world - 1) * alpha + 2 * frac * S / beta) + (world - 1) * alpha + frac * S / beta
    dense = dense if world > 1 else 0.0
    a2a = 0.0
    if world > 1:
        for v in a2a_bytes(facts, world, tasks / micro)[:round(c["a2a_per_micro"])]:
            a2a += micro * ((world - 1) * alpha + v / beta)
        small = c["small_all_reduce"] * 2 * (world - 1) * alpha + 2 * frac * 4 * facts["replicated_floats"] / beta
        small += (c["all_gather"] - 1) * (world - 1) * alpha
    else:
        small = 0.0
    compute = (cal["t1_s"] if world > 1 else cal["t_task_s"]) * tasks * s
    fixed = cal["t_fixed_s"] * s
    total = compute + fixed + imbalance + dense + a2a + small
    return {"compute": compute, "fixed": fixed, "imbalance": imbalance, "dense": dense, "a2a": a2a,
            "small": small, "total": total}


def unprofiled_scale(cal: dict, facts: dict, entry: dict) -> None:
    """Rescale the profile's compute to the unprofiled calibration run. The profiler's per-op
    bookkeeping slows a rank's compute; the wait D_W is a difference of the ranks' compute, so
    it is slowed by the same factor; the per-hop time alpha is time blocked in gloo, not per-op
    work. The factor r is measured in the configuration it corrects: the strong W = 2 run,
    profiled (the profile sets' medians) and unprofiled (its median over the cycles):
        T_unprofiled = r (t_1,prof B_r + D_W,prof) + t_fixed + T_dense + M T_a2a + T_small
    so t_1 = r t_1,prof and sigma = r sigma_prof, with t_1,prof the profile's compute per task
    with no correction. (World 1's profiled-minus-unprofiled pair, the former correction, runs two
    intra-op threads that absorb part of the bookkeeping, and moved 0.2-0.8 ms per task from run
    to run.) The profile's t_1 with that correction is kept as ``t1_profile_s``."""
    world = cal.get("alpha_fit_world")
    m = entry.get("modes", {}).get("strong", {}).get(str(world)) if world else None
    if m is None:
        return
    micro = parse_micro(m["batch"])
    tasks = int(re.search(r"= (\d+) tasks/meta-step", m["batch"]).group(1)) // world
    rest = local_step({**cal, "t1_s": 0.0, "sigma_s": 0.0}, facts, world, tasks, micro, cal["alpha_s"])["total"]
    prof = local_step({**cal, "t1_s": cal["t1_raw_s"]}, facts, world, tasks, micro, cal["alpha_s"])
    r = (tasks * world / m["tasks_per_s"] - rest) / (prof["compute"] + prof["imbalance"])
    cal.update(t1_profile_s=cal["t1_s"], sigma_profile_s=cal["sigma_s"], profile_scale_w2=r,
               t1_s=r * cal["t1_raw_s"], sigma_s=r * cal["sigma_s"])


def check(name: str, entry: dict, cal: dict, facts: dict) -> list[dict]:
    rows = []
    for mode, by_w in entry.get("modes", {}).items():
        for w, m in sorted(by_w.items(), key=lambda kv: int(kv[0])):
            world, micro = int(w), parse_micro(m["batch"])
            tasks = int(re.search(r"= (\d+) tasks/meta-step", m["batch"]).group(1)) // world
            row = {"config": name, "mode": mode, "world": world, "measured_tasks_per_s": m["tasks_per_s"],
                   "oversubscribed": m.get("oversubscribed", False)}
            row["role"] = "calibration" if (mode, world) == ("strong", cal.get("alpha_fit_world")) else "check"
            prof_cal = {**cal, "t1_s": cal.get("t1_profile_s", cal["t1_s"]),
                        "sigma_s": cal.get("sigma_profile_s", cal["sigma_s"])}
            for key, c, alpha, per_micro in (("model", cal, cal["alpha_s"], False),
                                             ("wait_per_micro", cal, cal["alpha_s"], True),
                                             ("link_only", cal, cal.get("alpha_link_s"), False),
                                             ("t1_from_profile", prof_cal, cal["alpha_s"], False)):
                if alpha is None:
                    continue
                t = local_step(c, facts, world, tasks, micro, alpha, per_micro)
                row[key] = {**{k: v * 1e3 for k, v in t.items()}, "tasks_per_s": tasks * world / t["total"]}
                row[key]["error"] = row[key]["tasks_per_s"] / m["tasks_per_s"] - 1
            rows.append(row)
    return rows


# ------------------------------------------------------------------ GPU cluster extrapolation
def _hier(world: int) -> tuple[int, int]:
    """(GPUs per node used, nodes)."""
    return min(world, GPUS_PER_NODE), max(1, world // GPUS_PER_NODE)


def gpu_all_reduce(size: float, world: int, link: dict, nvl: dict, part: float = 1.0) -> float:
    """Hierarchical all-reduce of ``size`` bytes (``part`` = 0.5: a reduce-scatter or all-gather)."""
    if world == 1:
        return 0.0
    g, n = _hier(world)
    t = 2 * (g - 1) * nvl["alpha"] + 2 * (g - 1) / g * size / nvl["bw"]
    if n > 1:
        t += 2 * math.ceil(math.log2(n)) * link["alpha"] + 2 * (n - 1) / n * size / g / link["bw"]
    return part * t


def gpu_all_to_all(v: float, world: int, link: dict, nvl: dict, hierarchical: bool, overlap: float = 1.0) -> float:
    """Seconds of an all-to-all sending ``v`` bytes per rank; hierarchical: inside the node,
    then ``1 / overlap`` of the inter-node bytes across (the node's requests deduplicated)."""
    if world == 1:
        return 0.0
    g, n = _hier(world)
    intra, inter = v * (g - 1) / (world - 1), v * (world - g) / (world - 1)
    if n == 1:
        return (g - 1) * nvl["alpha"] + intra / nvl["bw"]
    if hierarchical:
        return (2 * nvl["alpha"] + 2 * v / nvl["bw"] + link["alpha"] + (n - 1) * link["o_peer"]
                + inter / overlap / link["bw"])
    return link["alpha"] + (world - 1) * link["o_peer"] + max(intra / nvl["bw"], inter / link["bw"])


def gpu_step(facts: dict, world: int, tasks: int, task_s: float, fixed_s: float, link: dict,
             zero: int = 2, hierarchical: bool = False, sync_every: int = 1, small: float = 3.0,
             balance: float = 1.0) -> dict:
    """Seconds per meta-step on W GPUs, one micro-batch per rank (``balance`` 0: equal tasks)."""
    nvl = LINKS["nvlink"]
    S, passes = dense_bytes(zero, facts["dense_params"], 1)
    dense = passes * gpu_all_reduce(S, world, link, nvl, 0.5) / sync_every
    overlap = node_overlap(facts, world, tasks) if hierarchical else 1.0
    a2a = sum(gpu_all_to_all(v, world, link, nvl, hierarchical, overlap) for v in a2a_bytes(facts, world, tasks))
    sm = (small * gpu_all_reduce(4, world, link, nvl)
          + gpu_all_reduce(4 * facts["replicated_floats"], world, link, nvl)) / sync_every
    compute = task_s * tasks
    # the slowest rank's lead: per-rank compute varies with its tasks' sizes (cv per task)
    imbalance = task_s * math.sqrt(tasks) * facts["ids_cv"] * expected_max_normal(world) * balance
    total = compute + fixed_s + imbalance + dense + a2a + sm
    return {"compute": compute, "fixed": fixed_s, "imbalance": imbalance, "dense": dense, "a2a": a2a,
            "small": sm, "total": total, "comm": dense + a2a + sm}


def scaling_table(facts: dict, mode: str, args, link: str = "ib", task_scale: float = 1.0, **kw) -> list[dict]:
    task_s, fixed_s = args.gpu_task_us * 1e-6 * task_scale, args.gpu_fixed_ms * 1e-3
    per_rank = lambda w: args.strong_tasks // w if mode == "strong" else args.weak_tasks
    base = gpu_step(facts, 1, per_rank(1), task_s, fixed_s, LINKS[link], **kw)["total"]
    rows = []
    for w in WORLDS:
        t = gpu_step(facts, w, per_rank(w), task_s, fixed_s, LINKS[link], **kw)
        tps = per_rank(w) * w / t["total"]
        eff = base / t["total"] if mode == "weak" else tps / (w * per_rank(1) / base)
        rows.append({"world": w, "tasks_per_rank": per_rank(w), "tasks_per_s": tps, "efficiency": eff,
                     **{f"{k}_ms": v * 1e3 for k, v in t.items()}})
    return rows


def crossover(rows: list[dict]) -> int | None:
    """First W where communication exceeds compute (per-task work), else None."""
    return next((r["world"] for r in rows if r["comm_ms"] > r["compute_ms"]), None)


# ------------------------------------------------------------------ main
def fmt_w(w) -> str:
    return f"{w}" if w else f">{WORLDS[-1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link-bench", action="store_true", help="rerun the gloo microbenchmark (~15 s)")
    ap.add_argument("--gpu-task-us", type=float, default=20.0,
                    help="GPU compute per task (default 20: ~1/40 of the measured CPU per-task time)")
    ap.add_argument("--gpu-fixed-ms", type=float, default=1.0, help="GPU fixed per-step costs")
    ap.add_argument("--strong-tasks", type=int, default=4096, help="global tasks per meta-step, strong")
    ap.add_argument("--weak-tasks", type=int, default=64, help="tasks per rank per meta-step, weak")
    ap.add_argument("--big-rows", type=int, default=20_000_000)
    ap.add_argument("--inter-site-latency-ms", type=float, default=5.0, help="one-way, between two sites")
    args = ap.parse_args(argv)
    scaling = json.loads(SCALING.read_text())
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    link = old.get("link_bench")
    if args.link_bench:
        try:
            link = link_bench()
        except LaunchFailure as e:
            print(f"link benchmark failed: {e}", file=sys.stderr)
            return 1
    cores = scaling["machine"]["cpu_count"]
    out = {"scaling_json_machine": scaling["machine"], "link_bench": link, "links": LINKS,
           "parameters": vars(args), "calibration": {}, "check": []}
    if link:
        print("gloo on 127.0.0.1, idle ranks (slowest-rank median, us):")
        for w, v in link.items():
            print(f"  W={w}: alpha per hop all_reduce {v['alpha_all_reduce'] * 1e6:.0f}, all_to_all "
                  f"{v['alpha_all_to_all'] * 1e6:.0f}, all_gather {v['alpha_all_gather'] * 1e6:.0f}; "
                  f"beta {v['beta'] / 1e9:.2f} GB/s")
    for name, entry in scaling["configs"].items():
        cal = calibrate(name, entry, cores, link)
        if cal is None:
            print(f"{name}: no world-1 run/profile, skipped")
            continue
        cal["cores"] = cores
        facts = model_facts(entry["config"])
        cal["facts"] = facts
        unprofiled_scale(cal, facts, entry)
        out["calibration"][name] = cal
        out["check"] += check(name, entry, cal, facts)
    print("\ncalibration (this machine): t_fixed from world 1; t_1, sigma, alpha from the strong W=2 profile (medians "
          "over the profile sets), t_1 and sigma x r, the unprofiled / profiled compute of the strong W=2 run")
    for name, c in out["calibration"].items():
        print(f"  {name}: t_1 {c['t1_s'] * 1e3:.3f} ms (r {c.get('profile_scale_w2', float('nan')):.2f} x profile "
              f"{c['t1_raw_s'] * 1e3:.3f}; with world 1's profiler cost {c.get('t1_profile_s', float('nan')) * 1e3:.3f}; "
              f"world 1: {c['t_task_s'] * 1e3:.3f} x {c['world1_cores']:.2f} cores), t_fixed {c['t_fixed_s'] * 1e3:.2f} ms, sigma {c['sigma_s'] * 1e3:.1f} ms, alpha "
              f"{c['alpha_s'] * 1e6:.0f} us/hop (idle link {c.get('alpha_link_s', float('nan')) * 1e6:.0f}), "
              f"P = {c['facts']['dense_params']:,}, profiler {c['profiler_s_per_task'] * 1e3:+.3f} ms/task, "
              f"{c['profile_sets']} profile set(s)")
        if c["profile_sets"] > 1:
            print("    per set: profile t_1 " + ", ".join(f"{x['t1_raw_s'] * 1e3:.3f}" for x in c["per_set"]) + " ms; sigma "
                  + ", ".join(f"{x['sigma_s'] * 1e3:.1f}" for x in c["per_set"]) + " ms; alpha "
                  + ", ".join(f"{x['alpha_s'] * 1e6:.0f}" for x in c["per_set"]) + " us")
    print("\ncheck: predicted vs measured tasks/s (model: wait once per meta-step; per-ub: wait at every "
          "micro-batch; link-only: idle-link alpha; t1-prof: t_1 and sigma from the profile less world 1's profiler cost, no r)")
    print(f"{'config':>6} {'mode':>6} {'W':>2} {'role':>5} {'measured':>8} {'model':>7} {'error':>7} {'per-ub':>7} "
          f"{'link-only':>9} {'t1-prof':>7}  model ms: compute fixed wait dense a2a small")
    for r in out["check"]:
        m, lo, pm, tp = r["model"], r.get("link_only"), r["wait_per_micro"], r["t1_from_profile"]
        lo_s = f"{lo['error']:>+9.1%}" if lo else f"{'-':>9}"
        print(f"{r['config']:>6} {r['mode']:>6} {r['world']:>2} {r['role'][:5]:>5} {r['measured_tasks_per_s']:>8.0f} "
              f"{m['tasks_per_s']:>7.0f} {m['error']:>+7.1%} {pm['error']:>+7.1%} {lo_s} {tp['error']:>+7.1%}  "
              f"{m['compute']:.1f} "
              f"{m['fixed']:.1f} {m['imbalance']:.1f} {m['dense']:.2f} {m['a2a']:.2f} {m['small']:.2f}"
              f"{' (oversubscribed)' * r['oversubscribed']}")
    errs = [abs(r["model"]["error"]) for r in out["check"] if r["role"] == "check"]
    out["max_abs_error"] = max(errs) if errs else None
    out["max_abs_error_all"] = max((abs(r["model"]["error"]) for r in out["check"]), default=None)
    if errs:
        print(f"max |error| {max(errs):.1%} over the held-out runs, {out['max_abs_error_all']:.1%} with the "
              f"calibration runs (target 15%); within 15%: "
              f"{sum(abs(r['model']['error']) <= 0.15 for r in out['check'])} of {len(out['check'])}")

    demo = model_facts("examples/synthetic/config.yaml")
    big = model_facts("examples/synthetic/config.yaml", big_rows=args.big_rows)
    models = {"demo": demo, "big_table": big}
    print(f"\nextrapolation: {args.gpu_task_us:g} us/task, {args.gpu_fixed_ms:g} ms fixed per step, ZeRO-2, "
          f"{GPUS_PER_NODE} GPUs/node NVLink + IB NDR; strong: {args.strong_tasks} tasks/meta-step, "
          f"weak: {args.weak_tasks} tasks/rank; big_table: item_id {args.big_rows:,} x 16 rows sharded")
    out["extrapolation"] = {}
    for mname, facts in models.items():
        for mode in ("strong", "weak"):
            rows = scaling_table(facts, mode, args)
            out["extrapolation"][f"{mname}/{mode}"] = {"rows": rows, "comm_exceeds_compute_at": crossover(rows)}
            print(f"\n{mname}, {mode}: W, tasks/rank, tasks/s, efficiency, ms per step: compute fixed wait dense a2a "
                  "small")
            for r in rows:
                print(f"  {r['world']:>5} {r['tasks_per_rank']:>5} {r['tasks_per_s']:>11,.0f} {r['efficiency']:>6.1%}"
                      f"   {r['compute_ms']:.3f} {r['fixed_ms']:.2f} {r['imbalance_ms']:.3f} {r['dense_ms']:.3f} "
                      f"{r['a2a_ms']:.3f} {r['small_ms']:.3f}")
            print(f"  communication > compute from W = {fmt_w(crossover(rows))}")

    # what moves the crossover (W where communication exceeds compute)
    variants = {"baseline (ZeRO-2, flat a2a, IB)": {},
                "gpu-task-us x0.3": {"task_scale": 0.3}, "gpu-task-us x3": {"task_scale": 3.0},
                "equal task sizes (no imbalance)": {"balance": 0.0},
                "100 GbE": {"link": "eth100"}, "25 GbE per node": {"link": "eth25"},
                "ZeRO-0": {"zero": 0}, "ZeRO-3": {"zero": 3},
                "hierarchical all-to-all": {"hierarchical": True},
                "outer sync every 4 meta-steps": {"sync_every": 4},
                "hierarchical a2a + sync every 4": {"hierarchical": True, "sync_every": 4}}
    replicated = dict(big, dense_params=big["dense_params"] + args.big_rows * 16, sharded_tables=[
        t for t in big["sharded_tables"] if t[0] != args.big_rows])
    out["levers"] = {}
    print("\nwhat moves the crossover: W where communication > compute; efficiency at W=1024 (strong / weak)")
    for mname, facts in {**models, "big_table_replicated": replicated}.items():
        for vname, kw in variants.items():
            res = {}
            for mode in ("strong", "weak"):
                rows = scaling_table(facts, mode, args, **kw)
                res[mode] = {"crossover": crossover(rows), "efficiency_1024": rows[-1]["efficiency"],
                             "tasks_per_s_1024": rows[-1]["tasks_per_s"], "comm_ms_1024": rows[-1]["comm_ms"]}
            out["levers"][f"{mname}/{vname}"] = res
            print(f"  {mname:>20} {vname:>34}: strong W={fmt_w(res['strong']['crossover']):>6} "
                  f"{res['strong']['efficiency_1024']:>6.1%}  weak W={fmt_w(res['weak']['crossover']):>6} "
                  f"{res['weak']['efficiency_1024']:>6.1%}  comm@1024 {res['weak']['comm_ms_1024']:.2f} ms")
    out["inter_site"] = two_sites(models, args, gpu_step, a2a_bytes, LINKS["ib"])
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(rank_main({"link": link_worker}, sys.argv[2], sys.argv[3:]))
    sys.exit(main())
