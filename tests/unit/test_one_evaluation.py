"""One evaluation for the API and the CLI (gmeta_ds/evaluation/held_out.py): `MetaEngine.evaluate`
and the CLI's `run_evaluation` give the same scores on the same users, the popularity baseline,
the tuned fine-tune and both curves included; an API run's folder (``evaluate(..., out=DIR)``)
holds the summary.json and per_user.csv a CLI run writes, and ``gmeta-ds report`` draws the same
sections for both. In-process, tiny synthetic data, no process group (a few seconds)."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from gmeta_ds.config import config_from_dict
from gmeta_ds.errors import ConfigError
from gmeta_ds.meta_engine import MetaEngine
from gmeta_ds.workloads.ctr import build_data, build_learner, run_evaluation

pytestmark = pytest.mark.filterwarnings("ignore::gmeta_ds.evaluation.scores.MetricWarning")

TINY = {"data": {"synthetic": {"num_users": 60, "num_items": 30, "max_interactions": 30}, "valid_fraction": 0.2},
        "model": {"embed_dim": 4, "hidden": [8]},
        "meta": {"tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
        "train": {"meta_steps": 1, "progress": False},
        "eval": {"baseline_epochs": 1, "bootstrap_resamples": 20, "few_shot": [1, 3], "steps_curve": [0, 2],
                 "tasks_per_batch": 8}}


def _api_engine(cfg, data) -> MetaEngine:
    """An API engine over the CLI's untrained learner, without DeepSpeed or a process group,
    keeping the initial weights the CLI's non-meta baseline starts from."""
    plan = SimpleNamespace(world_size=1, tasks_per_micro_batch=4, grad_accum_steps=2, tasks_per_meta_step=8)
    initial = build_learner(cfg, data.fields, train=data.train).state_dict()
    engine = SimpleNamespace(module=build_learner(cfg, data.fields))
    return MetaEngine(engine, None, [], plan, {}, 0, cfg.seed, initial=initial)


def _api_evaluate(cfg, data, engine: MetaEngine, **kwargs) -> dict:
    """`MetaEngine.evaluate` asked for what the CLI's ``eval`` section asks for."""
    ev = cfg.eval
    if ev.finetune_search:
        kwargs.update(finetune_search=True, valid=data.valid)
    return engine.evaluate(data.test, tasks_per_batch=ev.tasks_per_batch, baselines=["non_meta", "popularity"],
                           train=data.train, baseline_epochs=ev.baseline_epochs, baseline_lr=ev.baseline_lr,
                           baseline_batch_size=ev.baseline_batch_size, bootstrap_resamples=ev.bootstrap_resamples,
                           few_shot=ev.few_shot, steps_curve=ev.steps_curve, synthetic=True, **kwargs)


def test_the_api_and_the_cli_score_the_same_users_alike(monkeypatch):
    import functools

    from gmeta_ds.evaluation import held_out

    # the fine-tune search on a 2 x 2 grid (its 20 points are most of the cost); both sides search it
    monkeypatch.setattr(held_out, "finetune_search", functools.partial(held_out.finetune_search, lrs=(0.1, 0.3),
                                                                       steps=(1, 2)))
    cfg = config_from_dict({**TINY, "eval": {**TINY["eval"], "finetune_search": True}})
    data = build_data(cfg)
    cli = run_evaluation(cfg, build_learner(cfg, data.fields), data)
    api = _api_evaluate(cfg, data, _api_engine(cfg, data))
    assert cli.pop("split") == "test"
    assert api == cli  # every key and number: scores, baselines, intervals, tuned fine-tune, both curves
    assert len(api["baseline_finetune_grid"]) == 4
    for key in ("baseline_popularity_auc", "baseline_finetune_tuned_auc_per_task", "few_shot", "inner_steps_curve",
                "baseline_finetune_grid"):
        assert key in api, key
    assert set(api["intervals"]["differences"]) == {"baseline", "baseline_finetune", "baseline_finetune_tuned",
                                                    "baseline_popularity"}


def _headings(page: str) -> list[str]:
    return re.findall(r"<h2>(.*?)</h2>", page)


