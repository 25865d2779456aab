"""Meta-IO throughput: building tasks from interaction logs, and collating them for the trainer.

1. Task building. Per ``--sizes`` N, a synthetic Parquet log of ~N interactions (user_id, item_id,
   rating, timestamp, user age/gender, item category, multi-hot ``tags`` as "a|b"; Zipf items,
   13-100 interactions per user) is written to a temp dir; a fresh subprocess per size times
   ``build_tasks(DataConfig(source="table", ...), seed=0)`` first (empty cache: read + tasks +
   .npz save) and cached (.npz hit), plus ``read_log`` and ``save_tasks`` alone, so the first build
   splits into read / tasks (group, vocab, encode) / save. Peak RSS = VmHWM, reset per phase.
2. Loader vs trainer, world 1: tasks/s of ``TaskLoader(..., prefetch=False).next()`` (pure collate)
   for 32 tasks/micro-batch x 2 micro-batches, bucketing on/off, on the demo's synthetic tasks and
   on the built tasks of the first size (with a multi-hot field), with a per-part breakdown; then
   ``gmeta-ds train`` on examples/synthetic/config.yaml and the median ``tasks_per_s`` of its
   metrics.jsonl (first record skipped). The aim: loader >= 10x trainer.

Results go to ``benchmarks/results/meta_io.json``.
Run from the repo root:  python benchmarks/meta_io.py [--sizes 1000000 10000000] [--repeats 2]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gmeta_ds.config import DataConfig, SchemaConfig, load_config
from gmeta_ds.data.builder import build_tasks, read_log, save_tasks
from gmeta_ds.data.loader import TaskLoader, padding_efficiency, task_lengths
from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.data.synthetic import generate_synthetic
from gmeta_ds.data.tasks import _pad, _pad_multi

RESULTS = ROOT / "benchmarks" / "results" / "meta_io.json"
DEMO = ROOT / "examples" / "synthetic" / "config.yaml"
SCHEMA = {"task_key": "user_id", "item_key": "item_id", "label": "rating", "timestamp": "timestamp",
          "user_features": ["age", "gender"], "item_features": ["category"], "multi_hot": {"tags": "|"}}


def write_log(n: int, path: Path, seed: int = 0) -> dict:
    """A synthetic log of ~n interactions as Parquet (vectorized; strings dictionary-decoded)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(13, 101, size=int(n / 56.5 * 1.1) + 10)
    lens = lens[:max(1, int(np.searchsorted(np.cumsum(lens), n, side="right")))]
    users, rows, n_items = len(lens), int(lens.sum()), max(1000, n // 100)
    cdf = np.cumsum(np.arange(1, n_items + 1, dtype=np.float64) ** -1.1)
    rank = np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(rows), side="right"), n_items - 1)
    items = rng.permutation(n_items)[rank]
    owner = np.repeat(np.arange(users), lens)
    tags = ["|".join(f"t{t}" for t in rng.choice(50, k, replace=False)) for k in rng.integers(1, 4, n_items)]

    def strings(codes, names):
        return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(names)).cast(pa.string())
    pq.write_table(pa.table({
        "user_id": owner.astype(np.int64) + 1, "item_id": items.astype(np.int64) + 1,
        "rating": rng.integers(1, 6, rows).astype(np.float32),
        "timestamp": rng.integers(946_684_800, 1_700_000_000, rows),
        "age": strings(rng.integers(0, 7, users)[owner], [f"a{i}" for i in range(7)]),
        "gender": strings(rng.integers(0, 2, users)[owner], ["F", "M"]),
        "category": strings(rng.integers(0, 30, n_items)[items], [f"c{i}" for i in range(30)]),
        "tags": strings(items, tags)}), path)
    return {"interactions": rows, "users": users, "items": n_items, "file_mb": path.stat().st_size / 2**20}


def mem_mb() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def timed(fn, *args):
    t = time.perf_counter()
    return fn(*args), time.perf_counter() - t


