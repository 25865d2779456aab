"""Meta-gradients of every algorithm against finite differences and closed forms."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_batch, tiny_melu

from gmeta_ds.algorithms import ALGORITHMS, FOMAML, MAML, MetaLearner, MetaSGD, Reptile
from gmeta_ds.algorithms.base import embed_batch
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional import masked_bce
from gmeta_ds.functional.inner import compose_rows, masked_pairwise, select_task


def make_learner(cls, steps=2, lr=0.3, vectorize=True, adapt=("mlp.*",), seed=0, kind="binary"):
    torch.manual_seed(seed)
    net = tiny_melu(embed_dim=3, hidden=[5]).double()
    for p in net.parameters():  # larger weights so second-order terms are not negligible
        p.data.normal_(0, 0.5)
    return MetaLearner(net, cls(steps, lr, list(adapt), vectorize, kind)).double()


def meta_grads(learner, batch):
    learner.zero_grad()
    out = learner(batch)
    out.loss.backward()
    return {n: p.grad.clone() for n, p in learner.named_parameters()}, out


def outer_value(learner, batch):
    """The MAML objective (mean query loss after adaptation), used for finite differences."""
    return learner(batch).query_loss.item()


def finite_difference(learner, batch, param, idx, eps=1e-6) -> float:
    """Central difference of the MAML objective in one element of ``param``."""
    values = []
    for step in (eps, -2 * eps):
        with torch.no_grad():
            param[idx] += step
        values.append(outer_value(learner, batch))
    with torch.no_grad():
        param[idx] += eps
    return (values[0] - values[1]) / (2 * eps)


def as_double(batch):
    for name in ("support_y", "support_mask", "query_y", "query_mask"):
        setattr(batch, name, getattr(batch, name).double())
    return batch


@pytest.mark.parametrize("cls", [MAML, MetaSGD])
def test_second_order_meta_gradient_matches_finite_differences(cls):
    learner = make_learner(cls)
    batch = as_double(tiny_batch())
    grads, _ = meta_grads(learner, batch)
    params = dict(learner.named_parameters())
    checked = 0
    for name in ["net.mlp.0.weight", "net.mlp.2.bias", "net.embedding.weights.item_id",
                 *(["inner_lrs.mlp__0__weight"] if cls is MetaSGD else [])]:
        p = params[name]
        for idx in [(0,) * p.dim(), tuple(s - 1 for s in p.shape)]:
            fd = finite_difference(learner, batch, p, idx)
            assert grads[name][idx].item() == pytest.approx(fd, rel=1e-5, abs=1e-8), name
            checked += 1
    assert checked >= 6


def manual_adapt(learner, batch, task, steps, lr):
    """Independent first-order inner loop on a deep copy of the net (plain autograd, no torch.func)."""
    net = copy.deepcopy(learner.net)
    rows_s = net.embed(batch.support_ids[task]).detach()
    for _ in range(steps):
        loss = masked_bce(net(rows_s), batch.support_y[task], batch.support_mask[task])
        grads = torch.autograd.grad(loss, [net.get_parameter(n) for n in learner.adapted])
        with torch.no_grad():
            for n, g in zip(learner.adapted, grads):
                net.get_parameter(n).sub_(lr * g)
    return net


def test_fomaml_equals_query_gradient_at_adapted_parameters():
    learner = make_learner(FOMAML)
    batch = as_double(tiny_batch())
    grads, _ = meta_grads(learner, batch)
    expected = {n: torch.zeros_like(p) for n, p in learner.net.named_parameters()}
    for t in range(batch.num_tasks):
        net = manual_adapt(learner, batch, t, 2, 0.3)
        rows_q = net.embed(batch.query_ids[t])
        loss = masked_bce(net(rows_q), batch.query_y[t], batch.query_mask[t]) / batch.num_tasks
        names = [n for n, _ in net.named_parameters()]
        for n, g in zip(names, torch.autograd.grad(loss, list(net.parameters()))):
            expected[n] += g
    for n in learner.adapted:
        torch.testing.assert_close(grads[f"net.{n}"], expected[n], rtol=1e-9, atol=1e-12)
    # embeddings: only through the query loss (first order ignores the support path)
    name = "embedding.weights.item_id"
    torch.testing.assert_close(grads[f"net.{name}"], expected[name], rtol=1e-9, atol=1e-12)


def test_reptile_equals_theta_minus_mean_adapted():
    learner = make_learner(Reptile)
    batch = as_double(tiny_batch())
    grads, _ = meta_grads(learner, batch)
    nets = [manual_adapt(learner, batch, t, 2, 0.3) for t in range(batch.num_tasks)]
    for n in learner.adapted:
        theta = learner.net.get_parameter(n)
        phi = torch.stack([net.get_parameter(n) for net in nets]).mean(0)
        torch.testing.assert_close(grads[f"net.{n}"], (theta - phi).detach(), rtol=1e-9, atol=1e-12)


def test_first_and_second_order_differ_on_adapted_parameters():
    batch = as_double(tiny_batch())
    g2, out2 = meta_grads(make_learner(MAML), batch)
    g1, out1 = meta_grads(make_learner(FOMAML), batch)
    assert out1.query_loss.item() == pytest.approx(out2.query_loss.item(), rel=1e-12)
    diff = (g2["net.mlp.0.weight"] - g1["net.mlp.0.weight"]).abs().max().item()
    assert diff > 1e-4 * g2["net.mlp.0.weight"].abs().max().item()
    # with zero inner steps' effect (lr 0) they coincide: the difference is the Hessian term
    g2z, _ = meta_grads(make_learner(MAML, lr=1e-12), batch)
    g1z, _ = meta_grads(make_learner(FOMAML, lr=1e-12), batch)
    torch.testing.assert_close(g2z["net.mlp.0.weight"], g1z["net.mlp.0.weight"])


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_vmap_and_loop_paths_agree(name):
    batch = as_double(tiny_batch(tasks=4))
    gv, ov = meta_grads(make_learner(ALGORITHMS[name], vectorize=True), batch)
    gl, ol = meta_grads(make_learner(ALGORITHMS[name], vectorize=False), batch)
    torch.testing.assert_close(ov.task_query_loss, ol.task_query_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ov.support_loss, ol.support_loss, rtol=1e-10, atol=1e-12)
    for n in gv:
        torch.testing.assert_close(gv[n], gl[n], rtol=1e-9, atol=1e-12, msg=n)


def test_padding_does_not_change_the_result():
    """A task padded with extra masked rows gives the same losses and meta-gradient."""
    batch = as_double(tiny_batch(tasks=2, ragged=False))
    wide = copy.deepcopy(batch)
    for part in ("support", "query"):
        for suffix, fill in (("ids", 0), ("y", 1.0), ("mask", 0.0)):
            t = getattr(wide, f"{part}_{suffix}")
            pad = torch.full((t.shape[0], 3, *t.shape[2:]), fill, dtype=t.dtype)
            setattr(wide, f"{part}_{suffix}", torch.cat([t, pad], dim=1))
    g, o = meta_grads(make_learner(MAML), batch)
    gw, ow = meta_grads(make_learner(MAML), wide)
    torch.testing.assert_close(o.task_query_loss, ow.task_query_loss)
    for n in g:
        torch.testing.assert_close(g[n], gw[n], msg=n)


def test_adapt_patterns_that_match_nothing_list_the_candidates():
    with pytest.raises(ConfigError, match=r"matches nothing; candidates are: mlp\.0\.weight, .*"
                                          r"embedding\.item_id"):
        make_learner(MAML, adapt=("decoder.*",))
    # whole tables are not candidates: a pattern naming them matches nothing
    with pytest.raises(ConfigError, match="matches nothing"):
        make_learner(MAML, adapt=("embedding.weights.*",))


ROWS = ("mlp.*", "embedding.item_id", "embedding.age")


def test_row_adaptation_meta_gradient_matches_finite_differences():
    learner = make_learner(MAML, adapt=ROWS)
    assert learner.adapted_fields == {0: "age", 1: "item_id"}
    batch = as_double(tiny_batch())
    grads, _ = meta_grads(learner, batch)
    table = learner.get_parameter("net.embedding.weights.item_id")
    used = int(batch.support_ids[0, 0, 1])
    for idx in [(used, 0), (used, 2)]:
        fd = finite_difference(learner, batch, table, idx)
        assert grads["net.embedding.weights.item_id"][idx].item() == pytest.approx(fd, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_row_adaptation_vmap_equals_loop(name):
    batch = as_double(tiny_batch(tasks=4))
    gv, ov = meta_grads(make_learner(ALGORITHMS[name], adapt=ROWS, vectorize=True), batch)
    gl, ol = meta_grads(make_learner(ALGORITHMS[name], adapt=ROWS, vectorize=False), batch)
    torch.testing.assert_close(ov.task_query_loss, ol.task_query_loss, rtol=1e-10, atol=1e-12)
    for n in gv:
        torch.testing.assert_close(gv[n], gl[n], rtol=1e-9, atol=1e-12, msg=n)


def test_only_rows_seen_in_the_support_adapt():
    """Adapting item rows only: a query row whose item is absent from the task's support keeps
    its un-adapted value; one whose item is present changes."""
    learner = make_learner(MAML, adapt=("embedding.item_id",), steps=1, lr=1.0)
    batch = as_double(tiny_batch(tasks=1, support=3, query=2, ragged=False))
    batch.support_ids[0, :, 1] = torch.tensor([2, 2, 5])
    batch.query_ids[0, :, 1] = torch.tensor([5, 9])
    rows_s, rows_q = embed_batch(learner.net.embed, batch)
    theta, support, query = learner.task_inputs(batch, rows_s, rows_q)
    inner = learner.inner_loop()
    fast, _ = inner.adapt_autograd(theta, {n: 1.0 for n in theta}, *(select_task(t, 0) for t in support))
    adapted = compose_rows(fast, select_task(query[0], 0), learner.adapted_fields)
    torch.testing.assert_close(adapted[1], rows_q[0, 1])          # item 9: untouched
    assert not torch.allclose(adapted[0, 1], rows_q[0, 0, 1])     # item 5: adapted
    torch.testing.assert_close(adapted[0, [0, 2]], rows_q[0, 0, [0, 2]])  # other fields untouched


def test_partial_adaptation_only_moves_matched_parameters():
    learner = make_learner(Reptile, adapt=("mlp.2.*",))
    assert learner.adapted == ["mlp.2.weight", "mlp.2.bias"]
    grads, _ = meta_grads(learner, as_double(tiny_batch()))
    nets = [manual_adapt(learner, as_double(tiny_batch()), t, 2, 0.3) for t in range(3)]
    # mlp.0 is not adapted: its Reptile gradient is the query-loss gradient, not theta - phi
    for net in nets:
        torch.testing.assert_close(net.mlp[0].weight, learner.net.mlp[0].weight)
    assert grads["net.mlp.0.weight"].abs().sum() > 0


def test_regression_kind_uses_mse_and_matches_finite_differences():
    learner = make_learner(MAML, kind="regression", lr=0.05)
    batch = as_double(tiny_batch())
    batch.support_y = batch.support_y * 4 + 1  # ratings 1..5
    batch.query_y = batch.query_y * 4 + 1
    grads, out = meta_grads(learner, batch)
    assert out.query_loss.item() > 1.0  # squared rating error, not a cross-entropy
    p = learner.get_parameter("net.mlp.0.weight")
    fd = finite_difference(learner, batch, p, (0, 0))
    assert grads["net.mlp.0.weight"][0, 0].item() == pytest.approx(fd, rel=1e-5, abs=1e-8)
    gl, ol = meta_grads(make_learner(MAML, kind="regression", lr=0.05, vectorize=False), batch)
    torch.testing.assert_close(out.task_query_loss, ol.task_query_loss)


def test_row_adaptation_with_pooled_multi_hot_columns():
    """Rows carry pooled multi-hot columns after the single-hot ones (W > F): deduplicating the
    adapted field's rows and composing them back reproduces every column."""
    from gmeta_ds.functional.inner import unique_rows

    g = torch.Generator().manual_seed(0)
    t, s, q, f, width, d = 2, 5, 3, 2, 3, 4
    ids_s, ids_q = torch.randint(0, 4, (t, s, f), generator=g), torch.randint(0, 4, (t, q, f), generator=g)
    table = torch.randn(4, d, generator=g)
    pooled_s, pooled_q = torch.randn(t, s, 1, d, generator=g), torch.randn(t, q, 1, d, generator=g)
    rows_s = torch.cat([table[ids_s], pooled_s], dim=2)
    rows_q = torch.cat([table[ids_q], pooled_q], dim=2)
    fast, index_s, index_q = unique_rows(ids_s, ids_q, rows_s, rows_q, {1: "item"})
    assert index_s.shape == (t, s, width) and fast["embedding.item"].shape[0] == len(torch.unique(
        torch.cat([ids_s[..., 1].flatten(), ids_q[..., 1].flatten()])))
    for i in range(t):
        torch.testing.assert_close(compose_rows(fast, (rows_s[i], index_s[i]), {1: "item"}), rows_s[i])
        torch.testing.assert_close(compose_rows(fast, (rows_q[i], index_q[i]), {1: "item"}), rows_q[i])


