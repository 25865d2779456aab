"""The CLI contract: validate's dry run, documented errors, --local_rank, train -> eval."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gmeta_ds.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = {"model": {"embed_dim": 4, "hidden": [8]},
        "meta": {"tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
        "data": {"synthetic": {"num_users": 60, "num_items": 40, "max_interactions": 25}},
        "train": {"meta_steps": 3, "progress": False},
        "eval": {"baseline_epochs": 1, "tasks_per_batch": 8},
        "deepspeed": "ds_configs/zero1.json"}


def write(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), **cfg}))
    return str(path)


def test_validate_prints_resolved_plan(tmp_path, capsys):
    assert main(["--local_rank=0", "validate", "--config", write(tmp_path, TINY),
                 "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 tasks/micro-batch x 1 accumulation steps x 2 ranks = 8 tasks/meta-step" in out
    assert '"gradient_accumulation_steps": 1' in out and "config OK" in out
    assert "adapted in the inner loop: mlp.0.weight, mlp.0.bias, mlp.2.weight, mlp.2.bias" in out


@pytest.mark.parametrize("overrides, message", [
    (["meta.algorithm=protonet"], "meta.algorithm: 'protonet' is not one of maml, fomaml, reptile, metasgd"),
    (["meta.bogus=1"], "meta.bogus: unknown key; valid keys here:"),
    (["deepspeed={zero_optimization: {stage: 4}}"], "supported stages: 0, 1, 2, 3"),
    (["meta.tasks_per_meta_step=6"], "must be a multiple of meta.tasks_per_micro_batch (4)"),
    (["meta.adapt=[decoder.*]"], "matches nothing; candidates are: mlp.0.weight"),
    (["train.nonfinite=skip"], "train.nonfinite: 'skip' needs one micro-batch per rank and meta-step"),
    (["train.nonfinite=ignore"], "train.nonfinite: 'ignore' is not one of abort, skip"),
    (["train.keep_last=-1"], "train.keep_last: -1 must be an integer >= 0"),
    (["embedding.sharding=sharded", "embedding.tables.nope.plan=row_wise"], "unknown table(s) ['nope']"),
])
def test_bad_input_exits_2_with_the_documented_message(tmp_path, capsys, overrides, message):
    args = ["validate", "--config", write(tmp_path, TINY)]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_train_then_eval_in_one_plain_process(tmp_path):
    config = write(tmp_path, TINY)
    cmd = [sys.executable, "-m", "gmeta_ds.cli", "train", "--config", config]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    for key in ("world_size", "meta_steps", "tasks_seen", "final_query_loss", "dense_checksum",
                "embedding_checksum", "eval", "elapsed_s"):
        assert key in summary, key
    assert summary["tasks_seen"] == 24 and summary["world_size"] == 1
    for key in ("auc", "logloss", "auc_no_adapt", "baseline_auc", "baseline_finetune_auc", "auc_per_task",
                "baseline_auc_per_task", "baseline_finetune_auc_per_task", "baseline_popularity_auc_per_task"):
        assert 0.0 < summary["eval"][key] < 1.5, key
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3] and records[0]["tasks"] == 24
    _check_intervals(summary["eval"], proc.stdout)
    _check_per_user_auc(summary["eval"], proc.stdout, out / "per_user.csv")
    trained_rows = (out / "per_user.csv").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "gmeta_ds.cli", "eval", "--config", config],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluated = json.loads((out / "eval.json").read_text())
    # eval's per-user rows go beside its eval.json; per_user.csv stays the pair of summary.json's
    # eval (gmeta-ds report drew eval's rows under the training run's numbers)
    assert (out / "per_user.csv").read_bytes() == trained_rows
    _check_per_user_auc(evaluated, proc.stdout, out / "eval_per_user.csv", lines=False)
    assert evaluated["auc"] == pytest.approx(summary["eval"]["auc"], rel=1e-6)
    assert json.loads(proc.stdout)["intervals"] == evaluated["intervals"]
    for metric, d in evaluated["intervals"]["differences"]["baseline_popularity"].items():
        assert d == pytest.approx(summary["eval"]["intervals"]["differences"]["baseline_popularity"][metric],
                                  rel=1e-6), metric


def _check_intervals(ev: dict, printed: str) -> None:
    """summary.json's paired intervals: each baseline's difference per metric with a 95%
    interval over the held-out users, the point difference that of the reported scores, and
    the train report's lines of them."""
    intervals = ev["intervals"]
    assert (intervals["resamples"], intervals["level"], intervals["users"]) == (1000, 0.95, ev["tasks"])
    assert set(intervals["differences"]) == {"baseline", "baseline_finetune", "baseline_popularity"}
    for name, metrics in intervals["differences"].items():
        assert set(metrics) == {"auc", "auc_per_task", "logloss"}
        for metric, d in metrics.items():  # every baseline reports every metric on its own
            assert d["diff"] == pytest.approx(ev[metric] - ev[f"{name}_{metric}"], abs=1e-9), (name, metric)
            assert d["low"] <= d["high"]
    assert (f"meta-learned minus baseline, 95% paired bootstrap interval over {ev['tasks']} held-out users "
            "(1000 resamples):") in printed
    # per-user AUC first (the metric a cold-start user decides on), then the global AUC, then logloss
    for name, label in (("baseline", "non-meta baseline"), ("baseline_finetune", "baseline + fine-tune"),
                        ("baseline_popularity", "popularity + user offset")):
        d = intervals["differences"][name]
        line = (f"  vs {label}: per-user AUC {d['auc_per_task']['diff']:+.4f} [{d['auc_per_task']['low']:+.4f}, "
                f"{d['auc_per_task']['high']:+.4f}] | AUC {d['auc']['diff']:+.4f} [{d['auc']['low']:+.4f}, "
                f"{d['auc']['high']:+.4f}] | logloss {d['logloss']['diff']:+.4f}")
        assert line in printed, line
    # The few-shot curve: every model at 1, 2, 5, 10, 20 support rows per user and all of them.
    curve = ev["few_shot"]
    assert curve["support"] == [1, 2, 5, 10, 20, "all"] and curve["support_rows"][0] == 1.0
    assert set(curve["metrics"]) == {"meta", "baseline", "baseline_finetune", "baseline_popularity"}
    assert curve["metrics"]["meta"]["auc_per_task"][-1] == pytest.approx(ev["auc_per_task"])
    assert curve["metrics"]["baseline_popularity"]["auc"][-1] == pytest.approx(ev["baseline_popularity_auc"])
    assert len(curve["intervals"]) == 6 and curve["intervals"][-1] == intervals["differences"]
    assert "few-shot per-user AUC adapting on the first 1, 2, 5, 10, 20, all support rows of each user:" in printed
    # The inner-steps curve: the meta-learned model and the fine-tuned baseline after 0-10 steps on
    # the full support; 0 steps is the initialisation as is, the configured steps the main numbers.
    steps = ev["inner_steps_curve"]
    assert steps["inner_steps"] == [0, 1, 2, 5, 10] and set(steps["metrics"]) == {"meta", "baseline_finetune"}
    assert steps["metrics"]["meta"]["auc"][0] == pytest.approx(ev["auc_no_adapt"])
    k = steps["inner_steps"].index(1)  # meta.inner_steps of TINY (the default)
    assert steps["metrics"]["meta"]["auc"][k] == pytest.approx(ev["auc"])
    assert steps["metrics"]["baseline_finetune"]["auc"][k] == pytest.approx(ev["baseline_finetune_auc"])
    assert steps["metrics"]["baseline_finetune"]["auc"][0] == pytest.approx(ev["baseline_auc"])
    assert len(steps["intervals"]) == 5 and set(steps["intervals"][0]) == {"baseline_finetune"}
    assert "per-user AUC after 0, 1, 2, 5, 10 inner steps on the full support:" in printed
    assert "\n  meta-learned + adaptation: " in printed


