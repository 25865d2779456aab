"""The meta-training loop on a DeepSpeed engine, written out top to bottom.

Per meta-step, each rank runs its GAS micro-batches (T tasks each): fused embedding lookup,
inner loop per task, outer loss -> ``engine.backward`` -> ``engine.step`` (DeepSpeed applies
the update at the accumulation boundary, after averaging across ranks).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from gmeta_ds import checkpoint
from gmeta_ds.algorithms import MetaLearner, build_algorithm
from gmeta_ds.algorithms.base import embed_batch
from gmeta_ds.config import RunConfig, config_to_dict
from gmeta_ds.data.builder import TaskData, build_tasks
from gmeta_ds.data.sampler import MetaBatchSampler
from gmeta_ds.data.synthetic import SyntheticData, generate_synthetic, synthetic_fields
from gmeta_ds.data.loader import TaskLoader, padding_efficiency, task_lengths
from gmeta_ds.data.tasks import TaskBatch, single_fields
from gmeta_ds.ds_config import BatchPlan, zero_stage
from gmeta_ds.engine import ds_engine
from gmeta_ds.embedding.plan import ShardingPlan, plan_from_config
from gmeta_ds.embedding.sharded import ShardedEmbeddingCollection
from gmeta_ds.engine.dist import all_mean, collective_phase
from gmeta_ds.evaluation import HEADLINE, evaluate, predict, score, train_baseline
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.inner import LOSSES
from gmeta_ds.models.melu import build_melu, melu_tables

WEIGHTS_FILE = "model.safetensors"
# "STEP:RANK": that rank SIGSTOPs itself (alive but stuck) in meta-step STEP (1-based) just before
# its last micro-batch's backward, so its peers wait in DeepSpeed's gradient all-reduce;
# "STEP:RANK:start": at the start of meta-step STEP (peers wait in our first collective). Tests only.
FAULT_STOP_ENV = "GMETA_DS_FAULT_STOP_AT"


def build_data(cfg: RunConfig) -> SyntheticData | TaskData:
    """The run's tasks (deterministic by seed: every rank builds the same ones): generated,
    or built from an interaction log on disk (cached, data/builder.py)."""
    if cfg.data.source == "synthetic":
        return generate_synthetic(cfg.data.synthetic, cfg.seed)
    return build_tasks(cfg.data, cfg.seed)


def preflight(cfg: RunConfig, world_size: int) -> None:
    """Checks that need the model's shape but no data or process group (run on every rank
    before the first collective): the embedding plan and what ``meta.adapt`` matches."""
    if cfg.data.source == "synthetic":
        fields = synthetic_fields(cfg.data.synthetic)
    else:
        fields = build_data(cfg).fields  # cached after the first build
    if cfg.embedding.sharding == "sharded":
        embedding_plan(cfg, fields, world_size)
    build_learner(cfg, fields, with_tables=False)


def build_learner(cfg: RunConfig, fields, with_tables: bool = True) -> MetaLearner:
    """Model + algorithm, initialised from the run seed (identical on every rank). Without
    tables when they are sharded outside the engine."""
    torch.manual_seed(cfg.seed)
    net = build_melu(fields, cfg.model.embed_dim, cfg.model.hidden, cfg.embedding, cfg.seed, with_tables)
    # meta.vectorize: auto -- activations of one task's padded rows through the MLP, kept for
    # every inner step and the outer pass (x3: values, gradients, second-order terms).
    rows = cfg.data.synthetic.max_interactions if cfg.data.source == "synthetic" else cfg.data.max_interactions
    width = len(fields) * cfg.model.embed_dim + sum(cfg.model.hidden)
    per_task = rows * width * 4 * (cfg.meta.inner_steps + 1) * 3
    return MetaLearner(net, build_algorithm(cfg.meta, label_kind(cfg), per_task))


def label_kind(cfg: RunConfig) -> str:
    """binary (clicks; synthetic data is always binary) or regression (ratings)."""
    return "binary" if cfg.data.source == "synthetic" else cfg.data.label


def embedding_plan(cfg: RunConfig, fields, world_size: int) -> ShardingPlan:
    """The sharding plan of the model's tables (``embedding.sharding: sharded``)."""
    return plan_from_config(melu_tables(fields, cfg.model.embed_dim, cfg.embedding), cfg.embedding,
                            world_size)


def build_sharded(cfg: RunConfig, fields, rank: int, world_size: int) -> ShardedEmbeddingCollection | None:
    """This rank's shards, or None when tables are replicated inside the engine."""
    if cfg.embedding.sharding != "sharded":
        return None
    return ShardedEmbeddingCollection(embedding_plan(cfg, fields, world_size), rank, cfg.seed,
                                      cfg.embedding.bad_ids, cfg.embedding.dedup)


