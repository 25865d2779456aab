"""Length bucketing, background prefetch and a resumable position."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gmeta_ds.config import SyntheticConfig
from gmeta_ds.data.loader import TaskLoader, task_lengths
from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.data.synthetic import generate_synthetic
from gmeta_ds.errors import ConfigError


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
        eff_plain += [x.padding_efficiency for x in a]
        eff_bucket += [x.padding_efficiency for x in b]
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
    with pytest.raises(ConfigError, match="saved for seed 3 and .* training tasks, but this run has seed 4"):
        other = TaskLoader(tasks, MetaBatchSampler(len(tasks), 8, 4, 1, 0, 4), False)
        other.load_state_dict(state)
    first.close()
    resumed.close()


def _rows_of(batch, t, part):
    """(label, first id) pairs of task slot t's real support or query rows."""
    ids, y, mask = ((batch.support_ids, batch.support_y, batch.support_mask) if part == "s"
                    else (batch.query_ids, batch.query_y, batch.query_mask))
    real = mask[t].bool()
    return sorted(zip(y[t][real].tolist(), map(tuple, ids[t][real].tolist())))


def test_resampled_episodes_redraw_support_and_query_from_the_tasks_rows(tasks):
    """data.resample: at each meta-step a task's support and query are a fresh split of its
    own rows, with its support size; the same (seed, step) gives the same episodes at any
    world size, on a resumed loader and with prefetch off; evaluation's collate is unchanged."""
    from gmeta_ds.data.tasks import collate

    def make(world=1, rank=0, gas=4, prefetch=True):
        return TaskLoader(tasks, MetaBatchSampler(len(tasks), 8, gas, world, rank, 3, task_lengths(tasks)),
                          prefetch, resample=True)

    first, second = make().next(), None
    drawn = {}
    for batch in first:
        fixed = collate(tasks, batch.task_ids.numpy())
        for slot, task in enumerate(batch.task_ids.tolist()):
            s, q = _rows_of(batch, slot, "s"), _rows_of(batch, slot, "q")
            fs, fq = _rows_of(fixed, slot, "s"), _rows_of(fixed, slot, "q")
            assert sorted(s + q) == sorted(fs + fq) and len(s) == len(fs) and len(q) == len(fq)
            drawn[task] = (s, q)
    assert sum(drawn[t][1] != _rows_of(collate(tasks, [t]), 0, "q") for t in drawn) > len(drawn) // 2
    # same episodes: two ranks, a resumed loader, no prefetch
    ranks = [b for r in range(2) for b in make(world=2, rank=r, gas=2).next()]
    resumed = make(prefetch=False)
    resumed.load_state_dict({"next_step": 0, "seed": 3, "tasks": len(tasks)})
    for other in (ranks, resumed.next()):
        for batch in other:
            for slot, task in enumerate(batch.task_ids.tolist()):
                assert (_rows_of(batch, slot, "s"), _rows_of(batch, slot, "q")) == drawn[task]
    # the next time a task is drawn, its episode differs
    loader_ = make()
    changed, seen = 0, 0
    for _ in range(len(tasks) // 32 + 1):
        loader_.next()
    for batch in loader_.next():
        for slot, task in enumerate(batch.task_ids.tolist()):
            if task in drawn:
                seen += 1
                changed += (_rows_of(batch, slot, "q") != drawn[task][1])
    assert seen == 0 or changed > seen // 2


def test_resample_refuses_a_time_split():
    from gmeta_ds.config import config_from_dict
    from gmeta_ds.errors import ConfigError
    with pytest.raises(ConfigError, match="data.resample: redraws each task's query at random"):
        config_from_dict({"data": {"resample": True, "split": "time"}})
    with pytest.raises(ConfigError, match="data.long_tasks: 'keep' is not one of skip, train"):
        config_from_dict({"data": {"long_tasks": "keep"}})


def test_random_support_sizes_keep_a_prefix_of_the_full_episode_and_its_query(tasks):
    """data.resample_support: random: each redrawn support keeps its first k rows, k in
    [1, the task's support size], spread from 1 to the full size (log-uniform); the query is
    the full-size episode's, and the sizes are the same at every world size."""
    def make(support, world=1, rank=0, gas=4):
        return TaskLoader(tasks, MetaBatchSampler(len(tasks), 8, gas, world, rank, 3, task_lengths(tasks)),
                          False, resample=True, support=support)

    full, sized = make("full").next(), make("random").next()
    kept, sizes = {}, []
    for a, b in zip(full, sized):
        assert a.task_ids.tolist() == b.task_ids.tolist()
        for slot, task in enumerate(a.task_ids.tolist()):
            s_full, s = _rows_of(a, slot, "s"), _rows_of(b, slot, "s")
            assert 1 <= len(s) <= len(s_full) and set(s) <= set(s_full)
            assert _rows_of(b, slot, "q") == _rows_of(a, slot, "q")
            kept[task] = s
            sizes.append((len(s), len(s_full)))
    assert min(k for k, _ in sizes) <= 2 and sum(k == n for k, n in sizes) >= 1
    assert sum(k < n for k, n in sizes) > len(sizes) // 2
    for batch in (b for r in range(2) for b in make("random", world=2, rank=r, gas=2).next()):
        for slot, task in enumerate(batch.task_ids.tolist()):
            assert _rows_of(batch, slot, "s") == kept[task]
    from gmeta_ds.config import config_from_dict
    with pytest.raises(ConfigError, match="data.resample_support: random sizes the support"):
        config_from_dict({"data": {"resample_support": "random"}})
    with pytest.raises(ConfigError, match="data.resample_support: 'some' is not one of full, random"):
        config_from_dict({"data": {"resample": True, "resample_support": "some"}})
