"""Helpers for tests that run real launchers as subprocesses (every wait has a timeout)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(tmp_path: Path, **sections) -> Path:
    """A small run config (few users, few meta-steps, no evaluation) written to tmp_path."""
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "seed": 3,
        "model": {"embed_dim": 4, "hidden": [8]},
        "meta": {"algorithm": "maml", "inner_steps": 2, "inner_lr": 0.1,
                 "tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
        "data": {"synthetic": {"num_users": 80, "num_items": 50, "max_interactions": 30}},
        "train": {"meta_steps": 4, "log_every": 2, "lr": 0.01, "progress": False},
        "eval": {"enabled": False},
        "deepspeed": str(REPO / "ds_configs" / "zero0.json"),
    }
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and key in cfg else value
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


TEXT_TINY_BERT = {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "intermediate_size": 32}


def text_config(tmp_path: Path, algorithm: str = "maml", ds: str = "zero0", **extra) -> Path:
    """A small few-shot text run config (tiny BERT, 3-way episodes, 4 meta-steps, no evaluation)."""
    cfg = {
        "task": "text", "output_dir": str(tmp_path / "run"), "seed": 1,
        "meta": {"algorithm": algorithm, "inner_steps": 2, "inner_lr": 0.5, "adapt": ["*"],
                 "tasks_per_micro_batch": 2, "tasks_per_meta_step": 4},
        "text": {"data": {"ways": 3, "shots": 2, "queries": 2, "max_length": 10,
                          "synthetic": {"num_classes": 12, "examples_per_class": 6, "topic_words": 8,
                                        "filler_words": 20, "words_per_text": 5}},
                 "model": {"config": TEXT_TINY_BERT}, "eval_episodes": 6, "baseline_steps": 3},
        "train": {"meta_steps": 4, "log_every": 1, "lr": 0.01, "progress": False},
        "eval": {"enabled": False},
        "deepspeed": str(REPO / "ds_configs" / f"{ds}.json"),
    }
    for key, value in extra.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and isinstance(cfg.get(key), dict) else value
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(cmd: list[str], timeout: int = TIMEOUT_S, env: dict | None = None,
        expect_ok: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command with a hard timeout; on failure show its output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd or REPO)
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                    f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def gmeta_ranks(world: int, *args: str, env: dict | None = None, expect_ok: bool = True,
                timeout: int = TIMEOUT_S, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``gmeta-ds ARGS`` on ``world`` warm ranks of the test pool (tests/pool.py): what a launcher
    runs on each rank, without the launcher's three cold interpreters. At world 1 the rank has no
    launcher variables (a plain ``gmeta-ds`` run). For tests whose subject is the training, not
    the launcher; the launchers keep their own tests (test_launchers, test_deepspeed_launcher)."""
    from pool import pool

    result = pool().run({"kind": "cli", "argv": [str(a) for a in args]}, world, env=env, cwd=cwd or REPO,
                        timeout=timeout, label=f"gmeta-ds {' '.join(map(str, args))}")
    if expect_ok and result.returncode != 0:
        pytest.fail(f"{' '.join(result.args)} exited {result.returncode} (ranks: {result.codes})\n"
                    f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def script_ranks(world: int, script: str | Path, *args: str, cwd: Path | None = None,
                 timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` on ``world`` warm ranks of the test pool (a user's script against
    the public API; at world 1 without launcher variables); fails the test unless every rank
    exits 0."""
    from pool import pool

    result = pool().run({"kind": "script", "script": str(script), "args": [str(a) for a in args]}, world,
                        cwd=cwd or REPO, timeout=timeout, label=f"python {script} {' '.join(map(str, args))}")
    if result.returncode != 0:
        pytest.fail(f"{' '.join(result.args)} exited {result.returncode} (ranks: {result.codes})\n"
                    f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-6000:]}")
    return result


def summary(config: Path) -> dict:
    out_dir = Path(yaml.safe_load(config.read_text())["output_dir"])
    return json.loads((out_dir / "summary.json").read_text())


def deepspeed_cmd(nproc: int, *args: str) -> list[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), *args]


def one_and_two_ranks(tmp_path: Path, **sections) -> tuple[dict, dict]:
    """The summaries of `tiny_config` with ``sections`` trained by one process (``one/``) and
    by two ranks (``two/``), on warm ranks of the test pool."""
    one = trained_once(tiny_config(tmp_path / "one", **sections), 1)
    double = tiny_config(tmp_path / "two", **sections)
    gmeta_ranks(2, "train", "--config", double)
    two = summary(double)
    assert one["world_size"] == 1 and two["world_size"] == 2
    return one, two


def assert_same_model(a: dict, b: dict) -> None:
    """Two runs over the same global tasks per meta-step trained the same model."""
    for key in ("dense_checksum", "embedding_checksum", "final_query_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    assert a["tasks_seen"] == b["tasks_seen"]


_TRAINED: dict[tuple[str, int], dict] = {}


def trained_once(config: Path, world: int) -> dict:
    """The summary of ``config`` trained on ``world`` pool ranks, memoised for the session by the
    resolved config (its output_dir aside) and the world size: the reference runs that several
    files compare with train once. The first call's output_dir holds the run's files."""
    from gmeta_ds.config import load_config

    resolved = load_config(str(config), [])
    key = (json.dumps({**_plain(resolved), "output_dir": None}, sort_keys=True, default=str), world)
    if key not in _TRAINED:
        gmeta_ranks(world, "train", "--config", config)
        _TRAINED[key] = summary(config)
    return _TRAINED[key]


def _plain(cfg) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> dict:
    """`tiny_config` trained by one process (no launcher variables)."""
    path = tiny_config(tmp_path_factory.mktemp("reference"))
    result = trained_once(path, 1)
    assert result["world_size"] == 1 and result["batch"].startswith("4 tasks/micro-batch x 2")
    return result


def leaked_shm(port: int) -> list[Path]:
    """DeepSpeed CPU all-reduce buffers a job on ``port`` left in /dev/shm."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))



@pytest.fixture
def emulated_hosts():
    """A factory of emulated clusters (`benchmarks/emulated_cluster.py`): ``make(hosts, rate)``
    gives H network namespaces whose links to each other carry ``rate`` ("100mbit"; None:
    unlimited). Root only: skipped, saying why, elsewhere. Every namespace is removed at the
    end, also when the test fails (and leftovers of the prefix before it starts)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from emulated_cluster import emulated_cluster, why_not_available

    reason = why_not_available()
    if reason:
        pytest.skip(f"emulated cluster: {reason}")
    with __import__("contextlib").ExitStack() as stack:
        yield lambda hosts, rate=None: stack.enter_context(emulated_cluster(hosts, rate))
