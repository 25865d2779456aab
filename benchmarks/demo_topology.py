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
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (sets OMP_WAIT_POLICY before torch; puts the checkout on sys.path)
from emulated_cluster import PREFIX, emulated_cluster, rank_env, wait_all  # noqa: E402
from sites import COMMON, CONFIG, train_seconds  # noqa: E402

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
                sets = [*COMMON, f"output_dir={out}", f"train.meta_steps={args.meta_steps}",
                        "meta.tasks_per_micro_batch=16", f"embedding.exchange_topology={topology}"]
                argv = [sys.executable, "-P", "-m", "gmeta_ds.cli", "train", "--config", str(CONFIG), "--overwrite",
                        *[x for s in sets for x in ("--set", s)]]
                logs = [open(Path(tmp) / f"{topology}{rep}.rank{r}.log", "w") for r in range(2 * PER_HOST)]
                procs = [subprocess.Popen(hosts[r // PER_HOST].command(argv), env=rank_env(hosts, PER_HOST, r, PORT),
                                          cwd=common.REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
                         for r, log in enumerate(logs)]
                wait_all(procs, 1800)
                for log in logs:
                    log.close()
                if any(p.returncode for p in procs):
                    sys.exit(f"{topology}: a rank failed\n" + (Path(tmp) / f"{topology}{rep}.rank0.log").read_text()[-3000:])
                run = {"tasks_per_s": args.meta_steps * TASKS_PER_STEP / train_seconds(out),
                       "cross_host_bytes_rank0": cross_host_bytes(out),
                       "auc": json.loads((out / "summary.json").read_text())["eval"]["auc"]}
                runs.setdefault(topology, []).append(run)
                print(topology, rep, json.dumps(run), flush=True)
    ratio = [a["tasks_per_s"] / f["tasks_per_s"] for a, f in zip(runs["auto"], runs["flat"])]
    print("auto / flat tasks/s:", ", ".join(f"{r:.2f}x" for r in ratio))


if __name__ == "__main__":
    main()
