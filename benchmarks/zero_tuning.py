"""DeepSpeed's gradient-reduction settings per ZeRO stage, at world 2 on the demo and CTR
configs: each variant against the stage's defaults, alternated, median of paired ratios.

Variants of ``zero_optimization`` (DeepSpeed's defaults: ``overlap_comm`` false for stages
1-2 and true for 3, ``contiguous_gradients`` true, 5e8-element buckets, so a model this size
is reduced in one bucket at the end of the backward):
  overlap   overlap_comm: true (reductions on a side stream, started while the backward runs)
  buckets   reduce_bucket_size / allgather_bucket_size 2e5 elements (reductions start as
            buckets fill; for stage 3 also prefetch_bucket_size)
  both      overlap + buckets
  no_contig contiguous_gradients: false

    python benchmarks/zero_tuning.py [--stages 1 2 3] [--configs demo ctr] [--repeats 3] [--steps 40]

Writes ``benchmarks/results/zero_tuning.json``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine  # first: OMP_WAIT_POLICY

# isort: split

import argparse
import json
import os
import statistics
import tempfile

from scaling import CONFIGS, run

RESULTS = REPO / "benchmarks" / "results" / "zero_tuning.json"
SMALL = 200_000
VARIANTS = {
    "default": {},
    "overlap": {"overlap_comm": True},
    "buckets": {"reduce_bucket_size": SMALL, "allgather_bucket_size": SMALL},
    "both": {"overlap_comm": True, "reduce_bucket_size": SMALL, "allgather_bucket_size": SMALL},
    "no_contig": {"contiguous_gradients": False},
}


def ds_config(stage: int, variant: dict, path: Path) -> Path:
    base = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    zero = {"stage": stage, **variant}
    if stage == 3 and "reduce_bucket_size" in variant:
        zero["stage3_prefetch_bucket_size"] = SMALL
    if stage == 3:
        zero.pop("allgather_bucket_size", None)  # not a stage-3 key
    base["zero_optimization"] = zero
    path.write_text(json.dumps(base))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--configs", nargs="+", default=["demo", "ctr"], choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.configs:
            for stage in args.stages:
                variants = {v: ds_config(stage, spec, tmp / f"z{stage}_{v}.json") for v, spec in VARIANTS.items()}
                cycles = [{v: run(CONFIGS[name], 2, "strong", args.steps, tmp / f"{name}_{stage}_{v}_{i}",
                                  args.timeout, extra=(f"deepspeed={path}",))["tasks_per_s"]
                           for v, path in variants.items()} for i in range(args.repeats)]
                entry = {"config": name, "stage": stage, "tasks_per_s": cycles,
                         "default_tasks_per_s": statistics.median(c["default"] for c in cycles),
                         "paired_vs_default": {v: statistics.median(c[v] / c["default"] for c in cycles)
                                               for v in VARIANTS if v != "default"}}
                results.append(entry)
                print(f"{name:<5} ZeRO-{stage}: default {entry['default_tasks_per_s']:.0f} tasks/s; " + ", ".join(
                    f"{v} {r:.2f}x" for v, r in entry["paired_vs_default"].items()), flush=True)
    RESULTS.write_text(json.dumps({"machine": {**machine(), "load_avg_at_end": os.getloadavg()},
                                   "world_size": 2, "meta_steps": args.steps, "variants": VARIANTS,
                                   "results": results}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
