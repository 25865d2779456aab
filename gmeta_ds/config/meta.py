"""``meta``: the meta-learning algorithm, its inner loop and how tasks are grouped."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from gmeta_ds.config.checks import AUTO, check_positive

# Tasks per micro-batch when neither meta.tasks_per_micro_batch nor the DeepSpeed config sets
# one ("auto" on both sides), and the run config's own default.
DEFAULT_MICRO_BATCH = 32


@dataclass
class MetaConfig:
    """The meta-learning algorithm and how tasks are grouped."""

    algorithm: str = "maml"                # maml (second order) | fomaml | reptile | metasgd
    inner_steps: int = 1                   # inner-loop SGD steps on each task's support loss
    # Inner-loop learning rate (metasgd: the initial per-parameter rates).
    inner_lr: float = 0.1
    # Glob over adapted names -> multiplier of inner_lr (the first matching glob; others x1),
    # e.g. {"popularity.*": 4.0}: the offset adapts faster than the layers.
    inner_lr_scale: dict[str, float] = field(default_factory=dict)
    # Shrinkage of small supports: the inner loss is sum / (support rows + inner_loss_prior)
    # instead of the mean, so a task with n support rows adapts n / (n + prior) as far per step
    # (0 = the mean). Like the popularity baseline's offset prior: few rows, small update.
    inner_loss_prior: float = 0.0
    # The outer loss asks for each task's order too: query loss = BCE (MSE) + rank_weight x the
    # mean pairwise logistic loss over the task's query pairs that the labels order (a click
    # above a non-click), a smooth bound of 1 - per-user AUC. 0 = the pointwise loss alone.
    rank_weight: float = 0.0
    # The first warmup_steps meta-steps train the model on their tasks' rows without adaptation
    # (support and query alike, plain supervised training through the same engine and
    # optimizers), then meta-training starts from that initialisation. 0 = none.
    warmup_steps: int = 0
    # The outer loss also holds the initialisation to the data: + init_weight x the unadapted
    # model's loss on every row of the tasks (support and query), so meta-training keeps the
    # initialisation's own ranking while it learns to adapt. 0 = the algorithm's loss alone.
    init_weight: float = 0.0
    # With model.item_popularity and popularity.bias adapted: before the inner steps, each task's
    # offset is moved to the MAP of its support given the model's own logits (the popularity
    # baseline's offset fit, Gaussian prior of precision offset_first); null = off.
    offset_first: Union[float, None] = None
    # With model.item_popularity: after the inner steps, each task's logits get one constant so
    # that their mean over its support equals that of popularity + the task's MAP offset
    # (prior precision support_level): the adapted model ranks, the shrunk statistic sets the
    # user's level (InnerLoop.level_shift). Applies to the non-meta baseline's fine-tune too.
    support_level: Union[float, None] = None
    # Glob patterns over dense parameter names adapted in the inner loop (MeLU: decision layers).
    # Left at this default, the model's own default_adapt is used (two_tower: user_tower.*).
    adapt: list[str] = field(default_factory=lambda: ["mlp.*"])
    # T: DeepSpeed's train_micro_batch_size_per_gpu, in tasks.
    tasks_per_micro_batch: Union[int, str] = DEFAULT_MICRO_BATCH
    # B: DeepSpeed's train_batch_size; accumulation = B / (T x world size).
    tasks_per_meta_step: Union[int, str] = 64
    # Run a micro-batch's tasks with vmap (true), a per-task loop (false), or vmap when its
    # estimated activation memory fits vectorize_budget_mb ("auto").
    vectorize: Union[bool, str] = AUTO
    # "auto": a quarter of the memory available to this rank (free GPU memory, or host RAM).
    vectorize_budget_mb: Union[int, str] = AUTO
    # Compile the vectorized inner loop and query loss with torch.compile (true), run them eager
    # (false), or "auto": eager, as measured on the shipped configs on CPU (docs/performance.md,
    # "Compiled meta-step"). Needs the vmap path (meta.vectorize); a failed compile runs eager
    # with one warning naming the reason.
    compile: Union[bool, str] = AUTO
    # Run the model's non-adapted body once per micro-batch as an ordinary module call and the
    # inner loop on its head only (gmeta_ds.functional.split): "auto" under ZeRO-3, where the
    # body then stays partitioned, when the model offers a split for meta.adapt; true at every
    # ZeRO stage (an error if the model cannot be split); false never.
    split_body: Union[bool, str] = AUTO


def task_activation_bytes(floats_per_row: int, rows: int, inner_steps: int) -> int:
    """Rough activation memory of one task (``meta.vectorize: auto``): ``rows`` padded rows of
    ``floats_per_row`` fp32 activations each (the model's ``activation_floats()``), kept for
    every inner step and the outer pass (x3: values, gradients, second-order terms)."""
    return rows * floats_per_row * 4 * (inner_steps + 1) * 3


def validate_meta_options(meta: MetaConfig, problems: list[str]) -> None:
    """``meta.*`` execution switches: vectorize, compile, split_body, the vectorize budget."""
    if meta.vectorize not in (True, False, AUTO):
        problems.append(f"meta.vectorize: {meta.vectorize!r} is not one of true, false, auto")
    if not (meta.compile is True or meta.compile is False or meta.compile == AUTO):
        problems.append(f"meta.compile: {meta.compile!r} is not one of true, false, auto")
    if meta.split_body not in (True, False, AUTO):
        problems.append(f"meta.split_body: {meta.split_body!r} is not one of true, false, auto")
    check_positive(problems, "meta.vectorize_budget_mb", meta.vectorize_budget_mb, allow_auto=True)
