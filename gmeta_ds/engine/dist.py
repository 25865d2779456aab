"""Process-group set-up shared by every launcher (plain python, deepspeed, torchrun, accelerate).

Rank and world size always come from the environment / process group, never from a
launcher library's own state (Accelerate reports 1 process on CPU under DeepSpeed).
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


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
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def destroy_process_group() -> None:
    """Tear down the process group if one exists (always called by the CLI)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_mean(values: list[float]) -> list[float]:
    """Mean of each value over all ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()
