"""Table-wise sharding: a whole table on one rank (`plan.plan_tables` places the largest
tables first on the least loaded rank).

Every id of the table goes to that owner, as its own local row (the `layout.WholeTable`
layout routes it), through the lookup's `RowExchange`; gradients and state are row-wise's
(the other ranks hold no rows of it).
"""
from __future__ import annotations

from gmeta_ds.embedding.sharding.row_wise import RowWise


class TableWise(RowWise):
    """Tables that live whole on their owner rank: row-wise's steps over a `WholeTable` layout."""
