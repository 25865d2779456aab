"""The bad-input matrix of the config and the launcher environment (issue 32): duplicate keys,
alias bombs, keys that do not apply, absurd numbers, validate agreeing with train, and the
launcher's variables. Every case runs in-process (one subprocess: the missing peer) and
asserts the error class or exit code and words naming the key."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gmeta_ds.cli import main
from gmeta_ds.config import MODEL_DEFAULT_ADAPT, MetaConfig, config_from_dict, load_config
from gmeta_ds.config.deepspeed import resolve_ds_config
from gmeta_ds.errors import ConfigError

TINY = {"model": {"embed_dim": 4, "hidden": [8]},
        "meta": {"tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
        "data": {"synthetic": {"num_users": 60, "num_items": 40, "max_interactions": 25}},
        "train": {"meta_steps": 2, "progress": False, "tensorboard": False},
        "eval": {"enabled": False}}


def write(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), **cfg}))
    return str(path)


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    return str(err.value)


def cli_refuses(capsys, args: list[str], words: list[str], code: int = 2) -> None:
    assert main(args) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


# ---------------------------------------------------------------- YAML and JSON files
def test_a_duplicate_yaml_key_is_refused_naming_its_path_and_lines(tmp_path, capsys):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  lr: 0.1\n  meta_steps: 3\n  lr: 0.5\n")
    with pytest.raises(ConfigError, match=r"train\.lr: duplicate key on line 4 \(first on line 2\)"):
        load_config(path)
    cli_refuses(capsys, ["validate", "--config", str(path)], ["gmeta-ds validate: ", "train.lr: duplicate key"])
    cli_refuses(capsys, ["validate", "--config", write(tmp_path, TINY), "--set", "deepspeed={a: 1, a: 2}"],
                ["deepspeed={a: 1, a: 2}", "a: duplicate key"])


def test_a_duplicate_json_key_in_the_deepspeed_file_is_refused(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 1, "stage": 2}}')
    cfg = config_from_dict({"deepspeed": str(ds)})
    with pytest.raises(ConfigError, match="key 'stage' appears twice"):
        resolve_ds_config(cfg, 1)


def test_an_alias_bomb_is_refused_fast(tmp_path, capsys):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]" for i in range(9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nmodel: {hidden: *j}\n")
    assert path.stat().st_size < 1024
    start = time.monotonic()
    cli_refuses(capsys, ["validate", "--config", str(path)], ["aliases (*name) expand to more than 100000"])
    assert time.monotonic() - start < 10


def test_a_few_aliases_are_fine(tmp_path):
    """yaml.safe_dump writes &id001 / *id001 for an object used twice: that stays valid."""
    widths = [8]
    cfg = load_config(write(tmp_path, {**TINY, "model": {"hidden": widths, "tower_hidden": widths}}))
    assert cfg.model.hidden == [8] and "&id001" in Path(tmp_path / "c.yaml").read_text()


@pytest.mark.parametrize("text, words", [
    ("x" * (2**20 + 1), "a run config is a few KB (at most 1048576)"),
    ("a: " + "[" * 3000 + "]" * 3000, "nest too deeply"),
    ("seed: " + "9" * 5000, "a value cannot be read"),
], ids=["over-1-MiB", "deep-nesting", "5000-digit-int"])
def test_oversized_files_and_values_are_refused(tmp_path, text, words):
    path = tmp_path / "big.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        load_config(path)


# ---------------------------------------------------------------- keys that do not apply
@pytest.mark.parametrize("data, words", [
    ({"data": {"query_size": 5}}, "data.query_size: set, but data.source: synthetic does not read it"),
    ({"data": {"path": "/x"}}, "data.path: set, but data.source: synthetic does not read it"),
    ({"data": {"source": "recbole", "path": "/x", "dataset_name": "ml", "sep": ";"}},
     "data.sep: set, but only data.source: table reads it"),
    ({"data": {"source": "table", "path": "/x", "dataset_name": "ml"}},
     "data.dataset_name: set, but only data.source: recbole reads it"),
    ({"data": {"source": "table", "path": "/x", "label": "regression", "threshold": 3.0}},
     "data.threshold: set, but data.label: regression keeps the rating"),
    ({"embedding": {"sharding": "sharded", "tables": {"item_id": {"admit_after": 3}}}},
     "embedding.tables.item_id.admit_after: set, but only kind: dynamic tables admit and evict ids"),
    ({"embedding": {"sharding": "sharded", "tables": {"item_id": {"eviction": "lfu"}}}},
     "embedding.tables.item_id.eviction: set, but only kind: dynamic"),
    ({"model": {"name": "two_tower"}, "meta": {"adapt": ["mlp.*"]}},
     "meta.adapt: ['mlp.*'] is given, but model.name: two_tower has no mlp"),
    ({"model": {"item_popularity": False, "popularity_prior": 3.0}},
     "model.popularity_prior: set, but it applies with model.item_popularity: true"),
    ({"task": "text", "model": {"hidden": [4]}}, "model: set, but task: text reads text.*"),
    ({"text": {"eval_episodes": 3}}, "text: set, but task: ctr does not read it"),
], ids=["query_size-synthetic", "path-synthetic", "sep-recbole", "dataset_name-table", "threshold-regression",
        "admit_after-static", "eviction-static", "adapt-two_tower", "prior-without-popularity",
        "model-on-text", "text-on-ctr"])
def test_a_key_that_does_not_apply_is_refused(data, words):
    assert words in refused(data)


def test_keys_left_at_their_default_are_fine():
    config_from_dict({"data": {"query_size": 10, "path": None}, "meta": {"adapt": ["mlp.*"]},
                      "embedding": {"sharding": "sharded", "tables": {"item_id": {"admit_after": 1}}}})
    cfg = config_from_dict({"model": {"name": "two_tower"}})  # adapt left out: the model's default
    assert cfg.meta.adapt == MetaConfig().adapt


def test_model_default_adapt_table_matches_the_models():
    """config.MODEL_DEFAULT_ADAPT (torch-free) repeats each zoo class's default_adapt."""
    from gmeta_ds.models import MODELS

    for name in MODELS.names():
        default = tuple(getattr(MODELS[name], "default_adapt", tuple(MetaConfig().adapt)))
        assert MODEL_DEFAULT_ADAPT.get(name, tuple(MetaConfig().adapt)) == default, name


