"""Helpers shared by the benchmarks. Importing this module first (before torch) sets
OMP_WAIT_POLICY=PASSIVE (ranks share cores) and, when gmeta_ds is not installed, puts the
checkout on sys.path."""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's deepspeed / gmeta-ds sit next to its python

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if importlib.util.find_spec("gmeta_ds") is None:  # not installed: run from a checkout
    sys.path.insert(0, str(REPO))


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
            "python": platform.python_version(), "torch": torch.__version__,
            "load_avg_at_end": os.getloadavg()}


def run_ranks(script: str, name: str, world: int, *args: str, timeout: float = 300.0) -> list[dict]:
    """``python script --worker name args`` on ``world`` gloo ranks (see `rank_main`); each
    rank's RESULT dict, sorted by rank. Kills every rank on timeout (`LaunchFailure`)."""
    port, procs = str(free_port()), []
    for rank in range(world):
        env = bench_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, script, "--worker", name, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline, outs = time.monotonic() + timeout, []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        raise LaunchFailure(f"{name} {args} on {world} ranks did not finish in {timeout:.0f}s")
    if any(p.returncode for p in procs):
        detail = "\n".join(f"--- rank {r} (exit {p.returncode})\n{o[-3000:]}"
                           for r, (p, o) in enumerate(zip(procs, outs)))
        raise LaunchFailure(f"{name} {args} failed on {world} ranks\n{detail}")
    results = [json.loads(line[7:]) for o in outs for line in o.splitlines() if line.startswith("RESULT ")]
    return sorted(results, key=lambda r: r["rank"])


def rank_main(workers: dict, name: str, args: list[str]) -> int:
    """One rank of `run_ranks`: join gloo, run ``workers[name](*args)``, print its dict."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    res = workers[name](*args)
    print("RESULT " + json.dumps({"rank": dist.get_rank(), **res}), flush=True)
    dist.barrier()  # gloo aborts a rank that tears down while a peer still talks to it
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 + gloo: finalisation can abort after sharded lookups (tests/distributed)
