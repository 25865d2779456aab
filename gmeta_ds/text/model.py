"""Hugging Face sequence classifiers as meta-learners.

- `build_tokenizer`: a local tokenizer directory (``AutoTokenizer``), or a small word-level
  tokenizer built offline from the texts with the ``tokenizers`` library.
- `build_classifier`: an ``AutoModelForSequenceClassification`` from a local pretrained
  directory (head re-sized to N ways) or built from a config dict (random init); dropout
  is switched off so an episode adapts the same way on every rank and under vmap.
- `SequenceClassifier`: the module the inner loop calls, ``(ids, attention) -> logits``; it
  passes the attention mask as a ready 4-D boolean mask, which the model uses as is (the 2-D
  form makes transformers inspect the mask's values, which vmap cannot trace).
- `TextMetaLearner`: `MetaLearner` over episodes of texts (``meta.adapt`` globs over
  ``model.*`` names: ``["model.classifier.*"]`` is ANIL, ``["*"]`` adapts everything).
"""
from __future__ import annotations

import contextlib

from pathlib import Path

import torch
from torch import Tensor, nn

from gmeta_ds.algorithms.base import MetaLearner, MetaOutput
from gmeta_ds.config import TextConfig
from gmeta_ds.errors import ConfigError
from gmeta_ds.functional.split import BodySplit
from gmeta_ds.text.data import TextEpisodes

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A BERT-style word-level tokenizer (``tokenizers`` library: BERT normalizer and
    pre-tokenizer, ``[CLS] text [SEP]``) whose vocabulary is the ``vocab_size`` - 5 most
    frequent words of ``texts`` (ties by spelling) after the special tokens; rarer words
    become ``[UNK]``. Built deterministically, so every rank gets the same token ids
    (``tokenizers``' own trainers break ties in hash order, which differs between processes)."""
    from collections import Counter

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    normalizer, splitter = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    counts = Counter(word for text in texts
                     for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text)))
    words = sorted(counts, key=lambda w: (-counts[w], w))[:max(0, vocab_size - len(SPECIAL_TOKENS))]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizer, splitter
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def _local_dir(path: str, key: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError([f"{key}: {str(folder)!r} is not a directory (a local Hugging Face "
                           "model or tokenizer folder; nothing is downloaded)"])
    return folder


def build_tokenizer(cfg: TextConfig, texts: list[str]):
    """The tokenizer of ``text.model.tokenizer`` (or of the pretrained model's directory), or
    one trained on ``texts``."""
    source = cfg.model.tokenizer or cfg.model.pretrained
    if source is None:
        return train_tokenizer(texts, cfg.model.vocab_size)
    from transformers import AutoTokenizer

    folder = _local_dir(source, "text.model.tokenizer" if cfg.model.tokenizer else "text.model.pretrained")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError([f"text.model.tokenizer: no tokenizer could be loaded from {folder}: {exc}"]) from exc
    if tokenizer.pad_token is None:
        raise ConfigError([f"text.model.tokenizer: the tokenizer in {folder} has no pad token; "
                           "episodes pad texts to text.data.max_length"])
    return tokenizer


def _no_dropout(config) -> None:
    for key, value in config.to_dict().items():
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)


@contextlib.contextmanager
def _quiet_loading():
    """Transformers' per-load "Loading weights" progress bar off while a classifier loads (a
    run loads one several times: training, the baselines, `gmeta-ds eval`), as it was after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def build_classifier(cfg: TextConfig, tokenizer, seed: int) -> nn.Module:
    """An ``AutoModelForSequenceClassification`` with ``text.data.ways`` labels, identical on
    every rank (initialised from ``seed``), dropout off."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    ways, attn = cfg.data.ways, cfg.model.attn_implementation
    torch.manual_seed(seed)
    if cfg.model.pretrained:
        folder = _local_dir(cfg.model.pretrained, "text.model.pretrained")
        try:
            config = AutoConfig.from_pretrained(str(folder), num_labels=ways, local_files_only=True)
            _no_dropout(config)
            with _quiet_loading():
                model = AutoModelForSequenceClassification.from_pretrained(
                    str(folder), config=config, ignore_mismatched_sizes=True, local_files_only=True,
                    attn_implementation=attn)
        except (OSError, ValueError) as exc:
            raise ConfigError([f"text.model.pretrained: no sequence classifier could be loaded "
                               f"from {folder}: {exc}"]) from exc
    else:
        spec = dict(cfg.model.config)
        if "model_type" not in spec:
            raise ConfigError(["text.model.config: needs model_type (e.g. bert), or set "
                               "text.model.pretrained to a local model directory"])
        spec.setdefault("max_position_embeddings", max(64, cfg.data.max_length + 2))
        try:
            config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=len(tokenizer),
                                          num_labels=ways, pad_token_id=tokenizer.pad_token_id, **spec)
            _no_dropout(config)
            model = AutoModelForSequenceClassification.from_config(config, attn_implementation=attn)
        except (KeyError, ValueError, TypeError) as exc:  # unknown model_type, inconsistent sizes
            raise ConfigError([f"text.model.config: {str(exc)[:400]}"]) from exc
    if model.config.num_labels != ways:
        raise ConfigError([f"text.model: the model has {model.config.num_labels} labels, "
                           f"episodes have text.data.ways = {ways}"])
    return model


