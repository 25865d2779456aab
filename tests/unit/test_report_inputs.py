"""``gmeta-ds report`` on malformed inputs (issue 49, item 7): a summary.json, splits.json or
per_user.csv that is not as gmeta-ds writes it exits 2 with one message naming the file, the
key (or line and column) and what was expected; each case was a traceback (AttributeError,
KeyError, TypeError, ValueError, IndexError, JSONDecodeError, UnicodeDecodeError). A hand-made
run folder, no training; each case well under a second."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from gmeta_ds.cli import main

D = {"diff": 0.01, "low": -0.01, "high": 0.03}
EVAL = {"tasks": 5, "query_rows": 50, "auc": 0.7, "auc_per_task": 0.6, "logloss": 0.6, "baseline_auc": 0.65,
        "intervals": {"level": 0.95, "users": 5, "resamples": 100,
                      "differences": {"baseline": {"auc": D, "auc_per_task": D}}},
        "few_shot": {"support": [1, 2], "metrics": {"meta": {"auc_per_task": [0.6, 0.62]},
                                                    "baseline": {"auc_per_task": [0.5, 0.55]}},
                     "intervals": [{"baseline": {"auc_per_task": D}}, {"baseline": {"auc_per_task": D}}]},
        "states": {"warm": {"tasks": 3, "auc": 0.7, "intervals": {"differences": {"baseline": {"auc": D}}}}}}
SUMMARY = {"task": "ctr", "world_size": 1, "meta_steps": 2, "elapsed_s": 3.0, "eval": EVAL,
           "config": {"model": {"name": "melu"}, "meta": {"algorithm": "maml"}, "seed": 0}}
SPLITS = {"splits": [{"seed": 0, "scores": {"tasks": 5, "auc": 0.7}, "differences": {"baseline": {"auc": D}}}],
          "differences": {"baseline": {"auc": D}}, "level": 0.95, "method": "paired"}
PER_USER = "user,meta_auc,baseline_auc\n1,0.6,0.5\n2,0.7,\n"


def _summary(**change) -> bytes:
    summary = copy.deepcopy(SUMMARY)
    summary.update({k: v for k, v in change.items() if not k.startswith("eval_")})
    summary["eval"].update({k[5:]: v for k, v in change.items() if k.startswith("eval_")})
    return json.dumps(summary).encode()


def _splits(**change) -> bytes:
    return json.dumps({**SPLITS, **change}).encode()


def _run(tmp_path: Path, files: dict[str, bytes]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "query_loss": 0.6, "support_loss": 0.7,
                                                   "tasks_per_s": 9.0}) + "\n")
    files = {"summary.json": _summary(), "per_user.csv": PER_USER.encode(), **files}
    for name, content in files.items():
        (run / name).write_bytes(content)
    return run


# (file -> its content, words of the message after the file's path)
CASES = {
    "summary-config-a-list": ({"summary.json": _summary(config=[1])},
                              "summary.json: key 'config': expected an object (the run config), got [1]"),
    "summary-config-model-a-list": ({"summary.json": _summary(config={"model": [1]})},
                                    "summary.json: key 'config.model': expected an object, got [1]"),
    "summary-elapsed-text": ({"summary.json": _summary(elapsed_s="slow")},
                             "summary.json: key 'elapsed_s': expected a number of seconds, got \"slow\""),
    "summary-intervals-a-list": ({"summary.json": _summary(eval_intervals=[1])},
                                 "summary.json: key 'eval.intervals': expected an object, got [1]"),
    "summary-interval-level-missing": (
        {"summary.json": _summary(eval_intervals={"differences": {"baseline": {"auc": D}}})},
        "summary.json: key 'eval.intervals.level': expected a number (the interval's level"),
    "summary-differences-a-list": (
        {"summary.json": _summary(eval_intervals={"level": 0.95, "differences": [1]})},
        "summary.json: key 'eval.intervals.differences': expected an object {baseline: {metric: interval}}"),
    "summary-difference-without-diff": (
        {"summary.json": _summary(eval_intervals={"level": 0.95, "differences": {"baseline": {"auc": {"low": 0}}}})},
        "summary.json: key 'eval.intervals.differences.baseline.auc': expected an object with diff, low and high"),
    "summary-unknown-metric": (
        {"summary.json": _summary(eval_intervals={"level": 0.95, "differences": {"baseline": {"ndcg": D}}})},
        "summary.json: key 'eval.intervals.differences.baseline.ndcg': expected a metric among auc, auc_per_task"),
    "summary-few-shot-a-list": ({"summary.json": _summary(eval_few_shot=[1])},
                                "summary.json: key 'eval.few_shot': expected an object with support, metrics"),
    "summary-few-shot-without-metrics": ({"summary.json": _summary(eval_few_shot={"support": [1]})},
                                         "summary.json: key 'eval.few_shot.metrics': expected an object"),
    "splits-empty-file": ({"splits.json": b""}, "splits.json: not valid JSON"),
    "splits-a-list": ({"splits.json": b"[1]"},
                      "splits.json: expected a JSON object (splits, differences, level, method), got list"),
    "splits-no-split": ({"splits.json": _splits(splits=[])},
                        "splits.json: key 'splits': expected a non-empty list of objects (one per split), got []"),
    "splits-without-differences": ({"splits.json": _splits(differences=None)},
                                   "splits.json: key 'differences': expected an object"),
    "splits-level-text": ({"splits.json": _splits(level="high")},
                          "splits.json: key 'level': expected a number (e.g. 0.95), got \"high\""),
    "splits-split-without-scores": ({"splits.json": _splits(splits=[{"seed": 0}])},
                                    "splits.json: key 'splits[0].scores': expected an object of metrics, got null"),
    "per-user-text-cell": ({"per_user.csv": b"user,meta_auc\n1,abc\n"},
                           "per_user.csv:2: column 'meta_auc': expected a number or an empty cell, got 'abc'"),
    "per-user-inf-cell": ({"per_user.csv": b"user,meta_auc\n1,inf\n"},
                          "per_user.csv:2: column 'meta_auc': expected a number or an empty cell, got 'inf'"),
    "per-user-short-row": ({"per_user.csv": b"user,meta_auc,baseline_auc\n1,0.5\n"},
                           "per_user.csv:2: column 'baseline_auc': expected a number or an empty cell, got a short row"),
    "per-user-not-utf8": ({"per_user.csv": b"\xff\xfe\x00"}, "per_user.csv: not a CSV table of UTF-8 text"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_malformed_report_input_is_named(tmp_path, capsys, name):
    files, words = CASES[name]
    run = _run(tmp_path, files)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{run}/{words}" in err, err
    assert not (run / "report.html").exists()


def test_well_formed_inputs_still_make_the_report(tmp_path):
    run = _run(tmp_path, {"splits.json": _splits()})
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "User splits (1)" in page and "Per-user AUC distribution" in page and "Few-shot curve" in page
