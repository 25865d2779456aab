"""Single-device CTR models (the model zoo), each registered by name in `registry.MODELS`
(bound here: a model's module is imported when it is first named).

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

MODELS.bind({
    "melu": "gmeta_ds.models.melu:MeLU", "dcn_v2": "gmeta_ds.models.dcn_v2:DCNv2",
    "deepfm": "gmeta_ds.models.deepfm:DeepFM", "wide_deep": "gmeta_ds.models.wide_deep:WideDeep",
    "dlrm": "gmeta_ds.models.dlrm:DLRM", "two_tower": "gmeta_ds.models.two_tower:TwoTower",
})

DEFAULT_ADAPT = tuple(MetaConfig().adapt)


def build_model(cfg: ModelConfig, fields, emb, seed: int, with_tables: bool = True,
                kind: str = "binary", oov_id: int | None = 0):
    """The model ``cfg.name`` (a name in `registry.MODELS`) over ``fields``, with its own
    unsharded tables initialised from ``seed`` (``with_tables``: the tables are replicated)
    or without tables (their rows come from a sharded collection). The caller seeds torch for
    the dense weights; the tables' rows depend on ``seed`` only. With ``cfg.item_popularity``
    the model gets a `popularity.PopularityOffset` (``net.popularity``) for labels ``kind``
    whose item id ``oov_id`` is the OOV id (None: none); fit its counts with
    `popularity.fit`; with ``cfg.popularity_feature`` the offset also feeds the statistic into
    the item row (`PopularityOffset.with_feature`). ``cfg.zero_init_output``: `zero_output`."""
    from gmeta_ds.embedding.tables import EmbeddingCollection
    from gmeta_ds.models.base import field_tables
    from gmeta_ds.models.popularity import PopularityOffset

    cls = MODELS[cfg.name]
    embedding = (EmbeddingCollection(field_tables(fields, cfg.embed_dim, emb), seed, emb.bad_ids)
                 if with_tables else None)
    net = cls.from_config(fields, cfg, embedding)
    if cfg.zero_init_output:
        zero_output(net)
    if cfg.item_popularity:
        net.popularity = PopularityOffset(fields, kind, cfg.popularity_prior, oov_id,
                                          feature_dim=cfg.embed_dim if cfg.popularity_feature else 0)
    return net


def zero_output(net) -> None:
    """Set the last linear layer of the model's ``mlp`` to zero (``model.zero_init_output``):
    MeLU's, DCN-v2's and DLRM's output then starts at 0, so with ``model.item_popularity`` the
    model starts as popularity alone and learns only the deviation from it (DeepFM and
    Wide & Deep: their deep part starts at 0). A model without an ``mlp`` ending in a linear
    layer (two_tower) is a `ConfigError`."""
    from torch import nn

    from gmeta_ds.errors import ConfigError

    head = getattr(net, "mlp", None)
    linear = [m for m in head.modules() if isinstance(m, nn.Linear)] if isinstance(head, nn.Module) else []
    if not linear:
        raise ConfigError([f"model.zero_init_output: {type(net).__name__} has no `mlp` ending in a linear "
                           "layer to start at zero"])
    nn.init.zeros_(linear[-1].weight)
    if linear[-1].bias is not None:
        nn.init.zeros_(linear[-1].bias)


def resolve_adapt(net, adapt) -> list[str]:
    """``adapt`` as given, or the model's ``default_adapt`` when ``adapt`` is the config's
    default (``["mlp.*"]``) or None."""
    if adapt is None or tuple(adapt) == DEFAULT_ADAPT:
        from gmeta_ds.models.protocol import model_hooks

        return list(model_hooks(net).default_adapt or DEFAULT_ADAPT)
    return list(adapt)
