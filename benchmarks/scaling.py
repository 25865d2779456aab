"""Does adding ranks pay? World 1, 2 and 4 on three configurations, strong and weak scaling,
run side by side in one script through the real CLI (``gmeta-ds train``; ``deepspeed
--num_gpus W`` for W > 1).

Configurations (``--configs``):
  demo   examples/synthetic/config.yaml: the demo (sharded tables, MLP 64-32, ZeRO-2)
  ctr    benchmarks/configs/ctr.yaml: MeLU over 8 fields, MLP 128-64, 3 inner steps of
         second-order MAML, 32 tasks per meta-step, replicated tables (ZeRO-2)
  dense  benchmarks/configs/dense.yaml: MLP 1024-512-256, where compute dominates
Modes (``--modes``):
  strong the config's global tasks per meta-step at every W (each rank gets 1/W of them)
  weak   the same tasks per rank at every W (W x the config's tasks per meta-step)

Every repetition is one cycle: world 1, then each (mode, W > 1) run, so the runs compared
are neighbours in time; a speed-up is the median over cycles of that cycle's ratio to its
world-1 run (this machine's cores are shared and single runs are noisy). Reported per run:
tasks/s (median over the logged windows after the first) and CPU-seconds per task (the
process CPU time of every rank, all threads, over the same windows, from metrics.jsonl's
``cpu_s_per_task``). W above this machine's cores is run anyway and marked
``oversubscribed`` (ranks then time-share cores: a lower bound on what W cores would do).

With ``--profile`` (default on), one extra run per (config, W) in strong mode records the
per-phase breakdown (``train.profile_steps``, `gmeta_ds.run.profiling`), per rank;
``--profile-repeats N`` records N such sets (saved under ``profiles``; ``profile`` is the first,
the one the tables show), and benchmarks/scaling_model.py calibrates on each set's W = 1 and
W = 2 profiles (run back to back) and takes the median of each parameter over the sets.
``--profile-only --append`` adds sets to the saved results (e.g. ``--worlds 1 2``).
``--same-model`` (default on): each config's strong-scaling runs at W = 2 must train the
model of a one-thread world-1 run (checksums and final loss within 1e-5 relative; Adam
amplifies last-bit differences of reduction order over hundreds of steps, so runs are
kept short).

    python benchmarks/scaling.py [--configs demo ctr dense] [--worlds 1 2 4] [--modes strong weak]
                                 [--repeats 3] [--steps N]
    python benchmarks/scaling.py --report     # the saved results as markdown tables

Writes ``benchmarks/results/scaling.json`` (read by benchmarks/scaling_model.py); configs not
run keep their saved results there.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, REPO, free_port, machine, run_group  # first: OMP_WAIT_POLICY

# isort: split

import argparse
import json
import os
import statistics
import tempfile
import time

import yaml

CONFIGS = {"demo": "examples/synthetic/config.yaml", "ctr": "benchmarks/configs/ctr.yaml",
           "dense": "benchmarks/configs/dense.yaml"}
DEFAULT_STEPS = {"demo": 60, "ctr": 60, "dense": 30}
RESULTS = REPO / "benchmarks" / "results" / "scaling.json"
SAME_MODEL_KEYS = ("dense_checksum", "embedding_checksum", "final_query_loss")


def batch_for(config: str, mode: str, world: int) -> tuple[int, int]:
    """(tasks per meta-step, tasks per micro-batch) of a run: strong keeps the config's global
    batch (the micro-batch shrinks where W ranks cannot each take a whole one); weak gives
    every rank the config's world-1 share."""
    meta = yaml.safe_load((REPO / config).read_text())["meta"]
    per_step, micro = int(meta["tasks_per_meta_step"]), int(meta["tasks_per_micro_batch"])
    if mode == "weak":
        return per_step * world, micro
    micro = min(micro, per_step // world)
    if per_step % (micro * world):
        raise SystemExit(f"{config}: {per_step} tasks per meta-step cannot be split over {world} ranks")
    return per_step, micro


def run(config: str, world: int, mode: str, steps: int, out: Path, timeout: float,
        threads: str = "auto", profile: int = 0, extra: tuple[str, ...] = ()) -> dict:
    """One ``gmeta-ds train`` run (``extra``: more ``--set KEY=VALUE``); its numbers."""
    per_step, micro = batch_for(config, mode, world)
    sets = [f"output_dir={out}", f"train.meta_steps={steps}", "train.log_every=10",
            "train.progress=false", "train.tensorboard=false", "eval.enabled=false",
            f"train.threads={threads}", f"meta.tasks_per_meta_step={per_step}",
            f"meta.tasks_per_micro_batch={micro}", *extra]
    if profile:
        sets += [f"train.profile_steps={profile}", "train.profile_warmup=5"]
    args = ["train", "--config", config, *[a for s in sets for a in ("--set", s)]]
    cmd = [str(BIN / "gmeta-ds"), *args] if world == 1 else [
        str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port()),
        str(BIN / "gmeta-ds"), *args]
    start = time.perf_counter()
    run_group(cmd, timeout, f"{config} world {world} ({mode})")
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = records[1:] or records
    summary = json.loads((out / "summary.json").read_text())
    result = {"world_size": world, "mode": mode, "wall_s": wall, "train_s": summary["elapsed_s"],
              "oversubscribed": world > (os.cpu_count() or 1),
              "tasks_per_s": statistics.median(r["tasks_per_s"] for r in windows),
              "cpu_s_per_task": statistics.median(r["cpu_s_per_task"] for r in windows),
              "batch": summary["batch"], "tasks_per_meta_step": per_step, "tasks_per_micro_batch": micro,
              "zero_stage": summary["ds_config"].get("zero_optimization", {}).get("stage", 0),
              **{k: summary[k] for k in SAME_MODEL_KEYS}}
    if profile:
        result["profile"] = json.loads((out / "profile.json").read_text())
    return result


