"""The body split (gmeta_ds.functional.split): running the non-adapted body once on every
task's rows and the inner loop on the head only gives the same outer loss and the same
meta-gradient, for every parameter (the body's through the support and query features
included), as running the whole model in the inner loop, for every algorithm, second order
included; in float64 to rounding, on MeLU and on a Hugging Face BERT classifier."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_batch, tiny_melu

from gmeta_ds.algorithms import ALGORITHMS, MetaLearner, build_algorithm
from gmeta_ds.config import MetaConfig, TextConfig, TextDataConfig, TextModelConfig, TextSyntheticConfig
from gmeta_ds.engine.parallelize import (SkeletonForward, body_split, parallelize, single_process_template,
                                        step_parameters)
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.split import BodySplit
from gmeta_ds.text.data import build_tasks, generate_texts
from gmeta_ds.text.model import SequenceClassifier, TextMetaLearner, build_classifier, build_tokenizer

ALGOS = ["maml", "fomaml", "reptile", "metasgd"]


def grads(learner, batch):
    learner.zero_grad()
    out = learner(batch)
    out.loss.backward()
    return {n: p.grad.clone() for n, p in learner.named_parameters() if p.grad is not None}, out


def compare(whole, split, batch):
    """``split``: a copy of ``whole`` with its body split active."""
    g_whole, out_whole = grads(whole, batch)
    g_split, out_split = grads(split, batch)
    assert out_split.loss.item() == pytest.approx(out_whole.loss.item(), rel=1e-12, abs=1e-14)
    assert set(g_split) == set(g_whole)
    for n in g_whole:
        torch.testing.assert_close(g_split[n], g_whole[n], rtol=1e-10, atol=1e-12, msg=n)
    return g_whole


def melu_learner(algorithm: str, adapt, vectorize=True):
    torch.manual_seed(0)
    net = tiny_melu(embed_dim=3, hidden=[6, 5]).double()
    for p in net.parameters():  # larger weights so second-order terms are not negligible
        p.data.normal_(0, 0.5)
    algo = ALGORITHMS[algorithm](2, 0.3, list(adapt), vectorize, "binary", True)
    return MetaLearner(net, algo).double()


def activate(learner):
    learner = copy.deepcopy(learner)
    parallelize(learner, 0)  # split_body: true -> the split at every ZeRO stage
    assert learner.active_split is not None
    return learner


@pytest.mark.parametrize("vectorize", [True, False])
@pytest.mark.parametrize("algorithm", ALGOS)
def test_melu_split_equals_the_whole_model(algorithm, vectorize):
    whole = melu_learner(algorithm, ["mlp.4.*"], vectorize)  # hidden [6, 5]: mlp.4 is the output layer
    g = compare(whole, activate(whole), tiny_batch(tasks=3, support=6, query=4, seed=1))
    body = [n for n in g if n.startswith(("net.mlp.0.", "net.mlp.2."))]
    assert len(body) == 4 and all(g[n].abs().sum() > 0 for n in body)  # the body does learn
    assert whole.active_split is None


def test_melu_body_meta_gradient_is_second_order():
    """The body's meta-gradient through the support features is not FOMAML's: the split keeps
    the second-order term (and matches the whole model, above)."""
    batch = tiny_batch(tasks=3, support=6, query=4, seed=2)
    g_maml, _ = grads(activate(melu_learner("maml", ["mlp.2.*", "mlp.4.*"])), batch)
    g_fo, _ = grads(activate(melu_learner("fomaml", ["mlp.2.*", "mlp.4.*"])), batch)
    assert (g_maml["net.mlp.0.weight"] - g_fo["net.mlp.0.weight"]).abs().max() > 1e-6


def test_melu_split_point_follows_adapt():
    net = tiny_melu(hidden=[6, 5])
    split = net.split_body(["mlp.2.weight", "mlp.4.bias"])
    assert isinstance(split, BodySplit)
    assert [id(p) for p in split.body.parameters()] == [id(p) for p in net.mlp[:2].parameters()]
    rows = torch.randn(7, 3, 3)
    torch.testing.assert_close(split.head(split.body(rows)), net(rows))
    assert net.split_body(["mlp.0.weight"]) is None  # everything adapts
    assert net.split_body(["embedding.weights.age"]) is None


def test_split_true_without_a_split_is_a_config_error():
    learner = melu_learner("maml", ["mlp.*"])
    with pytest.raises(ConfigError, match="meta.split_body: true, but the model cannot be split"):
        parallelize(learner, 0)
    rows = melu_learner("maml", ["mlp.4.*", "embedding.item_id"])
    with pytest.raises(ConfigError, match="embedding rows adapt"):
        parallelize(rows, 3)


def test_auto_splits_under_zero3_only():
    learner = MetaLearner(tiny_melu(hidden=[6, 5]), ALGORITHMS["maml"](1, 0.1, ["mlp.4.*"], True))
    parallelize(learner, 2)
    assert learner.active_split is None
    parallelize(learner, 3)
    assert learner.active_split is not None
    assert {id(p) for p in step_parameters(learner)} == {
        id(p) for n, p in learner.named_parameters() if not n.startswith(("net.mlp.0.", "net.mlp.2."))}
    assert learner.runner is None  # the body stays under DeepSpeed's hooks: no skeleton forward
    assert single_process_template(learner) is not learner


def test_zero3_without_a_split_runs_through_the_skeleton():
    """ZeRO-3 without a split: `parallelize` gives the learner a runner that runs its meta-device
    skeleton with the learner's own parameters (the same loss and gradients as the plain
    forward), every parameter is gathered per micro-step, and single-process copies are made
    from the skeleton."""
    learner = melu_learner("maml", ["mlp.*"])
    learner.algorithm.split_body = "auto"
    plain = copy.deepcopy(learner)
    assert parallelize(learner, 3) is None and learner.active_split is None
    assert isinstance(learner.runner, SkeletonForward)
    skeleton = single_process_template(learner)
    assert skeleton is learner.runner.skeleton and skeleton.runner is None
    assert all(p.is_meta for p in skeleton.parameters())
    assert [id(p) for p in step_parameters(learner)] == [id(p) for p in learner.parameters()]
    batch = tiny_batch(tasks=3, support=6, query=4, seed=3)
    compare(plain, learner, batch)
    assert single_process_template(plain) is plain


# ------------------------------------------------------------------------- text (HF BERT)
TINY = {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 32}


@pytest.fixture(scope="module")
def text_setup():
    data = TextDataConfig(ways=3, shots=2, queries=2, max_length=10,
                          synthetic=TextSyntheticConfig(num_classes=12, examples_per_class=6,
                                                        topic_words=8, filler_words=20, words_per_text=5))
    cfg = TextConfig(data=data, model=TextModelConfig(config=dict(TINY)))
    texts, labels = generate_texts(cfg.data.synthetic, 0)
    tok = build_tokenizer(cfg, texts)
    return cfg, tok, build_tasks(texts, labels, tok, cfg.data, 0)


def text_learner(cfg, tok, algorithm, adapt=("model.classifier.*",), model_type="bert"):
    model_cfg = TextModelConfig(config={**TINY, "model_type": model_type})
    cfg = TextConfig(data=cfg.data, model=model_cfg)
    net = SequenceClassifier(build_classifier(cfg, tok, seed=0))
    meta = MetaConfig(algorithm=algorithm, inner_steps=2, inner_lr=0.5, adapt=list(adapt), split_body=True)
    return TextMetaLearner(net, build_algorithm(meta, "multiclass")).double()


@pytest.mark.parametrize("algorithm", ALGOS)
def test_bert_head_only_split_equals_the_whole_model(text_setup, algorithm):
    cfg, tok, tasks = text_setup
    whole = text_learner(cfg, tok, algorithm)
    g = compare(whole, activate(whole), tasks.episodes("train", [0, 1, 2]))
    encoder = [n for n in g if ".bert.encoder." in n]
    assert encoder and all(g[n].abs().sum() > 0 for n in encoder if n.endswith("weight"))


@pytest.mark.parametrize("model_type", ["roberta", "distilbert"])
def test_other_hf_heads_split_or_fall_back(text_setup, model_type):
    """RoBERTa's head takes the hidden states: it splits and matches. DistilBERT's head is code
    in its forward: the probe refuses the split, and split_body: true says so."""
    cfg, tok, tasks = text_setup
    adapt = ("model.classifier.*",) if model_type == "roberta" else ("model.classifier.*", "model.pre_classifier.*")
    whole = text_learner(cfg, tok, "maml", adapt, model_type)
    if model_type == "roberta":
        compare(whole, activate(whole), tasks.episodes("train", [3, 4]))
    else:
        with pytest.raises(ConfigError, match="has no body for meta.adapt"):
            parallelize(whole, 3)


def test_bert_everything_adapted_has_no_split(text_setup):
    cfg, tok, _ = text_setup
    learner = text_learner(cfg, tok, "maml", ("*",))
    split, why = body_split(learner)
    assert split is None and "adapted parameters lie in the model's body" in why
