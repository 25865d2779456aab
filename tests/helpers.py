"""Small builders shared by tests: a tiny MeLU model and random task batches."""
from __future__ import annotations

import torch

from gmeta_ds.config import EmbeddingConfig
from gmeta_ds.data.tasks import FieldSpec, TaskBatch
from gmeta_ds.models.melu import MeLU, build_melu

FIELDS = [FieldSpec("age", 5, "user"), FieldSpec("item_id", 11, "item"), FieldSpec("cat", 4, "item")]


def tiny_melu(embed_dim: int = 3, hidden=(5,), fields=FIELDS, seed: int = 0) -> MeLU:
    """A MeLU with its own (unsharded) tables."""
    return build_melu(fields, embed_dim, list(hidden), EmbeddingConfig(), seed)


def tiny_batch(tasks: int = 3, support: int = 6, query: int = 4, seed: int = 0,
               ragged: bool = True) -> TaskBatch:
    """Random padded batch; with ``ragged`` each task has fewer real rows than the padding."""
    g = torch.Generator().manual_seed(seed)

    def part(rows: int):
        ids = torch.stack([torch.randint(0, f.num_ids, (tasks, rows), generator=g) for f in FIELDS], -1)
        y = torch.randint(0, 2, (tasks, rows), generator=g).float()
        mask = torch.ones(tasks, rows)
        if ragged:
            for t in range(tasks):  # task t keeps rows - t real rows (at least one)
                mask[t, max(1, rows - t):] = 0.0
        return ids, y, mask

    s, q = part(support), part(query)
    return TaskBatch(*s, *q, torch.arange(tasks))
