"""Meta-learning algorithms, one small file each, over the functional core.

``ALGORITHMS`` (the registry in ``gmeta_ds/registry.py``, bound here) maps ``meta.algorithm``
names to classes; `build_algorithm` builds one from a `MetaConfig`.
"""
from __future__ import annotations

from gmeta_ds.algorithms.base import AlgorithmSettings, MetaAlgorithm, MetaLearner, MetaOutput, match_adapted
from gmeta_ds.algorithms.maml import FOMAML, MAML
from gmeta_ds.algorithms.metasgd import MetaSGD
from gmeta_ds.algorithms.reptile import Reptile
from gmeta_ds.config import MetaConfig
from gmeta_ds.config.deepspeed import DEFAULT_MICRO_BATCH
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.compiled import CompiledTasks, choose_compile
from gmeta_ds.functional.inner import choose_vectorize
from gmeta_ds.registry import ALGORITHMS

ALGORITHMS.bind({"maml": MAML, "fomaml": FOMAML, "reptile": Reptile, "metasgd": MetaSGD})


def build_algorithm(cfg: MetaConfig, kind: str = "binary", bytes_per_task: int = 0) -> MetaAlgorithm:
    """The algorithm named by ``cfg.algorithm``, for labels of ``kind`` (binary | regression |
    multiclass); ``bytes_per_task`` (estimated activation memory of one task's inner and outer
    pass) times the tasks per micro-batch resolves ``meta.vectorize: auto``; ``meta.compile``
    sets the algorithm's `CompiledTasks` (`set_compile`)."""
    if cfg.algorithm not in ALGORITHMS:
        raise ConfigError([f"meta.algorithm: {cfg.algorithm!r} is not one of "
                           f"{', '.join(ALGORITHMS.names())}"])
    tasks = cfg.tasks_per_micro_batch if isinstance(cfg.tasks_per_micro_batch, int) else DEFAULT_MICRO_BATCH
    vectorize = choose_vectorize(cfg.vectorize, bytes_per_task, tasks, cfg.vectorize_budget_mb)
    algorithm = ALGORITHMS[cfg.algorithm].from_settings(AlgorithmSettings(
        inner_steps=cfg.inner_steps, inner_lr=cfg.inner_lr, adapt=cfg.adapt, vectorize=vectorize, kind=kind,
        split_body=cfg.split_body, inner_lr_scale=cfg.inner_lr_scale, inner_loss_prior=cfg.inner_loss_prior,
        offset_first=cfg.offset_first, support_level=cfg.support_level, rank_weight=cfg.rank_weight,
        warmup_steps=cfg.warmup_steps, init_weight=cfg.init_weight))
    return set_compile(algorithm, cfg.compile)


def set_compile(algorithm: MetaAlgorithm, setting: bool | str) -> MetaAlgorithm:
    """``algorithm`` with its vmap path compiled when ``setting`` (``meta.compile``: true,
    false, "auto") resolves to on (`choose_compile`); returns it."""
    if choose_compile(setting, algorithm.vectorize):
        algorithm.compiled = CompiledTasks()
    return algorithm


__all__ = ["ALGORITHMS", "FOMAML", "MAML", "MetaAlgorithm", "MetaLearner", "MetaOutput",
           "MetaSGD", "Reptile", "build_algorithm", "match_adapted", "set_compile"]