def test_exchange_pooled_on_a_single_hot_field_is_refused_by_validate(tmp_path, capsys):
    cfg = {**TINY, "embedding": {"sharding": "sharded", "tables": {"item_id": {"exchange": "pooled"}}}}
    cli_refuses(capsys, ["validate", "--config", write(tmp_path, cfg)],
                ["embedding.tables.item_id.exchange: pooled, but 'item_id' is a single-hot field"])


# ---------------------------------------------------------------- absurd numbers
@pytest.mark.parametrize("data, words", [
    ({"seed": 2**90}, "seed: ~10**27 is too large; at most 2**32 - 1"),
    ({"train": {"collective_timeout_s": 10**20}}, "train.collective_timeout_s: ~10**20 is too large; at most 604800"),
    ({"train": {"threads": 10**12}}, "train.threads: 1000000000000 is too large; at most 4096"),
    ({"train": {"lr": 10**400}}, "train.lr: ~10**400 is too large; at most 1e+12"),
    ({"embedding": {"sharding": "sharded", "tables": {"item_id": {"kind": "dynamic", "capacity": 10**17}}}},
     "embedding.tables.item_id.capacity: ~10**17 is too large; at most 2**31 - 1"),
    ({"embedding": {"sharding": "sharded", "tables": {"item_id": {"kind": "dynamic", "capacity": 500,
                                                                  "admit_after": 10**23}}}},
     "embedding.tables.item_id.admit_after: ~10**23 is too large"),
    ({"model": {"hidden": [8, 10**9]}}, "model.hidden: 1000000000 is too large; at most 65536"),
    ({"model": {"embed_dim": 10**6}}, "model.embed_dim: 1000000 is too large; at most 4096"),
    ({"model": {"hidden": [8] * 2000}}, "model.hidden: 2000 entries; at most 1024"),
    ({"meta": {"inner_steps": 10**7}}, "meta.inner_steps: 10000000 is too large; at most 10000"),
    ({"meta": {"inner_lr_scale": {"mlp.*": 1e300}}}, "meta.inner_lr_scale.mlp.*: 1e+300 is too large"),
    ({"data": {"synthetic": {"num_users": 10**8}}}, "data.synthetic.num_users x max_interactions"),
    ({"task": "text", "text": {"model": {"vocab_size": 10**9}}}, "text.model.vocab_size: 1000000000 is too large"),
], ids=["seed", "timeout", "threads", "lr", "capacity", "admit_after", "hidden", "embed_dim", "layers",
        "inner_steps", "lr_scale", "synthetic-size", "vocab"])