def reptile_reference(learner, batch, rate) -> dict:
    """Reptile's meta-gradient theta - mean phi by an independent loop: 2 plain SGD steps per
    task with ``rate(name, support rows)`` as each adapted parameter's step size."""
    phis = {n: [] for n in learner.adapted}
    for t in range(batch.num_tasks):
        n_rows = batch.support_mask[t].sum().item()
        copy_ = copy.deepcopy(learner.net)
        rows_s = copy_.embed(batch.support_ids[t]).detach()
        for _ in range(2):
            loss = masked_bce(copy_(rows_s), batch.support_y[t], batch.support_mask[t])
            gs = torch.autograd.grad(loss, [copy_.get_parameter(n) for n in learner.adapted])
            with torch.no_grad():
                for n, g in zip(learner.adapted, gs):
                    copy_.get_parameter(n).sub_(rate(n, n_rows) * g)
        for n in learner.adapted:
            phis[n].append(copy_.get_parameter(n))
    return {n: (learner.net.get_parameter(n) - torch.stack(phis[n]).mean(0)).detach() for n in learner.adapted}


def test_inner_lr_scale_gives_each_matched_parameter_its_own_rate():
    """meta.inner_lr_scale: Reptile's meta-gradient is theta - mean phi with phi adapted at
    inner_lr x the first matching glob's multiplier (x1 for the rest), by an independent loop."""
    torch.manual_seed(0)
    net = tiny_melu(embed_dim=3, hidden=[5]).double()
    scale = {"mlp.2.*": 3.0, "mlp.*": 0.5}  # first match wins: mlp.2.* x3, mlp.0.* x0.5
    learner = MetaLearner(net, Reptile(2, 0.3, ["mlp.*"], True, inner_lr_scale=scale)).double()
    rates = learner.learning_rates()
    assert rates == pytest.approx({"mlp.0.weight": 0.15, "mlp.0.bias": 0.15, "mlp.2.weight": 0.9,
                                   "mlp.2.bias": 0.9}, rel=1e-12)
    batch = as_double(tiny_batch())
    grads, _ = meta_grads(learner, batch)
    expected = reptile_reference(learner, batch, lambda n, rows: rates[n])
    for n in learner.adapted:
        torch.testing.assert_close(grads[f"net.{n}"], expected[n], rtol=1e-9, atol=1e-12, msg=n)


