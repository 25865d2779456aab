"""Item popularity as a logit offset of every model (``model.item_popularity``,
gmeta_ds/models/popularity.py): the statistic by hand, no leakage from held-out users or a
training row's own label, config errors, vmap == loop, the body split, sharded rows, and the
counts saved and loaded with the model."""
from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from gmeta_ds.algorithms import ALGORITHMS, MetaLearner
from gmeta_ds.algorithms.base import embed_batch, embedder
from gmeta_ds.evaluation.baselines import fit_popularity
from gmeta_ds.config import EmbeddingConfig, config_from_dict
from gmeta_ds.data.tasks import TaskSet, collate
from gmeta_ds.engine.parallelize import parallelize
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.errors import ConfigError
from gmeta_ds.evaluation.scores import predict
from gmeta_ds.models import build_model
from gmeta_ds.models.popularity import PopularityOffset
from gmeta_ds.models import MODELS
from tests.unit.models.test_zoo import FIELDS, TINY, batch, make_net, meta_grads, task_set

LOG_FIELDS = [FieldSpec("age", 3, "user"), FieldSpec("item_id", 5, "item")]


def _log(rows: list[list[tuple[int, float]]], support: list[int]) -> TaskSet:
    """Tasks of (item, label) rows; the age column is 0."""
    flat = [r for task in rows for r in task]
    ids = np.zeros((len(flat), 2), dtype=np.int32)
    ids[:, 1] = [item for item, _ in flat]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in rows])]).astype(np.int64)
    return TaskSet(LOG_FIELDS, ids, np.array([y for _, y in flat], dtype=np.float32), offsets,
                   np.array(support, dtype=np.int64), np.arange(len(rows), dtype=np.int64))


# Item 1: 2 clicks / 3 shown, item 2: 0 / 2, item 3: 1 / 1; global click rate 1/2; item 0 is
# the OOV id, item 4 is never seen.
TRAIN = _log([[(1, 1), (1, 1), (1, 0)], [(2, 0), (2, 0), (3, 1)]], [1, 1])


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_the_statistic_is_the_shrunk_click_log_odds_by_hand():
    pop = PopularityOffset(LOG_FIELDS, "binary", prior=2.0, oov_id=0).fit(TRAIN)
    items = torch.tensor([[0, 0], [0, 1], [0, 2], [0, 3], [0, 4], [0, 7]])
    expected = [0.0, logit(3 / 5), logit(1 / 4), logit(2 / 3), 0.0, 0.0]  # (clicks + 2 * 1/2) / (shown + 2)
    torch.testing.assert_close(pop.statistic(items), torch.tensor(expected), atol=1e-6, rtol=0)
    # ... the popularity baseline's own item scores (the same statistic, one code path).
    baseline = fit_popularity(TRAIN, 1, "binary", oov_id=0, prior=2.0)
    torch.testing.assert_close(pop.statistic(items[:4]).double(), torch.from_numpy(baseline.item_score),
                               atol=1e-6, rtol=0)
    # Leave-one-out for training rows, from the counts and the global rate (3/6) without the
    # row: item 1 clicked -> (1 + 2 * 2/5) / (2 + 2); item 2 not clicked -> (0 + 2 * 3/5) / (1 + 2);
    # item 3's only row -> its prior 2/5; the OOV id is never counted (global 1/2).
    loo = pop.statistic(items[:4], labels=torch.tensor([1.0, 1.0, 0.0, 1.0]))
    torch.testing.assert_close(loo, torch.tensor([0.0, logit(0.45), logit(0.4), logit(0.4)]), atol=1e-6, rtol=0)
    loo = pop.statistic(items[1:2], labels=torch.tensor([0.0]))  # item 1 not clicked: (2 + 2 * 3/5) / 4
    torch.testing.assert_close(loo, torch.tensor([logit(0.8)]), atol=1e-6, rtol=0)
    # The offset: weight (1) * statistic + bias (0).
    torch.testing.assert_close(pop(pop.statistic(items)), pop.statistic(items))


