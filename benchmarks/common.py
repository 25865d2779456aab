"""Helpers shared by the benchmarks that launch real processes (memory.py, overlap.py)."""
from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's deepspeed / gmeta-ds sit next to its python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_env(**extra: str) -> dict:
    """This environment with the venv first on PATH (else DeepSpeed JIT-rebuilds its ops)."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra}


class LaunchFailure(RuntimeError):
    """A launched command failed or timed out (the message holds its log's tail)."""


def run_group(cmd: list[str], timeout: float, what: str, env: dict | None = None) -> str:
    """Run ``cmd`` in its own process group (a launcher spawns ranks); kill the whole group on
    timeout; `LaunchFailure` with the log's tail on failure. Returns stdout + stderr."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env or bench_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise LaunchFailure(f"{what} did not finish in {timeout:.0f}s")
    if proc.returncode:
        raise LaunchFailure(f"{what} exited {proc.returncode}:\n{log[-3000:]}")
    return log


def machine() -> dict:
    import torch

    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor())
    return {"cpu": model, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__}
