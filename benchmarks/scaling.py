"""World 1 vs world 2 on this machine: the same config and global tasks per meta-step, run as
one plain process and under ``deepspeed --num_gpus 2``, side by side in one script.

Reports tasks/s (median over logged windows after the first), scaling efficiency
(tasks/s at W / (W x tasks/s at 1)) and whether both runs trained the same model (checksums
within 1e-5 relative). Writes ``benchmarks/results/scaling.json``.

    python benchmarks/scaling.py [--config examples/synthetic/config.yaml] [--steps 80]

Keep runs short for the same-model check: over hundreds of Adam steps the two runs drift apart
(300 demo steps: dense checksum -11.67 vs -10.14) although they agree to 1e-7 after 40 -
Adam amplifies the last-bit differences of reduction order in near-zero gradients.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, config: str, steps: int, out: Path, timeout: int) -> dict:
    sets = [f"output_dir={out}", f"train.meta_steps={steps}", "train.log_every=10",
            "train.progress=false", "train.tensorboard=false", "eval.enabled=false"]
    args = ["train", "--config", config, *[a for s in sets for a in ("--set", s)]]
    if world == 1:
        cmd = [str(BIN / "gmeta-ds"), *args]
    else:
        cmd = [str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port()),
               str(BIN / "gmeta-ds"), *args]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"world {world} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"world_size": world, "wall_s": wall, "train_s": summary["elapsed_s"],
            "tasks_per_s": statistics.median(r["tasks_per_s"] for r in (records[1:] or records)),
            "batch": summary["batch"], "dense_checksum": summary["dense_checksum"],
            "embedding_checksum": summary["embedding_checksum"],
            "final_query_loss": summary["final_query_loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/synthetic/config.yaml")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--timeout", type=int, default=900)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run(w, args.config, args.steps, Path(tmp) / f"w{w}", args.timeout) for w in (1, 2)]
    one, two = runs
    same = all(abs(two[k] - one[k]) <= 1e-5 * max(1.0, abs(one[k]))
               for k in ("dense_checksum", "embedding_checksum", "final_query_loss"))
    result = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "load_avg_at_end": os.getloadavg()},
              "config": args.config, "meta_steps": args.steps, "runs": runs,
              "speedup": two["tasks_per_s"] / one["tasks_per_s"],
              "scaling_efficiency": two["tasks_per_s"] / (2 * one["tasks_per_s"]),
              "same_model": same}
    print(f"{'world':>5} {'tasks/s':>10} {'train s':>8}  batch")
    for r in runs:
        print(f"{r['world_size']:>5} {r['tasks_per_s']:>10.0f} {r['train_s']:>8.1f}  {r['batch']}")
    print(f"speed-up {result['speedup']:.2f}x, scaling efficiency {result['scaling_efficiency']:.0%}, "
          f"same model: {same}")
    out = REPO / "benchmarks" / "results" / "scaling.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if not same:
        raise SystemExit("world 1 and world 2 trained different models")


if __name__ == "__main__":
    main()
