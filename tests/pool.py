"""A pool of warm rank processes for the tests that compare W ranks with one process (issue 34).

A 2-rank ``deepspeed`` launch of a tiny training costs about 16 s on 2 cores, nearly all of it
three interpreters importing torch and DeepSpeed; the 4-6 meta-steps under test take about one.
TorchRec tests its sharded modules in a pool of warm processes (``MultiProcessTestBase``); so do
we: up to `MAX_WORLD` long-lived workers (`pool_worker.py`) import everything once, and each job
runs on the first W of them as ranks 0..W-1 of a fresh job, with its own port, environment,
working directory and output files, the process group torn down after it.

What the launchers themselves do (argument parsing, environment, killing a job when a rank
fails, exit codes) stays tested with real launcher subprocesses in ``tests/launch``; jobs here
get the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), or none at W = 1 (a plain ``python`` run) except for ``call`` jobs.

Every wait has a timeout. A job past its timeout, or whose rank failed while others still run
(the launcher would kill them), ends with every worker of the job killed (process group and
all); workers that failed (other than refusing bad input, exit 2) or were left unclean are replaced, and a replaced worker starts
importing at once, in the background.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "pool_worker.py"
MAX_WORLD = 4
JOBS_PER_WORKER = 60      # a worker is replaced after this many jobs (bounds memory growth)
FAILED_RANK_GRACE_S = 15  # how long the other ranks may still take once one rank failed
START_TIMEOUT_S = 120     # imports of a new worker
# Exit codes after which a worker is reused: success, and the CLI's refusal of bad input (exit 2,
# raised before any engine or process group starts). Any other exit replaces the worker.
CLEAN_EXITS = (0, 2)
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK")


class PoolTimeout(AssertionError):
    """A job did not finish within its timeout (its workers were killed)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Result(subprocess.CompletedProcess):
    """Like the launcher's CompletedProcess: the ranks' outputs joined in rank order, and the
    first failing rank's exit code (0 when all succeeded)."""

    def __init__(self, args, codes: list[int | None], outs: list[str], errs: list[str], port: int):
        code = next((c for c in codes if c != 0), 0)
        super().__init__(args, -9 if code is None else code, "".join(outs), "".join(errs))
        self.codes, self.rank_stdout, self.rank_stderr, self.port = codes, outs, errs, port


