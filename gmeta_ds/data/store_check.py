"""Why a run may trust a task store, and a cache key that sees the log's content.

A store (``tasks-<key>/``) is trusted only after `verify_split` has checked, for every file
its ``manifest.json`` names:

* the name: a plain file directly inside the store (no path, no ``..``, no link, no FIFO);
* its dtype and shape: the ones the build writes for that array, consistent across arrays
  (rows of ids = rows of labels = the tasks' last offset, ...), and its size;
* its content: the xxh3-128 checksum recorded at build time (a fast non-cryptographic hash:
  it catches damage and edits, about 5 GB/s from the page cache), computed in the same one
  pass that checks the values: vocabulary ids in ``[0, num_ids)``, binary labels 0 or 1,
  regression labels finite, offsets from 0 rising to the array they index, every task
  with a support and a query.
The arrays are raw bytes (no pickle): they are read with ``pread`` / `numpy.memmap`.

`content_fingerprint` puts a log file's content into the cache key besides its size and
mtime, which a tool (or an attacker) can restore: the whole file up to `FULL_HASH_BYTES`,
beyond that the first and last 64 KiB, 16 strided 64 KiB blocks and the Parquet footer (its
metadata holds every row group's statistics), so the key stays cheap for huge logs.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import xxhash

from gmeta_ds.sparse import FieldSpec
from gmeta_ds.errors import DataError

HASH = "xxh3_128"
CHUNK_BYTES = 8 << 20
FULL_HASH_BYTES = 64 << 20
SAMPLE_BYTES, SAMPLES = 64 << 10, 16
FOOTER_MAX = 64 << 20  # a Parquet footer of a real log is kilobytes to a few megabytes
SPLITS = ("train", "valid", "test", "warm", "user_cold", "item_cold", "user_item_cold")
I4, I8, F4 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)


def _damaged(path: Path, problem: str) -> DataError:
    return DataError(f"{path}: {problem}; the task store is damaged or was changed after its build: "
                     f"delete the folder {path.parent} and the build runs again")


# ---------------------------------------------------------------- checksums
def file_digest(path: Path) -> str:
    """The xxh3-128 checksum of a file, read in chunks."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def content_fingerprint(path: Path) -> str:
    """A hash of a log file's content for the cache key (see the module docstring)."""
    h = xxhash.xxh3_128()
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as fh:
            if size <= FULL_HASH_BYTES:
                while chunk := fh.read(CHUNK_BYTES):
                    h.update(chunk)
                return h.hexdigest()
            for k in range(SAMPLES + 2):  # k = 0: the first block, k = SAMPLES + 1: the last
                fh.seek(k * (size - SAMPLE_BYTES) // (SAMPLES + 1))
                h.update(fh.read(SAMPLE_BYTES))
            fh.seek(size - 8)
            tail = fh.read(8)
            footer = int.from_bytes(tail[:4], "little")
            if tail[4:] == b"PAR1" and 0 < footer <= min(size - 8, FOOTER_MAX):
                fh.seek(size - 8 - footer)
                h.update(fh.read(footer))
    except OSError as exc:
        raise DataError(f"{path}: cannot read the log file ({exc.strerror or exc}) (data.path)") from None
    return h.hexdigest()


# ---------------------------------------------------------------- the manifest
def read_store_manifest(store: Path, version: int) -> tuple[dict, list[FieldSpec]]:
    """``manifest.json`` of ``store``, its format, version, fields and splits checked."""
    where = store / "manifest.json"
    try:
        manifest = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{store}: not a task store (manifest.json unreadable: {exc}); delete the "
                        "folder and the build runs again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "gmeta_ds task store" \
            or manifest.get("version") != version:
        found = manifest.get("version") if isinstance(manifest, dict) else None
        raise DataError(f"{store}: task store version {found!r}, this gmeta_ds reads version {version}; "
                        "delete the folder and the build runs again")
    for key, kind in (("fields", list), ("stats", dict), ("splits", dict)):
        if not isinstance(manifest.get(key), kind):
            raise _damaged(where, f"'{key}' is missing or not a {kind.__name__}")
    if manifest.get("label") not in ("binary", "regression"):
        raise _damaged(where, f"'label' is {manifest.get('label')!r}, expected 'binary' or 'regression'")
    fields = [_field(where, n, f) for n, f in enumerate(manifest["fields"])]
    splits = manifest["splits"]
    unknown = sorted(set(splits) - set(SPLITS))
    if unknown or not {"train", "test"} <= set(splits):
        raise _damaged(where, f"splits {sorted(splits)}: expected train, test and only {', '.join(SPLITS)}")
    return manifest, fields


def _field(where: Path, n: int, spec) -> FieldSpec:
    try:
        field = FieldSpec(**spec)
    except TypeError:
        field = None
    if field is None or not isinstance(field.name, str) or field.side not in ("user", "item") \
            or type(field.num_ids) is not int or not 0 <= field.num_ids < 2**62 \
            or not isinstance(field.multi_hot, bool) or not isinstance(field.raw, bool):
        raise _damaged(where, f"fields[{n}] is {spec!r}; expected name, num_ids (a count), side "
                              "(user or item), multi_hot and raw (true/false)")
    return field


def expected_dtypes(fields: list[FieldSpec]) -> dict[str, np.dtype]:
    """The arrays of one split and the dtype the build writes each one with."""
    single = [f for f in fields if not f.multi_hot]
    out = {"offsets": I8, "support_len": I8, "task_keys": I8,
           "ids": I8 if any(f.raw for f in single) else I4, "labels": F4}
    for f in fields:
        if f.multi_hot:
            out[f"multi.{f.name}.offsets"], out[f"multi.{f.name}.values"] = I8, I4
    return out


def member(store: Path, name, where: str) -> Path:
    """``store / name`` if ``name`` is a plain file directly inside the store."""
    ok = isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name \
        and "\\" not in name and "\0" not in name
    path = store / name if ok else None
    try:
        ok = ok and stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        ok = False
    if not ok:
        raise DataError(f"{where}: names {name!r}; a task store file must be a plain file directly inside "
                        f"{store} (no folder, no '..', no link); delete the folder and the build runs again")
    return path


# ---------------------------------------------------------------- one split
def verify_split(store: Path, name: str, entries, fields: list[FieldSpec], label: str) -> dict:
    """Check split ``name`` (see the module docstring). Returns array name -> (path, dtype,
    shape) for the per-row files, and the per-task arrays themselves (small) under their names."""
    where = f"{store / 'manifest.json'}: splits.{name}"
    dtypes = expected_dtypes(fields)
    if not isinstance(entries, dict) or set(entries) != set(dtypes):
        got = sorted(entries) if isinstance(entries, dict) else entries
        raise DataError(f"{where}: lists {got!r}, expected {sorted(dtypes)}; delete the folder {store} "
                        "and the build runs again")
    layout = {k: _entry(store, f"{where}.{k}", entries[k], dtype) for k, dtype in dtypes.items()}
    shapes = _expected_shapes(layout, fields)
    for k, (path, dtype, shape, _) in layout.items():
        if shape != shapes[k]:
            raise _damaged(path, f"shape {list(shape)} in manifest.json, expected {list(shapes[k])} "
                                 "(consistent with the split's other arrays)")
    out = {}
    for k in ("offsets", "support_len", "task_keys"):
        _verify(*layout[k])
        out[k] = np.fromfile(layout[k][0], layout[k][1]) if layout[k][2][0] else np.zeros(0, I8)
    _check_tasks(layout, out)
    _verify(*layout["ids"], check=_id_check(fields))
    _verify(*layout["labels"], check=_label_check(label))
    for f in fields:
        if f.multi_hot:
            values, offsets = layout[f"multi.{f.name}.values"], layout[f"multi.{f.name}.offsets"]
            _verify(*offsets, check=_offset_check(values[2][0], offsets[2][0]))
            _verify(*values, check=_range_check([f]))
    out.update({k: v[:3] for k, v in layout.items() if k not in out})
    return out


def _entry(store: Path, where: str, spec, dtype: np.dtype) -> tuple:
    if not isinstance(spec, dict) or not {"file", "dtype", "shape", HASH} <= set(spec):
        raise DataError(f"{where}: {spec!r} is not a store file entry (file, dtype, shape, {HASH}); "
                        f"delete the folder {store} and the build runs again")
    path = member(store, spec["file"], where)
    if spec["dtype"] != dtype.str:
        raise _damaged(path, f"dtype {spec['dtype']!r} in manifest.json, expected {dtype.str!r}")
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < 2**48 for s in shape):
        raise _damaged(path, f"shape {shape!r} in manifest.json is not a list of sizes")
    return path, dtype, tuple(shape), spec[HASH]


