"""Raw feature values of a request -> the model's ids, padded over a batch of users.

A categorical field with a vocabulary maps each value through it (`Vocabulary.encode`; a value
it does not hold gets the out-of-vocabulary row 0); a field of raw ids (dynamic tables) keeps
the value's id (`gmeta_ds.sparse.value_id`) and a dynamic table looks an id it never admitted
up as its default row; a field of plain ids (synthetic data) takes integers in
``[0, num_ids)``, others going to row 0. Each such unknown value is counted (the server's
``unknown_ids`` metric) so that a drift in the incoming values is visible. A support label is
0 or 1 for a binary model (clicks), a finite rating within +-1e12 (`MAX_LABEL`) for a
regression model: anything else is the request's `RequestError` naming ``support[i].label``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from gmeta_ds.config.bounds import MAX_FLOAT
from gmeta_ds.data.vocab import value_text
from gmeta_ds.serving.adapter import Padded
from gmeta_ds.serving.export import Export
from gmeta_ds.sparse import PAD_ID, Jagged, multi_fields, single_fields, value_id

MAX_LABEL = MAX_FLOAT  # the largest rating a regression model adapts on: the config's float bound


class RequestError(ValueError):
    """A request that cannot be encoded: ``field`` names where (``support.item``), the message why."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class Encoded:
    """One user's rows: ids (N, F_single) int64, bags (multi-hot field -> N arrays), labels
    (N,) float32 (zeros for candidates), unknown (values mapped to a default row)."""

    ids: np.ndarray
    bags: dict[str, list[np.ndarray]]
    labels: np.ndarray
    unknown: int


