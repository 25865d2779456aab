"""Functional core: masked losses and the inner loop over tasks (vmap or loop)."""
from gmeta_ds.functional.inner import (InnerLoop, TaskOutputs, loop_tasks, masked_bce, run_tasks,
                                       vmap_tasks)

__all__ = ["InnerLoop", "TaskOutputs", "loop_tasks", "masked_bce", "run_tasks", "vmap_tasks"]
