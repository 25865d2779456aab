"""Run a worker function on W real processes (gloo on CPU), with a hard timeout.

Each rank runs ``python -m distributed.workers NAME`` with RANK/WORLD_SIZE/MASTER_* set; the
parent kills every rank when the timeout passes and fails with every rank's output.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: str, world: int, *args: str, timeout: float = 120.0,
              module: str = "distributed.workers") -> list[str]:
    """Run worker ``worker`` (a function of ``module``, whose ``main`` calls it) on ``world``
    ranks; returns each rank's stdout; raises on failure."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(subprocess.Popen([sys.executable, "-m", module, worker, *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"{worker} on {world} ranks did not finish in {timeout}s")
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        detail = "\n".join(f"--- rank {r}\n{out[-3000:]}" for r, out in enumerate(outputs))
        raise AssertionError(f"{worker} failed on ranks {failed}\n{detail}")
    return outputs