def test_ratings_shrink_the_mean_rating():
    train = _log([[(1, 5.0), (1, 3.0), (2, 1.0)]], [1])
    pop = PopularityOffset(LOG_FIELDS, "regression", prior=1.0).fit(train)
    mean = 3.0
    got = pop.statistic(torch.tensor([[0, 1], [0, 2], [0, 4]]))
    torch.testing.assert_close(got, torch.tensor([(8 + mean) / 3, (1 + mean) / 2, mean]))
    loo = pop.statistic(torch.tensor([[0, 1]]), labels=torch.tensor([5.0]))  # mean without it: 2
    torch.testing.assert_close(loo, torch.tensor([(3 + 2.0) / 2]))


def test_no_leakage_from_held_out_users_or_a_rows_own_label():
    """The counts come from the training tasks of the CTR workload only: changing every
    validation and test label changes nothing; a training row's leave-one-out statistic does
    not move with its own label."""
    from gmeta_ds.workloads.ctr import CTRWorkload

    cfg = config_from_dict({"model": {"embed_dim": 4, "hidden": [8], "item_popularity": True},
                            "data": {"synthetic": {"num_users": 40, "num_items": 30, "max_interactions": 20}}})
    built = CTRWorkload().build(cfg, 0, 1)
    data, learner = built.data, built.learner
    pop = learner.net.popularity
    assert len(data.test) and len(data.train)
    assert [f.name for f in data.fields][pop.column] == "item_id"
    items = data.train.ids[:, pop.column].astype(np.int64)
    np.testing.assert_array_equal(pop.shown.numpy(), np.bincount(items, minlength=len(pop.shown)))
    np.testing.assert_allclose(pop.total.numpy(), np.bincount(items, data.train.labels, minlength=len(pop.shown)),
                               rtol=1e-6)
    assert pop.rows.item() == data.train.num_interactions  # no validation or test row counted
    # Leave-one-out: refit with one training label flipped; that row's statistic is unchanged.
    train = copy.copy(data.train)
    train.labels = data.train.labels.copy()
    ids = torch.from_numpy(data.train.ids[:1].astype(np.int64))
    before = pop.statistic(ids, torch.from_numpy(train.labels[:1]))
    train.labels[0] = 1.0 - train.labels[0]
    moved = PopularityOffset(data.fields, "binary", 10.0, None).fit(train)
    assert moved.mean.item() != pop.mean.item()
    torch.testing.assert_close(moved.statistic(ids, torch.from_numpy(train.labels[:1])), before)
    assert not torch.allclose(moved.statistic(ids), pop.statistic(ids))  # the full counts moved
    # Meta-training batches use the leave-one-out statistic, evaluation the full one.
    b = collate(data.train, [0, 1])
    rows = embed_batch(embedder(learner.net), b)
    _, support, _ = learner.task_inputs(b, *rows, training=True)
    torch.testing.assert_close(support[0][1], pop.statistic(b.support_ids, b.support_y))
    _, support, _ = learner.task_inputs(b, *rows)
    torch.testing.assert_close(support[0][1], pop.statistic(b.support_ids))


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": {"item_popularity": "yes", "popularity_prior": 0}})
    text = str(err.value)
    assert "model.item_popularity: expected bool, got 'yes'" in text
    assert "model.popularity_prior: 0.0 is not a positive number" in text
    with pytest.raises(ConfigError, match="model.popularity_prior: -1.0 is not a positive number"):
        config_from_dict({"model": {"item_popularity": True, "popularity_prior": -1.0}})
    raw = [FieldSpec("age", 3, "user"), FieldSpec("item_id", 5, "item", raw=True)]
    with pytest.raises(ConfigError, match="model.item_popularity: the item field 'item_id' keeps raw ids"):
        PopularityOffset(raw)


