"""Table-wise sharding: a whole table on one rank (`plan.plan_tables` places the largest
tables first on the least loaded rank).

Every id of the table goes to that owner, as its own local row, through the lookup's
`RowExchange`; gradients and state are row-wise's (the other ranks hold no rows of it).
"""
from __future__ import annotations

import torch
from torch import Tensor

from gmeta_ds.embedding.sharding.row_wise import RowWise


class TableWise(RowWise):
    """Tables that live whole on their owner rank."""

    def route(self, name: str, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Every id to the table's owner, where its row is the id itself."""
        return torch.full_like(ids, self.ctx.plan.tables[name].owner), ids