def test_inner_lr_scale_sets_meta_sgd_initial_rates_and_refuses_unmatched_globs():
    torch.manual_seed(0)
    learner = MetaLearner(tiny_melu(embed_dim=3, hidden=[5]),
                          MetaSGD(1, 0.1, ["mlp.*", "embedding.item_id"], True,
                                  inner_lr_scale={"mlp.2.*": 2.0, "embedding.*": 5.0}))
    torch.testing.assert_close(learner.inner_lrs["mlp__2__weight"], torch.full((1, 5), 0.2))
    first = learner.inner_lrs["mlp__0__weight"]
    torch.testing.assert_close(first, torch.full_like(first, 0.1))
    torch.testing.assert_close(learner.inner_lrs["embedding__item_id"], torch.full((3,), 0.5))
    with pytest.raises(ConfigError, match=r"meta.inner_lr_scale: \['popularity\.\*'\] matches no adapted "
                                          r"parameter; adapted: mlp\.0\.weight"):
        MetaLearner(tiny_melu(embed_dim=3, hidden=[5]), Reptile(1, 0.1, ["mlp.*"], True,
                                                                 inner_lr_scale={"popularity.*": 2.0}))


def test_inner_loss_prior_shrinks_each_tasks_steps_by_its_support_size():
    """meta.inner_loss_prior k: the inner loss is sum / (n + k), so Reptile's adapted
    parameters equal an independent loop's with each task's rate times n / (n + k)."""
    torch.manual_seed(0)
    k = 3.0
    learner = MetaLearner(tiny_melu(embed_dim=3, hidden=[5]).double(),
                          Reptile(2, 0.3, ["mlp.*"], True, inner_loss_prior=k)).double()
    batch = as_double(tiny_batch())
    grads, _ = meta_grads(learner, batch)
    expected = reptile_reference(learner, batch, lambda n, rows: 0.3 * rows / (rows + k))
    for n in learner.adapted:
        torch.testing.assert_close(grads[f"net.{n}"], expected[n], rtol=1e-9, atol=1e-12, msg=n)
    with pytest.raises(ConfigError, match="meta.inner_loss_prior: -1.0 must be a number >= 0"):
        Reptile(1, 0.1, ["mlp.*"], True, inner_loss_prior=-1.0)


