"""engine.save_model / gm.load_model, one documented pair (issue 33): the model, its tables,
the fields, the vocabularies that map raw values to rows and the algorithm come back from one
folder, loaded without running code from it, and a changed or foreign folder is refused
naming the file. In-process (a MetaEngine over a plain learner, no process group); the
sharded, 2-rank save runs in tests/launch/test_api_doc.py (the documented example)."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import gmeta_ds as gm
from gmeta_ds.api import MetaEngine


def _log(users: int = 30) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    rows = []
    for u in range(users):
        for i in rng.choice(25, size=14, replace=False):
            tags = "|".join(f"t{t}" for t in rng.choice(6, size=1 + i % 3, replace=False))
            rows.append((f"u{u}", f"item-{i}", f"a{u % 3}" if u % 7 else None, float(rng.random() < 0.4), tags))
    return pd.DataFrame(rows, columns=["user", "item", "age", "click", "tags"])


KEYS = dict(task_key="user", item_key="item", label="click", user_features=["age"], multi_hot={"tags": "|"},
            threshold=0.5, query_size=4, seed=1)
DIM = 4


class Tower(nn.Module):
    """Three fields (age, item, tags pooled) of d = 4 -> (N,)."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.row_fields = ["age", "item"]
        self.embed_dim = dim  # Meta-SGD's per-dimension rates of adapted rows read it
        self.body = nn.Linear(3 * dim, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, rows):
        return self.head(torch.relu(self.body(rows.flatten(start_dim=-2)))).squeeze(-1)


@pytest.fixture(scope="module")
def data():
    return gm.build_tasks(_log(), **KEYS)


def _engine(model, data, algorithm="maml", **options) -> MetaEngine:
    torch.manual_seed(0)
    model.embedding = gm.EmbeddingCollection(gm.tables_for(data.fields, DIM), seed=0)
    options.setdefault("adapt", None if isinstance(model, gm.FieldModel) else "head.*")
    learner = gm.meta_learner(model, algorithm, inner_steps=2, inner_lr=0.2, **options)
    with torch.no_grad():  # as if trained: away from any initialisation
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    plan = SimpleNamespace(world_size=1, tasks_per_micro_batch=2, grad_accum_steps=1)
    return MetaEngine(SimpleNamespace(module=learner), None, [], plan, {}, 0, 0)


def rewrite_meta(folder, meta: dict) -> None:
    """Write ``meta`` as the folder's model.json with a matching digest: a folder changed by
    someone who can write it (the digest cannot tell), for the checks that hold regardless."""
    import hashlib

    text = json.dumps(meta).encode()
    (folder / "model.json").write_bytes(text)
    (folder / "model.json.sha256").write_text(f"{hashlib.sha256(text).hexdigest()}  model.json\n")


def _raw_rows(data, tasks, n: int = 12) -> dict:
    """The first n rows of ``tasks`` as raw values, decoded through the vocabularies."""
    single = gm.single_fields(data.fields)
    cols = {f.name: [data.vocab[f.name].value(int(r)) for r in tasks.ids[:n, j]] for j, f in enumerate(single)}
    values, offsets = tasks.multi["tags"]
    cols["tags"] = [[data.vocab["tags"].value(int(v)) for v in values[offsets[r]:offsets[r + 1]]]
                    for r in range(n)]
    return cols


def test_a_saved_model_loads_back_with_its_tables_vocabularies_and_algorithm(data, tmp_path):
    engine = _engine(Tower(), data, "metasgd", adapt=["head.*", "embedding.item"], inner_lr_scale={"head.bias": 2.0})
    assert engine.save_model(tmp_path / "m", data) == tmp_path / "m"
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["model.json", "model.json.sha256",
                                                                    "model.safetensors", "vocab.safetensors"]
    saved = gm.load_model(tmp_path / "m", Tower())
    before, after = engine.learner.state_dict(), saved.learner.state_dict()
    assert sorted(before) == sorted(after) and any(k.startswith("inner_lrs.") for k in after)  # Meta-SGD's rates
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert saved.model is saved.learner.net and saved.algorithm["name"] == "metasgd"
    assert saved.learner.adapted_names() == engine.learner.adapted_names()
    assert saved.learner.algorithm.inner_lr_scale == {"head.bias": 2.0} and saved.learner.algorithm.inner_steps == 2
    assert saved.fields == data.fields and saved.vocab == data.vocab
    # Raw values score as the trained model scores their ids; unknown values go to row 0.
    cols = _raw_rows(data, data.train)
    ids, multi = saved.encode(cols)
    assert np.array_equal(ids.numpy(), np.asarray(data.train.ids[:12], dtype=np.int64))
    from gmeta_ds.algorithms.base import embedder

    net = engine.learner.net
    with torch.no_grad():
        expected = net(embedder(net)(ids, multi))
    assert torch.allclose(saved.logits(cols), expected, atol=1e-6)
    cols["item"][0], cols["tags"][0] = "never-seen", ["t-new", "t1"]
    ids, multi = saved.encode(cols)
    assert ids[0, 1] == 0 and multi["tags"].values[0] == 0 and multi["tags"].values[1] == data.vocab["tags"].encode(["t1"])[0]


