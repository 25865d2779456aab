"""Issue 47: where the per-user ranking gap came from and what closes it, one change at a time.

Each row is one ``gmeta-ds train`` of a config (one process, 1 thread, so two rows run side by
side on 2 cores) with ``--set`` overrides, scored by the run's own evaluation: the mean
per-user AUC of the meta-learned model after adaptation, its difference to each baseline with
the paired-bootstrap 95% interval over the held-out users, the few-shot curve (support rows 1,
2, 5, 10, 20, all) and the inner-steps curve (0 steps: the initialisation's own ranking).

Ladders (``--ladder``):
- ``demo``: examples/synthetic/config.yaml as shipped before issue 47 (``BEFORE``), then each
  change of the new recipe added in turn, then the shipped config; scored on the test users.
- ``valid``: the same ladder scored on validation users (``data.valid_fraction 0.1``,
  ``eval.split valid``): where the choices were confirmed without the test users.
- ``single``: each change alone on top of ``BEFORE`` (what each lever does by itself).
- ``zoo``: the shipped recipe against ``BEFORE`` with another model and another seed.

Writes benchmarks/results/cold_start_recipe.json (every row: overrides, the eval's numbers,
wall seconds) and prints one line per row.

    python benchmarks/cold_start_recipe.py [--ladder demo valid single zoo] [--jobs 2]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, bench_env, machine, run_group  # first: sets OMP_WAIT_POLICY

# isort: split

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

CONFIG = "examples/synthetic/config.yaml"
RESULTS = REPO / "benchmarks" / "results" / "cold_start_recipe.json"
# The demo's recipe before issue 47, as overrides of the shipped config.
BEFORE = {"data.resample": False, "meta.rank_weight": 0, "meta.init_weight": 0, "embedding.lr": 0.05,
          "meta.inner_loss_prior": 0, "meta.inner_lr": 0.3, "data.resample_support": "full",
          "data.valid_fraction": 0, "eval.finetune_search": False}
# The changes of the new recipe, in the order they were found (docs/cold_start.md).
STEPS = [("+ pairwise ranking term (meta.rank_weight 1)", {"meta.rank_weight": 1}),
         ("+ episodes redrawn (data.resample)", {"data.resample": True}),
         ("+ initialisation held to the data (meta.init_weight 1)", {"meta.init_weight": 1}),
         ("+ sparse rows' rate 0.15 (embedding.lr)", {"embedding.lr": 0.15}),
         ("+ small supports shrunk (meta.inner_loss_prior 5), inner lr 0.5",
          {"meta.inner_loss_prior": 5, "meta.inner_lr": 0.5}),
         ("+ random support sizes (data.resample_support random)", {"data.resample_support": "random"})]
VALID = {"data.valid_fraction": 0.1, "eval.split": "valid", "eval.finetune_search": False}
ZOO = [("dcn_v2", 1), ("deepfm", 2)]


def ladder(name: str) -> list[tuple[str, dict]]:
    """(label, overrides) of each row of a ladder."""
    if name in ("demo", "valid"):
        extra = VALID if name == "valid" else {}
        rows, current = [("before issue 47", {**BEFORE, **extra})], dict(BEFORE)
        for label, change in STEPS:
            current = {**current, **change}
            rows.append((label, {**current, **extra}))
        rows.append(("shipped config", dict(extra)))
        return rows
    if name == "single":
        return [(label.replace("+ ", "alone: "), {**BEFORE, **change}) for label, change in STEPS]
    return [(f"{model} seed {seed}: {which}", {**over, "model.name": model, "seed": seed})
            for model, seed in ZOO for which, over in (("before issue 47", BEFORE), ("shipped config", {}))]


def run(label: str, overrides: dict, out: Path) -> dict:
    """One training run of ``CONFIG`` with ``overrides`` into ``out``: its eval and wall time."""
    sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    cmd = [sys.executable, "-I", "-m", "gmeta_ds.cli", "train", "--config", CONFIG, *sets,
           "--set", f"output_dir={out}", "--set", "train.threads=1", "--set", "train.progress=false",
           "--set", "train.tensorboard=false", "--overwrite"]
    start = time.perf_counter()
    run_group(cmd, 1800, label, bench_env(OMP_NUM_THREADS="1"))
    summary = json.loads((out / "summary.json").read_text())
    return {"label": label, "overrides": overrides, "wall_s": round(time.perf_counter() - start, 1),
            "eval": summary["eval"]}


def line(row: dict) -> str:
    """The row's per-user AUC, its difference to the fine-tuned baselines, the few-shot curve."""
    ev = row["eval"]
    diffs = ev.get("intervals", {}).get("differences", {})
    parts = [f"{row['label'][:58]:58s} per-user {ev['auc_per_task']:.4f} AUC {ev['auc']:.4f}"]
    for name in ("baseline_finetune", "baseline_finetune_tuned", "baseline"):
        if name in diffs:
            d = diffs[name]["auc_per_task"]
            parts.append(f"vs {name[9:] or 'unadapted'} {d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]")
    few = ev.get("few_shot", {}).get("metrics", {}).get("meta", {}).get("auc_per_task", [])
    steps = ev.get("inner_steps_curve", {}).get("metrics", {}).get("meta", {}).get("auc_per_task", [])
    parts.append("few-shot " + " ".join(f"{x:.3f}" for x in few))
    parts.append(f"0 steps {steps[0]:.3f}" if steps else "")
    return " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ladder", nargs="+", default=["demo", "valid", "single", "zoo"],
                        choices=["demo", "valid", "single", "zoo"])
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side (1 thread each)")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        for name in args.ladder:
            rows = ladder(name)
            futures = [pool.submit(run, label, over, Path(tmp) / f"{name}-{i}") for i, (label, over) in enumerate(rows)]
            results[name] = [f.result() for f in futures]
            print(f"== {name}")
            for row in results[name]:
                print(line(row))
    results["machine"] = machine()
    results["config"] = CONFIG
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
