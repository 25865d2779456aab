"""Meta-learning algorithms, one small file each, over the functional core.

``ALGORITHMS`` maps ``meta.algorithm`` names to classes; `build_algorithm` builds one from a
`MetaConfig`.
"""
from __future__ import annotations

from gmeta_ds.algorithms.base import MetaAlgorithm, MetaLearner, MetaOutput, match_adapted
from gmeta_ds.algorithms.maml import FOMAML, MAML
from gmeta_ds.algorithms.metasgd import MetaSGD
from gmeta_ds.algorithms.reptile import Reptile
from gmeta_ds.config import MetaConfig
from gmeta_ds.errors import ConfigError

ALGORITHMS: dict[str, type[MetaAlgorithm]] = {
    "maml": MAML, "fomaml": FOMAML, "reptile": Reptile, "metasgd": MetaSGD,
}


def build_algorithm(cfg: MetaConfig, kind: str = "binary") -> MetaAlgorithm:
    """The algorithm named by ``cfg.algorithm``, for labels of ``kind`` (binary | regression)."""
    if cfg.algorithm not in ALGORITHMS:
        raise ConfigError([f"meta.algorithm: {cfg.algorithm!r} is not one of "
                           f"{', '.join(ALGORITHMS)}"])
    return ALGORITHMS[cfg.algorithm](cfg.inner_steps, cfg.inner_lr, cfg.adapt, cfg.vectorize, kind)


__all__ = ["ALGORITHMS", "FOMAML", "MAML", "MetaAlgorithm", "MetaLearner", "MetaOutput",
           "MetaSGD", "Reptile", "build_algorithm", "match_adapted"]
