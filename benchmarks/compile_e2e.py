"""`gmeta-ds train` of a config with ``meta.compile`` true against false (issue 53 item 2).

The config (``--config``, default the demo, examples/synthetic/config.yaml: MeLU, second-order
MAML, 2 inner steps, the ranking and anchor terms; ``--set KEY=VALUE`` overrides, e.g.
``model.name=dcn_v2`` for another model of the zoo) trains through the real CLI in one plain
process (world 1) with only what keeps a run short changed: ``train.meta_steps`` (default 80), ``train.log_every=10``, ``train.threads``
(default 1), evaluation, TensorBoard and the progress bar off. Compiled and eager runs alternate
in ``--rounds`` rounds (the order swapped each round). A run's speed is the median ``tasks_per_s``
of its logged windows after the first (the first holds the compile), beside the median CPU time
per task of the same windows (``cpu_s_per_task``: less moved by other work on shared cores than
wall time); its compile time is
summary.json's ``compile.compile_s``: inductor's cache is a fresh temporary folder for each
invocation, so the first round's compile is cold and later rounds' warm (the cache the first
filled). The break-even is the meta-steps after which the cold compile has paid for itself at
the measured speeds (none when compiled is not faster).

    python benchmarks/compile_e2e.py [--rounds 2] [--steps 80] [--threads 1] [--config FILE] [--set K=V ...]

Writes ``benchmarks/results/compile_e2e.json`` (``--out``). The machine's cores may be shared with other
work: ratios of neighbouring runs, noisy; each round is reported.
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

RESULTS = Path(__file__).resolve().parent / "results" / "compile_e2e.json"
CONFIG = "examples/synthetic/config.yaml"


def run(config: str, compiled: bool, threads: int, steps: int, out: Path, extra: list[str]) -> dict:
    """One training; its speed after the first window, compile facts and elapsed time."""
    sets = [*extra, f"output_dir={out}", f"train.meta_steps={steps}", "train.log_every=10", f"train.threads={threads}",
            "train.progress=false", "train.tensorboard=false", "eval.enabled=false",
            f"meta.compile={'true' if compiled else 'false'}"]
    cmd = [sys.executable, "-m", "gmeta_ds.cli", "train", "--config", str(REPO / config), "--overwrite",
           *[a for s in sets for a in ("--set", s)]]
    run_group(cmd, 1800, f"{config} meta.compile={compiled}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "tasks_per_s" in r][1:]
    if not timed:
        raise SystemExit("fewer than two logged windows; raise --steps")
    summary = json.loads((out / "summary.json").read_text())
    return {"tasks_per_s": statistics.median(r["tasks_per_s"] for r in timed),
            "windows": [round(r["tasks_per_s"], 1) for r in timed], "compile": summary["compile"],
            "cpu_ms_per_task": 1e3 * statistics.median(r["cpu_s_per_task"] for r in timed),
            "elapsed_s": summary["elapsed_s"], "final_query_loss": summary["final_query_loss"],
            "tasks_per_meta_step": summary["tasks_seen"] / summary["meta_steps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--config", default=CONFIG, help="run config, relative to the repository")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="compile_e2e_") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # round 1 cold, then warm
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {c: run(args.config, c, args.threads, args.steps, Path(tmp) / f"{c}_{i}", args.sets) for c in order}
            ratio = got[True]["tasks_per_s"] / got[False]["tasks_per_s"]
            cpu_ratio = got[False]["cpu_ms_per_task"] / got[True]["cpu_ms_per_task"]
            load = round(os.getloadavg()[0], 2)
            rounds.append({"eager": got[False], "compiled": got[True], "compiled_vs_eager": ratio,
                           "compiled_vs_eager_cpu": cpu_ratio, "load_avg_1min": load})
            print(f"round {i + 1}: eager {got[False]['tasks_per_s']:.0f} tasks/s, compiled "
                  f"{got[True]['tasks_per_s']:.0f} tasks/s ({ratio:.2f}x; by CPU time per task {cpu_ratio:.2f}x), compile "
                  f"{got[True]['compile']['compile_s']:.1f} s ({'cold' if i == 0 else 'warm'}), "
                  f"{got[True]['compile']['graphs']} graph(s){fallback(got[True])}, load average {load}", flush=True)
    summarize(args, rounds)


def fallback(run: dict) -> str:
    """A compiled run that went eager (its speed is then eager's): the reason, else nothing."""
    reason = run["compile"].get("eager_fallback")
    return f" - WENT EAGER: {reason}" if reason else ""


def summarize(args, rounds: list[dict]) -> None:
    """Print the verdict over the rounds and write the results file."""
    ratio = statistics.median(r["compiled_vs_eager"] for r in rounds)
    cold = rounds[0]["compiled"]["compile"]["compile_s"]
    warm = [r["compiled"]["compile"]["compile_s"] for r in rounds[1:]]
    eager = statistics.median(r["eager"]["tasks_per_s"] for r in rounds)
    tasks_per_step = rounds[0]["eager"]["tasks_per_meta_step"]
    saved_per_step = tasks_per_step / eager * (1 - 1 / ratio)  # seconds a compiled meta-step saves
    break_even = round(cold / saved_per_step) if saved_per_step > 0 else None
    each = ", ".join(f"{r['compiled_vs_eager']:.2f}" for r in rounds)
    cpu_each = ", ".join(f"{r['compiled_vs_eager_cpu']:.2f}" for r in rounds)
    verdict = f"break-even after {break_even} meta-steps" if break_even else "not faster: no break-even"
    print(f"compiled vs eager: {ratio:.2f}x (median of {len(rounds)} rounds: {each}; by CPU time per task: "
          f"{cpu_each}); compile {cold:.1f} s cold, "
          f"warm {', '.join(f'{w:.1f}' for w in warm) or '-'} s; {verdict}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "config": args.config, "sets": args.sets,
                               "meta_steps": args.steps, "threads": args.threads, "compiled_vs_eager": ratio,
                               "compile_s_cold": cold, "compile_s_warm": warm,
                               "break_even_meta_steps": break_even, "rounds": rounds}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
