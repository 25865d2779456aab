"""Checkpoints: DeepSpeed's own for the dense state, ours for sharded embeddings and the trainer.

Layout under ``OUTPUT_DIR/checkpoints``::

    step_00000040/                      one checkpoint (the tag)
      <DeepSpeed's files>               engine.save_checkpoint: dense weights, optimizer (ZeRO
                                        partitions), loss scaler
      dense.safetensors                 rank 0: the dense module's weights (export, no DeepSpeed)
      rank00000.safetensors             per rank: its embedding rows with their global ids, the
                                        sparse optimizers' per-row state, this rank's RNG states
      manifest.json                     rank 0, last: step, world size, plan, loader position,
                                        the SHA-256 and size of every file above
    latest                              the tag of the newest complete checkpoint

A checkpoint is complete when its manifest exists: rank 0 writes it after a barrier that every
rank reaches only once its files are on disk, then moves ``latest`` (atomic rename), then the
oldest checkpoints beyond ``train.keep_last`` are removed. A rank that dies mid-save leaves a
directory without a manifest, which loading never picks and the next save removes.

Embedding rows are saved by global id, so a checkpoint loads at any world size and plan
(resharding). Every file is verified against the manifest's hashes before anything is
deserialised, and DeepSpeed's pickled files are first opened with ``weights_only=True``, so a
file crafted to run code on unpickling is refused. Before any file is hashed, the manifest's
keys are type-checked, its files must be exactly the regular files inside the checkpoint
directory (no absolute path, no ``..``, no symbolic link, nothing unlisted) with the sizes it
records, and ``latest`` must name a ``step_*`` directory of its own folder: a damaged or
forged manifest is a `ConfigError` naming the file and the key, and hashing costs no more
than reading the checkpoint itself.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path, PurePosixPath

import numpy as np
import torch
import torch.distributed as dist

from gmeta_ds.engine import ds_engine, ds_internals
from gmeta_ds.engine.dist import group_timeouts, is_collective_timeout, on_wire
from gmeta_ds.engine.ds_engine import save_weights
from gmeta_ds.errors import CheckpointWriteError, CollectiveTimeout, ConfigError

FORMAT_VERSION = 1
LATEST = "latest"
# "STEP:RANK": that rank SIGKILLs itself in the middle of saving checkpoint STEP (tests only).
FAULT_ENV = "GMETA_DS_FAULT_KILL_IN_SAVE"
# "STEP": rank 0 fills the output directory's file system just before saving checkpoint STEP,
# so that its writes meet a real ENOSPC (tests only).
FAULT_FILL_ENV = "GMETA_DS_FAULT_FILL_DISK_AT"
MANIFEST = "manifest.json"
TAG = re.compile(r"step_[0-9]{8,20}")  # what `tag_of` writes, and all `latest` may name
MANIFEST_MAX_BYTES = 64 << 20  # far above any real manifest (a few KiB per thousand parameters)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def tag_of(step: int) -> str:
    return f"step_{step:08d}"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _sha256(path: Path) -> str:
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
    info = os.stat(path, follow_symlinks=False)
    key = (os.path.realpath(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns,
           info.st_ctime_ns)
    if key not in _HASHED:
        _HASHED[key] = _sha256(path)
    return _HASHED[key]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- per-rank state
def _rng_state() -> dict[str, torch.Tensor]:
    state = {"rng.torch": torch.get_rng_state()}
    np_state = np.random.get_state()
    state["rng.numpy.keys"] = torch.from_numpy(np_state[1].astype(np.int64))
    state["rng.numpy.pos"] = torch.tensor([np_state[2]], dtype=torch.int64)
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["rng.torch"])
    np.random.set_state(("MT19937", state["rng.numpy.keys"].numpy().astype(np.uint32),
                         int(state["rng.numpy.pos"][0]), 0, 0.0))


def table_meta(sharded) -> dict[str, list]:
    """Per table what a checkpoint must match: [rows, dim] (static), ["dynamic", dim]."""
    if sharded is None:
        return {}
    return {n: ["dynamic" if p.kind == "dynamic" else p.table.num_rows, p.table.dim]
            for n, p in sharded.plan.tables.items()}


def shard_state(sharded) -> dict[str, torch.Tensor]:
    """This rank's embedding rows (with global ids) and sparse-optimizer state, flat; dynamic
    tables the rows of their admitted ids, plus their default row and map (`_dynamic_state`)."""
    out: dict[str, torch.Tensor] = {}
    if sharded is None:
        return out
    for name, param in sharded.shards.items():
        plan = sharded.plan.tables[name]
        if plan.kind == "dynamic":
            out.update(_dynamic_state(sharded, name))
            continue
        out[f"table.{name}.ids"] = plan.global_ids(sharded.rank).to(torch.int64)
        out[f"table.{name}.rows"] = param.detach().cpu().clone()
        per_row, scalars = _optimizer_state(sharded, name)
        out.update({f"table.{name}.row_state.{k}": v.cpu().clone() for k, v in per_row.items()})
        out.update(scalars)
    return out


def _optimizer_state(sharded, name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A table's sparse-optimizer state: ({key: per-row tensor}, {``table.<name>.scalar_state.<key>``:
    its value as a float64 tensor})."""
    param = sharded.shards[name]
    per_row, scalars = {}, {}
    for key, value in sharded.optimizers[name].state.get(param, {}).items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == param.shape[0]:
            per_row[key] = value.detach()
        elif value is not None:
            scalars[f"table.{name}.scalar_state.{key}"] = torch.tensor([float(value)], dtype=torch.float64)
    return per_row, scalars


