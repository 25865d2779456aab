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

import gc
import json
import time
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from gmeta_ds.files import write_json
from gmeta_ds import checkpoint
from gmeta_ds.config import RunConfig, config_to_dict
from gmeta_ds.config.deepspeed import BatchPlan, zero_stage
from gmeta_ds.errors import ConfigError
from gmeta_ds.evaluation.scores import EVAL_PER_USER_FILE
from gmeta_ds.run.outputs import check_earlier_run, config_changes, continues_run, remove_earlier_outputs, run_phase
from gmeta_ds.meta_engine import EngineSpec, MetaEngine, arm_fault_stop, fault_stop
from gmeta_ds.meta_engine import start_engine as start_meta_engine
from gmeta_ds.engine.memory import host_tensor_mib, peak_rss_per_rank, rss_mib, vmhwm_mib
from gmeta_ds.run.profiling import PhaseProfiler, phase, write_profile
from gmeta_ds.run.run_log import Cadence, MetricsLog, StepWindow, dense_allreduce_bytes


def train_loop(cfg: RunConfig, meta, loader, plan: BatchPlan, rank: int, log: MetricsLog,
               resume: dict | None = None) -> dict:
    """Run meta-steps up to ``train.meta_steps`` on ``meta`` (a `meta_engine.MetaEngine`) with
    this rank's micro-batches from ``loader`` (from a checkpoint's position when ``resume``
    holds its manifest), checkpointing and logging to ``log`` as `run_log.Cadence` says;
    returns the last record."""
    meta.step = first = _restore_position(loader, resume)
    bar = tqdm(total=cfg.train.meta_steps, initial=first, disable=rank != 0 or not cfg.train.progress,
               desc="meta-train", unit="step")
    profiler = PhaseProfiler(cfg.train.profile_steps, cfg.train.profile_warmup,
                             Path(cfg.output_dir) / "profile" if cfg.train.profile_trace else None)
    window = StepWindow(plan.tasks_per_meta_step, plan.world_size,
                        dense_allreduce_bytes(meta.engine.module, plan.world_size), meta.embeddings,
                        sites=cfg.sites.count)
    cadence = Cadence(cfg.train.checkpoint_every, cfg.train.log_every, cfg.train.meta_steps)
    compiled = meta.engine.module.algorithm.compiled  # meta.compile: None when eager
    announce = compiled is not None and rank == 0  # the compile time, once, after it happened
    record = {}
    try:
        for step in range(first + 1, cfg.train.meta_steps + 1):  # 1-based
            fault_stop(f"{step}:{rank}:start")
            profiler.start_step()
            with run_phase(cfg, f"meta-step {step}"):
                with phase("data"):
                    batches = loader.next()
                stats = meta.meta_step(batches)
            profiler.end_step()
            if announce and (compiled.graphs or compiled.failure):
                bar.write(compile_line(compiled))
                announce = False
            window.exclude(*profiler.take_overhead())
            window.add(stats)
            if stats.skipped and rank == 0:
                bar.write(f"meta-step {step}: non-finite loss, skipped on every rank ({window.skipped} so far)")
            if cadence.checkpoint(step):
                with run_phase(cfg, f"checkpoint save at step {step}"):
                    checkpoint.save(meta.engine, meta.embeddings, loader.state_dict(), step, cfg.output_dir,
                                    cfg.train.keep_last, meta.ckpt_meta or {}, meta.checkpoint_extra())
            if cadence.log(step):
                with run_phase(cfg, f"meta-step {step}"):
                    record = window.record(step)
                if compiled is not None:  # cumulative: the first window's tasks_per_s includes it
                    record["compile_s"] = round(compiled.seconds, 3)
                log.write(record)
                bar.set_postfix(query_loss=f"{record['query_loss']:.4f}", tasks_per_s=f"{record['tasks_per_s']:.0f}")
            bar.update(1)
    finally:
        loader.close()
        bar.close()
    with run_phase(cfg, "synchronisation across sites"):
        meta.finish_sites()  # every site ends with the same weights (one site: nothing)
    _profile_summary(cfg, profiler, rank, plan, meta)
    return record


