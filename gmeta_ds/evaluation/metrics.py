"""Cold-start metrics over the query sets of many tasks (one task = one user).

All inputs are flat arrays over every scored query row, with the task id of each row. Rows are
grouped by task with one sort, so ~1M rows / ~10k tasks take a fraction of a second.

Ties in predictions are handled like scikit-learn, deterministically and independent of row
order: per-task AUC gives a tied positive/negative pair 1/2 (average ranks, as `roc_auc_score`),
and nDCG gives every row of a tied group the group's mean gain (as `ndcg_score` with
``ignore_ties=False``, i.e. the average over all orderings of the ties).
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass

import numpy as np

KINDS = ("binary", "regression")


def _check(labels, preds, task_ids, kind: str, k) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    labels, preds, task_ids = (np.asarray(a).reshape(-1) for a in (labels, preds, task_ids))
    if len(labels) != len(preds) or len(labels) != len(task_ids):
        raise ValueError(f"length mismatch: labels has {len(labels)} rows, preds {len(preds)}, "
                         f"task_ids {len(task_ids)}")
    if len(labels) == 0:
        raise ValueError("empty input: no query rows to score")
    labels, preds = labels.astype(np.float64), preds.astype(np.float64)
    if not (np.isfinite(labels).all() and np.isfinite(preds).all()):
        raise ValueError("labels and preds must be finite (found nan or inf)")
    if any(isinstance(x, bool) or int(x) != x or x < 1 for x in k):
        raise ValueError(f"every k must be a positive int, got {k}")
    if kind == "binary":
        if not np.isin(labels, (0.0, 1.0)).all():
            raise ValueError("binary labels must be 0 or 1")
        if preds.min() < 0.0 or preds.max() > 1.0:
            raise ValueError("binary preds must be probabilities in [0, 1]")
    elif labels.min() < 0.0:
        raise ValueError("regression labels are nDCG gains and must be non-negative")
    return labels, preds, task_ids


def _task_major(key: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Row order (N,) by task, then ``key`` descending; equal keys keep row order (stable).

    Same result as ``np.lexsort((-key, tid))``, faster: two stable sorts, the second on a narrow
    int dtype (numpy radix-sorts 16-bit ints).
    """
    order = np.argsort(-key, kind="stable")
    t = tid[order]
    t = t.astype(np.int16) if len(tid) and tid.max() < 2**15 else t
    return order[np.argsort(t, kind="stable")]


def _rank_desc(key: np.ndarray, tid: np.ndarray, starts: np.ndarray):
    """Sort rows by (task, key descending).

    key, tid: (N,); starts: (T,) first sorted position of each task.
    Returns order (N,) row indices, pos (N,) 0-based position within the task, and gid (N,) the
    id of the run of equal ``key`` within the same task that each sorted row belongs to.
    """
    order = _task_major(key, tid)
    t, s = tid[order], key[order]
    pos = np.arange(len(order)) - starts[t]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (t[1:] != t[:-1]) | (s[1:] != s[:-1])
    return order, pos, np.cumsum(new) - 1


def score_tasks(labels: np.ndarray, preds: np.ndarray, task_ids: np.ndarray, kind: str = "binary",
                k: tuple[int, ...] = (5, 10)) -> dict:
    """Score the query rows of many tasks.

    labels, preds, task_ids: (N,) each. ``task_ids`` may be any sortable dtype (ints, strings);
    rows of a task need not be contiguous. kind "binary": labels 0/1, preds probabilities in
    [0, 1]. kind "regression": labels true ratings (>= 0, they are the nDCG gains), preds
    predicted ratings. k: cut-offs of nDCG@k.

    Returns floats (and ints for counts):
      binary: ``auc`` (global AUC over all rows, as sklearn's `roc_auc_score`; nan when all
      labels are one class, never an exception), ``auc_per_task`` (mean per-task AUC over the
      ``tasks_with_auc`` tasks whose query labels hold both classes; nan if none), ``logloss``
      (as sklearn's `log_loss`, labels=[0, 1], preds clipped to [eps, 1 - eps] of float64),
      plus the nDCG keys below.
      regression: ``mae``, ``rmse``, plus the nDCG keys below.
      both: ``ndcg@{k}`` per k: mean over tasks of nDCG@k of the task's query list ranked by pred
      (gains = labels, log2 discount, ties averaged as `sklearn.metrics.ndcg_score`). Tasks with
      no positive gain (ideal DCG 0) are skipped; ``tasks_with_ndcg`` counts the rest (nan when
      none). A task of one row with a positive label scores 1.0 (sklearn refuses one-row lists).
      Also ``tasks`` (distinct task ids) and ``rows`` (N).
    Raises ValueError on empty input, mismatched lengths, non-finite values, bad labels or k.
    """
    labels, preds, task_ids = _check(labels, preds, task_ids, kind, k)
    tid, counts, ranked = _grouped(labels, preds, task_ids)
    out: dict = {"tasks": int(len(counts)), "rows": int(len(labels))}
    if kind == "binary":
        out.update(_binary_scores(labels, preds, tid, counts, ranked))
    else:
        err = preds - labels
        out["mae"] = float(np.abs(err).mean())
        out["rmse"] = float(np.sqrt(np.mean(err * err)))
    out.update(_ndcg_scores(labels, tid, len(counts), ranked, k))
    return out


