"""Checkpoint trust (issue 32), the waits of a resume at another world size: rank 0 converts the
checkpoint while the other ranks wait in one all-reduce. Two real gloo ranks per job, no
training (a hand-made checkpoint folder; the converter replaced by a process that hangs)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = [pytest.mark.distributed]

TIMEOUT_S = 12  # the process groups' timeout (train.collective_timeout_s)

WORKER = """
import os, sys, time
from pathlib import Path
from gmeta_ds import checkpoint
from gmeta_ds.engine import ds_internals
from gmeta_ds.engine.dist import init_process_group
from gmeta_ds.errors import CollectiveTimeout, ConfigError

mode, ckpt, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
rank, _ = init_process_group({timeout})
if rank == 0:
    # the converter hangs (bounded by rank 0), or rank 0 itself is stuck (only the peers' timeout helps)
    ds_internals.universal_conversion_command = lambda src, dst: [
        sys.executable, "-c", "import time; time.sleep(120)"]
    if mode == "stuck":
        checkpoint.universal.convert_to_universal = lambda *args: time.sleep(120) or ""
start = time.monotonic()
try:
    checkpoint.to_universal(ckpt, out, {{"world_size": 2, "step": 2}})
except (ConfigError, CollectiveTimeout) as exc:
    took = time.monotonic() - start
    print(f"rank {{rank}} after {{took:.1f}} s: {{type(exc).__name__}}: {{exc}}", flush=True)
    os._exit(0)
print("no error", flush=True)
"""


def _job(tmp_path: Path, mode: str) -> list[subprocess.Popen]:
    folder = tmp_path / mode
    (folder / "run" / "checkpoints" / "step_00000002").mkdir(parents=True)
    script = folder / "worker.py"
    script.write_text(WORKER.format(timeout=TIMEOUT_S))
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, str(script), mode, str(folder / "run" / "checkpoints" / "step_00000002"),
             str(folder / "run")], cwd=folder, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return procs


def _output(proc: subprocess.Popen, deadline: float) -> str:
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        out += "\n[killed at the test's deadline]"
    return out


def test_the_wait_for_rank_0s_conversion_is_bounded_and_named(tmp_path):
    """A converter that hangs is killed by rank 0 before the other ranks' all-reduce gives up,
    and every rank exits with the same clear error; a rank 0 stuck itself (no answer at all)
    makes the others give up at train.collective_timeout_s, saying what they waited for."""
    hang, stuck = _job(tmp_path, "hang"), _job(tmp_path, "stuck")
    deadline = time.monotonic() + TIMEOUT_S + 60
    try:
        hang_out = [_output(p, deadline) for p in hang]
        stuck_out = _output(stuck[1], deadline)
    finally:
        for proc in hang + stuck:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.communicate()
    limit = TIMEOUT_S - TIMEOUT_S / 5
    for rank, out in enumerate(hang_out):
        assert f"rank {rank} after" in out and "ConfigError" in out, out[-3000:]
        assert "converting it to a universal checkpoint" in out, out[-3000:]
        seconds = float(out.split(f"rank {rank} after ")[1].split(" s:")[0])
        assert seconds < TIMEOUT_S + 5, out[-3000:]
    assert f"did not finish within {limit:g} s, what train.collective_timeout_s={TIMEOUT_S} s" in hang_out[0]
    assert "on rank 0 (its error says why)" in hang_out[1]
    assert "rank 1 after" in stuck_out and "CollectiveTimeout" in stuck_out, stuck_out[-3000:]
    assert (f"rank 1 waited train.collective_timeout_s={TIMEOUT_S} s for rank 0 to convert its ZeRO "
            "partitions" in stuck_out), stuck_out[-3000:]
    assert float(stuck_out.split("rank 1 after ")[1].split(" s:")[0]) < TIMEOUT_S + 15