def _check_per_user_auc(ev: dict, printed: str, per_user: Path, lines: bool = True) -> None:
    """Every model's mean per-user AUC is reported (the fine-tuned baseline's too: the mean of
    the per-user AUCs of its fine-tuned predictions in ``per_user``) and, with ``lines``,
    printed on its own line before the global AUC's."""
    with open(per_user, newline="") as f:
        rows = list(csv.DictReader(f))
    for key, column in (("auc_per_task", "meta_auc"), ("auc_per_task_no_adapt", "meta_no_adapt_auc"),
                        ("baseline_auc_per_task", "baseline_auc"),
                        ("baseline_finetune_auc_per_task", "baseline_finetune_auc"),
                        ("baseline_popularity_auc_per_task", "baseline_popularity_auc")):
        mean = sum(float(r[column]) for r in rows if r[column]) / sum(1 for r in rows if r[column])
        assert ev[key] == pytest.approx(mean, abs=1e-5), key
    if not lines:
        return
    per_user_line = (f"cold-start per-user AUC: meta-learned + adaptation {ev['auc_per_task']:.4f} | without adaptation "
                     f"{ev['auc_per_task_no_adapt']:.4f} | non-meta baseline {ev['baseline_auc_per_task']:.4f} | "
                     f"baseline + fine-tune {ev['baseline_finetune_auc_per_task']:.4f} | popularity + user offset "
                     f"{ev['baseline_popularity_auc_per_task']:.4f}\n")
    auc_line = (f"cold-start AUC: meta-learned + adaptation {ev['auc']:.4f} | without adaptation "
                f"{ev['auc_no_adapt']:.4f} | non-meta baseline {ev['baseline_auc']:.4f} | baseline + fine-tune "
                f"{ev['baseline_finetune_auc']:.4f} | popularity + user offset {ev['baseline_popularity_auc']:.4f}\n")
    assert per_user_line + auc_line in printed, printed


