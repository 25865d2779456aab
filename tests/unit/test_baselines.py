"""The eval baselines: item popularity + per-user offset, and the fine-tuned baseline whose
lr and steps are chosen on validation users (gmeta_ds/evaluation/baselines.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import gmeta_ds.evaluation.baselines as baselines
from gmeta_ds.evaluation.baselines import (fit_popularity, item_column, popularity_predict, popularity_scores,
                                user_offsets)
from gmeta_ds.config import config_from_dict
from gmeta_ds.data.tasks import TaskSet
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.errors import ConfigError

FIELDS = [FieldSpec("age", 3, "user"), FieldSpec("item_id", 5, "item"), FieldSpec("brand", 2, "item")]


def _tasks(rows: list[list[tuple[int, float]]], support: list[int]) -> TaskSet:
    """Tasks of (item, label) rows; the age and brand columns are 0."""
    flat = [r for task in rows for r in task]
    ids = np.zeros((len(flat), 3), dtype=np.int32)
    ids[:, 1] = [item for item, _ in flat]
    labels = np.array([y for _, y in flat], dtype=np.float32)
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in rows])]).astype(np.int64)
    return TaskSet(FIELDS, ids, labels, offsets, np.array(support, dtype=np.int64),
                   np.arange(len(rows), dtype=np.int64))


# Item 1: 2 clicks / 3, item 2: 0 / 2, item 3: 1 / 1; global click rate 1/2; item 0 (OOV) unseen.
TRAIN = _tasks([[(1, 1), (1, 1), (1, 0)], [(2, 0), (2, 0), (3, 1)]], [1, 1])


def test_item_column_is_the_first_item_field():
    assert item_column(FIELDS) == 1
    fields = [FieldSpec("a", 2, "user"), FieldSpec("g", 3, "item", multi_hot=True),
              FieldSpec("movie", 9, "item")]
    assert item_column(fields) == 1


def test_popularity_matches_a_hand_computation():
    pop = fit_popularity(TRAIN, 1, "binary", oov_id=0, prior=2.0, offset_prior=0.0)
    # (clicks + 2 * 1/2) / (shown + 2): item 1 3/5, item 2 1/4, item 3 2/3; OOV and unseen: 1/2
    np.testing.assert_allclose(pop.item_score[:4], [0.0, math.log(1.5), math.log(1 / 3), math.log(2)])
    assert pop.prior_score == 0.0
    # A: support item 3 twice, 1 click of 2 -> offset logit(1/2) - log 2 = -log 2 (no shrinkage);
    # B: item 2 three times, 2 clicks -> logit(2/3) - log(1/3) = log 6. Item 4 never seen: prior.
    test = _tasks([[(3, 1), (3, 0), (1, 1), (0, 0)],
                   [(2, 1), (2, 1), (2, 0), (3, 0), (2, 1), (4, 1)]], [2, 3])
    np.testing.assert_allclose(user_offsets(pop, test), [-math.log(2), math.log(6)], atol=1e-12)
    out = popularity_predict(pop, test)
    np.testing.assert_allclose(out["pred"], [3 / 7, 1 / 3, 12 / 13, 2 / 3, 6 / 7], atol=1e-12)
    np.testing.assert_array_equal(out["task"], [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(out["labels"], [1, 0, 0, 1, 1])
    got = popularity_scores(pop, test)
    # positives 3/7, 2/3, 6/7 against negatives 1/3, 12/13: 3 of 6 pairs won
    assert got["baseline_popularity_auc"] == pytest.approx(0.5)
    assert got["baseline_popularity_auc_per_task"] == pytest.approx((1.0 + 0.0) / 2)  # A 1, B 0
    logloss = -sum(map(math.log, (3 / 7, 2 / 3, 1 / 13, 2 / 3, 6 / 7))) / 5
    assert got["baseline_popularity_logloss"] == pytest.approx(logloss)


def test_oov_id_gets_the_global_prior_even_when_seen_in_training():
    train = _tasks([[(0, 1), (0, 1), (1, 0), (1, 0)]], [1])
    assert fit_popularity(train, 1, "binary", oov_id=0, prior=2.0).item_score[0] == 0.0
    seen = fit_popularity(train, 1, "binary", oov_id=None, prior=2.0)
    assert seen.item_score[0] == pytest.approx(math.log(3))  # (2 + 1) / (2 + 2) -> logit log 3


def test_offset_moves_predictions_toward_the_support_click_rate():
    pop = fit_popularity(TRAIN, 1, "binary", prior=2.0, offset_prior=1.0)
    # same query (items 1 and 2), supports all clicks / no clicks / the items' own rates
    test = _tasks([[(1, 1), (2, 1), (1, 1), (1, 0), (2, 0)],
                   [(1, 0), (2, 0), (1, 0), (1, 0), (2, 0)],
                   [(1, 1), (2, 0), (1, 1), (1, 0), (2, 0)]], [3, 3, 3])
    b = user_offsets(pop, test)
    assert b[0] > 0 > b[1]
    # the Newton fixed point: sum(y - p) = offset_prior * b on each support
    s = pop.scores_of(test.ids)
    for t in range(3):
        rows = test.split(t)[0]
        p = 1 / (1 + np.exp(-(s[rows] + b[t])))
        assert (test.labels[rows] - p).sum() == pytest.approx(b[t], abs=1e-10)
    pred = popularity_predict(pop, test)["pred"].reshape(3, 2)
    plain = 1 / (1 + np.exp(-pop.scores_of(test.ids[[3, 4]])))
    assert (pred[0] > plain).all() and (pred[1] < plain).all()
    # a constant offset per user keeps each user's ranking: the per-task AUC is popularity's
    assert pred[0, 0] > pred[0, 1] and pred[1, 0] > pred[1, 1]


def test_regression_popularity_matches_a_hand_computation():
    train = _tasks([[(1, 5), (1, 4), (1, 3)], [(2, 1), (2, 2), (3, 4)]], [1, 1])
    pop = fit_popularity(train, 1, "regression", prior=2.0, offset_prior=1.0)
    # mean 19/6; (sum + 2 * 19/6) / (count + 2)
    np.testing.assert_allclose(pop.item_score[1:4], [11 / 3, 7 / 3, 31 / 9])
    test = _tasks([[(1, 5), (2, 3), (3, 4), (4, 2)]], [2])
    # residuals 4/3 and 2/3 -> offset 2 / (2 + 1) = 2/3; item 4 unseen: 19/6
    out = popularity_predict(pop, test)
    np.testing.assert_allclose(out["pred"], [31 / 9 + 2 / 3, 19 / 6 + 2 / 3])
    got = popularity_scores(pop, test)
    err = np.array([31 / 9 + 2 / 3 - 4, 19 / 6 + 2 / 3 - 2])
    assert got["baseline_popularity_mae"] == pytest.approx(np.abs(err).mean())
    assert got["baseline_popularity_rmse"] == pytest.approx(np.sqrt((err ** 2).mean()))


TINY = {"data": {"synthetic": {"num_users": 60, "num_items": 30, "max_interactions": 30},
                 "valid_fraction": 0.2},
        "model": {"embed_dim": 4, "hidden": [8]},
        "eval": {"baseline_epochs": 1, "finetune_search": True}}


def test_finetune_search_picks_the_best_validation_point_and_scores_test_once(monkeypatch):
    from gmeta_ds.workloads.ctr import CTRWorkload, build_data, build_learner, run_evaluation

    cfg = config_from_dict(TINY)
    data = build_data(cfg)
    assert data.valid is not None and len(data.valid) == 10 and len(data.train) == 38
    calls = []
    target = (0.3, 2)

    def fake_predict(learner, lrs, tasks, inner_steps, tasks_per_batch=64, which=None):
        (lr,) = set(lrs.values())
        calls.append((tasks, lr, inner_steps))
        queries = [tasks.split(t)[1] for t in range(len(tasks))]
        rows = np.concatenate([np.arange(q.start, q.stop) for q in queries])
        task = np.repeat(np.arange(len(tasks)), [q.stop - q.start for q in queries])
        labels = tasks.labels[rows]
        noise = np.random.default_rng(0).random(len(rows))
        # validation AUC rises with lr * steps up to the target, which alone ranks perfectly
        quality = 1.0 if (lr, inner_steps) == target else min(lr * inner_steps, 0.5) / 2
        adapted = quality * labels + (1 - quality) * noise
        return {"labels": labels, "adapted": adapted, "plain": noise, "task": task}

    monkeypatch.setattr(baselines, "predict", fake_predict)
    ev = run_evaluation(cfg, build_learner(cfg, data.fields), data)
    assert (ev["baseline_finetune_lr"], ev["baseline_finetune_steps"]) == target
    grid = ev["baseline_finetune_grid"]
    assert len(grid) == 20 and grid["lr=0.3,steps=2"] == 1.0 == max(grid.values())
    assert ev["baseline_finetune_tuned_auc"] == 1.0
    assert ev["baseline_finetune_tuned_auc_per_task"] == 1.0  # the chosen pair ranks every user perfectly
    assert "baseline_finetune_tuned_logloss" in ev
    # Every fine-tuned baseline reports its mean per-user AUC, whose paired difference is that of the scores.
    differences = ev["intervals"]["differences"]
    for name in ("baseline", "baseline_finetune", "baseline_finetune_tuned", "baseline_popularity"):
        assert differences[name]["auc_per_task"]["diff"] == pytest.approx(
            ev["auc_per_task"] - ev[f"{name}_auc_per_task"], abs=1e-9), name
    summary = {"meta_steps": 1, "tasks_seen": 1, "world_size": 1, "elapsed_s": 1.0, "final_query_loss": 0.5,
               "eval": ev}
    printed = CTRWorkload().report(summary, "out")
    assert printed[1].startswith("cold-start per-user AUC: meta-learned + adaptation ")
    assert (f"| baseline + fine-tune {ev['baseline_finetune_auc_per_task']:.4f} | baseline + tuned fine-tune "
            "(lr 0.3, 2 steps) 1.0000 | popularity + user offset ") in printed[1]
    assert printed[2].startswith("cold-start AUC: ")
    assert printed[4].startswith("  vs non-meta baseline: per-user AUC ")
    on_valid = [(lr, n) for tasks, lr, n in calls if tasks is data.valid]
    on_test = [(lr, n) for tasks, lr, n in calls if tasks is data.test]
    assert len(on_valid) == 20 and len(set(on_valid)) == 20
    # the test users are scored with the chosen pair, then along the inner-steps curve with the chosen lr
    assert on_test == [target] + [(target[0], n) for n in (0, 1, 2, 5, 10)]
    # ... and so is each point of the few-shot curve (their supports cut to 1, 2, 5, 10, 20 rows)
    few_shot = [(lr, n) for tasks, lr, n in calls if tasks is not data.valid and tasks is not data.test]
    assert few_shot == [target] * 5 and len(calls) == 31
    # the popularity baseline is on by default
    assert 0.0 <= ev["baseline_popularity_auc"] <= 1.0 and "baseline_popularity_logloss" in ev


def test_finetune_search_needs_validation_users():
    with pytest.raises(ConfigError, match="eval.finetune_search: chooses the fine-tuned baseline's lr "
                                          "and steps on validation users; set data.valid_fraction > 0"):
        config_from_dict({"eval": {"finetune_search": True}})
    with pytest.raises(ConfigError, match="eval.finetune_search: needs eval.baseline: true"):
        config_from_dict({"eval": {"finetune_search": True, "baseline": False},
                          "data": {"valid_fraction": 0.1}})
    with pytest.raises(ConfigError, match="eval.popularity_baseline: expected bool"):
        config_from_dict({"eval": {"popularity_baseline": "yes"}})
    ok = config_from_dict({"eval": {"finetune_search": True}, "data": {"valid_fraction": 0.1}})
    assert ok.eval.finetune_search


def test_synthetic_validation_users_leave_the_default_data_unchanged():
    from gmeta_ds.workloads.ctr import build_data

    plain = build_data(config_from_dict({"data": {"synthetic": {"num_users": 50}}}))
    split = build_data(config_from_dict({"data": {"synthetic": {"num_users": 50}, "valid_fraction": 0.25}}))
    assert plain.valid is None
    assert len(split.valid) == round(0.25 * len(plain.train))
    assert len(split.train) + len(split.valid) == len(plain.train)
    assert not set(split.valid.task_keys) & set(split.train.task_keys)
    np.testing.assert_array_equal(split.test.ids, plain.test.ids)


def test_finetune_search_tunes_for_the_per_user_auc_not_the_global_one(monkeypatch):
    """Clicks: the grid point is chosen by the mean per-user AUC (the metric the meta-learned
    model is compared on first). Here one point gets each user's level right (global AUC high,
    every user's own order random) and the other each user's order (per-user AUC 1, levels
    wrong): the second is chosen."""
    # user 0 clicks 3 of 4 query rows, user 1 clicks 1 of 4
    valid = _tasks([[(1, 1), (1, 1), (2, 1), (1, 1), (2, 0)], [(1, 1), (2, 0), (2, 0), (1, 1), (2, 0)]], [1, 1])
    labels = np.array([1, 1, 1, 0, 0, 0, 1, 0], dtype=np.float32)
    task = np.repeat([0, 1], 4)
    level = np.where(task == 0, 0.9, 0.1) + np.array([0, 1, 2, 3, 0, 1, 2, 3]) * 1e-3  # order: no signal
    order = np.where(task == 0, 0.2, 0.8) + labels * 0.1  # each user's clicks first, levels reversed

    def fake_predict(learner, lrs, tasks, inner_steps, tasks_per_batch=64, which=None):
        (lr,) = set(lrs.values())
        return {"labels": labels, "adapted": level if lr == 0.1 else order, "plain": level, "task": task}

    class Learner:
        algorithm = type("A", (), {"kind": "binary"})()

        def adapted_names(self):
            return ["mlp.0.weight"]

    monkeypatch.setattr(baselines, "predict", fake_predict)
    lr, steps, grid = baselines.finetune_search(Learner(), valid, lrs=(0.1, 0.3), steps=(1,))
    assert (lr, steps) == (0.3, 1) and grid == {"lr=0.1,steps=1": pytest.approx(1 / 3), "lr=0.3,steps=1": 1.0}
    score = baselines.score
    assert score({"labels": labels, "adapted": level, "plain": level, "task": task}, "binary", warn=False)["auc"] > \
        score({"labels": labels, "adapted": order, "plain": level, "task": task}, "binary", warn=False)["auc"]


def test_one_oov_rule_for_cli_api_and_serving():
    # Log sources map unseen items to id 0; synthetic ids are dense (item 0 is real); raw ids
    # (dynamic tables) have no OOV id.
    assert baselines.oov_id(synthetic=False) == 0
    assert baselines.oov_id(synthetic=True) is None
    assert baselines.oov_id(synthetic=False, raw=True) is None
    # No module writes the rule again beside baselines.oov_id (`oov_id=None if ...` or
    # `"oov_id": None if ...`), so the CLI, the API and an export cannot drift apart.
    import re
    from pathlib import Path

    package = Path(baselines.__file__).parents[1]
    inline = [str(p.relative_to(package)) for p in package.rglob("*.py")
              if re.search(r"oov_id\"?\s*[:=]\s*None if", p.read_text())]
    assert inline == []
