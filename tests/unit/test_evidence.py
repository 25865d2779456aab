"""The evidence commands of issue 39 on one tiny synthetic run over two user splits:
``gmeta-ds eval --splits K`` (gmeta_ds/evaluation/splits.py: K trained and evaluated splits, the mean
differences with intervals over splits and users, a finished split reused) and ``gmeta-ds
report RUN_DIR`` (gmeta_ds/evaluation/report.py: one self-contained HTML page, parsed here, and opened in
headless Chromium when /usr/bin/chromium exists)."""
from __future__ import annotations

import base64
import csv
import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from gmeta_ds.cli import main
from gmeta_ds.config import load_config
from gmeta_ds.evaluation.intervals import split_interval
from gmeta_ds.evaluation.report import write_report
from gmeta_ds.evaluation.splits import finished_summary, split_configs
from test_cli import REPO, TINY, write

SPLIT_TINY = {**TINY, "eval": {**TINY["eval"], "few_shot": [2], "steps_curve": [0, 2],
                                     "bootstrap_resamples": 200}}
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def two_splits(tmp_path_factory):
    """``gmeta-ds eval --splits 2`` of a tiny synthetic run: (config path, its stdout)."""
    tmp = tmp_path_factory.mktemp("splits")
    config = write(tmp, SPLIT_TINY)
    cmd = [sys.executable, "-m", "gmeta_ds.cli", "eval", "--config", config, "--splits", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return config, proc.stdout


def test_two_splits_train_evaluate_and_combine_and_a_rerun_would_reuse_them(two_splits):
    config, stdout = two_splits
    out = Path(config).parent / "out"
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
            assert result["differences"][name][metric]["diff"] == pytest.approx(sum(p["diff"] for p in points) / 2)
    curve = result["few_shot"]
    assert curve["support"] == [2, "all"] and curve["intervals"][-1] == result["differences"]
    assert curve["metrics"]["meta"]["auc"][-1] == pytest.approx(sum(s["eval"]["auc"] for s in summaries) / 2)
    assert "split 1/2 (seed 0, trained):" in stdout and "split 2/2 (seed 1, trained):" in stdout
    assert "meta-learned minus baseline over 2 user splits" in stdout
    assert "  few-shot, 2 support row(s), per-user AUC: non-meta baseline " in stdout
    # A rerun reads the finished splits instead of training them again; another config does not.
    assert [finished_summary(c) for c in split_configs(load_config(config, []), 2)] == summaries
    assert finished_summary(split_configs(load_config(config, ["eval.baseline_epochs=2"]), 2)[0]) is None


def test_splits_refuse_weights_and_fewer_than_two(tmp_path, capsys):
    config = write(tmp_path, SPLIT_TINY)
    assert main(["eval", "--config", config, "--splits", "2", "--weights", "w.safetensors"]) == 2
    assert "--splits trains a model per split; pass one of them" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--config", config, "--splits", "1"])
    assert "1 must be >= 2" in capsys.readouterr().err


class Page(HTMLParser):
    """A report's headings, table header and body cells, paragraphs, image sources and every
    other link."""

    def __init__(self, text: str):
        super().__init__()
        self.headings, self.cells, self.images, self.links, self._tag = [], [], [], [], None
        self.header_cells, self.paragraphs = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self._tag = tag
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        self.links += [v for k, v in attrs.items() if k in ("href", "src") and tag != "img"]
        if tag in ("h1", "h2", "h3", "td", "th", "p"):
            {"td": self.cells, "th": self.header_cells, "p": self.paragraphs}.get(tag, self.headings).append("")

    def handle_data(self, data):
        if self._tag in ("h1", "h2", "h3"):
            self.headings[-1] += data
        elif self._tag in ("td", "span"):
            self.cells[-1] += data
        elif self._tag == "th":
            self.header_cells[-1] += data
        elif self._tag == "p":
            self.paragraphs[-1] += data

    def handle_endtag(self, tag):
        self._tag = None if tag != "span" else "td"


def test_the_report_of_a_run_holds_every_section_its_numbers_and_only_inline_images(two_splits, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(Path(two_splits[0]).parent / "out" / "splits" / "seed-0", run)
    summary = json.loads((run / "summary.json").read_text())
    ev = summary["eval"]
    ev["states"] = {"user_cold": {k: v for k, v in ev.items() if k not in ("few_shot", "inner_steps_curve", "split")}}
    (run / "summary.json").write_text(json.dumps(summary))  # as a four-state run would have it
    page = Page(write_report(run).read_text())
    assert page.headings == ["gmeta-ds report: run", "Run", "Comparison with the baselines", "Tuning budgets", "Cold-start states",
                             "user cold (new users, existing items)", "Few-shot curve", "Inner-steps curve",
                             "Per-user AUC distribution",
                             "Training curves", "Configuration"]
    d = ev["intervals"]["differences"]["baseline_popularity"]["auc"]
    for text in (f"{ev['auc']:.4f}", f"{ev['baseline_popularity_logloss']:.4f}",
                 f"{d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}] undecided",
                 f"{ev['few_shot']['metrics']['baseline_finetune']['auc_per_task'][0]:.4f}"):
        assert text in page.cells, text
    # per-user AUC first, then the global AUC, then logloss: in the comparison table (every model
    # with its per-user AUC, the fine-tuned baseline's too) and in each baseline's verdict row.
    assert page.header_cells[2:6] == ["model", "per-user AUC", "AUC", "logloss"]
    assert page.header_cells[6:10] == ["vs baseline", "per-user AUC", "AUC", "logloss"]
    at = page.cells.index("baseline + fine-tune")
    assert page.cells[at + 1:at + 4] == [f"{ev['baseline_finetune_auc_per_task']:.4f}",
                                         f"{ev['baseline_finetune_auc']:.4f}", f"{ev['baseline_finetune_logloss']:.4f}"]
    at = page.cells.index("baseline + fine-tune", at + 1)
    verdict = page.cells[at + 1:at + 4]
    for cell, metric in zip(verdict, ("auc_per_task", "auc", "logloss")):
        d = ev["intervals"]["differences"]["baseline_finetune"][metric]
        assert cell.startswith(f"{d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}] "), (cell, metric)
        assert d["diff"] == pytest.approx(ev[metric] - ev[f"baseline_finetune_{metric}"], abs=1e-9), metric
    assert any(p.startswith("Meta-learned minus each baseline") and "the verdict: per-user AUC first" in p
               for p in page.paragraphs)
    with open(run / "per_user.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == ev["tasks"] and float(rows[0]["meta_auc"]) >= 0.0
    finetuned = [float(r["baseline_finetune_auc"]) for r in rows if r["baseline_finetune_auc"]]
    assert ev["baseline_finetune_auc_per_task"] == pytest.approx(np.mean(finetuned), abs=1e-5)
    median = np.median([float(r["meta_auc"]) for r in rows if r["meta_auc"]])
    assert f"{median:.4f}" in page.cells
    assert len(page.images) == 5 and not page.links  # cold-start, few-shot, inner steps, per-user, loss
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_of_a_ratings_run_keeps_mae_first(tmp_path):
    """No per-user AUC for ratings: MAE, then RMSE, in the comparison table and the verdicts."""
    d = {"diff": -0.02, "low": -0.03, "high": -0.01}
    ev = {"tasks": 9, "query_rows": 45, "mae": 0.7, "rmse": 0.9, "mae_no_adapt": 0.8, "rmse_no_adapt": 1.0,
          "baseline_finetune_mae": 0.72, "baseline_finetune_rmse": 0.95,
          "intervals": {"level": 0.95, "users": 9, "resamples": 100,
                        "differences": {"baseline_finetune": {"rmse": d, "mae": d}}}}
    (tmp_path / "summary.json").write_text(json.dumps({"task": "ctr", "meta_steps": 1, "eval": ev}))
    page = Page(write_report(tmp_path).read_text())
    assert page.header_cells[2:5] == ["model", "MAE", "RMSE"]
    assert page.header_cells[5:8] == ["vs baseline", "MAE", "RMSE"]
    at = page.cells.index("baseline + fine-tune")
    assert page.cells[at + 1:at + 3] == ["0.7200", "0.9500"]
    assert page.cells[-2] == "-0.0200 [-0.0300, -0.0100] better"


def test_the_report_of_a_splits_run_and_of_a_folder_without_one(two_splits, tmp_path, capsys):
    out = Path(two_splits[0]).parent / "out"
    result = json.loads((out / "splits.json").read_text())
    page = Page(write_report(out, tmp_path / "r.html").read_text())
    assert page.headings == ["gmeta-ds report: out", "User splits (2)", "Few-shot curve over the splits"]
    d = result["differences"]["baseline_finetune"]["logloss"]
    assert f"{d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}] undecided" in page.cells
    assert main(["report", str(tmp_path)]) == 2
    assert "holds neither summary.json nor splits.json" in capsys.readouterr().err


@pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"needs a headless browser: {CHROMIUM} not found "
                    "(Debian: apt-get install chromium)")
def test_the_report_opens_in_headless_chromium(two_splits, tmp_path):
    """The page as a browser draws it, with no network: a screenshot that is not blank."""
    import matplotlib.image

    report = write_report(Path(two_splits[0]).parent / "out" / "splits" / "seed-1", tmp_path / "r.html")
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,2400", f"--screenshot={shot}",
                    report.resolve().as_uri()], capture_output=True, timeout=120, check=True)
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (2400, 1200)
    colours = np.unique(pixels.reshape(-1, pixels.shape[2])[:, :3], axis=0)
    assert len(colours) > 50 and pixels[..., :3].std() > 0.05, (len(colours), pixels.std())