def test_an_absurd_number_is_refused_naming_the_key_and_bound(data, words):
    assert words in refused(data)


def test_an_absurd_number_exits_2_from_the_cli(tmp_path, capsys):
    cli_refuses(capsys, ["validate", "--config", write(tmp_path, TINY), "--set", f"seed={2**90}",
                         "--set", "train.collective_timeout_s=1e20"],
                ["gmeta-ds validate: ", "seed: ~10**27 is too large", "train.collective_timeout_s: expected int"])


def test_absurd_batch_keys_and_world_sizes_are_refused_fast(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 10**15}))
    cfg = config_from_dict({"deepspeed": str(ds), "meta": {"tasks_per_micro_batch": "auto"}})
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu: 1000000000000000 is not a positive "
                                          r"integer <= 1073741824"):
        resolve_ds_config(cfg, 1)
    start = time.monotonic()  # the divisor hint for a prime-sized meta-step: sqrt(n) work
    cfg = config_from_dict({"meta": {"tasks_per_micro_batch": 2**20, "tasks_per_meta_step": 2**30 - 35}})
    with pytest.raises(ConfigError, match="must be a multiple of"):
        resolve_ds_config(cfg, 1)
    assert time.monotonic() - start < 5
    cli_refuses(capsys, ["validate", "--config", write(tmp_path, TINY), "--world-size", str(10**12)],
                ["world size 1000000000000: expected 1 to 1048576 ranks"])
    hosts = tmp_path / "hosts"
    hosts.write_text("node0 slots=1000000000\n")
    cli_refuses(capsys, ["validate", "--config", write(tmp_path, TINY), "--hostfile", str(hosts)],
                ["host 'node0' has slots=1000000000; at most 4096 per host"])


# ---------------------------------------------------------------- malformed and silent values
LOG = {"source": "table", "path": "/x"}


@pytest.mark.parametrize("data, words", [
    ({"meta": {"inner_lr_scale": {1: 2.0}}}, "meta.inner_lr_scale: expected dict of str -> float, got {1: 2.0}"),
    ({"meta": {"inner_lr_scale": [1, 2]}}, "meta.inner_lr_scale: expected dict of str -> float, got [1, 2]"),
    ({"meta": {"inner_lr_scale": {"mlp.*": None}}}, "meta.inner_lr_scale: expected dict of str -> float"),
    ({"meta": {"inner_lr_scale": None}}, "meta.inner_lr_scale: expected dict of str -> float, got None"),
    ({"data": {**LOG, "schema": {"multi_hot": {"genre": 1}}}},
     "data.schema.multi_hot: expected dict of str -> str, got {'genre': 1}"),
    ({"data": {**LOG, "schema": {"multi_hot": {"genre": ""}}}},
     "data.schema.multi_hot.genre: an empty separator; expected the string that separates"),
    ({"data": {**LOG, "sep": ""}}, "data.sep: '' must be exactly one character (the CSV separator"),
    ({"data": {**LOG, "sep": "::"}}, "data.sep: '::' must be exactly one character"),
    ({"data": {"cache_dir": " "}}, "data.cache_dir: empty; expected the folder task stores are kept in"),
    ({"embedding": {"replicate_below_rows": -5}}, "embedding.replicate_below_rows: -5 must be an integer >= 0"),
    ({"data": {"synthetic": {"zipf_exponent": -1.0}}}, "data.synthetic.zipf_exponent: -1.0 must be >= 0"),
    ({"data": {**LOG, "memory_limit": "inf"}}, "data.memory_limit: 'inf' is not a finite size"),
    ({"data": {**LOG, "memory_limit": "nanGB"}}, "data.memory_limit: 'nanGB' is not a finite size"),
], ids=["lr_scale-int-key", "lr_scale-list", "lr_scale-null-value", "lr_scale-null", "multi_hot-int-sep",
        "multi_hot-empty-sep", "sep-empty", "sep-two-chars", "cache_dir-empty", "replicate_below_rows-negative",
        "zipf-negative", "memory_limit-inf", "memory_limit-nan"])
