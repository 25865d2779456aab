"""Batches move to the engine's device as a whole (tensors inside dataclasses, dicts, tuples)."""
from __future__ import annotations

import torch
from helpers import tiny_batch

from gmeta_ds.engine.ds_engine import to_device
from gmeta_ds.text.data import TextEpisodes


def test_every_tensor_of_a_batch_moves_and_nothing_else_changes():
    batch = tiny_batch(tasks=3, seed=1)
    moved = to_device(batch, torch.device("meta"))
    assert moved.support_ids.device.type == "meta" and moved.task_ids.device.type == "meta"
    assert all(j.values.device.type == "meta" for j in moved.support_multi.values())
    assert moved.support_ids.shape == batch.support_ids.shape and batch.support_ids.device.type == "cpu"
    ep = TextEpisodes(*(torch.zeros(2, 3, dtype=torch.long) for _ in range(7)))
    assert to_device(ep, torch.device("meta")).support_mask.device.type == "meta"
    assert to_device((1, {"a": torch.ones(1)}), torch.device("meta"))[1]["a"].device.type == "meta"