def pairwise_reference(logits, labels, mask) -> float:
    """meta.rank_weight's term by its definition: the mean of softplus(s_j - s_i) over the
    real pairs with y_i > y_j (a plain double loop)."""
    terms = [torch.nn.functional.softplus(logits[j] - logits[i]).item()
             for i in range(len(logits)) for j in range(len(logits))
             if mask[i] and mask[j] and labels[i] > labels[j]]
    return sum(terms) / len(terms) if terms else 0.0


def test_pairwise_loss_counts_only_real_ordered_pairs():
    torch.manual_seed(0)
    logits = torch.randn(7, dtype=torch.float64)
    ratings = torch.tensor([5., 3., 3., 1., 4., 2., 5.], dtype=torch.float64)  # ties are no pair
    mask = torch.tensor([1., 1., 1., 1., 1., 0., 0.], dtype=torch.float64)  # padding is no pair
    assert masked_pairwise(logits, ratings, mask).item() == pytest.approx(pairwise_reference(logits, ratings, mask))
    clicks = (ratings >= 4).double()
    assert masked_pairwise(logits, clicks, mask).item() == pytest.approx(pairwise_reference(logits, clicks, mask))
    # one class only, or no real row: no pair, loss 0 (not NaN)
    assert masked_pairwise(logits, torch.ones(7, dtype=torch.float64), mask).item() == 0.0
    assert masked_pairwise(logits, clicks, torch.zeros(7, dtype=torch.float64)).item() == 0.0
    # a task ordered right costs less than the same task ordered wrong
    right, wrong = torch.tensor([3., -3.]), torch.tensor([-3., 3.])
    y, m = torch.tensor([1., 0.]), torch.ones(2)
    assert masked_pairwise(right, y, m) < 0.05 < 3.0 < masked_pairwise(wrong, y, m)