def eval_inner_steps(cfg: RunConfig) -> int:
    return cfg.meta.inner_steps if cfg.eval.inner_steps == "auto" else int(cfg.eval.inner_steps)


class MetricsLog:
    """Rank 0's ``metrics.jsonl`` (one JSON object per logged meta-step, flushed as written)
    and, with ``train.tensorboard``, the same scalars as TensorBoard events under
    ``OUTPUT_DIR/tensorboard`` (nested dicts become ``a/b`` tags)."""

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool = True, resumed_at: int = 0):
        path = output_dir / "metrics.jsonl"
        kept = []
        if enabled and resumed_at and path.is_file():  # keep the records up to the checkpoint
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resumed_at]
        self.file = open(path, "w") if enabled else None
        if self.file and kept:
            self.file.write("\n".join(kept) + "\n")
        self.board = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(str(output_dir / "tensorboard"))

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


def _scalars(record: dict, prefix: str = ""):
    """(tag, number) pairs of a nested metrics dict."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield prefix + key, value


@dataclass
class StepStats:
    query_loss: float
    support_loss: float
    padding_efficiency: float
    skipped: bool = False


class NonFiniteLoss(RuntimeError):
    """A meta-step's outer loss was NaN/inf on some rank (``train.nonfinite: abort``)."""


def _nonfinite_anywhere(finite_here: bool) -> bool:
    """Whether the loss is NaN/inf on any rank (one small all-reduce when world > 1)."""
    bad = torch.tensor([0.0 if finite_here else 1.0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad)
    return bad.item() > 0


def meta_step(engine, sharded: ShardedEmbeddingCollection | None, fields: list[str],
              batches: list[TaskBatch], step: int = 0, nonfinite: str = "abort") -> StepStats:
    """One outer step: every micro-batch of this rank through backward, then the updates
    (DeepSpeed's at its accumulation boundary; the sparse optimizers' after the last one).

    Before each backward the outer loss is checked for NaN/inf on every rank: ``abort`` raises
    `NonFiniteLoss` on all ranks naming the meta-step, rank(s) and task ids; ``skip`` (one
    micro-batch per meta-step) drops the meta-step on all ranks, so no update happens at all."""
    query, support = [], []
    if engine.device.type != "cpu":  # batches are collated on the host
        batches = [ds_engine.to_device(b, engine.device) for b in batches]
    for batch in batches:
        rows = (embed_batch(lambda ids, multi: sharded.lookup_fields(ids, fields, multi), batch)
                if sharded else None)
        with ds_engine.gathered(engine.module):  # ZeRO-3: full parameters for this micro-step
            out = engine(batch, rows)
            finite = bool(torch.isfinite(out.loss.detach()).all())
            bad = _nonfinite_anywhere(finite)
            if not bad:
                if batch is batches[-1]:
                    _fault_stop(f"{step + 1}:{_rank()}")
                engine.backward(out.loss)
        if bad:
            where = _who_is_nonfinite(finite, batch)
            if nonfinite == "abort":
                raise NonFiniteLoss(f"meta-step {step + 1}: non-finite outer loss on " + "; ".join(
                    f"rank {r} (tasks {ids})" for r, ids in where) + " (train.nonfinite: abort; "
                    "'skip' drops such meta-steps instead)")
            if sharded is not None:
                for p in sharded.parameters():
                    p.grad = None
            return StepStats(float("nan"), float("nan"), padding_efficiency(batch), skipped=True)
        engine.step()
        query.append(out.query_loss.item())
        support.append(out.support_loss.item())
    if sharded is not None:
        sharded.step()
    padding = sum(padding_efficiency(b) for b in batches) / len(batches)
    return StepStats(sum(query) / len(query), sum(support) / len(support), padding)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _fault_stop(point: str) -> None:
    """Fault injection for the reliability tests (`FAULT_STOP_ENV`)."""
    if os.environ.get(FAULT_STOP_ENV) == point:
        os.kill(os.getpid(), signal.SIGSTOP)


def _who_is_nonfinite(finite: bool, batch: TaskBatch) -> list[tuple[int, list[int]]]:
    """(rank, task ids of its micro-batch) of every rank whose loss is not finite."""
    mine = None if finite else batch.task_ids.tolist()
    world = dist.get_world_size() if dist.is_initialized() else 1
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    return [(r, ids) for r, ids in enumerate(everyone) if ids is not None]


def dense_allreduce_bytes(module: torch.nn.Module, world: int) -> int:
    """Bytes each rank sends per meta-step in a ring all-reduce of the gradients."""
    grad_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in module.parameters())
    return int(2 * (world - 1) / world * grad_bytes) if world > 1 else 0


