"""Single-device CTR models (the model zoo), each registered by name in `registry.MODELS`.

| ``model.name`` | class | default ``meta.adapt`` |
|---|---|---|
| ``melu`` | `melu.MeLU` (concat -> MLP) | ``mlp.*`` |
| ``dcn_v2`` | `dcn_v2.DCNv2` (cross network + deep -> linear) | ``mlp.*`` (the decision layer) |
| ``deepfm`` | `deepfm.DeepFM` (first order + FM + deep) | ``mlp.*`` (the deep part) |
| ``wide_deep`` | `wide_deep.WideDeep` (wide linear + deep) | ``mlp.*`` (the deep part) |
| ``dlrm`` | `dlrm.DLRM` (bottom projection, pairwise dots, top MLP) | ``mlp.*`` (the top MLP) |
| ``two_tower`` | `two_tower.TwoTower` (user tower · item tower) | ``user_tower.*`` |

Every model follows the public contract (docs/api.md): ``forward(rows (N, F, d)) -> logits
(N,)``, ``row_fields``, ``embed_dim``; it owns an `EmbeddingCollection` (``embedding``) when
its tables are replicated, none when they are sharded. Each class is usable on its own
(``DCNv2(data.fields, embed_dim=8)``) or through `build_model` from the ``model:`` config.
"""
from __future__ import annotations

from gmeta_ds.config import MetaConfig, ModelConfig
from gmeta_ds.registry import MODELS

DEFAULT_ADAPT = tuple(MetaConfig().adapt)


def build_model(cfg: ModelConfig, fields, emb, seed: int, with_tables: bool = True,
                kind: str = "binary", oov_id: int | None = 0):
    """The model ``cfg.name`` (a name in `registry.MODELS`) over ``fields``, with its own
    unsharded tables initialised from ``seed`` (``with_tables``: the tables are replicated)
    or without tables (their rows come from a sharded collection). The caller seeds torch for
    the dense weights; the tables' rows depend on ``seed`` only. With ``cfg.item_popularity``
    the model gets a `popularity.PopularityOffset` (``net.popularity``) for labels ``kind``
    whose item id ``oov_id`` is the OOV id (None: none); fit its counts with
    `popularity.fit`."""
    from gmeta_ds.embedding.tables import EmbeddingCollection
    from gmeta_ds.models.base import field_tables
    from gmeta_ds.models.popularity import PopularityOffset

    cls = MODELS[cfg.name]
    embedding = (EmbeddingCollection(field_tables(fields, cfg.embed_dim, emb), seed, emb.bad_ids)
                 if with_tables else None)
    net = cls.from_config(fields, cfg, embedding)
    if cfg.item_popularity:
        net.popularity = PopularityOffset(fields, kind, cfg.popularity_prior, oov_id)
    return net


def resolve_adapt(net, adapt) -> list[str]:
    """``adapt`` as given, or the model's ``default_adapt`` when ``adapt`` is the config's
    default (``["mlp.*"]``) or None."""
    if adapt is None or tuple(adapt) == DEFAULT_ADAPT:
        return list(getattr(net, "default_adapt", DEFAULT_ADAPT))
    return list(adapt)
