"""The demo (examples/synthetic/config.yaml, 16 tasks per micro-batch) on emulated 2 hosts x 2
ranks (`emulated_cluster`, the link limited by tbf): ``embedding.exchange_topology`` flat
against auto (which takes the hierarchical row exchange there: the single-hot fields' expected
overlap in a host, `data.tasks.single_hot_overlap`). Per run: tasks/s over the training loop
(rank 0's metrics.jsonl windows), rank 0's cross-host embedding bytes (the counters'), held-out
AUC; the two interleaved, ``--reps`` times.

    python benchmarks/demo_topology.py [--meta-steps 150] [--rate 100mbit] [--reps 2]   # root, ~2 min
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (sets OMP_WAIT_POLICY before torch; puts the checkout on sys.path)
from emulated_cluster import PREFIX, emulated_cluster  # noqa: E402
from sites import launch, train_argv, train_seconds  # noqa: E402

PORT, PER_HOST, TASKS_PER_STEP = 29650, 2, 64


def cross_host_bytes(out: Path) -> int:
    """Rank 0's embedding bytes sent to other hosts over the run (metrics.jsonl's windows)."""
    return sum(v.get("cross_host_bytes_sent", 0) for line in (out / "metrics.jsonl").read_text().splitlines()
               for v in json.loads(line).get("embedding_comm", {}).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meta-steps", type=int, default=150)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--prefix", default=PREFIX)
    parser.add_argument("--subnet", type=int, default=1)
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp, emulated_cluster(2, args.rate, args.prefix, args.subnet) as hosts:
        for rep in range(args.reps):
            for topology in ("flat", "auto"):
                out = Path(tmp) / f"{topology}{rep}"
                argv = train_argv(out, args.meta_steps, ("meta.tasks_per_micro_batch=16",
                                                         f"embedding.exchange_topology={topology}"))
                launch(hosts, argv, out, 1800, PER_HOST, PORT)
                run = {"tasks_per_s": args.meta_steps * TASKS_PER_STEP / train_seconds(out),
                       "cross_host_bytes_rank0": cross_host_bytes(out),
                       "auc": json.loads((out / "summary.json").read_text())["eval"]["auc"]}
                runs.setdefault(topology, []).append(run)
                print(topology, rep, json.dumps(run), flush=True)
    ratio = [a["tasks_per_s"] / f["tasks_per_s"] for a, f in zip(runs["auto"], runs["flat"])]
    print("auto / flat tasks/s:", ", ".join(f"{r:.2f}x" for r in ratio))


if __name__ == "__main__":
    main()
