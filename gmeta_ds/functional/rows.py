"""Adapting looked-up embedding rows in the inner loop (``meta.adapt: ["embedding.<field>"]``).

The rows of an adapted field are deduplicated over the micro-batch: ``E_f`` (M_f, d) holds one
row per distinct id, taken from the fused lookup (so the outer gradient reaches the table).
Each task adapts its own copy of ``E_f`` on its support loss; its support and query rows are
then ``E_f[index]``, so an item seen in the support is adapted in the query too, and rows the
task never saw stay as they were. Inputs of one task become ``(rows, index)``: rows (N, F, d)
from the lookup, index (N, F) into ``E_f`` for adapted fields.

Example: field 1 adapted, support ids [[3, 7], [4, 7]], query ids [[3, 9]] ->
E_1 = rows of ids [7, 9] (M=2); index[:, 1] = [0, 0 | 1]; the query row of id 9 is untouched
by adaptation unless the support also contains 9.
"""
from __future__ import annotations

import torch
from torch import Tensor

ROW_PREFIX = "embedding."


def row_param_name(field: str) -> str:
    return ROW_PREFIX + field


def unique_rows(ids_s: Tensor, ids_q: Tensor, rows_s: Tensor, rows_q: Tensor,
                fields: dict[int, str]) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """Deduplicated rows of the adapted fields and per-row indices into them.

    ids_s (T, S, F) single-hot ids; rows_s (T, S, W, d), rows_q (T, Q, W, d) with W >= F
    (pooled multi-hot fields follow the single-hot ones and are never adapted); fields:
    position in F -> field name. Returns ({"embedding.<field>": (M_f, d)}, index_s (T, S, W),
    index_q (T, Q, W)) — index columns of other fields are 0.
    """
    t, s, f = ids_s.shape
    width, dim = rows_s.shape[2], rows_s.shape[-1]
    ids = torch.cat([ids_s.reshape(-1, f), ids_q.reshape(-1, f)])
    rows = torch.cat([rows_s.reshape(-1, width, dim), rows_q.reshape(-1, width, dim)])
    index = torch.zeros(len(ids), width, dtype=ids.dtype)
    table_rows = {}
    positions = torch.arange(len(ids))
    for j, name in fields.items():
        uniq, inverse = torch.unique(ids[:, j], return_inverse=True)
        first = torch.full((len(uniq),), len(ids)).scatter_reduce(0, inverse, positions, "amin")
        table_rows[row_param_name(name)] = rows[first, j]
        index[:, j] = inverse
    return table_rows, index[: t * s].reshape(t, s, width), index[t * s:].reshape(t, -1, width)


def compose_rows(fast: dict[str, Tensor], x, fields: dict[int, str]) -> Tensor:
    """One task's model input: rows (N, F, d) with adapted fields' columns read from the
    (adapted) deduplicated rows in ``fast``. ``x`` is rows, or (rows, index) when rows adapt."""
    if not fields or not isinstance(x, tuple):  # nothing adapts per row (or not MeLU rows)
        return x
    rows, index = x
    columns = [fast[row_param_name(fields[j])][index[:, j]] if j in fields else rows[:, j]
               for j in range(rows.shape[1])]
    return torch.stack(columns, dim=1)


def select_task(x, i: int):
    """Task ``i`` of a batched input (a tensor or nested tuples of tensors)."""
    return tuple(select_task(a, i) for a in x) if isinstance(x, tuple) else x[i]
