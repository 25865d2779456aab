"""Cold-start evaluation: adapt on each held-out task's support set, score its query set.

Also the non-meta baseline: the same architecture trained by ordinary supervised learning on
all interactions of the training users, scored as is and after the same fine-tuning on each
test user's support set that the meta-learned model gets.
"""
from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import vmap

from gmeta_ds.config.arguments import finite, int_at_least
from gmeta_ds.algorithms.base import MetaLearner, embed_batch, embedder, model_contract
from gmeta_ds.data.tasks import TaskSet, collate, take_rows
from gmeta_ds.sparse import Jagged
from gmeta_ds.functional.inner import PREDICTIONS, InnerLoop, LearningRates, check_output, masked_bce
from gmeta_ds.evaluation.intervals import paired_intervals
from gmeta_ds.evaluation.metrics import per_task_auc, score_tasks
from gmeta_ds.models.popularity import net_logits


def _adapted_logits(inner: InnerLoop, theta: dict, lrs: LearningRates, support: tuple, xq) -> Tensor:
    def one(xs, ys, ms, xq):
        fast, _ = inner.adapt_func(theta, lrs, xs, ys, ms)
        return inner.query_logits(theta, fast, xs, ys, ms, xq)

    return vmap(one)(*support, xq)


def plain_logits(net: nn.Module, rows: Tensor, ids: Tensor, kind: str = "binary") -> Tensor:
    """Unadapted logits of T tasks' rows (T, Q, F, d) with ids (T, Q, F_single): the model
    contract (docs/api.md) promises ``model(rows)`` 3-D rows (N, F, d), so the task and row
    dimensions are folded into N = T·Q for the call and unfolded after: (T, Q) or (T, Q, C).
    An output that is not one logit per row is refused as in training (`check_output`)."""
    t, q = rows.shape[:2]
    folded = rows.reshape(t * q, *rows.shape[2:])
    out = net_logits(net, folded, ids.reshape(t * q, *ids.shape[2:]))
    check_output(out, folded, kind)
    return out.reshape(t, q, *out.shape[1:])


