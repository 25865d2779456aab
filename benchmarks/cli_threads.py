"""`gmeta-ds train`'s speed at 1 and 2 intra-op threads and at ``train.threads: auto`` (issue 53 item 1).

Each shipped example config that needs no downloaded data trains through the real CLI (one plain
process, world 1: ``python -m gmeta_ds.cli train``) with only what keeps a run short changed:
``train.meta_steps`` (default 60), ``train.log_every=10``, evaluation and TensorBoard off. For
each config, runs at ``train.threads`` 1, 2 and auto alternate in ``--rounds`` rounds (the order
rotated each round), so a round's ratios share the machine's state. A run's speed is the median
of ``tasks_per_s`` over its logged windows after the first (the warm-up), and its CPU use the
median of ``cpu_s_per_task x tasks_per_s`` (cores busy on average: 1.0 = one core).

Reported per config: tasks/s per setting (median over rounds), auto's ratio to the faster of 1
and 2 threads (the target: >= 0.95) and 2 threads' ratio to 1 (per round, then the median).
The machine's cores may be shared with other work: ratios of neighbouring runs, noisy.

    python benchmarks/cli_threads.py [--rounds 3] [--steps 60] [--configs synthetic table]

Writes ``benchmarks/results/cli_threads.json``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, bench_env, machine, run_group  # first: sets OMP_WAIT_POLICY before torch loads

# isort: split

import argparse
import json
import statistics
import tempfile

RESULTS = Path(__file__).resolve().parent / "results" / "cli_threads.json"
# Shipped configs that train on data they make themselves (the table example's is written by its
# make_table.py into the run folder first).
CONFIGS = {"synthetic": "examples/synthetic/config.yaml", "table": "examples/table/config.yaml"}
SETTINGS = ("1", "2", "auto")


def prepare(name: str, work: Path) -> list[str]:
    """Extra ``--set`` values a config needs to run here (its data made first when it has a maker)."""
    if name != "table":
        return []
    data = work / "clicks.csv"
    run_group([sys.executable, str(REPO / "examples" / "table" / "make_table.py"), "--out", str(data)], 300,
              "make_table.py")
    return [f"data.path={data}", f"data.cache_dir={work / 'cache'}"]


def run(config: str, threads: str, steps: int, out: Path, extra: list[str]) -> dict:
    sets = [f"output_dir={out}", f"train.meta_steps={steps}", "train.log_every=10",
            f"train.threads={threads}", "train.progress=false", "train.tensorboard=false",
            "eval.enabled=false", *extra]
    cmd = [sys.executable, "-m", "gmeta_ds.cli", "train", "--config", str(REPO / config), "--overwrite",
           *[a for s in sets for a in ("--set", s)]]
    # As a user's shell runs it: no OMP_WAIT_POLICY (benchmarks/common.py sets PASSIVE for the
    # other benchmarks; the CLI chooses its own, gmeta_ds/cli.py `_set_wait_policy`).
    env = {k: v for k, v in bench_env().items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    run_group(cmd, 1200, f"{config} threads={threads}", env=env)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "tasks_per_s" in r][1:]
    if not timed:
        raise SystemExit(f"{config}: fewer than two logged windows; raise --steps")
    return {"tasks_per_s": statistics.median(r["tasks_per_s"] for r in timed),
            "cores_busy": statistics.median(r["cpu_s_per_task"] * r["tasks_per_s"] for r in timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=sorted(CONFIGS))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="cli_threads_") as tmp:
        work = Path(tmp)
        for name in args.configs:
            extra = prepare(name, work)
            rounds = []
            for i in range(args.rounds):
                order = SETTINGS[i % 3:] + SETTINGS[:i % 3]
                got = {t: run(CONFIGS[name], t, args.steps, work / f"{name}_{t}_{i}", extra) for t in order}
                rounds.append(got)
                print(f"{name} round {i + 1}: " + ", ".join(
                    f"threads={t} {got[t]['tasks_per_s']:.0f} tasks/s ({got[t]['cores_busy']:.2f} cores)"
                    for t in SETTINGS), flush=True)
            med = {t: statistics.median(r[t]["tasks_per_s"] for r in rounds) for t in SETTINGS}
            busy = {t: statistics.median(r[t]["cores_busy"] for r in rounds) for t in SETTINGS}
            auto_vs_best = statistics.median(r["auto"]["tasks_per_s"] / max(r["1"]["tasks_per_s"], r["2"]["tasks_per_s"])
                                             for r in rounds)
            two_vs_one = statistics.median(r["2"]["tasks_per_s"] / r["1"]["tasks_per_s"] for r in rounds)
            results[name] = {"config": CONFIGS[name], "tasks_per_s": med, "cores_busy": busy,
                             "auto_vs_best": auto_vs_best, "two_vs_one": two_vs_one, "rounds": rounds}
            print(f"{name}: tasks/s 1 thread {med['1']:.0f}, 2 threads {med['2']:.0f}, auto {med['auto']:.0f}; "
                  f"2 vs 1 {two_vs_one:.2f}x, auto vs the faster {auto_vs_best:.2f}x", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "meta_steps": args.steps, "rounds_count": args.rounds,
                               "results": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
