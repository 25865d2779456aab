"""OpenMP's wait policy x intra-op threads, for the bare learner and for `gmeta-ds train`.

Why the CLI sets ``OMP_WAIT_POLICY=PASSIVE`` only where OpenMP workers have no core of their own
(gmeta_ds/cli.py `_set_wait_policy`; docs/performance.md, "Threads"). Each run is a fresh process
(libgomp reads the policy once, at load), alternated in ``--rounds`` rounds:

- bare: `MetaLearner(MeLU, MAML(1 step), vectorize)` on 32-task micro-batches of the embedded
  dataset (benchmarks/inner_loop.py's setup), ms per micro-batch (forward + outer backward),
  median of 5 passes over 8 micro-batches, under PASSIVE, PASSIVE with ``GOMP_SPINCOUNT=300000``
  (libgomp's default spin, ~3 ms) and no policy at all, at 1 and 2 threads;
- cli: `gmeta-ds train` on the demo config (one process, 80 meta-steps, evaluation off), median
  tasks/s of the logged windows after the first, under PASSIVE and under PASSIVE with the default
  spin (the CLI keeps a policy the user set, so "no policy" is not expressible there).

    python benchmarks/wait_policy.py [--rounds 2]

Prints each run and the medians (a quiet machine is needed: spinning workers on busy cores is
the case PASSIVE exists for).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BARE = r'''
import sys, time, statistics
sys.path.insert(0, sys.argv[2]); sys.path.insert(0, sys.argv[3])
import torch
torch.set_num_threads(int(sys.argv[1]))
from inner_loop import make_batches, step
from gmeta_ds.algorithms.base import MetaLearner
from gmeta_ds.algorithms.maml import MAML
from gmeta_ds.config import EmbeddingConfig, ModelConfig, SyntheticConfig
from gmeta_ds.data.synthetic import synthetic_fields
from gmeta_ds.models.melu import build_melu
mc = ModelConfig()
net = build_melu(synthetic_fields(SyntheticConfig()), mc.embed_dim, mc.hidden, EmbeddingConfig(), seed=0)
batches = make_batches(32, 8)
learner = MetaLearner(net, MAML(1, 0.1, ["mlp.*"], vectorize=True))
fn = lambda b: learner(b).loss
for b in batches:
    step(net, fn, b)
times = []
for _ in range(5):
    t = time.perf_counter()
    for b in batches:
        step(net, fn, b)
    times.append((time.perf_counter() - t) / len(batches) * 1000)
print(statistics.median(times))
'''
ENVS = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"},
        "passive+default spin": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000"},
        "no policy": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    res: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, env in ENVS.items():
            for t in ("1", "2"):
                out = subprocess.run([sys.executable, "-c", BARE, t, str(REPO / "benchmarks"), str(REPO)],
                                     env={**base, **env}, capture_output=True, text=True, timeout=600, check=True)
                ms = float(out.stdout.strip().splitlines()[-1])
                res.setdefault(f"bare, {name}, {t} thread(s), ms/micro-batch", []).append(ms)
                print(f"bare {name} threads={t}: {ms:.2f} ms/micro-batch", flush=True)
    for _ in range(args.rounds):
        for name in ("passive", "passive+default spin"):
            for t in ("1", "2"):
                with tempfile.TemporaryDirectory() as tmp:
                    cmd = [sys.executable, "-m", "gmeta_ds.cli", "train", "--config",
                           str(REPO / "examples" / "synthetic" / "config.yaml"), "--set", f"output_dir={tmp}/run",
                           *[a for s in ("train.meta_steps=80", "train.log_every=10", f"train.threads={t}",
                                         "train.progress=false", "train.tensorboard=false", "eval.enabled=false")
                             for a in ("--set", s)]]
                    subprocess.run(cmd, env={**base, **ENVS[name]}, capture_output=True, text=True, timeout=900,
                                   check=True)
                    recs = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
                    tps = statistics.median(r["tasks_per_s"] for r in [r for r in recs if "tasks_per_s" in r][1:])
                res.setdefault(f"cli, {name}, {t} thread(s), tasks/s", []).append(tps)
                print(f"cli {name} threads={t}: {tps:.0f} tasks/s", flush=True)
    print(json.dumps({k: statistics.median(v) for k, v in res.items()}, indent=1))


if __name__ == "__main__":
    main()
