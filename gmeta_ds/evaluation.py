"""Cold-start evaluation: adapt on each held-out task's support set, score its query set.

Also the non-meta baseline: the same architecture trained by ordinary supervised learning on
all interactions of the training users, scored as is and after the same fine-tuning on each
test user's support set that the meta-learned model gets.
"""
from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import log_loss, roc_auc_score
from torch import Tensor, nn
from torch.func import functional_call, vmap

from gmeta_ds.data.tasks import TaskSet, collate
from gmeta_ds.functional.inner import InnerLoop, LearningRates, masked_bce


def _adapted_logits(inner: InnerLoop, theta: dict, lrs: LearningRates, support: tuple,
                    rows_q: Tensor) -> Tensor:
    def one(xs, ys, ms, xq):
        fast, _ = inner.adapt_func(theta, lrs, xs, ys, ms)
        return functional_call(inner.module, fast, (xq,), tie_weights=inner.tied)

    return vmap(one)(*support, rows_q)


def _scores(labels: np.ndarray, probs: np.ndarray) -> dict:
    auc = float(roc_auc_score(labels, probs)) if len(np.unique(labels)) == 2 else float("nan")
    return {"auc": auc, "logloss": float(log_loss(labels, probs, labels=[0, 1]))}


def evaluate(net: nn.Module, adapted: list[str], lrs: LearningRates, tasks: TaskSet,
             inner_steps: int, tasks_per_batch: int = 64) -> dict:
    """AUC and logloss over all query rows of ``tasks``, with and without adaptation.

    net: a MeLU-like model (``embed`` + ``forward``); adapted / lrs: which parameters adapt and
    their inner learning rates (floats or tensors); ``inner_steps`` first-order steps.
    Returns ``{"auc", "logloss", "auc_no_adapt", "logloss_no_adapt", "tasks", "query_rows"}``.
    """
    params = dict(net.named_parameters())
    theta = {n: params[n].detach() for n in adapted}
    lrs = {n: (lr.detach() if isinstance(lr, Tensor) else lr) for n, lr in lrs.items()}
    inner = InnerLoop(net, inner_steps, first_order=True)
    labels, adapted_p, plain_p = [], [], []
    for start in range(0, len(tasks), tasks_per_batch):
        batch = collate(tasks, np.arange(start, min(start + tasks_per_batch, len(tasks))))
        with torch.no_grad():
            rows_s, rows_q = net.embed(batch.support_ids), net.embed(batch.query_ids)
            plain = net(rows_q)
        adapted_logits = _adapted_logits(inner, theta, lrs, (rows_s, batch.support_y,
                                                             batch.support_mask), rows_q).detach()
        real = batch.query_mask.bool()
        labels.append(batch.query_y[real].numpy())
        adapted_p.append(torch.sigmoid(adapted_logits[real]).double().numpy())
        plain_p.append(torch.sigmoid(plain[real]).double().numpy())
    y = np.concatenate(labels)
    with_adapt, without = _scores(y, np.concatenate(adapted_p)), _scores(y, np.concatenate(plain_p))
    return {**with_adapt, "auc_no_adapt": without["auc"], "logloss_no_adapt": without["logloss"],
            "tasks": len(tasks), "query_rows": int(len(y))}


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
            loss = masked_bce(net(net.embed(ids[rows])), labels[rows], ones[: len(rows)])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return net