def _dynamic_state(sharded, name: str) -> dict[str, torch.Tensor]:
    """A dynamic table's admitted ids with their rows and optimizer state (``table.<name>.*``,
    as static tables), its default row (``dynamic.<name>.default*``) and its map: rows, last
    use, uses, clock, counters and admission sketch (``dynamic.<name>.*``)."""
    param, index = sharded.shards[name], sharded.dynamic[name]
    slots = index.rows
    out = {f"table.{name}.ids": index.keys.cpu().clone(),
           f"table.{name}.rows": param.detach()[slots].cpu(),
           f"dynamic.{name}.default": param.detach()[:1].cpu()}
    per_row, scalars = _optimizer_state(sharded, name)
    for key, value in per_row.items():
        out[f"table.{name}.row_state.{key}"] = value[slots].cpu()
        out[f"dynamic.{name}.default_state.{key}"] = value[:1].cpu()
    out.update(scalars)
    out.update({f"dynamic.{name}.{k}": v.cpu() for k, v in index.state().items() if k != "ids"})
    out[f"dynamic.{name}.capacity"] = torch.tensor([index.capacity])
    return out


def _load_dynamic(sharded, name: str, files: list[dict[str, torch.Tensor]]) -> None:
    """Refill a dynamic table from every saved rank: this rank takes the ids it owns at its
    world size. At the saving world size and capacity everything comes back as it was (rows,
    map, sketch, counters); elsewhere ids get rows in order (the most recently or frequently
    used kept if they exceed the capacity), the default row and its optimizer state are the
    mean of the saved ones, the sketches (same capacity) are summed and counters restart."""
    from gmeta_ds.embedding.dynamic import owner_of

    param, index, plan = sharded.shards[name], sharded.dynamic[name], sharded.plan.tables[name]
    for f in files:
        if f"dynamic.{name}.default" not in f:
            raise ConfigError([f"checkpoint table {name!r} is not dynamic; the config makes it "
                               f"dynamic (embedding.tables.{name}.kind)"])
        if f[f"dynamic.{name}.default"].shape[1] != plan.table.dim:
            raise ConfigError([f"checkpoint table {name!r} has rows of dimension "
                               f"{f[f'dynamic.{name}.default'].shape[1]}; the config builds {plan.table.dim}"])
    same = (len(files) == sharded.world and
            all(int(f[f"dynamic.{name}.capacity"][0]) == index.capacity for f in files))
    key = lambda k: f"dynamic.{name}.{k}"  # noqa: E731
    parts = {k: [] for k in ("ids", "rows", "last_used", "uses", "slots")}
    state_keys = sorted({k for f in files for k in f if k.startswith(f"table.{name}.row_state.")})
    states = {k: [] for k in state_keys}
    for f in files:
        ids = f[f"table.{name}.ids"]
        mine = owner_of(ids, sharded.world) == sharded.rank
        parts["ids"].append(ids[mine])
        parts["rows"].append(f[f"table.{name}.rows"][mine])
        parts["last_used"].append(f[key("last_used")][mine])
        parts["uses"].append(f[key("uses")][mine])
        parts["slots"].append(f[key("rows")][mine])
        for k in state_keys:
            states[k].append(f[k][mine])
    joined = {k: torch.cat(v) for k, v in parts.items()}
    own = files[sharded.rank] if same else None
    counters = ({k: int(v) for k, v in zip(sorted(index.counters), own[key("counters")].tolist())}
                if same else {k: 0 for k in index.counters})
    sketch = own.get(key("sketch")) if same else None
    if not same and index.sketch is not None:
        saved = [f[key("sketch")] for f in files if key("sketch") in f]
        if saved and all(s.shape == index.sketch.shape for s in saved):
            sketch = torch.stack(saved).sum(0).clamp(max=2**31 - 1).int()
    kept = index.restore(joined["ids"].to(index.keys.device), joined["slots"].to(index.keys.device) if same else None,
                         joined["last_used"].to(index.keys.device), joined["uses"].to(index.keys.device),
                         max(int(f[key("clock")][0]) for f in files),
                         sketch.to(index.keys.device) if sketch is not None else None, counters)
    kept = kept.cpu()
    default = own[key("default")] if same else torch.stack([f[key("default")] for f in files]).mean(0)
    with torch.no_grad():
        param.zero_()
        param[:1] = default.to(param.device)
        param[index.rows] = joined["rows"][kept].to(param.device)
    optimizer = sharded.optimizers[name]
    state = optimizer.state[param]
    for k in state_keys:
        short = k[len(f"table.{name}.row_state."):]
        saved_default = [f[key(f"default_state.{short}")] for f in files]
        value = torch.zeros((param.shape[0], *saved_default[0].shape[1:]), dtype=saved_default[0].dtype)
        value[:1] = saved_default[sharded.rank] if same else torch.stack(saved_default).mean(0)
        value[index.rows.cpu()] = torch.cat(states[k])[kept]
        state[short] = value.to(param.device)
    _restore_scalars(state, name, files)


