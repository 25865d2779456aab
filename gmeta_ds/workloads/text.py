"""The text workload (``task: text``): a Hugging Face sequence classifier meta-trained on
few-shot episodes, through the same training loop as every workload (`trainer.train`).

Episode ``i`` is a pure function of (seed, i), and meta-step ``s`` uses the global episodes ``s*B .. s*B + B-1`` split in order over
(rank, micro-batch), so the same global batch trains the same model at any world size.
Evaluation (rank 0): held-out classes, unseen in training; the meta-learned initialisation
adapted on each episode's support vs. the same architecture fine-tuned from scratch.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gmeta_ds.algorithms import build_algorithm
from gmeta_ds.config import RunConfig
from gmeta_ds.config.deepspeed import BatchPlan, dense_state_bytes, size_text
from gmeta_ds.engine import ds_engine
from gmeta_ds.engine.parallelize import check_split_body
from gmeta_ds.functional.inner import masked_cross_entropy
from gmeta_ds.text.data import TextEpisodes, TextTasks, build_tasks, load_texts
from gmeta_ds.text.model import (SequenceClassifier, TextMetaLearner, activation_bytes_per_task,
                                 build_classifier, build_tokenizer)
from gmeta_ds.run.outputs import run_phase
from gmeta_ds.workloads.base import Built, Workload, body_split_line

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


def adapted_accuracy(learner: TextMetaLearner, batch: TextEpisodes, steps: int) -> tuple[float, float]:
    """Query accuracy of each episode after ``steps`` inner steps on its support (first-order:
    no graph is kept), and before adapting; means over the episodes."""
    inner = learner.inner_loop(steps=steps, first_order=True)
    lrs = learner.learning_rates()
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


def scratch_accuracy(cfg: RunConfig, start: nn.Module, batch: TextEpisodes) -> float:
    """The baseline: the same architecture from its initialisation (``start``: the classifier
    as the run config builds it, before any meta-training), fine-tuned on each episode's
    support (all parameters, Adam, ``text.baseline_steps``); ``start`` itself is not changed."""
    accuracies = []
    for i in range(batch.support_y.shape[0]):
        net = copy.deepcopy(start).to(batch.support_y.device)
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
    ``eval.baseline`` also of the initial model (``initial``: the classifier the run config
    builds, before meta-training) fine-tuned from scratch: with Adam for
    ``text.baseline_steps`` steps, and with the meta-learner's own inner loop."""
    if cfg.eval.baseline and initial is None:
        initial = build_learner(cfg, tokenizer).to(next(learner.parameters()).device)
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
            scratch += [scratch_accuracy(cfg, initial.net, batch)] * n
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


