"""The model zoo (gmeta_ds/models/): every model with every algorithm, a multi-hot field,
own tables and handed-in (sharded) rows, and the adapt globs each documents."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gmeta_ds.algorithms import ALGORITHMS, MetaLearner
from gmeta_ds.algorithms.base import embed_batch, embedder
from gmeta_ds.config import EmbeddingConfig, ModelConfig, RunConfig, config_from_dict
from gmeta_ds.data.tasks import TaskSet, collate
from gmeta_ds.sparse import FieldSpec
from gmeta_ds.errors import ConfigError
from gmeta_ds.models import build_model, resolve_adapt
from gmeta_ds.models import MODELS

# Single-hot user and item fields plus a multi-hot item field (a bag of tags per row).
FIELDS = [FieldSpec("age", 5, "user"), FieldSpec("item_id", 11, "item"), FieldSpec("cat", 4, "item"),
          FieldSpec("tags", 6, "item", multi_hot=True)]
TINY = ModelConfig(embed_dim=3, hidden=[5], cross_layers=2, bottom_hidden=[4], tower_hidden=[5, 4])
# Per model: globs its docstring names as natural meta.adapt choices (besides the default),
# and what they must select.
NATURAL = {
    "melu": (["mlp.2.*"], ["mlp.2.weight", "mlp.2.bias"]),
    "dcn_v2": (["cross.1.*"], ["cross.1.weight", "cross.1.bias"]),
    "deepfm": (["linear.*"], ["linear.weight", "linear.bias"]),
    "wide_deep": (["wide.*", "mlp.*"], ["wide.weight", "wide.bias", "mlp.0.weight", "mlp.0.bias",
                                        "mlp.2.weight", "mlp.2.bias"]),
    "dlrm": (["mlp.2.*"], ["mlp.2.weight", "mlp.2.bias"]),
    "two_tower": (["user_tower.2.*", "bias"], ["bias", "user_tower.2.weight", "user_tower.2.bias"]),
}
DEFAULT_ADAPTED = {
    "melu": ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"],
    "dcn_v2": ["mlp.0.weight", "mlp.0.bias"],
    "deepfm": ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"],
    "wide_deep": ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"],
    "dlrm": ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"],
    "two_tower": ["user_tower.0.weight", "user_tower.0.bias", "user_tower.2.weight", "user_tower.2.bias"],
}


def task_set(tasks: int = 4, seed: int = 0) -> TaskSet:
    """Ragged tasks of 5-9 rows (support 2-5) with tag bags of 0-3 ids (empty ones included)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 10, tasks)
    n = int(lengths.sum())
    ids = np.stack([rng.integers(0, f.num_ids, n) for f in FIELDS if not f.multi_hot], 1).astype(np.int32)
    bags = [rng.choice(6, size=int(rng.integers(0, 4)), replace=False) for _ in range(n)]
    values = np.concatenate(bags).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])]).astype(np.int64)
    return TaskSet(FIELDS, ids, rng.integers(0, 2, n).astype(np.float32),
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                   (lengths - 3).astype(np.int64), np.arange(tasks), {"tags": (values, offsets)})


def as_double(batch):
    for name in ("support_y", "support_mask", "query_y", "query_mask"):
        setattr(batch, name, getattr(batch, name).double())
    return batch


def batch(tasks: int = 4):
    return as_double(collate(task_set(tasks), list(range(tasks))))


