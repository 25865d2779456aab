"""The serving adaptation core (issue 36): an export saved by engine.save_model, loaded by
gm.load_adapter in this process (no DeepSpeed, no process group), adapts each held-out user on
its support rows given as raw values and scores its query rows as candidates exactly as
evaluation.predict (what engine.evaluate and gmeta-ds eval score) does, for every algorithm;
the cache returns the same scores without adapting again; unknown values are counted."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import gmeta_ds as gm
from gmeta_ds.api import MetaEngine
from gmeta_ds.evaluation.scores import predict
from gmeta_ds.serving import UserRequest
from tests.helpers import click_log
from tests.unit.test_saved_model import Tower, _engine, rewrite_meta

KEYS = dict(task_key="user", item_key="item", label="click", user_features=["age"], multi_hot={"tags": "|"},
            threshold=0.5, query_size=5, seed=1)


@pytest.fixture(scope="module")
def data():
    return gm.build_tasks(click_log(users=24), **KEYS)


def _columns(data, tasks, rows: slice) -> dict:
    """Rows of ``tasks`` as raw values (decoded through the vocabularies)."""
    cols = {}
    for j, f in enumerate(gm.single_fields(data.fields)):
        cols[f.name] = [data.vocab[f.name].value(int(r)) for r in tasks.ids[rows, j]]
    values, offsets = tasks.multi["tags"]
    cols["tags"] = [[data.vocab["tags"].value(int(v)) for v in values[offsets[r]:offsets[r + 1]]]
                    for r in range(rows.start, rows.stop)]
    return cols


def requests(data, tasks) -> list[UserRequest]:
    """Each task as one user: its support rows with labels, its query rows as candidates."""
    out = []
    for t in range(len(tasks)):
        s, q = tasks.split(t)
        out.append(UserRequest(_columns(data, tasks, s), tasks.labels[s].tolist(), _columns(data, tasks, q),
                               user_id=f"user-{t}"))
    return out


CASES = [("maml", {"adapt": "head.*"}), ("fomaml", {"adapt": "head.*"}), ("reptile", {"adapt": "head.*"}),
         ("metasgd", {"adapt": ["head.*", "embedding.item"], "inner_lr_scale": {"head.bias": 2.0}})]


@pytest.mark.parametrize("algorithm,options", CASES, ids=[c[0] for c in CASES])
def test_adapted_scores_equal_the_evaluations_for_every_algorithm(data, tmp_path, algorithm, options):
    engine = _engine(Tower(), data, algorithm, **options)
    engine.save_model(tmp_path / "export", data)
    served = gm.load_adapter(tmp_path / "export", Tower())
    learner = engine.learner
    expected = predict(learner, learner.learning_rates(), data.test, 2)
    users = requests(data, data.test)
    got = served.predict(users)
    assert np.allclose(np.concatenate([g.scores for g in got]), expected["adapted"], atol=1e-5, rtol=0)
    assert not any(g.cached for g in got) and served.version == served.export.meta["files"]["model.safetensors"][:12]
    again = served.predict(users[:3])  # the cache: the same scores, no adaptation
    assert all(g.cached for g in again) and all(np.allclose(a.scores, g.scores) for a, g in zip(again, got))
    cold = served.predict([UserRequest({}, [], u.candidates) for u in users[:2]])  # no history yet
    n = sum(len(u.candidates["item"]) for u in users[:2])
    assert np.allclose(np.concatenate([c.scores for c in cold]), expected["plain"][:n], atol=1e-5, rtol=0)


def test_unknown_values_go_to_the_oov_row_and_are_counted(data, tmp_path):
    engine = _engine(Tower(), data, "maml", adapt="head.*")
    engine.save_model(tmp_path / "export", data)
    served = gm.load_adapter(tmp_path / "export", Tower(), cache_size=0)
    user = requests(data, data.test)[0]
    base = served.predict([user])[0]
    user.candidates["item"][0] = "never-seen"
    user.candidates["tags"][0] = ["t-new", "t1"]
    got = served.predict([user])[0]
    assert got.unknown == base.unknown + 2 and not got.cached
    with pytest.raises(gm.serving.encoding.RequestError, match=r"candidates.age: missing"):
        served.predict([UserRequest(user.support, user.labels, {"item": ["i1"], "tags": [[]]})])


def test_serving_imports_no_deepspeed():
    code = ("import sys, gmeta_ds.serving, gmeta_ds.serving.server; "
            "assert 'deepspeed' not in sys.modules, sorted(m for m in sys.modules if 'deepspeed' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


ZOO = ["melu", "dcn_v2", "deepfm", "wide_deep", "dlrm", "two_tower", "melu+popularity"]
POPULARITY = ({"item_popularity": True, "popularity_feature": True},
              {"adapt": ["mlp.*", "popularity.*"], "offset_first": 2.0, "support_level": 3.0})


@pytest.mark.parametrize("name", ZOO)
def test_the_cli_export_rebuilds_the_zoo_model_from_its_recipe(tmp_path, name):
    """gmeta-ds export WEIGHTS OUT --config: every zoo model comes back without passing it, and
    scores the held-out users as gmeta-ds eval's predictions do (its default adapted layers)."""
    import yaml

    from gmeta_ds.cli import main
    from gmeta_ds.config import load_config
    from gmeta_ds.engine.ds_engine import save_weights
    from gmeta_ds.workloads.ctr import build_data, build_learner

    config = tmp_path / "c.yaml"
    name, _, extra = name.partition("+")  # melu+popularity: the offset, offset_first and support_level
    model, meta = POPULARITY if extra else ({}, {})
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "model": {"name": name, "embed_dim": 4,
                                      "hidden": [8], "cross_layers": 1, "tower_hidden": [8, 4], **model},
                                      "meta": {"inner_steps": 2, "inner_lr": 0.3, **meta},
                                      "data": {"synthetic": {"num_users": 30, "num_items": 40, "max_interactions": 25}}}))
    cfg = load_config(config)
    data = build_data(cfg)
    learner = build_learner(cfg, data.fields, train=data.train)  # the popularity counts fitted
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    weights = save_weights(learner.state_dict(), tmp_path / "model.safetensors")
    assert main(["export", str(weights), str(tmp_path / "export"), "--config", str(config)]) == 0
    served = gm.load_adapter(tmp_path / "export")
    assert type(served.learner.net) is type(learner.net) and served.name == name
    expected = predict(learner, learner.learning_rates(), data.test, 2)
    names = [f.name for f in gm.single_fields(data.fields)]
    users = []
    for t in range(len(data.test)):
        s, q = data.test.split(t)
        users.append(UserRequest({n: data.test.ids[s, j].tolist() for j, n in enumerate(names)},
                                 data.test.labels[s].tolist(),
                                 {n: data.test.ids[q, j].tolist() for j, n in enumerate(names)}))
    got = np.concatenate([g.scores for g in served.predict(users)])
    assert np.allclose(got, expected["adapted"], atol=1e-5, rtol=0)


