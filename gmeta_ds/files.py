"""File helpers every layer shares (no torch): one atomic JSON write."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` as indented JSON, atomically (a temporary file beside it,
    then renamed): a reader, or a process killed mid-write, never sees a half-written file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
