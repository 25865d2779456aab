"""What every CTR model of the zoo shares (single-device, rank-agnostic).

A model maps looked-up field rows ``(N, F, d)`` to one logit per row ``(N,)`` (the public
contract, docs/api.md). It may own its tables (``embedding``: an unsharded
`EmbeddingCollection`, replicated inside DeepSpeed) or get none, when the tables are sharded
outside the engine and the trainer hands in looked-up rows. Field order in the rows: the
single-hot fields (``row_fields``, the tasks' id-column order), then the multi-hot ones (each
bag pooled by its table).
"""
from __future__ import annotations

from torch import Tensor, nn

from gmeta_ds.config import EmbeddingConfig, ModelConfig
from gmeta_ds.sparse import FieldSpec, model_field_order, single_fields
from gmeta_ds.embedding.tables import EmbeddingCollection, TableConfig
from gmeta_ds.errors import ConfigError


def field_tables(fields: list[FieldSpec], dim: int, cfg: EmbeddingConfig) -> list[TableConfig]:
    """One table per field (named after it), with the per-table overrides of ``cfg`` (optimizer,
    lr, kind and its dynamic settings, device, exchange)."""
    tables = []
    for f in fields:
        override = cfg.tables.get(f.name)
        dynamic = override is not None and override.kind == "dynamic"
        if override is not None and override.exchange == "pooled" and not f.multi_hot:
            raise ConfigError([f"embedding.tables.{f.name}.exchange: pooled, but {f.name!r} is a single-hot "
                               "field (one id per row, nothing to pool); set it to rows or auto"])
        tables.append(TableConfig(
            f.name, max(1, f.num_ids), dim, (f.name,), pooling="mean" if f.multi_hot else "sum",
            init_std=cfg.init_std,
            optimizer=(override and override.optimizer) or cfg.optimizer,
            lr=(override and override.lr) or cfg.lr,
            kind="dynamic" if dynamic else "static",
            capacity=override.capacity if dynamic else None,
            admit_after=override.admit_after if dynamic else 1,
            eviction=override.eviction if dynamic else "lru",
            device=(override and override.device) or cfg.device,
            # unset: single-hot fields exchange rows (deduplicated); bags embedding.exchange, by the plan
            exchange=(override and override.exchange) or ("auto" if f.multi_hot else "rows")))
    return tables


def mlp(width: int, hidden: list[int], out: int | None = 1, last_relu: bool = False) -> nn.Sequential:
    """``Linear + ReLU`` per width of ``hidden``, then ``Linear(·, out)`` (none when ``out`` is
    None; then the last ReLU is kept only with ``last_relu``)."""
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    if out is not None:
        layers.append(nn.Linear(width, out))
    elif layers and not last_relu:
        layers.pop()
    return nn.Sequential(*layers)


def mlp_width(width: int, hidden: list[int]) -> int:
    """Output width of ``mlp(width, hidden, out=None)``."""
    return hidden[-1] if hidden else width


class FieldModel(nn.Module):
    """Base of the zoo: field bookkeeping, the optional own tables and the lookup.

    Subclasses build their layers after ``super().__init__`` and implement `forward` (rows
    (N, F, d) -> logits (N,)), `from_config` (the ``model:`` config section) and
    `activation_floats` (floats of activations per input row, for ``meta.vectorize: auto``).
    ``default_adapt``: the ``meta.adapt`` globs used when the run leaves ``meta.adapt`` at its
    default (``["mlp.*"]``) or `gmeta_ds.meta_learner` gets no ``adapt``.

    Args:
        fields: the task set's fields; the model's input puts the single-hot ones first,
            then the multi-hot ones (`model_field_order`).
        embed_dim: d, the width of every field's rows.
        embedding: the model's own tables (`EmbeddingCollection`); None when the tables are
            sharded outside it and the engine passes looked-up rows.
    """

    default_adapt: tuple[str, ...] = ("mlp.*",)

    def __init__(self, fields: list[FieldSpec], embed_dim: int,
                 embedding: EmbeddingCollection | None = None):
        super().__init__()
        ordered = model_field_order(fields)
        self.field_names = [f.name for f in ordered]
        self.field_sides = [f.side for f in ordered]
        self.num_fields = len(ordered)
        # Fields whose looked-up rows may adapt per task (functional/inner.py): single-hot ones,
        # at positions 0..len-1 of the model input.
        self.row_fields = [f.name for f in single_fields(fields)]
        self.embed_dim = embed_dim
        self.embedding = embedding

    def embed(self, ids: Tensor, multi: dict | None = None) -> Tensor:
        """The rows of ids through the model's own tables (`EmbeddingCollection.lookup_fields`).

        Args:
            ids: (..., F_single) single-hot ids, in ``row_fields`` order.
            multi: multi-hot field -> `Jagged` of prod(...) bags; None: none.

        Returns:
            (..., F, d) rows, single-hot fields first.

        Raises:
            RuntimeError: a model without its own tables (they are sharded: pass rows).
        """
        if self.embedding is None:
            raise RuntimeError(f"this {type(self).__name__} has no embedding module: its tables are "
                               "sharded, so pass looked-up rows instead of ids")
        return self.embedding.lookup_fields(ids, self.row_fields, multi)

    @classmethod
    def from_config(cls, fields: list[FieldSpec], cfg: ModelConfig,
                    embedding: EmbeddingCollection | None = None) -> FieldModel:
        """The model from the ``model:`` config section. This default passes only
        ``embed_dim`` (a subclass whose constructor takes just ``fields, embed_dim, embedding``
        needs nothing more); models with hyper-parameters override it to pass theirs."""
        return cls(fields, cfg.embed_dim, embedding=embedding)

    def activation_floats(self) -> int:
        """Rough floats of activations kept per input row by one forward pass."""
        return self.num_fields * self.embed_dim
