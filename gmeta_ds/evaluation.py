"""Cold-start evaluation: adapt on each held-out task's support set, score its query set.

Also the non-meta baseline: the same architecture trained by ordinary supervised learning on
all interactions of the training users, scored as is and after the same fine-tuning on each
test user's support set that the meta-learned model gets.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import vmap

from gmeta_ds.algorithms.base import MetaLearner, embed_batch
from gmeta_ds.data.tasks import TaskSet, collate, take_rows
from gmeta_ds.embedding.tables import Jagged
from gmeta_ds.functional.inner import InnerLoop, LearningRates, masked_bce
from gmeta_ds.metrics import score_tasks


def _adapted_logits(inner: InnerLoop, theta: dict, lrs: LearningRates, support: tuple, xq) -> Tensor:
    def one(xs, ys, ms, xq):
        fast, _ = inner.adapt_func(theta, lrs, xs, ys, ms)
        return inner.logits(fast, xq)

    return vmap(one)(*support, xq)


def evaluate(learner: MetaLearner, lrs: LearningRates, tasks: TaskSet, inner_steps: int,
             tasks_per_batch: int = 64) -> dict:
    """AUC and logloss over all query rows of ``tasks``, with and without adaptation.

    learner: a `MetaLearner` whose net owns its (unsharded) tables; lrs: inner learning rate of
    every adapted name (floats or tensors); ``inner_steps`` first-order steps per task.
    Returns `gmeta_ds.metrics.score_tasks` of the adapted predictions (``auc``,
    ``auc_per_task``, ``logloss``, ``ndcg@5``, ``ndcg@10``, ...) plus ``auc_no_adapt``,
    ``auc_per_task_no_adapt``, ``logloss_no_adapt`` and ``query_rows``.
    """
    net = learner.net
    lrs = {n: (lr.detach() if isinstance(lr, Tensor) else lr) for n, lr in lrs.items()}
    inner = learner.algorithm.inner_loop(learner, inner_steps, first_order=True)
    labels, adapted_p, plain_p, task_ids = [], [], [], []
    for start in range(0, len(tasks), tasks_per_batch):
        batch = collate(tasks, np.arange(start, min(start + tasks_per_batch, len(tasks))))
        with torch.no_grad():
            rows_s, rows_q = embed_batch(net.embed, batch)
            plain = net(rows_q)
            theta, support, query = learner.task_inputs(batch, rows_s, rows_q)
        theta = {n: v.detach() for n, v in theta.items()}
        adapted_logits = _adapted_logits(inner, theta, lrs, support, query[0]).detach()
        real = batch.query_mask.bool()
        labels.append(batch.query_y[real].numpy())
        task_ids.append(batch.task_ids.unsqueeze(1).expand_as(real)[real].numpy())
        adapted_p.append(torch.sigmoid(adapted_logits[real]).double().numpy())
        plain_p.append(torch.sigmoid(plain[real]).double().numpy())
    y, ids = np.concatenate(labels), np.concatenate(task_ids)
    with_adapt = score_tasks(y, np.concatenate(adapted_p), ids)
    without = score_tasks(y, np.concatenate(plain_p), ids)
    return {**with_adapt, "auc_no_adapt": without["auc"], "logloss_no_adapt": without["logloss"],
            "auc_per_task_no_adapt": without["auc_per_task"], "tasks": len(tasks),
            "query_rows": int(len(y))}


def train_baseline(net: nn.Module, tasks: TaskSet, epochs: int, batch_size: int, lr: float,
                   seed: int) -> nn.Module:
    """Supervised (non-meta) training of ``net`` on every interaction of ``tasks`` with Adam."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.from_numpy(tasks.ids.astype(np.int64))
    labels = torch.from_numpy(tasks.labels)
    ones = torch.ones(batch_size)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(ids), generator=generator)
        for start in range(0, len(ids), batch_size):
            rows = order[start:start + batch_size]
            multi = {name: Jagged(*(torch.from_numpy(a.astype(np.int64)) for a in take_rows(v, o, rows.numpy())))
                     for name, (v, o) in tasks.multi.items()}
            loss = masked_bce(net(net.embed(ids[rows], multi)), labels[rows], ones[: len(rows)])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return net
