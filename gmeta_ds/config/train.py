"""``train``: the outer loop, logging, checkpoints and profiling, and its checks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from gmeta_ds.config.checks import AUTO, one_of


@dataclass
class TrainConfig:
    """Outer loop."""

    meta_steps: int = 200                  # outer (meta-) steps of the run
    lr: float = 1e-3                       # outer learning rate; fills "auto" in the DeepSpeed optimizer
    log_every: int = 10                    # meta-steps between lines of metrics.jsonl
    # Threads per rank; "auto" = cores // local ranks.
    threads: Union[int, str] = AUTO
    collective_timeout_s: int = 600        # process-group timeout of every collective
    progress: bool = True                     # tqdm bar on rank 0 (meta-step, tasks/s, query loss)
    tensorboard: bool = True                  # TensorBoard events under OUTPUT_DIR/tensorboard (rank 0)
    nonfinite: str = "abort"                  # NaN/inf outer loss: abort (error naming step, ranks, tasks) or skip
    checkpoint_every: int = 0                 # meta-steps between checkpoints (and one at the end); 0 = none
    keep_last: int = 2                        # complete checkpoints kept (0 = all)
    # Resume: null, "auto" (OUTPUT_DIR/checkpoints/latest when there is one), or a checkpoint path.
    resume: Union[str, None] = None
    # A new (not resumed) run into an output_dir holding an earlier run's outputs (its report.html,
    # plots/ and profile among them): refused unless true (CLI --overwrite); then they are removed
    # once every check passed, before meta-step 1. Refused when its checkpoints/, tensorboard/,
    # plots/ or profile/ holds anything a run does not write there.
    overwrite: bool = False
    # Per-phase time per rank (gmeta_ds/run/profiling.py): profile this many meta-steps after
    # profile_warmup ones; OUTPUT_DIR/profile.json (+ Chrome traces with profile_trace).
    profile_steps: int = 0
    profile_warmup: int = 5                # meta-steps run before profiling starts
    profile_trace: bool = False            # also write a Chrome trace per rank


def validate_train(train: TrainConfig, problems: list[str]) -> None:
    """``train.*`` on its own: the failure policy, counters >= 0, a resume target."""
    one_of(problems, "train.nonfinite", train.nonfinite, ("abort", "skip"))
    for key in ("checkpoint_every", "keep_last", "profile_steps", "profile_warmup"):
        value = getattr(train, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(f"train.{key}: {value!r} must be an integer >= 0")
    if train.resume is not None and not (isinstance(train.resume, str) and train.resume):
        problems.append(f"train.resume: {train.resume!r} must be null, 'auto' or a checkpoint path")