def test_the_report_states_both_sides_tuning_budgets(tmp_path):
    """The fine-tune search's grid and, when gmeta-ds tune's tune.json is in the folder, the
    meta-learned model's trials; without one the page says the configuration's settings ran."""
    ev = {"tasks": 9, "query_rows": 45, "auc": 0.7, "auc_per_task": 0.6, "logloss": 0.6,
          "baseline_finetune_grid": {f"lr={lr},steps={n}": 0.5 for lr in (0.1, 0.3) for n in (1, 2, 5)},
          "baseline_finetune_lr": 0.3, "baseline_finetune_steps": 5}
    (tmp_path / "summary.json").write_text(json.dumps({"task": "ctr", "meta_steps": 1, "eval": ev}))
    text = write_report(tmp_path).read_text()
    assert "<h2>Tuning budgets</h2>" in text
    assert "lr 0.3, 5 steps, the best of 6 settings on the validation users" in text
    assert "no gmeta-ds tune search in this folder" in text
    (tmp_path / "tune.json").write_text(json.dumps({"budget": {"trials": 20, "seconds": 9.0},
                                                    "objective": "eval.auc_per_task", "best": {"value": 0.75}}))
    text = write_report(tmp_path).read_text()
    assert "meta-learned model: gmeta-ds tune, 20 trials on the validation users (best eval.auc_per_task 0.7500)" in text
    for broken in ("{not json", "[1, 2]", '{"budget": 3}'):
        (tmp_path / "tune.json").write_text(broken)
        assert "tune.json is not a gmeta-ds tune result" in write_report(tmp_path).read_text()
