"""A rank that is alive but stuck (SIGSTOP, so no launcher or dead-peer check notices) ends the
job: every collective, ours and DeepSpeed's, gives up within ``train.collective_timeout_s``
and the surviving rank exits 3 with one clear message (real deepspeed launcher, 2 gloo ranks).

Timeline measured here (2 shared cores): the survivor's message comes TIMEOUT_S (15 s) plus
well under a second after rank 1 stopped; the launcher then SIGTERMs every rank, which a
stopped process never handles, and SIGKILLs it after its fixed 30 s grace
(deepspeed/launcher/launch.py ``terminate_process_tree``), so the job would end ~45 s after the
stop; the test ends the stopped rank itself once the launcher has begun terminating (job end
~17 s after the stop).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess as sp
import threading
import time
from pathlib import Path

import pytest
from conftest import BIN, REPO, deepspeed_cmd, tiny_config

from gmeta_ds.meta_engine import FAULT_STOP_ENV

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]

TIMEOUT_S = 15  # train.collective_timeout_s
STOP_AT = 5  # rank 1 stops in this meta-step (1-based); checkpoints every 2 steps
LAUNCHER_GRACE_S = 30  # deepspeed's launcher: SIGTERM, then SIGKILL 30 s later
MARGIN_S = 15  # start-up of the exception path and CPU contention on 2 shared cores


def _pids(config_path: Path, pattern: str = "") -> list[int]:
    out = sp.run(["pgrep", "-f", f"{pattern}train --config {config_path}"], capture_output=True,
                 text=True, timeout=10, check=False).stdout
    return [int(x) for x in out.split()]


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("sharding, point", [("dense", ""), pytest.param("sharded", ":start", marks=pytest.mark.slow)])
def test_stopped_rank_ends_the_job_within_the_collective_timeout(tmp_path, sharding, point):
    """dense tables, rank 1 stopped before its backward: the survivor waits in DeepSpeed's
    gradient all-reduce (``engine.allreduce_bucket``, on the data-parallel group DeepSpeed built
    with ``new_group``: 30 min, torch's default, before dist.inherit_timeout; this case then
    hung past its wait and failed). Sharded tables, rank 1 stopped at the start of the
    meta-step: the survivor waits in our own all-to-all of the embedding lookup (default group).

    Both check the survivor's message and exit code and that the launcher terminates the ranks
    (its SIGTERM), then kill the stopped rank themselves rather than wait out the launcher's SIGKILL
    ``LAUNCHER_GRACE_S`` later (DeepSpeed's fixed grace: 30 s of CI per case)."""
    embedding = {"sharding": sharding, **({"plan": "row_wise"} if sharding == "sharded" else {})}
    path = tiny_config(tmp_path, embedding=embedding,
                       train={"meta_steps": 400, "log_every": 1, "checkpoint_every": 2,
                              "collective_timeout_s": TIMEOUT_S, "progress": False})
    cmd = deepspeed_cmd(2, str(BIN / "gmeta-ds"), "train", "--config", str(path))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", FAULT_STOP_ENV: f"{STOP_AT}:1{point}"}
    proc = sp.Popen(cmd, cwd=REPO, env=env, stdout=sp.PIPE, stderr=sp.STDOUT, text=True,
                    start_new_session=True)  # its own process group: the launcher and its ranks
    lines: list[tuple[float, str]] = []  # (when read, line) of the launcher's and ranks' output

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline, stopped_at = time.monotonic() + 240, None
        while stopped_at is None and time.monotonic() < deadline and proc.poll() is None:
            if any(_stopped(pid) for pid in _pids(path, "local_rank=1 ")):
                stopped_at = time.monotonic()
            time.sleep(0.2)
        assert stopped_at is not None, "rank 1 never stopped:\n" + "".join(ln for _, ln in lines)[-4000:]
        # once the launcher saw rank 0 fail and terminates the ranks, end the stopped one (it would
        # get the launcher's own SIGKILL LAUNCHER_GRACE_S later: DeepSpeed's fixed grace, 30 s of CI)
        deadline = time.monotonic() + TIMEOUT_S + 2 * MARGIN_S + 30
        while time.monotonic() < deadline and proc.poll() is None \
                and not any("Killing subprocess" in ln for _, ln in lines):
            time.sleep(0.2)
        assert any("Killing subprocess" in ln for _, ln in lines) or proc.poll() is not None, \
            "the launcher never terminated the ranks:\n" + "".join(ln for _, ln in lines)[-4000:]
        for pid in _pids(path, "local_rank=1 "):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=TIMEOUT_S + LAUNCHER_GRACE_S + 2 * MARGIN_S + 30)
        ended = time.monotonic() - stopped_at
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        for pid in _pids(path):  # a rank that left the launcher's process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    out = "".join(ln for _, ln in lines)
    expected = (f"gmeta-ds train: meta-step {STOP_AT}: a collective did not complete within "
                f"train.collective_timeout_s={TIMEOUT_S} s on rank 0 (a peer rank is stuck or gone); "
                f"the last complete checkpoint is {tmp_path / 'run' / 'checkpoints' / 'step_00000004'}")
    said = [t for t, ln in lines if expected in ln]
    assert said, f"no timeout message in:\n{out[-6000:]}"
    message_after = said[0] - stopped_at
    print(f"{sharding}: message {message_after:.1f} s and job end {ended:.1f} s after rank 1 stopped")
    assert proc.returncode != 0 and "exits with return code = 3" in out, out[-4000:]
    assert "Traceback" not in out, out[-6000:]
    assert TIMEOUT_S - 1 <= message_after <= TIMEOUT_S + MARGIN_S
    assert ended <= TIMEOUT_S + LAUNCHER_GRACE_S + 2 * MARGIN_S
