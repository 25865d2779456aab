"""Launch-time checks (hostfiles, where the DeepSpeed config comes from), ``validate``'s
batch and memory report, TensorBoard events and ``gmeta-ds plot``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gmeta_ds.cli import main
from gmeta_ds.config.deepspeed import dense_state_bytes
from gmeta_ds.errors import ConfigError
from gmeta_ds.run.launchers import hostfile_world_size, launcher_ds_config, parse_hostfile

REPO = Path(__file__).resolve().parents[2]
ZERO1, ZERO2 = str(REPO / "ds_configs" / "zero1.json"), str(REPO / "ds_configs" / "zero2.json")
TINY = {"model": {"embed_dim": 4, "hidden": [8]},
        "meta": {"tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
        "data": {"synthetic": {"num_users": 60, "num_items": 40, "max_interactions": 25}},
        "train": {"meta_steps": 4, "log_every": 2, "progress": False},
        "eval": {"baseline_epochs": 1, "tasks_per_batch": 8},
        "deepspeed": "ds_configs/zero1.json"}


def write_config(tmp_path: Path, **extra) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), **TINY, **extra}))
    return str(path)


def test_hostfile_parsing(tmp_path):
    good = tmp_path / "good"
    good.write_text("# cluster\nnode0 slots=8   # head\n\n10.0.0.2 slots=4\n")
    hosts = parse_hostfile(good)
    assert [(h.name, h.slots, h.line) for h in hosts] == [("node0", 8, 2), ("10.0.0.2", 4, 4)]
    assert hostfile_world_size(hosts) == 12 and hostfile_world_size(hosts, num_gpus=2) == 4


@pytest.mark.parametrize("text, message", [
    ("node0 slots=2\nnode0 slots=2\n", "hf:2: host 'node0' is listed again (first on line 1)"),
    ("node0 slots=2x\n", "hf:1: 'node0 slots=2x' is not 'HOSTNAME slots=N'"),
    ("node0\n", "hf:1: 'node0' is not 'HOSTNAME slots=N'"),
    ("node0 slots=0\n", "hf:1: host 'node0' has slots=0; need at least 1"),
    ("# only a comment\n", "hf: no hosts (expected lines like 'node0 slots=8')"),
])
def test_bad_hostfiles_name_file_and_line(tmp_path, text, message):
    path = tmp_path / "hf"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_hostfile(path)
    assert message in str(err.value)


def test_missing_hostfile(tmp_path):
    with pytest.raises(ConfigError, match="hostfile .*nope' does not exist"):
        parse_hostfile(tmp_path / "nope")


def test_launcher_ds_config_sources():
    accel = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO2}
    assert launcher_ds_config(None, {}) is None
    assert launcher_ds_config(ZERO1, {}) == ZERO1
    assert launcher_ds_config(None, accel) == ZERO2
    assert launcher_ds_config(ZERO2, accel) == ZERO2  # the same file twice is fine
    with pytest.raises(ConfigError, match="two different DeepSpeed configs"):
        launcher_ds_config(ZERO1, accel)
    with pytest.raises(ConfigError, match="deepspeed_config_file"):
        launcher_ds_config(None, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})
    with pytest.raises(ConfigError, match="'/nope.json' does not exist"):
        launcher_ds_config("/nope.json", {})


def test_deepspeed_config_argument_overrides_run_config(tmp_path, capsys):
    config = write_config(tmp_path)
    assert main(["validate", "--config", config, "--deepspeed", "--deepspeed_config", ZERO2]) == 0
    assert '"stage": 2' in capsys.readouterr().out
    assert main(["validate", "--config", config, "--deepspeed_config", ZERO2,
                 "--set", f"deepspeed={ZERO1}"]) == 2
    assert "contradicts the launcher's DeepSpeed config" in capsys.readouterr().err


def test_validate_with_hostfile_reports_batch_and_memory(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    config = write_config(tmp_path, meta={"tasks_per_micro_batch": 2, "tasks_per_meta_step": 16})
    assert main(["validate", "--config", config, "--hostfile", str(hostfile)]) == 0
    out = capsys.readouterr().out
    assert f"hostfile {hostfile}: node0 (2 rank(s)), node1 (2 rank(s)) = 4 ranks" in out
    assert "2 tasks/micro-batch x 2 accumulation steps x 4 ranks = 16 tasks/meta-step" in out
    assert "dense state per rank (DeepSpeed ZeRO-1, 4 rank(s)): parameters" in out
    assert main(["validate", "--config", config, "--hostfile", str(hostfile), "--num_gpus", "3"]) == 2
    assert "world size (6) = 12" in capsys.readouterr().err


def test_dense_state_bytes_by_stage():
    n, w = 1000, 4
    assert dense_state_bytes({"zero_optimization": {"stage": 0}}, n, w) == \
        {"stage": 0, "params": 4000, "grads": 4000, "optimizer": 8000}
    # ZeRO 1-3 keep DeepSpeed's fp32 master partition beside Adam's moments, even in fp32.
    assert dense_state_bytes({"zero_optimization": {"stage": 1}}, n, w)["optimizer"] == 3000
    two = dense_state_bytes({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, n, w)
    assert two == {"stage": 2, "params": 2000, "grads": 500, "optimizer": 3000}
    three = dense_state_bytes({"zero_optimization": {"stage": 3}}, n, w)
    assert three == {"stage": 3, "params": 1000, "grads": 1000, "optimizer": 3000}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One small plain-process run (train + evaluation) shared by the output tests."""
    tmp = tmp_path_factory.mktemp("run")
    assert main(["train", "--config", write_config(tmp)]) == 0
    return tmp / "out"


def test_tensorboard_events_hold_the_logged_metrics(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(trained_run / "tensorboard"))
    events.Reload()
    query = events.Scalars("train/query_loss")
    assert [e.step for e in query] == [r["step"] for r in records] == [2, 4]
    assert [e.value for e in query] == pytest.approx([r["query_loss"] for r in records], rel=1e-6)
    summary = json.loads((trained_run / "summary.json").read_text())
    assert events.Scalars("eval/auc")[0].value == pytest.approx(summary["eval"]["auc"], rel=1e-6)


def test_plot_writes_pngs(trained_run, tmp_path, capsys):
    assert main(["plot", str(trained_run), "--out", str(tmp_path / "plots")]) == 0
    names = ["loss.png", "throughput.png", "communication.png", "coldstart.png", "few_shot.png", "inner_steps.png"]
    for name in names:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert capsys.readouterr().out.count("wrote ") == len(names)


def test_plot_of_a_directory_without_metrics(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl here" in capsys.readouterr().err
