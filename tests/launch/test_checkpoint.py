"""Checkpoints through the CLI: exact resume, resume at another world size (embedding tables
resharded), export, and refusal of tampered or mismatched checkpoints. Trainings run on warm
ranks of the test pool (tests/pool.py); the killed rank, the rank killed while saving and the
full disk run under the real deepspeed launcher, whose handling of a failed rank they test."""
from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import BIN, REPO, deepspeed_cmd, gmeta_ranks, run, summary, tiny_config, trained_once
from safetensors.torch import load_file

from gmeta_ds import checkpoint
from gmeta_ds.errors import ConfigError

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]

SHARDED = {"sharding": "sharded", "plan": "row_wise",
           "tables": {"gender": {"plan": "replicated"}, "price": {"plan": "table_wise"},
                      "age": {"optimizer": "rowwise_adagrad"}, "region": {"optimizer": "sgd"}}}


def config(tmp_path: Path, stage: int, steps: int, train_extra: dict | None = None, **extra) -> Path:
    return tiny_config(tmp_path, embedding=SHARDED,
                       train={"meta_steps": steps, "log_every": 1, "lr": 0.01, "progress": False,
                              "checkpoint_every": 3, "keep_last": 2, **(train_extra or {})},
                       deepspeed=str(REPO / "ds_configs" / f"zero{stage}.json"), **extra)


def train(path: Path, world: int, *overrides: str) -> dict:
    gmeta_ranks(world, "train", "--config", path, *[a for o in overrides for a in ("--set", o)])
    return summary(path)


def losses(path: Path) -> list[float]:
    out = Path(json.loads(json.dumps(summary(path)["config"]["output_dir"])))
    return [json.loads(line)["query_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """6 meta-steps in one go, per world size and stage."""
    cache = {}

    def get(world: int, stage: int):
        if (world, stage) not in cache:
            path = config(tmp_path_factory.mktemp(f"full{world}{stage}"), stage, 6)
            result = trained_once(path, world)  # a memoised run's files lie in its own output_dir
            out = Path(result["config"]["output_dir"])
            cache[world, stage] = (result, [json.loads(line)["query_loss"]
                                            for line in (out / "metrics.jsonl").read_text().splitlines()])
        return cache[world, stage]
    return get


SLOW = pytest.mark.slow  # the same path as a case kept in the default run; CI runs these too


@pytest.mark.parametrize("world, stage", [(1, 0), pytest.param(2, 1, marks=SLOW), (2, 2),
                                          pytest.param(2, 3, marks=SLOW)])
def test_exact_resume(tmp_path, uninterrupted, world, stage):
    """Stopped after 3 of 6 meta-steps and resumed: the same parameters and the same per-step
    losses as the uninterrupted run."""
    path = config(tmp_path, stage, 3)
    train(path, world)
    resumed = train(path, world, "train.meta_steps=6", "train.resume=auto")
    full, full_losses = uninterrupted(world, stage)
    assert resumed["resumed_from"]["step"] == 3 and resumed["resumed_from"]["optimizer_restored"]
    for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
        assert resumed[key] == pytest.approx(full[key], rel=1e-6), key
    assert losses(path) == pytest.approx(full_losses, rel=1e-6)
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert kept == ["step_00000003", "step_00000006"]


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), pytest.param(2, 3, marks=SLOW)])
def test_resume_at_another_world_size_reshards_tables(tmp_path, uninterrupted, before, after):
    """ZeRO-0 (full optimizer state in every checkpoint): the same global tasks per meta-step
    give the unchanged run's model after resharding the embedding rows and their state."""
    tasks = {"tasks_per_micro_batch": 2, "tasks_per_meta_step": 12} if 3 in (before, after) else {}
    meta = {"algorithm": "maml", "inner_steps": 2, "inner_lr": 0.1, "tasks_per_micro_batch": 4,
            "tasks_per_meta_step": 8, **tasks}
    path = config(tmp_path, 0, 3, meta=meta)
    train(path, before)
    resumed = train(path, after, "train.meta_steps=6", "train.resume=auto")
    assert resumed["resumed_from"]["world_size"] == before and resumed["world_size"] == after
    if tasks:
        full = train(config(tmp_path / "full", 0, 6, meta=meta), 1)
    else:
        full = uninterrupted(1, 0)[0]
    for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
        assert resumed[key] == pytest.approx(full[key], rel=1e-5), key


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=SLOW)])
def test_zero_partitions_at_another_world_size_go_through_universal_checkpoint(tmp_path, uninterrupted, stage):
    """ZeRO-2/3 partitions written by 2 ranks: resuming on 1 converts with DeepSpeed's
    ds_to_universal and restores Adam in full, giving the uninterrupted run's model."""
    path = config(tmp_path, stage, 3)
    train(path, 2)
    resumed = train(path, 1, "train.meta_steps=6", "train.resume=auto")
    assert resumed["resumed_from"]["optimizer_restored"] is True
    converted = list((tmp_path / "run" / "checkpoints" / "universal").glob("step_00000003-*"))
    assert len(converted) == 1 and (converted[0] / "zero").is_dir()
    full = uninterrupted(2, stage)[0]
    for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
        assert resumed[key] == pytest.approx(full[key], rel=1e-5), key


