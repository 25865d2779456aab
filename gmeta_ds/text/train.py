"""Meta-training a Hugging Face sequence classifier on few-shot episodes (``task: text``).

Same engine contract as the CTR trainer: per meta-step each rank runs its GAS micro-batches
of T episodes through `trainer.meta_step` (``engine.backward`` / ``engine.step``; ZeRO-3
micro-steps on gathered parameters). Episode ``i`` is a pure function of (seed, i), and
meta-step ``s`` uses the global episodes ``s*B .. s*B + B-1`` split in order over
(rank, micro-batch), so the same global batch trains the same model at any world size.
Evaluation (rank 0): held-out classes, unseen in training; the meta-learned initialisation
adapted on each episode's support vs. the same architecture fine-tuned from scratch.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from gmeta_ds import checkpoint
from gmeta_ds.algorithms import build_algorithm
from gmeta_ds.config import RunConfig, config_to_dict
from gmeta_ds.ds_config import BatchPlan
from gmeta_ds.engine import ds_engine
from gmeta_ds.engine.dist import all_mean
from gmeta_ds.functional.inner import masked_cross_entropy
from gmeta_ds.text.data import TextEpisodes, TextTasks, build_tasks, load_texts
from gmeta_ds.text.model import (SequenceClassifier, TextMetaLearner, activation_bytes_per_task,
                                 build_classifier, build_tokenizer)
from gmeta_ds.trainer import (MetricsLog, checkpoint_meta, meta_step, peak_rss_per_rank, resumed_from,
                              run_phase, start_engine, vmhwm_mib, write_json)

MODEL_DIR = "model"  # OUTPUT_DIR/model: save_pretrained of the meta-learned classifier + tokenizer


def build(cfg: RunConfig):
    """(tokenizer, tasks, learner): identical on every rank (deterministic from the seed)."""
    texts, labels = load_texts(cfg.text.data, cfg.seed)
    tokenizer = build_tokenizer(cfg.text, texts)
    tasks = build_tasks(texts, labels, tokenizer, cfg.text.data, cfg.seed)
    return tokenizer, tasks, build_learner(cfg, tokenizer)


def build_learner(cfg: RunConfig, tokenizer) -> TextMetaLearner:
    """The classifier at its initial weights (from the seed) with the configured algorithm."""
    model = build_classifier(cfg.text, tokenizer, cfg.seed)
    per_task = activation_bytes_per_task(cfg.text, model, cfg.meta.inner_steps)
    return TextMetaLearner(SequenceClassifier(model), build_algorithm(cfg.meta, "multiclass", per_task))


def episode_numbers(step: int, plan: BatchPlan, rank: int) -> list[list[int]]:
    """This rank's micro-batches of global episode numbers at meta-step ``step``."""
    t, gas = plan.tasks_per_micro_batch, plan.grad_accum_steps
    base = step * plan.tasks_per_meta_step
    return [[base + (rank * gas + m) * t + i for i in range(t)] for m in range(gas)]


def _loop(cfg: RunConfig, engine, tasks: TextTasks, plan: BatchPlan, rank: int, log: MetricsLog,
          first: int, ckpt_meta: dict) -> dict:
    record, start, steps = {}, time.perf_counter(), 0
    bar = tqdm(total=cfg.train.meta_steps, initial=first, disable=rank != 0 or not cfg.train.progress,
               desc="meta-train", unit="step")
    every = cfg.train.checkpoint_every
    try:
        for step in range(first, cfg.train.meta_steps):
            batches = [tasks.episodes("train", ids) for ids in episode_numbers(step, plan, rank)]
            with run_phase(cfg, f"meta-step {step + 1}"):
                stats = meta_step(engine, None, [], batches, step, cfg.train.nonfinite)
            steps += 0 if stats.skipped else 1
            last = step + 1 == cfg.train.meta_steps
            if every and ((step + 1) % every == 0 or last):
                with run_phase(cfg, f"checkpoint save at step {step + 1}"):
                    checkpoint.save(engine, None, {"episodes": "by meta-step"}, step + 1, cfg.output_dir,
                                    cfg.train.keep_last, ckpt_meta)
            if (step + 1) % cfg.train.log_every == 0 or last:
                with run_phase(cfg, f"meta-step {step + 1}"):
                    query, support = all_mean([stats.query_loss, stats.support_loss])
                elapsed = time.perf_counter() - start
                record = {"step": step + 1, "tasks": (step + 1) * plan.tasks_per_meta_step,
                          "query_loss": query, "support_loss": support,
                          "tasks_per_s": steps * plan.tasks_per_meta_step / elapsed}
                log.write(record)
                bar.set_postfix(query_loss=f"{query:.4f}", tasks_per_s=f"{record['tasks_per_s']:.0f}")
                start, steps = time.perf_counter(), 0
            bar.update(1)
    finally:
        bar.close()
    return record


