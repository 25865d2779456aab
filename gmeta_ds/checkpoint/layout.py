"""Where checkpoints live and how they are named: the constants of the format, the
checkpoints root, step tags, ``latest`` and `find` (what ``train.resume`` names)."""
from __future__ import annotations

import os
import re
from pathlib import Path

from gmeta_ds.errors import ConfigError

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
    """The folder holding a run's checkpoints and their ``latest``."""
    return Path(output_dir) / "checkpoints"


def tag_of(step: int) -> str:
    """The directory name of checkpoint ``step`` (``step_NNNNNNNN``, sorting by step)."""
    return f"step_{step:08d}"


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