@pytest.mark.parametrize("cls", [MAML, FOMAML, Reptile])
def test_rank_weight_adds_the_pairwise_term_of_the_adapted_query_logits(cls):
    """meta.rank_weight w: each task's query loss is BCE + w x the pairwise loss of the
    adapted model's query logits (an independent inner loop on a copy of the net)."""
    w = 0.7
    plain, ranked = make_learner(cls), make_learner(cls)
    ranked.algorithm = cls(2, 0.3, ["mlp.*"], True, "binary", rank_weight=w)
    batch = as_double(tiny_batch())
    out = ranked(batch)
    base = plain(batch).task_query_loss
    for t in range(batch.num_tasks):
        net = manual_adapt(plain, batch, t, 2, 0.3)
        logits = net(net.embed(batch.query_ids[t]))
        term = pairwise_reference(logits, batch.query_y[t], batch.query_mask[t])
        assert out.task_query_loss[t].item() == pytest.approx(base[t].item() + w * term, rel=1e-9)
    # the gradient goes through it (Reptile: the query loss reaches what does not adapt)
    name = "net.embedding.weights.item_id"
    assert not torch.allclose(meta_grads(ranked, batch)[0][name], meta_grads(plain, batch)[0][name])
    with pytest.raises(ConfigError, match="meta.rank_weight: -1 must be a number >= 0"):
        cls(1, 0.1, ["mlp.*"], True, rank_weight=-1)
    with pytest.raises(ConfigError, match="meta.rank_weight: orders a task's rows by their labels"):
        cls(1, 0.1, ["mlp.*"], True, kind="multiclass", rank_weight=1.0)


