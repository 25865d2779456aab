"""What a training run records as it goes: the meta-steps since the last log line
(`StepWindow`), when to checkpoint and log (`Cadence`), and where records go (`MetricsLog`:
metrics.jsonl and TensorBoard)."""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

from gmeta_ds.engine import ds_internals
from gmeta_ds.engine.dist import all_mean
from gmeta_ds.errors import ConfigError


class MetricsLog:
    """Rank 0's ``metrics.jsonl`` (one JSON object per logged meta-step, flushed as written)
    and, with ``train.tensorboard``, the same scalars as TensorBoard events under
    ``OUTPUT_DIR/tensorboard`` (nested dicts become ``a/b`` tags)."""

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool = True, resumed_at: int = 0):
        path = output_dir / "metrics.jsonl"
        self.file = self.board = None
        if not enabled:
            return
        if resumed_at and path.is_file():  # keep the records up to the checkpoint
            kept = [line for line, step in _records(path) if step <= resumed_at]
            # Replaced whole (temp file + rename): a write that fails leaves the earlier log.
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
            self.file = open(path, "a")
        else:
            self.file = open(path, "w")
        if tensorboard:
            self.board = _summary_writer(output_dir / "tensorboard")

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.board:
            for tag, value in _scalars(record):
                self.board.add_scalar(f"train/{tag}", value, record["step"])

    def write_eval(self, evaluation: dict, step: int) -> None:
        if self.board:
            for tag, value in _scalars(evaluation):
                self.board.add_scalar(f"eval/{tag}", value, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
        if self.board:
            self.board.close()
            self.board = None


def _records(path: Path) -> list[tuple[str, int]]:
    """``metrics.jsonl``'s lines with their steps. The last line may be cut short (a run killed
    while writing it, the case a resume recovers from): unreadable, it is dropped; any other
    line that is not a JSON object with an integer ``step`` is a `ConfigError` naming it."""
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    out = []
    for i, (number, line) in enumerate(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            step = None
        if isinstance(step, int) and not isinstance(step, bool):
            out.append((line, step))
        elif i < len(lines) - 1:
            raise ConfigError([(f"{path}:{number}: expected a JSON object with an integer 'step' (one per "
                                f"logged meta-step), got {line.strip()[:80]!r}; fix or remove the line to resume")])
    return out


def _summary_writer(folder: Path):
    """TensorBoard's writer on ``folder``, or an OSError naming it: TensorBoard's own (a full
    disk, a read-only mount) names no file and comes from its writer thread, so the folder is
    first probed with a small write of our own."""
    from torch.utils.tensorboard import SummaryWriter

    probe = folder / ".gmeta-ds-write-test"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        return SummaryWriter(str(folder))
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
        raise OSError(exc.errno, f"{exc.strerror or exc} (TensorBoard events; train.tensorboard=false "
                      "turns them off)", str(folder)) from exc


def _scalars(record: dict, prefix: str = ""):
    """(tag, number) pairs of a nested metrics dict."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield prefix + key, value


DYNAMIC_COUNTERS = ("occupancy", "capacity", "lookups", "hits", "admissions", "evictions")


def dynamic_record(counters: dict, means: list[float], world: int, seen: dict) -> dict:
    """metrics.jsonl's ``dynamic_tables``: per dynamic table, summed over ranks, rows held
    (``occupancy`` of ``capacity``), admissions and evictions so far, and the hit rate (ids
    found with a row of their own) of the lookups since the last line. ``seen`` carries the
    lookups and hits of the last line."""
    out = {}
    for i, name in enumerate(counters):
        total = dict(zip(DYNAMIC_COUNTERS, (round(v * world) for v in
                                            means[i * len(DYNAMIC_COUNTERS):(i + 1) * len(DYNAMIC_COUNTERS)])))
        lookups, hits = total["lookups"] - seen.get((name, "lookups"), 0), total["hits"] - seen.get((name, "hits"), 0)
        seen[(name, "lookups")], seen[(name, "hits")] = total["lookups"], total["hits"]
        out[name] = {"occupancy": total["occupancy"], "capacity": total["capacity"],
                     "admissions": total["admissions"], "evictions": total["evictions"],
                     "hit_rate": hits / lookups if lookups else None}
    return out


def dense_allreduce_bytes(module: torch.nn.Module, world: int) -> int:
    """Bytes each rank sends per meta-step in a ring all-reduce of the gradients."""
    grad_bytes = sum(ds_internals.full_numel(p) * p.element_size() for p in module.parameters())
    return int(2 * (world - 1) / world * grad_bytes) if world > 1 else 0


class Cadence:
    """Which meta-steps (1-based) checkpoint (every ``checkpoint_every``, 0: never, and the
    last) and write a log line (every ``log_every`` and the last)."""

    def __init__(self, checkpoint_every: int, log_every: int, meta_steps: int):
        self.checkpoint_every, self.log_every, self.meta_steps = checkpoint_every, log_every, meta_steps

    def checkpoint(self, step: int) -> bool:
        return bool(self.checkpoint_every) and (step % self.checkpoint_every == 0 or step == self.meta_steps)

    def log(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.meta_steps


class StepWindow:
    """The meta-steps since the last log line: their losses (the last finite ones), padding,
    skipped steps, wall and CPU time (minus what the profiler spent), and the traffic they
    caused; `record` turns them into one metrics.jsonl line (a collective: means over ranks).
    With ``sites`` > 1 ``tasks_per_meta_step`` and ``world`` are this site's: the line's
    ``tasks`` / ``tasks_per_s`` count the run's (every site takes its block of each meta-step),
    ``site_tasks`` / ``site_tasks_per_s`` this site's."""

    def __init__(self, tasks_per_meta_step: int, world: int, dense_bytes: int, sharded=None, sites: int = 1):
        self.tasks_per_meta_step, self.world, self.dense_bytes = tasks_per_meta_step, world, dense_bytes
        self.sites = sites
        self.sharded = sharded
        self.skipped, self.query, self.support = 0, float("nan"), float("nan")
        self.seen: dict = {}  # dynamic tables' lookups and hits at the last line
        self.reset()

    def reset(self) -> None:
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.steps, self.padding = 0, 0.0

    def exclude(self, wall: float, cpu: float) -> None:
        """Time that was not training (the profiler's own overhead)."""
        self.start += wall
        self.cpu_start += cpu

    def add(self, stats) -> None:
        """One meta-step's `StepResult`."""
        if stats.skipped:
            self.skipped += 1
            return
        self.steps += 1
        self.padding += stats.padding_efficiency
        self.query, self.support = stats.query_loss, stats.support_loss

    def record(self, step: int) -> dict:
        """The log line of the window ending at meta-step ``step``; starts the next window."""
        sharded = self.sharded
        cpu = time.process_time() - self.cpu_start  # this process, all its threads
        counters = sharded.dynamic_counters() if sharded else {}
        query, support, pad, cpu_mean, *dynamic = all_mean(
            [self.query, self.support, self.padding / max(1, self.steps), cpu,
             *[c[k] for c in counters.values() for k in DYNAMIC_COUNTERS]])
        elapsed = time.perf_counter() - self.start
        tasks = self.steps * self.tasks_per_meta_step
        record = {"step": step, "tasks": step * self.tasks_per_meta_step * self.sites,
                  "query_loss": query, "support_loss": support, "tasks_per_s": tasks * self.sites / elapsed,
                  "cpu_s_per_task": cpu_mean * self.world / tasks if tasks else None,
                  "padding_efficiency": pad, "skipped_steps": self.skipped,
                  "dense_allreduce_bytes": self.dense_bytes * self.steps,
                  "embedding_comm_bytes": sharded.stats.total_sent() if sharded else 0}
        if self.sites > 1:
            record.update(site_tasks=step * self.tasks_per_meta_step, site_tasks_per_s=tasks / elapsed)
        if sharded:
            record["embedding_comm"] = sharded.stats.as_dict()
            sharded.stats.reset()
        if counters:
            record["dynamic_tables"] = dynamic_record(counters, dynamic, self.world, self.seen)
        self.reset()
        return record