def test_a_zoo_model_loads_from_a_function_of_the_saved_fields(data, tmp_path):
    engine = _engine(gm.DCNv2(data.fields, embed_dim=DIM, cross_layers=1), data)
    engine.save_model(tmp_path / "zoo", data)
    saved = gm.load_model(tmp_path / "zoo", lambda fields: gm.DCNv2(fields, embed_dim=DIM, cross_layers=1))
    assert isinstance(saved.model, gm.DCNv2)
    before, after = engine.learner.state_dict(), saved.learner.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(gm.ConfigError, match=r"model: DCNv2 is not the architecture saved in .*zoo.*: the model "
                                             r"has weights the folder lacks: .*cross"):
        gm.load_model(tmp_path / "zoo", lambda fields: gm.DCNv2(fields, embed_dim=DIM, cross_layers=2))


def test_a_changed_or_foreign_folder_is_refused_naming_the_file(data, tmp_path):
    engine = _engine(Tower(), data)
    folder = engine.save_model(tmp_path / "m", data)
    with pytest.raises(gm.ConfigError, match=r"model: Tower is not the architecture saved in .*m \(.*Tower\): "
                                             r"net.body.weight: saved \(6, 12\), model \(6, 24\)"):
        gm.load_model(folder, Tower(dim=8))
    weights = folder / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    with pytest.raises(gm.ConfigError, match=r"model.safetensors: its SHA-256 does not match the one model.json "
                                             r"records"):
        gm.load_model(folder, Tower())
    (folder / "vocab.safetensors").unlink()
    (folder / "vocab.safetensors").symlink_to(weights)
    with pytest.raises(gm.ConfigError, match=r"vocab.safetensors: missing, or not a plain file"):
        gm.load_model(folder, Tower())
    meta = json.loads((folder / "model.json").read_text())
    rewrite_meta(folder, {**meta, "version": 99})
    with pytest.raises(gm.ConfigError, match=r"model.json: saved model version 99; this gmeta_ds reads version 1"):
        gm.load_model(folder, Tower())
    with pytest.raises(gm.ConfigError, match=r"path: .*nowhere does not exist, expected the folder "
                                             r"engine.save_model wrote"):
        gm.load_model(tmp_path / "nowhere", Tower())
    with pytest.raises(gm.ConfigError, match=r"model: expected a torch.nn.Module or a function"):
        gm.load_model(engine.save_model(tmp_path / "again", data), "Tower")


def test_save_model_never_replaces_what_is_not_a_saved_model(data, tmp_path):
    engine = _engine(Tower(), data)
    other = tmp_path / "results"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(gm.ConfigError, match=r"path: .*results is a folder that holds other files and no "
                                             r"model.json"):
        engine.save_model(other, data)
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(gm.ConfigError, match=r"data: expected the gm.TaskData the model was trained on"):
        engine.save_model(tmp_path / "m", data.train)
    first = engine.save_model(tmp_path / "m", data)
    with torch.no_grad():
        engine.learner.net.head.bias.add_(1.0)
    engine.save_model(first, data)  # over an earlier saved model: replaced whole
    loaded = gm.load_model(first, Tower())
    assert torch.equal(loaded.model.head.bias, engine.learner.net.head.bias)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "results"]  # no temporary folder left


def test_the_task_store_keeps_the_vocabularies_of_the_in_memory_build(data, tmp_path):
    """A log on disk (the out-of-core build) gives the vocabularies the in-memory build
    gives, verified by checksum at every open."""
    _log().to_parquet(tmp_path / "log.parquet")
    disk = gm.build_tasks(tmp_path / "log.parquet", cache_dir=str(tmp_path / "cache"), **KEYS)
    assert disk.vocab == data.vocab and sorted(disk.vocab) == ["age", "item", "tags"]
    assert data.vocab["age"].encode([None])[0] > 0  # a missing value is a value ("unknown")
    store = next(p for p in (tmp_path / "cache").glob("tasks-*") if p.is_dir())
    manifest = json.loads((store / "manifest.json").read_text())
    path = store / manifest["vocab"]["item"]["data"]["file"]
    blob = bytearray(path.read_bytes())
    blob[0] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(gm.DataError, match=r"vocab.1.data.bin: its content does not match the checksum"):
        gm.build_tasks(tmp_path / "log.parquet", cache_dir=str(tmp_path / "cache"), **KEYS)