def pop_net(name: str, with_tables: bool = True, feature: bool = False):
    """`make_net` with a popularity offset fitted on the zoo's tasks, weight 0.7, bias 0.2
    (``feature``: with model.popularity_feature, the feature row set to random values)."""
    net = make_net(name, with_tables)
    ref = build_model(dataclasses.replace(TINY, name=name, item_popularity=True, popularity_prior=3.0,
                                          popularity_feature=feature),
                      FIELDS, EmbeddingConfig(), 0, with_tables)
    net.popularity = ref.popularity.fit(task_set(6, seed=1)).double()
    with torch.no_grad():
        net.popularity.weight.fill_(0.7)
        net.popularity.bias.fill_(0.2)
        if feature:
            net.popularity.feature.copy_(torch.randn(3, generator=torch.Generator().manual_seed(5)))
    return net


def pop_learner(name, algorithm, vectorize, adapt=None, with_tables=True, feature=False):
    net = pop_net(name, with_tables, feature)
    adapt = adapt or [*net.default_adapt, "popularity.*", "embedding.item_id"]
    return MetaLearner(net, ALGORITHMS[algorithm](2, 0.3, adapt, vectorize, "binary")).double()


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("name", MODELS.names())
def test_vmap_and_loop_agree_with_the_offset(name, algorithm):
    """Every model and algorithm with the offset adapted (``popularity.*``) next to the
    model's default and the item rows: vmap == loop, and the offset's weight learns."""
    b = batch()
    gv, ov = meta_grads(pop_learner(name, algorithm, True), b)
    gl, ol = meta_grads(pop_learner(name, algorithm, False), b)
    torch.testing.assert_close(ov.task_query_loss, ol.task_query_loss, rtol=1e-10, atol=1e-12)
    assert gv.keys() == gl.keys() and "net.popularity.weight" in gv
    for n in gv:
        torch.testing.assert_close(gv[n], gl[n], rtol=1e-9, atol=1e-12, msg=n)
    assert gv["net.popularity.weight"].abs().sum() > 0
    # The offset is in the loss: without it the query losses differ.
    plain = pop_learner(name, algorithm, True)
    del plain.net.popularity
    plain = MetaLearner(plain.net, ALGORITHMS[algorithm](2, 0.3, [*plain.net.default_adapt], True, "binary")).double()
    assert not torch.allclose(plain(b).task_query_loss, ov.task_query_loss)


@pytest.mark.parametrize("name", MODELS.names())
def test_handed_in_rows_equal_own_tables_with_the_offset(name):
    """Sharded tables (rows handed in, a net without tables) give the same loss and dense
    meta-gradients as the net looking its rows up, offset included."""
    b = batch()
    owner = pop_learner(name, "maml", True)
    bare = pop_learner(name, "maml", True, with_tables=False)
    rows_s, rows_q = embed_batch(embedder(owner.net), b)
    g_own, o_own = meta_grads(owner, b)
    g_bare, o_bare = meta_grads(bare, b, (rows_s.detach(), rows_q.detach()))
    torch.testing.assert_close(o_bare.task_query_loss, o_own.task_query_loss, rtol=1e-12, atol=1e-14)
    for n, g in g_bare.items():
        torch.testing.assert_close(g, g_own[n], rtol=1e-10, atol=1e-13, msg=n)


@pytest.mark.parametrize("algorithm", ["maml", "reptile"])
def test_body_split_with_the_offset(algorithm):
    """MeLU's body split (adapting its last layer and the offset) equals the whole model."""
    whole = pop_learner("melu", algorithm, True, adapt=["mlp.2.*", "popularity.*"])
    whole.algorithm.split_body = True
    split = copy.deepcopy(whole)
    parallelize(split, 0)
    assert split.active_split is not None
    b = batch()
    g_whole, o_whole = meta_grads(whole, b)
    g_split, o_split = meta_grads(split, b)
    assert o_split.loss.item() == pytest.approx(o_whole.loss.item(), rel=1e-12, abs=1e-14)
    assert g_split.keys() == g_whole.keys()
    for n in g_whole:
        torch.testing.assert_close(g_split[n], g_whole[n], rtol=1e-10, atol=1e-12, msg=n)