def sh(cmd: list[str], what: str) -> str:
    """Run ``cmd`` from the repo root; its stdout, or RuntimeError with the end of its stderr."""
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if proc.returncode:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def data_config(path: Path, cache_dir: Path):
    return DataConfig(source="table", path=str(path), schema=SchemaConfig(**SCHEMA), cache_dir=str(cache_dir))


def worker(path: Path, work: Path, repeats: int) -> dict:
    """One size, in its own process: timings (s) and peaks (MB) per phase and repeat."""
    out = {"baseline_rss_mb": mem_mb()["VmRSS"], "peak_reset": reset_peak(), "runs": []}
    for r in range(repeats):
        run, cfg = {}, data_config(path, work / f"cache-{r}")
        reset_peak()
        data, run["first_s"] = timed(build_tasks, cfg, 0)
        run["first_peak_mb"] = mem_mb()["VmHWM"]
        assert "cache" not in data.stats, "first build hit a cache"
        del data
        cached = [timed(build_tasks, cfg, 0) for _ in range(3)]
        assert all("cache" in d.stats for d, _ in cached), "second build did not hit the .npz cache"
        data, run["cached_s"] = cached[0][0], statistics.median(s for _, s in cached)
        run["save_s"] = timed(save_tasks, work / "save-test.npz", data)[1]
        run["stats"] = {k: v for k, v in data.stats.items() if k not in ("cache", "source")}
        del data, cached
        reset_peak()
        log, run["read_s"] = timed(read_log, cfg)
        run["read_peak_mb"], run["arrow_mb"] = mem_mb()["VmHWM"], log.frame.data.nbytes / 2**20
        del log
        out["runs"].append(run)
    out["cache_npz_mb"] = sum(f.stat().st_size for f in (work / "cache-0").glob("*.npz")) / 2**20
    return out


def bench_build(size: int, tmp: Path, repeats: int) -> dict:
    work = tmp / f"n{size}"
    work.mkdir()
    t = time.perf_counter()
    log = write_log(size, work / "log.parquet")
    log["generate_s"] = time.perf_counter() - t
    out = sh([sys.executable, __file__, "--worker", str(work), "--repeats", str(repeats)], f"worker {size}")
    res = json.loads(out.strip().splitlines()[-1])
    med = {k: statistics.median(r[k] for r in res["runs"]) for k in ("first_s", "cached_s", "read_s", "save_s")}
    n = log["interactions"]
    return {"size": size, **log, **res, **med, "tasks_s": med["first_s"] - med["read_s"] - med["save_s"],
            "first_per_s": n / med["first_s"], "cached_per_s": n / med["cached_s"],
            "peak_mb": res["runs"][0]["first_peak_mb"],
            "peak_bytes_per_interaction": (res["runs"][0]["first_peak_mb"] - res["baseline_rss_mb"]) * 2**20 / n}


def bench_loader(tasks, steps: int, rounds: int) -> dict:
    """tasks/s of TaskLoader.next() without prefetch, bucketing on/off, interleaved rounds."""
    loaders = {b: TaskLoader(tasks, MetaBatchSampler(len(tasks), 32, 2, 1, 0, 0, task_lengths(tasks) if b else None),
                             prefetch=False) for b in (True, False)}
    times, pads = {b: [] for b in loaders}, {b: [] for b in loaders}
    for _ in range(rounds):
        for b, loader in loaders.items():
            for _ in range(steps):
                t = time.perf_counter()
                batches = loader.next()
                times[b].append(time.perf_counter() - t)
                pads[b] += [padding_efficiency(x) for x in batches]
    return {("on" if b else "off"): {"tasks_per_s": 64 / statistics.median(times[b]), "steps": len(times[b]),
                                     "padding_efficiency": float(np.mean(pads[b]))} for b in loaders}


