"""Time per meta-step of every zoo model against MeLU on ml-100k (issue 15, target 2: each
model within 1.5x MeLU's time per meta-step through ``gmeta-ds train``).

Every model registered in ``gmeta_ds.registry.MODELS`` trains through the real CLI
(``python -m gmeta_ds.cli train``, one process, ``train.threads=1``) with the shipped config
``examples/movielens/ml-100k.yaml`` (Reptile, 10 inner steps, item-popularity offset) and only
what keeps a run short changed: ``train.meta_steps`` (default 60), ``train.log_every=10``,
evaluation off. Each model adapts what the shipped config adapts, in its own terms: its
``default_adapt`` (the decision layers ``mlp.*``; two_tower ``user_tower.*``) plus
``popularity.*``.

Runs alternate in rounds (every model once per round, the order rotated by one each round,
``--rounds`` rounds, default 3), so each round's ratios share the machine's state. A run's time
per meta-step is the median over its logged windows after the first (the first holds the
warm-up) of ``tasks_per_meta_step / tasks_per_s`` from ``metrics.jsonl`` (wall), and of
``cpu_s_per_task * tasks_per_meta_step`` (this process's CPU time, every thread: far less
disturbed by other jobs on the cores). Reported per model: the medians over rounds, and the
median over rounds of the per-round ratio to MeLU (wall and CPU).

    python benchmarks/zoo_speed.py [--data /tmp/ml-100k] [--rounds 3] [--steps 60]
                                   [--models melu dcn_v2 ...] [--set KEY=VALUE ...] [--out NAME]

Writes ``benchmarks/results/zoo_speed.json`` (or ``NAME.json`` there).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine, run_group  # first: sets OMP_WAIT_POLICY before torch loads

# isort: split

import argparse
import json
import os
import statistics
import tempfile
import time

from gmeta_ds.models import MODELS

RESULTS = REPO / "benchmarks" / "results" / "zoo_speed.json"
CONFIG = "examples/movielens/ml-100k.yaml"
REFERENCE = "melu"


def adapt_for(name: str) -> list[str]:
    """What the shipped config adapts, in this model's terms: its default adapted part plus
    the popularity offset."""
    return [*getattr(MODELS[name], "default_adapt", ("mlp.*",)), "popularity.*"]


def run(name: str, data: str, steps: int, out: Path, timeout: float, extra: list[str]) -> dict:
    sets = [f"data.path={data}", f"model.name={name}", f"meta.adapt={json.dumps(adapt_for(name))}",
            f"output_dir={out}", f"train.meta_steps={steps}", "train.log_every=10", "train.threads=1",
            "train.progress=false", "train.tensorboard=false", "eval.enabled=false", *extra]
    cmd = [sys.executable, "-m", "gmeta_ds.cli", "train", "--config", str(REPO / CONFIG),
           *[a for s in sets for a in ("--set", s)]]
    start = time.perf_counter()
    run_group(cmd, timeout, f"{name} ({out.name})")
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "tasks_per_s" in r]
    summary = json.loads((out / "summary.json").read_text())
    per_step = summary["tasks_seen"] / summary["meta_steps"]
    timed = records[1:] or records  # the first window holds the warm-up
    return {"ms_per_step": statistics.median(1e3 * per_step / r["tasks_per_s"] for r in timed),
            "cpu_ms_per_step": statistics.median(1e3 * per_step * r["cpu_s_per_task"] for r in timed),
            "tasks_per_meta_step": per_step, "vectorize": summary["vectorize"],
            "final_query_loss": summary["final_query_loss"], "run_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/tmp/ml-100k", help="ml-100k folder (prepare_ml100k.py)")
    parser.add_argument("--models", nargs="+", default=list(MODELS.names()), choices=list(MODELS.names()))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default="zoo_speed", help="results file name under benchmarks/results (no .json)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable)")
    args = parser.parse_args()
    models = [REFERENCE] + [m for m in args.models if m != REFERENCE]
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = models[i % len(models):] + models[: i % len(models)]  # rotated by one each round
            got = {}
            for name in order:
                got[name] = run(name, args.data, args.steps, Path(tmp) / f"{name}_{i}", args.timeout,
                                args.sets)
                print(f"round {i}: {name:<10} {got[name]['ms_per_step']:7.1f} ms/step wall, "
                      f"{got[name]['cpu_ms_per_step']:7.1f} ms/step CPU", flush=True)
            rounds.append({"order": order, "runs": got})
    table = {}
    for name in models:
        mine = [r["runs"][name] for r in rounds]
        ref = [r["runs"][REFERENCE] for r in rounds]
        ratio = [m["ms_per_step"] / r["ms_per_step"] for m, r in zip(mine, ref)]
        cpu_ratio = [m["cpu_ms_per_step"] / r["cpu_ms_per_step"] for m, r in zip(mine, ref)]
        table[name] = {"adapt": adapt_for(name),
                       "ms_per_step_median": statistics.median(m["ms_per_step"] for m in mine),
                       "cpu_ms_per_step_median": statistics.median(m["cpu_ms_per_step"] for m in mine),
                       "ratio_to_melu_median": statistics.median(ratio), "ratios": ratio,
                       "cpu_ratio_to_melu_median": statistics.median(cpu_ratio), "cpu_ratios": cpu_ratio,
                       "within_1_5x": statistics.median(ratio) <= 1.5, "vectorize": mine[0]["vectorize"]}
        row = table[name]
        print(f"{name:<10} {row['ms_per_step_median']:7.1f} ms/step (CPU "
              f"{row['cpu_ms_per_step_median']:.1f}); x{row['ratio_to_melu_median']:.2f} MeLU "
              f"(CPU x{row['cpu_ratio_to_melu_median']:.2f})", flush=True)
    results = RESULTS.with_name(f"{args.out}.json")
    results.parent.mkdir(parents=True, exist_ok=True)
    tmp_json = results.with_suffix(".json.tmp")
    tmp_json.write_text(json.dumps({"machine": {**machine(), "load_avg_at_end": os.getloadavg()},
                                    "config": CONFIG, "meta_steps": args.steps, "rounds_count": args.rounds,
                                    "sets": args.sets, "models": table, "rounds": rounds}, indent=2) + "\n")
    os.replace(tmp_json, results)
    print(f"wrote {results.relative_to(REPO)}")


if __name__ == "__main__":
    main()