def run_phase(cfg: RunConfig, phase: str):
    """`collective_phase` for this run: a collective that exceeds ``train.collective_timeout_s``
    in it raises `CollectiveTimeout` naming ``phase`` and the last complete checkpoint."""
    return collective_phase(phase, cfg.train.collective_timeout_s,
                            checkpoint.checkpoint_root(cfg.output_dir) / checkpoint.LATEST)


def train_loop(cfg: RunConfig, engine, sharded, data: SyntheticData, plan: BatchPlan, rank: int,
               log: MetricsLog, resume: dict | None = None, ckpt_meta: dict | None = None) -> dict:
    """Run meta-steps up to ``train.meta_steps`` (from a checkpoint's position when ``resume``
    holds its manifest), logging to ``log`` and checkpointing every
    ``train.checkpoint_every`` steps and at the end; returns the last record."""
    lengths = task_lengths(data.train) if cfg.data.bucket_by_length else None
    sampler = MetaBatchSampler(len(data.train), plan.tasks_per_micro_batch, plan.grad_accum_steps,
                               plan.world_size, rank, cfg.seed, lengths)
    loader = TaskLoader(data.train, sampler, cfg.data.prefetch)
    first = 0
    if resume is not None:
        loader.load_state_dict(resume["loader"])
        first = resume["step"]
    fields = [f.name for f in single_fields(data.fields)]
    comm = dense_allreduce_bytes(engine.module, plan.world_size)
    bar = tqdm(total=cfg.train.meta_steps, initial=first, disable=rank != 0 or not cfg.train.progress,
               desc="meta-train", unit="step")
    every = cfg.train.checkpoint_every
    record, window_start, window_steps, padding = {}, time.perf_counter(), 0, 0.0
    skipped, last_query, last_support = 0, float("nan"), float("nan")
    try:
        for step in range(first, cfg.train.meta_steps):
            _fault_stop(f"{step + 1}:{rank}:start")
            with run_phase(cfg, f"meta-step {step + 1}"):
                stats = meta_step(engine, sharded, fields, loader.next(), step, cfg.train.nonfinite)
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
            with run_phase(cfg, f"meta-step {step + 1}"):
                query, support, pad = all_mean([last_query, last_support, padding / max(1, window_steps)])
            elapsed = time.perf_counter() - window_start
            record = {"step": step + 1, "tasks": (step + 1) * plan.tasks_per_meta_step,
                      "query_loss": query, "support_loss": support,
                      "tasks_per_s": window_steps * plan.tasks_per_meta_step / elapsed,
                      "padding_efficiency": pad, "skipped_steps": skipped,
                      "dense_allreduce_bytes": comm * window_steps,
                      "embedding_comm_bytes": sharded.stats.total_sent() if sharded else 0}
            if sharded:
                record["embedding_comm"] = sharded.stats.as_dict()
                sharded.stats.reset()
            log.write(record)
            bar.set_postfix(query_loss=f"{query:.4f}", tasks_per_s=f"{record['tasks_per_s']:.0f}")
            bar.update(1)
            window_start, window_steps, padding = time.perf_counter(), 0, 0.0
    finally:
        loader.close()
        bar.close()
    return record


def run_evaluation(cfg: RunConfig, learner: MetaLearner, data, rank: int = 0, world: int = 1) -> dict:
    """Cold-start metrics of the meta-learned model (the held-out tasks split over the ranks,
    predictions gathered on rank 0) and of the non-meta baseline (rank 0); with the four-state
    split, the same per state under ``states``. Collective when ``world`` > 1; returns {} on
    other ranks."""
    kind = learner.algorithm.kind
    held_out = data.valid if cfg.eval.split == "valid" else data.test
    sets = {"test": held_out, **(getattr(data, "states", {}) if cfg.eval.split == "test" else {})}
    scores = {name: _distributed_score(cfg, learner, tasks, rank, world) for name, tasks in sets.items()}
    if rank != 0:
        return {}
    if cfg.eval.baseline:
        baseline = build_learner(cfg, data.fields)
        train_baseline(baseline.net, data.train, cfg.eval.baseline_epochs,
                       cfg.eval.baseline_batch_size, cfg.eval.baseline_lr, cfg.seed, LOSSES[kind])
        for name, tasks in sets.items():
            scores[name].update(_baseline_scores(cfg, baseline, tasks, kind))
    result = {**scores.pop("test"), "split": cfg.eval.split}
    if scores:
        result["states"] = scores
    return result


