"""Process-group set-up shared by every launcher (plain python, deepspeed, torchrun, accelerate).

Rank and world size always come from the environment / process group, never from a
launcher library's own state (Accelerate reports 1 process on CPU under DeepSpeed).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from gmeta_ds.config.deepspeed import MAX_WORLD
from gmeta_ds.engine import ds_internals
from gmeta_ds.engine.sites import start_sites, stop_sites
from gmeta_ds.errors import CollectiveTimeout, ConfigError


# Rendezvous variables init_process_group set itself (no launcher), removed at teardown.
_SET_BY_US: dict[str, str] = {}
# The default group init_process_group started: destroy_process_group ends only that group; one
# the user started (`existing_group`) stays theirs.
_STARTED_HERE: list = [None]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHERS = "set by the launcher: deepspeed, torchrun, accelerate launch"


def _env_int(name: str, default: str, minimum: int, maximum: int = MAX_WORLD) -> int:
    text = os.environ.get(name, default)
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not minimum <= value <= maximum:
        raise ConfigError([f"environment variable {name}={text!r}: expected an integer >= {minimum} "
                           f"and <= {maximum} ({LAUNCHERS})"])
    return value


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local world size) as the launcher set them; (0, 1, 1) without one.
    A value that is not a count, a rank outside the world (or LOCAL_RANK outside the node),
    a node larger than the world or a port outside 1..65535 is a `ConfigError` naming the
    variable: checked before any collective, where torch would end in a ValueError."""
    rank = _env_int("RANK", "0", 0)
    world = _env_int("WORLD_SIZE", "1", 1)
    # torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE.
    local_name = "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in os.environ else "LOCAL_SIZE"
    local_world = _env_int(local_name, str(world), 1)
    problems = []
    if world > 1 and "RANK" not in os.environ:
        problems.append(f"environment variable WORLD_SIZE={world} is set but RANK is not: a launcher sets "
                        "both for each process (with MASTER_ADDR and MASTER_PORT); set RANK, or unset "
                        "WORLD_SIZE to run one process")
    if rank >= world:
        problems.append(f"environment variables RANK={rank} and WORLD_SIZE={world}: the rank must be "
                        "below the world size")
    if local_world > world:
        problems.append(f"environment variables {local_name}={local_world} and WORLD_SIZE={world}: the "
                        "ranks on this node cannot outnumber the ranks of the job")
    if "LOCAL_RANK" in os.environ:
        local_rank = _env_int("LOCAL_RANK", "0", 0)
        if local_rank >= local_world:
            what = local_name if local_name in os.environ else "WORLD_SIZE"
            problems.append(f"environment variables LOCAL_RANK={local_rank} and {what}={local_world}: "
                            "the local rank must be below the ranks on this node")
    if "MASTER_PORT" in os.environ:
        _env_int("MASTER_PORT", "", 1, 65535)
    if "MASTER_ADDR" in os.environ and not os.environ["MASTER_ADDR"].strip():
        problems.append("environment variable MASTER_ADDR='': expected rank 0's host name or address "
                        f"({LAUNCHERS})")
    if problems:
        raise ConfigError(problems)
    return rank, world, local_world


