"""Functional core: masked losses and the inner loop over tasks (vmap or loop)."""
from gmeta_ds.functional.inner import (InnerLoop, InnerSettings, TaskOutputs, TaskRecipe, loop_tasks, masked_bce,
                                       run_tasks, vmap_tasks)

__all__ = ["InnerLoop", "InnerSettings", "TaskOutputs", "TaskRecipe", "loop_tasks", "masked_bce", "run_tasks",
           "vmap_tasks"]