def adapted_accuracy(learner: TextMetaLearner, batch: TextEpisodes, steps: int) -> tuple[float, float]:
    """Query accuracy of each episode after ``steps`` inner steps on its support (first-order:
    no graph is kept), and before adapting; means over the episodes."""
    inner = learner.algorithm.inner_loop(learner, steps=steps, first_order=True)
    lrs = learner.algorithm.learning_rates(learner)
    params = dict(learner.net.named_parameters())
    theta = {n: params[n] for n in learner.adapted}
    adapted, plain = [], []
    for i in range(batch.support_y.shape[0]):
        xs = (batch.support_ids[i], batch.support_attention[i])
        xq = (batch.query_ids[i], batch.query_attention[i])
        with torch.enable_grad():
            fast, _ = inner.adapt_autograd(theta, lrs, xs, batch.support_y[i], batch.support_mask[i])
        with torch.no_grad():
            yq = batch.query_y[i]
            adapted.append((inner.logits(fast, xq).argmax(-1) == yq).float().mean().item())
            plain.append((inner.logits(theta, xq).argmax(-1) == yq).float().mean().item())
    return float(np.mean(adapted)), float(np.mean(plain))


def scratch_accuracy(cfg: RunConfig, tokenizer, batch: TextEpisodes) -> float:
    """The baseline: the same architecture from its initialisation (no meta-training),
    fine-tuned on each episode's support (all parameters, Adam, ``text.baseline_steps``)."""
    accuracies = []
    for i in range(batch.support_y.shape[0]):
        net = SequenceClassifier(build_classifier(cfg.text, tokenizer, cfg.seed)).to(batch.support_y.device)
        opt = torch.optim.Adam(net.parameters(), lr=cfg.text.baseline_lr)
        xs = (batch.support_ids[i], batch.support_attention[i])
        for _ in range(cfg.text.baseline_steps):
            opt.zero_grad()
            masked_cross_entropy(net(xs), batch.support_y[i], batch.support_mask[i]).backward()
            opt.step()
        with torch.no_grad():
            pred = net((batch.query_ids[i], batch.query_attention[i])).argmax(-1)
            accuracies.append((pred == batch.query_y[i]).float().mean().item())
    return float(np.mean(accuracies))


