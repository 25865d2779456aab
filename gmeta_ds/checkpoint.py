"""Checkpoints: DeepSpeed's own for the dense state, ours for sharded embeddings and the trainer.

Layout under ``OUTPUT_DIR/checkpoints``::

    step_00000040/                      one checkpoint (the tag)
      <DeepSpeed's files>               engine.save_checkpoint: dense weights, optimizer (ZeRO
                                        partitions), loss scaler
      dense.safetensors                 rank 0: the dense module's weights (export, no DeepSpeed)
      rank00000.safetensors             per rank: its embedding rows with their global ids, the
                                        sparse optimizers' per-row state, this rank's RNG states
      manifest.json                     rank 0, last: step, world size, plan, loader position,
                                        the SHA-256 of every file above
    latest                              the tag of the newest complete checkpoint

A checkpoint is complete when its manifest exists: rank 0 writes it after a barrier that every
rank reaches only once its files are on disk, then moves ``latest`` (atomic rename), then the
oldest checkpoints beyond ``train.keep_last`` are removed. A rank that dies mid-save leaves a
directory without a manifest, which loading never picks and the next save removes.

Embedding rows are saved by global id, so a checkpoint loads at any world size and plan
(resharding). Every file is verified against the manifest's hashes before anything is
deserialised, and DeepSpeed's pickled files are first opened with ``weights_only=True``, so a
file crafted to run code on unpickling is refused.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from gmeta_ds.engine import ds_engine, ds_internals
from gmeta_ds.engine.dist import is_collective_timeout, on_wire
from gmeta_ds.engine.ds_engine import save_weights
from gmeta_ds.errors import CheckpointWriteError, ConfigError

FORMAT_VERSION = 1
LATEST = "latest"
# "STEP:RANK": that rank SIGKILLs itself in the middle of saving checkpoint STEP (tests only).
FAULT_ENV = "GMETA_DS_FAULT_KILL_IN_SAVE"
# "STEP": rank 0 fills the output directory's file system just before saving checkpoint STEP,
# so that its writes meet a real ENOSPC (tests only).
FAULT_FILL_ENV = "GMETA_DS_FAULT_FILL_DISK_AT"
MANIFEST = "manifest.json"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def tag_of(step: int) -> str:
    return f"step_{step:08d}"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
    previous = (f"the last complete checkpoint is {root / latest.read_text().strip()} "
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
                        "files": {str(p.relative_to(ckpt)): _sha256(p) for p in files}}
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
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    elif resume == "auto":
        return None
    if not (path / MANIFEST).is_file():
        raise ConfigError([f"train.resume: {str(path)!r} is not a complete checkpoint (no {MANIFEST}; "
                           "expected OUTPUT_DIR/checkpoints or one of its step_* directories)"])
    return path


def read_manifest(ckpt: Path) -> dict:
    """The manifest, with every listed file present and matching its SHA-256."""
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError([f"{ckpt / MANIFEST}: not valid JSON ({exc.msg})"]) from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ConfigError([f"{ckpt / MANIFEST}: expected a JSON object with a 'files' mapping "
                           f"(file -> SHA-256), got {type(manifest).__name__}"])
    if manifest.get("format") != FORMAT_VERSION:
        raise ConfigError([f"{ckpt / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT_VERSION}"])
    problems = []
    for name, digest in manifest["files"].items():
        path = ckpt / name
        if not path.is_file():
            problems.append(f"{path}: listed in the manifest but missing")
        elif _sha256(path) != digest:
            problems.append(f"{path}: contents differ from the manifest's SHA-256 (modified or truncated)")
    unlisted = [p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST
                and str(p.relative_to(ckpt)) not in manifest["files"]]
    problems += [f"{p}: not part of the checkpoint (not in the manifest)" for p in unlisted]
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
    opens them."""
    import subprocess

    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    root = checkpoint_root(output_dir) / "universal"
    target = root / f"{ckpt.name}-{digest}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    failure = ""
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)  # any earlier conversion is never reused
        root.mkdir(parents=True)
        tmp = root / (target.name + ".tmp")
        done = subprocess.run(ds_internals.universal_conversion_command(ckpt, tmp),
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            failure = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            failure = failure[0]
        else:
            os.replace(tmp, target)
    flag = on_wire(torch.tensor([1.0 if failure else 0.0]))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag)
    if flag.item():
        raise RuntimeError(f"converting {ckpt} to a universal checkpoint failed: {failure or 'on rank 0'}")
    check_pickles(target)
    return target


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