class SequenceClassifier(nn.Module):
    """``forward((ids, attention)) -> logits (N, ways)`` around a HF sequence classifier."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        ids, attention = x
        mask = attention[:, None, None, :].bool()
        return self.model(input_ids=ids, attention_mask=mask).logits

    def split_body(self, adapted: list[str]) -> BodySplit | None:
        """The HF base model (``model.base_model``: the encoder) as the body and the model's
        other children (BERT: dropout + classifier; RoBERTa: its classification head) as the
        head, on the base model's pooled output when it has one, else on its hidden states.
        Accepted only if ``head(body(x))`` reproduces the model's own logits on a probe batch
        (architectures whose head is code in ``forward``, e.g. DistilBERT's, are refused)."""
        model = self.model
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(model, prefix, None) if prefix else None
        rest = [m for n, m in model.named_children() if n != prefix]
        if not isinstance(base, nn.Module) or not rest:
            return None

        def head(features: Tensor) -> Tensor:
            for module in rest:
                features = module(features)
            return features

        param = next(self.parameters())
        vocab = model.config.vocab_size
        ids = torch.arange(12, device=param.device).reshape(2, 6) % max(1, vocab - 5) + 5
        attention = torch.ones_like(ids)
        attention[1, -2:] = 0
        with torch.no_grad():
            want = self((ids, attention))
            for pooled in (True, False):
                body = _Encoder(base, pooled)
                try:
                    got = head(body((ids, attention)))
                except (TypeError, ValueError, RuntimeError, AttributeError):
                    continue
                if got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-4):
                    return BodySplit(body, head)
        return None


class _Encoder(nn.Module):
    """``(ids, attention) -> features`` of a HF base model: its pooled output (``pooled``) or
    its last hidden states."""

    def __init__(self, base: nn.Module, pooled: bool):
        super().__init__()
        self.base, self.pooled = base, pooled

    def forward(self, x: tuple[Tensor, Tensor]) -> Tensor:
        ids, attention = x
        out = self.base(input_ids=ids, attention_mask=attention[:, None, None, :].bool())
        features = out.pooler_output if self.pooled else out.last_hidden_state
        if features is None:
            raise ValueError("the base model has no pooled output")
        return features


def activation_bytes_per_task(cfg: TextConfig, model: nn.Module, inner_steps: int) -> int:
    """Rough activation memory of one episode's inner and outer passes (``meta.vectorize:
    auto``): texts x tokens x hidden x layers x ~20 saved tensors, per pass, x2 (gradients)."""
    c = model.config
    hidden = getattr(c, "hidden_size", 768)
    layers = getattr(c, "num_hidden_layers", 12)
    d = cfg.data
    texts = d.ways * (d.shots + d.queries)
    return texts * d.max_length * hidden * layers * 20 * 4 * (inner_steps + 1) * 2


class TextMetaLearner(MetaLearner):
    """A meta-learner over `TextEpisodes`: the support and query of each episode go through
    the algorithm's inner loop on `SequenceClassifier` (labels: multiclass)."""

    batch_type = TextEpisodes

    def __init__(self, net: SequenceClassifier, algorithm):
        super().__init__(net, algorithm)

    def meta_forward(self, batch: TextEpisodes, rows=None) -> MetaOutput:
        params = dict(self.net.named_parameters())
        theta = {n: params[n] for n in self.adapted}
        support = ((batch.support_ids, batch.support_attention), batch.support_y, batch.support_mask)
        query = ((batch.query_ids, batch.query_attention), batch.query_y, batch.query_mask)
        return self.outer_loss(theta, support, query)

