"""Cold-start evaluation of held-out users: the one path of the Python API
(`MetaEngine.evaluate`) and of the CLI (``gmeta-ds train`` / ``eval``, `workloads.ctr`).

The held-out tasks are split over the ranks (each task's predictions depend only on that task)
and their prediction rows gathered once (`gather_predictions`); the baselines are fitted on the
training users (`fit_baselines`: the non-meta model as is and fine-tuned, optionally with the
(lr, steps) chosen on the validation users, and item popularity + a per-user offset); every
model is scored on the same query rows with paired bootstrap intervals (`score_set`), then the
few-shot and inner-steps curves (`curves`) and each held-out user's metric per model
(`per_user_columns`, the CLI's per_user.csv). The result's keys are those of summary.json's
``eval``, whichever side asked.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch.distributed as dist

from gmeta_ds.algorithms.base import MetaLearner
from gmeta_ds.config import DEFAULTS
from gmeta_ds.data.tasks import TaskSet
from gmeta_ds.errors import ConfigError
from gmeta_ds.evaluation.baselines import (
    POPULARITY_METRICS,
    finetune_predict,
    finetune_scores_of,
    finetune_search,
    fit_popularity,
    item_column,
    oov_id,
    popularity_predict,
    popularity_scores_of,
)
from gmeta_ds.evaluation.few_shot import Named, few_shot_curve, steps_curve
from gmeta_ds.evaluation.scores import (
    HEADLINE,
    merge,
    paired,
    per_user_columns,
    predict,
    score,
    train_baseline,
)
from gmeta_ds.functional.inner import LOSSES
from gmeta_ds.sparse import single_fields

_EVAL = DEFAULTS.eval


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What an evaluation computes, as the ``eval`` config section names it (the API's
    keyword arguments fill the same fields). ``synthetic``: the tasks are the embedded
    synthetic data (``data.source: synthetic``), whose item 0 is a real item: the popularity
    baseline then has no out-of-vocabulary id (`baselines.oov_id`, the one rule)."""

    inner_steps: int
    seed: int
    tasks_per_batch: int = _EVAL.tasks_per_batch
    bootstrap_resamples: int = _EVAL.bootstrap_resamples
    non_meta: bool = False                          # eval.baseline
    baseline_finetune: bool = _EVAL.baseline_finetune
    finetune_search: bool = False
    popularity: bool = False                        # eval.popularity_baseline
    baseline_epochs: int = _EVAL.baseline_epochs
    baseline_lr: float = _EVAL.baseline_lr
    baseline_batch_size: int = _EVAL.baseline_batch_size
    few_shot: tuple[int, ...] = ()
    steps_curve: tuple[int, ...] = ()
    synthetic: bool = False


def evaluate_held_out(learner: MetaLearner, tasks: TaskSet, settings: EvalSettings, *, train: TaskSet | None = None,
                      valid: TaskSet | None = None, states: dict[str, TaskSet] | None = None,
                      baseline_start: Callable[[], MetaLearner] | None = None, rank: int = 0, world: int = 1,
                      everywhere: bool = False, split: str | None = None,
                      where: str = "eval") -> tuple[dict, dict | None]:
    """(summary.json's ``eval`` dict, per_user.csv's columns or None without held-out users)
    of ``tasks`` (module docstring). ``learner``: a single-process learner holding every
    weight; ``train``: the training tasks the baselines are fitted on; ``valid``: the
    validation users of the fine-tune search; ``states``: the four cold-start states' task
    sets, scored like ``tasks`` under ``states``; ``baseline_start``: builds the non-meta
    baseline's starting learner (the initial weights); ``split``: the name of the held-out set
    (``eval.split``), recorded as ``split``. Collective when ``world`` > 1 (one all-gather per
    task set); the other ranks then return ({}, None) unless ``everywhere`` (the API: every
    rank scores alone and returns the same dict)."""
    kind = learner.algorithm.kind
    sets = {"test": tasks, **(states or {})}
    rows = {name: gather_predictions(learner, each, settings, rank, world) for name, each in sets.items()}
    if rank != 0 and not everywhere:
        return {}, None
    models, tuned = fit_baselines(settings, kind, train, valid, baseline_start, where)
    scored = {name: score_set(settings, rows[name], each, models, kind) for name, each in sets.items()}
    scores = {name: out for name, (out, _) in scored.items()}
    columns = None
    if len(tasks):
        columns = per_user_columns(merge(rows["test"]), scored["test"][1], kind)
        full = {"meta": (rows["test"], "adapted"), **scored["test"][1]}
        scores["test"].update(curves(settings, learner, tasks, full, models, kind))
    result = {**scores.pop("test"), **tuned, **({"split": split} if split is not None else {})}
    if scores:
        result["states"] = scores
    return result, columns


