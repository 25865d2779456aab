"""The bottom layer for sparse data, which `data/`, `embedding/` and `models/` all build on:
the field specs of categorical features, jagged (bag) ids, the padding id, stable ids of raw
values, and bag statistics. No gmeta_ds import; torch only for `Jagged` and `hash_strings`."""
from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

PAD_ID = -(1 << 63)  # reserved: padding rows' id; reads the default row, never counted or admitted
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class FieldSpec:
    """One categorical feature field: ids are in ``[0, num_ids)``; ``side`` is user or item;
    ``multi_hot`` fields hold a bag of ids per interaction (e.g. a movie's genres). ``raw``
    fields (``data.raw_ids``, for dynamic tables) hold the column's own int64 values instead,
    with no vocabulary; their ``num_ids`` counts the distinct values of the training rows.

    Args:
        name: the field's name (its column).
        num_ids: ids are in [0, num_ids); id 0 is out-of-vocabulary.
        side: ``user`` or ``item``.
        multi_hot: a bag of ids per interaction instead of one id.
        raw: the column's own int64 values, for a dynamic table (no vocabulary).
    """

    name: str
    num_ids: int
    side: str
    multi_hot: bool = False
    raw: bool = False


def single_fields(fields: list[FieldSpec]) -> list[FieldSpec]:
    """The single-hot fields, in their order (the id columns of a `TaskBatch`).

    Args:
        fields: a task set's fields.

    Returns:
        Those that are not ``multi_hot``.
    """
    return [f for f in fields if not f.multi_hot]


def multi_fields(fields: list[FieldSpec]) -> list[FieldSpec]:
    """The multi-hot fields, in their order (the bags of a `TaskBatch`).

    Args:
        fields: a task set's fields.

    Returns:
        Those that are ``multi_hot``.
    """
    return [f for f in fields if f.multi_hot]


def model_field_order(fields: list[FieldSpec]) -> list[FieldSpec]:
    """The order of fields in model inputs (..., F, d): single-hot, then multi-hot."""
    return single_fields(fields) + multi_fields(fields)


@dataclass
class Jagged:
    """Ids of one feature for N samples: values (nnz,) int64, offsets (N + 1,) int64.
    ``one_per_sample``: known to hold exactly one id per sample (`single`), so pooling is the
    identity and `pool` skips it.

    Example: bags [3, 5], [], [7] are ``values = [3, 5, 7]``, ``offsets = [0, 2, 2, 3]``
    (N = 3); pooled by a table of width d they give (3, d).

    Args:
        values: (nnz,) int64 ids of every bag, one bag after the other.
        offsets: (N + 1,) int64, bag i is ``values[offsets[i]:offsets[i + 1]]``.
        one_per_sample: every bag holds exactly one id.
    """

    values: Tensor
    offsets: Tensor
    one_per_sample: bool = False

    @staticmethod
    def single(ids: Tensor) -> "Jagged":
        """One id per sample: ids (N,) -> offsets [0, 1, ..., N]."""
        ids = ids.reshape(-1)
        ids = ids if ids.is_floating_point() else ids.long()  # check_ids names float ids
        return Jagged(ids, torch.arange(len(ids) + 1, dtype=torch.long, device=ids.device), one_per_sample=True)

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1

    def segment_ids(self) -> Tensor:
        """Sample index of every value: (nnz,)."""
        lengths = self.offsets[1:] - self.offsets[:-1]
        return torch.repeat_interleave(torch.arange(self.num_samples, device=self.offsets.device), lengths)


@dataclass(frozen=True)
class BagStats:
    """What a table's lookups look like, for `choose_exchange`: ``mean_length`` ids per bag,
    ``distinct_ratio`` distinct ids per id looked up in one micro-batch (1: no repeats); for
    `topology.choose_row_topology`, ``host_distinct_ratio``: the same over the micro-batches of
    the ranks of one host together (None: not estimated)."""

    mean_length: float
    distinct_ratio: float = 1.0
    host_distinct_ratio: float | None = None


def string_id(value: str) -> int:
    """The stable non-negative int64 id of a string: the first 8 bytes of the MD5 of its UTF-8
    bytes, little-endian, top bit cleared (an id, not a security hash). DuckDB computes the
    same as ``(md5_number(s) & ((1::UHUGEINT << 63) - 1))::BIGINT``, so out-of-core builds and
    in-memory ones agree.

    Args:
        value: the string.

    Returns:
        Its id, in [0, 2**63).
    """
    return int.from_bytes(hashlib.md5(value.encode()).digest()[:8], "little") & _MASK63


def value_id(text: str) -> int:
    """The id of a raw categorical value in its string form: a canonical decimal int64
    ("42", "-7"; not "042" or "+1") is that integer, anything else its `string_id`. So integer
    ids keep their values whether a file stores them as integers or as text."""
    if re.fullmatch(r"0|-?[1-9][0-9]*", text) and -(1 << 63) <= int(text) < (1 << 63):
        return int(text)
    return string_id(text)


def hash_strings(values: Iterable[str]) -> Tensor:
    """`string_id` of every string, as an int64 tensor.

    Args:
        values: the strings (other values are taken as ``str(value)``).

    Returns:
        (len(values),) int64 ids.
    """
    return torch.tensor([string_id(str(v)) for v in values], dtype=torch.long)
