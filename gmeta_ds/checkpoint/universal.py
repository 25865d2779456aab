"""DeepSpeed's universal checkpoint conversion, isolated: redone on every resume, run by rank 0
in a subprocess from an empty directory, bounded by the process group's timeout."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from gmeta_ds.checkpoint.layout import checkpoint_root
from gmeta_ds.checkpoint.manifest import check_pickles
from gmeta_ds.engine import ds_internals
from gmeta_ds.processes import kill_group
from gmeta_ds.engine.dist import group_timeouts, is_collective_timeout, on_wire
from gmeta_ds.errors import CollectiveTimeout, ConfigError


def to_universal(ckpt: Path, output_dir: str | Path, manifest: dict) -> Path:
    """DeepSpeed's universal checkpoint of ``ckpt`` (ZeRO-1/2 optimizer partitions merged per
    parameter, loadable at any data-parallel size), made by rank 0 with DeepSpeed's own
    ``ds_to_universal`` after `verify`; collective. Returns its directory.

    The conversion is redone on every resume, never reused: DeepSpeed loads its files with
    ``weights_only=False``, so a conversion left on disk (by an earlier resume, of this or of
    another run in the same output directory, or planted) would be trusted without any check.
    It is written under a name tied to the source manifest's SHA-256, into a temporary folder
    renamed into place, and its pickles pass `check_pickles` on every rank before DeepSpeed
    opens them. The converter runs isolated from the working directory (`convert_to_universal`); the
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
        failure = convert_to_universal(ckpt, tmp, limit, timeout_s)
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


def convert_to_universal(ckpt: Path, out: Path, limit_s: float, timeout_s: float | None) -> str:
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
            kill_group(proc)
            bound = ("" if timeout_s is None else
                     f", what train.collective_timeout_s={timeout_s:g} s leaves while the other ranks wait;"
                     " raise it")
            return f"DeepSpeed's universal checkpoint converter did not finish within {limit_s:g} s{bound}"
        finally:
            if proc.poll() is None:
                kill_group(proc)
    if proc.returncode != 0:
        return (output.strip().splitlines()[-1:] or ["(no output)"])[0][:500]
    return ""

