"""Nothing of an earlier run is lost (issue 32, item 2): a run refused for any reason leaves the
earlier run's folder byte-identical; a fresh run into a finished run's folder is refused unless
``--overwrite`` (then the earlier outputs go only once every check passed); ``export`` never
writes into the checkpoint it reads. Plus the CLI's exit codes for a non-finite loss and an
unwritable TensorBoard folder. In-process (``cli.main``) where no engine starts, one tiny
trained run shared; a run that starts DeepSpeed's engine is a subprocess (DeepSpeed keeps its
process groups in module globals: a second engine in one process finds the first's)."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from gmeta_ds import checkpoint
from gmeta_ds.cli import main
from gmeta_ds.evaluation import plots
from gmeta_ds.meta_engine import NonFiniteLoss
from gmeta_ds.run import outputs, run_log, trainer

TINY = {"model": {"embed_dim": 4, "hidden": [8]},
        "meta": {"tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
        "data": {"synthetic": {"num_users": 60, "num_items": 40, "max_interactions": 25}},
        "embedding": {"sharding": "sharded", "tables": {"item_id": {"kind": "dynamic", "capacity": 500}}},
        "train": {"meta_steps": 2, "log_every": 1, "progress": False, "checkpoint_every": 2},
        "eval": {"enabled": False},
        "deepspeed": "ds_configs/zero0.json"}
REPO = Path(__file__).resolve().parents[2]


def write_config(folder: Path, out: Path) -> str:
    cfg = {**TINY, "output_dir": str(out), "deepspeed": str(REPO / TINY["deepspeed"])}
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (and the set of its folders)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def train(config: str, *args: str) -> int:
    return main(["train", "--config", config, *[a for o in args for a in (("--set", o) if "=" in o else (o,))]])


def train_apart(config: str, *args: str, spy: bool = False) -> subprocess.CompletedProcess:
    """``gmeta-ds train`` in a subprocess; with ``spy``, it prints which of the earlier run's
    outputs the folder holds right after `trainer.start_run_engine` (every check has passed)."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from gmeta_ds import cli
        from gmeta_ds.run import trainer
        start_engine = trainer.start_run_engine
        def spy(cfg, *args, **kwargs):
            result = start_engine(cfg, *args, **kwargs)
            print("SPY", sorted(p.name for p in Path(cfg.output_dir).iterdir()), flush=True)
            return result
        if {spy!r}:
            trainer.start_run_engine = spy
        sys.exit(cli.main(sys.argv[1:]))""")
    argv = ["train", "--config", config, *[a for o in args for a in (("--set", o) if "=" in o else (o,))]]
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished run (2 meta-steps, a checkpoint, model, summary, metrics, TensorBoard)."""
    root = tmp_path_factory.mktemp("finished")
    train_apart(write_config(root, root / "run"))
    held = outputs.earlier_outputs(root / "run")
    assert held == ["summary.json", "model.safetensors", "metrics.jsonl", "tensorboard/", "checkpoints/"]
    return root / "run"


@pytest.fixture()
def run_dir(finished, tmp_path) -> tuple[Path, str]:
    """A copy of the finished run and a config that writes into it."""
    out = tmp_path / "run"
    shutil.copytree(finished, out, symlinks=True)
    return out, write_config(tmp_path, out)


def test_fresh_run_into_a_finished_run_is_refused_by_train_and_validate(run_dir, capsys):
    out, config = run_dir
    before = hashes(out)
    for command in ("train", "validate"):
        assert main([command, "--config", config]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"gmeta-ds {command}: ")
        assert f"output_dir: {str(out)!r} holds an earlier run's outputs (summary.json, " \
               "model.safetensors, metrics.jsonl, tensorboard/, checkpoints/)" in err
        assert "nothing was changed" in err and "--overwrite (train.overwrite=true)" in err
        assert "--set train.resume=auto to continue it from its last checkpoint" in err
        assert "another output_dir" in err and "Traceback" not in err
        assert hashes(out) == before
    assert main(["validate", "--config", config, "--overwrite"]) == 0
    assert "will be removed once every check has passed" in capsys.readouterr().out
    assert hashes(out) == before