def _grouped(labels: np.ndarray, preds: np.ndarray, task_ids: np.ndarray):
    """(tid, counts, ranked): each row's task index (tasks in ``np.unique`` order), each
    task's row count, and the rows ranked within their task (`_Ranked`)."""
    _, tid, counts = np.unique(task_ids, return_inverse=True, return_counts=True)
    tid = tid.reshape(-1)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return tid, counts, _Ranked(*_rank_desc(preds, tid, starts), tid=tid, labels=labels)


@dataclass
class _Ranked:
    """The rows of every task ordered by descending prediction (`_rank_desc`): ``order``,
    ``pos`` (position in its task), ``gid`` (tie run id), and the task ids and labels so
    ordered (``t_sorted``, ``g_sorted``), with each tie run's size."""

    order: np.ndarray
    pos: np.ndarray
    gid: np.ndarray
    tid: InitVar[np.ndarray]
    labels: InitVar[np.ndarray]

    def __post_init__(self, tid: np.ndarray, labels: np.ndarray) -> None:
        self.t_sorted, self.g_sorted = tid[self.order], labels[self.order]
        self.group_size = np.bincount(self.gid)


def _binary_scores(labels: np.ndarray, preds: np.ndarray, tid: np.ndarray, counts: np.ndarray,
                   r: _Ranked) -> dict:
    """``auc``, ``auc_per_task`` (Mann-Whitney per task, ties averaged), ``tasks_with_auc``
    and ``logloss`` (see `score_tasks`). The global AUC is the same Mann-Whitney statistic over
    all rows as one task, and the log loss numpy's: sklearn's `roc_auc_score` and `log_loss`
    give the same values to 1e-12 (tests/unit/test_metrics.py) but importing sklearn.metrics
    costs every evaluating process 1-3 s."""
    n = len(labels)
    everyone = np.zeros(n, dtype=np.int64)
    auc = _task_auc(labels, everyone, np.array([n]), _grouped(labels, preds, everyone)[2])[0]
    out = {"auc": float(auc)}
    auc_t = _task_auc(labels, tid, counts, r)
    ok = ~np.isnan(auc_t)
    out["auc_per_task"] = float(auc_t[ok].mean()) if ok.any() else float("nan")
    out["tasks_with_auc"] = int(ok.sum())
    eps = np.finfo(np.float64).eps
    p = np.clip(preds.astype(np.float64), eps, 1.0 - eps)
    out["logloss"] = float(-np.mean(labels * np.log(p) + (1.0 - labels) * np.log1p(-p)))
    return out


def _task_auc(labels: np.ndarray, tid: np.ndarray, counts: np.ndarray, r: _Ranked) -> np.ndarray:
    """(T,) Mann-Whitney AUC of each task's rows (ties averaged), NaN for a task whose labels
    are all one class."""
    n_tasks = len(counts)
    # Mann-Whitney: ascending 1-based rank of a tie run holding descending positions [s, e] of
    # a task of size m is m - (s + e) / 2.
    first = np.bincount(r.gid, r.pos) / r.group_size - (r.group_size - 1) / 2.0
    run_rank = counts[r.t_sorted] - (2 * first[r.gid] + r.group_size[r.gid] - 1) / 2.0
    n_pos = np.bincount(tid, labels, minlength=n_tasks)
    n_neg = counts - n_pos
    rank_sum = np.bincount(r.t_sorted, run_rank * r.g_sorted, minlength=n_tasks)
    ok = (n_pos > 0) & (n_neg > 0)
    out = np.full(n_tasks, np.nan)
    out[ok] = (rank_sum[ok] - n_pos[ok] * (n_pos[ok] + 1) / 2.0) / (n_pos[ok] * n_neg[ok])
    return out


def per_task_auc(labels: np.ndarray, preds: np.ndarray, task_ids: np.ndarray) -> np.ndarray:
    """(T,) AUC of each task's query rows, tasks in ``np.unique(task_ids)`` order, NaN for a
    task whose labels are all one class: the values ``auc_per_task`` averages (`score_tasks`;
    binary labels, same checks)."""
    labels, preds, task_ids = _check(labels, preds, task_ids, "binary", ())
    return _task_auc(labels, *_grouped(labels, preds, task_ids))


def _ndcg_scores(labels: np.ndarray, tid: np.ndarray, n_tasks: int, r: _Ranked, k: tuple[int, ...]) -> dict:
    """``ndcg@{k}`` per cut-off and ``tasks_with_ndcg`` (see `score_tasks`)."""
    out = {}
    mean_gain = (np.bincount(r.gid, r.g_sorted) / r.group_size)[r.gid]  # tie-averaged gain per sorted row
    ideal_gain = labels[_task_major(labels, tid)]  # same task blocks, so `pos` applies too
    base_disc = 1.0 / np.log2(r.pos + 2.0)
    for kk in k:
        disc = np.where(r.pos < kk, base_disc, 0.0)
        dcg = np.bincount(r.t_sorted, mean_gain * disc, minlength=n_tasks)
        idcg = np.bincount(r.t_sorted, ideal_gain * disc, minlength=n_tasks)
        ok = idcg > 0
        out[f"ndcg@{int(kk)}"] = float((dcg[ok] / idcg[ok]).mean()) if ok.any() else float("nan")
    out["tasks_with_ndcg"] = int((np.bincount(tid, labels > 0, minlength=n_tasks) > 0).sum())
    return out
