"""Ragged task storage and padded task batches.

A *task* is one user's interactions, already split into a support part (used by the
inner loop) and a query part (scored by the outer loss). `TaskSet` stores many tasks
contiguously; `collate` pads a list of tasks into a `TaskBatch`.

Example (2 tasks, F=2 fields)::

    offsets     = [0, 3, 7]        # task 0 = rows 0..2, task 1 = rows 3..6
    support_len = [2, 3]           # task 0: rows 0,1 support, row 2 query
    collate([0, 1]) -> support_ids (2, 3, 2), query_ids (2, 1, 2), masks mark real rows
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gmeta_ds.data.vocab import Vocabulary
from gmeta_ds.sparse import PAD_ID, FieldSpec, multi_fields, single_fields
from gmeta_ds.sparse import BagStats
from gmeta_ds.sparse import Jagged


@dataclass
class TaskSet:
    """Tasks stored back to back.

    ids: int32 (N, F_single) — one column per single-hot field, in `single_fields` order;
    labels: float32 (N,); offsets: int64 (U+1,);
    support_len: int64 (U,) — the first ``support_len[t]`` rows of task t are its support;
    task_keys: int64 (U,) — e.g. the user id of each task;
    multi: multi-hot field -> (values int32 (nnz,), row offsets int64 (N+1,)).

    Args:
        fields: the fields of the ids, single-hot and multi-hot.
        ids: (N, F_single) int32 ids of the N rows, one column per single-hot field.
        labels: (N,) float32 labels.
        offsets: (U + 1,) int64, task t is rows ``offsets[t]:offsets[t + 1]``.
        support_len: (U,) int64 support rows of each task, at least 1 and fewer than its rows.
        task_keys: (U,) int64 key of each task (e.g. its user id).
        multi: multi-hot field -> (values (nnz,), row offsets (N + 1,)); {} without such fields.
    """

    fields: list[FieldSpec]
    ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    support_len: np.ndarray
    task_keys: np.ndarray
    multi: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n_tasks = len(self.offsets) - 1
        assert self.ids.ndim == 2 and self.ids.shape[1] == len(single_fields(self.fields))
        assert set(self.multi) == {f.name for f in multi_fields(self.fields)}
        assert len(self.labels) == len(self.ids) == self.offsets[-1]
        assert len(self.support_len) == len(self.task_keys) == n_tasks
        lengths = np.diff(self.offsets)
        assert np.all(self.support_len >= 1) and np.all(self.support_len < lengths)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_interactions(self) -> int:
        return int(self.offsets[-1])

    def split(self, task: int) -> tuple[slice, slice]:
        """Row slices of the support and query parts of one task.

        Args:
            task: the task's index, in [0, len(self)).

        Returns:
            (support rows, query rows) as slices of the N rows.
        """
        start, end = int(self.offsets[task]), int(self.offsets[task + 1])
        mid = start + int(self.support_len[task])
        return slice(start, mid), slice(mid, end)

    def subset(self, tasks: np.ndarray) -> "TaskSet":
        """A new TaskSet holding only ``tasks`` (in that order).

        Args:
            tasks: (K,) int indices of the tasks to keep (repeats allowed).

        Returns:
            A `TaskSet` of K tasks with copies of their rows.
        """
        lengths = np.diff(self.offsets)[tasks]
        rows = np.concatenate([np.arange(self.offsets[t], self.offsets[t + 1]) for t in tasks]) \
            if len(tasks) else np.zeros(0, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        multi = {name: take_rows(values, row_offsets, rows) for name, (values, row_offsets) in self.multi.items()}
        return TaskSet(self.fields, self.ids[rows], self.labels[rows], offsets,
                       self.support_len[tasks].copy(), self.task_keys[tasks].copy(), multi)

    def first_support(self, k: int) -> "TaskSet":
        """A new TaskSet whose tasks keep only the first ``k`` rows of their support (all of a
        shorter one) and every query row: what adaptation on fewer interactions sees.

        Args:
            k: support rows kept per task, >= 1.

        Returns:
            A `TaskSet` with the same tasks, keys and query rows.
        """
        support = np.asarray(self.support_len, dtype=np.int64)
        kept = np.minimum(support, k)
        lengths = np.diff(self.offsets) - support + kept
        start = np.repeat(np.asarray(self.offsets[:-1], dtype=np.int64), lengths)
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        rows = start + within + np.where(within >= np.repeat(kept, lengths), np.repeat(support - kept, lengths), 0)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        multi = {name: take_rows(values, row_offsets, rows) for name, (values, row_offsets) in self.multi.items()}
        return TaskSet(self.fields, self.ids[rows], self.labels[rows], offsets, kept, self.task_keys.copy(), multi)


def take_rows(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bags of ``rows`` from a jagged (values, offsets): a new (values, offsets)."""
    if not isinstance(offsets, np.ndarray) and len(rows):  # a task-store file: one read per run of rows
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        pieces = [offsets[int(rows[a]):int(rows[b - 1]) + 2]
                  for a, b in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(rows)]]))]
        ends = np.concatenate(pieces)
        inner = np.ones(len(ends), dtype=bool)
        inner[np.cumsum([len(p) for p in pieces]) - 1] = False  # the last offset of each piece
        starts = ends[inner]
        lengths = ends[1:][inner[:-1]] - starts
        new_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        picks = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
        return values[picks], new_offsets
    lengths = offsets[rows + 1] - offsets[rows]
    new_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    picks = np.repeat(offsets[rows] - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    return values[picks], new_offsets


@dataclass
class TaskBatch:
    """T tasks padded to the longest support (S) and query (Q) in the batch.

    support_ids: int64 (T, S, F_single); support_y: float32 (T, S); support_mask: float32 (T, S)
    query_ids: int64 (T, Q, F_single);   query_y: float32 (T, Q);   query_mask: float32 (T, Q)
    task_ids: int64 (T,) — indices into the TaskSet, for error messages and logs.
    Masks are 1.0 on real rows and 0.0 on padding; padded ids are 0 (a valid row), and
    `PAD_ID` in raw-id columns (dynamic tables look it up as their default row, uncounted).

    Args:
        support_ids: int64 (T, S, F_single) support ids.
        support_y: float32 (T, S) support labels.
        support_mask: float32 (T, S), 1.0 on real support rows.
        query_ids: int64 (T, Q, F_single) query ids.
        query_y: float32 (T, Q) query labels.
        query_mask: float32 (T, Q), 1.0 on real query rows.
        task_ids: int64 (T,) the tasks' indices in their `TaskSet`.
        support_multi: multi-hot field -> `Jagged` of T*S bags (padding rows: empty bags).
        query_multi: multi-hot field -> `Jagged` of T*Q bags.
        padding_efficiency: real rows / padded rows of the batch; None: measured from the masks.
    """

    support_ids: torch.Tensor
    support_y: torch.Tensor
    support_mask: torch.Tensor
    query_ids: torch.Tensor
    query_y: torch.Tensor
    query_mask: torch.Tensor
    task_ids: torch.Tensor
    # multi-hot field -> Jagged over the T*S (T*Q) padded rows, row-major; padding rows are empty bags
    support_multi: dict = field(default_factory=dict)
    query_multi: dict = field(default_factory=dict)
    # real rows / padded rows (support and query together), in (0, 1]: measured from the masks
    # once, when the batch is made (on the host, where it is padded), for the step's statistics
    padding_efficiency: float | None = None

    def __post_init__(self):
        if self.padding_efficiency is None:
            real = self.support_mask.sum() + self.query_mask.sum()
            self.padding_efficiency = float(real / (self.support_mask.numel() + self.query_mask.numel()))

    @property
    def num_tasks(self) -> int:
        return self.support_ids.shape[0]


def _rows_len(rows: slice | np.ndarray) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def pad_rows(task_set: TaskSet, parts: list[slice | np.ndarray]) -> tuple[torch.Tensor, ...]:
    """Pad each part (a slice of rows, or an array of row indices) to the longest one."""
    width = max(_rows_len(r) for r in parts)
    n_fields = task_set.ids.shape[1]
    ids = np.zeros((len(parts), width, n_fields), dtype=np.int64)
    raw = [j for j, f in enumerate(single_fields(task_set.fields)) if f.raw]
    ids[:, :, raw] = PAD_ID  # raw-id padding: never admitted or counted by a dynamic table
    labels = np.zeros((len(parts), width), dtype=np.float32)
    mask = np.zeros((len(parts), width), dtype=np.float32)
    for i, rows in enumerate(parts):
        n = _rows_len(rows)
        ids[i, :n] = task_set.ids[rows]
        labels[i, :n] = task_set.labels[rows]
        mask[i, :n] = 1.0
    return torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(mask)


def pad_multi(task_set: TaskSet, parts: list[slice | np.ndarray], width: int) -> dict:
    """Multi-hot bags of the padded rows (len(parts) * width rows, row-major) as Jagged."""
    out = {}
    for name, (values, offsets) in task_set.multi.items():
        rows = np.full(len(parts) * width, -1, dtype=np.int64)
        for i, part in enumerate(parts):
            picked_rows = np.arange(part.start, part.stop) if isinstance(part, slice) else part
            rows[i * width: i * width + len(picked_rows)] = picked_rows
        real = rows >= 0
        lengths = np.zeros(len(rows), dtype=np.int64)
        lengths[real] = offsets[rows[real] + 1] - offsets[rows[real]]
        picked, _ = take_rows(values, offsets, rows[real])
        bag_offsets = np.concatenate([[0], np.cumsum(lengths)])
        out[name] = Jagged(torch.from_numpy(picked.astype(np.int64)), torch.from_numpy(bag_offsets))
    return out


RESAMPLE_TAG = 0x5E5A  # keeps the episode streams apart from the sampler's epoch permutations


def resampled_split(task_set: TaskSet, task: int, key: tuple[int, ...], position: int | None = None,
                    support: str = "full") -> tuple[np.ndarray, np.ndarray]:
    """Episode resampling: the rows of ``task`` re-split at random into a support of the task's
    own support size and a query of the rest, drawn from ``(*key, task)``. ``position`` is where
    the task's rows lie in ``task_set`` when it is a subset (default: ``task``). ``support``
    "random" (``data.resample_support``): the support keeps only its first k rows, k drawn
    log-uniformly in [1, support size] from the same stream (the query is unchanged)."""
    where = task if position is None else position
    start, end = int(task_set.offsets[where]), int(task_set.offsets[where + 1])
    rng = np.random.default_rng([RESAMPLE_TAG, *key, int(task)])
    order = start + rng.permutation(end - start)
    mid = int(task_set.support_len[where])
    keep = mid
    if support == "random" and mid > 1:
        keep = min(mid, max(1, int(np.exp(rng.uniform(0.0, np.log(mid + 1))))))
    return np.sort(order[:keep]), np.sort(order[mid:])


def collate(task_set: TaskSet, tasks: np.ndarray | list[int],
            resample: tuple[int, ...] | None = None, support: str = "full") -> TaskBatch:
    """Pad the given tasks of ``task_set`` into one `TaskBatch`. From a task store (arrays read
    on demand) the tasks' rows are first read once per task and array (`TaskSet.subset`), then
    padded from memory.

    ``resample`` (``data.resample``): a key of non-negative ints, e.g. (run seed, meta-step);
    each task's support and query are then redrawn from all its rows (`resampled_split`, same
    sizes, or with ``support`` "random" a support of random size: `resampled_split`), the same
    for the same key and task whatever the batch or world size.

    Args:
        task_set: the tasks.
        tasks: the indices of the T tasks to pad, in batch order.
        resample: the resampling key; None: each task's own split.
        support: ``full`` or ``random`` (with ``resample`` only), the resampled support's size.

    Returns:
        The `TaskBatch` of the T tasks.
    """
    tasks = np.asarray(tasks, dtype=np.int64)
    if not isinstance(task_set.ids, np.ndarray):
        sub = task_set.subset(tasks)
        if resample is None:
            batch = collate(sub, np.arange(len(tasks)))
        else:
            parts = [resampled_split(sub, int(t), resample, position=i, support=support) for i, t in enumerate(tasks)]
            batch = _collate_parts(sub, parts, np.arange(len(tasks)))
        batch.task_ids = torch.as_tensor(tasks)
        return batch
    if resample is None:
        parts = [task_set.split(int(t)) for t in tasks]
    else:
        parts = [resampled_split(task_set, int(t), resample, support=support) for t in tasks]
    return _collate_parts(task_set, parts, tasks)


def _collate_parts(task_set: TaskSet, parts: list[tuple], tasks: np.ndarray) -> TaskBatch:
    s_ids, s_y, s_mask = pad_rows(task_set, [s for s, _ in parts])
    q_ids, q_y, q_mask = pad_rows(task_set, [q for _, q in parts])
    return TaskBatch(s_ids, s_y, s_mask, q_ids, q_y, q_mask, torch.as_tensor(tasks),
                     pad_multi(task_set, [s for s, _ in parts], s_ids.shape[1]),
                     pad_multi(task_set, [q for _, q in parts], q_ids.shape[1]))


BAG_SAMPLE = 1 << 20  # values read per multi-hot field to estimate its id frequencies


def bag_statistics(task_set: TaskSet, tasks_per_micro_batch: int, ranks_per_host: int = 1) -> dict[str, BagStats]:
    """Per multi-hot field: its mean bag length, and the distinct ids per id looked up that one
    micro-batch of ``tasks_per_micro_batch`` average tasks can expect, E[distinct] / n over n
    draws from the field's id frequencies (estimated on up to `BAG_SAMPLE` values, read in 16
    evenly spaced runs so a task store reads little); with ``ranks_per_host`` > 1, also that of
    the host's R micro-batches together (R n draws), and the same two for every single-hot
    field (`single_hot_overlap`). What ``exchange: auto`` (multi-hot fields) and
    ``exchange_topology: auto`` choose by; the same on every rank (it reads only the training
    tasks, with a fixed seed)."""
    out = {}
    rows = max(1, task_set.num_interactions)
    per_batch = tasks_per_micro_batch * rows / max(1, len(task_set))
    for name, (values, offsets) in task_set.multi.items():
        nnz = int(offsets[-1]) if len(offsets) else 0
        if nnz == 0:
            continue
        run = max(1, min(nnz, BAG_SAMPLE) // 16)
        starts = np.linspace(0, nnz - run, 16).astype(np.int64)
        sample = np.concatenate([np.asarray(values[int(a):int(a) + run]) for a in np.unique(starts)])
        log_miss = np.log1p(-np.minimum(np.unique(sample, return_counts=True)[1] / len(sample), 1 - 1e-12))
        draws = per_batch * nnz / rows

        def ratio(n: float) -> float:
            return min(1.0, float(np.sum(-np.expm1(n * log_miss))) / max(n, 1.0))

        out[name] = BagStats(nnz / rows, ratio(draws), ratio(ranks_per_host * draws) if ranks_per_host > 1 else None)
    if ranks_per_host > 1:
        out.update(single_hot_overlap(task_set, tasks_per_micro_batch, ranks_per_host))
    return out


SINGLE_SAMPLES = 16  # simulated hosts per single-hot field


def single_hot_overlap(task_set: TaskSet, tasks_per_micro_batch: int, ranks_per_host: int,
                       seed: int = 0) -> dict[str, BagStats]:
    """Per single-hot field: the distinct ids per id of one micro-batch and of a host's R
    micro-batches together, counted on `SINGLE_SAMPLES` simulated hosts of R x
    ``tasks_per_micro_batch`` training tasks drawn without replacement. Counted rather than
    drawn from the id frequencies (as for bags): a task's rows share ids (its user's above all),
    so ids are not independent draws; a field whose ids belong to tasks (the user) shows no
    overlap between ranks, one shared across tasks (a popular item) does."""
    n_tasks = len(task_set)
    per_host = min(n_tasks, max(1, int(tasks_per_micro_batch)) * ranks_per_host)
    if n_tasks < 2 or per_host < 2:
        return {}
    rng = np.random.default_rng(seed)
    hosts = [np.array_split(rng.choice(n_tasks, size=per_host, replace=False), ranks_per_host)
             for _ in range(SINGLE_SAMPLES)]
    starts, ends = task_set.offsets[:-1], task_set.offsets[1:]
    rows = [[np.concatenate([np.arange(starts[t], ends[t]) for t in part]) for part in host if len(part)]
            for host in hosts]
    out = {}
    for j, spec in enumerate(single_fields(task_set.fields)):
        column = task_set.ids[:, j]
        looked_up = ranks_distinct = host_distinct = 0
        for host in rows:
            ids = [np.asarray(column[r]) for r in host]
            looked_up += sum(len(i) for i in ids)
            ranks_distinct += sum(len(np.unique(i)) for i in ids)
            host_distinct += len(np.unique(np.concatenate(ids)))
        # over the same ids, so their ratio is the overlap: the ranks' distinct ids over the union's
        out[spec.name] = BagStats(1.0, ranks_distinct / looked_up, host_distinct / looked_up)
    return out


@dataclass
class TaskData:
    """Fields, training and held-out tasks, and what building them dropped or mapped.

    Args:
        fields: the fields of every task set.
        train: the training tasks.
        test: the held-out (cold-start) tasks.
        stats: counts of the build (rows and tasks kept, dropped, out of vocabulary...).
        states: cold-start state -> its tasks (``warm``, ``user_cold``, ``item_cold``,
            ``user_item_cold``) with the four-state split; {} otherwise.
        valid: the validation tasks (empty unless ``data.valid_fraction`` > 0); None: not built.
        vocab: field -> its `Vocabulary` (raw value -> id), for every field that has one.
        store: the task store folder it was read from (`store_read.open_store`); None when
            built in memory.
    """

    fields: list[FieldSpec]
    train: TaskSet
    test: TaskSet
    stats: dict = field(default_factory=dict)
    # four-state split only: warm, user_cold, item_cold, user_item_cold (test is user_cold)
    states: dict = field(default_factory=dict)
    valid: TaskSet | None = None  # validation users (empty unless data.valid_fraction > 0)
    # field -> its `Vocabulary` (raw value -> row id), for every field with one (not raw_ids)
    vocab: dict[str, Vocabulary] = field(default_factory=dict)
    store: Path | None = None
