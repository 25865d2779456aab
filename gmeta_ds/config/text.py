"""``text``: few-shot sequence classification (``task: text``) and its own checks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from gmeta_ds.config.checks import TEXT_FORMATS, one_of, check_positive


@dataclass
class TextSyntheticConfig:
    """Generated few-shot text classification data (``text.data.path: null``): each class is
    a pair of words from a pool of ``topic_words``; its texts hold both among filler words
    that every class shares (see gmeta_ds/text/data.py)."""

    num_classes: int = 60                  # classes generated
    examples_per_class: int = 20           # texts per class
    topic_words: int = 12                  # the pool of words that mark classes
    filler_words: int = 200                # the pool of words every class shares
    words_per_text: int = 8                # words per text


@dataclass
class TextDataConfig:
    """A local text classification table and its N-way K-shot episodes."""

    path: Union[str, None] = None             # CSV / JSON(L) / Parquet file; null = generated
    format: str = "auto"                      # auto (from the extension) | csv | json | parquet
    text_column: str = "text"              # the column holding the text
    label_column: str = "label"            # the column holding the class
    ways: int = 5                             # N classes per episode (labels remapped to 0..N-1)
    shots: int = 5                            # K support examples per class
    queries: int = 5                          # Q query examples per class
    max_length: int = 32                      # tokens per text (truncated / padded)
    test_classes: float = 0.25                # share of classes held out (unseen in meta-training)
    synthetic: TextSyntheticConfig = field(default_factory=TextSyntheticConfig)


@dataclass
class TextModelConfig:
    """An ``AutoModelForSequenceClassification``: from a local pretrained directory, or built
    from ``config`` (random init) with a tokenizer trained on the data."""

    pretrained: Union[str, None] = None       # local model directory (from_pretrained)
    tokenizer: Union[str, None] = None        # local tokenizer directory (default: pretrained)
    vocab_size: int = 1000                    # trained tokenizer's vocabulary (no tokenizer given)
    # AutoConfig.for_model keywords of the model built from scratch.
    config: dict = field(default_factory=lambda: {
        "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 128})
    # Second-order MAML differentiates attention twice: "eager" supports that everywhere;
    # "sdpa" is faster but its CPU kernels have no double backward (fine for first order).
    attn_implementation: str = "eager"


@dataclass
class TextConfig:
    """Few-shot sequence classification (``task: text``)."""

    data: TextDataConfig = field(default_factory=TextDataConfig)
    model: TextModelConfig = field(default_factory=TextModelConfig)
    eval_episodes: int = 100                  # test-class episodes scored after training
    baseline_steps: int = 30                  # fine-tune-from-scratch baseline: Adam steps per episode
    baseline_lr: float = 3e-3              # fine-tune-from-scratch baseline: its learning rate


def validate_text(text: TextConfig, problems: list[str]) -> None:
    """``text.*`` (task: text): episode shapes, generated data and the model's options."""
    d = text.data
    one_of(problems, "text.data.format", d.format, TEXT_FORMATS)
    for name in ("ways", "shots", "queries", "max_length"):
        check_positive(problems, f"text.data.{name}", getattr(d, name))
    if d.ways < 2 and not isinstance(d.ways, str):
        problems.append(f"text.data.ways: {d.ways} must be >= 2 (a classification episode)")
    if not 0.0 < d.test_classes < 1.0:
        problems.append(f"text.data.test_classes: {d.test_classes!r} must be in (0, 1)")
    syn = d.synthetic
    for name in ("num_classes", "examples_per_class", "topic_words", "filler_words", "words_per_text"):
        check_positive(problems, f"text.data.synthetic.{name}", getattr(syn, name))
    if d.path is None and syn.topic_words * (syn.topic_words - 1) // 2 < syn.num_classes:
        problems.append(f"text.data.synthetic.topic_words: {syn.topic_words} words make "
                        f"{syn.topic_words * (syn.topic_words - 1) // 2} pairs, fewer than "
                        f"num_classes ({syn.num_classes})")
    if d.path is None and syn.words_per_text < 2:
        problems.append(f"text.data.synthetic.words_per_text: {syn.words_per_text} must be >= 2 "
                        "(a text holds its class's two topic words)")
    for name in ("eval_episodes", "baseline_steps", "baseline_lr"):
        check_positive(problems, f"text.{name}", getattr(text, name))
    check_positive(problems, "text.model.vocab_size", text.model.vocab_size)
    one_of(problems, "text.model.attn_implementation", text.model.attn_implementation,
            ("eager", "sdpa"))
