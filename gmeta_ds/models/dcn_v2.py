"""DCN-v2 (Wang et al., WWW 2021), parallel form: a cross network beside a deep MLP, then a
linear decision layer over both.

``x0`` = the concatenated field rows (F·d); cross layer l: ``x_{l+1} = x0 * (W_l x_l + b_l) + x_l``
(full-rank W_l); deep: ``hidden`` widths with ReLU; logit = ``mlp([x_L, deep(x0)])``.

Config (``model.name: dcn_v2``): ``hidden`` (deep part), ``cross_layers`` (default 2).
Parameter names: ``cross.<l>.*``, ``deep.<i>.*``, ``mlp.0.*`` (the decision layer).
Natural ``meta.adapt``: ``mlp.*`` (default), plus the last cross layer
(``cross.<cross_layers-1>.*``), item rows (``embedding.item_id``).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from gmeta_ds.config import ModelConfig
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.embedding.tables import EmbeddingCollection
from gmeta_ds.models.base import FieldModel, mlp, mlp_width


class DCNv2(FieldModel):
    """rows (N, F, d) -> logits (N,): cross network + deep MLP -> linear decision layer.

    Args:
        fields: the fields whose rows it crosses (F).
        embed_dim: d; the cross layers are F x d wide.
        hidden: widths of the deep MLP beside the cross network.
        cross_layers: how many cross layers ``x0 * W x + x``.
        embedding: the model's own tables, or None for rows looked up outside.
    """

    def __init__(self, fields: list[FieldSpec], embed_dim: int, *, hidden: list[int] = (64, 32),
                 cross_layers: int = 2, embedding: EmbeddingCollection | None = None):
        super().__init__(fields, embed_dim, embedding)
        width = self.num_fields * embed_dim
        self.hidden = list(hidden)
        self.cross = nn.ModuleList(nn.Linear(width, width) for _ in range(cross_layers))
        self.deep = mlp(width, self.hidden, out=None, last_relu=True)
        self.mlp = nn.Sequential(nn.Linear(width + mlp_width(width, self.hidden), 1))

    @classmethod
    def from_config(cls, fields, cfg: ModelConfig, embedding=None) -> DCNv2:
        return cls(fields, cfg.embed_dim, hidden=cfg.hidden, cross_layers=cfg.cross_layers,
                   embedding=embedding)

    def activation_floats(self) -> int:
        return self.num_fields * self.embed_dim * (1 + 2 * len(self.cross)) + sum(self.hidden)

    def forward(self, rows: Tensor) -> Tensor:
        """Cross network and deep MLP over the same flattened rows, then one linear layer.

        Args:
            rows: (N, F, d) field rows.

        Returns:
            (N,) logits.
        """
        x0 = rows.flatten(start_dim=-2)
        x = x0
        for layer in self.cross:
            x = x0 * layer(x) + x
        return self.mlp(torch.cat([x, self.deep(x0)], dim=-1)).squeeze(-1)