def gather_predictions(learner: MetaLearner, tasks: TaskSet, settings: EvalSettings, rank: int,
                       world: int) -> list[dict]:
    """`predict` of ``tasks`` by all ranks (tasks r::W on rank r; collective when ``world``
    > 1): every rank's prediction rows, on every rank."""
    mine = predict(learner, learner.learning_rates(), tasks, settings.inner_steps, settings.tasks_per_batch,
                   np.arange(rank, len(tasks), world))
    if world == 1:
        return [mine]
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return parts


def score_set(settings: EvalSettings, meta_rows: list, tasks: TaskSet, models: list[Baseline],
              kind: str) -> tuple[dict, Named]:
    """One held-out set's scores: the meta-learned model's (``meta_rows``: `predict` parts),
    every baseline's and the paired intervals; and the baselines' prediction rows."""
    if len(tasks) == 0:
        return {"tasks": 0}, {}
    out = {**score(meta_rows, kind), "tasks": len(tasks)}
    compared: Named = {}
    for model in models:
        named = model.predict(tasks)
        out.update(model.scores(named, kind))
        compared.update(named)
    if compared and settings.bootstrap_resamples:
        out["intervals"] = paired(merge(meta_rows), compared, kind, settings.bootstrap_resamples, settings.seed)
    return out, compared


def curves(settings: EvalSettings, learner: MetaLearner, tasks: TaskSet, full: Named, models: list[Baseline],
           kind: str) -> dict:
    """The few-shot curve (``few_shot``, ``eval.few_shot``) and the inner-steps curve
    (``inner_steps_curve``, ``eval.steps_curve``) of the held-out ``tasks``
    (`gmeta_ds.evaluation.few_shot`); ``full``: every model's rows on the full support."""
    def meta_at(tasks, steps: int) -> Named:
        return {"meta": (predict(learner, learner.learning_rates(), tasks, steps, settings.tasks_per_batch),
                         "adapted")}

    out, resamples = {}, settings.bootstrap_resamples
    if settings.few_shot:
        predictors = [lambda t: meta_at(t, settings.inner_steps), *(m.predict for m in models)]
        out["few_shot"] = few_shot_curve(tasks, predictors, full, settings.few_shot, kind, resamples, settings.seed)
    if settings.steps_curve:
        at_steps = [meta_at, *(m.at_steps for m in models if m.at_steps is not None)]
        out["inner_steps_curve"] = steps_curve(tasks, at_steps, settings.steps_curve, kind, resamples, settings.seed)
    return out


@dataclasses.dataclass
class Baseline:
    """A fitted baseline: ``predict`` (a task set -> its named prediction rows, `Named`) and
    ``scores`` (those rows -> its ``baseline_*`` entries of the evaluation)."""

    predict: Callable[[Any], Named]
    scores: Callable[[Named, str], dict]
    at_steps: Callable[[Any, int], Named] | None = None  # a fine-tune's rows after a number of steps