def test_a_folder_without_outputs_is_not_refused(tmp_path):
    (tmp_path / "checkpoints").mkdir()  # empty: nothing of a run
    (tmp_path / "notes.txt").write_text("mine")
    assert outputs.earlier_outputs(tmp_path) == []


@pytest.mark.parametrize("change, message", [
    (["model.embed_dim=6"], "tables: checkpoint has"),
    (["meta.algorithm=fomaml"], "algorithm: checkpoint has 'maml'"),
    (["embedding.tables={}"], "the checkpoint holds a dynamic table, the config builds a static one"),
    ("tamper", "contents differ from the manifest's SHA-256"),
])
def test_a_refused_resume_leaves_the_run_byte_identical(run_dir, capsys, change, message):
    """The checks of a resume run after the process group and the build; before the fix the
    earlier summary.json and model.safetensors were removed before them."""
    out, config = run_dir
    if change == "tamper":
        dense = out / "checkpoints" / "step_00000002" / "dense.safetensors"
        dense.write_bytes(dense.read_bytes()[:-1] + b"\0")
        change = []
    before = hashes(out)
    assert train(config, "train.resume=auto", "train.meta_steps=4", *change) == 2
    assert message in capsys.readouterr().err
    assert hashes(out) == before


@pytest.mark.parametrize("name", ["planted.bin", "rank00000.safetensors"])
def test_a_huge_file_listed_in_a_real_checkpoints_manifest_is_refused_unread(run_dir, capsys, name):
    """A 300 GB (sparse) file planted in the checkpoint, or in place of its rank file, and
    listed in the manifest with its true size (the hash cannot match): the resume is refused
    naming the file within seconds, before any byte is hashed (it took 225 s to hash), and
    nothing of the run changes. The real checkpoint's files fit the bounds of its model."""
    out, config = run_dir
    ckpt = out / "checkpoints" / "step_00000002"
    manifest = checkpoint.read_manifest(ckpt)  # the real checkpoint passes, hashes and all
    assert manifest["capacities"] == {"item_id": 500}
    planted = ckpt / name
    planted.touch()
    os.truncate(planted, 300 << 30)
    manifest["files"][name], manifest["sizes"][name] = "0" * 64, 300 << 30
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    before = hashes_unread(out)
    start = time.perf_counter()
    assert train(config, "train.resume=auto", "train.meta_steps=4") == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - start < 5
    assert f"{planted}: " in err and "refused unread" in err, err
    assert "Traceback" not in err and hashes_unread(out) == before