def close(a: dict, b: dict) -> bool:
    return all(abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])) for k in SAME_MODEL_KEYS)


def bench_config(name: str, args, tmp: Path) -> dict:
    config, steps = CONFIGS[name], args.steps or DEFAULT_STEPS[name]
    others = [(m, w) for m in args.modes for w in args.worlds if w > 1]
    cycles = []
    for i in range(args.repeats):
        cycle = {"1": run(config, 1, "strong", steps, tmp / f"{name}_w1_{i}", args.timeout)}
        for mode, world in others:
            cycle[f"{mode}{world}"] = run(config, world, mode, steps, tmp / f"{name}_{mode}{world}_{i}",
                                          args.timeout)
        cycles.append(cycle)
        print(f"  {name} cycle {i + 1}: " + ", ".join(
            f"{k} {r['tasks_per_s']:.0f} tasks/s" for k, r in cycle.items()), flush=True)
    result = {"config": config, "meta_steps": steps, "cycles": cycles, "modes": {}}
    base = [c["1"] for c in cycles]
    result["world1"] = {"tasks_per_s": statistics.median(r["tasks_per_s"] for r in base),
                        "cpu_s_per_task": statistics.median(r["cpu_s_per_task"] for r in base),
                        "batch": base[0]["batch"]}
    for mode in args.modes:
        entry = {}
        for world in [w for w in args.worlds if w > 1]:
            runs = [c[f"{mode}{world}"] for c in cycles]
            ratios = [r["tasks_per_s"] / c["1"]["tasks_per_s"] for r, c in zip(runs, cycles)]
            cpu = [r["cpu_s_per_task"] / c["1"]["cpu_s_per_task"] for r, c in zip(runs, cycles)]
            entry[str(world)] = {"tasks_per_s": statistics.median(r["tasks_per_s"] for r in runs),
                                 "speedup_per_cycle": ratios, "speedup": statistics.median(ratios),
                                 "efficiency": statistics.median(ratios) / world,
                                 "cpu_s_per_task": statistics.median(r["cpu_s_per_task"] for r in runs),
                                 "cpu_s_per_task_ratio": statistics.median(cpu),
                                 "oversubscribed": runs[0]["oversubscribed"], "batch": runs[0]["batch"]}
        result["modes"][mode] = entry
    if args.same_model and "strong" in args.modes and 2 in args.worlds:
        reference = run(config, 1, "strong", steps, tmp / f"{name}_reference", args.timeout, threads="1")
        result["same_model_reference"] = {k: reference[k] for k in SAME_MODEL_KEYS}
        result["same_model"] = all(close(c["strong2"], reference) for c in cycles)
    if args.profile:
        result["profiles"] = [profiles(name, args, tmp / f"profiles{i}") for i in range(args.profile_repeats)]
        result["profile"] = result["profiles"][0]
    return result


def profiles(name: str, args, tmp: Path) -> dict:
    """Per-phase profiles (20 meta-steps after 5) of one strong-scaling run per W."""
    steps = max(args.steps or DEFAULT_STEPS[name], 30)
    tmp.mkdir(parents=True, exist_ok=True)
    return {str(w): run(CONFIGS[name], w, "strong", steps, tmp / f"{name}_profile{w}", args.timeout,
                        profile=20)["profile"] for w in args.worlds}


