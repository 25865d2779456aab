"""The lock under which one process builds a task store while the others wait, with a bound.

The ranks of a node (and other runs keyed to the same store) must not build it twice, so the
builder holds ``flock`` on ``tasks-<key>.lock``. A waiter must neither wait silently nor
forever: the holder writes its pid, host and start time into the lock file and rewrites it
every `HEARTBEAT_S` from a thread (a beat counter), and a waiter

* says once, on stderr, whom it waits for (pid P on host H, building since T);
* raises `DataError` when the lock file has not changed for ``stall_s`` (the run's
  ``train.collective_timeout_s``): the holder is stopped (SIGSTOP), hung or gone, which a
  long but live build never looks like, so a slow build is not cut short;
* raises in any case after ``wait_s`` (`LOCK_WAIT_S`).

A holder that exits (or is killed) on this host releases the flock with its last file
descriptor, so a dead holder on this host never blocks; only a stopped or hung one, or one
on another host of a shared file system, needs the bound. The lock file is never removed:
a waiter that reopened a removed path would lock another inode than the holder's.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from gmeta_ds.errors import DataError

LOCK_WAIT_S = 6 * 3600  # a live build (its holder beats): wait at most this long
STALL_S = 600           # the default of train.collective_timeout_s, for callers without a run config
HEARTBEAT_S = 1.0       # the holder rewrites its record this often; a waiter allows 3 missed beats at least
POLL_S = 0.2


def _record(started: float, beat: int) -> bytes:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started,
                       "beat": beat}).encode()


def _write(fd: int, data: bytes) -> None:
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def _beat(fd: int, started: float, stop: threading.Event) -> None:
    """The holder's sign of life: a changed lock file every `HEARTBEAT_S`."""
    beat = 0
    while not stop.wait(HEARTBEAT_S):
        beat += 1
        with contextlib.suppress(OSError):
            _write(fd, _record(started, beat))


def holder_text(data: bytes) -> str:
    """Who holds the lock, from the lock file's bytes: 'pid P on host H (building since T)'."""
    try:
        rec = json.loads(data)
        since = datetime.datetime.fromtimestamp(float(rec["started"]), datetime.UTC)
        text = f"pid {int(rec['pid'])} on host {rec['host']} (building since {since:%Y-%m-%d %H:%M:%S} UTC)"
    except (ValueError, KeyError, TypeError, OverflowError, OSError):
        return "another process (it left no pid/host record in the lock file)"
    if rec["host"] == socket.gethostname() and _stopped(int(rec["pid"])):
        text += ", now stopped (state T)"
    return text


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` of this host is stopped (SIGSTOP, a debugger)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


def _wait(fd: int, lock: Path, stall_s: float, wait_s: float) -> None:
    """Block until ``fd`` holds the flock, or raise once the holder looks dead or ``wait_s`` passed."""
    stall_s = max(float(stall_s), 3 * HEARTBEAT_S)
    start = last_change = time.monotonic()
    seen, told = None, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        data = os.pread(fd, 4096, 0)
        if data != seen:
            seen, last_change = data, now
        if not told and (data or now - start > 2):  # the holder writes its record right after locking
            print(f"gmeta_ds: waiting for the task store {lock.with_suffix('').name}, built by "
                  f"{holder_text(data)} (lock {lock})", file=sys.stderr, flush=True)
            told = True
        if now - last_change > stall_s or now - start > wait_s:
            raise DataError(_stuck(lock, data, now - start, now - last_change, stall_s))
        time.sleep(POLL_S)


def _stuck(lock: Path, data: bytes, waited: float, silent: float, stall_s: float) -> str:
    return (f"{lock}: waited {waited:.0f} s for the process building the task store "
            f"{lock.with_suffix('').name}: {holder_text(data)}; it has shown no sign of life for "
            f"{silent:.0f} s (stopped, hung, or gone with its host). If that process is stopped or hung, "
            f"end it; if it is gone, delete {lock} and run again; if the build is only slow, raise "
            f"train.collective_timeout_s (now {stall_s:.0f} s), the bound of this wait")


@contextlib.contextmanager
def build_lock(store: Path, stall_s: float = STALL_S, wait_s: float = LOCK_WAIT_S):
    """Held while one process builds ``store``: the ranks of a node build it once, the
    others wait (bounded, see the module docstring) and then open it."""
    store.parent.mkdir(parents=True, exist_ok=True)
    lock = store.with_name(f"{store.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _wait(fd, lock, stall_s, wait_s)
        started = time.time()
        stop = threading.Event()
        _write(fd, _record(started, 0))
        beater = threading.Thread(target=_beat, args=(fd, started, stop), daemon=True,
                                  name="gmeta_ds-store-lock")
        beater.start()
        try:
            yield
        finally:
            stop.set()
            beater.join()
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
