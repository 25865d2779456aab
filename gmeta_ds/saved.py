"""A trained model as one folder, written by `MetaEngine.save_model` and read back by
`gmeta_ds.load_model` without running any code from it.

The folder::

    model.json          format, version, the model's class (informational), the fields, the
                        tables, the algorithm's settings, and the SHA-256 of every other file
    model.json.sha256   model.json's own SHA-256, as ``sha256sum`` writes it (``sha256sum -c``
                        checks it in the folder)
    model.safetensors   every weight of the meta-learner (``net.*``: the model with its tables
                        under ``net.embedding.*``; algorithm-owned ones such as Meta-SGD's
                        ``inner_lrs.*``), float32
    vocab.safetensors   each vocabulary (`gmeta_ds.data.vocab`) as ``<field>.data`` (uint8) and
                        ``<field>.offsets`` (int64): raw values -> row ids

Loading checks model.json against its digest, its format and version, every number in it as
the run config bounds it (`gmeta_ds.config.saved_meta`), that each file it lists is a plain
file of the folder whose SHA-256 matches, and that the model given has exactly the saved
weights' names and shapes; a folder that fails any check is a `ConfigError` naming the file
and what was expected. A folder saved before the digest existed loads with a warning that
says how to save it again. The digest sits in the same folder: it tells a damaged or
half-written model.json from a sound one, not a planted one (whoever can write model.json can
write its digest; docs/serving.md, "The export folder"). The model's code is the caller's (a
class cannot be loaded without running code): `load_model(folder, model)` takes the model, or
a function building it from the saved fields. The folder is written beside itself and
renamed into place: a reader never sees half of it, and a folder being replaced stays whole
until the new one is complete.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from gmeta_ds.algorithms.base import EMBEDDING_PREFIX, NET_PREFIX, AlgorithmSettings, MetaLearner
from gmeta_ds.checkpoint.manifest import sha256
from gmeta_ds.data.vocab import Vocabulary, value_text
from gmeta_ds.embedding.tables import DynamicRows, EmbeddingCollection, TableConfig
from gmeta_ds.errors import ConfigError
from gmeta_ds.models.protocol import model_hooks
from gmeta_ds.sparse import FieldSpec, Jagged, model_field_order, single_fields

FORMAT, VERSION = "gmeta_ds model", 1
META, WEIGHTS, VOCAB = "model.json", "model.safetensors", "vocab.safetensors"
DIGEST = f"{META}.sha256"  # model.json's SHA-256, one sha256sum line
ALGORITHM_KEYS = tuple(f.name for f in dataclasses.fields(AlgorithmSettings))
# Settings added after exports existed, with the value an older export was trained with: a
# training-only term (the query loss's ranking weight) that adapting and scoring never read.
LATER_KEYS = {"rank_weight": 0.0, "warmup_steps": 0, "init_weight": 0.0}


def algorithm_settings(algorithm) -> dict | None:
    """The registered name and settings of ``algorithm`` (None for a user's own class, which
    cannot be rebuilt from a name)."""
    from gmeta_ds.algorithms import ALGORITHMS

    name = next((n for n in ALGORITHMS.names() if type(algorithm) is ALGORITHMS[n]), None)
    if name is None:
        return None
    return {"name": name, **dataclasses.asdict(algorithm.settings())}


# The most model.json a saved model writes (fields, tables, vocabulary sizes: kilobytes); a
# larger one is not ours, and is not read to find out.
META_MAX_BYTES = 16 * 2**20


def is_saved_model(meta: Path) -> bool:
    """Whether ``meta`` is the model.json of a saved model: a JSON object with our ``format``."""
    try:
        if not meta.is_file() or meta.stat().st_size > META_MAX_BYTES:
            return False
        found = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(found, dict) and found.get("format") == FORMAT


def target_problems(folder: Path) -> list[str]:
    """Why ``folder`` cannot take a saved model: a file, a folder holding anything but an
    earlier saved model (a model.json of ours and the files a save writes, nothing else: the
    folder is replaced whole, so a file of someone else's would be lost). New and empty
    folders are fine."""
    if folder.exists() and not folder.is_dir():
        return [f"path: {folder} is a file, expected a folder for the saved model"]
    if not folder.is_dir() or not any(folder.iterdir()):
        return []
    if not is_saved_model(folder / META):
        return [f"path: {folder} is a folder that holds other files and no {META} of a saved model "
                f"(format {FORMAT!r}); save into a new or empty folder, or over an earlier saved model"]
    foreign = sorted(p.name for p in folder.iterdir() if p.name not in (META, DIGEST, WEIGHTS, VOCAB))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f", ... ({len(foreign) - 5} more)" if len(foreign) > 5 else "")
        return [f"path: {folder} is a saved model with files a save does not write ({shown}); replacing "
                "it would delete them: move them away, or save into a new folder"]
    return []


def write_model(folder: str | Path, state: dict[str, Tensor], model: nn.Module, fields: list[FieldSpec],
                tables: list[TableConfig], vocab: dict[str, Vocabulary], algorithm,
                serving: dict | None = None) -> Path:
    """Write the folder (module docstring); returns its path. ``folder`` may be missing,
    empty, or an earlier saved model (replaced whole, once the new one is complete);
    anything else is refused before anything is written. ``serving``: what `gmeta_ds.serving`
    needs beyond the weights (`gmeta_ds.serving.export.serving_section`), kept in model.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    problems = target_problems(folder)
    if problems:
        raise ConfigError(problems, "MetaEngine.save_model")
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        save_file({k: (v.detach().float() if v.is_floating_point() else v.detach()).contiguous().cpu()
                   for k, v in state.items()}, str(work / WEIGHTS))
        arrays = {}
        for name, v in vocab.items():
            # copies: a task store's vocabularies are read-only maps, which torch warns about
            arrays[f"{name}.data"] = torch.from_numpy(np.array(v.data, dtype=np.uint8))
            arrays[f"{name}.offsets"] = torch.from_numpy(np.array(v.offsets, dtype=np.int64))
        save_file(arrays, str(work / VOCAB))
        meta = {"format": FORMAT, "version": VERSION,
                "model": f"{type(model).__module__}.{type(model).__qualname__}",
                "fields": [dataclasses.asdict(f) for f in fields],
                "tables": [{**dataclasses.asdict(t), "features": list(t.features)} for t in tables],
                "algorithm": algorithm_settings(algorithm),
                "serving": serving or {"name": type(model).__name__.lower(), "inner_steps": algorithm.inner_steps},
                "files": {name: sha256(work / name) for name in (WEIGHTS, VOCAB)}}
        text = (json.dumps(meta, indent=1) + "\n").encode()
        (work / META).write_bytes(text)
        (work / DIGEST).write_text(f"{hashlib.sha256(text).hexdigest()}  {META}\n")
        for name in (WEIGHTS, VOCAB, META, DIGEST):
            with open(work / name, "rb") as fh:
                os.fsync(fh.fileno())
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        if folder.exists():
            folder.rename(old)
        work.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


@dataclass
class SavedModel:
    """What `load_model` returns: ``model`` (its tables as ``model.embedding``), ``learner``
    (the meta-learner rebuilt with the saved algorithm and weights; None for a user's own
    algorithm class), ``fields``, ``tables``, ``vocab`` (field -> `Vocabulary`), ``path``.

    Args:
        model: the model holding the saved weights, its tables as ``model.embedding``.
        learner: the `MetaLearner` rebuilt with the saved algorithm; None for a user's own
            algorithm class.
        fields: the fields the model was trained on.
        tables: the tables' configs.
        vocab: field -> its `Vocabulary` (raw value -> id).
        algorithm: the saved algorithm's settings (model.json's ``algorithm``); None: none
            saved.
        path: the folder it was loaded from.
    """

    model: nn.Module
    learner: Any
    fields: list[FieldSpec]
    tables: list[TableConfig]
    vocab: dict[str, Vocabulary]
    algorithm: dict | None
    path: Path

    def encode(self, columns: dict[str, Any]) -> tuple[Tensor, dict[str, Jagged]]:
        """Raw feature values -> the model's inputs: ``columns`` maps every field to N raw
        values (a multi-hot field to N lists of values); returns (ids (N, F_single) int64 in
        the fields' order, {multi-hot field: Jagged}). A value outside the vocabulary gets
        id 0 (the out-of-vocabulary row); a field of raw ids (dynamic tables) keeps its
        values' ids.

        Args:
            columns: field name -> N raw values (a multi-hot field: N lists of values).

        Returns:
            The ids, (N, F_single) int64 in the single-hot fields' order, and the bags,
            multi-hot field -> `Jagged` of N bags.

        Raises:
            ConfigError: a field without values, fields of different lengths, or a multi-hot
                field whose rows are not lists.
        """
        from gmeta_ds.sparse import value_id

        missing = [f.name for f in self.fields if f.name not in columns]
        lengths = {f.name: len(columns[f.name]) for f in self.fields if f.name in columns}
        problems = [f"columns: no values for field(s) {', '.join(missing)}"] if missing else []
        if len(set(lengths.values())) > 1:
            problems.append(f"columns: every field needs the same number of rows; got {lengths}")
        if problems:
            raise ConfigError(problems, "SavedModel.encode")
        n = next(iter(lengths.values()), 0)
        single = []
        for f in single_fields(self.fields):
            values = list(columns[f.name])
            if f.raw:
                single.append(np.fromiter((value_id(value_text(v)) for v in values), np.int64, len(values)))
            else:
                single.append(self.vocab[f.name].encode(values))
        ids = torch.from_numpy(np.stack(single, axis=1) if single else np.zeros((n, 0), np.int64))
        multi = {}
        for f in self.fields:
            if not f.multi_hot:
                continue
            bags = list(columns[f.name])
            if any(isinstance(b, (str, bytes)) or not hasattr(b, "__iter__") for b in bags):
                raise ConfigError([f"columns[{f.name!r}]: a multi-hot field takes one list of values per row"],
                                  "SavedModel.encode")
            bags = [list(b) for b in bags]
            offsets = np.zeros(len(bags) + 1, np.int64)
            np.cumsum([len(b) for b in bags], out=offsets[1:])
            values = self.vocab[f.name].encode(v for b in bags for v in b)
            multi[f.name] = Jagged(torch.from_numpy(values), torch.from_numpy(offsets))
        return ids, multi

    @torch.no_grad()
    def logits(self, columns: dict[str, Any]) -> Tensor:
        """The model's logits for raw rows (`encode`), without adaptation: (N,) or (N, C).

        Args:
            columns: field name -> N raw values, as `encode` takes them.

        Returns:
            (N,) logits, or (N, C) for C classes.

        Raises:
            ConfigError: ``columns`` that `encode` refuses.
        """
        from gmeta_ds.algorithms.base import embedder
        from gmeta_ds.models.popularity import net_logits

        ids, multi = self.encode(columns)
        return net_logits(self.model, embedder(self.model)(ids, multi), ids)


def _refuse(path: Path, problem: str) -> ConfigError:
    return ConfigError([f"{path}: {problem}"], "gmeta_ds.load_model")


def _member(folder: Path, name: str) -> Path:
    path = folder / name
    try:
        ok = stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        ok = False
    if not ok:
        raise _refuse(path, "missing, or not a plain file (a saved model's files are plain files of its folder)")
    return path


def read_meta(folder: str | Path) -> dict:
    """model.json of a saved model: its digest, format, version and numbers checked."""
    from gmeta_ds.config.saved_meta import saved_meta_problems

    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError([f"path: {folder} {'is a file' if folder.exists() else 'does not exist'}, expected the "
                           "folder engine.save_model wrote"], "gmeta_ds.load_model")
    path = _member(folder, META)
    text = _head(path, META_MAX_BYTES + 1)
    if len(text) > META_MAX_BYTES:
        raise _refuse(path, f"over {META_MAX_BYTES} bytes; a saved model's model.json holds kilobytes")
    digested = _check_digest(folder, text)
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _refuse(path, f"not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _refuse(path, f"not a gmeta_ds saved model (format {meta.get('format') if isinstance(meta, dict) else meta!r})")
    if meta.get("version") != VERSION:
        raise _refuse(path, f"saved model version {meta.get('version')!r}; this gmeta_ds reads version {VERSION}")
    for key, kind in (("fields", list), ("tables", list), ("files", dict)):
        if not isinstance(meta.get(key), kind):
            raise _refuse(path, f"'{key}' is missing or not a {kind.__name__}")
    if set(meta["files"]) != {WEIGHTS, VOCAB}:
        raise _refuse(path, f"'files' lists {sorted(meta['files'])}, expected {WEIGHTS} and {VOCAB}")
    problems = saved_meta_problems(meta)
    if problems:
        raise ConfigError([f"{path}: {p}" for p in problems], "gmeta_ds.load_model")
    if not digested:
        warnings.warn(f"{path}: no {DIGEST} beside it (saved before gmeta_ds wrote one): its numbers are checked, "
                      "but damage to it cannot be detected; save it again (gmeta-ds export WEIGHTS OUT --config "
                      "RUN.yaml --overwrite, or engine.save_model) to add the digest", stacklevel=2)
    try:
        meta["fields"] = [FieldSpec(**f) for f in meta["fields"]]
        meta["tables"] = [TableConfig(**{**t, "features": tuple(t["features"])}) for t in meta["tables"]]
    except (TypeError, ValueError, KeyError) as exc:
        raise _refuse(path, f"its fields or tables are malformed ({exc})") from None
    return meta


def _head(path: Path, size: int) -> bytes:
    """At most ``size`` bytes of ``path``; a file that cannot be read is refused naming it."""
    try:
        with open(path, "rb") as fh:
            return fh.read(size)
    except OSError as exc:
        raise _refuse(path, f"not readable ({exc.strerror or exc})") from None


def _check_digest(folder: Path, text: bytes) -> bool:
    """model.json's bytes (``text``, as read) against the SHA-256 its digest file records;
    False for a folder without one (saved before it existed: `read_meta` warns)."""
    path = folder / DIGEST
    if not os.path.lexists(path):
        return False
    line = _head(_member(folder, DIGEST), 200)
    found = re.fullmatch(rb"([0-9a-f]{64})  " + re.escape(META.encode()) + rb"\n?", line)
    if found is None:
        raise _refuse(path, f"not one SHA-256 line for {META} (expected 64 hex digits, two spaces, {META}, "
                            "as sha256sum writes it)")
    if found.group(1).decode() != hashlib.sha256(text).hexdigest():
        raise _refuse(folder / META, f"its SHA-256 does not match the one {DIGEST} records (changed or damaged "
                                     "after it was saved)")
    return True


def saved_learner(model: nn.Module, settings, where: Path):
    """The meta-learner of the saved algorithm settings around ``model``."""
    from gmeta_ds.algorithms import ALGORITHMS

    if isinstance(settings, dict):
        settings = {**LATER_KEYS, **settings}
    if not isinstance(settings, dict) or settings.get("name") not in ALGORITHMS.names() \
            or not set(ALGORITHM_KEYS) <= set(settings):
        raise _refuse(where, f"'algorithm' is {settings!r}: expected a registered algorithm's name and "
                             f"{', '.join(ALGORITHM_KEYS)}")
    try:
        algorithm = ALGORITHMS[settings["name"]].from_settings(AlgorithmSettings(**{k: settings[k] for k in ALGORITHM_KEYS}))
    except ConfigError as exc:
        raise _refuse(where, f"'algorithm' is refused: {'; '.join(exc.problems)}") from None
    return MetaLearner(model, algorithm)


def load_model(folder: str | Path, model: nn.Module | Callable[[list[FieldSpec]], nn.Module]) -> SavedModel:
    """Load a folder written by `MetaEngine.save_model` (module docstring) into ``model`` (the
    same architecture; or a function building it from the saved fields, e.g.
    ``lambda fields: gm.DCNv2(fields, embed_dim=8)``). Its tables are attached as
    ``model.embedding`` when it has none; every weight must match by name and shape.

    Args:
        folder: the saved model's folder.
        model: the same architecture, or a function of the saved fields that builds it.

    Returns:
        The `SavedModel`: the model with its weights, the learner, fields, tables and
        vocabularies.

    Raises:
        ConfigError: a folder that is missing or is not a saved model, a file whose SHA-256
            differs from model.json's, numbers out of bounds, or weights whose names or
            shapes do not match the model, each naming the file and what was expected.
    """
    folder = Path(folder)
    meta = read_meta(folder)
    tensors = _read_files(folder, meta)
    fields, tables = meta["fields"], meta["tables"]
    vocab = _vocabularies(folder, fields, tensors[VOCAB])
    model = built_model(model, fields)
    state = tensors[WEIGHTS]
    if tables and model_hooks(model).embedding is None and any(k.startswith(EMBEDDING_PREFIX) for k in state):
        model.embedding = EmbeddingCollection(tables)
    settings = meta.get("algorithm")
    learner = saved_learner(model, settings, folder / META) if settings is not None else None
    if learner is None:  # a user's own algorithm class: the model's weights alone
        state = {k[len(NET_PREFIX):]: v for k, v in state.items() if k.startswith(NET_PREFIX)}
    target = learner if learner is not None else model
    fit_dynamic_tables(target, state)
    check_architecture(target, state, model, folder, meta.get("model"))
    own = target.state_dict()
    target.load_state_dict({k: v.to(own[k].dtype) if v.is_floating_point() else v for k, v in state.items()})
    return SavedModel(model, learner, fields, tables, vocab, settings, folder)


def _read_files(folder: Path, meta: dict) -> dict[str, dict[str, Tensor]]:
    """The weights and vocabulary files, each a plain file of ``folder`` whose SHA-256 matches
    model.json's, read as safetensors (no code runs)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors = {}
    for name, path in checked_files(folder, meta).items():
        try:
            tensors[name] = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise _refuse(path, f"not a readable safetensors file ({exc})") from None
    return tensors


def checked_files(folder: Path, meta: dict) -> dict[str, Path]:
    """model.json's files, each a plain file of ``folder`` whose SHA-256 matches its record."""
    paths = {name: _member(folder, name) for name in (WEIGHTS, VOCAB)}
    for name, path in paths.items():
        if sha256(path) != meta["files"][name]:
            raise _refuse(path, f"its SHA-256 does not match the one {META} records (changed or damaged "
                                "after it was saved)")
    return paths


def _vocabularies(folder: Path, fields: list[FieldSpec], arrays: dict[str, Tensor]) -> dict[str, Vocabulary]:
    """Each vocabulary field's `Vocabulary` from vocab.safetensors (fields of raw ids have none)."""
    vocab = {}
    for f in fields:
        if f.raw:
            continue
        try:
            vocab[f.name] = Vocabulary(arrays[f"{f.name}.data"].numpy(), arrays[f"{f.name}.offsets"].numpy())
        except (KeyError, ValueError) as exc:
            raise _refuse(folder / VOCAB, f"no valid vocabulary for field {f.name!r} ({exc})") from None
    return vocab


def built_model(model, fields: list[FieldSpec]) -> nn.Module:
    """``model``, or what the function ``model`` builds from the saved fields."""
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise ConfigError([f"model: expected a torch.nn.Module or a function fields -> module, got "
                           f"{type(model).__name__}"], "gmeta_ds.load_model")
    built = model(model_field_order(fields))
    if not isinstance(built, nn.Module):
        raise ConfigError([f"model: the function returned {type(built).__name__}, not a torch.nn.Module"],
                          "gmeta_ds.load_model")
    return built


def fit_dynamic_tables(learner: nn.Module, state: dict[str, Tensor]) -> None:
    """Each dynamic table sized to the ids it admitted in ``state`` (`DynamicRows` resizes when
    it loads), so that the architecture check compares everything else."""
    for name, module in learner.named_modules():
        if isinstance(module, DynamicRows):
            own = {k: state[f"{name}.{k}"] for k in ("ids", "rows", "defaults") if f"{name}.{k}" in state}
            module.load_state_dict(own, strict=False)


def check_architecture(target: nn.Module, state: dict, model: nn.Module, folder: Path, saved_as) -> None:
    """Every weight of ``target`` in ``state`` and the other way round, with equal shapes;
    else a `ConfigError` listing the differences (at most 8 of each kind)."""
    own = target.state_dict()
    unexpected = sorted(set(state) - set(own))
    absent = sorted(set(own) - set(state))
    shapes = [f"{k}: saved {tuple(state[k].shape)}, model {tuple(own[k].shape)}"
              for k in sorted(set(state) & set(own)) if tuple(state[k].shape) != tuple(own[k].shape)]
    if not (unexpected or absent or shapes):
        return
    lines = []
    if absent:
        lines.append(f"the model has weights the folder lacks: {', '.join(absent[:8])}")
    if unexpected:
        lines.append(f"the folder has weights the model lacks: {', '.join(unexpected[:8])}")
    lines.extend(shapes[:8])
    raise ConfigError([f"model: {type(model).__name__} is not the architecture saved in {folder} "
                       f"({saved_as}): " + "; ".join(lines)], "gmeta_ds.load_model")
