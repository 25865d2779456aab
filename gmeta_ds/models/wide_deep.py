"""Wide & Deep (Cheng et al., DLRS 2016): a wide linear part beside a deep MLP, summed into
one logit.

- wide: a linear map of the concatenated field rows (``wide``). The paper's wide part is
  linear over sparse one-hot ids and hand-made cross-product features; with rows-only
  inputs (the model contract) it is linear over the fields' embedding rows, and no
  cross-product transformations are built.
- deep: ``mlp`` over the concatenated rows (``hidden`` widths, then 1).

Config (``model.name: wide_deep``): ``hidden``. Parameter names: ``wide.*``, ``mlp.<i>.*``.
Natural ``meta.adapt``: ``mlp.*`` (default: the deep part), ``wide.*`` (the linear part:
cheap per-user adaptation), both (``["wide.*", "mlp.*"]``), item rows (``embedding.item_id``).
"""
from __future__ import annotations

from torch import Tensor, nn

from gmeta_ds.config import ModelConfig
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.embedding.tables import EmbeddingCollection
from gmeta_ds.models.base import FieldModel, mlp


class WideDeep(FieldModel):
    """rows (N, F, d) -> logits (N,): wide linear + deep MLP.

    Args:
        fields: the input fields (F); both parts read all of them.
        embed_dim: the rows' width d.
        hidden: hidden widths of the deep part (the wide part is one linear layer).
        embedding: own tables of the model (None: looked up outside it).
    """

    def __init__(self, fields: list[FieldSpec], embed_dim: int, *, hidden: list[int] = (64, 32),
                 embedding: EmbeddingCollection | None = None):
        super().__init__(fields, embed_dim, embedding)
        width = self.num_fields * embed_dim
        self.hidden = list(hidden)
        self.wide = nn.Linear(width, 1)
        self.mlp = mlp(width, self.hidden)

    @classmethod
    def from_config(cls, fields, cfg: ModelConfig, embedding=None) -> WideDeep:
        return cls(fields, cfg.embed_dim, hidden=cfg.hidden, embedding=embedding)

    def activation_floats(self) -> int:
        return self.num_fields * self.embed_dim + sum(self.hidden)

    def forward(self, rows: Tensor) -> Tensor:
        """Wide and deep logits of the flattened rows, added.

        Args:
            rows: (N, F, d), one row per field.

        Returns:
            The (N,) summed logits.
        """
        x = rows.flatten(start_dim=-2)
        return (self.wide(x) + self.mlp(x)).squeeze(-1)