def collate_breakdown(tasks, steps: int) -> dict:
    """Median ms per micro-batch of each part of `collate` (bucketed), and of the sampler."""
    sampler = MetaBatchSampler(len(tasks), 32, 2, 1, 0, 0, task_lengths(tasks))
    parts = {k: [] for k in ("sampler", "split", "pad_support", "pad_query", "pad_multi")}
    for step in range(steps):
        mbs, dt = timed(sampler.micro_batches, step)
        parts["sampler"].append(dt / len(mbs))
        for mb in mbs:  # the steps of `collate`, timed one by one
            splits, dt_split = timed(lambda m=mb: [tasks.split(int(i)) for i in m])
            (sup, dt_sup), (qry, dt_qry) = (timed(_pad, tasks, [x[j] for x in splits]) for j in (0, 1))
            dt_multi = sum(timed(_pad_multi, tasks, [x[j] for x in splits], w[0].shape[1])[1]
                           for j, w in ((0, sup), (1, qry)))
            for k, dt in zip(list(parts)[1:], (dt_split, dt_sup, dt_qry, dt_multi)):
                parts[k].append(dt)
    return {k: 1e3 * statistics.median(v) for k, v in parts.items()}


def sampler_scaling(sizes=(10_000, 100_000, 1_000_000), steps: int = 20) -> dict:
    """ms per meta-step of `MetaBatchSampler.micro_batches` (32 x 2, bucketed) vs task count."""
    out = {}
    for n in sizes:
        sampler = MetaBatchSampler(n, 32, 2, 1, 0, 0, np.random.default_rng(0).integers(13, 101, n))
        out[n] = 1e3 * timed(lambda s=sampler: [s.micro_batches(k) for k in range(steps)])[1] / steps
    return out


def bench_trainer(tmp: Path, steps: int, runs: int) -> dict:
    exe = Path(sys.executable).with_name("gmeta-ds")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gmeta_ds.cli"]
    out = {"runs": []}
    for r in range(runs):
        out_dir = tmp / f"train-{r}"
        _, wall = timed(sh, cmd + ["train", "--config", str(DEMO), "--set", f"train.meta_steps={steps}",
                                   "--set", "eval.enabled=false", "--set", "train.progress=false",
                                   "--set", f"output_dir={out_dir}"], "trainer")
        recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()][1:]
        out["runs"].append({"wall_s": wall, "tasks_per_s": [x["tasks_per_s"] for x in recs],
                            "padding_efficiency": statistics.median(x["padding_efficiency"] for x in recs)})
    out["tasks_per_s"] = statistics.median(v for run in out["runs"] for v in run["tasks_per_s"])
    return out


def machine() -> dict:
    import datasets
    import pandas
    import torch
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    dirty = sh(["git", "status", "--porcelain", "gmeta_ds"], "git status")
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "mem_total_gb": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30,
            "load_avg_at_start": os.getloadavg(), "python": platform.python_version(),
            "numpy": np.__version__, "pandas": pandas.__version__, "pyarrow": pa.__version__,
            "datasets": datasets.__version__, "torch": torch.__version__,
            "gmeta_ds_uncommitted": dirty.splitlines()}


def print_builds(builds: list[dict], repeats: int) -> None:
    print(f"\nTask building ({repeats} repeat(s), medians; peak: VmHWM of the first build, MB; "
          "B/int+: (peak - import baseline) / interaction; read pk: VmHWM of read_log alone)")
    print(f"{'interactions':>12} {'users':>7} {'first s':>8} {'inter/s':>9} {'cached s':>8} {'inter/s':>10} "
          f"{'read s':>7} {'tasks s':>7} {'save s':>6} {'peak MB':>8} {'B/int+':>7} {'read pk':>8}")
    for b in builds:
        print(f"{b['interactions']:>12,} {b['users']:>7,} {b['first_s']:>8.2f} {b['first_per_s']:>9.3g} "
              f"{b['cached_s']:>8.3f} {b['cached_per_s']:>10.3g} {b['read_s']:>7.2f} {b['tasks_s']:>7.2f} "
              f"{b['save_s']:>6.2f} {b['peak_mb']:>8.0f} {b['peak_bytes_per_interaction']:>7.0f} "
              f"{b['runs'][0]['read_peak_mb']:>8.0f}")