def test_an_api_run_folder_reports_the_sections_of_a_cli_run(tmp_path):
    from gmeta_ds.cli import main
    from gmeta_ds.evaluation.report import write_report

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "cli"), **TINY}))
    assert main(["train", "--config", str(cfg_file)]) == 0
    cfg = config_from_dict(TINY)
    data = build_data(cfg)
    engine = _api_engine(cfg, data)
    result = _api_evaluate(cfg, data, engine, out=tmp_path / "api")
    summary = json.loads((tmp_path / "api" / "summary.json").read_text())
    assert summary["eval"] == json.loads(json.dumps(result))
    cli_summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    for key in ("world_size", "meta_steps", "tasks_seen", "final_query_loss", "dense_checksum",
                "embedding_checksum", "eval", "elapsed_s", "config"):  # the summary contract
        assert key in summary and key in cli_summary, key
    cli_rows = (tmp_path / "cli" / "per_user.csv").read_text().splitlines()
    api_rows = (tmp_path / "api" / "per_user.csv").read_text().splitlines()
    assert api_rows[0] == cli_rows[0] and len(api_rows) == len(cli_rows) == len(data.test) + 1
    cli_page = write_report(tmp_path / "cli").read_text()
    api_page = write_report(tmp_path / "api").read_text()
    assert _headings(api_page) == _headings(cli_page)
    assert "Per-user AUC distribution" in _headings(api_page) and "Few-shot curve" in _headings(api_page)


def test_an_api_run_folder_is_written_only_where_nothing_foreign_lies(tmp_path):
    cfg = config_from_dict({**TINY, "eval": {"few_shot": [], "steps_curve": [], "bootstrap_resamples": 0}})
    data = build_data(cfg)
    engine = _api_engine(cfg, data)
    out = tmp_path / "run"
    engine.evaluate(data.test, out=out)
    first = (out / "summary.json").read_text()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"out: .*run holds files a gmeta-ds run does not write \(notes.txt\)"):
        engine.evaluate(data.test, inner_steps=0, out=out)
    assert (out / "summary.json").read_text() == first and (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    again = engine.evaluate(data.test, inner_steps=0, out=out)  # an earlier run of ours is replaced
    assert json.loads((out / "summary.json").read_text())["eval"]["auc"] == again["auc"]
    assert sorted(p.name for p in out.iterdir()) == ["per_user.csv", "summary.json"]  # no temporary file left
    with pytest.raises(ConfigError, match=r"out: .* is a file"):
        engine.evaluate(data.test, out=out / "summary.json")


def test_an_api_run_without_held_out_users_leaves_no_earlier_per_user_csv(tmp_path):
    """per_user.csv of an earlier evaluation stayed beside the summary.json of one without
    held-out users: `gmeta-ds report` then drew the earlier run's users as this run's."""
    cfg = config_from_dict({**TINY, "eval": {"few_shot": [], "steps_curve": [], "bootstrap_resamples": 0}})
    data = build_data(cfg)
    engine = _api_engine(cfg, data)
    out = tmp_path / "run"
    engine.evaluate(data.test, out=out)
    assert (out / "per_user.csv").is_file()
    empty = engine.evaluate(data.test.subset(np.arange(0)), out=out)
    assert json.loads((out / "summary.json").read_text())["eval"] == empty and empty["tasks"] == 0
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_the_apis_opt_in_evaluation_arguments_are_checked_naming_them():
    cfg = config_from_dict(TINY)
    data = build_data(cfg)
    engine = _api_engine(cfg, data)
    with pytest.raises(ConfigError) as caught:
        engine.evaluate(data.test, few_shot=[0, 2], steps_curve="0,1", finetune_search=True, states={"warm": 1},
                        synthetic="yes", out=3)
    message = str(caught.value)
    for words in ("few_shot: 0 is not an integer >= 1", "steps_curve: '0,1' is not a list of integers >= 0",
                  "finetune_search: tunes the non-meta baseline's fine-tuning: add 'non_meta' to baselines",
                  "valid: finetune_search chooses the fine-tuning's lr and steps on validation users",
                  "states: expected None or a dict of state name -> gm.TaskSet", "synthetic: 'yes' is not True or False",
                  "out: 3 is not None or a folder path"):
        assert words in message, words