def _restore_scalars(state: dict, name: str, files: list[dict[str, torch.Tensor]]) -> None:
    """Lazy optimizers count steps per shard; after resharding take the largest."""
    scalar_state: dict[str, float] = {}
    prefix = f"table.{name}.scalar_state."
    for f in files:
        for key in [k for k in f if k.startswith(prefix)]:
            short = key[len(prefix):]
            scalar_state[short] = max(scalar_state.get(short, 0.0), float(f[key][0]))
    for key, value in scalar_state.items():
        old = state.get(key)
        if torch.is_tensor(old):
            state[key] = torch.tensor(value, dtype=old.dtype, device=old.device)
        elif isinstance(old, int) or key == "step":  # a lazy optimizer's counter (SparseAdam's int step)
            state[key] = int(value)
        else:
            state[key] = torch.tensor(value)


def load_shard_state(sharded, files: list[dict[str, torch.Tensor]]) -> None:
    """Fill this rank's rows and optimizer state from every saved rank's file (any old world
    size or plan): each row comes from the file that holds its global id."""
    for name, param in sharded.shards.items():
        plan = sharded.plan.tables[name]
        if plan.kind == "dynamic":
            _load_dynamic(sharded, name, files)
            continue
        mine = plan.global_ids(sharded.rank)
        position = torch.full((plan.table.num_rows,), -1, dtype=torch.int64)
        position[mine] = torch.arange(len(mine))
        rows = torch.empty_like(param.data)
        filled = torch.zeros(len(mine), dtype=torch.bool)
        row_state: dict[str, torch.Tensor] = {}
        for f in files:
            if f"table.{name}.ids" not in f:
                raise ConfigError([f"checkpoint has no embedding table {name!r}"])
            if f"dynamic.{name}.default" in f:
                raise ConfigError([f"checkpoint table {name!r} is dynamic; the config makes it static "
                                   f"(set embedding.tables.{name}.kind: dynamic to resume it)"])
            ids = f[f"table.{name}.ids"]
            saved = f[f"table.{name}.rows"]
            if saved.shape[1:] != param.shape[1:] or (len(ids) and int(ids.max()) >= plan.table.num_rows):
                raise ConfigError([f"checkpoint table {name!r} has rows of shape {tuple(saved.shape[1:])} "
                                   f"and ids up to {int(ids.max()) if len(ids) else -1}; the config "
                                   f"builds {plan.table.num_rows} x {plan.table.dim}"])
            where = position[ids]
            keep = where >= 0
            rows[where[keep]] = saved[keep]
            filled[where[keep]] = True
            prefix = f"table.{name}.row_state."
            for key in [k for k in f if k.startswith(prefix)]:
                value = f[key]
                state = row_state.setdefault(key[len(prefix):], torch.zeros((len(mine), *value.shape[1:]),
                                                                          dtype=value.dtype))
                state[where[keep]] = value[keep]
        if not bool(filled.all()):
            raise ConfigError([f"checkpoint is missing {int((~filled).sum())} row(s) of table {name!r}"])
        with torch.no_grad():
            param.copy_(rows)
        optimizer = sharded.optimizers[name]
        state = optimizer.state[param]
        for key, value in row_state.items():
            state[key] = value.to(param.device)
        _restore_scalars(state, name, files)


