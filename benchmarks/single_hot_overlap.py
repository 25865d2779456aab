"""The single-hot fields' expected overlap between the ranks of a host (what
``exchange_topology: auto`` chooses the row exchange by, `data.tasks.single_hot_overlap`)
against the overlap of the micro-batches the training sampler really deals (`MetaBatchSampler`,
W = 4 ranks as 2 hosts x 2, the first micro-batch of 20 meta-steps): the sum of the two ranks'
distinct ids over the distinct ids of their union.

    python benchmarks/single_hot_overlap.py examples/synthetic/config.yaml 16   # config, tasks per micro-batch
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (puts the checkout on sys.path)
from gmeta_ds.config import load_config  # noqa: E402
from gmeta_ds.data.sampler import MetaBatchSampler  # noqa: E402
from gmeta_ds.data.tasks import single_hot_overlap  # noqa: E402
from gmeta_ds.errors import ConfigError  # noqa: E402
from gmeta_ds.embedding.topology import host_overlap  # noqa: E402
from gmeta_ds.sparse import single_fields  # noqa: E402
from gmeta_ds.workloads.ctr import build_data  # noqa: E402

WORLD, PER_HOST, STEPS = 4, 2, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a run config (YAML)")
    parser.add_argument("tasks_per_micro_batch", type=int, help="tasks per rank and micro-batch (>= 1)")
    parser.add_argument("--set", action="append", default=[], help="a config override KEY=VALUE, as for gmeta-ds")
    args = parser.parse_args()
    if args.tasks_per_micro_batch < 1:
        parser.error(f"tasks_per_micro_batch must be >= 1, got {args.tasks_per_micro_batch}")
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        sys.exit(f"single_hot_overlap.py: {exc}")
    per_micro_batch = args.tasks_per_micro_batch
    train = build_data(cfg).train
    expected = single_hot_overlap(train, per_micro_batch, PER_HOST)
    samplers = [MetaBatchSampler(len(train), per_micro_batch, 1, WORLD, r, cfg.seed, np.diff(train.offsets))
                for r in range(PER_HOST)]
    for j, spec in enumerate(single_fields(train.fields)):
        column, measured = train.ids[:, j], []
        for step in range(STEPS):
            ids = [np.concatenate([column[train.offsets[t]:train.offsets[t + 1]] for t in s.micro_batches(step)[0]])
                   for s in samplers]
            measured.append(sum(len(np.unique(i)) for i in ids) / len(np.unique(np.concatenate(ids))))
        e = expected[spec.name]
        print(f"{spec.name:>14}: expected {host_overlap(e.distinct_ratio, e.host_distinct_ratio):.3f}, "
              f"sampler {np.mean(measured):.3f}")


if __name__ == "__main__":
    main()