def fit_baselines(settings: EvalSettings, kind: str, train: TaskSet | None, valid: TaskSet | None,
                  baseline_start: Callable[[], MetaLearner] | None, where: str) -> tuple[list[Baseline], dict]:
    """The asked-for baselines, fitted on the training users, and the chosen fine-tuning (lr,
    steps, grid; {} without ``finetune_search``)."""
    models, tuned = [], {}
    if settings.non_meta:
        baseline = baseline_start()
        train_baseline(baseline.net, train, settings.baseline_epochs, settings.baseline_batch_size,
                       settings.baseline_lr, settings.seed, LOSSES[kind])
        models.append(_non_meta(settings, baseline))
        if settings.finetune_search:  # chosen on validation users only; test users scored once
            lr, steps, grid = finetune_search(baseline, valid, settings.tasks_per_batch)
            tuned = {"baseline_finetune_lr": lr, "baseline_finetune_steps": steps, "baseline_finetune_grid": grid}
            models.append(_tuned_finetune(settings, baseline, lr, steps))
    if settings.popularity:
        models.append(_popularity(settings, kind, train, where))
    return models, tuned


def _non_meta(settings: EvalSettings, baseline: MetaLearner) -> Baseline:
    """The non-meta baseline as is (``baseline``) and, with ``baseline_finetune``, fine-tuned
    on each support with the meta inner loop's rates (``baseline_finetune``)."""
    fixed = fixed_rates(baseline)
    finetune = settings.baseline_finetune

    def rows(tasks) -> Named:
        out = predict(baseline, fixed, tasks, settings.inner_steps, settings.tasks_per_batch)
        return {"baseline": (out, "plain"), **({"baseline_finetune": (out, "adapted")} if finetune else {})}

    def at_steps(tasks, n: int) -> Named:
        return {"baseline_finetune": (predict(baseline, fixed, tasks, n, settings.tasks_per_batch), "adapted")}

    return Baseline(rows, non_meta_scores, at_steps if finetune else None)


def _tuned_finetune(settings: EvalSettings, baseline: MetaLearner, lr: float, steps: int) -> Baseline:
    """The non-meta baseline fine-tuned with the (lr, steps) of the search
    (``baseline_finetune_tuned``)."""
    def at_steps(tasks, n: int) -> Named:
        return {"baseline_finetune_tuned": (finetune_predict(baseline, tasks, lr, n, settings.tasks_per_batch),
                                            "adapted")}

    return Baseline(lambda tasks: at_steps(tasks, steps),
                    lambda named, kind: finetune_scores_of(named["baseline_finetune_tuned"][0], kind), at_steps)


def _popularity(settings: EvalSettings, kind: str, train: TaskSet, where: str) -> Baseline:
    """Item popularity + a per-user offset fitted on each support (``baseline_popularity``).
    Log sources map unseen items to the OOV id 0; synthetic item 0 is a real item, and raw ids
    (dynamic tables) have no OOV id."""
    if kind not in POPULARITY_METRICS:
        raise ConfigError([f"baselines: 'popularity' scores binary or regression labels, not {kind!r}"], where)
    try:
        column = item_column(train.fields)
    except ValueError as err:
        raise ConfigError([f"baselines: 'popularity': {err}"], where) from None
    raw = single_fields(train.fields)[column].raw
    popularity = fit_popularity(train, column, kind, oov_id=oov_id(settings.synthetic, raw), raw=raw)
    return Baseline(lambda tasks: {"baseline_popularity": (popularity_predict(popularity, tasks), "pred")},
                    lambda named, kind: popularity_scores_of(named["baseline_popularity"][0], kind))


def fixed_rates(baseline: MetaLearner) -> dict[str, float]:
    """The non-meta baseline's fine-tuning rates: the meta inner loop's (meta.inner_lr(_scale))."""
    return {n: baseline.algorithm.rate(n) for n in baseline.adapted_names()}


def non_meta_scores(named: Named, kind: str) -> dict:
    """The non-meta baseline's headline metrics, as is and (when predicted) fine-tuned, and
    (binary) the mean per-user AUC of both (``baseline_auc_per_task``,
    ``baseline_finetune_auc_per_task``)."""
    base = score(named["baseline"][0], kind)
    out = {}
    for name in HEADLINE[kind]:
        out[f"baseline_{name}"] = base[f"{name}_no_adapt"]
        if "baseline_finetune" in named:
            out[f"baseline_finetune_{name}"] = base[name]
    if kind == "binary":
        out["baseline_auc_per_task"] = base["auc_per_task_no_adapt"]
        if "baseline_finetune" in named:
            out["baseline_finetune_auc_per_task"] = base["auc_per_task"]
    return out
