"""score_tasks against scikit-learn references computed task by task."""
import math
import subprocess
import sys

import numpy as np
import pytest
from sklearn.metrics import log_loss, ndcg_score, roc_auc_score

from gmeta_ds.evaluation.metrics import score_tasks


def _binary(seed=0, n_tasks=40, max_len=25, ties=False):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_len, n_tasks)
    tids = np.repeat(rng.permutation(10 * n_tasks)[:n_tasks], sizes)
    rng.shuffle(tids)  # rows of a task are not contiguous
    labels = (rng.random(len(tids)) < 0.4).astype(int)
    preds = rng.random(len(tids))
    if ties:
        preds = np.round(preds * 4) / 4  # only 5 distinct values: many ties within tasks
    return labels, preds, tids


def _per_task(tids):
    for t in np.unique(tids):
        yield t, tids == t


def _ref_ndcg(labels, preds, tids, k):
    vals = []
    for _, m in _per_task(tids):
        y, p = labels[m].astype(float), preds[m]
        if y.max() <= 0:
            continue
        vals.append(1.0 if len(y) == 1 else ndcg_score(y[None], p[None], k=k))
    return np.mean(vals), len(vals)


@pytest.mark.parametrize("ties", [False, True])
def test_global_auc_and_logloss_match_sklearn(ties):
    """Our Mann-Whitney AUC and numpy log loss (no sklearn import at run time) equal sklearn's,
    with tied predictions and predictions at 0 and 1 (clipped) included."""
    labels, preds, tids = _binary(seed=1)
    if ties:
        preds = np.round(preds, 1)
        preds[:5] = [0.0, 1.0, 0.0, 1.0, 0.5]
    out = score_tasks(labels, preds, tids)
    eps = np.finfo(np.float64).eps
    assert out["auc"] == pytest.approx(roc_auc_score(labels, preds), abs=1e-12)
    assert out["logloss"] == pytest.approx(log_loss(labels, np.clip(preds, eps, 1 - eps), labels=[0, 1]), abs=1e-12)
    assert out["rows"] == len(labels) and out["tasks"] == len(np.unique(tids))


def test_scoring_does_not_import_sklearn():
    """Evaluation in the CLI and API imports no sklearn (1-3 s of every evaluating process)."""
    code = ("import sys, numpy as np; from gmeta_ds.evaluation.metrics import score_tasks; "
            "r = np.random.default_rng(0); y = (r.random(200) < .3).astype(float); "
            "score_tasks(y, r.random(200), r.integers(0, 9, 200)); print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.parametrize("ties", [False, True])
def test_per_task_auc_matches_hand_loop(ties):
    labels, preds, tids = _binary(seed=2, ties=ties)
    ref, skipped = [], 0
    for _, m in _per_task(tids):
        if len(np.unique(labels[m])) < 2:
            skipped += 1
            continue
        ref.append(roc_auc_score(labels[m], preds[m]))
    assert skipped > 0  # the fixture does contain one-class tasks
    out = score_tasks(labels, preds, tids)
    assert out["tasks_with_auc"] == len(ref) == out["tasks"] - skipped
    assert out["auc_per_task"] == pytest.approx(np.mean(ref), abs=1e-12)


def test_one_class_tasks_skipped_and_counted():
    labels = np.array([1, 1, 0, 0, 1, 0, 0])
    preds = np.array([.9, .8, .1, .2, .3, .7, .6])
    tids = np.array([7, 7, 8, 8, 9, 9, 9])  # task 7 all positive, task 8 all negative
    out = score_tasks(labels, preds, tids, k=(2,))
    assert out["tasks_with_auc"] == 1 and out["auc_per_task"] == 0.0  # task 9: pos ranked last
    assert out["tasks_with_ndcg"] == 2  # task 8 has no positive: skipped for nDCG
    assert out["ndcg@2"] == pytest.approx((1.0 + ndcg_score([[1, 0, 0]], [[.3, .7, .6]], k=2)) / 2)


def test_single_class_global_labels_give_nan_auc_not_error():
    out = score_tasks(np.zeros(6), np.linspace(0, 1, 6), np.array([0, 0, 1, 1, 2, 2]))
    assert math.isnan(out["auc"]) and math.isnan(out["auc_per_task"])
    assert out["tasks_with_auc"] == 0 and math.isnan(out["ndcg@5"]) and out["tasks_with_ndcg"] == 0
    assert np.isfinite(out["logloss"])


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [1, 3, 5, 10, 30])
def test_binary_ndcg_matches_sklearn_per_task(ties, k):
    labels, preds, tids = _binary(seed=3, max_len=12, ties=ties)  # many tasks shorter than k
    out = score_tasks(labels, preds, tids, k=(k,))
    ref, count = _ref_ndcg(labels, preds, tids, k)
    assert out[f"ndcg@{k}"] == pytest.approx(ref, abs=1e-12)
    assert out["tasks_with_ndcg"] == count


