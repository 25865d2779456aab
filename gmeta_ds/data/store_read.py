"""Reading a task store (`stream`): its per-row arrays read on demand (`StoreArray`), the
store opened as a `TaskData` once verified, and the memory a process holds of it.
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path

import numpy as np

from gmeta_ds.data.readers import DataError
from gmeta_ds.data.store_check import read_store_manifest, verify_split, verify_vocab
from gmeta_ds.data.store_files import STORE_VERSION
from gmeta_ds.data.tasks import TaskData, TaskSet

STATES = ("warm", "user_cold", "item_cold", "user_item_cold")


class StoreArray:
    """A read-only array in a task-store file that reads the rows asked for with ``pread``.

    Collating a micro-batch asks for a few runs of rows (one per task); reading them with
    ``pread`` puts exactly those bytes in this process's memory, while the file's pages stay in
    the kernel's page cache, shared by every rank of the node. (Through a memory map the kernel
    maps whole folios around each touched row: after 640 tasks of a 10M-interaction store a
    rank had 92 of its 122 MB of ids resident.) Row slices and 1-D integer index arrays are
    read directly; anything else (``ids[:, j]``, ``np.asarray``, arithmetic) goes through a
    read-only `numpy.memmap` of the whole file."""

    def __init__(self, path: Path, dtype: np.dtype, shape: tuple) -> None:
        self.path, self.dtype, self.shape = path, np.dtype(dtype), tuple(shape)
        self.ndim, self.size = len(self.shape), int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize
        self.row_bytes = int(np.prod(self.shape[1:])) * self.dtype.itemsize
        self._fd: int | None = None
        self._map: np.memmap | None = None
        self._closer: weakref.finalize | None = None

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"StoreArray({self.path.name}, {self.dtype}, {list(self.shape)})"

    def __getstate__(self) -> dict:  # picklable (DataLoader workers, spawn): reopen lazily
        return {**self.__dict__, "_fd": None, "_map": None, "_closer": None}

    def _read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, *self.shape[1:]), self.dtype)
        if stop > start:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
                # closed when the array goes, or at exit before the interpreter tears modules
                # down (a __del__ then finds its module's globals gone and prints a traceback)
                self._closer = weakref.finalize(self, os.close, self._fd)
            offset = start * self.row_bytes
            n = os.preadv(self._fd, [out], offset)
            if n == out.nbytes:
                return out
            view, offset = memoryview(out).cast("B")[max(n, 0):], offset + max(n, 0)
            while len(view):
                n = os.preadv(self._fd, [view], offset)
                if n <= 0:
                    raise DataError(f"{self.path}: the task store file ended early (truncated after it was opened?)")
                view, offset = view[n:], offset + n
        return out

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(self.shape[0])
            return self._read(start, max(start, stop))
        if isinstance(key, (int, np.integer)):
            k = int(key) + (self.shape[0] if key < 0 else 0)
            if not 0 <= k < self.shape[0]:
                raise IndexError(f"index {key} out of range for {self!r}")
            return self._read(k, k + 1)[0]
        if isinstance(key, np.ndarray) and key.ndim == 1 and key.dtype.kind in "iu" and len(key):
            if key.min() < 0 or key.max() >= self.shape[0]:
                raise IndexError(f"index out of range for {self!r}")
            breaks = np.flatnonzero(np.diff(key) != 1) + 1  # runs of consecutive rows
            starts = np.concatenate([[0], breaks])
            ends = np.concatenate([breaks, [len(key)]])
            lo, hi = int(key.min()), int(key.max()) + 1
            if len(starts) > 8 and hi - lo <= 4 * len(key):  # many short runs close together: one read
                return self._read(lo, hi)[key - lo]
            return np.concatenate([self._read(int(key[a]), int(key[b - 1]) + 1) for a, b in zip(starts, ends)])
        return self.array()[key]

    def array(self) -> np.ndarray:
        """The whole array as a read-only memory map."""
        if self._map is None:
            self._map = np.memmap(self.path, self.dtype, "r", shape=self.shape)
        return self._map

    def __array__(self, dtype=None, copy=None):
        a = self.array()
        return a if dtype is None else a.astype(dtype)

    def astype(self, dtype, **kw) -> np.ndarray:
        return self.array().astype(dtype, **kw)

    def __getattr__(self, name):  # .max(), .sum(), .T, ...: on the memory map
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.array(), name)


def open_store(store: Path):
    """The `TaskData` of a finished store, its per-row arrays read on demand (`StoreArray`),
    once `store_check` has verified the manifest and every file (names, dtypes, shapes,
    checksums, values)."""
    manifest, fields = read_store_manifest(store, STORE_VERSION)
    parts = {}
    for name, entries in manifest["splits"].items():  # per-task arrays in memory, per-row ones read on demand
        a = verify_split(store, name, entries, fields, manifest["label"])
        multi = {f.name: (task_rows(a[f"multi.{f.name}.values"]), task_rows(a[f"multi.{f.name}.offsets"]))
                 for f in fields if f.multi_hot}
        parts[name] = TaskSet(fields, task_rows(a["ids"]), task_rows(a["labels"]), a["offsets"], a["support_len"],
                              a["task_keys"], multi)
    states = {k: v for k, v in parts.items() if k in STATES}
    vocab = verify_vocab(store, manifest.get("vocab"), fields)
    return TaskData(fields, parts["train"], parts["test"], {**manifest["stats"], "cache": str(store)},
                    states, parts.get("valid"), vocab, store)


def store_identity(data) -> dict | None:
    """What ``data`` (a `TaskData`) was read from, to compare between ranks: ``content``, a
    digest of its store's fields, label kind and every array's dtype, shape and checksum
    (manifest.json, verified when the store was opened: equal digests, equal tasks, whatever
    folder or host the store was built in), the store's folder name (its cache key) and the
    Delta table version read (None for other logs). None for tasks built in memory or generated."""
    store = getattr(data, "store", None)
    if store is None:
        return None
    manifest = json.loads((Path(store) / "manifest.json").read_text())
    held = json.dumps({k: manifest.get(k) for k in ("fields", "label", "splits", "vocab")}, sort_keys=True)
    snapshot = data.stats.get("snapshot") or {}
    return {"content": hashlib.sha256(held.encode()).hexdigest()[:20], "store": Path(store).name,
            "version": snapshot.get("version")}


def task_rows(layout: tuple) -> StoreArray | np.ndarray:
    """A verified per-row file (path, dtype, shape), read on demand."""
    path, dtype, shape = layout
    return StoreArray(path, dtype, shape) if int(np.prod(shape)) else np.zeros(shape, dtype)


def store_version(store: Path) -> int | None:
    """The version a store's manifest records (None: no readable manifest)."""
    try:
        return json.loads((store / "manifest.json").read_text()).get("version")
    except (OSError, ValueError, AttributeError):
        return None


def mapped_store_mib() -> float | None:
    """Resident MiB of this process's task-store mappings (``tasks-*/*.bin`` in
    /proc/self/smaps): the data a rank holds, pages shared with every rank of its node
    through the page cache. None where /proc is not available."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split(None, 5)
        if len(head) >= 5 and "-" in head[0] and not line.endswith("kB"):  # a mapping's header
            path = head[5] if len(head) == 6 else ""
            inside = path.endswith(".bin") and "/tasks-" in path
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total / 1024


def in_memory_mib(data) -> float | None:
    """MiB of the task arrays of ``data`` (a `TaskData`) held in this process's memory (not
    `StoreArray` files); None without data."""
    if data is None:
        return None
    parts = [getattr(data, "train", None), getattr(data, "valid", None), getattr(data, "test", None),
             *getattr(data, "states", {}).values()]
    total = 0
    for ts in parts:
        if ts is None:
            continue
        arrays = [ts.ids, ts.labels, ts.offsets, ts.support_len, ts.task_keys,
                  *[a for pair in ts.multi.values() for a in pair]]
        total += sum(a.nbytes for a in arrays if isinstance(a, np.ndarray) and not isinstance(a, np.memmap))
    return total / 2**20