def test_a_malformed_or_silent_value_is_refused_naming_the_key(data, words):
    """Each was a traceback (TypeError, int(nan)), a later reader's crash, or silently did
    something else (a store written into the working directory, inverted popularity)."""
    assert words in refused(data)


def test_well_formed_values_of_those_keys_still_load():
    cfg = config_from_dict({"meta": {"inner_lr_scale": {"mlp.*": 2}}})
    assert cfg.meta.inner_lr_scale == {"mlp.*": 2}
    cfg = config_from_dict({"data": {**LOG, "sep": "\t", "schema": {"multi_hot": {"genres": "||"}}}})
    assert cfg.data.sep == "\t" and cfg.data.schema.multi_hot == {"genres": "||"}
    assert config_from_dict({"embedding": {"replicate_below_rows": 0}}).embedding.replicate_below_rows == 0
    config_from_dict({"data": {"synthetic": {"zipf_exponent": 0.0}, "memory_limit": "2GB"}})  # a machine setting


@pytest.mark.parametrize("path, words", [
    ("/dev/null", ("config file '/dev/null' is not a regular file (a device, pipe or socket, like /dev/null); "
                   "expected a YAML file")),
    ("/proc/self/status", "config file '/proc/self/status' is a virtual file (its size reads 0, as in /proc"),
], ids=["dev-null", "proc-file"])
def test_a_config_path_that_is_no_file_on_disk_says_what_it_is(capsys, path, words):
    """Was "does not exist" for /dev/null."""
    cli_refuses(capsys, ["validate", "--config", path], [words])


@pytest.mark.parametrize("path, words", [
    ("/dev/null", ("/dev/null: is not a regular file (a device, pipe or socket, like /dev/null); expected a CSV "
                   "or Parquet file on disk (data.path)")),
    ("/proc/self/status", ("/proc/self/status: is a virtual file (its size reads 0, as in /proc or /sys), not a "
                           "file on disk")),
], ids=["dev-null", "proc-file"])
def test_a_data_path_that_is_no_file_on_disk_says_what_it_is(tmp_path, capsys, path, words):
    """Were "file does not exist" (/dev/null) and "file is empty" (/proc/self/status)."""
    cfg = {**TINY, "data": {"source": "table", "path": path}}
    cli_refuses(capsys, ["train", "--config", write(tmp_path, cfg)], [words])


def test_a_duplicated_csv_header_column_is_named(tmp_path, capsys):
    """Was KeyError: 'Field "item_id" exists 2 times in schema'."""
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,rating,item_id\n" + "".join(f"{u},{i},{(u + i) % 5 + 1},{i}\n"
                                                             for u in range(30) for i in range(20)))
    cfg = {**TINY, "data": {"source": "table", "path": str(log)}}
    cli_refuses(capsys, ["validate", "--config", write(tmp_path, cfg)],
                [f"{log}: the header names column(s) 'item_id' more than once; expected each column name once"])


