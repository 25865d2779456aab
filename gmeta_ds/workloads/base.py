"""The workload protocol: what one value of ``task:`` in a run config supplies to the one
training loop (`gmeta_ds.run.trainer.train`).

A workload builds its data and learner, hands the loop each meta-step's micro-batches, and
at the end saves and scores the model. Everything else -- the DeepSpeed engine, resume,
the meta-step itself, checkpoints, metrics, timeouts, the summary -- is the loop's, the same
for every workload. To add one: subclass `Workload`, register it in
``gmeta_ds.registry.WORKLOADS`` (``WORKLOADS.register("mine", MyWorkload)``), and name it
with ``task: mine``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from gmeta_ds.algorithms import MetaLearner
from gmeta_ds.config import RunConfig
from gmeta_ds.config.deepspeed import BatchPlan, size_text, zero_stage
from gmeta_ds.data.readers import DataError
from gmeta_ds.data.remote import shown
from gmeta_ds.data.store_read import store_identity
from gmeta_ds.engine.parallelize import body_split, split_wanted
from gmeta_ds.run.outputs import run_phase


class BatchSource(Protocol):
    """This rank's micro-batches, one meta-step per `next` call; resumable."""

    def next(self) -> list: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...


@dataclass
class Built:
    """What a workload built for a run: the learner (handed to DeepSpeed), this rank's sharded
    tables (None when none are sharded), their configs, the field names a checkpoint records,
    and the workload's own data (tasks, tokenizer, ...)."""

    learner: MetaLearner
    data: Any
    sharded: Any = None
    tables: list = field(default_factory=list)
    field_names: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def body_split_line(learner: MetaLearner, ds_config: dict) -> str:
    """``gmeta-ds validate``'s line on how a micro-step runs the model (`functional.split`):
    whether the body is split off, and under ZeRO-3 what each rank gathers per micro-step."""
    stage = zero_stage(ds_config)
    half = ds_config.get("bf16", {}).get("enabled", False) or ds_config.get("fp16", {}).get("enabled", False)
    width = 2 if half else 4
    total = sum(p.numel() for p in learner.parameters())
    wanted = split_wanted(learner.algorithm.split_body, stage)
    split, why = body_split(learner) if wanted or learner.algorithm.split_body == "auto" else (None, "")
    if split is not None and wanted:
        body = sum(p.numel() for p in split.body.parameters())
        largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in split.body.modules()), default=0)
        if stage == 3:
            return (f"model body: {body} of {total} parameters run once per micro-batch, partitioned "
                    f"(DeepSpeed's ZeRO-3 hooks gather one module at a time, largest "
                    f"{size_text(width * largest)}); the rest, {size_text(width * (total - body))}, "
                    "is gathered per micro-step (meta.split_body)")
        return (f"model body: {body} of {total} parameters run once per micro-batch, the inner loop "
                "runs on the head only (meta.split_body: true)")
    if stage == 3:
        reason = why or "meta.split_body: false"
        return (f"model body: not split ({reason}): ZeRO-3 gathers every parameter for each "
                f"micro-step, {size_text(width * total)} per rank on top of the partitioned state "
                "(adapting only the last layers, e.g. a classifier head, lets the body stay partitioned)")
    return ("model body: not split (meta.split_body: auto splits under ZeRO-3"
            + (f"; here it could not: {why}" if why else "") + ")")


def check_ranks_read_the_same(cfg: RunConfig, data) -> None:
    """Every rank trains on the same tasks: each rank lists ``data.path`` and resolves a Delta
    table's latest version on its own, so an object rewritten or a commit landing while the ranks
    start could give them different stores. One all-gather of each rank's `store_identity`
    (collective; nothing for one rank or tasks built in memory) before anything depends on the
    data; a `DataError` on every rank, naming ``data.path`` and what each rank read, when their
    contents differ."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1 or getattr(data, "store", None) is None:
        return
    everyone = [None] * world
    with run_phase(cfg, "data check across ranks"):
        dist.all_gather_object(everyone, store_identity(data))
    if len({e["content"] for e in everyone}) == 1:
        return
    path = shown(str(cfg.data.path))
    if any(e["version"] is not None for e in everyone):
        read = _by_rank(everyone, lambda e: f"Delta table version {e['version']}")
        raise DataError(f"data.path {path}: the ranks read different versions of the table ({read}); a commit "
                        "landed while they started: pin data.version_as_of (or data.timestamp_as_of) so every "
                        "rank reads one version")
    read = _by_rank(everyone, lambda e: f"task store {e['store']}")
    raise DataError(f"data.path {path}: the ranks read different data ({read}); the files or objects there "
                    "changed while the ranks listed them, or the ranks see different ones: train again once "
                    "the writes are done, or point data.path at files nothing rewrites")


def _by_rank(everyone: list[dict], what) -> str:
    """``rank 0: A; ranks 1, 2: B``: what each group of ranks with the same content read."""
    groups: dict[str, list[int]] = {}
    for rank, e in enumerate(everyone):
        groups.setdefault(e["content"], []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {what(everyone[r[0]])}"
                     for r in groups.values())


class Workload(ABC):
    """Base of every workload; ``noun`` is what one task is called in messages."""

    name = ""
    noun = "tasks"

    @abstractmethod
    def preflight(self, cfg: RunConfig, world_size: int) -> Any:
        """Every check that needs data or the model but no process group (every rank, before
        the first collective); what it returns is handed to `build`."""

    @abstractmethod
    def build(self, cfg: RunConfig, rank: int, world_size: int, prepared: Any) -> Built:
        """The learner, tables and data of this rank (deterministic from the seed)."""

    @abstractmethod
    def batches(self, cfg: RunConfig, built: Built, plan: BatchPlan, rank: int) -> BatchSource:
        """This rank's micro-batches per meta-step: the same global batch at any world size."""

    @abstractmethod
    def finish(self, cfg: RunConfig, engine, built: Built, rank: int, world: int) -> tuple[dict, dict]:
        """After the last meta-step (collective): save the model and score it; returns (the
        evaluation, extra summary keys), both {} on ranks other than 0 where it likes."""

    @abstractmethod
    def evaluate_saved(self, cfg: RunConfig, weights: str | None) -> dict:
        """``gmeta-ds eval``: score saved weights (default: this run's) in one process."""

    @abstractmethod
    def describe(self, cfg: RunConfig, ds_config: dict, plan: BatchPlan) -> list[str]:
        """``gmeta-ds validate``: lines on the data, the model and its memory."""

    @abstractmethod
    def report(self, summary: dict, output_dir: str | Path) -> list[str]:
        """The lines ``gmeta-ds train`` prints at the end (rank 0)."""
