"""MeLU-style meta CTR model (Lee et al., KDD 2019): per-field embeddings -> concat -> MLP -> logit.

Single-device code that knows nothing of ranks. It receives its embedding module from the
trainer: an unsharded `EmbeddingCollection` (replicated tables, trained by DeepSpeed with the
dense parameters), or none at all when the tables are sharded outside the engine and the
trainer hands in looked-up rows. Lookup (`embed`) and the decision layers (`forward`) are
separate so support and query ids are looked up in one fused call and the functional inner
loop adapts only the decision layers.

Config (``model.name: melu``): ``hidden`` (the MLP's widths). Natural ``meta.adapt``:
``mlp.*`` (default: every decision layer), the last layer only (``mlp.<2·len(hidden)>.*``),
item rows (``embedding.item_id``).
"""
from __future__ import annotations

from torch import Tensor, nn

from gmeta_ds.config import EmbeddingConfig, ModelConfig
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.embedding.tables import EmbeddingCollection
from gmeta_ds.functional.split import BodySplit
from gmeta_ds.models.base import FieldModel, field_tables, mlp

melu_tables = field_tables  # one table per field (kept under its first name)


class MeLU(FieldModel):
    """Concatenated field embeddings through an MLP to one click logit.

    `embed`: single-hot ids (..., F_single) and multi-hot bags -> rows (..., F, d), single-hot
    fields first (needs an embedding module). `forward`: rows (N, F, d) -> logits (N,).
    Parameter names: ``embedding.weights.<field>`` (when owned) and ``mlp.<i>.weight|bias``.

    Args:
        fields: the task set's fields (F of them).
        embed_dim: d of every field's rows; the MLP's input is F x d wide.
        hidden: the MLP's hidden widths, before its one-logit output layer.
        embedding: its own tables; None when they are sharded outside the model.
    """

    def __init__(self, fields: list[FieldSpec], embed_dim: int, hidden: list[int] = (64, 32),
                 embedding: EmbeddingCollection | None = None):
        super().__init__(fields, embed_dim, embedding)
        self.hidden = list(hidden)
        self.mlp = mlp(len(fields) * embed_dim, self.hidden)

    @classmethod
    def from_config(cls, fields, cfg: ModelConfig, embedding=None) -> MeLU:
        return cls(fields, cfg.embed_dim, cfg.hidden, embedding)

    def activation_floats(self) -> int:
        return self.num_fields * self.embed_dim + sum(self.hidden)

    def forward(self, rows: Tensor) -> Tensor:
        """The click logit of each row's concatenated field embeddings.

        Args:
            rows: (N, F, d) looked-up rows.

        Returns:
            (N,) logits of the MLP.
        """
        return self.mlp(rows.flatten(start_dim=-2)).squeeze(-1)

    def split_body(self, adapted: list[str]) -> BodySplit | None:
        """The decision layers before the first adapted one as the body (`functional.split`):
        with ``meta.adapt: ["mlp.4.*"]`` (hidden [64, 32]) the body is ``mlp[:4]``, the head
        ``mlp[4:]``. None when an adapted parameter is not a decision layer's, or the first
        layer adapts.

        Args:
            adapted: the names of the adapted parameters (``mlp.<i>.weight|bias``).

        Returns:
            The `BodySplit`, or None when the model cannot be split there.
        """
        layers = set()
        for name in adapted:
            parts = name.split(".")
            if parts[0] != "mlp" or len(parts) < 3 or not parts[1].isdigit():
                return None
            layers.add(int(parts[1]))
        first = min(layers, default=0)
        if first == 0:
            return None
        body = nn.Sequential(nn.Flatten(start_dim=-2), *self.mlp[:first])
        return BodySplit(body, lambda features: self.mlp[first:](features).squeeze(-1))


def build_melu(fields: list[FieldSpec], embed_dim: int, hidden: list[int], emb: EmbeddingConfig,
               seed: int, with_tables: bool = True) -> MeLU:
    """A MeLU whose own unsharded tables are initialised from ``seed`` (``with_tables``), or
    one without tables whose rows come from a sharded collection."""
    embedding = (EmbeddingCollection(field_tables(fields, embed_dim, emb), seed, emb.bad_ids)
                 if with_tables else None)
    return MeLU(fields, embed_dim, hidden, embedding)