def test_a_dangling_symbolic_link_as_output_dir_is_named(tmp_path, capsys):
    """Was "is not writable: File exists"."""
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    cli_refuses(capsys, ["train", "--config", write(tmp_path, TINY)],
                [f"output_dir: '{link}' is a symbolic link to '{tmp_path / 'gone'}', which does not exist"])
    assert link.is_symlink() and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("states, words", [
    ([1, 2], "key 'eval.states': expected an object (state name -> its metrics object), got [1, 2]"),
    (3, "key 'eval.states': expected an object (state name -> its metrics object), got 3"),
    ({"warm": {"auc": "high"}}, "key 'eval.states.warm.auc': expected a number or null, got \"high\""),
], ids=["list", "number", "text-metric"])
def test_plot_names_a_malformed_eval_states(tmp_path, capsys, states, words):
    """Were TypeErrors inside the cold-start chart."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "query_loss": 0.6, "support_loss": 0.7,
                                                   "tasks_per_s": 9.0}) + "\n")
    (run / "summary.json").write_text(json.dumps({"eval": {"auc": 0.7, "states": states}}))
    cli_refuses(capsys, ["plot", str(run)], [f"{run / 'summary.json'}: {words}"])


def test_a_resume_drops_a_torn_last_metrics_line_and_names_a_garbage_one(tmp_path):
    """metrics.jsonl on resume: a last line cut short (a run killed while writing it) is
    dropped with the records past the checkpoint; garbage before the end is named by line
    (both were a JSONDecodeError on rank 0)."""
    from gmeta_ds.run.run_log import MetricsLog

    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"step": s, "query_loss": 0.5}) for s in (1, 2, 3)]
    path.write_text("\n".join(records) + '\n{"step": 4, "query_lo')
    log = MetricsLog(tmp_path, enabled=True, tensorboard=False, resumed_at=2)
    log.close()
    assert path.read_text() == records[0] + "\n" + records[1] + "\n"
    path.write_text("\n".join([records[0], "garbage", records[1], records[2]]) + "\n")
    with pytest.raises(ConfigError, match=rf"{path}:2: expected a JSON object with an integer 'step'.*'garbage'"):
        MetricsLog(tmp_path, enabled=True, tensorboard=False, resumed_at=2)


@pytest.mark.parametrize("cell", ["inf", "-inf", "1e300"])
def test_a_label_that_is_not_a_finite_float32_is_named_in_the_log_not_the_store(tmp_path, capsys, cell):
    """Was accepted into the task store, whose check then called the store damaged (so
    rebuilding it could not help); now the build names the log's row and column."""
    from gmeta_ds.data.readers import DataError, LogSchema, read_table

    rows = [f"{u},{i},{(u + i) % 5 + 1}" for u in range(30) for i in range(20)]
    rows[7] = "0,7," + cell
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,rating\n" + "\n".join(rows) + "\n")
    cfg = {**TINY, "data": {"source": "table", "path": str(log), "label": "regression",
                            "cache_dir": str(tmp_path / "cache")}}
    cli_refuses(capsys, ["train", "--config", write(tmp_path, cfg)],
                [(f"{log}: row 8 below the header: column 'rating' must be a finite number within float32 "
                  f"(a label), got '{cell}'")])
    # the in-memory reader (MovieLens, RecBole, the API's tables) says the same
    with pytest.raises(DataError, match=rf"line 9: column 'rating' must be a finite number within float32 "
                                        rf"\(a label\), got '{cell}'"):
        read_table(log, LogSchema("user_id", "item_id", "rating", None))


# ---------------------------------------------------------------- validate agrees with train
def test_validate_refuses_split_body_true_on_a_model_without_a_split(tmp_path, capsys):
    cfg = {**TINY, "model": {"name": "dcn_v2", "embed_dim": 4, "hidden": [8]},
           "meta": {**TINY["meta"], "split_body": True}}
    cli_refuses(capsys, ["validate", "--config", write(tmp_path, cfg)],
                ["meta.split_body: true, but the model cannot be split: DCNv2 defines no split_body"])


