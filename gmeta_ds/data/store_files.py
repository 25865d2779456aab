"""The files of a task store (`stream`): its format version and the raw array files it
is written as, each described by a manifest entry (file, dtype, shape, checksum).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gmeta_ds.data.store_check import HASH, file_digest

STORE_VERSION = 3  # 3: the vocabularies; 2: a checksum per file and the label kind (older stores are rebuilt)


class ArrayWriter:
    """A raw array file of known shape, filled by row ranges with ``pwrite`` (not a memory
    map: written pages then stay in the page cache without counting in this process's
    resident memory)."""

    def __init__(self, folder: Path, name: str, dtype, shape: tuple) -> None:
        self.path, self.dtype, self.shape = folder / f"{name}.bin", np.dtype(dtype), shape
        self.row_bytes = int(np.prod(shape[1:])) * self.dtype.itemsize
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, int(np.prod(shape)) * self.dtype.itemsize)

    def put(self, start: int, values: np.ndarray) -> None:
        """Write ``values`` as the rows from ``start`` on."""
        if len(values):
            data = np.ascontiguousarray(values, dtype=self.dtype).data
            offset = start * self.row_bytes
            view = memoryview(data).cast("B")
            while len(view):
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n

    def close(self) -> dict:
        """Close the file; returns its manifest entry (file, dtype, shape, checksum)."""
        os.close(self.fd)
        return {"file": self.path.name, "dtype": self.dtype.str, "shape": list(self.shape),
                HASH: file_digest(self.path)}


class Appender:
    """A raw 1-D array file of unknown length, appended to."""

    def __init__(self, folder: Path, name: str, dtype) -> None:
        self.path, self.dtype, self.n = folder / f"{name}.bin", np.dtype(dtype), 0
        self.fh = open(self.path, "wb")

    def append(self, values: np.ndarray) -> None:
        """Append ``values`` at the end of the file."""
        self.fh.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self.n += len(values)

    def close(self) -> dict:
        """Close the file; returns its manifest entry (file, dtype, shape, checksum)."""
        self.fh.close()
        return {"file": self.path.name, "dtype": self.dtype.str, "shape": [self.n], HASH: file_digest(self.path)}


def write_array(folder: Path, name: str, values: np.ndarray) -> dict:
    """Write ``values`` as the array file ``name``; returns its manifest entry."""
    w = ArrayWriter(folder, name, values.dtype, values.shape)
    w.put(0, values)
    return w.close()



def fsync_tree(folder: Path) -> None:
    """Sync every file of ``folder`` to disk before the folder is renamed into place."""
    for f in folder.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