def test_eval_without_weights_names_the_missing_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "gmeta_ds.cli", "eval", "--config",
                           write(tmp_path, TINY)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0
    assert "model.safetensors does not exist" in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="fp16 runs where CUDA is")
@pytest.mark.parametrize("command", ["train", "validate"])
def test_fp16_without_a_gpu_is_refused_before_training(tmp_path, capsys, command):
    """train and validate agree: fp16 on a machine without CUDA is refused by both."""
    args = [command, "--config", write(tmp_path, TINY), "--set", "deepspeed=ds_configs/zero2_fp16.json"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "deepspeed.fp16.enabled: fp16 needs a CUDA GPU" in err and "zero2_bf16.json" in err
    assert not (tmp_path / "out" / "summary.json").exists()


def test_export_of_a_run_without_checkpoints_says_how_to_write_them(tmp_path, capsys):
    """A finished run's folder (summary.json, model.safetensors) with no checkpoints/: the
    message names CHECKPOINT, says the run wrote none and how to enable them."""
    run_dir = tmp_path / "demo"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    (run_dir / "model.safetensors").write_bytes(b"")
    for given in (run_dir / "checkpoints", run_dir):
        assert main(["export", str(given), str(tmp_path / "m.safetensors")]) == 2
        err = capsys.readouterr().err
        assert f"CHECKPOINT {str(given)!r}" in err and "train.resume" not in err
        assert (f"the run in {str(run_dir)!r} wrote no checkpoints "
                "(train.checkpoint_every is 0 by default)") in err
        assert "--set train.checkpoint_every=N" in err and "model.safetensors" in err


def test_warmup_steps_are_the_first_meta_steps_and_then_meta_training_runs(tmp_path, monkeypatch):
    """meta.warmup_steps: 2 of 4 meta-steps: every micro-batch of steps 1-2 goes through the
    supervised loss and none after (the engine counts the steps; 2 micro-batches per step)."""
    from gmeta_ds.algorithms.base import MetaAlgorithm

    seen = []
    real = MetaAlgorithm.supervised_loss, MetaAlgorithm.anchored_loss
    monkeypatch.setattr(MetaAlgorithm, "supervised_loss", lambda self, *a: seen.append("warm") or real[0](self, *a))
    monkeypatch.setattr(MetaAlgorithm, "anchored_loss", lambda self, *a: seen.append("meta") or real[1](self, *a))
    cfg = {**TINY, "meta": {**TINY["meta"], "warmup_steps": 2}, "train": {"meta_steps": 4, "progress": False},
           "eval": {"enabled": False}}
    assert main(["train", "--config", write(tmp_path, cfg)]) == 0
    assert seen == ["warm"] * 4 + ["meta"] * 4


def test_serve_without_its_extra_names_the_extra(tmp_path, capsys, monkeypatch):
    """A wheel installed without [serve]: one line naming the extra, exit 2, no traceback."""
    import sys as _sys

    monkeypatch.setitem(_sys.modules, "gmeta_ds.serving.server", None)  # as if orjson were missing
    assert main(["serve", str(tmp_path)]) == 2
    assert "gmeta-ds serve needs the serve extra" in capsys.readouterr().err