def hashes_unread(folder: Path) -> dict:
    """`hashes` of ``folder``, with files over 1 MiB stood for by their size and mtime."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file()
            and p.stat().st_size > 1 << 20 else hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def test_a_requeue_with_another_model_config_is_refused_not_called_complete(run_dir, capsys):
    """A finished run requeued unchanged is complete (exit 0, nothing touched); requeued with
    a changed model, embedding or meta section it was called complete too (silently keeping
    the other model): now refused naming the changed keys."""
    out, config = run_dir
    before = hashes(out)
    assert train(config, "train.resume=auto") == 0
    assert "the run is already complete" in capsys.readouterr().out
    assert train(config, "train.resume=auto", "model.embed_dim=6", "meta.inner_steps=3") == 2
    err = capsys.readouterr().err
    assert "records a finished run of another configuration" in err
    assert "model.embed_dim: 4 -> 6" in err and "meta.inner_steps: 1 -> 3" in err, err
    assert hashes(out) == before


def test_overwrite_removes_the_earlier_run_only_after_every_check(run_dir, tmp_path, capsys):
    out, config = run_dir
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(out / "checkpoints", elsewhere)
    before = hashes(out)
    # A check that fails at engine start (another run's checkpoint of another model): kept.
    assert train(config, "--overwrite", f"train.resume={elsewhere}", "train.meta_steps=4",
                 "model.embed_dim=6") == 2
    assert "the run config does not match the checkpoint" in capsys.readouterr().err
    assert hashes(out) == before

    old_summary = (out / "summary.json").read_bytes()
    proc = train_apart(config, "--overwrite", "seed=5", "train.checkpoint_every=0", "train.tensorboard=false",
                       spy=True)
    # When the last check has passed the earlier run is still whole; then it is removed.
    assert "SPY ['checkpoints', 'metrics.jsonl', 'model.safetensors', 'summary.json', 'tensorboard']" \
        in proc.stdout
    assert "train.overwrite: every check passed; removed the earlier run's summary.json" in proc.stdout
    assert (out / "summary.json").read_bytes() != old_summary
    assert not (out / "checkpoints").exists() and not (out / "tensorboard").exists()


def test_a_resume_keeps_the_earlier_summary_until_it_writes_its_own(run_dir):
    out, config = run_dir
    (out / "eval.json").write_text("{}")  # scored the earlier weights
    (out / "eval_per_user.csv").write_text("task,query_rows,meta_auc\n")  # its per-user rows
    proc = train_apart(config, "train.resume=auto", "train.meta_steps=3", spy=True)
    spied = proc.stdout.split("SPY ", 1)[1].splitlines()[0]
    assert all(name in spied for name in ("'summary.json'", "'model.safetensors'", "'eval.json'"))
    assert json.loads((out / "summary.json").read_text())["meta_steps"] == 3
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert not (out / "eval.json").exists() and not (out / "eval_per_user.csv").exists()


def test_export_never_writes_into_the_checkpoint_it_reads(run_dir, tmp_path, capsys):
    out, _ = run_dir
    root = out / "checkpoints"
    step = root / "step_00000002"
    link = tmp_path / "link"
    link.symlink_to(step)
    before = hashes(out)
    for target in (step / "dense.safetensors", step / "new.safetensors", root / "x.safetensors",
                   link / "dense.safetensors"):
        for source in (root, step):
            assert main(["export", str(source), str(target)]) == 2, target
            err = capsys.readouterr().err
            assert f"OUT {str(target)!r} is inside" in err and "write the export outside it" in err
            assert hashes(out) == before


def test_export_replaces_an_existing_file_only_when_asked_and_atomically(run_dir, tmp_path, capsys,
                                                                         monkeypatch):
    out, _ = run_dir
    target = tmp_path / "exported.safetensors"
    target.write_bytes(b"an earlier export")
    earlier = target.read_bytes()
    assert main(["export", str(out / "checkpoints"), str(target)]) == 2
    assert f"OUT {str(target)!r} exists; pass --overwrite" in capsys.readouterr().err
    assert target.read_bytes() == earlier

    import safetensors.torch

    def full_disk(state, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", path)
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    assert main(["export", str(out / "checkpoints"), str(target), "--overwrite"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert target.read_bytes() == earlier
    monkeypatch.undo()
    assert main(["export", str(out / "checkpoints"), str(target), "--overwrite"]) == 0
    assert target.read_bytes() != earlier


def test_nonfinite_loss_exits_5_with_its_message(tmp_path, monkeypatch, capsys):
    def diverged(*args, **kwargs):
        raise NonFiniteLoss("meta-step 3: non-finite outer loss on rank 0 (tasks [1, 2])")
    monkeypatch.setattr(trainer, "train", diverged)
    assert train(write_config(tmp_path, tmp_path / "run")) == 5
    err = capsys.readouterr().err
    assert "gmeta-ds train: meta-step 3: non-finite outer loss on rank 0 (tasks [1, 2])" in err
    assert "Traceback" not in err


def test_tensorboard_that_cannot_start_names_its_folder(tmp_path, monkeypatch, capsys):
    import torch.utils.tensorboard

    class FullDisk:
        def __init__(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")  # as TensorBoard's writer thread
    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", FullDisk)
    with pytest.raises(OSError) as info:
        run_log.MetricsLog(tmp_path, True, tensorboard=True)
    assert info.value.filename == str(tmp_path / "tensorboard") and info.value.errno == errno.ENOSPC
    assert not list((tmp_path / "tensorboard").iterdir())  # the probe is gone

    def start_tensorboard(*args, **kwargs):
        run_log.MetricsLog(tmp_path, True, tensorboard=True)
    monkeypatch.setattr(trainer, "train", start_tensorboard)
    assert train(write_config(tmp_path, tmp_path / "run")) == 4
    err = capsys.readouterr().err
    assert f"could not access {tmp_path / 'tensorboard'}: No space left on device" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("planted", ["checkpoints/my_notes.txt", "checkpoints/best_model",
                                     "tensorboard/my_plots.png", "plots/my_chart.png", "profile/my_trace.json"])
def test_overwrite_refuses_a_folder_holding_what_no_run_wrote(run_dir, planted, capsys):
    """--overwrite removes the earlier run's checkpoints/ and tensorboard/ whole: anything in
    them that gmeta-ds did not write (a user's own folder of that name) is refused, untouched."""
    out, config = run_dir
    path = out / planted
    path.parent.mkdir(exist_ok=True)  # plots/ and profile/ are not in the finished run
    if "." in path.name:
        path.write_text("mine")
    else:
        path.mkdir()
        (path / "weights.bin").write_bytes(b"\0" * 8)
    before = hashes(out)
    for command in ("validate", "train"):
        assert main([command, "--config", config, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert f"--overwrite replaces only what a gmeta-ds run wrote, and these are not: {planted}" in err
        assert "nothing was changed" in err and "Traceback" not in err
        assert hashes(out) == before


def test_overwrite_takes_what_deepspeed_writes_beside_checkpoints(run_dir, capsys):
    """DeepSpeed copies its recovery scripts beside ZeRO checkpoints: they are the run's, not
    foreign (a ZeRO-2 run's folder is replaced by --overwrite)."""
    out, config = run_dir
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        (out / "checkpoints" / script).write_text("# DeepSpeed's\n")
    assert main(["validate", "--config", config, "--overwrite"]) == 0
    assert "will be removed once every check has passed" in capsys.readouterr().out


def _report_plots_profile(out: Path) -> list[str]:
    """What `gmeta-ds report`, `gmeta-ds plot` and train.profile_steps/profile_trace leave in a
    run's folder, planted: the names `earlier_outputs` gives them."""
    (out / "report.html").write_text("<html>the earlier run's report</html>")
    (out / "plots").mkdir()
    for name in ("loss.png", "coldstart.png"):
        (out / "plots" / name).write_bytes(b"\x89PNG")
    (out / "profile.json").write_text("{}")
    (out / "profile").mkdir()
    (out / "profile" / "trace_rank0.json").write_text("{}")
    return ["report.html", "plots/", "profile.json", "profile/"]


def test_overwrite_removes_the_earlier_runs_report_plots_and_profile_after_every_check(run_dir, capsys):
    """fixes2 item 3: `train --overwrite` left the earlier run's report.html, plots/, profile.json
    and profile/ (not in EARLIER_OUTPUTS), so the new run's folder showed the old run's report,
    charts and profile. They are a run's outputs: a fresh run is refused while they are there,
    and --overwrite lists them and removes them with the rest, once every check has passed."""
    out, config = run_dir
    planted = _report_plots_profile(out)
    assert outputs.earlier_outputs(out)[-4:] == planted
    before = hashes(out)
    assert main(["validate", "--config", config]) == 2
    assert "report.html, plots/, profile.json, profile/)" in capsys.readouterr().err
    assert main(["validate", "--config", config, "--overwrite"]) == 0  # theirs, not foreign
    assert hashes(out) == before
    cfg = SimpleNamespace(output_dir=str(out), train=SimpleNamespace(resume=None, overwrite=True))
    held = outputs.check_earlier_run(cfg)
    assert held[-4:] == planted
    outputs.remove_earlier_outputs(out, held)
    assert sorted(p.name for p in out.iterdir()) == []


def test_only_what_a_run_writes_in_plots_and_profile_is_ours():
    assert all(outputs._ours_inside("plots", name) for name in plots.PLOT_FILES)
    assert outputs._ours_inside("profile", "trace_rank0.json") and outputs._ours_inside("profile", "trace_rank12.json")
    assert not outputs._ours_inside("profile", "trace_rank.json") and not outputs._ours_inside("plots", "mine.png")
    # every chart plot_run saves is named in PLOT_FILES
    saved = re.findall(r'save\([^\n]*"(\w+\.png)"\)', Path(plots.__file__).read_text())
    assert saved and set(saved) <= set(plots.PLOT_FILES)