def _expected_shapes(layout: dict, fields: list[FieldSpec]) -> dict:
    n_tasks = layout["task_keys"][2][0] if layout["task_keys"][2] else -1
    n_rows = layout["labels"][2][0] if layout["labels"][2] else -1
    shapes = {"task_keys": (n_tasks,), "support_len": (n_tasks,), "offsets": (n_tasks + 1,),
              "labels": (n_rows,), "ids": (n_rows, len([f for f in fields if not f.multi_hot]))}
    for f in fields:
        if f.multi_hot:
            values = layout[f"multi.{f.name}.values"][2]
            shapes[f"multi.{f.name}.offsets"] = (n_rows + 1,)
            shapes[f"multi.{f.name}.values"] = values[:1] if len(values) == 1 else (-1,)
    return shapes


def _check_tasks(layout: dict, arrays: dict) -> None:
    """Offsets from 0 to the number of rows; every task with a support and a query."""
    offsets, support = arrays["offsets"], arrays["support_len"]
    lengths = np.diff(offsets)
    if offsets[0] != 0 or offsets[-1] != layout["labels"][2][0] or (lengths < 2).any():
        raise _damaged(layout["offsets"][0], f"task offsets must rise from 0 to {layout['labels'][2][0]} "
                                             "(the rows) by at least 2 per task")
    if (support < 1).any() or (support >= lengths).any():
        raise _damaged(layout["support_len"][0], "every task needs a support of at least 1 row and a query")