def test_the_objective_settings_round_trip_and_an_older_export_without_them_loads(data, tmp_path):
    """meta.rank_weight / init_weight / warmup_steps are saved with the algorithm and read back;
    a model.json written before they existed (no such keys) loads with the values it was
    trained with (0: training-only terms that adapting and scoring never read)."""
    engine = _engine(Tower(), data, rank_weight=0.5, init_weight=0.25, warmup_steps=3)
    engine.save_model(tmp_path / "m", data)
    saved = gm.load_model(tmp_path / "m", Tower())
    algorithm = saved.learner.algorithm
    assert (algorithm.rank_weight, algorithm.init_weight, algorithm.warmup_steps) == (0.5, 0.25, 3)
    meta = json.loads((tmp_path / "m" / "model.json").read_text())
    for key in ("rank_weight", "init_weight", "warmup_steps"):
        del meta["algorithm"][key]
    rewrite_meta(tmp_path / "m", meta)
    older = gm.load_model(tmp_path / "m", Tower()).learner.algorithm
    assert (older.rank_weight, older.init_weight, older.warmup_steps) == (0.0, 0.0, 0)
    del meta["algorithm"]["inner_steps"]  # a key every export has is still required
    rewrite_meta(tmp_path / "m", meta)
    with pytest.raises(gm.ConfigError, match="'algorithm' is"):
        gm.load_model(tmp_path / "m", Tower())


def test_overwrite_replaces_only_a_saved_model_of_ours(data, tmp_path, capsys):
    """Issue 49: a folder is replaced only when it is an earlier saved model (a model.json of
    ours and the files a save writes, nothing else); a model.json of someone else's, or a file
    beside ours, is refused naming it, and nothing is touched (save_model, and gmeta-ds export
    --config ... --overwrite before it builds anything)."""
    from gmeta_ds.cli import main

    engine = _engine(Tower(), data)
    foreign = tmp_path / "theirs"
    foreign.mkdir()
    (foreign / "model.json").write_text('{"format": "someone else", "weights": 1}')
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(gm.ConfigError, match=r"theirs is a folder that holds other files and no model.json of a "
                                             r"saved model \(format 'gmeta_ds model'\)"):
        engine.save_model(foreign, data)
    ours = engine.save_model(tmp_path / "ours", data)
    (ours / "notes.txt").write_text("mine too")
    with pytest.raises(gm.ConfigError, match=r"ours is a saved model with files a save does not write \(notes.txt\)"):
        engine.save_model(ours, data)
    config, weights = tmp_path / "c.yaml", tmp_path / "w.safetensors"
    config.write_text("data: {synthetic: {num_users: 30}}\n")
    weights.write_bytes(b"refused before it is read")
    for folder, why in ((foreign, "is a folder that holds other files and no model.json of a saved model"),
                        (ours, r"is a saved model with files a save does not write \(notes.txt\)")):
        capsys.readouterr()
        assert main(["export", str(weights), str(folder), "--config", str(config), "--overwrite"]) == 2
        assert re.search(rf"OUT: .*{folder.name} {why}", capsys.readouterr().err)
    assert (foreign / "notes.txt").read_text() == "mine" and (ours / "notes.txt").read_text() == "mine too"
    assert sorted(p.name for p in foreign.iterdir()) == ["model.json", "notes.txt"]
    (ours / "notes.txt").unlink()
    assert engine.save_model(ours, data) == ours  # an earlier saved model alone is replaced whole


