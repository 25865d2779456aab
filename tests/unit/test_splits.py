"""``gmeta-ds eval --splits K`` (gmeta_ds/splits.py): K trained and evaluated user splits, the
mean differences with intervals over splits and users, and a finished split reused."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gmeta_ds.cli import main
from gmeta_ds.config import load_config
from gmeta_ds.intervals import split_interval
from gmeta_ds.splits import finished_summary, split_configs
from test_cli import REPO, TINY, write

SPLIT_TINY = {**TINY, "eval": {**TINY["eval"], "few_shot": [2], "bootstrap_resamples": 200}}


def test_two_splits_train_evaluate_and_combine_then_a_rerun_reuses_them(tmp_path):
    config = write(tmp_path, SPLIT_TINY)
    cmd = [sys.executable, "-m", "gmeta_ds.cli", "eval", "--config", config, "--splits", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    result = json.loads((out / "splits.json").read_text())
    assert [s["seed"] for s in result["splits"]] == [0, 1] and result["held_out_fraction"] == 0.0
    summaries = [json.loads((out / "splits" / f"seed-{s}" / "summary.json").read_text()) for s in (0, 1)]
    for split, summary in zip(result["splits"], summaries):
        assert summary["config"]["seed"] == split["seed"] and split["scores"]["auc"] == summary["eval"]["auc"]
        assert split["differences"] == summary["eval"]["intervals"]["differences"]
    assert summaries[0]["eval"]["auc"] != summaries[1]["eval"]["auc"]  # other users, other model
    for name in ("baseline", "baseline_finetune", "baseline_popularity"):
        for metric in ("auc", "auc_per_task", "logloss"):
            points = [s["eval"]["intervals"]["differences"][name][metric] for s in summaries]
            assert result["differences"][name][metric] == split_interval(points, 0.0)
            assert result["differences"][name][metric]["diff"] == pytest.approx(
                sum(p["diff"] for p in points) / 2)
    curve = result["few_shot"]
    assert curve["support"] == [2, "all"] and curve["intervals"][-1] == result["differences"]
    assert curve["metrics"]["meta"]["auc"][-1] == pytest.approx(sum(s["eval"]["auc"] for s in summaries) / 2)
    assert "split 1/2 (seed 0, trained):" in proc.stdout and "split 2/2 (seed 1, trained):" in proc.stdout
    assert "meta-learned minus baseline over 2 user splits" in proc.stdout
    assert "  few-shot, 2 support row(s), per-user AUC: non-meta baseline " in proc.stdout
    # A rerun reads the finished splits instead of training them again; another config does not.
    runs = split_configs(load_config(config, []), 2)
    assert [finished_summary(c) for c in runs] == summaries
    assert finished_summary(split_configs(load_config(config, ["eval.baseline_epochs=2"]), 2)[0]) is None


def test_splits_refuse_weights_and_fewer_than_two(tmp_path, capsys):
    config = write(tmp_path, SPLIT_TINY)
    assert main(["eval", "--config", config, "--splits", "2", "--weights", "w.safetensors"]) == 2
    assert "--splits trains a model per split; pass one of them" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--config", config, "--splits", "1"])
    assert "1 must be >= 2" in capsys.readouterr().err
