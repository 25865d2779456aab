"""An API script under the deepspeed launcher, with and without OMP_NUM_THREADS=1 (issue 50 item 1).

`gm.initialize` gives each rank its share of the host's cores (``threads="auto"``): cores / the
launcher's ranks on this host. Before it did, an API script under ``deepspeed --num_gpus 2``
kept torch's default (every core on every rank): OpenMP spun on shared cores and the issue
measured 156.7 s against 8.5 s with OMP_NUM_THREADS=1. Each cycle here launches, side by side:

  auto    ``deepspeed --num_gpus 2 script`` as a user runs it (no OMP_NUM_THREADS)
  omp1    the same with OMP_NUM_THREADS=1 set by hand (the target: auto within 1.3x of it)
  before  (``--before``) ``threads=<cores>``: every rank takes every core, what auto replaced

The ranks' environment is the user's: no OMP_WAIT_POLICY (benchmarks/common.py sets PASSIVE for
the other benchmarks; a user's script does not have it). The time is rank 0's loop of
``--steps`` meta-steps after one warm-up step (no start-up, no import): the docs' two-layer
model of docs/api.md on 200 users, second-order MAML, 2 inner steps, ZeRO-1, sharded tables.
The machine's cores may be shared with other work: ratios of neighbouring runs, noisy.

    python benchmarks/api_threads.py [--steps 60] [--repeats 1] [--before]

Writes ``benchmarks/results/api_threads.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "api_threads.json"
RUNS = ("auto", "omp1", "before")


def rank_script(steps: int, threads: str, out: str) -> None:
    """One rank of the launched API script (docs/api.md's example, smaller). This process
    never imports benchmarks/common.py: it would set OMP_WAIT_POLICY, which a user's does not."""
    import numpy as np
    import pandas as pd
    import torch
    from torch import nn

    import gmeta_ds as gm

    rng = np.random.default_rng(0)
    log = pd.DataFrame({"user": [f"u{u}" for u in range(200) for _ in range(20)],
                        "item": [f"i{i}" for i in rng.integers(0, 50, 4000)],
                        "city": [f"c{u % 4}" for u in range(200) for _ in range(20)]})
    log["click"] = (rng.random(4000) < 0.3).astype(float)
    data = gm.build_tasks(log, task_key="user", item_key="item", label="click", user_features=["city"],
                          label_kind="binary", threshold=0.5, query_size=5, seed=0,
                          cache_dir=str(Path(out).parent / "cache"))

    class TwoLayer(nn.Module):
        def __init__(self, fields, dim):
            super().__init__()
            self.row_fields = [f.name for f in gm.single_fields(fields)]
            self.body = nn.Sequential(nn.Linear(len(fields) * dim, 32), nn.ReLU())
            self.head = nn.Linear(32, 1)

        def forward(self, rows):
            return self.head(self.body(rows.flatten(start_dim=-2))).squeeze(-1)

    torch.manual_seed(0)
    learner = gm.meta_learner(TwoLayer(data.fields, 8), "maml", inner_steps=2, inner_lr=0.1, adapt=["head.*"])
    engine = gm.initialize(learner, {"optimizer": {"type": "Adam", "params": {"lr": "auto"}},
                                     "zero_optimization": {"stage": 1}},
                           tables=gm.tables_for(data.fields, dim=8), tasks_per_micro_batch=8,
                           tasks_per_meta_step=16, lr=1e-2, threads=threads if threads == "auto" else int(threads))
    engine.meta_step(engine.batches(data.train, 0))  # warm-up: first-call costs
    start = time.perf_counter()
    for step in range(1, steps + 1):
        engine.meta_step(engine.batches(data.train, step))
    seconds = time.perf_counter() - start
    if engine.rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "torch_threads": torch.get_num_threads()}))


def launch(run: str, steps: int, work: Path) -> dict:
    """One `deepspeed --num_gpus 2` launch of this file as the API script; rank 0's timing."""
    from common import BIN, bench_env, free_port, run_group
    env = bench_env()
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        env.pop(name, None)
    if run == "omp1":
        env["OMP_NUM_THREADS"] = "1"
    threads = str(os.cpu_count() or 1) if run == "before" else "auto"
    out = work / f"{run}.json"
    run_group([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), __file__,
               "--rank-script", str(steps), threads, str(out)], timeout=900, what=f"api_threads {run}", env=env)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--before", action="store_true", help="also run threads=<cores> (slow: ~20x on 2 cores)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py: only here, not in the ranks
    from common import machine
    runs = [r for r in RUNS if r != "before" or args.before]
    times: dict[str, list[float]] = {r: [] for r in runs}
    threads: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # one cycle: every run once, neighbours in time
            for run in runs:
                result = launch(run, args.steps, Path(tmp))
                times[run].append(result["seconds"])
                threads[run] = result["torch_threads"]
    ratios = [a / b for a, b in zip(times["auto"], times["omp1"])]
    rows = {r: {"seconds": statistics.median(times[r]), "all_seconds": times[r], "torch_threads": threads[r],
                "vs_omp1": statistics.median(times[r]) / statistics.median(times["omp1"])} for r in runs}
    result = {"steps": args.steps, "ranks": 2, "repeats": args.repeats, "runs": rows,
              "auto_over_omp1_per_cycle": ratios, "target": "auto within 1.3x of omp1",
              "machine": machine(), "command": "python benchmarks/api_threads.py " + " ".join(sys.argv[1:])}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.steps} meta-steps on 2 ranks (deepspeed --num_gpus 2), {os.cpu_count()} cores; noisy (shared)")
    print("| run | torch threads per rank | loop s | vs OMP_NUM_THREADS=1 |\n|---|---|---|---|")
    for run, row in rows.items():
        print(f"| {run} | {row['torch_threads']} | {row['seconds']:.2f} | {row['vs_omp1']:.2f}x |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("--local_rank"):
        sys.argv.pop(1)  # the deepspeed launcher's own argument, before ours
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-script":
        rank_script(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        sys.exit(0)
    sys.exit(main())