def test_counts_are_saved_and_loaded_with_the_model():
    """The counts are buffers of the state dict: a fresh, unfitted learner loading it predicts
    exactly as the fitted one (``gmeta-ds eval``), and differs before loading."""
    tasks = task_set(6, seed=2)
    fitted = pop_learner("melu", "reptile", True)
    fresh = pop_learner("melu", "reptile", True)
    fresh.net.popularity.shown.zero_()
    fresh.net.popularity.total.zero_()
    assert {"net.popularity.shown", "net.popularity.total", "net.popularity.mean"} <= set(fitted.state_dict())
    lrs = {n: 0.3 for n in fitted.adapted_names()}
    want = predict(fitted, lrs, tasks, 2)
    assert not np.allclose(predict(fresh, lrs, tasks, 2)["plain"], want["plain"])
    fresh.load_state_dict(fitted.state_dict())
    got = predict(fresh, lrs, tasks, 2)
    np.testing.assert_allclose(got["adapted"], want["adapted"], rtol=1e-12)
    np.testing.assert_allclose(got["plain"], want["plain"], rtol=1e-12)


def test_popularity_feature_adds_the_statistic_to_the_item_row_only():
    """model.popularity_feature: ``with_feature`` adds s * feature to the item field's row
    (position 1 of FIELDS) and nothing else; it starts at zero (the model unchanged);
    evaluation's plain logits (`net_logits`) equal the inner loop's before any step; the
    config needs item_popularity; the body split is refused."""
    from gmeta_ds.models.popularity import net_logits

    net = pop_net("melu", feature=True)
    rows = torch.randn(2, 7, 4, 3, dtype=torch.float64)
    s = torch.randn(2, 7, dtype=torch.float64)
    out = net.popularity.with_feature(rows, s)
    expected = rows.clone()
    expected[..., 1, :] += s.unsqueeze(-1) * net.popularity.feature
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    fresh = build_model(dataclasses.replace(TINY, item_popularity=True, popularity_feature=True), FIELDS,
                        EmbeddingConfig(), 0)
    assert fresh.popularity.feature.shape == (3,) and not fresh.popularity.feature.any()
    torch.testing.assert_close(fresh.popularity.with_feature(rows.float(), s.float()), rows.float())
    learner = MetaLearner(net, ALGORITHMS["reptile"](2, 0.3, ["mlp.*", "popularity.*"], True)).double()
    assert "popularity.feature" in learner.adapted
    b = batch()
    rows_s, rows_q = embed_batch(embedder(net), b)
    theta, _, query = learner.task_inputs(b, rows_s, rows_q)
    inner = learner.inner_loop()
    (xq, stat_q), _, _ = query
    for t in range(b.num_tasks):
        torch.testing.assert_close(inner.logits(theta, (xq[t], stat_q[t])), net_logits(net, xq[t], b.query_ids[t]))
    with pytest.raises(ConfigError, match="model.popularity_feature: needs model.item_popularity: true"):
        config_from_dict({"model": {"popularity_feature": True}})
    learner.algorithm.split_body = True
    with pytest.raises(ConfigError, match="the popularity feature enters the model's input rows"):
        parallelize(learner, 0)