def supervised_reference(learner, batch) -> torch.Tensor:
    """The warm-up loss by its definition: per task, the mean BCE of the unadapted net over
    every real row (support and query alike); the mean over tasks."""
    net, losses = learner.net, []
    for t in range(batch.num_tasks):
        ids = torch.cat([batch.support_ids[t], batch.query_ids[t]])
        y = torch.cat([batch.support_y[t], batch.query_y[t]])
        mask = torch.cat([batch.support_mask[t], batch.query_mask[t]])
        losses.append(masked_bce(net(net.embed(ids)), y, mask))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("vectorize", [True, False])
def test_warmup_steps_train_the_unadapted_model_on_every_row(vectorize):
    """A warm-up meta-step (meta.warmup_steps) is plain supervised training: its loss and its
    gradient are those of the unadapted net's BCE over each task's support and query rows."""
    learner = make_learner(MAML, vectorize=vectorize)
    learner.algorithm = MAML(2, 0.3, ["mlp.*"], vectorize, "binary", warmup_steps=3)
    batch = as_double(tiny_batch())
    learner.algorithm.warming_up = True
    grads, out = meta_grads(learner, batch)
    learner.zero_grad()
    reference = supervised_reference(learner, batch)
    reference.backward()
    assert out.loss.item() == pytest.approx(reference.item(), rel=1e-12)
    for name, p in learner.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)
    learner.algorithm.warming_up = False  # after the warm-up: MAML's own loss again
    assert learner(batch).loss.item() == pytest.approx(make_learner(MAML)(batch).loss.item(), rel=1e-12)
    with pytest.raises(ConfigError, match="meta.warmup_steps: 1.5 must be an integer >= 0"):
        MAML(1, 0.1, ["mlp.*"], True, warmup_steps=1.5)


@pytest.mark.parametrize("cls", [MAML, Reptile])
def test_init_weight_adds_the_unadapted_models_loss_on_every_row(cls):
    """meta.init_weight a: the outer loss is the algorithm's + a x the warm-up (supervised) loss;
    so is its gradient."""
    a = 0.4
    plain, anchored = make_learner(cls), make_learner(cls)
    anchored.algorithm = cls(2, 0.3, ["mlp.*"], True, "binary", init_weight=a)
    batch = as_double(tiny_batch())
    grads, out = meta_grads(anchored, batch)
    plain.zero_grad()
    (plain(batch).loss + a * supervised_reference(plain, batch)).backward()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert out.query_loss.item() == pytest.approx(plain(batch).query_loss.item(), rel=1e-12)
    with pytest.raises(ConfigError, match="meta.init_weight: -0.5 must be a number >= 0"):
        cls(1, 0.1, ["mlp.*"], True, init_weight=-0.5)