# ---------------------------------------------------------------- launcher environment
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def launcher_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"},
     "LOCAL_WORLD_SIZE=4 and WORLD_SIZE=2: the ranks on this node cannot outnumber the ranks of the job"),
    ({"WORLD_SIZE": "2", "LOCAL_SIZE": "3"}, "LOCAL_SIZE=3 and WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "one"}, "environment variable LOCAL_RANK='one': expected an integer >= 0"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "environment variable LOCAL_RANK='-1': expected an integer >= 0"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"},
     "LOCAL_RANK=2 and LOCAL_WORLD_SIZE=2: the local rank must be below the ranks on this node"),
    ({"MASTER_PORT": "70000"}, "environment variable MASTER_PORT='70000': expected an integer >= 1 and <= 65535"),
    ({"MASTER_PORT": "http"}, "environment variable MASTER_PORT='http': expected an integer"),
    ({"MASTER_ADDR": " "}, "environment variable MASTER_ADDR='': expected rank 0's host name or address"),
    ({"RANK": "-1"}, "environment variable RANK='-1': expected an integer >= 0"),
    ({"WORLD_SIZE": str(10**30)}, "expected an integer >= 1 and <= 1048576"),
    ({"RANK": None, "WORLD_SIZE": "2"}, "environment variable WORLD_SIZE=2 is set but RANK is not"),
], ids=["local-world-above-world", "local-size-above-world", "local-rank-word", "local-rank-negative",
        "local-rank-outside-node", "port-above-65535", "port-word", "empty-addr", "rank-negative", "huge-world",
        "world-without-rank"])
def test_bad_launcher_variables_exit_2_before_any_collective(tmp_path, capsys, launcher_env, env, words):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **env}
    for name, value in env.items():
        if value is None:
            launcher_env.delenv(name, raising=False)
        else:
            launcher_env.setenv(name, value)
    quick = {**TINY, "train": {**TINY["train"], "collective_timeout_s": 5}}  # a regression fails, not hangs
    cli_refuses(capsys, ["train", "--config", write(tmp_path, quick)], ["gmeta-ds train: ", words])
    assert not (tmp_path / "out").exists()


def test_rank_without_master_address_is_refused_before_the_rendezvous(launcher_env):
    from gmeta_ds.engine.dist import init_process_group

    launcher_env.setenv("RANK", "0")
    launcher_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"MASTER_ADDR, MASTER_PORT not set, but RANK=0 is"):
        init_process_group(600)


def test_a_missing_peer_ends_in_a_timeout_naming_the_rendezvous(tmp_path):
    """WORLD_SIZE=2 and only rank 0: the rendezvous waits train.collective_timeout_s, then
    exit 3 naming MASTER_ADDR:MASTER_PORT, the world size and the key (was DistStoreError)."""
    from gmeta_ds.engine.dist import free_port

    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-I", "-m", "gmeta_ds.cli", "train", "--config", write(tmp_path, TINY),
           "--set", "train.collective_timeout_s=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for words in ("gmeta-ds train: ", "not all WORLD_SIZE=2 ranks joined the rendezvous at "
                  f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} within train.collective_timeout_s=2 s"):
        assert words in proc.stderr, proc.stderr[-3000:]


def test_a_registered_model_that_breaks_the_contract_is_refused_by_validate(tmp_path, capsys):
    """gmeta-ds validate (and train, before its first collective) runs the model once on a
    small batch: a model registered in MODELS that returns (N, 1) is named there."""
    from gmeta_ds.models.melu import MeLU
    from gmeta_ds.registry import MODELS

    class ColumnMeLU(MeLU):
        def forward(self, rows):
            return super().forward(rows).unsqueeze(-1)

    MODELS.register("column_melu", ColumnMeLU)
    try:
        cfg = {**TINY, "model": {"name": "column_melu"}}
        cli_refuses(capsys, ["validate", "--config", write(tmp_path, cfg)],
                    ["model column_melu", "model output: model(rows) returned shape (3, 1) for rows of shape (3, ",
                     "(squeeze the last dimension"])
    finally:
        MODELS._entries.pop("column_melu")