class EpisodeLoader:
    """This rank's micro-batches of episodes, meta-step by meta-step (`episode_numbers`)."""

    def __init__(self, tasks: TextTasks, plan: BatchPlan, rank: int):
        self.tasks, self.plan, self.rank = tasks, plan, rank
        self.next_step = 0

    def next(self) -> list[TextEpisodes]:
        step, self.next_step = self.next_step, self.next_step + 1
        return [self.tasks.episodes("train", ids) for ids in episode_numbers(step, self.plan, self.rank)]

    def state_dict(self) -> dict:
        return {"episodes": "by meta-step", "next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = int(state["next_step"])

    def close(self) -> None:
        """Nothing to release: episodes are made on demand."""


class TextWorkload(Workload):
    name = "text"
    noun = "episodes"

    def preflight(self, cfg: RunConfig, world_size: int):
        prepared = build(cfg)  # tokenizer, episodes and learner: every rank, before any collective
        check_split_body(prepared[2])
        return prepared

    def build(self, cfg: RunConfig, rank: int, world_size: int, prepared=None) -> Built:
        tokenizer, tasks, learner = prepared or build(cfg)
        return Built(learner, tasks, extra={"tokenizer": tokenizer})

    def batches(self, cfg: RunConfig, built: Built, plan: BatchPlan, rank: int) -> EpisodeLoader:
        return EpisodeLoader(built.data, plan, rank)

    def finish(self, cfg: RunConfig, engine, built: Built, rank: int, world: int) -> tuple[dict, dict]:
        """Rank 0 saves the classifier (``OUTPUT_DIR/model``, save_pretrained) and scores it on
        held-out classes; the other ranks wait in the loop's final barrier."""
        tokenizer, tasks = built.extra["tokenizer"], built.data
        # A plain float32 copy for saving and evaluation, on rank 0 only, filled one gathered
        # parameter at a time (no second full copy on any rank).
        final = build_learner(cfg, tokenizer) if rank == 0 else None
        with run_phase(cfg, "final gather"):
            ds_engine.gather_into(engine.module, final)  # collective under ZeRO-3
        if rank != 0:
            return {}, {}
        out_dir = Path(cfg.output_dir)
        final.to(engine.device)
        final.net.model.save_pretrained(str(out_dir / MODEL_DIR))
        tokenizer.save_pretrained(str(out_dir / MODEL_DIR))
        initial = (build_learner(cfg, tokenizer).to(engine.device)
                   if cfg.eval.enabled and cfg.eval.baseline else None)
        evaluation = evaluate(cfg, final, tokenizer, tasks, initial) if cfg.eval.enabled else {}
        return evaluation, {"data": tasks.describe(), "parameters": ds_engine.numel(engine.module)}

    def evaluate_saved(self, cfg: RunConfig, weights: str | None) -> dict:
        """Held-out-class accuracy of a saved classifier (default: OUTPUT_DIR/model)."""
        folder = weights or str(Path(cfg.output_dir) / MODEL_DIR)
        model_cfg = dataclasses.replace(cfg.text.model, pretrained=folder, tokenizer=folder)
        saved = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, model=model_cfg))
        tokenizer, tasks, learner = build(saved)
        # The baselines start from the run config's own initialisation (its text.model), as
        # `train` scored them, never from the meta-trained weights being evaluated.
        initial = build_learner(cfg, tokenizer) if cfg.eval.baseline else None
        return evaluate(cfg, learner, tokenizer, tasks, initial)

    def describe(self, cfg: RunConfig, ds_config: dict, plan: BatchPlan) -> list[str]:
        _, tasks, learner = build(cfg)
        n_params = sum(p.numel() for p in learner.parameters())
        dense = dense_state_bytes(ds_config, n_params, plan.world_size)
        return [f"data: {tasks.describe()}",
                f"model: {type(learner.net.model).__name__}, {n_params} parameters; adapted in the inner "
                f"loop: {len(learner.adapted)} tensors ({', '.join(learner.adapted[:6])}"
                f"{', ...' if len(learner.adapted) > 6 else ''}); tasks run "
                f"{'vectorized (vmap)' if learner.algorithm.vectorize else 'one by one (loop)'}",
                f"dense state per rank (DeepSpeed ZeRO-{dense['stage']}, {plan.world_size} rank(s)): "
                f"parameters {size_text(dense['params'])}, gradients {size_text(dense['grads'])}, "
                f"optimizer {size_text(dense['optimizer'])}", body_split_line(learner, ds_config)]

    def report(self, summary: dict, output_dir) -> list[str]:
        ev = summary.get("eval", {})
        lines = [f"done: {summary['meta_steps']} meta-steps, {summary['tasks_seen']} episodes on "
                 f"{summary['world_size']} rank(s) in {summary['elapsed_s']:.1f}s; final query loss "
                 f"{summary['final_query_loss']:.4f}"]
        if ev:
            parts = [f"meta-learned + adaptation {ev['accuracy']:.4f}",
                     f"without adaptation {ev['accuracy_no_adapt']:.4f}"]
            if "baseline_scratch_accuracy" in ev:
                parts.append(f"from scratch: {ev['baseline_scratch_steps']} Adam steps "
                             f"{ev['baseline_scratch_accuracy']:.4f}")
            if "baseline_scratch_inner_loop_accuracy" in ev:
                parts.append(f"from scratch, the same inner loop {ev['baseline_scratch_inner_loop_accuracy']:.4f}")
            parts.append(f"chance {ev['chance']:.4f}")
            lines.append(f"held-out classes, {ev['ways']}-way {ev['shots']}-shot accuracy: " + " | ".join(parts))
        lines.append(f"outputs: {output_dir}/summary.json, metrics.jsonl, {MODEL_DIR}/ (save_pretrained)")
        return lines
