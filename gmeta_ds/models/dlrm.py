"""DLRM-style model (Naumov et al., 2019): bottom MLP, pairwise dot-product interactions,
top MLP.

**No dense numeric features.** In DLRM the bottom MLP embeds the dense (numeric) features
into one vector that joins the sparse features' embeddings in the interaction. The task
pipeline carries only categorical ids today (`TaskSet` / `TaskBatch` have no numeric
columns), so here the bottom MLP is a projection applied to every field's row (weights
shared over the fields): ``z_f = bottom(e_f)``, a d-wide vector per field. Then:

- interactions: ``<z_f, z_g>`` for every field pair f < g (F(F-1)/2 values);
- top MLP (``mlp``): over ``[z_1, ..., z_F, interactions]`` (``hidden`` widths, then 1).

Config (``model.name: dlrm``): ``bottom_hidden`` (hidden widths of the bottom projection,
default none: one ``Linear(d, d)``), ``hidden`` (top MLP). Parameter names: ``bottom.<i>.*``,
``mlp.<i>.*``. Natural ``meta.adapt``: ``mlp.*`` (default: the top MLP), the last top layer,
item rows (``embedding.item_id``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from gmeta_ds.config import ModelConfig
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.embedding.tables import EmbeddingCollection
from gmeta_ds.models.base import FieldModel, mlp


class DLRM(FieldModel):
    """rows (N, F, d) -> logits (N,): per-field bottom projection, pairwise dots, top MLP.

    Args:
        fields: the fields (F); the top MLP sees their F(F-1)/2 pairwise dots.
        embed_dim: d, the rows' width and the bottom projection's output.
        hidden: the top MLP's hidden widths.
        bottom_hidden: the bottom projection's hidden widths (empty: one linear layer).
        embedding: the model's tables; None for tables sharded by the engine.
    """

    def __init__(self, fields: list[FieldSpec], embed_dim: int, *, hidden: list[int] = (64, 32),
                 bottom_hidden: list[int] = (), embedding: EmbeddingCollection | None = None):
        super().__init__(fields, embed_dim, embedding)
        f = self.num_fields
        self.hidden, self.bottom_hidden = list(hidden), list(bottom_hidden)
        self.bottom = mlp(embed_dim, self.bottom_hidden, out=embed_dim)
        rows, cols = torch.triu_indices(f, f, offset=1).tolist()
        self._pairs = (rows, cols)  # python lists: no buffer in the state dict, any device
        self.mlp = mlp(f * embed_dim + len(rows), self.hidden)

    @classmethod
    def from_config(cls, fields, cfg: ModelConfig, embedding=None) -> DLRM:
        return cls(fields, cfg.embed_dim, hidden=cfg.hidden, bottom_hidden=cfg.bottom_hidden,
                   embedding=embedding)

    def activation_floats(self) -> int:
        f, d = self.num_fields, self.embed_dim
        return f * (d * 2 + sum(self.bottom_hidden)) + f * f + sum(self.hidden)

    def forward(self, rows: Tensor) -> Tensor:
        """Bottom-projected rows and their pairwise dot products through the top MLP.

        Args:
            rows: (N, F, d) per-field rows.

        Returns:
            (N,) logits of the top MLP.
        """
        z = self.bottom(rows)                                  # (N, F, d)
        dots = z @ z.transpose(-1, -2)                         # (N, F, F)
        pairs = dots[..., self._pairs[0], self._pairs[1]]      # (N, F(F-1)/2)
        return self.mlp(torch.cat([z.flatten(start_dim=-2), pairs], dim=-1)).squeeze(-1)