def evaluate(cfg: RunConfig, learner: TextMetaLearner, tokenizer, tasks: TextTasks,
             initial: TextMetaLearner | None = None) -> dict:
    """Accuracy on ``text.eval_episodes`` episodes of held-out classes (deterministic); with
    ``eval.baseline`` also of the initial model fine-tuned from scratch: with Adam for
    ``text.baseline_steps`` steps, and with the meta-learner's own inner loop (``initial``)."""
    numbers = list(range(cfg.text.eval_episodes))
    steps = cfg.meta.inner_steps if cfg.eval.inner_steps == "auto" else int(cfg.eval.inner_steps)
    adapted, plain, scratch, same = [], [], [], []
    for chunk in range(0, len(numbers), cfg.eval.tasks_per_batch):
        batch = tasks.episodes("test", numbers[chunk:chunk + cfg.eval.tasks_per_batch])
        batch = ds_engine.to_device(batch, next(learner.parameters()).device)
        a, p = adapted_accuracy(learner, batch, steps)
        n = batch.support_y.shape[0]
        adapted += [a] * n
        plain += [p] * n
        if cfg.eval.baseline:
            scratch += [scratch_accuracy(cfg, tokenizer, batch)] * n
            if initial is not None:
                same += [adapted_accuracy(initial, batch, steps)[0]] * n
    d = cfg.text.data
    result = {"episodes": len(numbers), "ways": d.ways, "shots": d.shots, "queries": d.queries,
              "held_out_classes": len(tasks.class_names["test"]), "inner_steps": steps,
              "accuracy": float(np.mean(adapted)), "accuracy_no_adapt": float(np.mean(plain)),
              "chance": 1.0 / d.ways}
    if scratch:
        result["baseline_scratch_accuracy"] = float(np.mean(scratch))
        result["baseline_scratch_steps"] = cfg.text.baseline_steps
    if same:
        result["baseline_scratch_inner_loop_accuracy"] = float(np.mean(same))
    return result


def train_text(cfg: RunConfig, ds_config: dict, plan: BatchPlan, rank: int, built=None) -> dict:
    """Meta-train, save the classifier (``OUTPUT_DIR/model``, Hugging Face format), evaluate
    on held-out classes (rank 0) and write ``summary.json``; returns the summary. ``built``:
    what `build` returned (the CLI builds before the first collective, to fail early)."""
    start = time.perf_counter()
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, tasks, learner = built or build(cfg)
    ckpt_meta = checkpoint_meta(cfg, learner, None, [])
    engine, resume, ds_config = start_engine(cfg, learner, ds_config, plan, None, ckpt_meta)
    log = MetricsLog(out_dir, rank == 0, cfg.train.tensorboard, resume["step"] if resume else 0)
    try:
        last = _loop(cfg, engine, tasks, plan, rank, log, resume["step"] if resume else 0, ckpt_meta)
    except BaseException:
        log.close()
        raise
    training_peak = vmhwm_mib()
    with run_phase(cfg, "final gather"):
        dense, _ = ds_engine.checksums(engine.module)
        state = ds_engine.full_state_dict(engine.module)  # collective under ZeRO-3
        peak_rss = peak_rss_per_rank(training_peak)  # collective
    summary = {}
    if rank == 0:
        final = build_learner(cfg, tokenizer)  # a plain float32 copy for saving and evaluation
        final.load_state_dict({k: v.float() for k, v in state.items()})
        final.to(engine.device)
        final.net.model.save_pretrained(str(out_dir / MODEL_DIR))
        tokenizer.save_pretrained(str(out_dir / MODEL_DIR))
        initial = build_learner(cfg, tokenizer).to(engine.device) if cfg.eval.enabled and cfg.eval.baseline else None
        evaluation = evaluate(cfg, final, tokenizer, tasks, initial) if cfg.eval.enabled else {}
        log.write_eval(evaluation, cfg.train.meta_steps)
        summary = {"task": "text", "world_size": plan.world_size, "meta_steps": cfg.train.meta_steps,
                   "resumed_from": resumed_from(resume),
                   "tasks_seen": cfg.train.meta_steps * plan.tasks_per_meta_step,
                   "final_query_loss": last.get("query_loss"), "dense_checksum": dense,
                   "embedding_checksum": 0.0, "eval": evaluation, "data": tasks.describe(),
                   "vectorize": learner.algorithm.vectorize,
                   "parameters": ds_engine.numel(engine.module), "batch": plan.describe(),
                   "ds_config": ds_config, "config": config_to_dict(cfg),
                   "peak_rss_mib_per_rank": peak_rss, "elapsed_s": time.perf_counter() - start}
        write_json(out_dir / "summary.json", summary)
    log.close()
    if dist.is_initialized():
        with run_phase(cfg, "evaluation (waiting for rank 0)"):
            dist.barrier()  # other ranks wait for rank 0's evaluation before tearing down
    return summary
