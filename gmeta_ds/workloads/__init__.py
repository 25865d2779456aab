"""Workloads: what ``task:`` in a run config names (``ctr``, ``text``), each supplying its data,
learner, micro-batches and final scoring to the one training loop (`gmeta_ds.run.trainer.train`).
Registered by name in ``gmeta_ds.registry.WORKLOADS`` (bound here: a workload's module is
imported when it is first named); the protocol is `workloads.base.Workload`."""
from __future__ import annotations

from gmeta_ds.registry import WORKLOADS
from gmeta_ds.workloads.base import BatchSource, Built, Workload

WORKLOADS.bind({"ctr": "gmeta_ds.workloads.ctr:CTRWorkload", "text": "gmeta_ds.workloads.text:TextWorkload"})


def get_workload(name: str) -> Workload:
    """A fresh instance of the workload registered as ``name``."""
    return WORKLOADS[name]()


__all__ = ["BatchSource", "Built", "Workload", "get_workload"]