def compile_line(compiled) -> str:
    """The one line rank 0 prints after the first meta-step under ``meta.compile``."""
    if compiled.failure is not None:
        return f"meta.compile: eager ({compiled.failure})"
    return (f"meta.compile: the inner loop and query loss compiled in {compiled.seconds:.1f} s "
            f"({compiled.graphs} graph{'s' if compiled.graphs != 1 else ''} so far; summary.json's compile counts "
            "them all)")


def _restore_position(loader, resume: dict | None) -> int:
    """The loader at a resumed checkpoint's position; the meta-steps done (0 on a fresh run)."""
    if resume is None:
        return 0
    loader.load_state_dict(resume["loader"])
    return resume["step"]


def _profile_summary(cfg: RunConfig, profiler: PhaseProfiler, rank: int, plan: BatchPlan, meta) -> None:
    """With ``train.profile_steps``: profile.json (collective) and its table on stdout."""
    if not cfg.train.profile_steps:
        return
    with run_phase(cfg, "profile summary"):
        report = write_profile(profiler, Path(cfg.output_dir), rank, plan.world_size,
                               {"world_size": plan.world_size, "batch": plan.describe(),
                                "zero_stage": zero_stage(meta.ds_config)})
    if report is not None and cfg.train.progress:
        from gmeta_ds.run.profiling import table

        print(f"gmeta-ds: per-phase time of {profiler.recorded} profiled meta-steps (ms per "
              f"meta-step; collectives in brackets), {cfg.output_dir}/profile.json:\n"
              f"{table(report)}", flush=True)


def start_run_engine(cfg: RunConfig, built, ds_config: dict, plan: BatchPlan,
                     rank: int) -> tuple[MetaEngine, dict | None]:
    """`meta_engine.start_engine` for this run (``train.resume``, ``output_dir``, the seed,
    ``train.nonfinite``; its checkpoints name the data's fields and ``meta.algorithm``): (the
    engine, the resumed checkpoint's state or None)."""
    return start_meta_engine(EngineSpec(
        built.learner, ds_config, plan, built.sharded, built.tables, rank, cfg.seed, cfg.train.nonfinite,
        cfg.train.resume, cfg.output_dir, built.field_names, cfg.meta.algorithm, sites=cfg.sites))


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
        summary = json.loads(summary_path.read_text()) if continues_run(cfg, found) else {}
        finished = summary.get("meta_steps") == step
    except (OSError, ValueError, AttributeError):
        summary, finished = {}, False
    if not finished:
        raise ConfigError([f"train.meta_steps: {cfg.train.meta_steps} is not above the step of the "
                           f"checkpoint to resume ({found}, meta-step {step}) and {summary_path} does "
                           "not record that run as finished; raise train.meta_steps to train further"])
    changed = config_changes(summary.get("config"), cfg)
    if changed:
        raise ConfigError([(f"{summary_path} records a finished run of another configuration ({'; '.join(changed[:5])}"
                            f"{' ...' if len(changed) > 5 else ''}): this is not a requeue of it; train this "
                            "configuration in another output_dir (or afresh, without train.resume, with --overwrite)")])
    return (f"the run is already complete: {found} is at meta-step {step} (train.meta_steps="
            f"{cfg.train.meta_steps}) and {summary_path} records it; nothing to do, outputs left as "
            "they are (raise train.meta_steps to train further)")


