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

# The public API (docs/api.md), imported on first use so that ``import gmeta_ds`` stays light.
_PUBLIC = {
    "build_tasks": "gmeta_ds.api", "tables_for": "gmeta_ds.api", "meta_learner": "gmeta_ds.api",
    "initialize": "gmeta_ds.api", "MetaEngine": "gmeta_ds.meta_engine", "StepResult": "gmeta_ds.meta_engine",
    "TableConfig": "gmeta_ds.embedding.tables", "EmbeddingCollection": "gmeta_ds.embedding.tables",
    "Jagged": "gmeta_ds.sparse",
    "hash_strings": "gmeta_ds.sparse", "string_id": "gmeta_ds.sparse",
    "ShardedEmbeddingCollection": "gmeta_ds.embedding.sharded",
    "ShardingPlan": "gmeta_ds.embedding.plan", "plan_tables": "gmeta_ds.embedding.plan",
    "MetaLearner": "gmeta_ds.algorithms", "MetaAlgorithm": "gmeta_ds.algorithms",
    "MetaOutput": "gmeta_ds.algorithms", "MAML": "gmeta_ds.algorithms", "FOMAML": "gmeta_ds.algorithms",
    "Reptile": "gmeta_ds.algorithms", "MetaSGD": "gmeta_ds.algorithms", "ALGORITHMS": "gmeta_ds.algorithms",
    "TaskSet": "gmeta_ds.data.tasks", "TaskBatch": "gmeta_ds.data.tasks", "FieldSpec": "gmeta_ds.sparse",
    "collate": "gmeta_ds.data.tasks", "single_fields": "gmeta_ds.sparse",
    "multi_fields": "gmeta_ds.sparse", "TaskData": "gmeta_ds.data.tasks",
    "ConfigError": "gmeta_ds.errors", "DataError": "gmeta_ds.errors",
    "load_model": "gmeta_ds.saved", "SavedModel": "gmeta_ds.saved", "Vocabulary": "gmeta_ds.data.vocab",
    "load_adapter": "gmeta_ds.serving",
    # the model zoo (docs/architecture.md "Models"): each takes (fields, embed_dim, ...)
    "MeLU": "gmeta_ds.models.melu", "DCNv2": "gmeta_ds.models.dcn_v2", "DeepFM": "gmeta_ds.models.deepfm",
    "WideDeep": "gmeta_ds.models.wide_deep", "DLRM": "gmeta_ds.models.dlrm",
    "TwoTower": "gmeta_ds.models.two_tower", "FieldModel": "gmeta_ds.models.base",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gmeta_ds' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
