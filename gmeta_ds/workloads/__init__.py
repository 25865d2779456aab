"""Workloads: what ``task:`` in a run config names (``ctr``, ``text``), each supplying its data,
learner, micro-batches and final scoring to the one training loop (`gmeta_ds.run.trainer.train`).
Registered by name in ``gmeta_ds.registry.WORKLOADS``; the protocol is `workloads.base.Workload`."""
from __future__ import annotations

from gmeta_ds.registry import WORKLOADS
from gmeta_ds.workloads.base import BatchSource, Built, Workload


def get_workload(name: str) -> Workload:
    """A fresh instance of the workload registered as ``name``."""
    return WORKLOADS[name]()


__all__ = ["BatchSource", "Built", "Workload", "get_workload"]
