import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Every subprocess of the suite sees the same PATH, this venv's bin first (gmeta-ds, deepspeed,
# torchrun, accelerate, ninja): DeepSpeed's JIT-built CPU ops (Adam) are rebuilt (~40 s at
# 2 cores) whenever PATH differs between runs.
_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")


def pytest_sessionfinish(session, exitstatus):
    """The warm rank pool (tests/pool.py) ends with the session."""
    from pool import close_pool

    close_pool()