@pytest.mark.parametrize("algorithm", ["maml", "reptile"])
@pytest.mark.parametrize("name", MODELS.names())
def test_vmap_and_loop_agree_with_the_popularity_feature(name, algorithm):
    """Every model with the popularity feature adapted: vmap == loop, the feature learns,
    and it changes the loss; handed-in rows (sharded tables) equal own tables."""
    b = batch()
    gv, ov = meta_grads(pop_learner(name, algorithm, True, feature=True), b)
    gl, ol = meta_grads(pop_learner(name, algorithm, False, feature=True), b)
    torch.testing.assert_close(ov.task_query_loss, ol.task_query_loss, rtol=1e-10, atol=1e-12)
    assert gv.keys() == gl.keys()
    for n in gv:
        torch.testing.assert_close(gv[n], gl[n], rtol=1e-9, atol=1e-12, msg=n)
    assert gv["net.popularity.feature"].abs().sum() > 0
    without = pop_learner(name, algorithm, True)
    assert not torch.allclose(without(b).task_query_loss, ov.task_query_loss)
    owner = pop_learner(name, algorithm, True, feature=True)
    bare = pop_learner(name, algorithm, True, with_tables=False, feature=True)
    rows_s, rows_q = embed_batch(embedder(owner.net), b)
    g_bare, o_bare = meta_grads(bare, b, (rows_s.detach(), rows_q.detach()))
    torch.testing.assert_close(o_bare.task_query_loss, ov.task_query_loss, rtol=1e-12, atol=1e-14)
    for n, g in g_bare.items():
        torch.testing.assert_close(g, gv[n], rtol=1e-10, atol=1e-13, msg=n)


def _support_logits(learner, b, t, fast=None):
    """The model's logits of task t's support rows at ``fast`` (default: theta)."""
    from gmeta_ds.algorithms.base import embed_batch, embedder
    rows_s, rows_q = embed_batch(embedder(learner.net), b)
    theta, support, _ = learner.task_inputs(b, rows_s, rows_q)
    inner = learner.inner_loop()
    from torch.utils._pytree import tree_map
    pick = lambda v: v[t]  # noqa: E731
    return inner, theta, tree_map(pick, support[0]), support[1][t], support[2][t]


@pytest.mark.parametrize("lam", [0.0, 1.0, 5.0])
def test_offset_first_sets_the_bias_to_the_map_of_the_support(lam):
    """meta.offset_first: the bias moves by b maximising sum loglik(y | z + b) - lam b^2 / 2
    (z the model's logits at theta): the penalised score is zero there, by hand."""
    learner = pop_learner("melu", "reptile", True)
    learner.algorithm.offset_first = lam
    b = batch()
    inner, theta, xs, ys, ms = _support_logits(learner, b, 0)
    assert inner.recipe.offset_prior == lam
    theta = {n: v.detach() for n, v in theta.items()}
    moved = inner.recipe.offset_first(inner, theta, xs, ys, ms)
    shift = (moved["popularity.bias"] - theta["popularity.bias"]).item()
    z = inner.logits(theta, xs).detach()
    p = torch.sigmoid(z + shift)
    score = ((ys - p) * ms).sum().item() - lam * shift
    assert abs(score) < 1e-9 and abs(shift) > 1e-3
    assert all(torch.equal(moved[n], theta[n]) for n in theta if n != "popularity.bias")


def maml_vmap_equals_loop(b, **options):
    """Second-order MAML with the algorithm's ``options`` set: the vmap and loop paths give the
    same query losses and meta-gradients; returns the vmap path's output."""
    out = {}
    for vectorize in (True, False):
        learner = pop_learner("melu", "maml", vectorize)
        for key, value in options.items():
            setattr(learner.algorithm, key, value)
        out[vectorize] = meta_grads(learner, b)
    (gv, ov), (gl, ol) = out[True], out[False]
    torch.testing.assert_close(ov.task_query_loss, ol.task_query_loss, rtol=1e-10, atol=1e-12)
    for n in gv:
        torch.testing.assert_close(gv[n], gl[n], rtol=1e-9, atol=1e-12, msg=n)
    return ov


def test_offset_first_vmap_equals_loop_and_changes_the_meta_gradient():
    b = batch()
    ov = maml_vmap_equals_loop(b, offset_first=1.0)
    _, plain = meta_grads(pop_learner("melu", "maml", True), b)
    assert not torch.allclose(plain.task_query_loss, ov.task_query_loss)