def markdown(report: dict) -> str:
    """The scaling table and the per-phase breakdowns of a ``scaling.json``, as markdown."""
    from gmeta_ds.run.profiling import PHASES

    lines = ["| config | mode | W | tasks/s | speed-up (per cycle) | efficiency | CPU-s per task | vs W=1 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in report["configs"].items():
        w1 = r["world1"]
        lines.append(f"| {name} | | 1 | {w1['tasks_per_s']:,.0f} | 1.00x | 100% | "
                     f"{w1['cpu_s_per_task'] * 1e3:.2f} ms | 1.00x |")
        for mode, entry in r["modes"].items():
            for world, e in entry.items():
                star = " (oversubscribed)" if e["oversubscribed"] else ""
                lines.append(f"| {name} | {mode} | {world}{star} | {e['tasks_per_s']:,.0f} | "
                             f"**{e['speedup']:.2f}x** ({', '.join(f'{x:.2f}' for x in e['speedup_per_cycle'])})"
                             f" | {e['efficiency']:.0%} | {e['cpu_s_per_task'] * 1e3:.2f} ms | "
                             f"{e['cpu_s_per_task_ratio']:.2f}x |")
    for name, r in report["configs"].items():
        if "profile" not in r:
            continue
        cols = [(w, i) for w, p in r["profile"].items() for i in range(len(p["ranks"]))]
        lines += ["", f"**{name}**, ms per meta-step (of which in collectives), strong scaling, "
                  f"{r['profile']['1']['batch']} at W=1:", "",
                  "| phase | " + " | ".join(f"W={w} rank {i}" for w, i in cols) + " |",
                  "|---|" + "---|" * len(cols)]
        for phase in PHASES:
            cells = []
            for w, i in cols:
                e = r["profile"][w]["ranks"][i]["phases"].get(phase, {"ms": 0, "calls": 0, "collective_ms": 0})
                cells.append("" if not e["calls"] else
                             f"{e['ms']:.1f}" + (f" ({e['collective_ms']:.1f})" if e["collective_ms"] >= 0.05 else ""))
            if any(cells):
                lines.append(f"| {phase} | " + " | ".join(cells) + " |")
        lines.append("| **meta-step** | " + " | ".join(
            f"**{r['profile'][w]['ranks'][i]['step_ms']:.1f}**" for w, i in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["strong", "weak"], choices=["strong", "weak"])
    parser.add_argument("--repeats", type=int, default=3, help="cycles; medians of per-cycle ratios")
    parser.add_argument("--steps", type=int, default=0, help="meta-steps per run (0: per config)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--no-same-model", dest="same_model", action="store_false")
    parser.add_argument("--profile-repeats", type=int, default=1,
                        help="profile sets (one run per W each) per config; the model takes medians")
    parser.add_argument("--profile-only", action="store_true",
                        help="only re-record the profiles of --configs into the saved scaling.json")
    parser.add_argument("--append", action="store_true",
                        help="with --profile-only: add the new sets to the saved ones instead of replacing them")
    parser.add_argument("--report", action="store_true",
                        help="print the tables of the saved scaling.json as markdown; run nothing")
    args = parser.parse_args()
    if args.report:
        print(markdown(json.loads(RESULTS.read_text())))
        return
    if args.profile_only:  # re-record the profiles of the saved results' configs
        report = json.loads(RESULTS.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.configs:
                entry = report["configs"][name]
                kept = (entry.get("profiles") or [entry["profile"]]) if args.append and "profile" in entry else []
                new = [profiles(name, args, Path(tmp) / f"{name}{i}") for i in range(args.profile_repeats)]
                entry["profiles"] = kept + new
                entry["profile"] = entry["profiles"][0]
                print(f"{name}: {len(entry['profiles'])} profile sets", flush=True)
        RESULTS.write_text(json.dumps(report, indent=2) + "\n")
        print(markdown(report))
        return
    if 1 not in args.worlds:
        args.worlds = [1, *args.worlds]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            print(f"{name}: {CONFIGS[name]}", flush=True)
            results[name] = bench_config(name, args, Path(tmp))
    for r in results.values():
        r["repeats"], r["load_avg_at_end"] = args.repeats, os.getloadavg()
    # Configs not run this time keep their saved results (same worlds only).
    saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    kept = saved.get("configs", {}) if saved.get("worlds") == args.worlds else {}
    report = {"machine": {**machine(), "load_avg_at_end": os.getloadavg()},
              "worlds": args.worlds, "configs": {**kept, **results}}
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'config':<7}{'mode':<8}{'W':>3}{'tasks/s':>10}{'speed-up':>10}{'eff.':>7}"
          f"{'CPU-s/task':>12}{'vs W=1':>8}  per cycle")
    for name, r in results.items():
        w1 = r["world1"]
        print(f"{name:<7}{'':<8}{1:>3}{w1['tasks_per_s']:>10.0f}{'1.00x':>10}{'100%':>7}"
              f"{w1['cpu_s_per_task'] * 1e3:>10.2f}ms{'1.00x':>8}")
        for mode, entry in r["modes"].items():
            for world, e in entry.items():
                flag = " (oversubscribed)" if e["oversubscribed"] else ""
                print(f"{name:<7}{mode:<8}{world:>3}{e['tasks_per_s']:>10.0f}{e['speedup']:>9.2f}x"
                      f"{e['efficiency']:>7.0%}{e['cpu_s_per_task'] * 1e3:>10.2f}ms"
                      f"{e['cpu_s_per_task_ratio']:>7.2f}x  "
                      f"{', '.join(f'{x:.2f}' for x in e['speedup_per_cycle'])}{flag}")
        if "same_model" in r:
            print(f"{name:<7}same model at W=2 as one-thread W=1: {r['same_model']}")
    print(f"wrote {RESULTS}")
    if not all(r.get("same_model", True) for r in results.values()):
        raise SystemExit("world 1 and world 2 trained different models")


if __name__ == "__main__":
    main()
