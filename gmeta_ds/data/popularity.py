"""Item popularity statistics from the training users' interactions, shared by the popularity
baseline (gmeta_ds/evaluation/baselines.py) and the models' popularity offset
(gmeta_ds/models/popularity.py): per-item counts and the item's score shrunk to the global
rate with ``prior`` pseudo-interactions. The score works on numpy arrays and torch tensors.
"""
from __future__ import annotations

import numpy as np
import torch

from gmeta_ds.data.tasks import TaskSet
from gmeta_ds.sparse import FieldSpec, single_fields

EPS = 1e-6  # binary rates are clipped to [EPS, 1 - EPS] before the logit


def item_column(fields: list[FieldSpec]) -> int:
    """Column of the item id in ``TaskSet.ids``: the first item-side single-hot field (the
    builder puts the schema's item key first among the item fields; synthetic data's
    ``item_id`` comes first too)."""
    for j, f in enumerate(single_fields(fields)):
        if f.side == "item":
            return j
    raise ValueError("no item-side single-hot field: the popularity baseline needs an item id column")


def item_statistics(train: TaskSet, column: int, oov_id: int | None = 0,
                    items: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """(shown, total, mean): per item id, its interactions and the sum of their labels over
    every row of ``train`` (support and query), and the global mean label. ``items``: the
    rows' item indices, when not ``train.ids[:, column]`` (raw ids mapped to 0..n-1). The OOV
    id ``oov_id`` (None: every id is a real item) counts nothing: it scores the global rate."""
    items = train.ids[:, column].astype(np.int64) if items is None else items
    labels = train.labels.astype(np.float64)
    size = int(items.max()) + 1 if len(items) else 0
    shown = np.bincount(items, minlength=size).astype(np.float64)
    total = np.bincount(items, labels, minlength=size)
    if oov_id is not None and 0 <= oov_id < size:
        shown[oov_id] = total[oov_id] = 0.0
    return shown, total, float(labels.mean()) if len(labels) else 0.5


def shrunk_score(total, shown, prior: float, mean, kind: str):
    """An item's score from its counts (numpy arrays or torch tensors, elementwise): binary
    ``logit((total + prior * p) / (shown + prior))`` with p = ``mean`` (a rate in
    [EPS, 1 - EPS]; the result is clipped to it too), regression the shrunk mean rating."""
    rate = (total + prior * mean) / (shown + prior)
    if kind != "binary":
        return rate
    rate = rate.clip(EPS, 1.0 - EPS)
    if isinstance(rate, np.ndarray):
        return np.log(rate) - np.log1p(-rate)
    return torch.log(rate) - torch.log1p(-rate)
