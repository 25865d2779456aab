"""The public API's task building and learner wrapping (no process group needed)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from helpers import click_log
from torch import nn

import gmeta_ds as gm


def _log(users: int = 40, seed: int = 0) -> pd.DataFrame:
    return click_log(users, seed)


KEYS = dict(task_key="user", item_key="item", label="click", user_features=["age"],
            multi_hot={"tags": "|"}, label_kind="binary", threshold=0.5, query_size=4, seed=3)


def _same(a, b) -> None:
    assert [f.name for f in a.fields] == [f.name for f in b.fields]
    for split in ("train", "test"):
        x, y = getattr(a, split), getattr(b, split)
        np.testing.assert_array_equal(x.ids, y.ids)
        np.testing.assert_array_equal(x.labels, y.labels)
        np.testing.assert_array_equal(x.offsets, y.offsets)
        np.testing.assert_array_equal(x.multi["tags"][0], y.multi["tags"][0])


def test_build_tasks_is_the_same_from_every_kind_of_source(tmp_path):
    frame = _log()
    reference = gm.build_tasks(frame, **KEYS)
    assert len(reference.train) + len(reference.test) == 40
    assert {f.name: f.multi_hot for f in reference.fields} == {"age": False, "item": False, "tags": True}
    frame.to_csv(tmp_path / "log.csv", index=False)
    frame.to_parquet(tmp_path / "log.parquet")
    listed = frame.assign(tags=[t.split("|") for t in frame["tags"]])  # list cells, as Parquet holds them
    import datasets

    for source in (tmp_path / "log.csv", str(tmp_path / "log.parquet"), pa.Table.from_pandas(frame),
                   {c: frame[c].to_numpy() for c in frame}, datasets.Dataset.from_pandas(frame), listed):
        _same(reference, gm.build_tasks(source, **KEYS, cache_dir=str(tmp_path / "cache")))


def test_build_tasks_errors_name_the_problem():
    with pytest.raises(gm.ConfigError, match=r"data.query_size: expected int"):
        gm.build_tasks(_log(), **{**KEYS, "query_size": "four"})
    with pytest.raises(gm.ConfigError, match="data.qery_size: unknown key"):
        gm.build_tasks(_log(), **{**KEYS, "qery_size": 4})
    with pytest.raises(gm.DataError, match="missing column"):
        gm.build_tasks(_log().drop(columns=["age"]), **KEYS)
    with pytest.raises(gm.ConfigError, match="source of type list"):
        gm.build_tasks([1, 2], **KEYS)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.row_fields = ["age", "item"]
        self.body = nn.Linear(3 * 4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, rows):
        return self.head(torch.relu(self.body(rows.flatten(start_dim=-2)))).squeeze(-1)


def test_meta_learner_adapts_what_it_is_told():
    model = Tower()
    learner = gm.meta_learner(model, "fomaml", adapt=[model.body.weight, "head.*", "embedding.item"])
    assert learner.adapted == ["body.weight", "head.weight", "head.bias"]
    assert learner.adapted_fields == {1: "item"}
    assert learner.algorithm.first_order
    with pytest.raises(gm.ConfigError, match="not one of the model's parameters"):
        gm.meta_learner(model, adapt=[nn.Parameter(torch.zeros(1))])
    with pytest.raises(gm.ConfigError, match="algorithm: 'mammal' is not one of maml"):
        gm.meta_learner(model, "mammal", adapt=["head.*"])
    with pytest.raises(gm.ConfigError, match=r"meta.adapt: \['tail.\*'\] matches nothing"):
        gm.meta_learner(model, adapt=["tail.*"])


def test_a_learner_over_own_tables_trains_in_one_process():
    """The single-device path (no DeepSpeed): the model's own EmbeddingCollection, the fused
    lookup through ``row_fields``, a meta-gradient that reaches tables and the body."""
    data = gm.build_tasks(_log(), **KEYS)
    model = Tower()
    model.embedding = gm.EmbeddingCollection(gm.tables_for(data.fields, 4), seed=0)
    learner = gm.meta_learner(model, "maml", inner_steps=2, adapt=["head.*"])
    out = learner(gm.collate(data.train, [0, 1, 2]))
    out.loss.backward()
    assert out.task_query_loss.shape == (3,)
    assert model.body.weight.grad.abs().sum() > 0
    assert model.embedding.weights["tags"].grad.abs().sum() > 0


def test_raw_item_ids_get_dynamic_tables_and_look_up_by_their_hashed_value():
    data = gm.build_tasks(_log(), **KEYS, raw_ids=["item"])
    item = next(f for f in data.fields if f.name == "item")
    assert item.raw and not next(f for f in data.fields if f.name == "age").raw
    with pytest.raises(gm.ConfigError, match="'item' hold raw ids.*pass capacity="):
        gm.tables_for(data.fields, 4)
    tables = gm.tables_for(data.fields, 4, capacity=64)
    assert {t.name: t.kind for t in tables} == {"age": "static", "item": "dynamic", "tags": "static"}
    emb = gm.ShardedEmbeddingCollection(gm.plan_tables(tables, 1, {}), 0)
    batch = gm.collate(data.train, [0, 1])
    fields = [f.name for f in gm.single_fields(data.fields)]
    column = fields.index("item")
    ids = batch.support_ids[..., column][batch.support_mask > 0]
    assert set(ids.tolist()) <= {gm.string_id(f"i{i}") for i in range(30)}
    assert (batch.support_ids[..., column][batch.support_mask == 0] == -(2**63)).all()  # padding
    rows = emb.lookup_fields(batch.support_ids, fields)
    assert rows.shape[:-1] == (*batch.support_ids.shape[:2], len(fields))
    assert emb.dynamic["item"].occupancy == len(set(ids.tolist()))