def test_universal_conversion_is_never_reused_stale_or_planted(tmp_path):
    """Run A (2 ranks) resumed on 1 rank leaves a conversion; a fresh run B (other seed) in the
    same output directory, resumed on 1 rank, must load B's state (= B uninterrupted on 2
    ranks), not A's conversion; a pickle planted where a conversion used to be reused never
    runs."""
    path = config(tmp_path, 2, 3)
    train(path, 2)
    train(path, 1, "train.meta_steps=6", "train.resume=auto")
    train(path, 2, "seed=4", "train.overwrite=true")  # run B, fresh, same output directory
    planted = tmp_path / "run" / "checkpoints" / "universal" / "step_00000003" / "zero" / "net.mlp.0.weight"
    planted.mkdir(parents=True, exist_ok=True)

    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    (planted / "fp32.pt").write_bytes(pickle.dumps({"param": Evil()}))
    resumed = train(path, 1, "seed=4", "train.meta_steps=6", "train.resume=auto")
    assert not (tmp_path / "pwned").exists()
    assert resumed["resumed_from"]["step"] == 3 and resumed["resumed_from"]["world_size"] == 2
    reference = train(config(tmp_path / "b", 2, 6, seed=4), 2)
    for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
        assert resumed[key] == pytest.approx(reference[key], rel=1e-5), key


def test_export_equals_the_final_weights(tmp_path):
    path = config(tmp_path, 0, 3)
    train(path, 2)
    out = tmp_path / "export.safetensors"
    gmeta_ranks(1, "export", tmp_path / "run" / "checkpoints", out)
    exported, final = load_file(str(out)), load_file(str(tmp_path / "run" / "model.safetensors"))
    assert sorted(exported) == sorted(final)
    for key in final:
        torch.testing.assert_close(exported[key], final[key], rtol=0, atol=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("saved")
    path = config(tmp, 0, 3)
    train(path, 1)
    return tmp


def test_tampered_or_malicious_files_are_refused(saved, tmp_path):
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "run" / "checkpoints" / "step_00000003", ckpt)
    target = ckpt / "mp_rank_00_model_states.pt"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    target.write_bytes(pickle.dumps({"module": Evil()}))
    with pytest.raises(ConfigError, match="contents differ from the manifest's SHA-256"):
        checkpoint.read_manifest(ckpt)
    with pytest.raises(ConfigError, match="refused by torch.load.weights_only=True."):
        checkpoint.check_pickles(ckpt)  # even with a forged manifest hash
    assert not (tmp_path / "pwned").exists()


def test_requeue_of_a_finished_run_and_a_failed_fresh_run_leave_nothing_stale(saved, tmp_path):
    """A scheduler's requeue (same command + train.resume=auto) of a finished run exits 0
    and touches nothing; with train.meta_steps raised it continues; a fresh run that fails in
    the same directory (with --overwrite) leaves none of the earlier run's results behind."""
    import shutil
    out = tmp_path / "run"
    shutil.copytree(saved / "run", out)
    gmeta = ["train", "--config", str(saved / "config.yaml"), "--set", f"output_dir={out}"]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for steps in (3, 2):  # at and beyond the checkpoint's step
        proc = gmeta_ranks(1, *gmeta, "--set", "train.resume=auto", "--set", f"train.meta_steps={steps}")
        assert "the run is already complete" in proc.stdout and "meta-step 3" in proc.stdout
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    (out / "summary.json").rename(tmp_path / "summary.json")
    proc = gmeta_ranks(1, *gmeta, "--set", "train.resume=auto", "--set", "train.meta_steps=2", expect_ok=False)
    assert proc.returncode == 2 and "train.meta_steps: 2 is not above the step" in proc.stderr
    (tmp_path / "summary.json").rename(out / "summary.json")
    gmeta_ranks(1, *gmeta, "--set", "train.resume=auto", "--set", "train.meta_steps=4")
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["meta_steps"] == 4 and resumed["resumed_from"]["step"] == 3
    # a fresh run without --overwrite is refused: tests/unit/test_runs_kept.py
    proc = gmeta_ranks(1, *gmeta, "--set", "seed=9", "--overwrite", env={checkpoint.FAULT_ENV: "3:0"},
                       expect_ok=False)
    assert proc.returncode != 0  # killed while saving its first checkpoint
    for stale in ("summary.json", "model.safetensors", "checkpoints/latest",
                  "checkpoints/step_00000004/manifest.json"):
        assert not (out / stale).exists(), stale
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_incomplete_checkpoint_is_never_picked(saved, tmp_path):
    import shutil
    root = tmp_path / "checkpoints"
    shutil.copytree(saved / "run" / "checkpoints", root)
    (root / "step_00000006").mkdir()  # a save that died before its manifest
    (root / "step_00000006" / "rank00000.safetensors").write_bytes(b"partial")
    assert checkpoint.find(str(root), ".") == root / "step_00000003"
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        checkpoint.find(str(root / "step_00000006"), ".")


