"""Hugging Face classifiers as meta-learners: building (config or local pretrained folder,
with errors naming the key), vmap == loop meta-gradients, MAML's second-order gradient
against finite differences, and bf16 with float32 fast weights."""
from __future__ import annotations

import copy

import pytest
import torch

from gmeta_ds.algorithms import ALGORITHMS, build_algorithm
from gmeta_ds.config import MetaConfig, TextConfig, TextDataConfig, TextModelConfig, TextSyntheticConfig
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.inner import choose_vectorize, masked_cross_entropy
from gmeta_ds.text.data import TextEpisodes, build_tasks, generate_texts
from gmeta_ds.text.model import (SequenceClassifier, TextMetaLearner, build_classifier,
                                 build_tokenizer, train_tokenizer)

TINY = {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 32}


def text_cfg(**model) -> TextConfig:
    data = TextDataConfig(ways=3, shots=2, queries=2, max_length=10,
                          synthetic=TextSyntheticConfig(num_classes=12, examples_per_class=6,
                                                        topic_words=8, filler_words=20, words_per_text=5))
    return TextConfig(data=data, model=TextModelConfig(config=dict(TINY), **model))


@pytest.fixture(scope="module")
def setup():
    cfg = text_cfg()
    texts, labels = generate_texts(cfg.data.synthetic, 0)
    tok = build_tokenizer(cfg, texts)
    return cfg, tok, build_tasks(texts, labels, tok, cfg.data, 0)


def learner_for(cfg, tok, algorithm="maml", adapt=("*",), vectorize=True, dtype=torch.float64, steps=2, lr=0.5):
    net = SequenceClassifier(build_classifier(cfg, tok, seed=0))
    meta = MetaConfig(algorithm=algorithm, inner_steps=steps, inner_lr=lr, adapt=list(adapt), vectorize=vectorize)
    return TextMetaLearner(net, build_algorithm(meta, "multiclass")).to(dtype)


def grads(learner, batch):
    learner.zero_grad()
    out = learner(batch)
    out.loss.backward()
    return {n: p.grad.clone() for n, p in learner.named_parameters() if p.grad is not None}, out


def test_tokenizer_training_is_deterministic(setup):
    cfg, tok, _ = setup
    texts, _ = generate_texts(cfg.data.synthetic, 0)
    assert train_tokenizer(texts, 100).get_vocab() == train_tokenizer(texts, 100).get_vocab()
    assert tok("topic1 w3")["input_ids"][0] == tok.cls_token_id


def test_classifier_has_one_output_per_way_and_no_dropout(setup):
    cfg, tok, _ = setup
    model = build_classifier(cfg, tok, seed=0)
    assert model.config.num_labels == 3
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    again = build_classifier(cfg, tok, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_pretrained_folder_is_loaded_with_the_head_resized(setup, tmp_path):
    cfg, tok, _ = setup
    from transformers import AutoConfig, AutoModelForSequenceClassification

    spec = dict(TINY)
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=len(tok), num_labels=7, **spec)
    saved = AutoModelForSequenceClassification.from_config(config)
    saved.save_pretrained(tmp_path / "pre")
    tok.save_pretrained(tmp_path / "pre")
    loaded_cfg = text_cfg(pretrained=str(tmp_path / "pre"))
    model = build_classifier(loaded_cfg, build_tokenizer(loaded_cfg, []), seed=0)
    assert model.config.num_labels == 3 and model.classifier.weight.shape[0] == 3
    body = dict(saved.named_parameters())
    assert torch.equal(dict(model.named_parameters())["bert.embeddings.word_embeddings.weight"],
                       body["bert.embeddings.word_embeddings.weight"])


def test_missing_folders_and_bad_configs_name_the_key(setup, tmp_path):
    _, tok, _ = setup
    with pytest.raises(ConfigError, match="text.model.pretrained: .*nowhere' is not a directory"):
        build_classifier(text_cfg(pretrained=str(tmp_path / "nowhere")), tok, 0)
    with pytest.raises(ConfigError, match="text.model.tokenizer: .*nothing' is not a directory"):
        build_tokenizer(text_cfg(tokenizer=str(tmp_path / "nothing")), [])
    cfg = text_cfg()
    cfg.model.config = {"hidden_size": 16}
    with pytest.raises(ConfigError, match="text.model.config: needs model_type"):
        build_classifier(cfg, tok, 0)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("adapt", [("*",), ("model.classifier.*",)])
