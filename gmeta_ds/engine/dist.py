"""Process-group set-up shared by every launcher (plain python, deepspeed, torchrun, accelerate).

Rank and world size always come from the environment / process group, never from a
launcher library's own state (Accelerate reports 1 process on CPU under DeepSpeed).
"""
from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist


# Rendezvous variables init_process_group set itself (no launcher), removed at teardown.
_SET_BY_US: dict[str, str] = {}


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local world size) as the launcher set them; (0, 1, 1) without one."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", str(world))))
    return rank, world, local_world


def set_threads(threads: int | str) -> int:
    """Give this rank ``threads`` intra-op threads ("auto": cores // ranks on this node).

    Ranks share the node's cores; oversubscribing them makes OpenMP spin and slows a MAML
    loop by an order of magnitude.
    """
    if threads == "auto":
        _, _, local_world = env_world()
        threads = max(1, (os.cpu_count() or 1) // max(1, local_world))
    torch.set_num_threads(int(threads))
    return int(threads)


def init_process_group(timeout_s: int) -> tuple[int, int]:
    """Initialise DeepSpeed's communication backend; returns (rank, world size).

    Without a launcher the single-process rendezvous variables are set here (otherwise
    DeepSpeed would try MPI discovery). Backend: NCCL with CUDA, gloo on CPU.
    """
    import deepspeed

    if "RANK" not in os.environ:
        single = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        os.environ.update(single)
        _SET_BY_US.update(single)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    shm_skipped = backend == "gloo" and skip_deepspeed_shm_op()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "gloo" and not shm_skipped:
            unlink_shm_buffers()  # this DeepSpeed built the op anyway: remove its buffers
    return dist.get_rank(), dist.get_world_size()


def skip_deepspeed_shm_op() -> bool:
    """Keep DeepSpeed's CPU backend from JIT-building and mapping its shared-memory all-reduce
    op, which only ``inference_all_reduce`` (tensor-parallel inference) uses, never training.
    Left alone it costs a C++ build at start-up (gcc needed; rebuilt whenever launchers
    differ in environment: ~40 s at 2 cores), 66 MB of RAM per rank in /dev/shm that
    DeepSpeed never frees, and a busy-wait for peers' buffers that never appear across hosts.
    Returns False where this DeepSpeed has no such hook (then `unlink_shm_buffers` cleans up)."""
    import importlib

    # Not ``import deepspeed.comm.torch``: deepspeed.comm's attribute ``torch`` is torch itself.
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    if not hasattr(ds_torch, "build_shm_op") or not hasattr(ds_torch, "TorchBackend"):
        return False
    ds_torch.build_shm_op = lambda: None
    return True


def unlink_shm_buffers() -> list[Path]:
    """Remove the names of DeepSpeed's CPU shared-memory all-reduce buffers (66 MB of RAM per
    rank in /dev/shm, never unlinked by DeepSpeed: every CPU run, finished or killed, would
    leave them behind). Collective: after a barrier every rank has mapped every peer's buffer,
    so the mappings stay valid while the names go; returns the files removed."""
    dist.barrier()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    path = Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{dist.get_rank()}")
    if path.exists():
        path.unlink(missing_ok=True)
        return [path]
    return []


def destroy_process_group() -> None:
    """Tear down the process group if one exists (always called by the CLI), and forget the
    single-process rendezvous variables set here, so a later run in this process gets a
    fresh port."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in list(_SET_BY_US.items()):
        if os.environ.get(key) == value:
            del os.environ[key]
        del _SET_BY_US[key]


def all_mean(values: list[float]) -> list[float]:
    """Mean of each value over all ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()
