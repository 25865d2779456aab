"""Time of the paired bootstrap of an evaluation (`gmeta_ds.evaluation.intervals.paired_intervals`).

Synthetic held-out set: ``--users`` users with ``--rows`` query rows each (the default 10 is
``data.query_size``), binary labels, the meta-learned model's and one baseline's predictions
(correlated, both informative). Timed: one `paired_intervals` call with ``--resamples``
resamples, all three binary metrics (global AUC weighted by user multiplicity, mean per-user
AUC, logloss) for both models; and the same for ratings (MAE, RMSE). Reported: the median wall
and CPU time (``process_time``: the machine may be shared) of ``--reps`` calls, and that two calls with the same seed agree exactly. Target (issue 39):
under 2 s for 10,000 users x 1,000 resamples. Writes ``benchmarks/results/bootstrap.json``.

    python benchmarks/bootstrap.py [--users 10000] [--rows 10] [--resamples 1000] [--reps 3]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # first: sets OMP_WAIT_POLICY before numerical libraries load

# isort: split

import argparse
import json
import statistics
import time

import numpy as np

from gmeta_ds.evaluation.intervals import paired_intervals


def held_out(users: int, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Query rows of ``users`` users: labels, task, and two models' predictions."""
    rng = np.random.default_rng(seed)
    task = np.repeat(np.arange(users), rows)
    signal = rng.normal(size=users * rows) + rng.normal(size=users)[task]
    labels = (signal + rng.normal(size=len(task)) > 0).astype(np.float32)
    meta = 1.0 / (1.0 + np.exp(-(signal + rng.normal(size=len(task)))))
    base = 1.0 / (1.0 + np.exp(-(0.8 * signal + rng.normal(size=len(task)))))
    return {"labels": labels, "task": task, "meta": meta, "base": base,
            "rating": 1.0 + 4.0 * labels, "meta_r": 1.0 + 4.0 * meta, "base_r": 1.0 + 4.0 * base}


def timed(reps: int, call) -> tuple[float, float, dict]:
    """Median wall and CPU seconds of ``reps`` calls and the last result (CPU time: what the
    call costs on a machine others share)."""
    wall, cpu, out = [], [], None
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = call()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    d = held_out(args.users, args.rows)
    binary_s, binary_cpu, binary = timed(args.reps, lambda: paired_intervals(
        d["labels"], d["task"], d["meta"], {"baseline": d["base"]}, "binary", args.resamples, seed=0))
    rating_s, rating_cpu, _ = timed(args.reps, lambda: paired_intervals(
        d["rating"], d["task"], d["meta_r"], {"baseline": d["base_r"]}, "regression", args.resamples, seed=0))
    again = paired_intervals(d["labels"], d["task"], d["meta"], {"baseline": d["base"]}, "binary",
                             args.resamples, seed=0)
    result = {"machine": machine(), "users": args.users, "rows_per_user": args.rows,
              "resamples": args.resamples, "binary_s": round(binary_s, 3), "binary_cpu_s": round(binary_cpu, 3),
              "regression_s": round(rating_s, 3), "regression_cpu_s": round(rating_cpu, 3),
              "deterministic": again == binary, "differences": binary["differences"]["baseline"]}
    print(json.dumps(result, indent=2))
    out = Path(__file__).resolve().parent / "results" / "bootstrap.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
