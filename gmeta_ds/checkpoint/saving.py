"""Saving: every rank's files, then rank 0's manifest and ``latest``; a write that fails on any
rank abandons the checkpoint on every rank with one report."""
from __future__ import annotations

import errno
import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from gmeta_ds.files import write_json
from gmeta_ds.checkpoint.layout import (
    FAULT_ENV, FAULT_FILL_ENV, FORMAT_VERSION, LATEST, MANIFEST, checkpoint_root, tag_of)
from gmeta_ds.checkpoint import manifest as manifest_module
from gmeta_ds.checkpoint.rows import rng_state, shard_state
from gmeta_ds.engine import ds_engine
from gmeta_ds.engine.dist import is_collective_timeout, on_wire
from gmeta_ds.errors import CheckpointWriteError


def _barrier() -> None:
    """Wait for every rank (nothing to wait for without peers)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


_LOW_SPACE = 1 << 20  # bytes: below this after a failed write, the cause is a full disk


def _existing(path: Path) -> Path:
    """``path``, or its nearest existing ancestor (whose disk usage says why a write failed)."""
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
    """Fault injection: grow ``path`` until its file system is full (tests only)."""
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


class _Writes:
    """This rank's writes of checkpoint ``step`` into ``ckpt``: the first failure, as one line
    (`_write_failure`); once one write failed, none is tried after it."""

    def __init__(self, root: Path, ckpt: Path, step: int) -> None:
        self.root, self.ckpt, self.step = root, ckpt, step
        self.failure: str | None = None

    def attempt(self, what: str, write) -> None:
        """Call ``write()`` unless a write failed before; a failure is recorded, naming ``what``."""
        if self.failure is None:
            try:
                write()
            except Exception as exc:  # noqa: BLE001 - any write error becomes one clear report
                self.failure = _write_failure(exc, what, self.ckpt)

    def settle(self) -> None:
        """Collective: when any rank's write failed, every rank abandons the checkpoint (`_abandon`)."""
        failures = _agree(self.failure)
        if failures:
            _abandon(self.root, self.ckpt, self.step, failures)


def save(engine, sharded, loader_state: dict, step: int, output_dir: str | Path, keep_last: int,
         meta: dict, extra: dict | None = None) -> Path:
    """Write checkpoint ``step`` (collective: every rank calls it); returns its directory.
    ``extra``: more tensors for this rank's file (the outer synchronisation's state across sites).

    A write that fails on any rank (disk full, quota, permissions) fails the save on every rank
    with `CheckpointWriteError` naming the rank, the file and the cause; the incomplete
    directory is removed and ``latest`` keeps naming the previous checkpoint."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    root = checkpoint_root(output_dir)
    tag = tag_of(step)
    ckpt = root / tag
    writes = _Writes(root, ckpt, step)
    if os.environ.get(FAULT_FILL_ENV) == str(step) and rank == 0:  # fault injection (tests)
        _fill_disk(Path(output_dir) / ".fault_fill")
    if rank == 0:
        writes.attempt(f"the checkpoint directory {ckpt}", lambda: _fresh_dir(ckpt))
    writes.settle()
    _save_deepspeed(engine, writes, tag)
    _save_own_files(engine, sharded, writes, rank, extra or {})
    if os.environ.get(FAULT_ENV) == f"{step}:{rank}":  # fault injection for the reliability tests
        os.kill(os.getpid(), signal.SIGKILL)
    writes.settle()  # every rank's files are on disk, or every rank knows they are not
    if rank == 0:
        head = {"format": FORMAT_VERSION, "step": step, "world_size": world, "loader": loader_state, **meta}
        writes.attempt(f"{ckpt / MANIFEST} and {root / LATEST}", lambda: _commit(root, ckpt, head))
        if writes.failure is None:
            _prune(root, keep_last, tag)
    writes.settle()
    return ckpt


def _fresh_dir(ckpt: Path) -> None:
    """Create ``ckpt`` empty, removing an incomplete or older copy of the same step."""
    if ckpt.exists():
        shutil.rmtree(ckpt)
    ckpt.mkdir(parents=True)


def _save_deepspeed(engine, writes: _Writes, tag: str) -> None:
    """DeepSpeed's own files (dense weights, ZeRO optimizer partitions, loss scaler); a failed
    write is recorded in ``writes``, a collective timeout raised."""
    try:
        engine.save_checkpoint(str(writes.root), tag=tag, client_state={"gmeta_ds_step": writes.step},
                               save_latest=False)
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, RuntimeError) and is_collective_timeout(exc):
            raise
        writes.failure = _write_failure(exc, f"DeepSpeed's checkpoint files in {writes.ckpt}", writes.ckpt)
        # DeepSpeed's save ends in a barrier after its writes, which the other ranks have
        # reached or will reach: meet them there, then report at the agreement below.
        _barrier()


def _save_own_files(engine, sharded, writes: _Writes, rank: int, extra: dict) -> None:
    """This rank's ``rankNNNNN.safetensors`` (embedding rows, sparse-optimizer and RNG state)
    and, on rank 0, ``dense.safetensors`` (collective under ZeRO-3)."""
    from safetensors.torch import save_file

    own = {**shard_state(sharded), **rng_state(), **extra}
    own_file = writes.ckpt / f"rank{rank:05d}.safetensors"
    writes.attempt(str(own_file), lambda: save_file({k: v.contiguous() for k, v in own.items()}, str(own_file)))
    dense = ds_engine.full_state_dict(engine.module, rank0_only=True)  # collective under ZeRO-3
    if rank == 0:
        dense_file = writes.ckpt / "dense.safetensors"
        writes.attempt(str(dense_file), lambda: save_file(
            {k: v.float().contiguous().cpu() for k, v in dense.items()}, str(dense_file)))


def _commit(root: Path, ckpt: Path, head: dict) -> None:
    """Rank 0, last: the manifest (``head`` with the SHA-256 and size of every file written),
    then ``latest`` moved to this checkpoint (atomic rename)."""
    sha256 = manifest_module.sha256  # looked up per call: tests count the files hashed
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    manifest = {**head,
                "files": {p.relative_to(ckpt).as_posix(): sha256(p) for p in files},
                "sizes": {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in files}}
    write_json(ckpt / MANIFEST, manifest)
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(ckpt.name + "\n")
    os.replace(tmp, root / LATEST)


def _prune(root: Path, keep_last: int, newest: str) -> None:
    """Remove incomplete checkpoints and complete ones beyond the newest ``keep_last``."""
    complete = sorted(p for p in root.glob("step_*") if (p / MANIFEST).is_file())
    for path in root.glob("step_*"):
        if path.name != newest and not (path / MANIFEST).is_file():
            shutil.rmtree(path, ignore_errors=True)
    if keep_last > 0:
        for path in complete[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)