def predict(learner: MetaLearner, lrs: LearningRates, tasks: TaskSet, inner_steps: int,
            tasks_per_batch: int = 64, which: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Query predictions of tasks ``which`` (default all), with and without adaptation.

    learner: a `MetaLearner` whose net owns its (unsharded) tables; lrs: inner learning rate of
    every adapted name (floats or tensors); ``inner_steps`` first-order steps per task (0:
    no adaptation at all, adapted = plain). Returns flat arrays over the real query rows:
    labels, adapted, plain (probabilities), task. Each task's predictions depend only on that
    task, so ranks can split the tasks.
    """
    net = learner.net
    lrs = {n: (lr.detach() if isinstance(lr, Tensor) else lr) for n, lr in lrs.items()}
    inner = learner.inner_loop(inner_steps, first_order=True)
    to_pred = PREDICTIONS[learner.algorithm.kind]
    which = np.arange(len(tasks)) if which is None else np.asarray(which)
    out: dict[str, list] = {"labels": [], "adapted": [], "plain": [], "task": []}
    for start in range(0, len(which), tasks_per_batch):
        batch = collate(tasks, which[start:start + tasks_per_batch])
        with torch.no_grad():
            rows_s, rows_q = embed_batch(embedder(net), batch)
            with model_contract(net, rows_q):
                plain = plain_logits(net, rows_q, batch.query_ids, learner.algorithm.kind)
            theta, support, query = learner.task_inputs(batch, rows_s, rows_q)
        theta = {n: v.detach() for n, v in theta.items()}
        if inner_steps == 0:
            adapted_logits = plain
        else:
            with model_contract(net, rows_s):
                adapted_logits = _adapted_logits(inner, theta, lrs, support, query[0]).detach()
        real = batch.query_mask.bool()
        out["labels"].append(batch.query_y[real].numpy())
        out["task"].append(batch.task_ids.unsqueeze(1).expand_as(real)[real].numpy())
        out["adapted"].append(to_pred(adapted_logits[real]).double().numpy())
        out["plain"].append(to_pred(plain[real]).double().numpy())
    empty = {"labels": np.float32, "task": np.int64, "adapted": np.float64, "plain": np.float64}
    return {k: np.concatenate(v) if v else np.zeros(0, dtype=empty[k]) for k, v in out.items()}


# Metrics also reported without adaptation (``<name>_no_adapt``) and for the baseline.
HEADLINE = {"binary": ("auc", "logloss"), "regression": ("mae", "rmse")}
# Fewer scored tasks (users) than this and a score says little: the result warns.
FEW_TASKS = 5


class MetricWarning(UserWarning):
    """An evaluation metric is undefined (reported as None) or rests on very few tasks."""


def undefined_reason(name: str, labels: np.ndarray) -> str:
    """Why metric ``name`` (``auc``, ``auc_per_task``, ``ndcg@k``..., with or without
    ``_no_adapt``) is undefined on query rows with these ``labels``."""
    base = name.removesuffix("_no_adapt")
    for prefix in ("baseline_popularity_", "baseline_finetune_tuned_"):
        base = base.removeprefix(prefix)
    if base == "auc":
        values = np.unique(labels)
        which = f"{values[0]:g}" if len(values) == 1 else "?"
        return (f"AUC undefined: the held-out query labels are all one class (all {which}, {len(labels)} "
                "rows); AUC needs both classes")
    if base == "auc_per_task":
        return ("per-task AUC undefined: no held-out task's query labels hold both classes "
                "(tasks_with_auc = 0)")
    if base.startswith("ndcg@"):
        return f"{base} undefined: no held-out task's query has a positive label (tasks_with_ndcg = 0)"
    return f"{base} undefined on these query rows"


def defined(scores: dict, labels: np.ndarray, warn: bool = True) -> dict:
    """``scores`` with every NaN metric replaced by None (JSON null: a summary never holds a
    bare NaN) and its reason (`undefined_reason`) listed under ``warnings``; each new warning
    is also issued as a `MetricWarning` (``warn``)."""
    out, notes = dict(scores), list(scores.get("warnings", []))
    reasons: dict[str, list[str]] = {}  # one note per reason, naming every metric it voids
    for name, value in scores.items():
        if isinstance(value, float) and math.isnan(value):
            out[name] = None
            reasons.setdefault(undefined_reason(name, labels), []).append(name)
    notes += [f"{', '.join(names)}: {reason}" for reason, names in reasons.items()]
    if notes:
        out["warnings"] = notes
        if warn:
            for note in notes[len(scores.get("warnings", [])):]:
                warnings.warn(note, MetricWarning, stacklevel=3)
    return out


def score(preds: list[dict[str, np.ndarray]] | dict[str, np.ndarray], kind: str = "binary",
          warn: bool = True) -> dict:
    """Metrics of `predict` outputs (one, or one per rank): `gmeta_ds.evaluation.metrics.score_tasks` of
    the adapted predictions (binary: ``auc``, ``auc_per_task``, ``logloss``, ``ndcg@k``;
    regression: ``mae``, ``rmse``, ``ndcg@k``) plus the headline metrics without adaptation
    (``auc_no_adapt``... or ``mae_no_adapt``...), ``query_rows`` and ``tasks_scored``.

    Never a bare NaN: an undefined metric (AUC when every query label is one class, per-task
    AUC when no task holds both classes, nDCG with no positive label) is None, and
    ``warnings`` (also issued as `MetricWarning`, unless not ``warn``) says why; so does a
    score of fewer than `FEW_TASKS` tasks (one user's AUC is not a cold-start AUC)."""
    merged = merge(preds)
    with_adapt = score_tasks(merged["labels"], merged["adapted"], merged["task"], kind)
    without = score_tasks(merged["labels"], merged["plain"], merged["task"], kind)
    names = HEADLINE[kind] + (("auc_per_task",) if kind == "binary" else ())
    out = {**with_adapt, **{f"{n}_no_adapt": without[n] for n in names}, "query_rows": int(len(merged["task"])),
           "tasks_scored": int(with_adapt["tasks"])}
    notes = few_tasks_notes(out, kind)
    if notes:
        out["warnings"] = notes
        if warn:
            for note in notes:
                warnings.warn(note, MetricWarning, stacklevel=2)
    return defined(out, merged["labels"], warn)


def merge(preds: list[dict[str, np.ndarray]] | dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Prediction rows of one or several parts (`predict` of each rank, `popularity_predict`...)
    as one, ordered by task (stable: the same row order at any world size)."""
    parts = preds if isinstance(preds, list) else [preds]
    merged = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(merged["task"], kind="stable")
    return {k: v[order] for k, v in merged.items()}


def paired(meta: dict[str, np.ndarray], baselines: dict[str, dict[str, np.ndarray]], kind: str,
           resamples: int, seed: int) -> dict:
    """`gmeta_ds.evaluation.intervals.paired_intervals` of the meta-learned model's adapted predictions
    ``meta`` (merged by `merge`) against each baseline's, given as {name: (rows, key)}: its prediction
    rows (any row order; merged here) and the key of the prediction to compare. Every baseline
    must hold the same query rows: a mismatch is a bug, raised, never a wrong interval."""
    preds = {}
    for name, (rows, key) in baselines.items():
        rows = merge(rows)
        if not (np.array_equal(rows["task"], meta["task"]) and np.array_equal(rows["labels"], meta["labels"])):
            raise RuntimeError(f"paired intervals: the {name} predictions are not of the meta-learned model's "
                               "query rows")
        preds[name] = rows[key]
    return paired_intervals(meta["labels"], meta["task"], meta["adapted"], preds, kind, resamples, seed)


# Each held-out user's metric per model (gmeta_ds/evaluation/report.py draws its distribution):
# the run's evaluation, beside its summary.json; `gmeta-ds eval`'s own, beside its eval.json.
PER_USER_FILE = "per_user.csv"
EVAL_PER_USER_FILE = "eval_per_user.csv"


def per_user_columns(meta: dict[str, np.ndarray], compared: dict[str, tuple[dict, str]], kind: str) -> dict:
    """per_user.csv's columns: ``task`` (the held-out task id), ``query_rows``, and each model's
    AUC of that user's query rows (``<model>_auc``; MAE for ratings, ``<model>_mae``): ``meta``
    (adapted), ``meta_no_adapt`` and every baseline of ``compared`` (`paired`'s {name: (rows,
    key)}); NaN where undefined (one class in the query, a diverged fine-tune)."""
    task, user, rows = np.unique(meta["task"], return_inverse=True, return_counts=True)
    suffix = "auc" if kind == "binary" else "mae"
    out = {"task": task, "query_rows": rows}
    models = {"meta": meta["adapted"], "meta_no_adapt": meta["plain"],
              **{name: merge(r)[key] for name, (r, key) in compared.items()}}
    for name, pred in models.items():
        if not np.isfinite(pred).all():
            out[f"{name}_{suffix}"] = np.full(len(task), np.nan)
        elif kind == "binary":
            out[f"{name}_{suffix}"] = per_task_auc(meta["labels"], pred, meta["task"])
        else:
            out[f"{name}_{suffix}"] = np.bincount(user.reshape(-1), np.abs(pred - meta["labels"])) / rows
    return out


def write_per_user(path, columns: dict[str, np.ndarray]) -> None:
    """``columns`` (`per_user_columns`) as CSV (`per_user_text`), written beside ``path`` and
    renamed into place: an earlier file is replaced only by a complete one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(per_user_text(columns))
    os.replace(tmp, path)


def per_user_text(columns: dict[str, np.ndarray]) -> str:
    """per_user.csv's text of ``columns`` (`per_user_columns`), an undefined value an empty field."""
    import csv
    import io

    out = io.StringIO(newline="")
    writer = csv.writer(out)
    writer.writerow(columns)
    for row in zip(*columns.values()):
        writer.writerow(["" if isinstance(v, float) and math.isnan(v) else
                         (f"{v:.6g}" if isinstance(v, float) else int(v)) for v in map(_plain, row)])
    return out.getvalue()


def _plain(value):
    """A numpy scalar as a Python int or float."""
    return value.item() if hasattr(value, "item") else value


def few_tasks_notes(scores: dict, kind: str) -> list[str]:
    """Warnings for scores that rest on fewer than `FEW_TASKS` tasks (users)."""
    notes = []
    tasks = scores["tasks_scored"]
    if tasks < FEW_TASKS:
        metric = "AUC" if kind == "binary" else "MAE / RMSE"
        notes.append(f"only {tasks} task(s) scored: the {metric} rests on the query rows of {tasks} user(s) "
                     f"and says little about cold start; score at least {FEW_TASKS} held-out tasks")
    with_auc = scores.get("tasks_with_auc")
    if kind == "binary" and with_auc is not None and 0 < with_auc < FEW_TASKS:
        notes.append(f"auc_per_task is the mean over only {with_auc} task(s) whose query labels hold both "
                     "classes")
    return notes


def evaluate(learner: MetaLearner, lrs: LearningRates, tasks: TaskSet, inner_steps: int,
             tasks_per_batch: int = 64) -> dict:
    """`score` of `predict` over every task of ``tasks`` in this process."""
    return score(predict(learner, lrs, tasks, inner_steps, tasks_per_batch), learner.algorithm.kind)


def train_baseline(net: nn.Module, tasks: TaskSet, epochs: int, batch_size: int, lr: float,
                   seed: int, loss_fn=masked_bce) -> nn.Module:
    """Supervised (non-meta) training of ``net`` on every interaction of ``tasks`` with Adam."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.from_numpy(tasks.ids.astype(np.int64))
    labels = torch.from_numpy(np.array(tasks.labels))  # a copy: store arrays are read-only
    ones = torch.ones(batch_size)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(ids), generator=generator)
        for start in range(0, len(ids), batch_size):
            rows = order[start:start + batch_size]
            multi = {name: Jagged(*(torch.from_numpy(a.astype(np.int64)) for a in take_rows(v, o, rows.numpy())))
                     for name, (v, o) in tasks.multi.items()}
            # A training row is left out of its own item's popularity counts (models/popularity.py).
            logits = net_logits(net, embedder(net)(ids[rows], multi), ids[rows], labels[rows])
            loss = loss_fn(logits, labels[rows], ones[: len(rows)])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return net


BASELINES = ("non_meta", "popularity")


def evaluate_problems(tasks, inner_steps, tasks_per_batch, bootstrap_resamples, baselines, train, settings,
                      initial_kept: bool, extras: dict | None = None) -> tuple[list[str], list[str]]:
    """What is wrong with `MetaEngine.evaluate`'s arguments, and the baselines it asks for:
    ``settings`` the non-meta baseline's (epochs, lr, batch size); ``initial_kept``: the engine
    kept the initial weights that baseline starts from; ``extras``: the opt-in keyword
    arguments (`extra_problems`)."""
    problems = [] if isinstance(tasks, TaskSet) else [f"tasks: expected a gm.TaskSet (data.test), got "
                                                      f"{type(tasks).__name__}"]
    if inner_steps is not None:
        int_at_least(problems, "inner_steps", inner_steps, 0)
    int_at_least(problems, "tasks_per_batch", tasks_per_batch, 1)
    int_at_least(problems, "bootstrap_resamples", bootstrap_resamples, 0)
    wanted = _baseline_names(problems, baselines)
    if wanted:
        _check_baselines(problems, wanted, train, *settings, initial_kept)
    extra_problems(problems, wanted, **(extras or {}))
    return problems, wanted


def extra_problems(problems: list[str], wanted: list[str], few_shot=(), steps_curve=(), finetune_search=False,
                   valid=None, states=None, synthetic=False, out=None) -> None:
    """`MetaEngine.evaluate`'s opt-in arguments: the curves' support sizes (>= 1) and inner
    steps (>= 0), the fine-tune search (the non-meta baseline and validation users), the
    cold-start states ({name: TaskSet}), ``synthetic`` and ``out`` (a folder path)."""
    for name, values, low in (("few_shot", few_shot, 1), ("steps_curve", steps_curve, 0)):
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            problems.append(f"{name}: {values!r} is not a list of integers >= {low}")
        else:
            for value in values:
                int_at_least(problems, name, value, low)
    for name, value in (("finetune_search", finetune_search), ("synthetic", synthetic)):
        if not isinstance(value, bool):
            problems.append(f"{name}: {value!r} is not True or False")
    if finetune_search is True:
        if "non_meta" not in wanted:
            problems.append("finetune_search: tunes the non-meta baseline's fine-tuning: add 'non_meta' to baselines")
        if not isinstance(valid, TaskSet) or len(valid) == 0:
            problems.append(f"valid: finetune_search chooses the fine-tuning's lr and steps on validation users: "
                            f"pass valid=data.valid, a non-empty gm.TaskSet (got {type(valid).__name__})")
    if states is not None and not (isinstance(states, dict) and all(
            isinstance(k, str) and isinstance(v, TaskSet) for k, v in states.items())):
        problems.append("states: expected None or a dict of state name -> gm.TaskSet (data.states)")
    if out is not None and not (isinstance(out, os.PathLike) or isinstance(out, str) and out.strip()):
        problems.append(f"out: {out!r} is not None or a folder path (str or Path)")


def _baseline_names(problems: list[str], baselines) -> list[str]:
    """``evaluate``'s ``baselines`` as a list of names of `BASELINES` (a str is one name)."""
    if isinstance(baselines, str):
        baselines = [baselines]
    try:
        names = list(baselines)
    except TypeError:
        problems.append(f"baselines: {baselines!r} is not a list of {', '.join(BASELINES)}")
        return []
    bad = [n for n in names if n not in BASELINES]
    if bad:
        problems.append(f"baselines: {', '.join(map(repr, bad))} not among {', '.join(BASELINES)}")
    return [n for n in BASELINES if n in names]


def _check_baselines(problems: list[str], wanted: list[str], train, epochs, lr, batch_size, initial_kept: bool) -> None:
    """``evaluate``'s baseline arguments: the training tasks and the non-meta baseline's
    training settings, and initial weights to start it from."""
    if not isinstance(train, TaskSet):
        problems.append(f"train: the baselines {', '.join(wanted)} are fitted on the training tasks: "
                        f"pass train=data.train (got {type(train).__name__})")
    int_at_least(problems, "baseline_epochs", epochs, 0)
    finite(problems, "baseline_lr", lr)
    int_at_least(problems, "baseline_batch_size", batch_size, 1)
    if "non_meta" in wanted and not initial_kept:
        problems.append("baselines: 'non_meta' starts from the model's initial weights, which this "
                        "engine did not keep (its parameters were already partitioned when "
                        "gm.initialize got them)")
