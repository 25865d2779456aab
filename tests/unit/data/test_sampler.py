"""The tasks of meta-step k do not depend on the world size."""
from __future__ import annotations

import numpy as np
import pytest

from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.errors import ConfigError


def tasks_of_step(step, world, gas, t=4, n=50, seed=1):
    samplers = [MetaBatchSampler(n, t, gas, world, r, seed) for r in range(world)]
    return [mb for s in samplers for mb in s.micro_batches(step)]


@pytest.mark.parametrize("step", [0, 3, 11])
def test_same_global_tasks_at_any_world_size(step):
    one = np.concatenate(tasks_of_step(step, world=1, gas=4))
    for world, gas in ((2, 2), (4, 1)):
        parts = tasks_of_step(step, world, gas)
        assert all(len(p) == 4 for p in parts)
        assert sorted(np.concatenate(parts)) == sorted(one)


def test_epochs_cover_tasks_without_repeats_and_reshuffle():
    sampler = MetaBatchSampler(50, 4, 2, 2, 0, seed=1)  # 16 tasks/meta-step, 3 steps/epoch
    epoch0 = np.concatenate([sampler.global_batch(s) for s in range(3)])
    assert len(set(epoch0)) == 48
    assert not np.array_equal(sampler.global_batch(0), sampler.global_batch(3))


def test_too_few_tasks_is_a_config_error():
    with pytest.raises(ConfigError, match="64 tasks per meta-step but the training set has only 50"):
        MetaBatchSampler(50, 8, 4, 2, 0, seed=0)