def test_a_dynamic_tables_id_map_serves_its_admitted_rows_and_counts_the_rest(tmp_path):
    """A field of raw ids on a dynamic table: the export keeps the admitted ids with their rows;
    an admitted id reads its row, any other the default row, counted as unknown."""
    data = gm.build_tasks(click_log(users=24), **KEYS, raw_ids=["item"])
    tables = gm.tables_for(data.fields, 4, capacity=64)
    learner = gm.meta_learner(Tower(), "maml", inner_steps=2, inner_lr=0.2, adapt="head.*")
    learner.net.embedding = gm.EmbeddingCollection(tables, seed=0)
    dynamic = learner.net.embedding.dynamic["item"]
    seen = torch.unique(torch.as_tensor(data.train.ids[:, 1], dtype=torch.long))
    dynamic.ids = seen[::2].clone()  # half the training items admitted
    dynamic.rows = nn.Parameter(torch.randn(len(dynamic.ids), 4))
    plan = SimpleNamespace(world_size=1, tasks_per_micro_batch=2, grad_accum_steps=1)
    MetaEngine(SimpleNamespace(module=learner), None, [], plan, {}, 0, 0).save_model(tmp_path / "export", data)
    served = gm.load_adapter(tmp_path / "export", Tower())
    expected = predict(learner, learner.learning_rates(), data.test, 2)
    users = []
    for t in range(len(data.test)):
        s, q = data.test.split(t)
        cols = [_columns_raw(data, data.test, part) for part in (s, q)]
        users.append(UserRequest(cols[0], data.test.labels[s].tolist(), cols[1]))
    got = served.predict(users)
    assert np.allclose(np.concatenate([g.scores for g in got]), expected["adapted"], atol=1e-5, rtol=0)
    items = np.asarray(data.test.ids[:, 1])
    assert sum(g.unknown for g in got) == int((~np.isin(items, dynamic.ids.numpy())).sum())
    loaded = gm.load_model(tmp_path / "export", Tower())  # the same folder through the API's loader
    back = loaded.model.embedding.dynamic["item"]
    assert torch.equal(back.ids, dynamic.ids) and torch.equal(back.rows, dynamic.rows)