def print_loader(loader: dict, scaling: dict, trainer: dict) -> None:
    rate = trainer["tasks_per_s"]
    print(f"\nLoader (prefetch off, 32 tasks x 2 micro-batches) vs trainer ({rate:.0f} tasks/s, demo config, "
          f"world 1, median of {sum(len(r['tasks_per_s']) for r in trainer['runs'])} windows)")
    print(f"{'tasks':<18} {'bucket':>6} {'tasks/s':>9} {'padding':>7} {'x trainer':>9}")
    for name, res in loader.items():
        for b in ("on", "off"):
            res[b]["vs_trainer"] = res[b]["tasks_per_s"] / rate
            print(f"{name:<18} {b:>6} {res[b]['tasks_per_s']:>9.0f} {res[b]['padding_efficiency']:>7.3f} "
                  f"{res[b]['vs_trainer']:>9.1f}")
    print("ms per micro-batch (bucketed), by part of the loader:")
    for name, res in loader.items():
        print(f"  {name:<16} " + ", ".join(f"{k} {v:.3f}" for k, v in res["collate_ms"].items()))
    print("sampler ms per meta-step vs training tasks: " + ", ".join(f"{n:,}: {v:.2f}" for n, v in scaling.items()))
    print(f"trainer padding efficiency {statistics.median(r['padding_efficiency'] for r in trainer['runs']):.3f}, "
          "wall per run " + ", ".join(f"{r['wall_s']:.1f}s" for r in trainer["runs"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--repeats", type=int, default=2, help="first/cached/read timings per size")
    ap.add_argument("--loader-steps", type=int, default=100, help="meta-steps per round and setting")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=100)
    ap.add_argument("--train-runs", type=int, default=2)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker / "log.parquet", args.worker, args.repeats)))
        return 0
    start, info = time.perf_counter(), machine()
    with tempfile.TemporaryDirectory(prefix="meta_io-") as tmp_name:
        tmp = Path(tmp_name)
        builds = []
        for size in args.sizes:
            builds.append(bench_build(size, tmp, args.repeats))
            if size != args.sizes[0]:  # the first size's log and cache feed the loader benchmark
                shutil.rmtree(tmp / f"n{size}")
        print_builds(builds, args.repeats)
        demo = load_config(DEMO)
        first = tmp / f"n{args.sizes[0]}"
        table = build_tasks(data_config(first / "log.parquet", first / "cache-0"), seed=0)
        assert "cache" in table.stats
        sources = {"demo synthetic": generate_synthetic(demo.data.synthetic, demo.seed).train,
                   f"table {builds[0]['interactions']:,}": table.train}
        loader = {name: {**bench_loader(ts, args.loader_steps, args.rounds), "tasks": len(ts),
                         "collate_ms": collate_breakdown(ts, 50)} for name, ts in sources.items()}
        scaling = sampler_scaling()
        trainer = bench_trainer(tmp, args.train_steps, args.train_runs)
    print_loader(loader, scaling, trainer)
    total = time.perf_counter() - start
    params = {k: v for k, v in vars(args).items() if k != "worker"} | {
        "schema": SCHEMA, "tasks_per_micro_batch": 32, "micro_batches_per_meta_step": 2, "world_size": 1,
        "trainer_config": str(DEMO.relative_to(ROOT)), "loader_prefetch": False}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp_json = RESULTS.with_suffix(".json.tmp")  # written whole, then renamed: readers never see half
    tmp_json.write_text(json.dumps({"machine": info, "parameters": params, "total_s": total, "results": {
        "build": builds, "loader": loader, "sampler_ms_per_step": scaling, "trainer": trainer}}, indent=2) + "\n")
    os.replace(tmp_json, RESULTS)
    print(f"total {total:.0f}s; wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