def _distributed_score(cfg: RunConfig, learner: MetaLearner, tasks, rank: int, world: int) -> dict:
    """Scores of ``tasks`` predicted by all ranks (tasks r::W on rank r), on rank 0."""
    lrs = learner.algorithm.learning_rates(learner)
    mine = predict(learner, lrs, tasks, eval_inner_steps(cfg), cfg.eval.tasks_per_batch,
                   np.arange(rank, len(tasks), world))
    parts = [mine]
    if world > 1:
        parts = [None] * world if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
    if rank != 0:
        return {}
    if len(tasks) == 0:
        return {"tasks": 0}
    return {**score(parts, learner.algorithm.kind), "tasks": len(tasks)}


def _baseline_scores(cfg: RunConfig, baseline: MetaLearner, tasks, kind: str) -> dict:
    """The baseline's headline metrics on ``tasks``, as is and fine-tuned on each support."""
    if len(tasks) == 0:
        return {}
    fixed = {n: cfg.meta.inner_lr for n in baseline.adapted_names()}
    base = evaluate(baseline, fixed, tasks, eval_inner_steps(cfg), cfg.eval.tasks_per_batch)
    out = {}
    for name in HEADLINE[kind]:
        out[f"baseline_{name}"] = base[f"{name}_no_adapt"]
        if cfg.eval.baseline_finetune:
            out[f"baseline_finetune_{name}"] = base[name]
    if kind == "binary":
        out["baseline_auc_per_task"] = base["auc_per_task_no_adapt"]
    return out


def full_state(module: torch.nn.Module, tables: dict) -> dict:
    """The learner's state dict (gathered under ZeRO-3; collective then) with sharded tables
    (gathered) under their unsharded names."""
    state = ds_engine.full_state_dict(module)
    state.update({f"net.embedding.weights.{name}": t for name, t in tables.items()})
    return state


def eval_learner(cfg: RunConfig, module: MetaLearner, data: SyntheticData, state: dict) -> MetaLearner:
    """A single-process learner with unsharded tables holding ``state``."""
    if module.net.embedding is not None and not ds_engine.is_partitioned(module):
        return module
    learner = build_learner(cfg, data.fields, with_tables=True)
    learner.load_state_dict(state)
    return learner


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically: readers never see a half-written file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def checkpoint_meta(cfg: RunConfig, module: torch.nn.Module, sharded, fields) -> dict:
    """What a checkpoint must match to load into this run: tables, fields, dense shapes."""
    tables = ({n: [p.table.num_rows, p.table.dim] for n, p in sharded.plan.tables.items()}
              if sharded is not None else {})
    return {"tables": tables, "fields": [f.name for f in fields], "algorithm": cfg.meta.algorithm,
            "dense_shapes": {n: list(v.shape) for n, v in module.state_dict().items()}}


def start_engine(cfg: RunConfig, learner, ds_config: dict, plan: BatchPlan, sharded,
                 ckpt_meta: dict):
    """The DeepSpeed engine, restored from ``train.resume`` when set: (engine, the resumed
    checkpoint's state or None, the ds_config used)."""
    found = checkpoint.find(cfg.train.resume, cfg.output_dir) if cfg.train.resume else None
    if not dist.is_initialized() or dist.get_rank() == 0:
        clear_stale_outputs(Path(cfg.output_dir), fresh=found is None)
    universal = manifest = None
    if found is not None:
        manifest = checkpoint.verify(found, ckpt_meta)
        if manifest["world_size"] != plan.world_size and zero_stage(ds_config) > 0:
            # ZeRO partitions were cut for the old world size: go through DeepSpeed's
            # universal checkpoint, which loads at any data-parallel size.
            universal = checkpoint.to_universal(found, cfg.output_dir, manifest)
            ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
    engine = ds_engine.initialize(learner, ds_config)
    resume = None
    if found is not None:
        resume = {**checkpoint.load(found, manifest, engine, sharded, universal), "checkpoint": found}
    return engine, resume, ds_config


# A run's results in output_dir, written at its end (metrics.jsonl is rewritten by MetricsLog).
RUN_OUTPUTS = ("summary.json", WEIGHTS_FILE, "eval.json")


