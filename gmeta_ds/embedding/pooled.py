"""Pooling on the owner now lives in `gmeta_ds.embedding.sharding.owner_pooled` (one file per
sharding strategy); its names stay importable from here."""
from __future__ import annotations

from torch import Tensor

from gmeta_ds.embedding.sharding.owner_pooled import INT32_LIMIT, GroupLayout, OwnerPooled
from gmeta_ds.sparse import Jagged

__all__ = ["INT32_LIMIT", "GroupLayout", "OwnerPooled", "owner_pooled"]


def owner_pooled(coll, features: dict[str, Jagged]) -> dict[str, Tensor]:
    """{feature: (N, d)} for features of pooled tables of ``coll`` (a
    `ShardedEmbeddingCollection`): its `OwnerPooled` strategy's `OwnerPooled.pool`."""
    return coll.strategies["owner_pooled"].pool(features) if features else {}
