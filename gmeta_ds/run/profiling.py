"""Where a meta-step's time goes, per rank: ``train.profile_steps`` (torch.profiler).

The meta-step is labelled with `phase` regions (``torch.profiler.record_function``; they cost
nothing while no profiler runs): ``data`` (the next micro-batches), ``lookup`` (the fused
embedding lookup, all-to-all included), ``inner_loop`` (the learner's forward: inner
adaptation of every task and the outer query loss), ``nonfinite_check`` (the outer loss's
NaN/inf check), ``outer_backward`` (``engine.backward``: the outer gradient and, at the
accumulation boundary, DeepSpeed's gradient reduction across ranks), ``optimizer_step``
(``engine.step``: DeepSpeed's update, under ZeRO-1/2 also the all-gather of the updated
partitions) and ``sparse_step`` (the sharded tables' row optimizers).

`PhaseProfiler` records ``train.profile_steps`` meta-steps after ``train.profile_warmup``
and summarises them per rank: milliseconds per meta-step in each phase (inclusive wall time),
the time collectives were in flight inside it (gloo / NCCL work items, from the profiler's
communication events; on a rank that arrives first this includes waiting for its peers),
and the collectives by kind. `write_profile` gathers every rank's summary (collective) and writes
``OUTPUT_DIR/profile.json`` on rank 0 (with ``train.profile_trace``, also a Chrome trace per
rank under ``OUTPUT_DIR/profile/``). The profiler's own per-op bookkeeping slows the profiled
steps (compare ``step_ms`` with the unprofiled tasks/s in metrics.jsonl); the phases' shares
are what to read.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gmeta_ds.files import write_json

TRACE_FILE = "trace_rank{rank}.json"  # each rank's Chrome trace under OUTPUT_DIR/profile (train.profile_trace)

PREFIX = "gmeta_ds/"
PHASES = ("data", "lookup", "inner_loop", "nonfinite_check", "outer_backward", "optimizer_step",
          "sparse_step")
STEP = "meta_step"
_COMM_PREFIXES = ("gloo:", "nccl:")


def phase(name: str):
    """A labelled region of the meta-step (a no-op unless a profiler is recording)."""
    return record_function(PREFIX + name)


class PhaseProfiler:
    """torch.profiler over ``steps`` meta-steps after ``warmup`` (`start_step` / `end_step`
    around every meta-step, then `summary`)."""

    def __init__(self, steps: int, warmup: int, trace_dir: Path | None = None):
        self.steps, self.warmup, self.trace_dir = steps, warmup, trace_dir
        self.seen = self.recorded = 0
        self.prof = None
        self.region = None
        self.result: dict | None = None
        self.overhead_s = self.overhead_cpu_s = 0.0

    @property
    def recording(self) -> bool:
        return self.prof is not None

    def start_step(self) -> None:
        if self.steps and self.prof is None and self.result is None and self.seen >= self.warmup:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities)
            self.prof.start()
        if self.prof is not None:
            self.region = phase(STEP)
            self.region.__enter__()

    def end_step(self) -> None:
        self.seen += 1
        if self.prof is None:
            return
        self.region.__exit__(None, None, None)
        self.recorded += 1
        if self.recorded >= self.steps:
            self.finish()

    def finish(self) -> None:
        """Stop recording (also when the run ends before ``steps`` were recorded) and
        summarise; the time this takes is added to `overhead_s`."""
        if self.prof is None:
            return
        started, cpu = time.perf_counter(), time.process_time()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.stop()
        self.result = summarize(self.prof.events(), self.recorded)
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            rank = os.environ.get("RANK", "0")
            self.prof.export_chrome_trace(str(self.trace_dir / TRACE_FILE.format(rank=rank)))
        self.prof = None
        self.overhead_s += time.perf_counter() - started
        self.overhead_cpu_s += time.process_time() - cpu

    def take_overhead(self) -> tuple[float, float]:
        """(wall, CPU) seconds spent stopping the profiler and summarising since the last
        call (the trainer leaves them out of its tasks/s and CPU-seconds per task)."""
        spent = (self.overhead_s, self.overhead_cpu_s)
        self.overhead_s = self.overhead_cpu_s = 0.0
        return spent


def summarize(events, steps: int) -> dict:
    """Per-meta-step milliseconds of each phase and of the time collectives were in flight
    during it (the union of the collectives' intervals intersected with the phase's, so a
    collective posted in one phase and completing in the next counts in both, each for its
    own part), and of every kind of collective."""
    regions, comms = [], []
    for ev in events:
        name = ev.name
        if name.startswith(PREFIX):
            regions.append((name[len(PREFIX):], ev.time_range.start, ev.time_range.end))
        elif name.startswith(_COMM_PREFIXES):
            comms.append((name, ev.time_range.start, ev.time_range.end))
    per = max(1, steps)
    phases = {p: {"ms": 0.0, "calls": 0, "collective_ms": 0.0} for p in PHASES}
    step_ms = 0.0
    in_flight = _union([(start, end) for _, start, end in comms])
    for name, start, end in regions:
        if name == STEP:
            step_ms += (end - start) / 1e3
            continue
        entry = phases.setdefault(name, {"ms": 0.0, "calls": 0, "collective_ms": 0.0})
        entry["ms"] += (end - start) / 1e3
        entry["calls"] += 1
        entry["collective_ms"] += sum(max(0, min(end, e) - max(start, s)) for s, e in in_flight) / 1e3
    collectives: dict[str, dict] = {}
    for name, start, end in comms:
        kind = collectives.setdefault(name, {"calls": 0, "ms": 0.0})
        kind["calls"] += 1
        kind["ms"] += (end - start) / 1e3
    for entry in [*phases.values(), *collectives.values()]:
        for key in entry:
            entry[key] /= per
    accounted = sum(e["ms"] for e in phases.values())
    return {"steps": steps, "step_ms": step_ms / per, "phases": phases,
            "other_ms": max(0.0, step_ms / per - accounted), "collectives": collectives}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time as ``intervals``."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def write_profile(profiler: PhaseProfiler, output_dir: Path, rank: int, world: int,
                  context: dict) -> dict | None:
    """Gather every rank's summary (collective when world > 1); rank 0 writes
    ``profile.json`` and returns it (None elsewhere)."""
    import torch.distributed as dist

    profiler.finish()
    mine = profiler.result or {"steps": 0}
    everyone = [mine]
    if world > 1 and dist.is_initialized():
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    report = {**context, "ranks": everyone}
    write_json(Path(output_dir) / "profile.json", report)
    return report


def table(report: dict) -> str:
    """The per-phase breakdown of a ``profile.json`` as text (ms per meta-step, per rank)."""
    ranks = report["ranks"]
    head = "phase".ljust(16) + "".join(f"rank {r} ms (comm)".rjust(20) for r in range(len(ranks)))
    lines = [head]
    names = [p for p in PHASES if any(r.get("phases", {}).get(p, {}).get("calls") for r in ranks)]
    for name in names:
        cells = []
        for r in ranks:
            e = r["phases"].get(name, {"ms": 0.0, "collective_ms": 0.0})
            cells.append(f"{e['ms']:9.2f} ({e['collective_ms']:6.2f})".rjust(20))
        lines.append(name.ljust(16) + "".join(cells))
    lines.append("other".ljust(16) + "".join(f"{r.get('other_ms', 0.0):9.2f}".ljust(9).rjust(20)
                                             for r in ranks))
    lines.append("meta-step".ljust(16) + "".join(f"{r.get('step_ms', 0.0):9.2f}".ljust(9).rjust(20)
                                                 for r in ranks))
    return "\n".join(lines)