@pytest.mark.parametrize("where,key,value,message", [
    ("algorithm", "inner_steps", 10**9, r"'algorithm' holds inner_steps 1000000000, expected an integer in \[0, 10000\]"),
    ("algorithm", "inner_steps", True, r"'algorithm' holds inner_steps True, expected an integer"),
    ("algorithm", "inner_lr", float("nan"), r"'algorithm' holds inner_lr nan, expected a finite number"),
    ("algorithm", "inner_lr", "0.1", r"'algorithm' holds inner_lr '0.1', expected a finite number"),
    ("algorithm", "inner_lr", -0.1, r"'algorithm' holds inner_lr -0.1, expected a finite number in \(0, 1e\+12\]"),
    ("algorithm", "inner_lr", 1e300, r"'algorithm' holds inner_lr 1e\+300, expected a finite number in \(0, 1e\+12\]"),
    ("algorithm", "inner_lr_scale", {"head.*": float("inf")},
     r"'algorithm' holds inner_lr_scale \{'head.\*': inf\}, expected null or at most 1024 globs"),
    ("algorithm", "support_level", float("nan"),
     r"'algorithm' holds support_level nan, expected a finite number in \[0, 1e\+12\] or null"),
    ("algorithm", "kind", "ranking", r"'algorithm' holds kind 'ranking', expected one of 'binary', 'regression'"),
    ("algorithm", "rank_weight", -1, r"'algorithm' holds rank_weight -1, expected a finite number in \[0, 1e\+12\]"),
    ("fields", "num_ids", 10**12, r"'fields'\[0\] holds num_ids 1000000000000, expected an integer in \[1, 2147483647\]"),
    ("fields", "raw", 1, r"'fields'\[0\] holds raw 1, expected one of True, False"),
    ("tables", "dim", 10**6, r"'tables'\[0\] holds dim 1000000, expected an integer in \[1, 4096\]"),
    ("tables", "num_rows", -5, r"'tables'\[0\] holds num_rows -5, expected an integer in \[1, 2147483647\]"),
    ("serving", "inner_steps", 10**9, r"'serving' is .*: expected the model's name and its inner_steps \(an integer in \[0, 10000\]"),
])
def test_an_exports_numbers_are_bounded_at_load(data, tmp_path, where, key, value, message):
    """Issue 49: every number of model.json is checked as the run config checks its key (a
    rate finite and in range, a size positive and bounded), even when its digest was rewritten
    with it: a number edited in (1e9 inner steps, a NaN or negative rate, a table of 10**12
    rows) is refused at load naming the file, the key and the range, instead of a request that
    never returns, scores null or an allocation that cannot succeed."""
    engine = _engine(Tower(), data)
    folder = engine.save_model(tmp_path / "m", data)
    meta = json.loads((folder / "model.json").read_text())
    (meta[where][0] if isinstance(meta[where], list) else meta[where])[key] = value
    rewrite_meta(folder, meta)
    with pytest.raises(gm.ConfigError, match=r"model.json: " + message):
        gm.load_adapter(folder, Tower())


def test_a_table_the_weights_do_not_hold_is_refused_naming_it(data, tmp_path):
    """A model.json whose table name the weights do not hold (renamed, digest rewritten) was
    a KeyError traceback ('net.embedding.weights.x') from gm.load_adapter and gmeta-ds serve."""
    folder = _engine(Tower(), data).save_model(tmp_path / "m", data)
    meta = json.loads((folder / "model.json").read_text())
    meta["tables"][0]["name"] = "renamed"
    rewrite_meta(folder, meta)
    with pytest.raises(gm.ConfigError, match=r"model.json: 'tables' names renamed, which model.safetensors "
                                             r"does not hold \(its tables: "):
        gm.load_adapter(folder, Tower())


def test_model_json_is_checked_against_its_digest(data, tmp_path):
    """Issue 49: model.json.sha256 (a sha256sum line) holds model.json's SHA-256: a model.json
    changed after the save is refused naming both files; a digest file that is not one
    sha256sum line is refused naming it; a folder saved before digests existed (none) loads
    with a warning that says how to save it again."""
    import hashlib
    import subprocess

    folder = _engine(Tower(), data).save_model(tmp_path / "m", data)
    text = (folder / "model.json").read_bytes()
    assert (folder / "model.json.sha256").read_text() == f"{hashlib.sha256(text).hexdigest()}  model.json\n"
    assert subprocess.run(["sha256sum", "--check", "--quiet", "model.json.sha256"], cwd=folder, check=False).returncode == 0
    (folder / "model.json").write_bytes(text.replace(b'"inner_steps": 2', b'"inner_steps": 3'))
    with pytest.raises(gm.ConfigError, match=r"model.json: its SHA-256 does not match the one model.json.sha256 "
                                             r"records"):
        gm.load_model(folder, Tower())
    (folder / "model.json").write_bytes(text)
    (folder / "model.json.sha256").write_text("0" * 64 + "  other.json\n")
    with pytest.raises(gm.ConfigError, match=r"model.json.sha256: not one SHA-256 line for model.json"):
        gm.load_adapter(folder, Tower())
    (folder / "model.json.sha256").unlink()
    with pytest.warns(UserWarning, match=r"model.json: no model.json.sha256 beside it .* save it again "
                                         r"\(gmeta-ds export WEIGHTS OUT --config RUN.yaml --overwrite"):
        assert gm.load_model(folder, Tower()).learner.algorithm.inner_steps == 2