def test_offset_first_needs_the_adapted_bias_and_binary_or_rating_labels():
    from gmeta_ds.algorithms import Reptile
    with pytest.raises(ConfigError, match="meta.offset_first: sets each task's popularity.bias"):
        MetaLearner(pop_net("melu"), Reptile(1, 0.1, ["mlp.*"], True, offset_first=1.0))
    with pytest.raises(ConfigError, match="meta.offset_first: -1 must be null or a number >= 0"):
        Reptile(1, 0.1, ["mlp.*"], True, offset_first=-1)
    with pytest.raises(ConfigError, match="not 'multiclass'"):
        Reptile(1, 0.1, ["mlp.*"], True, "multiclass", offset_first=1.0)
    with pytest.raises(ConfigError, match="meta.offset_first: fits the popularity offset's bias"):
        config_from_dict({"meta": {"offset_first": 1.0}})


def test_support_level_shifts_each_task_to_the_map_level_of_its_support():
    """meta.support_level: after adaptation a task's logits move by one constant c with
    mean_support(adapted + c) = mean_support(r + b), r the offset at theta (weight * s + bias)
    and b the MAP offset of the support under prior λ (zero penalised score), by hand."""
    from gmeta_ds.models.popularity import map_offset
    learner = pop_learner("melu", "reptile", True)
    learner.algorithm.support_level = 2.0
    b = batch()
    inner, theta, xs, ys, ms = _support_logits(learner, b, 1)
    assert inner.recipe.level_prior == 2.0
    theta = {n: v.detach() for n, v in theta.items()}
    fast, _ = inner.adapt_func(theta, learner.learning_rates(), xs, ys, ms)
    shift = inner.recipe.level_shift(inner, theta, fast, xs, ys, ms)
    stat = xs[1]
    r = theta["popularity.weight"] * stat + theta["popularity.bias"]
    off = map_offset(r, ys, ms, 2.0)
    p = torch.sigmoid(r + off)
    assert abs(((ys - p) * ms).sum().item() - 2.0 * off.item()) < 1e-9
    z = inner.logits(fast, xs)
    n = ms.sum()
    assert (((z + shift) * ms).sum() / n).item() == pytest.approx((((r + off) * ms).sum() / n).item(), abs=1e-12)
    torch.testing.assert_close(inner.query_logits(theta, fast, xs, ys, ms, xs), z + shift)


def test_support_level_moves_predictions_by_a_constant_per_task_in_every_path():
    """evaluation.predict: with support_level each task's adapted logits differ from those
    without by one constant per task; the MAML meta-gradient with it agrees between vmap and
    the loop; a net without the offset is refused."""
    from gmeta_ds.algorithms import Reptile
    tasks = task_set(4, seed=3)
    plain = pop_learner("melu", "reptile", True)
    level = pop_learner("melu", "reptile", True)
    level.algorithm.support_level = 1.0
    a = predict(plain, plain.learning_rates(), tasks, 2)
    c = predict(level, level.learning_rates(), tasks, 2)
    diff = np.log(c["adapted"] / (1 - c["adapted"])) - np.log(a["adapted"] / (1 - a["adapted"]))
    for t in np.unique(a["task"]):
        d = diff[a["task"] == t]
        assert np.ptp(d) < 1e-9
    assert np.abs(diff).max() > 1e-3
    np.testing.assert_array_equal(a["plain"], c["plain"])
    maml_vmap_equals_loop(batch(), support_level=1.0)
    with pytest.raises(ConfigError, match="meta.support_level: sets each task's level from the item-popularity"):
        MetaLearner(make_net("melu"), Reptile(1, 0.1, ["mlp.*"], True, support_level=1.0))
    with pytest.raises(ConfigError, match="meta.support_level: sets each task's level"):
        config_from_dict({"meta": {"support_level": 1.0}})
