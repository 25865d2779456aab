"""The manifest and its verification: hashes and sizes of every file, its keys checked one by
one before anything is hashed, DeepSpeed's pickles opened with ``weights_only=True``, and the
model match (`verify`)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath

import torch

from gmeta_ds.checkpoint.budget import budget
from gmeta_ds.checkpoint.layout import FORMAT_VERSION, MANIFEST, MANIFEST_MAX_BYTES
from gmeta_ds.config.deepspeed import MAX_WORLD
from gmeta_ds.engine import ds_internals
from gmeta_ds.errors import ConfigError


def sha256(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes, read in 1 MiB blocks; a symbolic link is refused."""
    digest = hashlib.sha256()
    with open(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# (real path, device, inode, size, mtime, ctime) -> SHA-256 of the files this process hashed.
# The CLI verifies a checkpoint before the process group starts (`trainer.completed_run`) and
# again after (`verify`): the second time costs a stat per file, so no rank hashes while a peer
# waits in a collective. Any write changes the ctime, which no user can set back.
_HASHED: dict[tuple, str] = {}


def _verified_sha256(path: Path) -> str:
    """`sha256` of ``path``, hashed once per unchanged file in this process (`_HASHED`)."""
    info = os.stat(path, follow_symlinks=False)
    key = (os.path.realpath(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns,
           info.st_ctime_ns)
    if key not in _HASHED:
        _HASHED[key] = sha256(path)
    return _HASHED[key]



def _show(value) -> str:
    """``value`` as an error message quotes it, cut to 80 characters."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value, minimum: int) -> bool:
    """Whether ``value`` is an int (not a bool) in ``[minimum, 2**63)``."""
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value < 2**63


def _load_manifest(where: Path) -> dict:
    """``manifest.json`` parsed: a regular file (not a link) of bounded size holding a JSON
    object; anything else a `ConfigError` naming it."""
    try:
        info = os.stat(where, follow_symlinks=False)
    except FileNotFoundError:
        raise ConfigError([f"{where}: missing ({where.parent} is not a complete checkpoint)"]) from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError([f"{where}: a symbolic link or not a regular file; expected the manifest "
                           "gmeta-ds wrote"])
    if info.st_size > MANIFEST_MAX_BYTES:
        raise ConfigError([f"{where}: {info.st_size} bytes, more than a manifest can be "
                           f"({MANIFEST_MAX_BYTES} bytes)"])
    try:
        manifest = json.loads(where.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError([f"{where}: not valid JSON (undecodable bytes)"]) from None
    except json.JSONDecodeError as exc:
        raise ConfigError([f"{where}: not valid JSON ({exc.msg})"]) from None
    except (ValueError, RecursionError) as exc:  # a number too long, nesting too deep
        raise ConfigError([f"{where}: not valid JSON ({type(exc).__name__}: {str(exc)[:120]})"]) from None
    if not isinstance(manifest, dict):
        raise ConfigError([f"{where}: expected a JSON object with a 'files' mapping "
                           f"(file -> SHA-256), got {type(manifest).__name__}"])
    if not isinstance(manifest.get("files"), dict):
        what = f"got {_show(manifest['files'])}" if "files" in manifest else "it is missing"
        raise ConfigError([f"{where}: key 'files': expected an object (file -> SHA-256), {what}"])
    if manifest.get("format") != FORMAT_VERSION:
        raise ConfigError([f"{where}: format {_show(manifest.get('format'))}, expected {FORMAT_VERSION}"])
    return manifest


def _is_table(value) -> bool:
    """Whether ``value`` is a table's ``[rows, dim]`` as `table_meta` writes it."""
    return (isinstance(value, list) and len(value) == 2 and (value[0] == "dynamic" or _is_int(value[0], 1))
            and _is_int(value[1], 1))


def _is_loader(value) -> bool:
    """Whether ``value`` is a loader position as the data loaders save it."""
    # next_step / tasks / step (a position or count) and seed, where a loader saved them
    return isinstance(value, dict) and all(
        _is_int(value[k], 0) for k in ("next_step", "tasks", "step") if k in value) and (
        "seed" not in value or _is_int(value["seed"], -2**63))


# key -> (check, what is expected): the manifest keys a resume or an export reads.
_KEYS = {
    "step": (lambda v: _is_int(v, 0), "an integer >= 0 (the meta-step)"),
    "world_size": (lambda v: _is_int(v, 1) and v <= MAX_WORLD, f"an integer >= 1 and <= {MAX_WORLD}"),
    "loader": (_is_loader, "an object (the data position: integer next_step, seed, tasks)"),
    "algorithm": (lambda v: isinstance(v, str), "a string"),
    "fields": (lambda v: isinstance(v, list) and all(isinstance(f, str) for f in v), "a list of strings"),
    "tables": (lambda v: isinstance(v, dict), "an object {table: [rows, dim]}"),
    "dense_shapes": (lambda v: isinstance(v, dict), "an object {parameter: [sizes]}"),
}
# the entries of the mapping keys: (check, what is expected)
_ENTRIES = {
    "tables": (_is_table, '[rows (an integer >= 1, or "dynamic"), dim (an integer >= 1)]'),
    "dense_shapes": (lambda s: isinstance(s, list) and all(_is_int(n, 0) for n in s),
                     "a list of sizes, each an integer >= 0"),
}


def _key_problems(manifest: dict, where: Path) -> list[str]:
    """One line per key of `_KEYS` that is missing or of the wrong type (entries of the mappings too)."""
    problems = []
    for key, (check, expected) in _KEYS.items():
        if key not in manifest:
            problems.append(f"{where}: key {key!r} is missing (expected {expected})")
        elif not check(manifest[key]):
            problems.append(f"{where}: key {key!r}: expected {expected}, got {_show(manifest[key])}")
        elif key in _ENTRIES:
            check, expected = _ENTRIES[key]
            problems += [f"{where}: key '{key}.{name}': expected {expected}, got {_show(value)}"
                         for name, value in manifest[key].items() if not check(value)]
    return problems


def _bad_name(name) -> bool:
    """Whether a manifest's file name could lead outside the checkpoint directory (or is not
    the normalised relative path `save` writes)."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        return True
    path = PurePosixPath(name)
    return (path.is_absolute() or str(path) != name or any(p in ("..", ".") for p in path.parts)
            or name == MANIFEST)


def _file_problems(manifest: dict, where: Path, ckpt: Path, model: dict) -> list[str]:
    """The manifest's files and sizes against the checkpoint directory: every name a relative
    path inside it, exactly the regular files found there (no link, nothing else), each of the
    recorded size, every rank's file and ``dense.safetensors`` among them, and each one a file
    a save of ``model`` (tables, dense shapes, capacities) writes, no larger than it writes
    (`budget.Budget`)."""
    files, sizes = manifest["files"], manifest.get("sizes")
    problems = [f"{where}: key 'files': {_show(n)} is not a file inside {ckpt} (an absolute path, "
                "'..', or not normalised)" for n in files if _bad_name(n)]
    problems += [f"{where}: key 'files.{n}': expected a SHA-256 (64 hex digits), got {_show(d)}"
                 for n, d in files.items() if not (isinstance(d, str) and re.fullmatch(r"[0-9a-f]{64}", d))]
    if sizes is not None and not (isinstance(sizes, dict) and set(sizes) == set(files)
                                  and all(_is_int(v, 0) for v in sizes.values())):
        problems.append(f"{where}: key 'sizes': expected an object with an integer >= 0 for each "
                        "file of 'files' and nothing else")
        sizes = None
    if problems:
        return problems
    on_disk: dict[str, int] = {}
    base = ckpt.resolve()
    for folder, dirs, names in os.walk(base, followlinks=False):
        for name in dirs + names:
            path = Path(folder, name)
            info = os.stat(path, follow_symlinks=False)
            rel = path.relative_to(base).as_posix()
            if stat.S_ISREG(info.st_mode):
                if rel != MANIFEST:
                    on_disk[rel] = info.st_size
            elif not stat.S_ISDIR(info.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
                problems.append(f"{ckpt / rel}: {kind}; a checkpoint holds only the files it wrote")
    problems += [f"{ckpt / n}: listed in the manifest but missing" for n in files if n not in on_disk]
    problems += [f"{ckpt / n}: not part of the checkpoint (not in the manifest)"
                 for n in on_disk if n not in files]
    if sizes is not None:
        problems += [f"{ckpt / n}: contents differ from the manifest's SHA-256 (modified or truncated: "
                     f"{on_disk[n]} bytes, the manifest's 'sizes' records {sizes[n]}; not hashed)"
                     for n in files if n in on_disk and on_disk[n] != sizes[n]]
    world = manifest["world_size"]
    required = {"dense.safetensors", *(f"rank{r:05d}.safetensors" for r in range(world))}
    lacking = sorted(required - set(files))
    if lacking:
        more = " ..." if len(lacking) > 4 else ""
        problems.append(f"{where}: key 'files' lacks {len(lacking)} of the files a checkpoint of "
                        f"world_size={world} holds: {', '.join(lacking[:4])}{more}")
    problems += [f"{where}: key 'files.{n}': a rank file beyond world_size={world}"
                 for n in files if re.fullmatch(r"rank[0-9]+\.safetensors", n) and n not in required]
    if problems:
        return problems
    return budget(model["tables"], model["dense_shapes"], _capacities(model), world).problems(on_disk, ckpt)


def _capacities(model: dict) -> dict:
    """``model``'s dynamic tables' rows per rank, as far as it records them validly."""
    found = model.get("capacities")
    return {k: v for k, v in found.items() if _is_int(v, 1)} if isinstance(found, dict) else {}


def read_manifest(ckpt: Path, meta: dict | None = None) -> dict:
    """The manifest, with every listed file present and matching its SHA-256.

    Checked before any file is hashed, each failure a `ConfigError` naming the file and the
    key: the manifest's keys and types (`_KEYS`), with ``meta`` (what the loading run builds:
    `check_compatible`) its match to that model, then its files: relative paths inside
    ``ckpt``, exactly the regular files there (a symbolic link or an unlisted file is
    refused), of the sizes it records (manifests written before sizes were recorded are
    checked by hash alone), and only files a save writes, each no larger than a save of the
    model writes it (`budget`: from ``meta``'s tables, dense shapes and capacities, or
    without ``meta`` from the manifest's own). So a manifest cannot make a resume read
    anything but the checkpoint's own files, and never more bytes than a save of the model
    writes."""
    where = ckpt / MANIFEST
    manifest = _load_manifest(where)
    problems = _key_problems(manifest, where)
    if problems:
        raise ConfigError(problems, str(ckpt))
    if meta is not None:
        check_compatible(manifest, meta, ckpt)
    problems = _file_problems(manifest, where, ckpt, manifest if meta is None else meta)
    if problems:
        raise ConfigError(problems, str(ckpt))
    problems = [f"{ckpt / name}: contents differ from the manifest's SHA-256 (modified or truncated)"
                for name, digest in manifest["files"].items() if _verified_sha256(ckpt / name) != digest]
    if problems:
        raise ConfigError(problems, str(ckpt))
    return manifest


def check_pickles(ckpt: Path) -> None:
    """Open every DeepSpeed ``.pt`` file with ``weights_only=True`` (tensors, containers and
    DeepSpeed's few data classes only): a file that would run code or build arbitrary objects
    on unpickling is refused before DeepSpeed opens it (the allowed classes:
    `ds_internals.PICKLED_CLASSES`)."""
    allowed = ds_internals.pickled_classes()
    for path in sorted(ckpt.rglob("*.pt")):
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any refusal is a refusal
            raise ConfigError([f"{path}: refused by torch.load(weights_only=True): "
                               f"{str(exc).splitlines()[0][:300]}"]) from exc


def check_compatible(manifest: dict, meta: dict, ckpt: Path) -> None:
    """The checkpoint was written for this model: same tables (rows x dim), fields and dense
    parameter shapes."""
    problems = []
    saved, built = manifest.get("tables") or {}, meta.get("tables") or {}
    for name in sorted(set(saved) & set(built)):
        kinds = ["dynamic" if v[0] == "dynamic" else "static" for v in (saved[name], built[name])]
        if kinds[0] != kinds[1]:
            problems.append(f"table {name!r}: the checkpoint holds a {kinds[0]} table, the config builds "
                            f"a {kinds[1]} one; set embedding.tables.{name}.kind: {kinds[0]} to resume "
                            "it, or start a fresh run")
    for key in ("tables", "fields", "dense_shapes", "algorithm"):
        if manifest.get(key) != meta.get(key):
            problems.append(f"{key}: checkpoint has {manifest.get(key)!r}, the config builds {meta.get(key)!r}")
    if problems:
        raise ConfigError(problems, f"{ckpt / MANIFEST} (the run config does not match the checkpoint)")


def verify(ckpt: Path, meta: dict) -> dict:
    """Model match, hashes bounded by what a save of ``meta``'s model writes, and safe pickles;
    returns the manifest (no state is loaded)."""
    manifest = read_manifest(ckpt, meta)
    check_pickles(ckpt)
    return manifest