def test_ties_are_averaged_and_order_independent():
    labels = np.array([1, 0, 0, 1])
    preds = np.array([.5, .5, .5, .1])
    out = score_tasks(labels, preds, np.zeros(4), k=(2,))
    assert out["ndcg@2"] == pytest.approx(ndcg_score([labels], [preds], k=2), abs=1e-12)
    perm = np.array([2, 3, 1, 0])
    assert score_tasks(labels[perm], preds[perm], np.zeros(4), k=(2,)) == out


def test_regression_metrics():
    rng = np.random.default_rng(4)
    tids = rng.integers(0, 30, 500)
    ratings = rng.integers(1, 6, 500).astype(float)
    preds = np.round(ratings + rng.normal(0, 1, 500))  # rounded: ties in preds
    out = score_tasks(ratings, preds, tids, kind="regression", k=(3, 10))
    assert out["mae"] == pytest.approx(np.mean(np.abs(preds - ratings)), abs=1e-12)
    assert out["rmse"] == pytest.approx(np.sqrt(np.mean((preds - ratings) ** 2)), abs=1e-12)
    for k in (3, 10):
        assert out[f"ndcg@{k}"] == pytest.approx(_ref_ndcg(ratings, preds, tids, k)[0], abs=1e-12)
    assert "auc" not in out and "logloss" not in out


def test_string_task_ids():
    labels, preds, tids = _binary(seed=5)
    a = score_tasks(labels, preds, tids)
    b = score_tasks(labels, preds, np.array([f"user{t}" for t in tids]))
    assert a == pytest.approx(b, abs=1e-12)


def test_error_messages():
    with pytest.raises(ValueError, match="empty input"):
        score_tasks(np.array([]), np.array([]), np.array([]))
    with pytest.raises(ValueError, match=r"labels has 3 rows, preds 2"):
        score_tasks(np.array([0, 1, 0]), np.array([.1, .2]), np.array([0, 0, 0]))
    with pytest.raises(ValueError, match="task_ids 4"):
        score_tasks(np.array([0, 1, 0]), np.array([.1, .2, .3]), np.zeros(4))
    with pytest.raises(ValueError, match="kind"):
        score_tasks(np.array([0, 1]), np.array([.1, .2]), np.zeros(2), kind="ranking")
    with pytest.raises(ValueError, match="0 or 1"):
        score_tasks(np.array([0, 2]), np.array([.1, .2]), np.zeros(2))
    with pytest.raises(ValueError, match="finite"):
        score_tasks(np.array([0, 1]), np.array([.1, np.nan]), np.zeros(2))
    with pytest.raises(ValueError, match="positive int"):
        score_tasks(np.array([0, 1]), np.array([.1, .2]), np.zeros(2), k=(0,))


def test_extreme_probabilities_give_finite_logloss():
    out = score_tasks(np.array([1, 0, 1, 0]), np.array([0., 1., 1., 0.]), np.array([0, 0, 1, 1]))
    assert np.isfinite(out["logloss"]) and out["auc"] == 0.5


def test_million_rows_ten_thousand_tasks_runs():
    rng = np.random.default_rng(6)
    n = 1_000_000
    tids = rng.integers(0, 10_000, n)
    labels = (rng.random(n) < 0.3).astype(np.int8)
    preds = rng.random(n).astype(np.float32)
    out = score_tasks(labels, preds, tids)
    assert out["tasks"] == 10_000 and out["rows"] == n
    assert 0.45 < out["auc_per_task"] < 0.55 and 0.0 < out["ndcg@10"] < 1.0
