"""Memory probes of a rank (Linux ``/proc``; None elsewhere): resident size now and at its
peak, the host memory its tensors hold, and every rank's peaks for ``summary.json``."""
from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed as dist


def _status_mib(key: str) -> float | None:
    status = Path("/proc/self/status")
    lines = [ln for ln in status.read_text().splitlines() if ln.startswith(key + ":")] if status.exists() else []
    return int(lines[0].split()[1]) / 1024 if lines else None


def vmhwm_mib() -> float | None:
    """This process image's peak resident size so far, MiB (Linux; None elsewhere)."""
    return _status_mib("VmHWM")


def rss_mib() -> float | None:
    """This process's resident size now, MiB (Linux; None elsewhere), after handing the
    allocator's free heap pages back to the system (glibc ``malloc_trim``), so memory freed
    earlier is not counted as held."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return _status_mib("VmRSS")


def host_tensor_mib() -> float:
    """MiB of host memory in the distinct tensor storages this process can reach (each
    storage once, however many views share it; ZeRO-3's partitions, ``param.ds_tensor``,
    included): the model state and DeepSpeed's buffers, measured rather than inferred."""
    sizes = {}
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor):  # type(): no __class__ lookups
                continue
            for t in (obj, getattr(obj, "ds_tensor", None)):
                if t is not None and t.device.type == "cpu" and not t.is_meta:
                    storage = t.untyped_storage()
                    sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes())
        except (RuntimeError, ReferenceError):  # storages that cannot be read (e.g. freed)
            continue
    sizes.pop(0, None)  # empty storages
    return sum(sizes.values()) / 2**20


def peak_rss_per_rank(training_peak: float | None, data=None, runtime: float | None = None,
                      between_steps: float | None = None, tensors: float | None = None) -> list[dict]:
    """Every rank's peak resident memory, MiB (collective when world > 1): VmHWM after
    training and at the end (after gathering tables and evaluating), and ru_maxrss (on Linux
    it survives exec, so a launched rank starts at its launcher's resident size), and the
    rank's data: resident pages of task-store memory maps (shared with its node; rows are read
    with pread, so normally none) and the task arrays it holds in memory (all of them for
    generated tasks; the per-task offsets and lengths for a task store). ``runtime`` (the
    resident size before the model and data were built: interpreter, torch, DeepSpeed) and
    ``between_steps`` (after the training loop, garbage collected: the model's state,
    DeepSpeed's buffers and the data, no activations) and ``tensors`` (what of it is tensor
    storage, `host_tensor_mib`) are added when given."""
    import resource

    from gmeta_ds.data.stream import in_memory_mib, mapped_store_mib

    mine = {"training_vmhwm_mib": training_peak, "vmhwm_mib": vmhwm_mib(),
            "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "task_store_rss_mib": mapped_store_mib(), "tasks_in_memory_mib": in_memory_mib(data)}
    if runtime is not None:
        mine["runtime_rss_mib"] = runtime
    if between_steps is not None:
        mine["after_training_rss_mib"] = between_steps
    if tensors is not None:
        mine["after_training_tensor_mib"] = tensors
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