# ---------------------------------------------------------------------------- save
_LOW_SPACE = 1 << 20  # bytes: below this after a failed write, the cause is a full disk


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _write_failure(exc: BaseException, what: str, where: Path) -> str:
    """One line naming this rank, the file and the cause of a failed write. torch.save reports
    a full disk as ``enforce fail ... unexpected pos``, so a disk with under 1 MiB free after
    the failure is reported as full whatever the exception says."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    try:
        usage = shutil.disk_usage(_existing(where))
        free = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
        low = usage.free < _LOW_SPACE
    except OSError:
        free, low = "free space unknown", False
    full = (getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text
            or "os error 28" in text or "os error 122" in text or low)
    cause = f"no space left on the device ({free})" if full else f"{type(exc).__name__}: {text} ({free})"
    return f"rank {rank}: could not write {what}: {cause}"


def _agree(failure: str | None) -> list[str]:
    """Collective: every rank's write failures (one line each), the same list on every rank;
    empty when every rank's writes succeeded. Also serves as the barrier of that point."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [failure] if failure else []
    flag = on_wire(torch.tensor([1 if failure else 0], dtype=torch.int64))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag[0]):
        return []
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failure)
    return [f for f in gathered if f]


def _abandon(root: Path, ckpt: Path, step: int, failures: list[str]) -> None:
    """Every rank: remove the incomplete checkpoint (rank 0; its manifest first, so it can
    never pass for complete) and raise `CheckpointWriteError` with every rank's failure."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        (ckpt / MANIFEST).unlink(missing_ok=True)
        (root / (LATEST + ".tmp")).unlink(missing_ok=True)
        shutil.rmtree(ckpt, ignore_errors=True)
    latest = root / LATEST
    previous = (f"the last complete checkpoint is {root / latest.read_text(errors='replace').strip()[:80]} "
                f"({latest} still names it)") if latest.is_file() else "no earlier checkpoint exists"
    raise CheckpointWriteError(
        f"checkpoint step {step} could not be written under {root}:\n  "
        + "\n  ".join(failures)
        + f"\nthe incomplete checkpoint {ckpt.name} was removed; {previous}. Free space (or "
        "lower train.keep_last) and resume with train.resume=auto")


def _fill_disk(path: Path) -> None:
    with open(path, "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 65536):
                pass
        except OSError:  # ENOSPC: full
            pass
        try:
            while f.write(b"\0"):
                pass
        except OSError:
            pass


def save(engine, sharded, loader_state: dict, step: int, output_dir: str | Path, keep_last: int,
         meta: dict) -> Path:
    """Write checkpoint ``step`` (collective: every rank calls it); returns its directory.

    A write that fails on any rank (disk full, quota, permissions) fails the save on every rank
    with `CheckpointWriteError` naming the rank, the file and the cause; the incomplete
    directory is removed and ``latest`` keeps naming the previous checkpoint."""
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    root = checkpoint_root(output_dir)
    tag = tag_of(step)
    ckpt = root / tag
    failure: str | None = None
    if os.environ.get(FAULT_FILL_ENV) == str(step) and rank == 0:  # fault injection (tests)
        _fill_disk(Path(output_dir) / ".fault_fill")

    def attempt(what: str, write) -> None:
        nonlocal failure
        if failure is None:
            try:
                write()
            except Exception as exc:  # noqa: BLE001 - any write error becomes one clear report
                failure = _write_failure(exc, what, ckpt)

    if rank == 0:
        def fresh_dir() -> None:
            if ckpt.exists():  # an incomplete or older copy of the same step
                shutil.rmtree(ckpt)
            ckpt.mkdir(parents=True)
        attempt(f"the checkpoint directory {ckpt}", fresh_dir)
    failures = _agree(failure)
    if failures:
        _abandon(root, ckpt, step, failures)
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state={"gmeta_ds_step": step},
                               save_latest=False)
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, RuntimeError) and is_collective_timeout(exc):
            raise
        failure = _write_failure(exc, f"DeepSpeed's checkpoint files in {ckpt}", ckpt)
        # DeepSpeed's save ends in a barrier after its writes, which the other ranks have
        # reached or will reach: meet them there, then report at the agreement below.
        _barrier()
    own = {**shard_state(sharded), **_rng_state()}
    own_file = ckpt / f"rank{rank:05d}.safetensors"
    attempt(str(own_file), lambda: save_file({k: v.contiguous() for k, v in own.items()}, str(own_file)))
    dense = ds_engine.full_state_dict(engine.module, rank0_only=True)  # collective under ZeRO-3
    if rank == 0:
        dense_file = ckpt / "dense.safetensors"
        attempt(str(dense_file), lambda: save_file(
            {k: v.float().contiguous().cpu() for k, v in dense.items()}, str(dense_file)))
    if os.environ.get(FAULT_ENV) == f"{step}:{rank}":  # fault injection for the reliability tests
        os.kill(os.getpid(), signal.SIGKILL)
    failures = _agree(failure)  # every rank's files are on disk, or every rank knows they are not
    if failures:
        _abandon(root, ckpt, step, failures)
    if rank == 0:
        def commit() -> None:
            files = sorted(p for p in ckpt.rglob("*") if p.is_file())
            manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world,
                        "loader": loader_state, **meta,
                        "files": {p.relative_to(ckpt).as_posix(): _sha256(p) for p in files},
                        "sizes": {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in files}}
            _write_json(ckpt / MANIFEST, manifest)
            tmp = root / (LATEST + ".tmp")
            tmp.write_text(tag + "\n")
            os.replace(tmp, root / LATEST)
        attempt(f"{ckpt / MANIFEST} and {root / LATEST}", commit)
        if failure is None:
            _prune(root, keep_last, tag)
    failures = _agree(failure)
    if failures:
        _abandon(root, ckpt, step, failures)
    return ckpt


def _prune(root: Path, keep_last: int, newest: str) -> None:
    """Remove incomplete checkpoints and complete ones beyond the newest ``keep_last``."""
    complete = sorted(p for p in root.glob("step_*") if (p / MANIFEST).is_file())
    for path in root.glob("step_*"):
        if path.name != newest and not (path / MANIFEST).is_file():
            shutil.rmtree(path, ignore_errors=True)
    if keep_last > 0:
        for path in complete[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- load
def find(resume: str, output_dir: str | Path) -> Path | None:
    """The checkpoint directory ``train.resume`` names: ``auto`` = the run's ``latest`` (None
    when there is none yet), a checkpoints root (its ``latest``), or one checkpoint directory."""
    path = checkpoint_root(output_dir) if resume == "auto" else Path(resume)
    if os.path.lexists(path / LATEST):
        path = _latest(path)
    elif resume == "auto":
        return None
    if not (path / MANIFEST).is_file():
        raise ConfigError([f"train.resume: {str(path)!r} is not a complete checkpoint (no {MANIFEST}; "
                           "expected OUTPUT_DIR/checkpoints or one of its step_* directories)"])
    return path


def _latest(root: Path) -> Path:
    """The checkpoint directory ``root/latest`` names: one line ``step_NNNNNNNN``, a real
    directory of ``root`` (never a path elsewhere, a link, or undecodable bytes)."""
    latest = root / LATEST
    expected = f"expected one line naming a step_* directory of {root} (as gmeta-ds writes it)"
    if latest.is_symlink() or not latest.is_file():
        raise ConfigError([f"{latest}: a symbolic link or not a regular file; {expected}"])
    with open(latest, "rb") as f:
        raw = f.read(256)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError([f"{latest}: not text (undecodable bytes); {expected}"]) from None
    if not TAG.fullmatch(tag):
        shown = repr(tag[:60]) if tag else "empty"
        raise ConfigError([f"{latest}: {shown} is not a checkpoint tag; {expected}"])
    path = root / tag
    if path.is_symlink():
        raise ConfigError([f"{latest}: names {path}, a symbolic link; {expected}"])
    return path


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value, minimum: int) -> bool:
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
    return (isinstance(value, list) and len(value) == 2 and (value[0] == "dynamic" or _is_int(value[0], 1))
            and _is_int(value[1], 1))


def _is_loader(value) -> bool:
    # next_step / tasks / step (a position or count) and seed, where a loader saved them
    return isinstance(value, dict) and all(
        _is_int(value[k], 0) for k in ("next_step", "tasks", "step") if k in value) and (
        "seed" not in value or _is_int(value["seed"], -2**63))


# key -> (check, what is expected): the manifest keys a resume or an export reads.
_KEYS = {
    "step": (lambda v: _is_int(v, 0), "an integer >= 0 (the meta-step)"),
    "world_size": (lambda v: _is_int(v, 1), "an integer >= 1"),
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


def _file_problems(manifest: dict, where: Path, ckpt: Path) -> list[str]:
    """The manifest's files and sizes against the checkpoint directory: every name a relative
    path inside it, exactly the regular files found there (no link, nothing else), each of the
    recorded size, and every rank's file and ``dense.safetensors`` among them."""
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
    return problems


