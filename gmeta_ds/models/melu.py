"""MeLU-style meta CTR model (Lee et al., KDD 2019): per-field embeddings -> concat -> MLP -> logit.

Single-device code that knows nothing of ranks. Embedding lookup (`embed`) and the decision
layers (`forward`) are separate so the trainer can look up support and query ids in one fused
call and hand the rows to the functional inner loop, which adapts only the decision layers.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from gmeta_ds.data.tasks import FieldSpec


class ReplicatedEmbeddings(nn.Module):
    """One `nn.Embedding` table per field, replicated on every rank (data-parallel).

    ids: int64 (..., F) -> rows (..., F, d).
    """

    def __init__(self, fields: list[FieldSpec], dim: int):
        super().__init__()
        self.field_names = [f.name for f in fields]
        self.tables = nn.ModuleDict({f.name: nn.Embedding(f.num_ids, dim) for f in fields})
        for table in self.tables.values():
            nn.init.normal_(table.weight, std=0.05)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.shape[-1] != len(self.field_names):
            raise ValueError(f"ids have {ids.shape[-1]} fields, expected {len(self.field_names)} "
                             f"({', '.join(self.field_names)})")
        rows = [self.tables[name](ids[..., i]) for i, name in enumerate(self.field_names)]
        return torch.stack(rows, dim=-2)


class MeLU(nn.Module):
    """Embeddings for every field, concatenated, through an MLP to one click logit.

    `embed`: ids (..., F) -> rows (..., F, d). `forward`: rows (N, F, d) -> logits (N,).
    Parameter names: ``embedding.tables.<field>.weight`` and ``mlp.<i>.weight|bias``.
    """

    def __init__(self, fields: list[FieldSpec], embed_dim: int, hidden: list[int]):
        super().__init__()
        self.embedding = ReplicatedEmbeddings(fields, embed_dim)
        layers: list[nn.Module] = []
        width = len(fields) * embed_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def embed(self, ids: Tensor) -> Tensor:
        return self.embedding(ids)

    def forward(self, rows: Tensor) -> Tensor:
        return self.mlp(rows.flatten(start_dim=-2)).squeeze(-1)
