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


def _keep_out_of_home() -> None:
    """The suite writes no cache into the home folder: task stores (data.cache_dir's default
    follows $XDG_CACHE_HOME), Hugging Face's, matplotlib's and torch.compile's
    (TORCHINDUCTOR_CACHE_DIR, meta.compile) caches go to one folder per session, removed at
    exit. DeepSpeed's JIT-built ops are kept in the checkout's ``.torch_extensions`` (as .ci/run
    does; git ignores it), built once and reused by later sessions (rebuilding them costs ~40 s);
    a TORCH_EXTENSIONS_DIR already set is kept."""
    import atexit
    import shutil
    import tempfile

    if os.environ.get("GMETA_DS_TEST_CACHE"):  # a subprocess of the suite: the session's folder
        return
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(__file__).resolve().parents[1] / ".torch_extensions")
    folder = tempfile.mkdtemp(prefix="gmeta-test-cache-")
    atexit.register(shutil.rmtree, folder, True)
    os.environ.update(GMETA_DS_TEST_CACHE=folder, XDG_CACHE_HOME=folder, HF_HOME=os.path.join(folder, "huggingface"),
                      MPLCONFIGDIR=os.path.join(folder, "matplotlib"),
                      TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"))


_keep_out_of_home()