def read_manifest(ckpt: Path) -> dict:
    """The manifest, with every listed file present and matching its SHA-256.

    Checked before any file is hashed, each failure a `ConfigError` naming the file and the
    key: the manifest's keys and types (`_KEYS`), then its files: relative paths inside
    ``ckpt``, exactly the regular files there (a symbolic link or an unlisted file is
    refused), of the sizes it records (manifests written before sizes were recorded are
    checked by hash alone). So a manifest cannot make a resume read anything but the
    checkpoint's own files, and never more bytes than they hold."""
    where = ckpt / MANIFEST
    manifest = _load_manifest(where)
    problems = _key_problems(manifest, where)
    if problems:
        raise ConfigError(problems, str(ckpt))
    problems = _file_problems(manifest, where, ckpt)
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
    """Hashes, model match and safe pickles; returns the manifest (no state is loaded)."""
    manifest = read_manifest(ckpt)
    check_compatible(manifest, meta, ckpt)
    check_pickles(ckpt)
    return manifest


def to_universal(ckpt: Path, output_dir: str | Path, manifest: dict) -> Path:
    """DeepSpeed's universal checkpoint of ``ckpt`` (ZeRO-1/2 optimizer partitions merged per
    parameter, loadable at any data-parallel size), made by rank 0 with DeepSpeed's own
    ``ds_to_universal`` after `verify`; collective. Returns its directory.

    The conversion is redone on every resume, never reused: DeepSpeed loads its files with
    ``weights_only=False``, so a conversion left on disk (by an earlier resume, of this or of
    another run in the same output directory, or planted) would be trusted without any check.
    It is written under a name tied to the source manifest's SHA-256, into a temporary folder
    renamed into place, and its pickles pass `check_pickles` on every rank before DeepSpeed
    opens them. The converter runs isolated from the working directory (`_convert`); the
    other ranks wait for it in one all-reduce, so rank 0 gives the converter less than the
    process group's timeout and every rank's error says what it waited for."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    root = checkpoint_root(output_dir) / "universal"
    target = root / f"{ckpt.name}-{digest}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    timeout_s = _group_timeout_s()
    failure = ""
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)  # any earlier conversion is never reused
        root.mkdir(parents=True)
        tmp = root / (target.name + ".tmp")
        # Leave the waiting ranks time to hear of a failure before their all-reduce gives up.
        limit = 3600.0 if timeout_s is None else max(1.0, timeout_s - min(30.0, timeout_s / 5))
        failure = _convert(ckpt, tmp, limit, timeout_s)
        if failure:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, target)
    flag = on_wire(torch.tensor([1.0 if failure else 0.0]))
    if dist.is_initialized() and dist.get_world_size() > 1:
        try:
            dist.all_reduce(flag)
        except RuntimeError as exc:
            if not is_collective_timeout(exc):
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise CollectiveTimeout(
                f"resume from {ckpt}: rank {rank} waited train.collective_timeout_s={timeout_s:g} s for rank "
                "0 to convert its ZeRO partitions (written at another world size) with DeepSpeed's "
                f"universal checkpoint converter, in vain: rank 0 is stuck or gone [{type(exc).__name__}: "
                f"{first}]") from None
    if flag.item():
        raise ConfigError([f"{ckpt}: converting it to a universal checkpoint (its ZeRO optimizer "
                           f"partitions were written at world size {manifest['world_size']}) failed: "
                           f"{failure or 'on rank 0 (its error says why)'}"])
    check_pickles(target)
    return target


def _group_timeout_s() -> float | None:
    """The shortest timeout of this rank's process groups, seconds (None without peers)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    timeouts = [t.total_seconds() for t in group_timeouts().values()]
    return min(timeouts) if timeouts else dist.distributed_c10d.default_pg_timeout.total_seconds()


