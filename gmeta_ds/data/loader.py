"""Per-rank task loading: the sampler's micro-batches, collated in a background thread.

While the trainer runs meta-step k, a worker thread collates the micro-batches of meta-step
k + 1 (collate is numpy and torch copies, which release the GIL), so the trainer does not
wait on padding. The position is the next meta-step, so `state_dict` / `load_state_dict`
resume exactly.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.errors import ConfigError
from gmeta_ds.data.tasks import TaskBatch, TaskSet, collate


class TaskLoader:
    """Iterates meta-steps: each item is this rank's list of GAS `TaskBatch` micro-batches.

    ``prefetch``: collate the next meta-step in a background thread. ``resample``
    (``data.resample``): each task's support and query are redrawn from its rows at every
    meta-step that draws it, keyed by (sampler seed, meta-step), so a resumed run and any world
    size see the same episodes; ``support`` (``data.resample_support``): "random" sizes each
    redrawn support at random (`tasks.resampled_split`).
    """

    def __init__(self, tasks: TaskSet, sampler: MetaBatchSampler, prefetch: bool = True,
                 resample: bool = False, support: str = "full"):
        self.tasks, self.sampler, self.resample, self.support = tasks, sampler, resample, support
        self.next_step = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gmeta-prefetch") if prefetch else None
        self._pending: tuple[int, Future] | None = None

    def _collate(self, step: int) -> list[TaskBatch]:
        key = (self.sampler.seed, step) if self.resample else None
        return [collate(self.tasks, mb, resample=key, support=self.support) for mb in self.sampler.micro_batches(step)]

    def next(self) -> list[TaskBatch]:
        """The micro-batches of meta-step ``next_step``; starts collating the one after."""
        step = self.next_step
        if self._pending is not None and self._pending[0] == step:
            batches = self._pending[1].result()
        else:
            batches = self._collate(step)
        self.next_step = step + 1
        if self._pool is not None:
            self._pending = (step + 1, self._pool.submit(self._collate, step + 1))
        return batches

    def state_dict(self) -> dict:
        return {"next_step": self.next_step, "seed": self.sampler.seed, "tasks": len(self.tasks)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["next_step"]``; a different seed or task count is an error."""
        if state["seed"] != self.sampler.seed or state["tasks"] != len(self.tasks):
            raise ConfigError([f"train.resume: the checkpoint was saved for seed {state['seed']} and "
                               f"{state['tasks']} training tasks, but this run has seed {self.sampler.seed} "
                               f"and {len(self.tasks)} training tasks (seed, data or its split changed); "
                               "resume with the run's original seed and data, or start a fresh run"])
        self.next_step = int(state["next_step"])
        self._pending = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def task_lengths(tasks: TaskSet) -> np.ndarray:
    """Interactions per task (int64, (U,))."""
    return np.diff(tasks.offsets)
