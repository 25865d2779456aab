"""File helpers every layer shares (no torch): one atomic JSON write, and what a path that
should be a regular file is instead."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` as indented JSON, atomically (a temporary file beside it,
    then renamed): a reader, or a process killed mid-write, never sees a half-written file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def not_a_file(path: Path) -> str | None:
    """None when ``path`` is a regular file holding bytes; else what it is, as an error
    message says it: missing, a dangling symbolic link, a folder, a device, pipe or socket
    (``/dev/null``), a virtual file whose size reads 0 (``/proc``, ``/sys``), or empty."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        return "is a symbolic link to a missing file" if path.is_symlink() else "does not exist"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISDIR(info.st_mode):
        return "is a folder"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file (a device, pipe or socket, like /dev/null)"
    if info.st_size == 0:
        try:
            with open(path, "rb") as f:
                virtual = bool(f.read(1))
        except OSError:
            virtual = False
        return ("is a virtual file (its size reads 0, as in /proc or /sys), not a file on disk" if virtual
                else "is empty")
    return None


def data_file_problem(what: str) -> str:
    """`not_a_file`'s answer as the data readers word it ("file does not exist", "a folder,
    expected a file", "file is empty"; the others as they are, ending in what is expected)."""
    worded = {"does not exist": "file does not exist", "is a folder": "a folder, expected a file",
              "is empty": "file is empty"}
    return worded.get(what, f"{what}; expected a CSV or Parquet file on disk")


def not_a_directory(target: Path, found: Path) -> str:
    """Why ``target`` cannot be made a directory, ``found`` being it or its nearest parent
    that exists (as a link or otherwise) and is no directory: a file, or a dangling link."""
    if found.is_symlink() and not found.exists():
        where = "is" if found == target else f"is under {str(found)!r},"
        return f"{where} a symbolic link to {os.readlink(found)!r}, which does not exist"
    return "exists and is not a directory" if found == target else f"is under {str(found)!r}, a file"