def _check_rendezvous_env() -> None:
    """torch's env:// rendezvous needs MASTER_ADDR and MASTER_PORT once RANK is set."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError([f"environment variable(s) {', '.join(missing)} not set, but RANK="
                           f"{os.environ['RANK']} is: expected rank 0's address and a free port "
                           f"({LAUNCHERS})"])


def core_share() -> tuple[int, int, int]:
    """(threads, cores, ranks): this rank's share of the node's cores, ``cores // ranks`` (at
    least 1), with ``ranks`` the launcher's ranks on this node (1 without a launcher; every
    rank of a process group started without one: never more threads than the cores hold)."""
    _, _, local_world = env_world()
    if dist.is_initialized() and not ({"LOCAL_WORLD_SIZE", "LOCAL_SIZE"} & set(os.environ)):
        local_world = dist.get_world_size()  # a group started without a launcher: assume one host
    cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world)), cores, local_world


def set_threads(threads: int | str) -> int:
    """Give this rank ``threads`` intra-op threads ("auto": cores // ranks on this node).

    Ranks share the node's cores; oversubscribing them makes OpenMP spin and slows a MAML
    loop by an order of magnitude.
    """
    if threads == "auto":
        threads = core_share()[0]
    torch.set_num_threads(int(threads))
    return int(threads)


def choose_threads(threads: int | str) -> tuple[int, str]:
    """The intra-op threads `gm.initialize` gives this rank, and why (its line on rank 0).

    An int is taken as is. "auto" is this rank's share of the node's cores (`core_share`, as
    the CLI's ``train.threads: auto``) unless the user chose already: OMP_NUM_THREADS set
    (torch read it at import; torchrun sets 1 for several ranks), or torch's own count below
    the share (torch.set_num_threads called before): kept. A count above the share is cut to
    it: ranks that oversubscribe the cores make OpenMP spin (~20x slower on 2 ranks here)."""
    if threads != "auto":
        return int(threads), f"threads={threads}"
    current = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ:
        return current, f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} kept"
    share, cores, ranks = core_share()
    if current < share:
        return current, f"torch's setting kept, under the share of {cores} cores / {ranks} rank(s) on this host"
    return share, f"{cores} cores / {ranks} rank(s) on this host; threads=N or OMP_NUM_THREADS to choose"


def existing_group(timeout_s: int) -> tuple[int, int] | None:
    """(rank, world size) of a default process group started before gmeta_ds was asked (the
    user's own ``init_process_group``, Accelerate's ``Accelerator()``, a test harness), made
    ready for DeepSpeed without a second start; None when no group is up (then
    `init_process_group` starts one). The group, not the environment, gives the world:
    a group started with ``init_method="tcp://..."`` or a store sets no RANK / WORLD_SIZE.

    Its backend must be the one `init_process_group` would choose (NCCL for CUDA tensors on
    a GPU host, gloo on CPU), else a `ConfigError` naming both. DeepSpeed reads LOCAL_RANK
    from the environment: set here when missing (the current CUDA device, 0 on CPU). Later
    groups get ``timeout_s`` (`inherit_timeout`), and DeepSpeed's shared-memory op is not
    built, as for a group started here."""
    if not dist.is_initialized():
        return None
    device, want = ("cuda", "nccl") if torch.cuda.is_available() else ("cpu", "gloo")
    config = str(dist.get_backend_config())  # "cpu:gloo,cuda:gloo", "cuda:nccl", "gloo"
    per_device = dict(part.split(":", 1) if ":" in part else (device, part) for part in config.split(","))
    if per_device.get(device) != want:
        raise ConfigError([(f"the existing process group's backend is {config!r}, but {device} tensors on "
                            f"this host need {want!r}: start it with init_process_group(backend={want!r}) "
                            "or let gmeta_ds.initialize start it")])
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if device == "cuda" else 0)
    inherit_timeout(datetime.timedelta(seconds=timeout_s))
    skip_deepspeed_shm_op()
    return dist.get_rank(), dist.get_world_size()


class RunWorld(NamedTuple):
    """Where a run's ranks come from, known before its first collective (`run_world`)."""

    rank: int
    size: int
    origin: str  # in the batch keys' errors: "the existing process group" or "the launch"
    joined: bool  # a group was already up: used as it is, never started or torn down here


def run_world(timeout_s: int) -> RunWorld:
    """The rank and world size a run plans for (`gm.initialize`, ``gmeta-ds train`` through
    ``gmeta_ds.cli.main`` in a process that has a group): an existing default process group's
    (`existing_group`, its backend checked), else the launcher's (`env_world`)."""
    joined = existing_group(timeout_s)
    if joined is not None:
        return RunWorld(*joined, "the existing process group", True)
    return RunWorld(*env_world()[:2], "the launch", False)


def init_process_group(timeout_s: int, sites: int = 1) -> tuple[int, int]:
    """Initialise DeepSpeed's communication backend; returns (rank, world size) of the
    process group: the launcher's, or with ``sites`` > 1 this rank's site's (`engine.sites`).

    Without a launcher the single-process rendezvous variables are set here (otherwise
    DeepSpeed would try MPI discovery). Backend: NCCL with CUDA, gloo on CPU.
    """
    import deepspeed

    if "RANK" not in os.environ and not dist.is_initialized():  # a started group has its ranks
        single = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        os.environ.update(single)
        _SET_BY_US.update(single)
    started = dist.is_initialized()
    if not started:  # before torch's rendezvous turns a bad value into a ValueError
        launched = env_world()
        world = launched[1]
        _check_rendezvous_env()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    shm_skipped = backend == "gloo" and skip_deepspeed_shm_op()
    timeout = datetime.timedelta(seconds=timeout_s)
    inherit_timeout(timeout)
    if not started:
        try:
            if sites > 1:
                start_sites(sites, backend, timeout, launched)
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
            _STARTED_HERE[0] = dist.group.WORLD
        except RuntimeError as exc:  # torch's DistStoreError / DistNetworkError
            if is_collective_timeout(exc):
                raise _rendezvous_timeout(exc, world, timeout_s) from None
            if isinstance(exc, getattr(dist, "DistError", ())):  # e.g. MASTER_PORT taken on rank 0
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise ConfigError([f"process group start-up at MASTER_ADDR:MASTER_PORT="
                                   f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                                   f"failed ({type(exc).__name__}: {first}); expected rank 0's reachable "
                                   f"address and a free port ({LAUNCHERS})"]) from None
            raise
        if backend == "gloo" and not shm_skipped:
            unlink_shm_buffers()  # this DeepSpeed built the op anyway: remove its buffers
    return dist.get_rank(), dist.get_world_size()


def _rendezvous_timeout(exc: BaseException, world: int, timeout_s: int) -> CollectiveTimeout:
    """The rendezvous did not gather every rank in time: a peer never started, died first,
    or cannot reach (or is not told) rank 0's address."""
    addr = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return CollectiveTimeout(
        f"process group start-up: not all WORLD_SIZE={world} ranks joined the rendezvous at "
        f"MASTER_ADDR:MASTER_PORT={addr} within train.collective_timeout_s={timeout_s} s (rank "
        f"{os.environ.get('RANK')}); start every rank with the same MASTER_ADDR, MASTER_PORT and "
        f"WORLD_SIZE, or raise the timeout [{type(exc).__name__}: {first}]")


def inherit_timeout(timeout: datetime.timedelta) -> None:
    """Make every process group of the run use ``timeout``, not only the default one.

    DeepSpeed builds its own groups (the data-parallel group its gradient all-reduce runs on,
    ``deepspeed.utils.groups._clone_world_group``; ZeRO's, MoE's, pipeline's) with
    ``torch.distributed.new_group(ranks)`` and no timeout, so torch gives them
    ``distributed_c10d._get_default_timeout(backend)``: 30 min for gloo, 10 min for NCCL,
    whatever ``init_process_group`` got. That function reads the module globals set here at
    call time, so one assignment before the first group covers every later ``new_group``
    call, DeepSpeed's and ours (passing a timeout at each of DeepSpeed's ~40 call sites is
    impossible); `enforce_group_timeouts` re-checks the groups that exist. Tested with torch
    2.13.0 and deepspeed 0.19.8 (gloo: the data-parallel group then times out at the
    configured value, measured with 2 real processes).

    NCCL (not testable here, no GPU pair): the same value reaches NCCL groups through
    ``default_pg_nccl_timeout``; torch's watchdog then aborts a timed-out collective only with
    async error handling on, which is torch's default (``TORCH_NCCL_ASYNC_ERROR_HANDLING``
    unset = 3); it is set to 3 here when unset, so the watchdog ends a stuck NCCL job (it
    takes the process down itself, with torch's own "Watchdog caught collective operation
    timeout" message, since CUDA work cannot be trusted after an aborted collective)."""
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:  # None when torch is built without NCCL
        c10d.default_pg_nccl_timeout = timeout
    if torch.cuda.is_available():
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")


def _group_backends():
    """(group, backend) of every process group of this rank, where torch's private API tells
    (read defensively: nothing where it is missing)."""
    for pg in list(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None) or {}):
        for device in ("cpu", "cuda"):
            try:
                backend = pg._get_backend(torch.device(device))
                backend.options._timeout  # noqa: B018 (probe)
            except (AttributeError, RuntimeError, TypeError, ValueError):  # no backend on this
                continue  # device, or another torch's private API: nothing to check there
            yield pg, backend


def group_timeouts() -> dict[str, datetime.timedelta]:
    """{"NAME (BACKEND)": timeout} of every process group of this rank."""
    return {f"{pg.group_name} ({type(b).__name__})": b.options._timeout for pg, b in _group_backends()}


_CHECKED_GROUPS = [-1]  # how many groups existed at the last `enforce_group_timeouts`


def enforce_group_timeouts(timeout_s: int) -> list[str]:
    """Give every existing group whose timeout is not ``timeout_s`` that timeout (defence in
    depth behind `inherit_timeout`, e.g. for a group built with an explicit other timeout;
    verified: it makes a 30-min gloo group time out at the new value). Cheap when no group
    was added since the last call. Returns the groups changed."""
    world = getattr(dist.distributed_c10d, "_world", None)
    count = len(getattr(world, "pg_map", None) or {})
    if not dist.is_initialized() or count == _CHECKED_GROUPS[0]:
        return []
    _CHECKED_GROUPS[0] = count
    timeout = datetime.timedelta(seconds=timeout_s)
    changed = []
    for pg, backend in _group_backends():
        if backend.options._timeout != timeout:
            backend._set_default_timeout(timeout)
            changed.append(f"{pg.group_name} ({type(backend).__name__})")
    return changed


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's report of a collective that did not complete in time."""
    if not isinstance(exc, RuntimeError):  # DistBackendError is a RuntimeError
        return False
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


@contextlib.contextmanager
def collective_phase(phase: str, timeout_s: int, latest: Path | None = None):
    """Run the block as ``phase`` ("meta-step 7", "checkpoint save at step 6", "evaluation",
    "final gather"): a collective that times out in it (a peer rank stuck or gone) becomes
    `CollectiveTimeout` naming the phase, ``train.collective_timeout_s``, this rank and the
    last complete checkpoint (``latest``: the file naming it, read when the error happens)."""
    enforce_group_timeouts(timeout_s)
    try:
        yield
    except CollectiveTimeout:
        raise
    except RuntimeError as exc:
        if not is_collective_timeout(exc):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        ckpt = "no checkpoint was completed (train.checkpoint_every)"
        if latest is not None and latest.is_file():
            with open(latest, "rb") as fh:  # a damaged `latest` must not hide the timeout
                tag = fh.read(256).decode("utf-8", "replace").strip()
            ckpt = f"the last complete checkpoint is {latest.parent / tag}"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CollectiveTimeout(
            f"{phase}: a collective did not complete within train.collective_timeout_s="
            f"{timeout_s} s on rank {rank} (a peer rank is stuck or gone); {ckpt} "
            f"[{type(exc).__name__}: {first}]") from None


def skip_deepspeed_shm_op() -> bool:
    """Keep DeepSpeed's CPU backend from JIT-building and mapping its shared-memory all-reduce
    op, which only ``inference_all_reduce`` (tensor-parallel inference) uses, never training.
    Left alone it costs a C++ build at start-up (gcc needed; rebuilt whenever launchers
    differ in environment: ~40 s at 2 cores), 66 MB of RAM per rank in /dev/shm that
    DeepSpeed never frees, and a busy-wait for peers' buffers that never appear across hosts.
    Returns False where this DeepSpeed has no such hook (then `unlink_shm_buffers` cleans up).
    A DeepSpeed internal: `ds_internals.skip_shm_op`."""
    return ds_internals.skip_shm_op()


def unlink_shm_buffers() -> list[Path]:
    """Remove the names of DeepSpeed's CPU shared-memory all-reduce buffers (66 MB of RAM per
    rank in /dev/shm, never unlinked by DeepSpeed: every CPU run, finished or killed, would
    leave them behind). Collective: after a barrier every rank has mapped every peer's buffer,
    so the mappings stay valid while the names go; returns the files removed."""
    dist.barrier()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    path = ds_internals.shm_buffer_path(dist.get_rank(), addr, port)  # DeepSpeed's own name for it
    if path.exists():
        path.unlink(missing_ok=True)
        return [path]
    return []


_TEARDOWN_BARRIER_S = 60


def destroy_process_group(clean_exit: bool = True) -> None:
    """Tear down the process group if `init_process_group` started it (always called by the
    CLI; a group the user started stays up), and forget the single-process rendezvous
    variables set here, so a later run in this process gets a fresh port.

    Gloo aborts a finished process ("terminate called without an active exception", SIGABRT,
    seen about once in a few hundred 2-rank exits under load) when its worker threads still
    hold work objects whose tensors are freed late, or when a peer closes its sockets while
    this rank's pairs are still live. So first the garbage that may own such work objects is
    collected, and on a clean exit every rank meets at a barrier (bounded: a peer that is gone
    costs at most `_TEARDOWN_BARRIER_S`, then the group is destroyed anyway) before any of
    them closes its connections. After an error there is no barrier: peers may be inside
    another collective, and the launcher ends them."""
    stop_sites(clean_exit)
    if dist.is_initialized() and dist.group.WORLD is _STARTED_HERE[0]:
        gc.collect()
        if clean_exit and dist.get_world_size() > 1:
            with contextlib.suppress(Exception):
                if dist.get_backend() == "gloo":
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=_TEARDOWN_BARRIER_S))
                else:
                    dist.barrier()
        ds_internals.destroy_world()
        _STARTED_HERE[0] = None
    for key, value in list(_SET_BY_US.items()):
        if os.environ.get(key) == value:
            del os.environ[key]
        del _SET_BY_US[key]


def on_wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the default process group can reduce it: on this rank's GPU under NCCL
    (which refuses host tensors), as it is under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


def all_mean(values: list[float]) -> list[float]:
    """Mean of each value over all ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = on_wire(t)
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.cpu().tolist()