def _verify(path: Path, dtype: np.dtype, shape: tuple, digest: str, check=None) -> None:
    """Size, checksum and (``check(block, first_row)`` -> problem or None) values, in one pass."""
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    size = shape[0] * row_bytes
    if os.lstat(path).st_size != size:
        raise _damaged(path, f"expected {size} bytes ({dtype} {list(shape)}) as manifest.json says")
    step = max(1, CHUNK_BYTES // row_bytes) * row_bytes if row_bytes else CHUNK_BYTES
    h, row, buf = xxhash.xxh3_128(), 0, bytearray(min(step, size))
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as fh:
        while size and (n := fh.readinto(buf)):
            chunk = memoryview(buf)[:n]
            h.update(chunk)
            block = np.frombuffer(chunk, dtype).reshape(-1, *shape[1:])
            problem = check(block, row) if check else None
            if problem:
                raise _damaged(path, problem)
            row += len(block)
    if h.hexdigest() != digest:
        raise _damaged(path, f"its content does not match the checksum ({HASH}) recorded at build time")


def _first(bad: np.ndarray) -> int:
    return int(np.argwhere(bad)[0][0])


def _range_check(fields: list[FieldSpec]):
    """Ids of vocabulary fields (columns of the block, raw fields skipped) in [0, num_ids)."""
    coded = [j for j, f in enumerate(fields) if not f.raw]

    def check(block: np.ndarray, row: int):
        ids = block.reshape(len(block), -1)
        unsigned = ids.view(np.uint32 if ids.dtype.itemsize == 4 else np.uint64)  # a negative id is huge
        for j in coded:  # one column at a time: 10x faster than a broadcast compare of (N, F)
            f = fields[j]
            if len(ids) and unsigned[:, j].max() >= f.num_ids:
                r = _first(unsigned[:, j] >= f.num_ids)
                return (f"row {row + r}: id {int(ids[r, j])} of field {f.name!r} is outside [0, {f.num_ids}), "
                        "the vocabulary manifest.json records")
        return None
    return check if coded else None


def _id_check(fields: list[FieldSpec]):
    return _range_check([f for f in fields if not f.multi_hot])


def _label_check(label: str):
    def check(block: np.ndarray, row: int):
        bad = ~np.isfinite(block) if label == "regression" else (block != 0) & (block != 1)
        if bad.any():
            r = _first(bad)
            allowed = "a finite number" if label == "regression" else "0 or 1 (data.label: binary)"
            return f"row {row + r}: label {float(block[r])!r} is not {allowed}"
        return None
    return check


def _offset_check(n_values: int, n_offsets: int):
    """Bag offsets: from 0, never falling, ending at the number of values."""
    last = [0]

    def check(block: np.ndarray, row: int):
        steps = np.diff(block, prepend=last[0])
        if (row == 0 and block[0] != 0) or (steps < 0).any():
            return f"row {row}: bag offsets must start at 0 and never fall"
        last[0] = int(block[-1])
        if row + len(block) == n_offsets and last[0] != n_values:
            return f"the last bag offset is {last[0]}, expected {n_values} (the values file's length)"
        return None
    return check


# ---------------------------------------------------------------- vocabularies
U1 = np.dtype(np.uint8)


def verify_vocab(store: Path, entries, fields: list[FieldSpec]) -> dict:
    """The vocabularies manifest.json lists (field -> {data, offsets}), each file checked as
    the split arrays are (plain file, size, checksum, offsets rising to the bytes' length) and
    each field's length matching its ``num_ids - 1``; field -> `Vocabulary` (memory-mapped)."""
    from gmeta_ds.data.vocab import Vocabulary

    where = f"{store / 'manifest.json'}: vocab"
    coded = {f.name: f for f in fields if not f.raw}
    if not isinstance(entries, dict) or set(entries) != set(coded):
        got = sorted(entries) if isinstance(entries, dict) else entries
        raise DataError(f"{where}: lists {got!r}, expected {sorted(coded)} (every field with a vocabulary); "
                        f"delete the folder {store} and the build runs again")
    out = {}
    for name, spec in entries.items():
        if not isinstance(spec, dict) or set(spec) != {"data", "offsets"}:
            raise _damaged(store / "manifest.json", f"vocab.{name} is {spec!r}, expected data and offsets")
        data = _entry(store, f"{where}.{name}.data", spec["data"], U1)
        offsets = _entry(store, f"{where}.{name}.offsets", spec["offsets"], I8)
        if len(data[2]) != 1 or offsets[2] != (coded[name].num_ids,):
            raise _damaged(offsets[0], f"the vocabulary of {name!r} has shape {offsets[2]} in manifest.json, "
                                       f"expected [{coded[name].num_ids}] (its field's num_ids)")
        _verify(*data)
        _verify(*offsets, check=_offset_check(data[2][0], offsets[2][0]))
        arrays = [np.memmap(p, dtype, "r", shape=tuple(shape)) if shape[0] else np.zeros(shape, dtype)
                  for p, dtype, shape, _ in (data, offsets)]
        out[name] = Vocabulary(*arrays)
    return out
