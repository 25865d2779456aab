"""Paired before/after of the trainer: the same runs with the code of an earlier commit and
with this checkout, alternated, so the ratio is not the machine's drift.

For every (config, W): ``--repeats`` pairs, each the earlier commit's run then this
checkout's, both through the real CLI (``python -m gmeta_ds.cli train``; under ``deepspeed
--num_gpus W --module`` for W > 1) with the same venv, ``PYTHONPATH`` choosing the code (the
earlier commit is exported with ``git archive`` into a temporary folder). Reported: tasks/s
(median over the logged windows after the first) of both, the median of the pairs' ratios,
and whether both trained the same model (checksums within 1e-5 relative at W = 2, where one
thread per rank makes runs reproducible).

    python benchmarks/before_after.py --before 3483f9e [--configs demo ctr] [--worlds 1 2]
                                      [--repeats 3] [--steps 60] [--set KEY=VALUE ...] [--out NAME]

Writes ``benchmarks/results/before_after.json`` (or ``NAME.json`` there).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, REPO, bench_env, free_port, machine, run_group  # first: OMP_WAIT_POLICY

# isort: split

import argparse
import json
import os
import statistics
import subprocess
import tempfile

from scaling import CONFIGS, SAME_MODEL_KEYS, close

RESULTS = REPO / "benchmarks" / "results" / "before_after.json"


def run(code: Path, config: str, world: int, steps: int, out: Path, timeout: float,
        extra: list[str]) -> dict:
    sets = [f"output_dir={out}", f"train.meta_steps={steps}", "train.log_every=10", "train.progress=false",
            "train.tensorboard=false", "eval.enabled=false", *extra]
    args = ["train", "--config", str(REPO / config), *[a for s in sets for a in ("--set", s)]]
    cmd = [sys.executable, "-m", "gmeta_ds.cli", *args] if world == 1 else [
        str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port()),
        "--module", "gmeta_ds.cli", *args]
    env = bench_env(PYTHONPATH=str(code))
    run_group(cmd, timeout, f"{code.name} {config} world {world}", env=env)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"tasks_per_s": statistics.median(r["tasks_per_s"] for r in records[1:] or records),
            **{k: summary[k] for k in SAME_MODEL_KEYS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--configs", nargs="+", default=["demo", "ctr"], choices=list(CONFIGS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default="before_after", help="results file name (no .json)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both sides (repeatable), e.g. deepspeed=ds_configs/zero0.json")
    args = parser.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / f"before-{rev}"
        before.mkdir()
        archive = subprocess.run(["git", "archive", rev, "gmeta_ds"], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        for name in args.configs:
            for world in args.worlds:
                pairs = []
                for i in range(args.repeats):
                    pairs.append({which: run(code, CONFIGS[name], world, args.steps,
                                             Path(tmp) / f"{name}_{world}_{which}_{i}", args.timeout,
                                             args.sets)
                                  for which, code in (("before", before), ("after", REPO))})
                ratios = [p["after"]["tasks_per_s"] / p["before"]["tasks_per_s"] for p in pairs]
                entry = {"config": name, "world_size": world, "pairs": pairs, "ratios": ratios,
                         "speedup": statistics.median(ratios),
                         "before_tasks_per_s": statistics.median(p["before"]["tasks_per_s"] for p in pairs),
                         "after_tasks_per_s": statistics.median(p["after"]["tasks_per_s"] for p in pairs)}
                if world > 1:
                    entry["same_model"] = all(close(p["after"], p["before"]) for p in pairs)
                results.append(entry)
                print(f"{name:<6} W={world}: before {entry['before_tasks_per_s']:.0f} tasks/s, after "
                      f"{entry['after_tasks_per_s']:.0f}; paired {', '.join(f'{r:.2f}' for r in ratios)}"
                      f" -> {entry['speedup']:.2f}x" + (f"; same model: {entry['same_model']}"
                                                         if world > 1 else ""), flush=True)
    out = RESULTS.with_name(f"{args.out}.json")
    out.write_text(json.dumps({"machine": {**machine(), "load_avg_at_end": os.getloadavg()},
                                   "before": rev, "after": "working tree", "meta_steps": args.steps,
                                   "sets": args.sets,
                                   "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
