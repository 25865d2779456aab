"""Child processes every layer starts (no torch): ending one with everything it started."""
from __future__ import annotations

import os
import signal
import subprocess


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the session ``proc`` leads (started with ``start_new_session=True``: the process
    and its workers or compile jobs) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass
    proc.communicate()
