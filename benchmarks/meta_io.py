"""Meta-IO throughput at scale: the out-of-core task build, the memory-mapped store, the loader.

1. Task building. Per ``--sizes`` N, ``gmeta-ds data synthesize`` writes a log of exactly N
   interactions as Parquet shards (Zipf items, 13-100 interactions per user, user features age and
   gender, item feature category, multi-hot ``tags``, timestamps); a fresh subprocess builds the
   task store (`build_tasks`, DuckDB, ``data.memory_limit`` default) and reports wall time,
   interactions/s, peak RSS (VmHWM) and bytes per interaction, DuckDB's phase times and the
   store's size on disk; a second fresh subprocess opens the cached store (open time, VmHWM) and
   collates 200 micro-batches of 32 tasks from it: loader tasks/s and the data a rank then holds
   (task arrays in memory + resident pages of store memory maps) against the store's size.
2. Loader vs trainer, world 1: tasks/s of ``TaskLoader(..., prefetch=False).next()`` (pure collate)
   for 32 tasks/micro-batch x 2 micro-batches, bucketing on/off, on the demo's synthetic tasks and
   on the built tasks of the first size, with a per-part breakdown; then ``gmeta-ds train`` on
   examples/synthetic/config.yaml and the median ``tasks_per_s`` of its metrics.jsonl.
3. With ``--train-size N`` (one of the sizes): ``deepspeed --num_gpus 2 gmeta-ds train`` on that
   size's store (examples/table/config.yaml's model, the synthetic log's schema, evaluation off):
   per-rank VmHWM and resident task-store pages, and the trainer's tasks/s against the loader's.

Results go to ``benchmarks/results/meta_io.json``.
Run from the repo root:  python benchmarks/meta_io.py [--sizes 1000000 10000000 100000000] [--train-size 100000000]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from gmeta_ds.config import DataConfig, SchemaConfig, load_config
from gmeta_ds.data.builder import build_tasks, store_path
from gmeta_ds.data.stream import in_memory_mib, mapped_store_mib
from gmeta_ds.data.parquet_log import synthesize_log
from gmeta_ds.data.loader import TaskLoader, task_lengths
from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.data.synthetic import generate_synthetic
from gmeta_ds.data.tasks import pad_rows, pad_multi

RESULTS = ROOT / "benchmarks" / "results" / "meta_io.json"
DEMO = ROOT / "examples" / "synthetic" / "config.yaml"
SCHEMA = {"task_key": "user_id", "item_key": "item_id", "label": "rating", "timestamp": "timestamp",
          "user_features": ["age", "gender"], "item_features": ["category"], "multi_hot": {"tags": "|"}}


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
    return DataConfig(source="table", path=str(path), format="parquet", schema=SchemaConfig(**SCHEMA),
                      cache_dir=str(cache_dir))


def worker(mode: str, work: Path) -> dict:
    """In a fresh process: ``build`` the store of ``work/log`` into ``work/cache``, or ``open``
    the built one and collate from it."""
    cfg = data_config(work / "log", work / "cache")
    out = {"baseline_rss_mb": mem_mb()["VmRSS"], "peak_reset": reset_peak()}
    data, seconds = timed(build_tasks, cfg, 0)
    out["s"], out["peak_mb"] = seconds, mem_mb()["VmHWM"]
    out["from_cache"] = "cache" in data.stats
    if mode == "build":
        out["stats"] = {k: v for k, v in data.stats.items() if k not in ("cache", "source")}
        return out
    store = store_path(cfg, 0)
    out["store_mb"] = sum(f.stat().st_size for f in store.iterdir()) / 2**20
    out["store_rss_after_open_mb"] = mapped_store_mib()
    loader = TaskLoader(data.train, MetaBatchSampler(len(data.train), 32, 2, 1, 0, 0, task_lengths(data.train)),
                        prefetch=False)
    loader.next()
    t = time.perf_counter()
    for _ in range(100):
        loader.next()
    out["loader_tasks_per_s"] = 100 * 64 / (time.perf_counter() - t)
    out["store_rss_after_200_micro_batches_mb"] = mapped_store_mib()
    out["tasks_in_memory_mb"] = in_memory_mib(data)
    out["peak_after_loading_mb"] = mem_mb()["VmHWM"]
    return out


def bench_build(size: int, tmp: Path) -> dict:
    work = tmp / f"n{size}"
    work.mkdir()
    log = synthesize_log(work / "log", size, shards=max(1, size // 5_000_000), seed=0)
    res = {"size": size, "interactions": log["rows"], "users": log["users"], "items": log["items"],
           "log_mb": log["mb"], "generate_s": log["seconds"]}
    for mode in ("build", "open"):
        out = sh([sys.executable, __file__, "--worker", mode, str(work)], f"{mode} {size}")
        res[mode] = json.loads(out.strip().splitlines()[-1])
    assert not res["build"]["from_cache"] and res["open"]["from_cache"]
    n = res["interactions"]
    res |= {"build_s": res["build"]["s"], "interactions_per_s": n / res["build"]["s"],
            "peak_mb": res["build"]["peak_mb"], "open_s": res["open"]["s"], "store_mb": res["open"]["store_mb"],
            "peak_bytes_per_interaction": res["build"]["peak_mb"] * 2**20 / n,
            "peak_above_import_bytes_per_interaction": (res["build"]["peak_mb"] - res["build"]["baseline_rss_mb"]) * 2**20 / n,
            "store_bytes_per_interaction": res["open"]["store_mb"] * 2**20 / n}
    return res


def bench_train_on_store(size: int, tmp: Path, steps: int) -> dict:
    """World 2 through the deepspeed launcher on the built store of ``size``."""
    work = tmp / f"n{size}"
    exe = Path(sys.executable).with_name("gmeta-ds")
    launcher = Path(sys.executable).with_name("deepspeed")
    sets = {"data.path": str(work / "log"), "data.format": "parquet", "data.cache_dir": str(work / "cache"),
            "data.threshold": 4, "data.split": "random", "data.min_interactions": 13,
            "data.schema": json.dumps(SCHEMA), "eval.enabled": "false", "train.progress": "false",
            "train.meta_steps": steps, "train.log_every": 5, "output_dir": str(work / "run"),
            "meta.tasks_per_meta_step": 64, "meta.tasks_per_micro_batch": 32, "embedding.sharding": "sharded"}
    cmd = [str(launcher), "--num_gpus", "2", "--master_port", "29731", str(exe), "train", "--config",
           str(ROOT / "examples" / "table" / "config.yaml")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env_path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    _, wall = timed(lambda: subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True,
                                           env={**os.environ, "PATH": env_path}))
    summary = json.loads((work / "run" / "summary.json").read_text())
    recs = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    return {"wall_s": wall, "steps": steps, "tasks_per_s": statistics.median(r["tasks_per_s"] for r in recs),
            "peak_rss_mib_per_rank": summary.get("peak_rss_mib_per_rank")}


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
                pads[b] += [x.padding_efficiency for x in batches]
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
            (sup, dt_sup), (qry, dt_qry) = (timed(pad_rows, tasks, [x[j] for x in splits]) for j in (0, 1))
            dt_multi = sum(timed(pad_multi, tasks, [x[j] for x in splits], w[0].shape[1])[1]
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


def print_builds(builds: list[dict]) -> None:
    print("\nTask store build (fresh process; peak = VmHWM MB) and open (fresh process)")
    print(f"{'interactions':>12} {'users':>9} {'build s':>8} {'inter/s':>9} {'peak MB':>8} {'B/int':>6} "
          f"{'store MB':>9} {'open s':>7} {'loader t/s':>10} {'data MB':>8}")
    for b in builds:
        o = b["open"]
        print(f"{b['interactions']:>12,} {b['users']:>9,} {b['build_s']:>8.1f} {b['interactions_per_s']:>9.3g} "
              f"{b['peak_mb']:>8.0f} {b['peak_bytes_per_interaction']:>6.1f} {b['store_mb']:>9.0f} "
              f"{b['open_s']:>7.3f} {o['loader_tasks_per_s']:>10.0f} "
              f"{o['tasks_in_memory_mb'] + o['store_rss_after_200_micro_batches_mb']:>8.1f}")
        print(f"{'':>12} phases: " + ", ".join(f"{k} {v:.1f}s" for k, v in b["build"]["stats"]["build_phases_s"].items()))


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
    ap.add_argument("--train-size", type=int, default=None, help="train at world 2 on this size's store")
    ap.add_argument("--store-train-steps", type=int, default=30)
    ap.add_argument("--loader-steps", type=int, default=100, help="meta-steps per round and setting")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=100)
    ap.add_argument("--train-runs", type=int, default=2)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], Path(args.worker[1]))))
        return 0
    if args.train_size is not None and args.train_size not in args.sizes:
        ap.error("--train-size must be one of --sizes")
    start, info = time.perf_counter(), machine()
    with tempfile.TemporaryDirectory(prefix="meta_io-") as tmp_name:
        tmp = Path(tmp_name)
        builds, store_train = [], None
        for size in args.sizes:
            builds.append(bench_build(size, tmp))
            print_builds(builds[-1:])
            if size == args.train_size:
                store_train = bench_train_on_store(size, tmp, args.store_train_steps)
                print(f"world 2 on the {size:,} store: {store_train['tasks_per_s']:.0f} tasks/s; per rank "
                      + "; ".join(f"VmHWM {r['vmhwm_mib']:.0f} MiB (data: {r['tasks_in_memory_mib']:.1f} MiB of task "
                                  f"arrays, {r['task_store_rss_mib']:.1f} MiB of mapped store pages)"
                                  for r in store_train["peak_rss_mib_per_rank"] or []))
            if size != args.sizes[0]:  # the first size's log and store feed the loader benchmark
                shutil.rmtree(tmp / f"n{size}")
        print_builds(builds)
        demo = load_config(DEMO)
        first = tmp / f"n{args.sizes[0]}"
        table = build_tasks(data_config(first / "log", first / "cache"), seed=0)
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
        "build": builds, "train_on_store": store_train, "loader": loader, "sampler_ms_per_step": scaling, "trainer": trainer}}, indent=2) + "\n")
    os.replace(tmp_json, RESULTS)
    print(f"total {total:.0f}s; wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
