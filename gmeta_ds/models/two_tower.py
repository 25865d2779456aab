"""Two-tower model: a user tower over the user-side fields, an item tower over the item-side
fields (`FieldSpec.side`), logit = <user vector, item vector> + bias.

Each tower: the concatenated rows of its side's fields (multi-hot ones included, pooled)
through ``tower_hidden`` widths (ReLU between, the last layer linear); the last width is the
dimension of the dot product. Needs at least one field on each side.

Config (``model.name: two_tower``): ``tower_hidden`` (default [64, 32]). Parameter names:
``user_tower.<i>.*``, ``item_tower.<i>.*``, ``bias``. There is no ``mlp``: the default
``meta.adapt`` of this model is ``user_tower.*`` (a task is one cold-start user; adapting the
user tower personalises the user vector). Natural alternatives: the user tower's last layer,
``bias``, item rows (``embedding.item_id``), the item tower.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from gmeta_ds.config import ModelConfig
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.embedding.tables import EmbeddingCollection
from gmeta_ds.errors import ConfigError
from gmeta_ds.models.base import FieldModel, mlp


class TwoTower(FieldModel):
    """rows (N, F, d) -> logits (N,): user tower · item tower + bias.

    Args:
        fields: the fields, each on the ``user`` or ``item`` side (at least one of each).
        embed_dim: d of each field's row.
        tower_hidden: each tower's widths; the last is the width of the two vectors dotted.
        embedding: the model's own tables; None when rows come from sharded tables.

    Raises:
        ConfigError: no user-side or no item-side field, or an empty ``tower_hidden``.
    """

    default_adapt = ("user_tower.*",)

    def __init__(self, fields: list[FieldSpec], embed_dim: int, *, tower_hidden: list[int] = (64, 32),
                 embedding: EmbeddingCollection | None = None):
        super().__init__(fields, embed_dim, embedding)
        self.user_positions = [j for j, side in enumerate(self.field_sides) if side == "user"]
        self.item_positions = [j for j, side in enumerate(self.field_sides) if side == "item"]
        if not self.user_positions or not self.item_positions or not tower_hidden:
            sides = dict(zip(self.field_names, self.field_sides))
            message = (f"model.name: two_tower needs at least one user-side and one item-side field "
                       f"and a non-empty model.tower_hidden; fields (side): {sides}, tower_hidden: "
                       f"{list(tower_hidden)}")
            raise ConfigError([message])
        self.tower_hidden = list(tower_hidden)
        *inner, out = self.tower_hidden
        self.user_tower = mlp(len(self.user_positions) * embed_dim, inner, out=out)
        self.item_tower = mlp(len(self.item_positions) * embed_dim, inner, out=out)
        self.bias = nn.Parameter(torch.zeros(1))  # (1,): DeepSpeed cannot broadcast 0-dim parameters

    @classmethod
    def from_config(cls, fields, cfg: ModelConfig, embedding=None) -> TwoTower:
        return cls(fields, cfg.embed_dim, tower_hidden=cfg.tower_hidden, embedding=embedding)

    def activation_floats(self) -> int:
        return self.num_fields * self.embed_dim + 2 * sum(self.tower_hidden)

    def forward(self, rows: Tensor) -> Tensor:
        """The dot product of the user tower's and the item tower's vectors, plus the bias.

        Args:
            rows: (N, F, d); the user-side and item-side fields feed their towers.

        Returns:
            (N,) logits.
        """
        user = self.user_tower(rows[..., self.user_positions, :].flatten(start_dim=-2))
        item = self.item_tower(rows[..., self.item_positions, :].flatten(start_dim=-2))
        return (user * item).sum(dim=-1) + self.bias
