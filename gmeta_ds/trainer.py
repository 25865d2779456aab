"""The one meta-training loop on a DeepSpeed engine, for every workload, top to bottom.

A workload (``task:`` in the config, `gmeta_ds.workloads`) builds the learner, tables and
data and supplies each meta-step's micro-batches; this module starts the engine (resuming
from a checkpoint when asked) and runs, per meta-step, each rank's GAS micro-batches (T
tasks each): fused embedding lookup, inner loop per task, outer loss -> ``engine.backward``
-> ``engine.step`` (DeepSpeed applies the update at the accumulation boundary, after
averaging across ranks); then checkpoints, metrics, the workload's final save and scoring,
and ``summary.json``.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from gmeta_ds import checkpoint
from gmeta_ds.config import RunConfig, config_to_dict
from gmeta_ds.ds_config import BatchPlan, zero_stage
from gmeta_ds.engine import ds_engine, ds_internals
from gmeta_ds.engine.dist import all_mean, collective_phase
from gmeta_ds.errors import ConfigError
from gmeta_ds.outputs import WEIGHTS_FILE  # noqa: F401 - workloads.ctr reads it here
from gmeta_ds.outputs import check_earlier_run, continues_run, remove_earlier_outputs
from gmeta_ds.meta_engine import MetaEngine, checkpoint_meta, fault_stop
from gmeta_ds.meta_engine import start_engine as start_meta_engine
from gmeta_ds.profiling import PhaseProfiler, phase, write_profile

# Where the learner holds MeLU's tables: MetaLearner.net (MeLU) .embedding (its tables,
# ``weights.<table>``); the checksums' embedding part and the unsharded names of gathered tables.
EMBEDDING_PREFIX = "net.embedding."


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
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resumed_at]
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


def run_phase(cfg: RunConfig, phase: str):
    """`collective_phase` for this run: a collective that exceeds ``train.collective_timeout_s``
    in it raises `CollectiveTimeout` naming ``phase`` and the last complete checkpoint."""
    return collective_phase(phase, cfg.train.collective_timeout_s,
                            checkpoint.checkpoint_root(cfg.output_dir) / checkpoint.LATEST)


def train_loop(cfg: RunConfig, meta, loader, plan: BatchPlan, rank: int, log: MetricsLog,
               resume: dict | None = None, ckpt_meta: dict | None = None) -> dict:
    """Run meta-steps up to ``train.meta_steps`` on ``meta`` (a `meta_engine.MetaEngine`) with this
    rank's micro-batches from ``loader`` (from a checkpoint's position when ``resume`` holds
    its manifest), logging to ``log`` and checkpointing every ``train.checkpoint_every``
    steps and at the end; returns the last record."""
    engine, sharded = meta.engine, meta.embeddings
    first = 0
    if resume is not None:
        loader.load_state_dict(resume["loader"])
        first = resume["step"]
    meta.step = first
    comm = dense_allreduce_bytes(engine.module, plan.world_size)
    bar = tqdm(total=cfg.train.meta_steps, initial=first, disable=rank != 0 or not cfg.train.progress,
               desc="meta-train", unit="step")
    every = cfg.train.checkpoint_every
    profiler = PhaseProfiler(cfg.train.profile_steps, cfg.train.profile_warmup,
                             Path(cfg.output_dir) / "profile" if cfg.train.profile_trace else None)
    record, window_start, window_steps, padding = {}, time.perf_counter(), 0, 0.0
    seen: dict = {}  # dynamic tables' lookups and hits at the last log line
    window_cpu = time.process_time()
    skipped, last_query, last_support = 0, float("nan"), float("nan")
    try:
        for step in range(first, cfg.train.meta_steps):
            fault_stop(f"{step + 1}:{rank}:start")
            profiler.start_step()
            with run_phase(cfg, f"meta-step {step + 1}"):
                with phase("data"):
                    batches = loader.next()
                stats = meta.meta_step(batches)
            profiler.end_step()
            spent, spent_cpu = profiler.take_overhead()
            window_start += spent
            window_cpu += spent_cpu
            if stats.skipped:
                skipped += 1
                if rank == 0:
                    bar.write(f"meta-step {step + 1}: non-finite loss, skipped on every rank "
                              f"({skipped} so far)")
            else:
                window_steps += 1
                padding += stats.padding_efficiency
                last_query, last_support = stats.query_loss, stats.support_loss
            last = step + 1 == cfg.train.meta_steps
            if every and ((step + 1) % every == 0 or last):
                with run_phase(cfg, f"checkpoint save at step {step + 1}"):
                    checkpoint.save(engine, sharded, loader.state_dict(), step + 1, cfg.output_dir,
                                    cfg.train.keep_last, ckpt_meta or {})
            if (step + 1) % cfg.train.log_every and not last:
                bar.update(1)
                continue
            cpu = time.process_time() - window_cpu  # this process, all its threads
            counters = sharded.dynamic_counters() if sharded else {}
            with run_phase(cfg, f"meta-step {step + 1}"):
                query, support, pad, cpu_mean, *dynamic = all_mean(
                    [last_query, last_support, padding / max(1, window_steps), cpu,
                     *[c[k] for c in counters.values() for k in DYNAMIC_COUNTERS]])
            elapsed = time.perf_counter() - window_start
            tasks = window_steps * plan.tasks_per_meta_step
            record = {"step": step + 1, "tasks": (step + 1) * plan.tasks_per_meta_step,
                      "query_loss": query, "support_loss": support,
                      "tasks_per_s": tasks / elapsed,
                      "cpu_s_per_task": cpu_mean * plan.world_size / tasks if tasks else None,
                      "padding_efficiency": pad, "skipped_steps": skipped,
                      "dense_allreduce_bytes": comm * window_steps,
                      "embedding_comm_bytes": sharded.stats.total_sent() if sharded else 0}
            if sharded:
                record["embedding_comm"] = sharded.stats.as_dict()
                sharded.stats.reset()
            if counters:
                record["dynamic_tables"] = dynamic_record(counters, dynamic, plan.world_size, seen)
            log.write(record)
            bar.set_postfix(query_loss=f"{query:.4f}", tasks_per_s=f"{record['tasks_per_s']:.0f}")
            bar.update(1)
            window_start, window_steps, padding = time.perf_counter(), 0, 0.0
            window_cpu = time.process_time()
    finally:
        loader.close()
        bar.close()
    if cfg.train.profile_steps:
        with run_phase(cfg, "profile summary"):
            report = write_profile(profiler, Path(cfg.output_dir), rank, plan.world_size,
                                   {"world_size": plan.world_size, "batch": plan.describe(),
                                    "zero_stage": zero_stage(meta.ds_config)})
        if report is not None and cfg.train.progress:
            from gmeta_ds.profiling import table

            print(f"gmeta-ds: per-phase time of {profiler.recorded} profiled meta-steps (ms per "
                  f"meta-step; collectives in brackets), {cfg.output_dir}/profile.json:\n"
                  f"{table(report)}", flush=True)
    return record


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically: readers never see a half-written file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def start_engine(cfg: RunConfig, built, ds_config: dict, plan: BatchPlan, rank: int,
                 ckpt_meta: dict) -> tuple[MetaEngine, dict | None]:
    """`meta_engine.start_engine` for this run (``train.resume``, ``output_dir``, the seed and
    ``train.nonfinite``): (the engine, the resumed checkpoint's state or None)."""
    return start_meta_engine(built.learner, ds_config, plan, built.sharded, built.tables, rank, cfg.seed,
                             cfg.train.nonfinite, cfg.train.resume, cfg.output_dir, ckpt_meta)


def completed_run(cfg: RunConfig) -> str | None:
    """With ``train.resume``, a message when there is nothing left to do: the checkpoint it
    names is at or beyond ``train.meta_steps`` and ``summary.json`` records that run as
    finished at that step (a scheduler's requeue of a finished job). Read-only; every rank
    calls it before the first collective."""
    found = checkpoint.find(cfg.train.resume, cfg.output_dir) if cfg.train.resume else None
    if found is None:
        return None
    step = checkpoint.read_manifest(found)["step"]
    if step < cfg.train.meta_steps:
        return None
    summary_path = Path(cfg.output_dir) / "summary.json"
    try:  # another run's checkpoint (outside OUTPUT_DIR/checkpoints) finished nothing here
        finished = continues_run(cfg, found) and json.loads(summary_path.read_text()).get("meta_steps") == step
    except (OSError, ValueError, AttributeError):
        finished = False
    if not finished:
        raise ConfigError([f"train.meta_steps: {cfg.train.meta_steps} is not above the step of the "
                           f"checkpoint to resume ({found}, meta-step {step}) and {summary_path} does "
                           "not record that run as finished; raise train.meta_steps to train further"])
    return (f"the run is already complete: {found} is at meta-step {step} (train.meta_steps="
            f"{cfg.train.meta_steps}) and {summary_path} records it; nothing to do, outputs left as "
            "they are (raise train.meta_steps to train further)")


def resumed_from(resume: dict | None) -> dict | None:
    """The summary's ``resumed_from``: where `start_engine` resumed from, or None."""
    if resume is None:
        return None
    return {"checkpoint": str(resume["checkpoint"]), "step": resume["step"],
            "world_size": resume["world_size"], "optimizer_restored": resume["optimizer_restored"]}


def train(cfg: RunConfig, ds_config: dict, plan: BatchPlan, rank: int, workload=None,
          prepared=None, runtime_rss_mib: float | None = None) -> dict:
    """The one training loop of every workload (``task:``): build (the workload), start the
    engine (resuming when asked), meta-train, gather, save and score (the workload), write
    ``summary.json``; returns the summary (rank 0; {} elsewhere). ``prepared``: what the
    workload's preflight returned (the CLI runs it before the first collective).
    ``runtime_rss_mib``: this process's resident size before any model or data was built
    (the CLI measures it), reported next to the resident size after training so the memory
    the model's state holds between steps can be read off (`peak_rss_per_rank`)."""
    from gmeta_ds.workloads import get_workload

    workload = workload or get_workload(cfg.task)
    start = time.perf_counter()
    out_dir = Path(cfg.output_dir)
    replaced = check_earlier_run(cfg)  # the CLI ran it before the first collective already
    out_dir.mkdir(parents=True, exist_ok=True)
    built = workload.build(cfg, rank, plan.world_size, prepared)
    ckpt_meta = checkpoint_meta(built.learner, built.sharded, built.field_names, cfg.meta.algorithm)
    meta, resume = start_engine(cfg, built, ds_config, plan, rank, ckpt_meta)
    engine, ds_config = meta.engine, meta.ds_config
    if replaced:  # every check passed: only now is anything of the earlier run removed
        if plan.world_size > 1:  # every rank has loaded what it resumes (it may lie in output_dir)
            with run_phase(cfg, "engine start"):
                dist.barrier()
        if rank == 0:
            remove_earlier_outputs(out_dir, replaced)
    meta.fields = built.extra.get("lookup_fields", [])
    log = MetricsLog(out_dir, rank == 0, cfg.train.tensorboard, resume["step"] if resume else 0)
    try:
        last = train_loop(cfg, meta, workload.batches(cfg, built, plan, rank), plan, rank, log, resume,
                          ckpt_meta)
    except BaseException:
        log.close()
        raise
    training_peak = vmhwm_mib()  # before the tables are gathered for saving
    gc.collect()
    between_steps = rss_mib()  # the model's state, DeepSpeed's buffers, the data: no activations
    held_tensors = host_tensor_mib()
    with run_phase(cfg, "final gather"):
        dense, embedding = ds_engine.checksums(engine.module, EMBEDDING_PREFIX)
        if built.sharded is not None:
            embedding = built.sharded.checksum()
    evaluation, extras = workload.finish(cfg, engine, built, rank, plan.world_size)
    log.write_eval(evaluation, cfg.train.meta_steps)
    log.close()
    with run_phase(cfg, "evaluation (waiting for rank 0)"):
        peak_rss = peak_rss_per_rank(training_peak, getattr(built, "data", None),  # collective
                                     runtime_rss_mib, between_steps, held_tensors)
    summary = {}
    if rank == 0:
        summary = {"task": cfg.task, "world_size": plan.world_size, "meta_steps": cfg.train.meta_steps,
                   "resumed_from": resumed_from(resume),
                   "tasks_seen": cfg.train.meta_steps * plan.tasks_per_meta_step,
                   "final_query_loss": last.get("query_loss"), "dense_checksum": dense,
                   "embedding_checksum": embedding, "eval": evaluation,
                   "vectorize": engine.module.algorithm.vectorize,
                   "split_body": getattr(engine.module, "active_split", None) is not None,
                   "batch": plan.describe(), "ds_config": ds_config,
                   "config": config_to_dict(cfg), **extras,
                   "peak_rss_mib_per_rank": peak_rss, "elapsed_s": time.perf_counter() - start}
        write_json(out_dir / "summary.json", summary)
        if resume is not None:  # it scored the earlier run's weights, replaced just now
            (out_dir / "eval.json").unlink(missing_ok=True)
    if dist.is_initialized():
        with run_phase(cfg, "evaluation (waiting for rank 0)"):
            dist.barrier()  # other ranks wait for rank 0's evaluation before tearing down
    return summary


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
