"""``eval``: cold-start evaluation on held-out users and its baselines."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from gmeta_ds.config.checks import AUTO


@dataclass
class EvalConfig:
    """Cold-start evaluation on held-out users (adapt on support, score query)."""

    enabled: bool = True                   # score held-out users after training
    # Inner steps at evaluation; "auto" = meta.inner_steps.
    inner_steps: Union[int, str] = AUTO
    tasks_per_batch: int = 64              # held-out tasks adapted together
    # Also train the non-meta baseline (the same model, supervised on every row).
    baseline: bool = True
    baseline_epochs: int = 3               # the baseline's epochs over the training users' rows
    baseline_batch_size: int = 512         # the baseline's rows per batch
    baseline_lr: float = 1e-3              # the baseline's Adam learning rate
    # Fine-tune the baseline on each test user's support before scoring (its own metric).
    baseline_finetune: bool = True
    # Also fine-tune it with (lr, steps) chosen from a grid on the validation users
    # (data.valid_fraction > 0): baseline_finetune_tuned_*, baseline_finetune_lr / _steps.
    finetune_search: bool = False
    # Item popularity (shrunk click rate / mean rating) + a per-user offset fitted on the
    # support: baseline_popularity_* (gmeta_ds/evaluation/baselines.py).
    popularity_baseline: bool = True
    # Which held-out users to score: test, or valid (log sources with data.valid_fraction > 0).
    split: str = "test"
    # Paired bootstrap over the held-out users (seeded by the run seed): a 95% interval of each
    # metric's difference, meta-learned minus each baseline, under ``intervals`` (0: none).
    bootstrap_resamples: int = 1000
    # The few-shot curve (``few_shot``): every model re-scored on the held-out users with only
    # the first k rows of each support, for each k here, and with all of it ([]: none).
    few_shot: list[int] = field(default_factory=lambda: [1, 2, 5, 10, 20])
    # The inner-steps curve (``inner_steps_curve``): the meta-learned model and the fine-tuned
    # baselines re-scored on the held-out users after each number of inner steps here, on the
    # full support (0: the initialisation as is; []: none).
    steps_curve: list[int] = field(default_factory=lambda: [0, 1, 2, 5, 10])
