"""Few-shot text classification episodes from a local table (CSV / JSON(L) / Parquet, read
with Hugging Face ``datasets``), or generated.

A dataset becomes a `TextTasks`: every text tokenized once to ``max_length`` ids, and the
classes split into meta-training and held-out (unseen) classes. An episode draws N classes
(labels remapped to 0..N-1 in draw order), K support and Q query texts per class; episode
``i`` of a run depends only on (seed, split, i), so every rank draws the same global episodes
and the ranks' share of a meta-step does not depend on the world size.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from gmeta_ds.config import TextDataConfig, TextSyntheticConfig
from gmeta_ds.errors import DataError

_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# SeedSequence keys of the episode streams (training / held-out classes) and the class split.
_TRAIN_KEY, _TEST_KEY, _SPLIT_KEY = 0, 1, 2


def generate_texts(cfg: TextSyntheticConfig, seed: int) -> tuple[list[str], list[str]]:
    """(texts, labels): class c is a pair of topic words drawn from a pool of
    ``topic_words``; each of its texts holds both words, at random places among
    ``words_per_text - 2`` filler words shared by every class. Held-out classes are new pairs
    of words seen in meta-training, so what transfers is a representation of which topic
    words a text holds (and that fillers carry no signal), which a model fine-tuned from
    scratch must learn anew from each support set."""
    rng = np.random.default_rng([seed, 7])
    fillers = [f"w{i}" for i in range(cfg.filler_words)]
    pairs = [(a, b) for a in range(cfg.topic_words) for b in range(a + 1, cfg.topic_words)]
    chosen = rng.choice(len(pairs), size=cfg.num_classes, replace=False)
    texts, labels = [], []
    for c, pair in enumerate(chosen):
        for _ in range(cfg.examples_per_class):
            words = list(rng.choice(fillers, size=cfg.words_per_text - 2))
            for topic in pairs[pair]:
                words.insert(int(rng.integers(0, len(words) + 1)), f"topic{topic}")
            texts.append(" ".join(words))
            labels.append(f"class_{c:03d}")
    return texts, labels


def read_text_table(cfg: TextDataConfig) -> tuple[list[str], list[str]]:
    """(texts, labels as strings) of the table at ``cfg.path``; errors name the file and column."""
    import datasets

    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise DataError(f"text.data.path: {path} is not a file (a CSV, JSON(L) or Parquet table "
                        f"with columns {cfg.text_column!r} and {cfg.label_column!r})")
    fmt = cfg.format if cfg.format != "auto" else _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: cannot tell the format from the extension {path.suffix!r}; set "
                        "text.data.format to csv, json or parquet")
    kwargs = {"delimiter": "\t"} if fmt == "csv" and path.suffix.lower() == ".tsv" else {}
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(fmt, data_files=str(path), split="train", **kwargs)
    except Exception as exc:  # datasets raises many types for a malformed file
        raise DataError(f"{path}: not a readable {fmt} table: {exc}") from exc
    for col in (cfg.text_column, cfg.label_column):
        if col not in table.column_names:
            raise DataError(f"{path}: no column {col!r} (columns: {', '.join(table.column_names)}); "
                            f"set text.data.text_column / text.data.label_column")
    texts, labels = table[cfg.text_column], table[cfg.label_column]
    bad = [i for i, (t, y) in enumerate(zip(texts, labels)) if not isinstance(t, str) or y is None]
    if bad:
        raise DataError(f"{path}: row {bad[0]} has no text in {cfg.text_column!r} or no label in "
                        f"{cfg.label_column!r} ({len(bad)} such rows)")
    return list(texts), [str(y) for y in labels]


@dataclass
class TextEpisodes:
    """A micro-batch of T episodes. ids / attention (T, N*K or N*Q, L); y (T, ·) labels in
    0..N-1; mask (T, ·) ones (every row is real; the loss contract takes a row mask);
    ``task_ids`` (T,) global episode numbers."""

    support_ids: Tensor
    support_attention: Tensor
    support_y: Tensor
    query_ids: Tensor
    query_attention: Tensor
    query_y: Tensor
    task_ids: Tensor
    padding_efficiency: float = 1.0  # every row is real (`TaskBatch.padding_efficiency`)

    @property
    def support_mask(self) -> Tensor:
        return torch.ones(self.support_y.shape, device=self.support_y.device)

    @property
    def query_mask(self) -> Tensor:
        return torch.ones(self.query_y.shape, device=self.query_y.device)

    def trimmed(self) -> "TextEpisodes":
        """The same episodes without the token columns that are padding in every text."""
        width = int(max(self.support_attention.sum(-1).max(), self.query_attention.sum(-1).max(), 1))
        return TextEpisodes(self.support_ids[..., :width], self.support_attention[..., :width],
                            self.support_y, self.query_ids[..., :width],
                            self.query_attention[..., :width], self.query_y, self.task_ids)


class TextTasks:
    """Tokenized texts grouped by class, with the train / held-out class split."""

    def __init__(self, ids: Tensor, attention: Tensor, labels: list[str], cfg: TextDataConfig, seed: int):
        names = sorted(set(labels))
        need = cfg.shots + cfg.queries
        counts = {n: 0 for n in names}
        for y in labels:
            counts[y] += 1
        usable = [n for n in names if counts[n] >= need]
        rng = np.random.default_rng([seed, _SPLIT_KEY])
        order = [usable[i] for i in rng.permutation(len(usable))]
        n_test = max(cfg.ways, int(round(cfg.test_classes * len(order))))
        if len(order) - n_test < cfg.ways:
            raise DataError(f"{len(usable)} classes have >= {need} texts (shots + queries); "
                            f"{cfg.ways}-way episodes need {cfg.ways} training and {cfg.ways} "
                            f"held-out classes (text.data.test_classes = {cfg.test_classes}); "
                            f"{len(names) - len(usable)} classes were too small")
        self.cfg, self.seed = cfg, seed
        self.ids, self.attention = ids, attention
        self.class_names = {"test": order[:n_test], "train": order[n_test:]}
        index = {n: [] for n in names}
        for i, y in enumerate(labels):
            index[y].append(i)
        self.members = {n: np.asarray(index[n]) for n in usable}
        self.skipped_classes = len(names) - len(usable)

    def episodes(self, split: str, numbers: list[int]) -> TextEpisodes:
        """Episodes ``numbers`` of ``split`` (train | test) as one micro-batch."""
        cfg = self.cfg
        key = _TRAIN_KEY if split == "train" else _TEST_KEY
        classes = self.class_names[split]
        parts = {k: [] for k in ("s", "q", "ys", "yq")}
        for number in numbers:
            rng = np.random.default_rng([self.seed, key, number])
            chosen = rng.choice(len(classes), size=cfg.ways, replace=False)
            s, q = [], []
            for members in (self.members[classes[c]] for c in chosen):
                picked = rng.choice(members, size=cfg.shots + cfg.queries, replace=False)
                s.append(picked[:cfg.shots])
                q.append(picked[cfg.shots:])
            parts["s"].append(np.concatenate(s))
            parts["q"].append(np.concatenate(q))
            parts["ys"].append(np.repeat(np.arange(cfg.ways), cfg.shots))
            parts["yq"].append(np.repeat(np.arange(cfg.ways), cfg.queries))
        s, q = (torch.from_numpy(np.stack(parts[k])) for k in ("s", "q"))
        return TextEpisodes(self.ids[s], self.attention[s], torch.from_numpy(np.stack(parts["ys"])),
                            self.ids[q], self.attention[q], torch.from_numpy(np.stack(parts["yq"])),
                            torch.as_tensor(numbers)).trimmed()

    def describe(self) -> str:
        c = self.cfg
        return (f"{len(self.ids)} texts, {len(self.class_names['train'])} training / "
                f"{len(self.class_names['test'])} held-out classes"
                + (f" ({self.skipped_classes} classes with < {c.shots + c.queries} texts skipped)"
                   if self.skipped_classes else "")
                + f"; episodes {c.ways}-way {c.shots}-shot, {c.queries} queries per class")


def load_texts(cfg: TextDataConfig, seed: int) -> tuple[list[str], list[str]]:
    """The table's (texts, labels), or generated ones without ``text.data.path``."""
    return read_text_table(cfg) if cfg.path else generate_texts(cfg.synthetic, seed)


def build_tasks(texts: list[str], labels: list[str], tokenizer, cfg: TextDataConfig, seed: int) -> TextTasks:
    """Tokenize every text once (truncated / padded to ``max_length``) and split the classes."""
    enc = tokenizer(texts, max_length=cfg.max_length, truncation=True, padding="max_length",
                    return_tensors="pt")
    return TextTasks(enc["input_ids"], enc["attention_mask"], labels, cfg, seed)