def _rank_pids(config_path: Path, local_rank: int) -> list[int]:
    import subprocess as sp
    out = sp.run(["pgrep", "-f", f"local_rank={local_rank} train --config {config_path}"],
                 capture_output=True, text=True, timeout=10).stdout
    return [int(x) for x in out.split()]


def test_killed_rank_ends_the_job_and_the_last_checkpoint_resumes(tmp_path):
    """SIGKILL rank 1 after the first checkpoint: the job exits non-zero well within the
    collective timeout, naming the lost rank; resuming from `latest` finishes the run."""
    import os
    import signal
    import subprocess as sp
    import time

    path = config(tmp_path, 0, 2000, {"checkpoint_every": 2, "collective_timeout_s": 60})
    cmd = deepspeed_cmd(2, str(BIN / "gmeta-ds"), "train", "--config", str(path))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = sp.Popen(cmd, cwd=REPO, env=env, stdout=sp.PIPE, stderr=sp.STDOUT, text=True)
    latest = tmp_path / "run" / "checkpoints" / "latest"
    try:
        deadline = time.monotonic() + 180
        while not latest.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert latest.exists(), "no checkpoint within 180 s"
        victims = _rank_pids(path, 1)
        assert victims, "rank 1 not found"
        killed_at = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60 + 60)  # collective timeout + margin
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode != 0 and took < 120
    assert "--local_rank=1" in out and "return code = -9" in out
    step = int(latest.read_text().strip().split("_")[1])
    resumed = train(path, 1, f"train.meta_steps={step + 2}", "train.resume=auto")
    assert resumed["resumed_from"]["step"] == step and resumed["world_size"] == 1


def test_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path):
    path = config(tmp_path, 0, 6)
    cmd = deepspeed_cmd(2, str(BIN / "gmeta-ds"), "train", "--config", str(path))
    proc = run(cmd, env={checkpoint.FAULT_ENV: "6:1"}, expect_ok=False)
    assert proc.returncode != 0
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert not (root / "step_00000006" / "manifest.json").exists()
    assert checkpoint.find("auto", tmp_path / "run") == root / "step_00000003"
    checkpoint.read_manifest(root / "step_00000003")  # intact: every hash matches
    resumed = train(path, 2, "train.resume=auto")
    assert resumed["resumed_from"]["step"] == 3 and resumed["meta_steps"] == 6
    assert (root / "latest").read_text().strip() == "step_00000006"


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 32 MiB tmpfs: room for a run and its checkpoints until the fault hook fills it."""
    path = tmp_path / "disk"
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(path)],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({proc.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], timeout=30)


@pytest.mark.parametrize("world, stage", [(1, 0), (2, 1)])
def test_full_disk_during_a_checkpoint_write_is_a_clear_error_on_every_rank(small_disk, world, stage):
    """The disk fills up just before checkpoint 6 (a real ENOSPC from the kernel): every rank
    exits with one message naming the checkpoint, the rank, the file and the full disk; the
    incomplete checkpoint is gone, ``latest`` still names step 3, and once space is freed the
    run resumes from it. Under ZeRO-1 at world 2 both ranks write DeepSpeed files that fail."""
    path = config(small_disk, stage, 6, output_dir=str(small_disk / "run"))
    args = [str(BIN / "gmeta-ds"), "train", "--config", str(path)]
    cmd = args if world == 1 else deepspeed_cmd(world, *args)
    proc = run(cmd, env={checkpoint.FAULT_FILL_ENV: "6"}, expect_ok=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-4000:]
    if world == 1:
        assert proc.returncode == 4
    assert out.count("gmeta-ds train: checkpoint step 6 could not be written") == world, out[-4000:]
    assert "rank 0: could not write" in out and "no space left on the device" in out
    root = small_disk / "run" / "checkpoints"
    assert "the incomplete checkpoint step_00000006 was removed" in out
    assert f"the last complete checkpoint is {root / 'step_00000003'}" in out
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert not (root / "step_00000006").exists()
    checkpoint.read_manifest(root / "step_00000003")  # intact: every hash matches
    (small_disk / "run" / ".fault_fill").unlink()
    resumed = train(path, world, "train.resume=auto")
    assert resumed["resumed_from"]["step"] == 3 and resumed["meta_steps"] == 6
    assert (root / "latest").read_text().strip() == "step_00000006"