def _columns_raw(data, tasks, rows: slice) -> dict:
    """`_columns`, with a raw field's ids given as they are (their value is the id)."""
    cols = {}
    for j, f in enumerate(gm.single_fields(data.fields)):
        ids = [int(r) for r in tasks.ids[rows, j]]
        cols[f.name] = ids if f.raw else [data.vocab[f.name].value(r) for r in ids]
    values, offsets = tasks.multi["tags"]
    cols["tags"] = [[data.vocab["tags"].value(int(v)) for v in values[offsets[r]:offsets[r + 1]]]
                    for r in range(rows.start, rows.stop)]
    return cols


def test_a_malformed_export_refuses_to_load_naming_the_file(data, tmp_path, capsys):
    import json

    from gmeta_ds.cli import main

    folder = _engine(Tower(), data, "maml", adapt="head.*").save_model(tmp_path / "export", data)
    meta = json.loads((folder / "model.json").read_text())
    rewrite_meta(folder, {**meta, "serving": None})
    with pytest.raises(gm.ConfigError, match=r"model.json: 'serving' is None"):
        gm.load_adapter(folder, Tower())
    rewrite_meta(folder, meta)
    weights = folder / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    with pytest.raises(gm.ConfigError, match=r"model.safetensors: its SHA-256 does not match"):
        gm.load_adapter(folder, Tower())
    assert main(["serve", str(folder), "--port", "0"]) == 2
    assert "model.safetensors: its SHA-256 does not match" in capsys.readouterr().err
    with pytest.raises(gm.ConfigError, match=r"holds no recipe .*gm.load_adapter\(path, model\)"):
        gm.load_adapter(_engine(Tower(), data, "maml", adapt="head.*").save_model(tmp_path / "again", data))


def test_one_request_that_cannot_be_encoded_fails_alone(data, tmp_path):
    """Issue 49: a batch holding poisoned requests (a field given as a number where rows are
    expected, a field missing, an id past int64) scores every valid user exactly as alone; each
    poisoned user gets its own `RequestError` (the server's 400), whatever it raised inside."""
    from gmeta_ds.serving.batching import predict_batch
    from gmeta_ds.serving.encoding import RequestError

    engine = _engine(Tower(), data, "maml", adapt="head.*")
    engine.save_model(tmp_path / "export", data)
    served = gm.load_adapter(tmp_path / "export", Tower())
    users = requests(data, data.test)[:4]
    alone = predict_batch(served, users, lambda *a: None)
    poisoned = [UserRequest({**users[0].support, "item": 7}, users[0].labels, users[0].candidates, user_id="p1"),
                UserRequest(users[1].support, users[1].labels, {"item": [10**30] * 2}, user_id="p2"),
                UserRequest(users[2].support, [float("inf")] * len(users[2].labels), users[2].candidates, user_id="p3")]
    batch = [poisoned[0], users[0], poisoned[1], users[1], users[2], poisoned[2], users[3]]
    mixed = predict_batch(served, batch, lambda *a: None)
    for got, want in zip([mixed[i] for i in (1, 3, 4, 6)], alone):
        assert not isinstance(got, Exception) and np.array_equal(got.scores, want.scores)
    for i in (0, 2):
        assert isinstance(mixed[i], RequestError), mixed[i]