def make_net(name: str, with_tables: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    net = build_model(dataclasses.replace(TINY, name=name), FIELDS, EmbeddingConfig(), seed, with_tables)
    net = net.double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # larger weights so second-order terms are not negligible
        for n, p in net.named_parameters():
            if not n.startswith("embedding."):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return net


def make_learner(name: str, algorithm: str, vectorize: bool, adapt=None, with_tables: bool = True):
    net = make_net(name, with_tables)
    adapt = resolve_adapt(net, adapt) if adapt is not None else [*net.default_adapt, "embedding.item_id"]
    return MetaLearner(net, ALGORITHMS[algorithm](2, 0.3, adapt, vectorize, "binary")).double()


def meta_grads(learner, b, rows=None):
    learner.zero_grad()
    out = learner(b, rows)
    out.loss.backward()
    return {n: p.grad.clone() for n, p in learner.named_parameters() if p.grad is not None}, out


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("name", MODELS.names())
def test_vmap_and_loop_meta_gradients_agree(name, algorithm):
    """Each model, each algorithm: the vmap path equals the per-task loop (dense parameters,
    tables, adapted item rows; a multi-hot field among the inputs)."""
    b = batch()
    gv, ov = meta_grads(make_learner(name, algorithm, True), b)
    gl, ol = meta_grads(make_learner(name, algorithm, False), b)
    torch.testing.assert_close(ov.task_query_loss, ol.task_query_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ov.support_loss, ol.support_loss, rtol=1e-10, atol=1e-12)
    assert gv.keys() == gl.keys() and "net.embedding.weights.tags" in gv
    for n in gv:
        torch.testing.assert_close(gv[n], gl[n], rtol=1e-9, atol=1e-12, msg=n)
    assert gv["net.embedding.weights.tags"].abs().sum() > 0  # the bag rows learn


@pytest.mark.parametrize("name", MODELS.names())
def test_second_order_maml_matches_finite_differences(name):
    """MAML's meta-gradient through each architecture (FM term, cross layers, dot products)
    equals central differences of the objective in a few elements."""
    learner = make_learner(name, "maml", True)
    b = batch(3)
    grads, _ = meta_grads(learner, b)
    params = dict(learner.named_parameters())
    for pname in [f"net.{learner.adapted[0]}", "net.embedding.weights.tags", "net.embedding.weights.age"]:
        p = params[pname]
        idx = tuple(s - 1 for s in p.shape)
        values = []
        for step in (1e-6, -2e-6):
            with torch.no_grad():
                p[idx] += step
            values.append(learner(b).query_loss.item())
        with torch.no_grad():
            p[idx] += 1e-6
        fd = (values[0] - values[1]) / 2e-6
        assert grads[pname][idx].item() == pytest.approx(fd, rel=1e-5, abs=1e-8), pname


@pytest.mark.parametrize("name", MODELS.names())
def test_forward_shapes_and_handed_in_rows(name):
    """rows (N, F, d) -> logits (N,); rows handed in (sharded tables: a net without tables)
    give the loss and the dense meta-gradient of the net looking them up itself."""
    b = batch()
    owner = make_learner(name, "maml", True)
    net = owner.net
    assert net.field_names == ["age", "item_id", "cat", "tags"] and net.row_fields == ["age", "item_id", "cat"]
    rows_s, rows_q = embed_batch(embedder(net), b)
    t, s = b.support_ids.shape[:2]
    assert rows_s.shape == (t, s, 4, 3)
    assert net(rows_s[0]).shape == (s,)
    assert net(rows_s.reshape(-1, 4, 3)).shape == (t * s,)
    bare = make_learner(name, "maml", True, with_tables=False)
    assert bare.net.embedding is None
    assert {n for n, _ in bare.named_parameters()} == {n for n, _ in owner.named_parameters()
                                                       if not n.startswith("net.embedding.weights")}
    g_own, o_own = meta_grads(owner, b)
    g_bare, o_bare = meta_grads(bare, b, (rows_s.detach(), rows_q.detach()))
    torch.testing.assert_close(o_bare.task_query_loss, o_own.task_query_loss, rtol=1e-12, atol=1e-14)
    for n, g in g_bare.items():
        torch.testing.assert_close(g, g_own[n], rtol=1e-10, atol=1e-13, msg=n)


@pytest.mark.parametrize("name", MODELS.names())
def test_adapt_globs_match(name):
    """The default adapt (meta.adapt left at ["mlp.*"]) and the documented alternatives
    select what they say; embedding.<field> rows adapt for every model."""
    net = make_net(name)
    learner = MetaLearner(net, ALGORITHMS["maml"](1, 0.1, resolve_adapt(net, ["mlp.*"]), True))
    assert learner.adapted == DEFAULT_ADAPTED[name]
    globs, expected = NATURAL[name]
    learner = MetaLearner(net, ALGORITHMS["maml"](1, 0.1, [*globs, "embedding.item_id"], True))
    assert learner.adapted == expected and learner.adapted_fields == {1: "item_id"}


@pytest.mark.parametrize("name", MODELS.names())
def test_model_name_from_config(name, tmp_path):
    """``model.name`` builds the model through the CTR workload; meta.adapt left at its
    default takes the model's default_adapt, an explicit one is kept."""
    from gmeta_ds.workloads.ctr import build_learner

    fields = [FieldSpec("age", 5, "user"), FieldSpec("item_id", 11, "item")]
    cfg = config_from_dict({"model": {"name": name, "embed_dim": 4, "hidden": [8], "tower_hidden": [6]}})
    learner = build_learner(cfg, fields)
    assert type(learner.net) is MODELS[name] and learner.net.embedding is not None
    assert learner.adapted_names() and all(n in dict(learner.net.named_parameters()) for n in learner.adapted)
    cfg = config_from_dict({"model": {"name": name, "embed_dim": 4},
                            "meta": {"adapt": ["embedding.item_id"]}})
    learner = build_learner(cfg, fields, with_tables=False)
    assert learner.adapted == [] and learner.adapted_fields == {1: "item_id"}
    assert learner.net.embedding is None


def test_model_config_is_validated():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": {"name": "resnet", "cross_layers": 0, "tower_hidden": [],
                                    "bottom_hidden": [4, -1], "heads": 2}})
    text = str(err.value)
    assert "model.name: 'resnet' is not one of melu, dcn_v2, deepfm, wide_deep, dlrm, two_tower" in text
    assert "model.cross_layers: 0 is not a positive number" in text
    assert "model.tower_hidden: empty" in text and "model.bottom_hidden: [4, -1] must be positive" in text
    assert "model.heads: unknown key" in text
    assert RunConfig().model.name == "melu"