def test_vmap_and_loop_give_the_same_meta_gradients(setup, name, adapt):
    cfg, tok, tasks = setup
    batch = tasks.episodes("train", [0, 1, 2])
    gv, ov = grads(learner_for(cfg, tok, name, adapt, vectorize=True), batch)
    gl, ol = grads(learner_for(cfg, tok, name, adapt, vectorize=False), batch)
    assert ov.loss.item() == pytest.approx(ol.loss.item(), rel=1e-10)
    assert gv.keys() == gl.keys() and len(gv) > 0
    for n in gv:  # atol: the [CLS] row sums a cancelling term from every text, in another order
        torch.testing.assert_close(gv[n], gl[n], rtol=1e-7, atol=2e-9, msg=lambda m, n=n: f"{n}: {m}")


def test_maml_meta_gradient_matches_finite_differences(setup):
    """Second order through BERT: d/dθ of the query loss after two inner steps."""
    cfg, tok, tasks = setup
    batch = tasks.episodes("train", [3])
    learner = learner_for(cfg, tok, "maml", ("*",), steps=2, lr=2.0)
    g, _ = grads(learner, batch)
    fo, _ = grads(learner_for(cfg, tok, "fomaml", ("*",), steps=2, lr=2.0), batch)
    name = "net.model.bert.encoder.layer.0.output.dense.weight"
    param = dict(learner.named_parameters())[name]
    eps = 1e-6
    with torch.no_grad():
        for idx in [(0, 0), (5, 7)]:
            old = param[idx].item()
            param[idx] = old + eps
            up = learner(batch).query_loss.item()
            param[idx] = old - eps
            down = learner(batch).query_loss.item()
            param[idx] = old
            assert g[name][idx].item() == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9)
    assert not torch.allclose(g[name], fo[name], rtol=1e-3)  # second-order terms matter here


def test_bf16_parameters_adapt_in_float32(setup):
    """bf16 weights: losses and fast weights are float32, and the inner loop lowers the loss
    on its own support (query = support here) about as much as in float32; in plain bf16
    most of that step would round away."""
    cfg, tok, tasks = setup
    b = tasks.episodes("train", [0, 1])
    same = TextEpisodes(b.support_ids, b.support_attention, b.support_y, b.support_ids,
                        b.support_attention, b.support_y, b.task_ids)
    ref = learner_for(cfg, tok, "maml", dtype=torch.float32, lr=0.1, steps=1)
    torch.manual_seed(0)
    with torch.no_grad():  # weights large enough for a random model to separate the texts
        for p in ref.parameters():
            p.normal_(0, 0.3)
    half = copy.deepcopy(ref).to(torch.bfloat16)
    g, out = grads(half, same)
    _, ref_out = grads(ref, same)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert all(v.dtype == torch.bfloat16 and torch.isfinite(v).all() for v in g.values())
    gain = ref_out.support_loss.item() - ref_out.query_loss.item()
    half_gain = out.support_loss.item() - out.query_loss.item()
    assert gain > 1e-3
    assert half_gain == pytest.approx(gain, rel=0.25)


def test_choose_vectorize():
    assert choose_vectorize(True, 10**15, 64) is True
    assert choose_vectorize(False, 1, 1) is False
    assert choose_vectorize("auto", 2**20, 4, budget_mb=8) is True
    assert choose_vectorize("auto", 2**20, 16, budget_mb=8) is False
    assert choose_vectorize("auto", 1, 1) is True


def test_masked_cross_entropy_ignores_padding():
    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    expected = torch.nn.functional.cross_entropy(logits[:3], labels[:3])
    torch.testing.assert_close(masked_cross_entropy(logits, labels, mask), expected)


@pytest.mark.parametrize("spec", [
    {"model_type": "roberta"}, {"model_type": "electra"}, {"model_type": "albert", "embedding_size": 16},
    {"model_type": "deberta-v2"},
    {"model_type": "distilbert", "dim": 16, "n_layers": 1, "n_heads": 2, "hidden_dim": 32},
])
def test_other_encoders_meta_train_with_vmap_and_loop(setup, spec):
    """Second-order MAML through each encoder family: the vmap and loop paths agree."""
    cfg, tok, tasks = setup
    if spec["model_type"] != "distilbert":
        spec = {**TINY, **spec}
    cfg = text_cfg()
    cfg.model.config = spec
    batch = tasks.episodes("train", [0, 1])
    gv, ov = grads(learner_for(cfg, tok, "maml", vectorize=True), batch)
    gl, ol = grads(learner_for(cfg, tok, "maml", vectorize=False), batch)
    assert ov.loss.item() == pytest.approx(ol.loss.item(), rel=1e-9)
    assert gv.keys() == gl.keys() and all(torch.isfinite(g).all() for g in gv.values())