class _Worker:
    def __init__(self, log: Path):
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-u", "-P", str(WORKER), str(TESTS)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         cwd=TESTS, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.buffer = b""
        self.ready = False
        self.jobs = 0

    def send(self, job: dict) -> None:
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        self.jobs += 1

    def poll_line(self, wait_s: float) -> dict | None:
        """The next reply if one arrives within ``wait_s``; raises EOFError if the worker died."""
        if b"\n" not in self.buffer:
            readable, _, _ = select.select([self.proc.stdout], [], [], max(0.0, wait_s))
            if readable:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise EOFError(f"pool worker {self.proc.pid} exited ({self.proc.wait(10)})")
                self.buffer += chunk
        if b"\n" not in self.buffer:
            return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self, deadline: float) -> None:
        while not self.ready:
            if time.monotonic() > deadline:
                raise PoolTimeout(f"pool worker {self.proc.pid} did not start in time; its log:\n"
                                  f"{self.log.read_text()[-3000:]}")
            reply = self.poll_line(min(1.0, deadline - time.monotonic()))
            self.ready = reply is not None and "ready" in reply

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class RankPool:
    def __init__(self, size: int = MAX_WORLD):
        self.size = size
        self.folder = Path(tempfile.mkdtemp(prefix="gmeta-pool-"))
        self.workers: list[_Worker | None] = [None] * size
        self.started = 0

    def _worker(self, rank: int) -> _Worker:
        worker = self.workers[rank]
        if worker is None or worker.proc.poll() is not None or worker.jobs >= JOBS_PER_WORKER:
            if worker is not None:
                worker.kill()
            self.started += 1
            worker = self.workers[rank] = _Worker(self.folder / f"worker{rank}.{self.started}.log")
        return worker

    def warm(self, world: int) -> None:
        """Start the first ``world`` workers now (they import while the caller does other work)."""
        for rank in range(world):
            self._worker(rank)

    def _replace(self, ranks) -> None:
        for rank in ranks:
            if self.workers[rank] is not None:
                self.workers[rank].kill()
                self.workers[rank] = None
        self.warm(max(ranks, default=-1) + 1)

    def run(self, job: dict, world: int, env: dict | None = None, cwd: Path | str | None = None,
            timeout: float = 240.0, label: str = "") -> Result:
        """Run ``job`` (see pool_worker.py) as ranks 0..world-1; returns their joined outputs."""
        if not 1 <= world <= self.size:
            raise ValueError(f"world {world}: the pool has {self.size} workers")
        deadline = time.monotonic() + timeout
        workers = [self._worker(rank) for rank in range(world)]
        for worker in workers:
            worker.wait_ready(time.monotonic() + START_TIMEOUT_S)
        port = str(free_port())
        jobdir = Path(tempfile.mkdtemp(prefix="job-", dir=self.folder))
        for rank, worker in enumerate(workers):
            ranks = {} if world == 1 and job["kind"] != "call" else {
                "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            worker.send({**job, "env": {"PYTHONUNBUFFERED": "1", **(env or {}), **ranks},
                         "unset": [k for k in RANK_VARS if k not in ranks],
                         "cwd": str(cwd or Path.cwd()),
                         "stdout": str(jobdir / f"{rank}.out"), "stderr": str(jobdir / f"{rank}.err")})
        replies: list[dict | None] = [None] * world
        failed_at = None
        try:
            while any(r is None for r in replies):
                now = time.monotonic()
                if now > deadline or (failed_at is not None and now > failed_at + FAILED_RANK_GRACE_S):
                    break
                for rank, worker in enumerate(workers):
                    if replies[rank] is None:
                        try:
                            replies[rank] = worker.poll_line(0.05 if world > 1 else 0.5)
                        except EOFError:
                            replies[rank] = {"rc": None, "clean": False}
                        if replies[rank] is not None and replies[rank]["rc"] != 0 and failed_at is None:
                            failed_at = time.monotonic()
        finally:
            unfinished = [r for r in range(world) if replies[r] is None]
            dirty = [r for r in range(world) if replies[r] is not None
                     and (replies[r]["rc"] not in CLEAN_EXITS or not replies[r]["clean"])]
            if unfinished or dirty:
                self._replace(sorted(set(unfinished) | set(dirty)))
        outs = [_read(jobdir / f"{r}.out") for r in range(world)]
        errs = [_read(jobdir / f"{r}.err") for r in range(world)]
        shutil.rmtree(jobdir, ignore_errors=True)
        args = [label or json.dumps(job), f"world={world}"]
        if unfinished and failed_at is None:
            detail = "\n".join(f"--- rank {r} stdout\n{o[-2000:]}\n--- rank {r} stderr\n{e[-3000:]}"
                               for r, (o, e) in enumerate(zip(outs, errs)))
            raise PoolTimeout(f"{' '.join(args)}: ranks {unfinished} did not finish within {timeout:.0f} s "
                              f"(killed)\n{detail}")
        return Result(args, [None if r is None else r["rc"] for r in replies], outs, errs, int(port))

    def close(self) -> None:
        for worker in self.workers:
            if worker is not None:
                worker.kill()
        self.workers = [None] * self.size
        shutil.rmtree(self.folder, ignore_errors=True)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


_POOL: RankPool | None = None


def pool() -> RankPool:
    """The session's pool (one per pytest process), created on first use."""
    global _POOL
    if _POOL is None:
        _POOL = RankPool()
    return _POOL


def close_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None
