"""Vocabularies: the raw values of a categorical field and the table rows they map to.

A field's vocabulary is built from the training users' rows (`builder.py`, `stream.py`): the
value at position i has id i + 1, every other value id 0 (out of vocabulary). It is kept as
two flat arrays, the values' UTF-8 bytes back to back and their int64 offsets, so that it
is stored in the task store and in a saved model as plain arrays (hashed, loaded without
code execution, memory-mappable) and decoded only when asked. Raw values are looked up in
their string form, the form the builders use: a str as it is, an integer as its decimal
digits, a missing value (None, NaN) as ``MISSING`` (the readers fill missing values so too).
"""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np

MISSING = "unknown"  # the string form of a missing raw value (None, NaN, an empty cell)


def value_text(value) -> str:
    """The string form a builder gave ``value`` (see the module docstring)."""
    if value is None or isinstance(value, float) and math.isnan(value):
        return MISSING
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (bool, np.bool_)):
        return str(value)
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))  # an integer column read as floats (a CSV with a gap)
    return str(value)


class Vocabulary:
    """The values of one field in id order (id = position + 1; id 0 = out of vocabulary).

    ``data``: uint8 (the values' UTF-8 bytes back to back), ``offsets``: int64 (V + 1,).

    Example: values ``["ab", "c"]`` are ``data = b"abc"``, ``offsets = [0, 2, 3]``; "ab" is
    id 1, "c" id 2.

    Args:
        data: 1-D uint8, the V values' UTF-8 bytes back to back.
        offsets: 1-D int64 (V + 1,), rising from 0 to len(data); value i is
            ``data[offsets[i]:offsets[i + 1]]``.

    Raises:
        ValueError: arrays of another dtype or rank, or offsets that do not rise from 0 to
            len(data).
    """

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        data, offsets = np.asarray(data), np.asarray(offsets)
        if data.dtype != np.uint8 or data.ndim != 1 or offsets.dtype != np.int64 or offsets.ndim != 1:
            raise ValueError("a vocabulary is uint8 bytes and int64 offsets, both 1-D")
        if (len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(data)
                or (len(offsets) > 1 and np.any(np.diff(offsets) < 0))):
            raise ValueError(f"vocabulary offsets must rise from 0 to {len(data)} (the bytes' length)")
        self.data, self.offsets = data, offsets
        self._ids: dict[str, int] | None = None

    @classmethod
    def from_values(cls, values: Iterable) -> "Vocabulary":
        """From the values in id order (their string forms)."""
        encoded = [value_text(v).encode("utf-8") for v in values]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        data = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        return cls(data, offsets)

    @classmethod
    def from_arrow(cls, values) -> "Vocabulary":
        """From a pyarrow array of the values (strings, or integers: their decimal digits) in
        id order; a null is ``MISSING``. Copies the bytes once, no Python loop."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks() if values.num_chunks else pa.array([], pa.string())
        text = pc.fill_null(values.cast(pa.string()), MISSING).cast(pa.large_string())
        if len(text) == 0:
            return cls(np.zeros(0, np.uint8), np.zeros(1, np.int64))
        _, offsets, data = text.buffers()
        offsets = np.frombuffer(offsets, dtype=np.int64)[text.offset:text.offset + len(text) + 1]
        data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
        return cls(data[offsets[0]:offsets[-1]].copy(), offsets - offsets[0])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __eq__(self, other) -> bool:
        return (isinstance(other, Vocabulary) and np.array_equal(self.offsets, other.offsets)
                and np.array_equal(self.data, other.data))

    def __repr__(self) -> str:
        shown = ", ".join(repr(v) for v in self.values(0, 3))
        return f"Vocabulary({len(self)} values: {shown}{', ...' if len(self) > 3 else ''})"

    def values(self, start: int = 0, stop: int | None = None) -> list[str]:
        """The values of ids ``start + 1 .. stop`` (positions ``start:stop``).

        Args:
            start: the first position (id - 1).
            stop: the position after the last (cut to the vocabulary's size); None: the end.

        Returns:
            The values' strings, in id order.
        """
        stop = len(self) if stop is None else min(stop, len(self))
        raw = bytes(self.data[self.offsets[start]:self.offsets[stop]]) if stop > start else b""
        base = int(self.offsets[start]) if stop > start else 0
        return [raw[int(a) - base:int(b) - base].decode("utf-8")
                for a, b in zip(self.offsets[start:stop], self.offsets[start + 1:stop + 1])]

    def value(self, row: int) -> str | None:
        """The raw value of row id ``row`` (None for 0, out of vocabulary).

        Args:
            row: a row id in 0..len(self).

        Returns:
            Its value's string, or None for id 0.

        Raises:
            IndexError: ``row`` outside 0..len(self).
        """
        if not 0 <= row <= len(self):
            raise IndexError(f"row id {row} outside 0..{len(self)}")
        return None if row == 0 else self.values(row - 1, row)[0]

    def encode(self, values: Iterable) -> np.ndarray:
        """int64 row ids of raw ``values`` (0 for a value not in the vocabulary).

        Args:
            values: raw values, matched by their string forms (an integral float as its
                integer: 3.0 is "3").

        Returns:
            (len(values),) int64 ids.
        """
        if self._ids is None:
            self._ids = {v: i + 1 for i, v in enumerate(self.values())}
        ids = self._ids
        return np.fromiter((ids.get(value_text(v), 0) for v in values), dtype=np.int64)