def clear_stale_outputs(out_dir: Path, fresh: bool) -> list[Path]:
    """Remove what an earlier run left in ``out_dir`` that this run will write again (rank 0,
    before training): its summary, weights, evaluation and charts, so that a run that fails
    leaves nothing a reader could take for its own result (the text task's ``model/`` folder
    is replaced by save_pretrained at the end); on a fresh start (no checkpoint to
    resume) also its metrics, TensorBoard events and checkpoints, which a later
    ``train.resume: auto`` would otherwise mix with this run's. Returns what was removed."""
    names = RUN_OUTPUTS + (("metrics.jsonl", "tensorboard", "checkpoints") if fresh else ())
    removed = [out_dir / n for n in names if (out_dir / n).exists()]
    for path in removed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if fresh and any(p.name == "checkpoints" for p in removed):
        print(f"gmeta-ds: starting fresh (train.resume is not set or found no checkpoint): removed the "
              f"earlier run's checkpoints and outputs in {out_dir}", flush=True)
    return removed


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
    try:
        finished = json.loads(summary_path.read_text()).get("meta_steps") == step
    except (OSError, ValueError):
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


def train(cfg: RunConfig, ds_config: dict, plan: BatchPlan, rank: int) -> dict:
    """Meta-train, evaluate (rank 0) and write ``summary.json``; returns the summary."""
    start = time.perf_counter()
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = build_data(cfg)
    sharded = build_sharded(cfg, data.fields, rank, plan.world_size)
    learner = build_learner(cfg, data.fields, with_tables=sharded is None)
    ckpt_meta = checkpoint_meta(cfg, learner, sharded, data.fields)
    engine, resume, ds_config = start_engine(cfg, learner, ds_config, plan, sharded, ckpt_meta)
    log = MetricsLog(out_dir, rank == 0, cfg.train.tensorboard, resume["step"] if resume else 0)
    try:
        last = train_loop(cfg, engine, sharded, data, plan, rank, log, resume, ckpt_meta)
    except BaseException:
        log.close()
        raise
    training_peak = vmhwm_mib()  # before the tables are gathered for saving
    with run_phase(cfg, "final gather"):
        dense, embedding = ds_engine.checksums(engine.module)
        tables = {}
        if sharded is not None:
            embedding = sharded.checksum()
            tables = sharded.gather_tables(everywhere=cfg.eval.enabled)
        state = full_state(engine.module, tables)
    if rank == 0:
        ds_engine.save_weights(state, out_dir / WEIGHTS_FILE)
    evaluation = {}
    if cfg.eval.enabled:
        with run_phase(cfg, "evaluation"):
            evaluation = run_evaluation(cfg, eval_learner(cfg, engine.module, data, state), data,
                                        rank, plan.world_size)
    log.write_eval(evaluation, cfg.train.meta_steps)
    log.close()
    with run_phase(cfg, "final gather"):
        peak_rss = peak_rss_per_rank(training_peak)  # collective
    summary = {}
    if rank == 0:
        summary = {"world_size": plan.world_size, "meta_steps": cfg.train.meta_steps,
                   "resumed_from": resumed_from(resume),
                   "tasks_seen": cfg.train.meta_steps * plan.tasks_per_meta_step,
                   "final_query_loss": last.get("query_loss"), "dense_checksum": dense,
                   "embedding_checksum": embedding, "eval": evaluation,
                   "vectorize": engine.module.algorithm.vectorize,
                   "batch": plan.describe(), "ds_config": ds_config,
                   "config": config_to_dict(cfg), "elapsed_s": time.perf_counter() - start}
        summary["peak_rss_mib_per_rank"] = peak_rss
        write_json(out_dir / "summary.json", summary)
    if dist.is_initialized():
        with run_phase(cfg, "evaluation (waiting for rank 0)"):
            dist.barrier()  # other ranks wait for rank 0's evaluation before tearing down
    return summary


def vmhwm_mib() -> float | None:
    """This process image's peak resident size so far, MiB (Linux; None elsewhere)."""
    status = Path("/proc/self/status")
    hwm = [ln for ln in status.read_text().splitlines() if ln.startswith("VmHWM:")] if status.exists() else []
    return int(hwm[0].split()[1]) / 1024 if hwm else None


def peak_rss_per_rank(training_peak: float | None) -> list[dict]:
    """Every rank's peak resident memory, MiB (collective when world > 1): VmHWM after
    training and at the end (after gathering tables and evaluating), and ru_maxrss (on Linux
    it survives exec, so a launched rank starts at its launcher's resident size)."""
    import resource

    mine = {"training_vmhwm_mib": training_peak, "vmhwm_mib": vmhwm_mib(),
            "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
