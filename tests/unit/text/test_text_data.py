"""Few-shot text episodes: reading tables (CSV / JSON / Parquet) with clear errors, the class
split, and episodes (labels remapped, deterministic, support and query disjoint)."""
from __future__ import annotations

import json

import pytest
import torch

from gmeta_ds.config import TextDataConfig, TextSyntheticConfig
from gmeta_ds.errors import DataError
from gmeta_ds.text.data import build_tasks, generate_texts, read_text_table
from gmeta_ds.text.model import train_tokenizer

ROWS = [{"text": f"sample {i} about {c}", "label": c} for c in ("sports", "music", "food") for i in range(4)]


def write(tmp_path, fmt: str):
    import pandas as pd

    df = pd.DataFrame(ROWS)
    path = tmp_path / f"data.{fmt}"
    if fmt == "csv":
        df.to_csv(path, index=False)
    elif fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    else:
        df.to_parquet(path)
    return path


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_tables_of_each_format_read_the_same(tmp_path, fmt):
    texts, labels = read_text_table(TextDataConfig(path=str(write(tmp_path, fmt))))
    assert texts == [r["text"] for r in ROWS] and labels == [r["label"] for r in ROWS]


def test_table_errors_name_the_file_and_what_is_expected(tmp_path):
    with pytest.raises(DataError, match="text.data.path: .*missing.csv is not a file"):
        read_text_table(TextDataConfig(path=str(tmp_path / "missing.csv")))
    odd = tmp_path / "data.xyz"
    odd.write_text("x")
    with pytest.raises(DataError, match=r"cannot tell the format from the extension '.xyz'"):
        read_text_table(TextDataConfig(path=str(odd)))
    path = write(tmp_path, "csv")
    with pytest.raises(DataError, match=r"no column 'sentence' \(columns: text, label\)"):
        read_text_table(TextDataConfig(path=str(path), text_column="sentence"))
    path.write_text("text,label\nhello,a\n,b\n")
    with pytest.raises(DataError, match=r"row 1 has no text in 'text'"):
        read_text_table(TextDataConfig(path=str(path)))


def test_generated_texts_hold_the_pair_of_their_class():
    cfg = TextSyntheticConfig(num_classes=6, examples_per_class=3, topic_words=5, filler_words=10,
                              words_per_text=6)
    texts, labels = generate_texts(cfg, seed=1)
    assert len(texts) == 18 and len(set(labels)) == 6
    assert generate_texts(cfg, seed=1) == (texts, labels) and generate_texts(cfg, seed=2) != (texts, labels)
    pairs = {}
    for text, label in zip(texts, labels):
        words = text.split()
        topics = frozenset(w for w in words if w.startswith("topic"))
        assert len(words) == 6 and len(topics) == 2
        assert pairs.setdefault(label, topics) == topics  # the same pair in every text of a class
    assert len(set(pairs.values())) == 6  # classes are distinct pairs


@pytest.fixture(scope="module")
def tasks():
    cfg = TextDataConfig(ways=3, shots=2, queries=3, max_length=12, test_classes=0.3,
                         synthetic=TextSyntheticConfig(num_classes=12, examples_per_class=8,
                                                       topic_words=8, filler_words=20, words_per_text=6))
    texts, labels = generate_texts(cfg.synthetic, 0)
    return build_tasks(texts, labels, train_tokenizer(texts, 100), cfg, seed=0), texts, labels


def test_classes_split_into_disjoint_train_and_held_out(tasks):
    t, _, _ = tasks
    train, test = set(t.class_names["train"]), set(t.class_names["test"])
    assert not train & test and len(test) == 4 and len(train) == 8


def test_episodes_remap_labels_and_are_deterministic(tasks):
    t, texts, labels = tasks
    batch = t.episodes("train", [0, 1, 5])
    assert batch.support_ids.shape[:2] == (3, 6) and batch.query_ids.shape[:2] == (3, 9)
    assert batch.support_y[0].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.query_y[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert batch.task_ids.tolist() == [0, 1, 5]
    again = t.episodes("train", [5])
    assert torch.equal(again.support_ids[0], batch.support_ids[2][:, :again.support_ids.shape[-1]])
    # support and query of an episode never share a text; each label is one class throughout
    rows = {tuple(r.tolist()): i for i, r in enumerate(t.ids)}
    for e in range(3):
        width = batch.support_ids.shape[-1]
        pad = lambda r: tuple(r.tolist()) + (0,) * (t.ids.shape[1] - width)  # noqa: E731
        s = [rows[pad(r)] for r in batch.support_ids[e]]
        q = [rows[pad(r)] for r in batch.query_ids[e]]
        assert not set(s) & set(q)
        for k in range(3):
            members = {labels[i] for i, y in zip(s, batch.support_y[e]) if y == k}
            members |= {labels[i] for i, y in zip(q, batch.query_y[e]) if y == k}
            assert len(members) == 1 and members <= set(t.class_names["train"])
    held = t.episodes("test", [0])
    assert {labels[rows[tuple(r.tolist()) + (0,) * (t.ids.shape[1] - held.support_ids.shape[-1])]]
            for r in held.support_ids[0]} <= set(t.class_names["test"])


def test_episodes_drop_columns_that_are_padding_everywhere(tasks):
    t, _, _ = tasks
    batch = t.episodes("train", [0, 1])
    width = batch.support_ids.shape[-1]
    assert width < t.ids.shape[1]
    assert int(max(batch.support_attention.sum(-1).max(), batch.query_attention.sum(-1).max())) == width


def test_too_few_classes_is_a_clear_error(tasks):
    _, texts, labels = tasks
    cfg = TextDataConfig(ways=7, shots=2, queries=3, max_length=12)  # 12 classes: 7 held out, 5 left
    with pytest.raises(DataError, match="7-way episodes need 7 training and 7 held-out classes"):
        build_tasks(texts, labels, train_tokenizer(texts, 100), cfg, seed=0)
