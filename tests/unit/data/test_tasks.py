"""Task storage and padding, with single- and multi-hot fields."""
from __future__ import annotations

import numpy as np
import torch

from gmeta_ds.algorithms import MAML, MetaLearner
from gmeta_ds.algorithms.base import embed_batch
from gmeta_ds.config import EmbeddingConfig
from gmeta_ds.data.tasks import TaskSet, collate, take_rows
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.models.melu import build_melu

FIELDS = [FieldSpec("genres", 6, "item", multi_hot=True), FieldSpec("user", 4, "user"),
          FieldSpec("item", 9, "item")]


def task_set() -> TaskSet:
    """Two tasks: 4 rows (support 3) and 3 rows (support 1); genres bags of 0-3 ids."""
    ids = np.array([[0, 1], [0, 2], [0, 3], [0, 1], [1, 5], [1, 6], [1, 8]], dtype=np.int32)
    bags = [[1, 2], [], [5], [0, 1, 2], [3], [4, 4], []]
    values = np.array([g for b in bags for g in b], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
    return TaskSet(FIELDS, ids, np.arange(7, dtype=np.float32) % 2, np.array([0, 4, 7]),
                   np.array([3, 1]), np.array([10, 11]), {"genres": (values, offsets)})


def test_take_rows_picks_bags():
    values, offsets = task_set().multi["genres"]
    picked, new_offsets = take_rows(values, offsets, np.array([3, 1, 0]))
    assert picked.tolist() == [0, 1, 2, 1, 2] and new_offsets.tolist() == [0, 3, 3, 5]


def test_collate_pads_multi_hot_bags_row_major():
    batch = collate(task_set(), [1, 0])
    assert batch.support_ids.shape == (2, 3, 2) and batch.query_ids.shape == (2, 2, 2)
    bags = batch.support_multi["genres"]
    lengths = (bags.offsets[1:] - bags.offsets[:-1]).tolist()
    assert lengths == [1, 0, 0, 2, 0, 1]          # task 1: row 4 + 2 pads; task 0: rows 0-2
    assert bags.values.tolist() == [3, 1, 2, 5]
    q = batch.query_multi["genres"]
    assert (q.offsets[1:] - q.offsets[:-1]).tolist() == [2, 0, 3, 0]
    assert batch.support_mask.tolist() == [[1, 0, 0], [1, 1, 1]]


def test_multi_hot_rows_are_mean_pooled_and_train():
    torch.manual_seed(0)
    net = build_melu(FIELDS, 3, [4], EmbeddingConfig(), seed=0)
    assert net.field_names == ["user", "item", "genres"] and net.row_fields == ["user", "item"]
    batch = collate(task_set(), [0, 1])
    rows_s, rows_q = embed_batch(net.embed, batch)
    assert rows_s.shape == (2, 3, 3, 3) and rows_q.shape == (2, 2, 3, 3)
    table = net.embedding.weights["genres"]
    torch.testing.assert_close(rows_s[0, 0, 2], table[[1, 2]].mean(0))
    torch.testing.assert_close(rows_s[0, 1, 2], torch.zeros(3))   # empty bag
    learner = MetaLearner(net, MAML(1, 0.1, ["mlp.*", "embedding.item"], True))
    learner(batch).loss.backward()
    # every genre id occurs in some bag: the pooled rows carry gradient to each of them
    assert torch.all(table.grad.abs().sum(1) > 0)


def test_bag_statistics_mean_length_and_expected_distinct_ids():
    from gmeta_ds.data.tasks import bag_statistics

    stats = bag_statistics(task_set(), tasks_per_micro_batch=2)["genres"]
    values = task_set().multi["genres"][0]
    assert stats.mean_length == len(values) / 7  # 9 ids over 7 rows
    # one micro-batch of 2 average tasks (7 rows) draws 9 ids from the genres' frequencies
    p = np.bincount(values) / len(values)
    p = p[p > 0]
    expected = np.sum(1 - (1 - p) ** 9) / 9
    assert abs(stats.distinct_ratio - expected) < 1e-9
    rng = np.random.default_rng(0)  # the same by simulation
    simulated = np.mean([len(np.unique(rng.choice(values, 9))) / 9 for _ in range(20000)])
    assert abs(stats.distinct_ratio - simulated) < 0.01
    assert stats.host_distinct_ratio is None
    host = bag_statistics(task_set(), tasks_per_micro_batch=2, ranks_per_host=3)["genres"]
    assert host.distinct_ratio == stats.distinct_ratio  # the host's 3 micro-batches: 27 draws
    assert abs(host.host_distinct_ratio - np.sum(1 - (1 - p) ** 27) / 27) < 1e-9


def test_single_hot_overlap_counts_simulated_hosts_of_tasks():
    """A field whose ids belong to a task (the user) overlaps nowhere between ranks; one whose
    ids every task shares (5 items, each in every task) overlaps R-fold; the plan's auto
    topology takes the hierarchical row exchange for the second only."""
    from gmeta_ds.data.tasks import bag_statistics, single_hot_overlap
    from gmeta_ds.embedding.plan import plan_tables, with_topology
    from gmeta_ds.embedding.tables import TableConfig
    from gmeta_ds.embedding.topology import Topology

    fields = [FieldSpec("user", 40, "user"), FieldSpec("item", 5, "item")]
    n_tasks, rows = 40, 10
    ids = np.stack([np.repeat(np.arange(n_tasks), rows), np.tile(np.arange(rows) % 5, n_tasks)], 1).astype(np.int32)
    ts = TaskSet(fields, ids, np.zeros(n_tasks * rows, np.float32), np.arange(0, n_tasks * rows + 1, rows),
                 np.full(n_tasks, 5), np.arange(n_tasks))
    stats = single_hot_overlap(ts, tasks_per_micro_batch=2, ranks_per_host=2)
    assert stats["user"].distinct_ratio == 2 / 20 and stats["user"].host_distinct_ratio == 4 / 40  # overlap 1
    assert stats["item"].distinct_ratio == 5 / 20 and stats["item"].host_distinct_ratio == 5 / 40  # overlap 2
    assert bag_statistics(ts, 2, ranks_per_host=2) == stats and bag_statistics(ts, 2) == {}  # one rank per host
    tables = [TableConfig(f.name, f.num_ids * 100, 8, (f.name,)) for f in fields]
    for only, expected in (("user", "flat"), ("item", "hierarchical")):
        plan = plan_tables([t for t in tables if t.name == only], 4, {only: "row_wise"})
        assert with_topology(plan, Topology(4, 2), "auto", stats).row_exchange_topology == expected, only


def test_first_support_keeps_the_first_k_support_rows_and_every_query_row():
    ts = task_set()
    cut = ts.first_support(2)  # task 0: support rows 0-1 of 0-2, query row 3; task 1: support 4, query 5-6
    assert cut.support_len.tolist() == [2, 1] and cut.offsets.tolist() == [0, 3, 6]
    assert cut.ids.tolist() == ts.ids[[0, 1, 3, 4, 5, 6]].tolist()
    assert cut.labels.tolist() == ts.labels[[0, 1, 3, 4, 5, 6]].tolist()
    assert cut.multi["genres"][0].tolist() == [1, 2, 0, 1, 2, 3, 4, 4]
    assert cut.multi["genres"][1].tolist() == [0, 2, 2, 5, 6, 8, 8]
    assert cut.task_keys.tolist() == [10, 11]
    whole = ts.first_support(5)
    assert whole.ids.tolist() == ts.ids.tolist() and whole.support_len.tolist() == [3, 1]
