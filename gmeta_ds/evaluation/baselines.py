"""Baselines scored next to the meta-learned model in ``eval`` (CTR workload).

* Item popularity with a per-user offset (`fit_popularity`, `popularity_scores`): each item's
  score from the training users' interactions, shrunk to the global rate; each held-out user
  gets one offset fitted on its support rows; query rows score popularity + offset.
  Binary labels: item score = logit((clicks + m * p) / (shown + m)) with p the training click
  rate and m = ``prior`` pseudo-interactions; the user offset b maximises
  sum_support log sigmoid-likelihood(y | score + b) - ``offset_prior`` * b^2 / 2 (Newton steps);
  prediction sigmoid(score + b). Regression: item score = (sum of ratings + m * mean) /
  (count + m); offset = sum of support residuals / (support rows + ``offset_prior``);
  prediction score + b. Items never seen in training, and the OOV id (log sources: id 0),
  get the global prior (p, resp. the mean rating).
  The offset is constant within a user, so the per-user AUC (``auc_per_task``) is exactly the
  per-user AUC of popularity alone; it moves the global AUC and the logloss (MAE / RMSE).
* The non-meta baseline fine-tuned with (lr, steps) chosen on validation users
  (`finetune_search`): every point of a small grid scored on ``data.valid``, the best by the
  headline metric (AUC, or MAE for ratings) then applied once to the test users.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gmeta_ds.algorithms.base import MetaLearner
from gmeta_ds.data.popularity import (
    EPS,
    item_column,  # noqa: F401  (re-exported: callers import it from here)
    item_statistics,
    shrunk_score,
)
from gmeta_ds.data.tasks import TaskSet
from gmeta_ds.evaluation.scores import predict, score
from gmeta_ds.evaluation.metrics import score_tasks

# Metrics reported for the popularity baseline (``baseline_popularity_<name>``).
POPULARITY_METRICS = {"binary": ("auc", "auc_per_task", "logloss"), "regression": ("mae", "rmse")}
# eval.finetune_search's grid: inner learning rate x fine-tuning steps.
SEARCH_LRS = (0.01, 0.03, 0.1, 0.3, 1.0)
SEARCH_STEPS = (1, 2, 5, 10)


def _null(value):
    """None for an undefined (NaN) metric: summaries hold JSON null, never a bare NaN (the
    meta-learned model's scores of the same query rows say why, `evaluation.defined`)."""
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


@dataclass
class Popularity:
    """Fitted item scores: ``item_score[i]`` (logit for binary, rating for regression) of item
    id i (of item ``item_ids[i]`` for raw ids); other ids score ``prior_score``."""

    kind: str
    column: int
    item_score: np.ndarray
    prior_score: float
    offset_prior: float
    item_ids: np.ndarray | None = None  # sorted raw ids (data.raw_ids), else None: ids 0..len-1

    def scores_of(self, ids: np.ndarray) -> np.ndarray:
        items = ids[:, self.column].astype(np.int64)
        if self.item_ids is not None:
            pos = np.clip(np.searchsorted(self.item_ids, items), 0, max(0, len(self.item_ids) - 1))
            known = self.item_ids[pos] == items if len(self.item_ids) else np.zeros(len(items), bool)
            items = pos
        else:
            known = (items >= 0) & (items < len(self.item_score))
        out = np.full(len(items), self.prior_score)
        out[known] = self.item_score[items[known]]
        return out


def _logit(p):
    return np.log(p) - np.log1p(-p)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def oov_id(synthetic: bool, raw: bool = False) -> int | None:
    """The item id standing for out-of-vocabulary items, one rule for the CLI, the API and
    serving: 0 for a log source's vocabulary-mapped ids; None for synthetic data (dense ids,
    item 0 is a real item) and for raw ids (``data.raw_ids``: dynamic tables have no OOV id)."""
    return None if synthetic or raw else 0


def fit_popularity(train: TaskSet, column: int, kind: str, oov_id: int | None = 0,
                   prior: float = 10.0, offset_prior: float = 1.0, raw: bool = False) -> Popularity:
    """Item scores from every interaction of ``train`` (support and query rows).

    column: the item id column (`item_column`); oov_id: the id of out-of-vocabulary items
    (log sources: 0), scored with the global prior; None when every id is a real item
    (synthetic data). prior: pseudo-interactions at the global rate added to each item.
    offset_prior: strength of the per-user offset's shrinkage to 0 (see the module docstring).
    raw: the column holds raw int64 ids (``data.raw_ids``), scored by id, with no OOV id.
    """
    if kind not in POPULARITY_METRICS:
        raise ValueError(f"kind must be one of {tuple(POPULARITY_METRICS)}, got {kind!r}")
    items, item_ids = None, None
    if raw:
        item_ids, items = np.unique(train.ids[:, column].astype(np.int64), return_inverse=True)
        items, oov_id = items.reshape(-1), None
    shown, total, mean = item_statistics(train, column, oov_id, items)
    if kind == "binary":
        mean = float(np.clip(mean, EPS, 1.0 - EPS))
        prior_score = float(_logit(mean))
    else:
        prior_score = mean
    item_score = shrunk_score(total, shown, prior, mean, kind)
    return Popularity(kind, column, item_score, prior_score, offset_prior, item_ids)


def user_offsets(pop: Popularity, tasks: TaskSet, newton_steps: int = 25) -> np.ndarray:
    """(U,) float64: each task's offset fitted on its support rows (module docstring)."""
    n_tasks = len(tasks)
    start = tasks.offsets[:-1]
    owner = np.repeat(np.arange(n_tasks), tasks.support_len)
    rows = np.repeat(start, tasks.support_len) + (np.arange(len(owner)) - np.repeat(
        np.cumsum(tasks.support_len) - tasks.support_len, tasks.support_len))
    s = pop.scores_of(tasks.ids[rows])
    y = tasks.labels[rows].astype(np.float64)
    n = tasks.support_len.astype(np.float64)
    if pop.kind == "regression":
        return np.bincount(owner, y - s, minlength=n_tasks) / (n + pop.offset_prior)
    b = np.zeros(n_tasks)
    for _ in range(newton_steps):  # concave in b: Newton from 0, steps clipped for safety
        p = _sigmoid(s + b[owner])
        grad = np.bincount(owner, y - p, minlength=n_tasks) - pop.offset_prior * b
        hess = np.bincount(owner, p * (1.0 - p), minlength=n_tasks) + pop.offset_prior
        b += np.clip(grad / np.maximum(hess, 1e-12), -4.0, 4.0)
    return b


def popularity_predict(pop: Popularity, tasks: TaskSet) -> dict[str, np.ndarray]:
    """Query rows of every task: labels, pred (probability or rating), task (index)."""
    b = user_offsets(pop, tasks)
    lengths = np.diff(tasks.offsets)
    q_len = lengths - tasks.support_len
    task = np.repeat(np.arange(len(tasks)), q_len)
    first_q = tasks.offsets[:-1] + tasks.support_len
    rows = np.repeat(first_q, q_len) + (np.arange(len(task)) - np.repeat(np.cumsum(q_len) - q_len, q_len))
    raw = pop.scores_of(tasks.ids[rows]) + b[task]
    pred = _sigmoid(raw) if pop.kind == "binary" else raw
    return {"labels": tasks.labels[rows], "pred": pred, "task": task}


def popularity_scores(pop: Popularity, tasks: TaskSet) -> dict:
    """``baseline_popularity_<metric>`` of ``tasks`` ({} when there are none)."""
    if len(tasks) == 0:
        return {}
    return popularity_scores_of(popularity_predict(pop, tasks), pop.kind)


def popularity_scores_of(out: dict[str, np.ndarray], kind: str) -> dict:
    """``baseline_popularity_<metric>`` of `popularity_predict` rows ``out``."""
    scores = score_tasks(out["labels"], out["pred"], out["task"], kind)
    return {f"baseline_popularity_{name}": _null(scores[name]) for name in POPULARITY_METRICS[kind]}


def _headline(kind: str) -> tuple[str, float]:
    """The search's metric and its sign (+1: higher is better): the mean per-user AUC for
    clicks, the metric a cold-start user decides on and the one the meta-learned model is
    compared on first, so the fine-tuned baseline is tuned for it too; MAE for ratings."""
    return ("auc_per_task", 1.0) if kind == "binary" else ("mae", -1.0)


def finetune_predict(baseline: MetaLearner, tasks: TaskSet, lr: float, steps: int,
                     tasks_per_batch: int) -> dict[str, np.ndarray]:
    """`predict` of the baseline fine-tuned on each support with one inner ``lr`` for every
    adapted name and ``steps`` steps."""
    lrs = {n: lr for n in baseline.adapted_names()}
    return predict(baseline, lrs, tasks, steps, tasks_per_batch)


def finetune_search(baseline: MetaLearner, valid: TaskSet, tasks_per_batch: int = 64,
                    lrs=SEARCH_LRS, steps=SEARCH_STEPS) -> tuple[float, int, dict]:
    """(lr, steps, {"lr=..,steps=..": metric}) of the grid point whose fine-tuning scores best
    on the validation users ``valid`` (ties: the first in grid order, lr-major). Points whose
    predictions are not finite (fine-tuning diverged) or whose metric is undefined score None
    in the table and are never chosen."""
    if valid is None or len(valid) == 0:
        raise ValueError("eval.finetune_search needs validation users (data.valid_fraction > 0)")
    kind = baseline.algorithm.kind
    name, sign = _headline(kind)
    best, table = None, {}
    for lr in lrs:
        for n in steps:
            out = finetune_predict(baseline, valid, float(lr), int(n), tasks_per_batch)
            value = None
            if np.isfinite(out["adapted"]).all():
                value = score(out, kind, warn=False)[name]
            table[f"lr={lr:g},steps={n}"] = value
            if value is not None and (best is None or sign * value > sign * best[0]):
                best = (value, float(lr), int(n))
    if best is None:
        raise ValueError(f"eval.finetune_search: no grid point gave a finite validation {name}")
    return best[1], best[2], table


def finetune_scores(baseline: MetaLearner, tasks: TaskSet, lr: float, steps: int,
                    tasks_per_batch: int = 64) -> dict:
    """``baseline_finetune_tuned_<metric>`` of ``tasks`` fine-tuned with the chosen pair."""
    if len(tasks) == 0:
        return {}
    return finetune_scores_of(finetune_predict(baseline, tasks, lr, steps, tasks_per_batch), baseline.algorithm.kind)


def finetune_scores_of(out: dict[str, np.ndarray], kind: str) -> dict:
    """``baseline_finetune_tuned_<metric>`` of `finetune_predict` rows ``out`` (None when the
    fine-tuning diverged: predictions not finite)."""
    if not np.isfinite(out["adapted"]).all():
        return {f"baseline_finetune_tuned_{n}": None for n in POPULARITY_METRICS[kind]}
    scores = score(out, kind, warn=False)
    return {f"baseline_finetune_tuned_{n}": scores[n] for n in POPULARITY_METRICS[kind]}