def test_two_tower_needs_both_sides():
    with pytest.raises(ConfigError, match="two_tower needs at least one user-side and one item-side"):
        build_model(dataclasses.replace(TINY, name="two_tower"), [FieldSpec("item_id", 5, "item")],
                    EmbeddingConfig(), 0)


@pytest.mark.parametrize("name", MODELS.names())
def test_zero_init_output_zeroes_only_the_last_layer_of_mlp(name):
    """model.zero_init_output: the last linear layer of ``mlp`` is zero and nothing else moves
    (same seed); melu, dcn_v2, dlrm then output 0 for any rows, and with item_popularity the
    learner's logits are the popularity offset alone; two_tower (no mlp) is refused."""
    cfg = dataclasses.replace(TINY, name=name, zero_init_output=True)
    if name == "two_tower":
        with pytest.raises(ConfigError, match="model.zero_init_output: TwoTower has no `mlp`"):
            build_model(cfg, FIELDS, EmbeddingConfig(), 0)
        return
    torch.manual_seed(0)
    zero = build_model(cfg, FIELDS, EmbeddingConfig(), 0)
    torch.manual_seed(0)
    plain = build_model(dataclasses.replace(cfg, zero_init_output=False), FIELDS, EmbeddingConfig(), 0)
    last = [n for n, m in zero.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("mlp.")][-1]
    for n, p in zero.named_parameters():
        if n.startswith(last + "."):
            assert not p.any(), n
        else:
            torch.testing.assert_close(p, plain.get_parameter(n), rtol=0, atol=0, msg=n)
    rows = torch.randn(7, 4, 3)
    if name in ("melu", "dcn_v2", "dlrm"):
        assert not zero(rows).any()
        torch.manual_seed(0)
        net = build_model(dataclasses.replace(cfg, item_popularity=True), FIELDS, EmbeddingConfig(), 0)
        net.popularity.fit(task_set(6, seed=1))
        learner = MetaLearner(net, ALGORITHMS["reptile"](1, 0.1, ["mlp.*", "popularity.*"], True))
        b = collate(task_set(3), [0, 1, 2])
        rows_s, rows_q = embed_batch(embedder(net), b)
        _, (xs, _, _), _ = learner.task_inputs(b, rows_s, rows_q)
        loop = learner.inner_loop()
        fast = dict(net.named_parameters())
        fast = {n: fast[n] for n in learner.adapted}
        torch.testing.assert_close(loop.logits(fast, (xs[0][0], xs[1][0])), net.popularity(xs[1][0]))
    else:
        assert zero(rows).abs().sum() > 0  # the wide / first-order and FM parts still speak


@pytest.mark.parametrize("name", sorted(MODELS.names()))
def test_every_zoo_model_builds_from_fields_and_embed_dim_alone(name):
    """docs/api.md: the zoo's hyper-parameters are keywords with defaults (model.* defaults)."""
    model = MODELS[name](FIELDS, embed_dim=4)
    rows = torch.randn(7, len(FIELDS), 4)
    assert model(rows).shape == (7,)
