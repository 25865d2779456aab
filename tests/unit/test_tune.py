"""gmeta-ds tune: real trials (each a `gmeta-ds train` subprocess) scored on validation users
only, a study that continues in its SQLite file, and bad inputs refused before any trial."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from gmeta_ds.cli import main
from gmeta_ds.config import load_config, parse_override

optuna = pytest.importorskip("optuna", reason="the tune extra: pip install 'gmeta-ds[tune]'")

TINY = {"model": {"embed_dim": 4, "hidden": [8]},
        "meta": {"tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
        "data": {"synthetic": {"num_users": 60, "num_items": 40, "max_interactions": 25}, "valid_fraction": 0.2},
        "train": {"meta_steps": 3, "progress": False},
        "eval": {"baseline_epochs": 1, "tasks_per_batch": 8},
        "deepspeed": "ds_configs/zero1.json"}
SPACE = {"meta.inner_lr": {"low": 0.03, "high": 1.0, "log": True}, "meta.inner_steps": {"choices": [1, 2]}}


def write(folder: Path, name: str, data: dict) -> str:
    path = folder / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def tune(config: str, space: str, trials: int, *extra: str) -> int:
    return main(["tune", "--config", config, "--space", space, "--trials", str(trials), *extra])


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    """Two trials of the tiny config: (config, space, output_dir)."""
    folder = tmp_path_factory.mktemp("tune")
    config = write(folder, "c.yaml", {"output_dir": str(folder / "out"), **TINY})
    space = write(folder, "space.yaml", SPACE)
    assert tune(config, space, 2) == 0
    return config, space, folder / "out"


def test_trials_are_scored_on_the_validation_users_only(search):
    config, _, out = search
    result = json.loads((out / "tune.json").read_text())
    assert [t["state"] for t in result["trials"]] == ["COMPLETE", "COMPLETE"]
    assert result["objective"] == "eval.auc_per_task" and result["direction"] == "maximize"
    cfg = load_config(config)
    valid_users = _validation_users(cfg)
    for trial in result["trials"]:
        summary = json.loads((Path(trial["output_dir"]) / "summary.json").read_text())
        ev = summary["eval"]
        assert trial["value"] == ev["auc_per_task"]
        assert ev["split"] == "valid" and summary["config"]["eval"]["split"] == "valid"
        assert ev["tasks"] == valid_users  # the validation users, never the 12 test users
        assert not any(k.startswith("baseline") for k in ev)  # only the meta-learned model is scored
        for key, value in trial["params"].items():  # the trial trained with its own values
            section, name = key.split(".")
            assert summary["config"][section][name] == value
        assert trial["output_dir"] == str(out / "tune" / f"trial-{trial['number']}")
    best = max(result["trials"], key=lambda t: t["value"])
    assert result["best"]["number"] == best["number"] and result["best"]["value"] == best["value"]
    pieces = shlex.split(result["best"]["set"])  # one copy-pasteable line of --set overrides
    assert pieces[::2] == ["--set"] * len(SPACE)
    assert {".".join(parse_override(p)[0]): parse_override(p)[1] for p in pieces[1::2]} == best["params"]
    assert result["budget"]["trials"] == 2
    assert result["budget"]["seconds"] == pytest.approx(sum(t["seconds"] for t in result["trials"]))


def _validation_users(cfg) -> int:
    from gmeta_ds.data.synthetic import generate_synthetic, split_valid

    data = split_valid(generate_synthetic(cfg.data.synthetic, cfg.seed), cfg.data.valid_fraction, cfg.seed)
    assert 0 < len(data.valid) < len(data.test) + len(data.valid)
    return len(data.valid)


def test_a_rerun_continues_the_study_and_retries_an_interrupted_trial(search, capsys):
    config, space, out = search
    # A search killed mid-trial leaves its trial RUNNING in the study: the next run marks it
    # failed (interrupted, not counted) and runs its values again.
    study = optuna.load_study(study_name="tune", storage=f"sqlite:///{out / 'tune.db'}")
    killed = study.ask({"meta.inner_lr": optuna.distributions.FloatDistribution(0.03, 1.0, log=True),
                        "meta.inner_steps": optuna.distributions.CategoricalDistribution([1, 2])})
    assert tune(config, space, 3) == 0
    result = json.loads((out / "tune.json").read_text())
    states = [(t["number"], t["state"], t.get("interrupted", False)) for t in result["trials"]]
    assert states == [(0, "COMPLETE", False), (1, "COMPLETE", False), (2, "FAIL", True), (3, "COMPLETE", False)]
    retry = result["trials"][3]
    assert retry["retry_of"] == killed.number and retry["params"] == killed.params
    assert sorted(p.name for p in (out / "tune").iterdir() if p.is_dir()) == ["trial-0", "trial-1", "trial-3"]
    assert result["budget"]["trials"] == 3
    assert "trial(s) 2 of an interrupted search: marked failed, run again" in capsys.readouterr().out
    assert tune(config, space, 3) == 0  # already 3 finished: nothing more runs
    assert len(json.loads((out / "tune.json").read_text())["trials"]) == 4
    assert "best: trial " in capsys.readouterr().out


@pytest.mark.parametrize("space, overrides, message", [
    ({"meta.bogus": {"low": 0.1, "high": 1.0}, "meta.inner_lr": {"low": 1.0, "high": 0.1}}, [],
     ["meta.bogus: unknown key; valid keys here:", "meta.inner_lr: low 1.0 must be below high 0.1"]),
    ({"meta.inner_steps": {"choices": []}, "embedding.lr": {"low": 0.0, "high": 0.5, "log": True},
      "eval.split": {"choices": ["test"]}}, [],
     ["meta.inner_steps: choices must be a non-empty list", "embedding.lr: log: true needs low > 0",
      "eval.split: tune fixes it for every trial"]),
    ({"meta.inner_lr": {"low": 0.0, "high": 1.0}}, [],
     ["meta.inner_lr: 0.0 is not a positive number (space value meta.inner_lr=0.0)"]),
    (SPACE, ["data.valid_fraction=0"], ["set data.valid_fraction > 0"]),
])
def test_bad_inputs_exit_2_before_any_trial(tmp_path, capsys, space, overrides, message):
    config = write(tmp_path, "c.yaml", {"output_dir": str(tmp_path / "out"), **TINY})
    args = [a for o in overrides for a in ("--set", o)]
    assert tune(config, write(tmp_path, "space.yaml", space), 2, *args) == 2
    err = capsys.readouterr().err
    for line in message:
        assert line in err, err
    assert "Traceback" not in err and not (tmp_path / "out" / "tune").exists()


def test_another_space_for_the_same_study_is_refused(search, capsys, tmp_path):
    config, _, out = search
    before = len(optuna.load_study(study_name="tune", storage=f"sqlite:///{out / 'tune.db'}").trials)
    other = write(tmp_path, "other.yaml", {"meta.inner_lr": {"low": 0.01, "high": 1.0, "log": True}})
    assert tune(config, other, 5) == 2
    err = capsys.readouterr().err
    assert "--study tune: the study in" in err and "was made with another space" in err
    assert 'meta.inner_lr: {"low": 0.03, "high": 1.0, "log": true} -> {"low": 0.01' in err
    assert len(optuna.load_study(study_name="tune", storage=f"sqlite:///{out / 'tune.db'}").trials) == before


def test_another_cache_or_thread_count_continues_the_study_but_another_setting_is_refused(search, capsys, tmp_path):
    """Where the task store is kept or how many threads run changes no score: the same study
    continues (no trial rerun: it already holds its trials); a setting that changes scores
    (a config key outside the space) is refused, naming it."""
    config, space, out = search
    storage = f"sqlite:///{out / 'tune.db'}"
    before = len(optuna.load_study(study_name="tune", storage=storage).trials)
    finished = sum(t.state.name in ("COMPLETE", "FAIL") and not t.user_attrs.get("interrupted")
                   for t in optuna.load_study(study_name="tune", storage=storage).trials)
    assert tune(config, space, finished, "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "train.threads=1") == 0
    assert len(optuna.load_study(study_name="tune", storage=storage).trials) == before
    capsys.readouterr()
    assert tune(config, space, finished, "--set", "meta.tasks_per_meta_step=4") == 2
    assert "was made with another config (meta.tasks_per_meta_step: 8 -> 4)" in capsys.readouterr().err


def test_a_missing_optuna_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    config = write(tmp_path, "c.yaml", {"output_dir": str(tmp_path / "out"), **TINY})
    assert tune(config, write(tmp_path, "space.yaml", SPACE), 2) == 2
    assert "pip install 'gmeta-ds[tune]'" in capsys.readouterr().err
