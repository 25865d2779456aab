"""gmeta_ds — distributed meta-learning on DeepSpeed (G-Meta, Xiao et al., CIKM 2023).

Glossary:
- task: one user's interactions (cold-start CTR); split into a support set (adapted on) and a
  query set (scored by the outer loss).
- inner step: one SGD step of a task's adapted parameters on its support loss.
- meta-step (outer step): one update of the meta-parameters from the query losses of
  ``tasks_per_meta_step`` tasks (all ranks, all accumulation micro-batches).
- micro-batch: the T tasks one rank processes together (vectorized with vmap).
- table vs feature (field): a feature field's ids index an embedding table.
- rank / world size: one process of the job / how many there are.

Importing this package does not import torch (the CLI sets thread policy first).
"""
__version__ = "0.1.0"
