"""The few-shot curve: held-out metrics as a function of how many support interactions each
user's adaptation sees (``eval.few_shot``).

For each size k every held-out user keeps the first k rows of its support (all of a shorter
one; `TaskSet.first_support`) and all of its query rows, so every point scores the same query
rows; the meta-learned model adapts on that support and so does each baseline (fine-tuning on
it, or a popularity offset fitted on it). The last point, ``"all"``, is the full evaluation.
Per point: every model's metrics (`gmeta_ds.evaluation.intervals.METRICS`) and each baseline's paired
bootstrap difference to the meta-learned model (`gmeta_ds.evaluation.scores.paired`).

The inner-steps curve (`steps_curve`, ``eval.steps_curve``) is the same comparison along the
number of inner steps, on the full support: the meta-learned model and each baseline that
adapts (fine-tuning) after 0, 1, 2, ... steps.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from gmeta_ds.data.tasks import TaskSet
from gmeta_ds.evaluation.scores import merge, paired
from gmeta_ds.evaluation.intervals import METRICS
from gmeta_ds.evaluation.metrics import score_tasks

# Support sizes of the curve (the full support is always added as "all").
SIZES = (1, 2, 5, 10, 20)
# Prediction rows of named models on a task set: {name: (predict-style rows, key of the prediction)}.
Named = dict[str, tuple[dict, str]]
Predictor = Callable[[TaskSet], Named]
StepPredictor = Callable[[TaskSet, int], Named]


def few_shot_curve(tasks: TaskSet, predictors: list[Predictor], full: Named, sizes, kind: str,
                   resamples: int, seed: int) -> dict:
    """The curve over ``sizes`` and "all" (module docstring).

    predictors: functions of a task set returning named prediction rows; one of them names
    the meta-learned model ``"meta"`` (its ``adapted`` predictions), the others the baselines
    (the names of ``eval.intervals``). full: the same rows already computed on ``tasks``
    (the "all" point). Returns {"support": [k..., "all"], "support_rows": mean support rows per
    user at each point, "metrics": {model: {metric: [value per point]}}, "intervals":
    [{baseline: {metric: {"diff", "low", "high"}}} per point] (empty dicts with 0 resamples)}."""
    sizes = sorted({int(k) for k in sizes})
    points = []
    for k in sizes:
        cut = tasks.first_support(k)
        named: Named = {}
        for predictor in predictors:
            named.update(predictor(cut))
        points.append((float(np.mean(cut.support_len)), named))
    points.append((float(np.mean(tasks.support_len)), full))
    return {"support": [*sizes, "all"], "support_rows": [rows for rows, _ in points],
            **_scored_points([named for _, named in points], kind, resamples, seed)}


def steps_curve(tasks: TaskSet, at_steps: list[StepPredictor], steps, kind: str, resamples: int,
                seed: int) -> dict:
    """The inner-steps curve (``eval.steps_curve``): every model of ``at_steps`` (functions of
    a task set and a number of inner steps returning named prediction rows; one names the
    meta-learned model ``"meta"``) after each number of ``steps`` on the full support. Returns
    {"inner_steps": [s...], "metrics": ..., "intervals": ...} as `few_shot_curve`'s."""
    steps = sorted({int(s) for s in steps})
    points = []
    for n in steps:
        named: Named = {}
        for predictor in at_steps:
            named.update(predictor(tasks, n))
        points.append(named)
    return {"inner_steps": steps, **_scored_points(points, kind, resamples, seed)}


def _scored_points(points: list[Named], kind: str, resamples: int, seed: int) -> dict:
    """{"metrics": {model: {metric: [value per point]}}, "intervals": [each baseline's paired
    difference to ``"meta"`` per point]} of a curve's points."""
    out = {"metrics": {}, "intervals": []}
    for named in points:
        for name, values in _metrics(named, kind).items():
            for metric, value in values.items():
                out["metrics"].setdefault(name, {}).setdefault(metric, []).append(value)
        baselines = {n: v for n, v in named.items() if n != "meta"}
        differences = {}
        if resamples and baselines:
            differences = paired(merge(named["meta"][0]), baselines, kind, resamples, seed)["differences"]
        out["intervals"].append(differences)
    return out


def _metrics(named: Named, kind: str) -> dict[str, dict[str, float | None]]:
    """{model: {metric: value}} of named prediction rows; None where undefined (one class, or
    predictions that are not finite: a diverged fine-tune)."""
    out = {}
    for name, (rows, key) in named.items():
        rows = merge(rows)
        if not np.isfinite(rows[key]).all():
            out[name] = dict.fromkeys(METRICS[kind])
            continue
        scores = score_tasks(rows["labels"], rows[key], rows["task"], kind)
        out[name] = {m: None if np.isnan(scores[m]) else float(scores[m]) for m in METRICS[kind]}
    return out
