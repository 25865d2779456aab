"""Length bucketing, background prefetch and a resumable position."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gmeta_ds.config import SyntheticConfig
from gmeta_ds.data.loader import TaskLoader, padding_efficiency, task_lengths
from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.data.synthetic import generate_synthetic


@pytest.fixture(scope="module")
def tasks():
    return generate_synthetic(SyntheticConfig(num_users=300), seed=0).train


def loader(tasks, bucket=True, prefetch=True, world=1, rank=0, gas=4):
    lengths = task_lengths(tasks) if bucket else None
    return TaskLoader(tasks, MetaBatchSampler(len(tasks), 8, gas, world, rank, 3, lengths), prefetch)


def test_bucketing_keeps_each_meta_steps_tasks_and_cuts_padding(tasks):
    plain, bucketed = loader(tasks, bucket=False), loader(tasks)
    eff_plain, eff_bucket = [], []
    for _ in range(5):
        a, b = plain.next(), bucketed.next()
        assert sorted(torch.cat([x.task_ids for x in a]).tolist()) == \
            sorted(torch.cat([x.task_ids for x in b]).tolist())
        eff_plain += [padding_efficiency(x) for x in a]
        eff_bucket += [padding_efficiency(x) for x in b]
    assert np.mean(eff_bucket) > np.mean(eff_plain) + 0.1


def test_bucketed_tasks_are_the_same_at_any_world_size(tasks):
    one = torch.cat([x.task_ids for x in loader(tasks, gas=4).next()])
    two = torch.cat([x.task_ids for r in range(2) for x in loader(tasks, world=2, rank=r, gas=2).next()])
    assert sorted(one.tolist()) == sorted(two.tolist())


def test_prefetch_gives_the_same_batches(tasks):
    a, b = loader(tasks, prefetch=False), loader(tasks, prefetch=True)
    for _ in range(3):
        for x, y in zip(a.next(), b.next()):
            assert torch.equal(x.support_ids, y.support_ids) and torch.equal(x.query_y, y.query_y)
    b.close()


def test_state_dict_resumes_exactly(tasks):
    first = loader(tasks)
    for _ in range(3):
        first.next()
    state = first.state_dict()
    expected = first.next()
    resumed = loader(tasks)
    resumed.load_state_dict(state)
    got = resumed.next()
    assert all(torch.equal(x.task_ids, y.task_ids) for x, y in zip(expected, got))
    with pytest.raises(ValueError, match="saved for seed 3 and .* tasks, not seed 4"):
        other = TaskLoader(tasks, MetaBatchSampler(len(tasks), 8, 4, 1, 0, 4), False)
        other.load_state_dict(state)
    first.close()
    resumed.close()
