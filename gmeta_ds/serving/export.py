"""The self-contained export that serving loads: a saved-model folder (`gmeta_ds.saved`) read
without running code from it, its large arrays memory-mapped.

The folder is what ``engine.save_model`` and ``gmeta-ds export --config`` write: model.json
(fields, tables, the algorithm's settings, a ``serving`` section with the model's name, the
inner steps to adapt with and, from the CLI, the run config's ``recipe``: the model and
embedding sections the zoo model is rebuilt from), model.safetensors (dense weights, every
table reassembled from its shards, dynamic tables' id maps ``...dynamic.<t>.ids``, Meta-SGD's
learned rates) and vocab.safetensors (raw value -> row id per field). model.json is checked
against its digest (model.json.sha256) and its numbers against the config's bounds, and every
other file's SHA-256 against model.json, before anything is used (`gmeta_ds.saved.read_meta`).

Tensors are mapped from the files (`mapped_tensors`) rather than read: a table larger than
memory is paged in as rows are looked up, several server processes share its pages, and a
model's start-up does not copy it. safetensors' own ``safe_open`` validates the header but copies
each tensor it returns, hence the mapping here (the format is 8 bytes of header length,
a JSON header, then the raw little-endian data).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from gmeta_ds.config.bounds import BOUNDS
from gmeta_ds.data.vocab import Vocabulary
from gmeta_ds.errors import ConfigError
from gmeta_ds.saved import META, VOCAB, WEIGHTS, checked_files, read_meta
from gmeta_ds.sparse import FieldSpec

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
MAX_INNER_STEPS = BOUNDS["eval.inner_steps"][0]  # a request adapts with at most as many as a run evaluates with


def _short(value, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (a hostile model.json may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def serving_section(name: str, inner_steps: int, recipe: dict | None = None) -> dict:
    """model.json's ``serving`` entry: the model's name, the inner steps a request adapts with
    (the run's eval steps), and the recipe a zoo model is rebuilt from (None: the caller
    passes the model to `gmeta_ds.serving.load_adapter`)."""
    return {"name": name, "inner_steps": int(inner_steps), **({"recipe": recipe} if recipe else {})}


def _refuse(path: Path, problem: str) -> ConfigError:
    return ConfigError([f"{path}: {problem}"], "gmeta_ds.serving")


def mapped_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a safetensors file, mapped copy-on-write (no read of the data, pages
    shared between processes until written); a malformed file is a `ConfigError` naming it.

    safetensors' own reader (``safe_open``) checks the header first and refuses what it
    refuses: offsets and shape entries that are not non-negative integers, offsets not
    contiguous or not covering the data section, a dtype whose size times the shape is not the
    span, a header past its size bound or nested JSON. A float tensor holding NaN or Inf is
    refused naming it (one pass over the weights at load)."""
    try:
        with safe_open(path, "np"):
            pass
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        header.pop("__metadata__", None)
        raw = np.memmap(path, dtype=np.uint8, mode="c")
        out = {}
        for name, info in header.items():
            start, end = (8 + length + o for o in info["data_offsets"])
            array = raw[start:end].view(DTYPES[info["dtype"]]).reshape(info["shape"])
            out[name] = torch.from_numpy(array)
    except (OSError, ValueError, KeyError, TypeError, struct.error, SafetensorError) as exc:
        raise _refuse(path, f"not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    for name, tensor in out.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise _refuse(path, f"tensor {name!r} holds NaN or Inf values, expected finite weights")
    return out


@dataclass
class Export:
    """An opened export: ``state`` (weight name -> mapped tensor), ``vocab`` (field -> its
    `Vocabulary`; fields of ids without one are absent), ``serving`` (model.json's section),
    ``version`` (the first 12 hex digits of the weights' SHA-256: a new export of other weights
    is a new version)."""

    path: Path
    meta: dict
    state: dict[str, Tensor]
    vocab: dict[str, Vocabulary]
    serving: dict

    @property
    def fields(self) -> list[FieldSpec]:
        return self.meta["fields"]

    @property
    def name(self) -> str:
        return self.serving["name"]

    @property
    def version(self) -> str:
        return self.meta["files"][WEIGHTS][:12]


def open_export(folder: str | Path) -> Export:
    """Check and map an export folder (module docstring); any problem is a `ConfigError`
    naming the file."""
    folder = Path(folder)
    meta = read_meta(folder)
    serving = meta.get("serving")
    if not isinstance(serving, dict) or not isinstance(serving.get("name"), str) \
            or not isinstance(serving.get("inner_steps"), int) or isinstance(serving["inner_steps"], bool) \
            or not 0 <= serving["inner_steps"] <= MAX_INNER_STEPS:
        raise _refuse(folder / META, f"'serving' is {_short(serving)}: expected the model's name and its "
                                     f"inner_steps (an integer in [0, {MAX_INNER_STEPS}]; re-export it with this "
                                     "gmeta_ds: engine.save_model or gmeta-ds export --config)")
    if meta.get("algorithm") is None:
        raise _refuse(folder / META, "'algorithm' is null: a user's own algorithm class cannot adapt at serving "
                                     "time; save with a registered algorithm (maml, fomaml, reptile, metasgd)")
    paths = checked_files(folder, meta)
    state = mapped_tensors(paths[WEIGHTS])
    arrays = mapped_tensors(paths[VOCAB])
    vocab = {}
    for f in meta["fields"]:
        if f"{f.name}.data" in arrays:
            try:
                vocab[f.name] = Vocabulary(arrays[f"{f.name}.data"].numpy(), arrays[f"{f.name}.offsets"].numpy())
            except (KeyError, ValueError) as exc:
                raise _refuse(paths[VOCAB], f"no valid vocabulary for field {f.name!r} ({exc})") from None
    return Export(folder, meta, state, vocab, serving)