class Encoder:
    """Encode the raw columns of one export's fields."""

    def __init__(self, export: Export):
        self.single = single_fields(export.fields)
        self.multi = multi_fields(export.fields)
        self.vocab = export.vocab
        # the single-hot fields of plain ids (neither a vocabulary nor raw ids) and their sizes
        self.plain = [j for j, f in enumerate(self.single) if f.name not in self.vocab and not f.raw]
        self.plain_sizes = np.array([[self.single[j].num_ids] for j in self.plain], np.int64)
        self.admitted = {}  # raw field -> the sorted ids its dynamic table admitted
        for table in export.meta["tables"]:
            ids = export.state.get(f"net.embedding.dynamic.{table.name}.ids")
            for name in table.features if ids is not None else ():
                self.admitted[name] = ids.numpy()
        for vocab in self.vocab.values():
            vocab.encode([])  # build the value -> id map now, not on the first request
        # binary labels are clicks, regression's ratings (AlgorithmSettings' default: binary)
        self.kind = (export.meta.get("algorithm") or {}).get("kind", "binary")

    def encode(self, columns: dict[str, list], labels: list[float] | None, where: str) -> Encoded:
        """``columns``: field -> N raw values (a multi-hot field: N lists); ``where`` prefixes
        the field in errors (``support``, ``candidates``)."""
        n = len(labels) if labels is not None else len(next(iter(columns.values()), []))
        ids = np.zeros((n, len(self.single)), np.int64)
        unknown, done = self._plain_block(ids, columns, n, where)
        for j, f in enumerate(self.single):
            if j not in done:
                ids[:, j], missed = self._column(f, self._values(columns, f.name, n, where), f"{where}.{f.name}")
                unknown += missed
        bags = {}
        for f in self.multi:
            rows = self._values(columns, f.name, n, where)
            if any(isinstance(b, (str, bytes)) or not isinstance(b, (list, tuple)) for b in rows):
                raise RequestError(f"{where}.{f.name}", "a multi-hot field takes a list of values per row")
            flat = self.vocab[f.name].encode(v for b in rows for v in b)
            unknown += int((flat == 0).sum())
            bags[f.name] = np.split(flat, np.cumsum([len(b) for b in rows])[:-1]) if rows else []
        y = self._labels(labels, where) if labels is not None else np.zeros(n, np.float32)
        return Encoded(ids, bags, y, unknown)

    def _labels(self, labels: list, where: str) -> np.ndarray:
        """The support's labels as float32, each checked against the model's label kind (as
        float64 first: 1e300 is not a rating that float32 would make inf, 1 + 1e-9 not a click)."""
        try:
            y = np.asarray(labels, np.float64)
        except (TypeError, ValueError, OverflowError):
            y = None
        if y is None or y.shape != (len(labels),):
            raise RequestError(f"{where}.label", "expected one number per row")
        if self.kind == "binary":
            bad, expected = (y != 0) & (y != 1), "0 or 1 (a binary model's labels are clicks)"
        elif self.kind == "regression":
            bad, expected = ~(np.abs(y) <= MAX_LABEL), f"a finite rating within +-{MAX_LABEL:g}"
        else:
            return y.astype(np.float32)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise RequestError(f"{where}[{i}].label", f"expected {expected}, got {labels[i]!r}")
        return y.astype(np.float32)

    def _plain_block(self, ids: np.ndarray, columns: dict, n: int, where: str) -> tuple[int, set[int]]:
        """The plain-id fields' columns of ``ids`` filled in one array conversion (a request's
        hot path: one per field costs more); (unknown, the columns filled), or (0, none filled)
        when a column is missing or a value is not an integer (then the field-by-field path
        converts it, or names the first problem in field order)."""
        if not self.plain or not n:
            return 0, set()
        try:
            block = np.array([self._values(columns, self.single[j].name, n, where) for j in self.plain])
        except RequestError:
            return 0, set()
        if block.dtype.kind not in "iu" or bool in set(map(type, _block_values(columns, self.plain, self.single))):
            return 0, set()  # a boolean among integers converts to 1/0 here: the field-by-field path refuses it
        bad = (block < 0) | (block >= self.plain_sizes)
        ids[:, self.plain] = np.where(bad, 0, block).T
        return int(bad.sum()), set(self.plain)

    @staticmethod
    def _values(columns: dict, name: str, n: int, where: str) -> list:
        if name not in columns and n == 0:
            return []
        if name not in columns:
            raise RequestError(f"{where}.{name}", "missing: every row needs this field (or give it once in "
                                                  "'user' when it is a user feature)")
        values = columns[name]
        if len(values) != n:
            raise RequestError(f"{where}.{name}", f"{len(values)} values for {n} rows")
        return values

    def _column(self, f, values: list, where: str) -> tuple[np.ndarray, int]:
        """(ids, how many were unknown) of one single-hot field."""
        if f.name in self.vocab:
            ids = self.vocab[f.name].encode(values)
            return ids, int((ids == 0).sum())
        if f.raw:
            ids = np.fromiter((value_id(value_text(v)) for v in values), np.int64, len(values))
            admitted = self.admitted.get(f.name)
            if admitted is None or not len(ids):
                return ids, 0
            pos = np.searchsorted(admitted, ids).clip(max=len(admitted) - 1)
            return ids, int((admitted[pos] != ids).sum()) if len(admitted) else len(ids)
        ids = np.asarray(values)
        if ids.dtype.kind not in "iu" or bool in set(map(type, values)):
            try:
                ids = np.asarray([_plain_id(v) for v in values], np.int64)
            except (TypeError, ValueError, OverflowError):  # OverflowError: past int64, or +-Infinity
                raise RequestError(where, f"expected integer ids in [0, {f.num_ids}) (not a boolean, "
                                          "not a number with a fraction: 3.7 is not id 3)") from None
        ids = ids.astype(np.int64, copy=False).reshape(len(values))
        bad = (ids < 0) | (ids >= f.num_ids)
        return np.where(bad, 0, ids), int(bad.sum())

    def pad(self, users: list[Encoded]) -> Padded:
        """The users' rows padded to the longest (at least one row; padding has mask 0, ids 0,
        `PAD_ID` in raw columns, empty bags)."""
        b, n = len(users), max([len(u.labels) for u in users] + [1])
        ids = np.zeros((b, n, len(self.single)), np.int64)
        ids[..., [j for j, f in enumerate(self.single) if f.raw]] = PAD_ID
        labels, mask = np.zeros((b, n), np.float32), np.zeros((b, n), np.float32)
        for i, u in enumerate(users):
            ids[i, :len(u.labels)] = u.ids
            labels[i, :len(u.labels)] = u.labels
            mask[i, :len(u.labels)] = 1.0
        multi = {}
        for f in self.multi:
            bags = [bag for u in users for bag in u.bags[f.name] + [np.zeros(0, np.int64)] * (n - len(u.labels))]
            offsets = np.zeros(len(bags) + 1, np.int64)
            np.cumsum([len(x) for x in bags], out=offsets[1:])
            values = np.concatenate(bags) if bags else np.zeros(0, np.int64)
            multi[f.name] = Jagged(torch.from_numpy(values.astype(np.int64)), torch.from_numpy(offsets))
        return Padded(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(mask), multi)


def _block_values(columns: dict, plain: list[int], single: list) -> itertools.chain:
    """Every value of the plain-id fields' columns, one after another."""
    return itertools.chain.from_iterable(columns[single[j].name] for j in plain)


def _plain_id(value) -> int:
    """A plain-id field's value as an id: an integer or an integer's text; a boolean or a float
    is refused (TypeError), never converted (true is not id 1, 3.7 not id 3)."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"{value!r} is not an integer id")
    return int(value)