def _convert(ckpt: Path, out: Path, limit_s: float, timeout_s: float | None) -> str:
    """Run DeepSpeed's ``ds_to_universal`` on ``ckpt`` into ``out``; '' when it succeeded,
    else why not. It runs from an empty directory of its own with ``python -P``
    (`ds_internals.universal_conversion_command`): nothing in the directory the run was started
    from (a planted ``deepspeed/`` package) is imported. Killed, with its workers, after
    ``limit_s`` seconds."""
    command = ds_internals.universal_conversion_command(ckpt, out)
    with tempfile.TemporaryDirectory(prefix="gmeta_ds_convert_") as empty:
        proc = subprocess.Popen(command, cwd=empty, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            bound = ("" if timeout_s is None else
                     f", what train.collective_timeout_s={timeout_s:g} s leaves while the other ranks wait;"
                     " raise it")
            return f"DeepSpeed's universal checkpoint converter did not finish within {limit_s:g} s{bound}"
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    if proc.returncode != 0:
        return (output.strip().splitlines()[-1:] or ["(no output)"])[0][:500]
    return ""


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s session (the converter and its worker processes) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass
    proc.communicate()


def load(ckpt: Path, manifest: dict, engine, sharded, universal: Path | None = None) -> dict:
    """Restore dense state (DeepSpeed; from ``universal`` when the world size changed under
    ZeRO-1/2), embedding rows and optimizer state (resharded), RNG; ``manifest`` is what
    `verify` returned for ``ckpt`` (call it first: nothing here re-checks the files). Returns
    the manifest with ``optimizer_restored`` (step and loader position inside)."""
    from safetensors.torch import load_file

    world = dist.get_world_size() if dist.is_initialized() else 1
    same_world = manifest["world_size"] == world
    stage = engine.zero_optimization_stage()
    # ZeRO-1/2 optimizer partitions load directly only at the world size that wrote them;
    # elsewhere from the universal conversion (or weights only without it).
    load_optimizer = same_world or stage == 0 or universal is not None
    source = universal if (universal is not None and not same_world) else ckpt
    path, _ = engine.load_checkpoint(str(source.parent), tag=source.name,
                                     load_optimizer_states=load_optimizer,
                                     load_module_only=not load_optimizer)
    if path is None:
        raise ConfigError([f"{ckpt}: DeepSpeed found no checkpoint to load"])
    files = [load_file(str(ckpt / f"rank{r:05d}.safetensors")) for r in range(manifest["world_size"])]
    if sharded is not None:
        load_shard_state(sharded, files)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if same_world:
        _set_rng_state(files[rank])
    manifest["optimizer_restored"] = load_optimizer
    return manifest


def _export_dynamic(name: str, files: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A dynamic table's `DynamicRows` state from every rank's file: the admitted ids (sorted)
    with their rows, and each rank's default row."""
    ids = torch.cat([f[f"table.{name}.ids"] for f in files])
    rows = torch.cat([f[f"table.{name}.rows"] for f in files])
    order = torch.argsort(ids)
    return {f"net.embedding.dynamic.{name}.ids": ids[order], f"net.embedding.dynamic.{name}.rows": rows[order],
            f"net.embedding.dynamic.{name}.defaults": torch.cat([f[f"dynamic.{name}.default"] for f in files])}


def export(ckpt: Path, out: Path) -> Path:
    """One safetensors file with the dense weights and every full table, under the names of the
    unsharded model (loads without DeepSpeed or a process group)."""
    from safetensors.torch import load_file

    manifest = read_manifest(ckpt)
    state = load_file(str(ckpt / "dense.safetensors"))
    files = [load_file(str(ckpt / f"rank{r:05d}.safetensors")) for r in range(manifest["world_size"])]
    for name, (rows, dim) in manifest.get("tables", {}).items():
        if rows == "dynamic":
            state.update(_export_dynamic(name, files))
            continue
        table = torch.empty(rows, dim)
        seen = torch.zeros(rows, dtype=torch.bool)
        for f in files:
            ids = f[f"table.{name}.ids"]
            table[ids] = f[f"table.{name}.rows"]
            seen[ids] = True
        if not bool(seen.all()):
            raise ConfigError([f"{ckpt}: table {name!r} is missing rows"])
        state[f"net.embedding.weights.{name}"] = table
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_weights(state, out)
