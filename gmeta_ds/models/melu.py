"""MeLU-style meta CTR model (Lee et al., KDD 2019): per-field embeddings -> concat -> MLP -> logit.

Single-device code that knows nothing of ranks. It receives its embedding module from the
trainer: an unsharded `EmbeddingCollection` (replicated tables, trained by DeepSpeed with the
dense parameters), or none at all when the tables are sharded outside the engine and the
trainer hands in looked-up rows. Lookup (`embed`) and the decision layers (`forward`) are
separate so support and query ids are looked up in one fused call and the functional inner
loop adapts only the decision layers.
"""
from __future__ import annotations

from torch import Tensor, nn

from gmeta_ds.config import EmbeddingConfig
from gmeta_ds.data.tasks import FieldSpec, model_field_order, single_fields
from gmeta_ds.embedding.tables import EmbeddingCollection, TableConfig


def melu_tables(fields: list[FieldSpec], dim: int, cfg: EmbeddingConfig) -> list[TableConfig]:
    """One table per field (named after it), with the per-table optimizer overrides of ``cfg``."""
    tables = []
    for f in fields:
        override = cfg.tables.get(f.name)
        tables.append(TableConfig(
            f.name, f.num_ids, dim, (f.name,), pooling="mean" if f.multi_hot else "sum",
            init_std=cfg.init_std,
            optimizer=(override and override.optimizer) or cfg.optimizer,
            lr=(override and override.lr) or cfg.lr))
    return tables


class MeLU(nn.Module):
    """Concatenated field embeddings through an MLP to one click logit.

    `embed`: single-hot ids (..., F_single) and multi-hot bags -> rows (..., F, d), single-hot
    fields first (needs an embedding module). `forward`: rows (N, F, d) -> logits (N,).
    Parameter names: ``embedding.weights.<field>`` (when owned) and ``mlp.<i>.weight|bias``.
    """

    def __init__(self, fields: list[FieldSpec], embed_dim: int, hidden: list[int],
                 embedding: EmbeddingCollection | None = None):
        super().__init__()
        ordered = model_field_order(fields)
        self.field_names = [f.name for f in ordered]
        # Fields whose looked-up rows may adapt per task (functional/rows.py): single-hot ones,
        # at positions 0..len-1 of the model input.
        self.row_fields = [f.name for f in single_fields(fields)]
        self.embed_dim = embed_dim
        self.embedding = embedding
        layers: list[nn.Module] = []
        width = len(fields) * embed_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def embed(self, ids: Tensor, multi: dict | None = None) -> Tensor:
        if self.embedding is None:
            raise RuntimeError("this MeLU has no embedding module: its tables are sharded, so "
                               "pass looked-up rows instead of ids")
        return self.embedding.lookup_fields(ids, self.row_fields, multi)

    def forward(self, rows: Tensor) -> Tensor:
        return self.mlp(rows.flatten(start_dim=-2)).squeeze(-1)


def build_melu(fields: list[FieldSpec], embed_dim: int, hidden: list[int], emb: EmbeddingConfig,
               seed: int, with_tables: bool = True) -> MeLU:
    """A MeLU whose own unsharded tables are initialised from ``seed`` (``with_tables``), or
    one without tables whose rows come from a sharded collection."""
    embedding = (EmbeddingCollection(melu_tables(fields, embed_dim, emb), seed, emb.bad_ids)
                 if with_tables else None)
    return MeLU(fields, embed_dim, hidden, embedding)