def resumed_from(resume: dict | None) -> dict | None:
    """The summary's ``resumed_from``: where `start_run_engine` resumed from, or None."""
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
    arm_fault_stop()
    start = time.perf_counter()
    out_dir = Path(cfg.output_dir)
    replaced = check_earlier_run(cfg)  # the CLI ran it before the first collective already
    out_dir.mkdir(parents=True, exist_ok=True)
    built = workload.build(cfg, rank, plan.world_size, prepared)
    meta, resume = start_run_engine(cfg, built, ds_config, plan, rank)
    if replaced:  # every check passed: only now is anything of the earlier run removed
        if plan.world_size > 1:  # every rank has loaded what it resumes (it may lie in output_dir)
            with run_phase(cfg, "engine start"):
                dist.barrier()
        if rank == 0:
            remove_earlier_outputs(out_dir, replaced)
    meta.fields = built.extra.get("lookup_fields", [])
    log = MetricsLog(out_dir, rank == 0, cfg.train.tensorboard, resume["step"] if resume else 0)
    try:
        last = train_loop(cfg, meta, workload.batches(cfg, built, plan, rank), plan, rank, log, resume)
    except BaseException:
        log.close()
        raise
    memory = _after_training_memory()
    with run_phase(cfg, "final gather"):
        dense, embedding = meta.checksums()
    evaluation, extras = workload.finish(cfg, meta.engine, built, rank, plan.world_size)
    log.write_eval(evaluation, cfg.train.meta_steps)
    log.close()
    with run_phase(cfg, "evaluation (waiting for rank 0)"):
        peak_rss = peak_rss_per_rank(memory["training_peak"], getattr(built, "data", None),  # collective
                                     runtime_rss_mib, memory["between_steps"], memory["tensors"])
    summary = {}
    if rank == 0:
        summary = {"task": cfg.task, "world_size": plan.world_size, "meta_steps": cfg.train.meta_steps,
                   "resumed_from": resumed_from(resume),
                   "tasks_seen": cfg.train.meta_steps * plan.tasks_per_meta_step,
                   "final_query_loss": last.get("query_loss"), "dense_checksum": dense,
                   "embedding_checksum": embedding, "eval": evaluation, **_engine_facts(meta, plan),
                   "config": config_to_dict(cfg), **extras, **_sites_facts(meta, plan),
                   "peak_rss_mib_per_rank": peak_rss, "elapsed_s": time.perf_counter() - start}
        write_summary(out_dir, summary, resumed=resume is not None)
    if dist.is_initialized():
        with run_phase(cfg, "evaluation (waiting for rank 0)"):
            dist.barrier()  # other ranks wait for rank 0's evaluation before tearing down
    return summary


def _sites_facts(meta: MetaEngine, plan: BatchPlan) -> dict:
    """summary.json's ``sites`` across sites (rank 0 of site 0): the layout, the synchronisations
    and the bytes this site's ranks sent to other sites, per task of the whole run."""
    if meta.outer is None:
        return {}
    sites, outer = meta.outer.sites, meta.outer
    tasks = meta.step * plan.tasks_per_meta_step * sites.count
    return {"sites": {"count": sites.count, "ranks_per_site": sites.size, "sync_every": outer.every,
                      "delta_dtype": outer.dtype, "synchronisations": outer.synchronisations,
                      "tasks_seen_all_sites": tasks, "cross_site_bytes_site": outer.site_sent,
                      "cross_site_bytes_per_task": outer.site_sent * sites.count / max(tasks, 1)}}


def _after_training_memory() -> dict:
    """This rank's memory right after the loop: its peak so far (before the tables are
    gathered for saving), and, garbage collected, its resident size (the model's state,
    DeepSpeed's buffers, the data: no activations) and the tensor storage in it."""
    training_peak = vmhwm_mib()
    gc.collect()
    return {"training_peak": training_peak, "between_steps": rss_mib(), "tensors": host_tensor_mib()}


def _engine_facts(meta: MetaEngine, plan: BatchPlan) -> dict:
    """summary.json's facts of how the engine ran: vmap or loop, ZeRO-3's body split, the
    batch plan and the DeepSpeed config used (universal loading included when resumed)."""
    module = meta.engine.module
    compiled = module.algorithm.compiled
    return {"vectorize": module.algorithm.vectorize,
            "compile": compiled.facts() if compiled is not None else {"enabled": False},
            "split_body": module.active_split is not None,
            "batch": plan.describe(), "ds_config": meta.ds_config}


def write_summary(out_dir: Path, summary: dict, resumed: bool) -> None:
    """Rank 0's summary.json; a resumed run's eval.json and eval_per_user.csv (the earlier run's
    weights' scores) go."""
    write_json(out_dir / "summary.json", summary)
    if resumed:  # they scored the earlier run's weights, replaced just now
        (out_dir / "eval.json").unlink(missing_ok=True)
        (out_dir / EVAL_PER_USER_FILE).unlink(missing_ok=True)


