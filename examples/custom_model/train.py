"""Bring your own model: a DCN-v2 (cross network + deep tower) meta-trained with second-order
MAML on DeepSpeed ZeRO-2, with row-wise sharded embedding tables, written only against the
public API of gmeta_ds (docs/api.md).

    python examples/custom_model/train.py                          # one process
    deepspeed --num_gpus 2 examples/custom_model/train.py          # two ranks (gloo on CPU)
    python examples/custom_model/train.py --steps 60 --resume      # 30 more steps, at any world size

Both print the same cold-start AUC and write the same weights (OUT/model.safetensors).
"""
from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
import torch
from torch import nn

import gmeta_ds as gm


def interaction_log(users: int = 300, items: int = 120, seed: int = 0) -> pd.DataFrame:
    """A click log: users with an age bucket, items with a category and a bag of tags (one
    multi-hot field), clicks from a hidden user-item affinity. Your own log goes here."""
    rng = np.random.default_rng(seed)
    taste, style = rng.normal(size=(users, 4)), rng.normal(size=(items, 4))
    popularity, affinity = rng.normal(size=items), rng.normal(size=(5, 7))  # age x category
    rows = []
    for u in range(users):
        for i in rng.choice(items, size=rng.integers(15, 40), replace=False):
            logit = popularity[i] + 1.5 * affinity[u % 5, i % 7] + taste[u] @ style[i] / 2
            tags = "|".join(f"t{t}" for t in rng.choice(12, size=rng.integers(1, 4), replace=False))
            rows.append((f"u{u}", f"i{i}", f"age{u % 5}", f"c{i % 7}", tags,
                         float(rng.random() < 1 / (1 + np.exp(-logit)))))
    return pd.DataFrame(rows, columns=["user", "item", "age", "category", "tags", "click"])


class DCNv2(nn.Module):
    """Cross network (x_{l+1} = x_0 * (W_l x_l + b_l) + x_l) beside a deep MLP, then a linear
    head. Input: looked-up rows (N, F, d); output: one click logit per row (N,)."""

    def __init__(self, row_fields: list[str], num_fields: int, dim: int, cross_layers: int = 2,
                 hidden: int = 32):
        super().__init__()
        self.row_fields = row_fields  # single-hot fields, in the tasks' id-column order
        width = num_fields * dim
        self.cross = nn.ModuleList(nn.Linear(width, width) for _ in range(cross_layers))
        self.deep = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(width + hidden, 1)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        x0 = rows.flatten(start_dim=-2)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.head(torch.cat([x, self.deep(x0)], dim=-1)).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="runs/custom_model")
    parser.add_argument("--resume", action="store_true", help="continue from OUT's newest checkpoint")
    parser.add_argument("--local_rank", type=int, default=0)  # set by the deepspeed launcher
    args = parser.parse_args()

    # 1. Tasks: one per user, support/query split, vocabularies from training users only.
    data = gm.build_tasks(interaction_log(), task_key="user", item_key="item", label="click",
                          user_features=["age"], item_features=["category"], multi_hot={"tags": "|"},
                          label_kind="binary", threshold=0.5, query_size=5, min_interactions=10, seed=0)
    # 2. Tables (one per field, dim 8) and the model over their rows.
    dim = 8
    tables = gm.tables_for(data.fields, dim, optimizer="adagrad", lr=0.05)
    torch.manual_seed(0)  # the same initial dense weights on every rank
    model = DCNv2([f.name for f in gm.single_fields(data.fields)], len(data.fields), dim)
    # 3. The algorithm: second-order MAML adapting the head and the last cross layer per task.
    learner = gm.meta_learner(model, "maml", inner_steps=2, inner_lr=0.1,
                              adapt=["head.*", model.cross[-1].weight])
    # 4. DeepSpeed (ZeRO-2 over the dense parameters), tables sharded row-wise over the ranks.
    ds_config = {"optimizer": {"type": "Adam", "params": {"lr": "auto"}}, "zero_optimization": {"stage": 2}}
    engine = gm.initialize(learner, ds_config, tables=tables, sharding="row_wise",
                           tasks_per_micro_batch=8, tasks_per_meta_step=16, lr=1e-2, seed=0,
                           resume="auto" if args.resume else None, output_dir=args.out)

    for step in range(engine.step, args.steps):  # engine.step: where a resumed run left off
        result = engine.meta_step(engine.batches(data.train, step))
        if engine.rank == 0 and (step + 1) % 5 == 0:
            print(f"meta-step {step + 1}: query loss {result.query_loss:.4f}")
    engine.save_checkpoint(args.out)  # resumable at any world size
    scores = engine.evaluate(data.test)  # every rank gets the same scores
    engine.save_weights(f"{args.out}/model.safetensors")
    if engine.rank == 0:
        print(f"cold-start AUC on {scores['tasks']} new users: {scores['auc']:.4f} adapted, "
              f"{scores['auc_no_adapt']:.4f} without adaptation; weights in {args.out}/model.safetensors")


if __name__ == "__main__":
    main()
