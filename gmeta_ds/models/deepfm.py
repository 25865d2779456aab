"""DeepFM (Guo et al., IJCAI 2017): first-order term + FM second-order term over the field
rows + deep MLP, summed into one logit.

- first order: a linear map of the concatenated rows, ``sum_f <w_f, e_f> + b`` (``linear``).
  The paper's first-order term is a scalar weight per id; with rows-only inputs (the model
  contract; sharded tables hand in rows of one width) it is a learned direction per field
  applied to that field's row, i.e. the per-id weight factorised through the embedding.
- second order: ``0.5 * sum_k [(sum_f e_fk)^2 - sum_f e_fk^2]`` = sum over field pairs of
  ``<e_f, e_g>`` (no parameters; multi-hot fields take part with their pooled row).
- deep: ``mlp`` over the concatenated rows (``hidden`` widths, then 1).

Config (``model.name: deepfm``): ``hidden``. Parameter names: ``linear.*``, ``mlp.<i>.*``.
Natural ``meta.adapt``: ``mlp.*`` (default: the deep part), ``linear.*`` (the first-order
term: a cheap per-user bias), item rows (``embedding.item_id``: adapts the FM term too).
"""
from __future__ import annotations

from torch import Tensor, nn

from gmeta_ds.config import ModelConfig
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.embedding.tables import EmbeddingCollection
from gmeta_ds.models.base import FieldModel, mlp


def fm_second_order(rows: Tensor) -> Tensor:
    """rows (..., F, d) -> (...,): the sum over field pairs f < g of <e_f, e_g>."""
    return 0.5 * (rows.sum(dim=-2).pow(2) - rows.pow(2).sum(dim=-2)).sum(dim=-1)


class DeepFM(FieldModel):
    """rows (N, F, d) -> logits (N,): first order + FM + deep.

    Args:
        fields: the fields whose pairwise interactions the FM term sums (F).
        embed_dim: d of each field's row (the FM's factor size).
        hidden: the deep part's hidden widths.
        embedding: tables owned by the model; None: sharded, rows passed in.
    """

    def __init__(self, fields: list[FieldSpec], embed_dim: int, *, hidden: list[int] = (64, 32),
                 embedding: EmbeddingCollection | None = None):
        super().__init__(fields, embed_dim, embedding)
        width = self.num_fields * embed_dim
        self.hidden = list(hidden)
        self.linear = nn.Linear(width, 1)
        self.mlp = mlp(width, self.hidden)

    @classmethod
    def from_config(cls, fields, cfg: ModelConfig, embedding=None) -> DeepFM:
        return cls(fields, cfg.embed_dim, hidden=cfg.hidden, embedding=embedding)

    def activation_floats(self) -> int:
        return self.num_fields * self.embed_dim * 2 + self.embed_dim + sum(self.hidden)

    def forward(self, rows: Tensor) -> Tensor:
        """The first-order, FM second-order and deep terms, summed.

        Args:
            rows: the (N, F, d) embeddings of the fields.

        Returns:
            (N,) logits, one per row.
        """
        x = rows.flatten(start_dim=-2)
        return (self.linear(x) + self.mlp(x)).squeeze(-1) + fm_second_order(rows)
