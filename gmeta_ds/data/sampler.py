"""Which tasks each rank processes in each meta-step, independent of the world size.

Meta-step k takes B = tasks_per_meta_step tasks from a per-epoch permutation of all tasks
(seeded by run seed and epoch; the tail that does not fill a meta-batch is left for the next
epoch's permutation). Those B tasks are the same whatever the world size; rank r's
micro-batch m gets the T tasks at positions ``(m * W + r) * T ...``. The position is the
meta-step itself, so resuming needs no other state.

Across S sites (``part`` = (site, S)), the B tasks are cut into S contiguous blocks of B / S
in permutation order, site s takes block s and cuts it over its own ranks as above: which
tasks a site sees does not depend on its number of ranks, and the sites together see the
one-site run's B tasks.
"""
from __future__ import annotations

import numpy as np

from gmeta_ds.errors import ConfigError


class MetaBatchSampler:
    """Task indices per (meta-step, micro-batch) for one rank."""

    def __init__(self, num_tasks: int, tasks_per_micro_batch: int, grad_accum_steps: int,
                 world_size: int, rank: int, seed: int, lengths: np.ndarray | None = None,
                 part: tuple[int, int] = (0, 1)):
        self.t, self.gas, self.world, self.rank = tasks_per_micro_batch, grad_accum_steps, world_size, rank
        self.part = part
        self.batch = tasks_per_micro_batch * grad_accum_steps * world_size * part[1]
        if num_tasks < self.batch:
            raise ConfigError([f"meta.tasks_per_meta_step: {self.batch} tasks per meta-step but the "
                               f"training set has only {num_tasks} tasks"])
        self.num_tasks, self.seed = num_tasks, seed
        self.per_epoch = num_tasks // self.batch
        # Bucketing: with task lengths given, each meta-batch is sorted by length before it is
        # cut into micro-batches, so tasks of similar length are padded together. The set of
        # tasks per meta-step (and so the meta-gradient) is unchanged.
        self.lengths = lengths
        self._cache = (-1, np.zeros(0, dtype=np.int64))

    def global_batch(self, step: int) -> np.ndarray:
        """The B task indices of meta-step ``step`` (same on every rank and world size)."""
        epoch, within = divmod(step, self.per_epoch)
        cached_epoch, order = self._cache  # one attribute: safe to share with the prefetch thread
        if cached_epoch != epoch:  # one permutation per epoch, not per step (O(tasks) each)
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_tasks)
            self._cache = (epoch, order)
        return order[within * self.batch:(within + 1) * self.batch]

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This rank's GAS micro-batches of T task indices for meta-step ``step``."""
        tasks = self.global_batch(step)
        index, parts = self.part
        tasks = tasks[index * len(tasks) // parts:(index + 1) * len(tasks) // parts]
        if self.lengths is not None:
            tasks = tasks[np.argsort(self.lengths[tasks], kind="stable")]
        return [tasks[(m * self.world + self.rank) * self.t:][: self.t] for m in range(self.gas)]
