"""Delta Lake tables as logs (data/delta.py): the store the same rows give as plain Parquet,
byte for byte; a version or a time pins a snapshot, recorded with the store and keying it
(a new commit rebuilds, the same version reuses); a partition filter leaves the other
partitions' files unread; mistakes are one line naming the path and the key, exit 2 in the
CLI; a table on a local S3 server (moto, in its own process: deltalake's reader holds the
GIL, so a server thread of this process would starve) reads like the local one.
Cost: ~0.3 s per build, ~2 s for the S3 server (once per module)."""
from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from test_remote_logs import SECRET, cfg_for, day_log, later_days
from test_stream import SCHEMA, assert_same

import gmeta_ds as gm
from gmeta_ds.cli import main
from gmeta_ds.config import config_from_dict
from gmeta_ds.data.builder import build_tasks, store_path
from gmeta_ds.data.readers import DataError
from gmeta_ds.errors import ConfigError

deltalake = pytest.importorskip("deltalake", reason="needs deltalake (the delta and dev extras)")

SKIP = ("cache", "build_s", "build_phases_s", "source", "snapshot")


def write_days(one, target, days, mode="error", storage_options=None):
    """The plain file's rows of ``days`` appended to the Delta table at ``target`` (one commit),
    partitioned by ``day``."""
    table = pq.read_table(one)
    keep = pa.compute.is_in(table.column("day"), pa.array([datetime.date(2026, 11, d) for d in days]))
    deltalake.write_deltalake(str(target), table.filter(keep), partition_by=["day"], mode=mode,
                              storage_options=storage_options)


def first_day(one, tmp_path):
    table = pq.read_table(one)
    path = tmp_path / "first.parquet"
    pq.write_table(table.filter(pa.compute.equal(table.column("day"), pa.scalar(datetime.date(2026, 11, 1)))), path)
    return path


def same_bytes(a, b) -> None:
    """Two stores' arrays are byte-identical: every array's checksum in their manifests."""
    ma, mb = (json.loads((store_path(c, 0) / "manifest.json").read_text()) for c in (a, b))
    assert ma["splits"] == mb["splits"] and ma["vocab"] == mb["vocab"]


def test_a_delta_table_gives_the_store_of_its_rows_as_plain_parquet(tmp_path):
    one, _ = day_log(tmp_path)
    table = tmp_path / "delta"
    write_days(one, table, (1,))
    write_days(one, table, (1, 2, 3), mode="overwrite")  # v0's file stays on disk, no longer in the table
    plain_cfg = cfg_for(one, tmp_path)
    plain = build_tasks(plain_cfg, seed=0)
    for path in (table, f"file://{table}"):
        cfg = cfg_for(path, tmp_path)
        built = build_tasks(cfg, seed=0)
        assert_same(plain, built, SKIP)
        same_bytes(plain_cfg, cfg)
        assert built.stats["snapshot"]["version"] == 1 and built.stats["snapshot"]["format"] == "delta"
    api = gm.build_tasks(str(table), seed=0, cache_dir=str(tmp_path / "api"), split="time",
                         **{**SCHEMA, "timestamp": "day"}, min_interactions=8, max_interactions=35,
                         query_size=4, test_fraction=0.25, version_as_of=1)
    assert_same(plain, api, SKIP)


def test_a_version_or_a_time_pins_a_snapshot_that_keys_the_store(tmp_path):
    one, _ = day_log(tmp_path)
    table = tmp_path / "delta"
    write_days(one, table, (1,))
    time.sleep(0.3)  # commits well apart: a time between them names v0 under any load
    write_days(one, table, (2, 3), mode="append")
    latest = build_tasks(cfg_for(table, tmp_path), seed=0)
    assert_same(build_tasks(cfg_for(one, tmp_path), seed=0), latest, SKIP)  # v0 + v1: every day
    assert latest.stats["snapshot"]["version"] == 1 and "cache" not in latest.stats
    v0 = build_tasks(cfg_for(table, tmp_path, version_as_of=0), seed=0)
    assert_same(build_tasks(cfg_for(first_day(one, tmp_path), tmp_path), seed=0), v0, SKIP)
    assert v0.stats["snapshot"]["version"] == 0
    v0_at = datetime.datetime.fromisoformat(v0.stats["snapshot"]["committed_at"])
    v1_at = datetime.datetime.fromisoformat(latest.stats["snapshot"]["committed_at"])
    before_v1 = (v0_at + (v1_at - v0_at) / 2).isoformat()
    by_time = build_tasks(cfg_for(table, tmp_path, timestamp_as_of=before_v1), seed=0)
    assert by_time.stats["snapshot"]["version"] == 0 and by_time.stats.get("cache")  # v0's store, reused
    assert build_tasks(cfg_for(table, tmp_path), seed=0).stats.get("cache")  # unchanged: reused
    write_days(one, table, (3,), mode="append")  # v2
    rebuilt = build_tasks(cfg_for(table, tmp_path), seed=0)
    assert rebuilt.stats["snapshot"]["version"] == 2 and "cache" not in rebuilt.stats
    assert store_path(cfg_for(table, tmp_path), 0) != store_path(cfg_for(table, tmp_path, version_as_of=1), 0)
    assert build_tasks(cfg_for(table, tmp_path, version_as_of=1), seed=0).stats.get("cache")


def test_the_version_read_goes_to_summary_json(tmp_path):
    """What the training run adds to summary.json (`CTRWorkload.finish`'s extra keys)."""
    import types

    import torch

    from gmeta_ds.workloads.base import Built
    from gmeta_ds.workloads.ctr import CTRWorkload

    one, _ = day_log(tmp_path)
    write_days(one, tmp_path / "delta", (1, 2, 3))
    data = build_tasks(cfg_for(tmp_path / "delta", tmp_path), seed=0)
    cfg = config_from_dict({"output_dir": str(tmp_path / "out"), "eval": {"enabled": False}}, "test")
    (tmp_path / "out").mkdir()
    engine = types.SimpleNamespace(module=torch.nn.Linear(2, 1))
    _, extras = CTRWorkload().finish(cfg, engine, Built(learner=engine.module, data=data), 0, 1)
    assert extras == {"data_snapshot": data.stats["snapshot"]}
    assert extras["data_snapshot"]["version"] == 0 and extras["data_snapshot"]["table"] == str(tmp_path / "delta")


def test_a_partition_filter_reads_only_the_kept_partitions_files(tmp_path):
    one, _ = day_log(tmp_path)
    table = tmp_path / "delta"
    write_days(one, table, (2,))
    write_days(one, table, (1, 2, 3), mode="overwrite")  # v0's day-2 file stays on disk, unread
    for f in (table / "day=2026-11-01").glob("*.parquet"):
        f.write_bytes(b"not parquet: never read")
    expected = build_tasks(cfg_for(later_days(one, tmp_path), tmp_path), seed=0)
    assert_same(expected, build_tasks(cfg_for(table, tmp_path, filter="day >= '2026-11-02'"), seed=0), SKIP)


def one_line(err, *parts) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text, text
    for part in parts:
        assert part in text, text
    return text


def test_delta_mistakes_are_one_line_naming_the_path_and_the_key(tmp_path):
    one, hive = day_log(tmp_path)
    table = tmp_path / "delta"
    write_days(one, table, (1, 2))
    cases = [({"path": hive, "format": "delta"}, [f"data.path {hive}: not a Delta table (no _delta_log/"]),
             ({"path": tmp_path / "none", "format": "delta"}, ["not a Delta table (no such folder)"]),
             ({"path": table, "version_as_of": 4}, [f"data.version_as_of 4: the Delta table at {table} has",
                                                    "versions 0 to 0"]),
             ({"path": table, "timestamp_as_of": "2000-01-01"}, ["data.timestamp_as_of '2000-01-01': before the",
                                                                f"first commit of the Delta table at {table}"]),
             ({"path": hive, "version_as_of": 0}, [f"data.version_as_of: set, but data.path {hive} is not a Delta"])]
    for kw, parts in cases:
        with pytest.raises(DataError) as err:
            build_tasks(cfg_for(kw.pop("path"), tmp_path, **kw), seed=0)
        one_line(err, *parts)
    bad = {"version_as_of": 0, "timestamp_as_of": "2026-11-30"}
    with pytest.raises(ConfigError) as err:
        gm.build_tasks(str(table), task_key="user", item_key="item", label="rating", **bad)
    assert "data.version_as_of (0) and data.timestamp_as_of ('2026-11-30'): both set" in str(err.value)
    for data, message in (({"timestamp_as_of": "yesterday"}, "data.timestamp_as_of: 'yesterday' is not an ISO 8601"),
                          ({"format": "parquet", "version_as_of": 1}, "only a Delta table has versions"),
                          ({"version_as_of": -1}, "data.version_as_of: -1 must be >= 0")):
        with pytest.raises(ConfigError, match=message):
            config_from_dict({"data": {"source": "table", "path": str(table), **data}}, "test")


def cli_config(tmp_path, path, **data) -> str:
    cfg = {"output_dir": str(tmp_path / "out"), "model": {"embed_dim": 4, "hidden": [8]},
           "meta": {"tasks_per_micro_batch": 4, "tasks_per_meta_step": 8},
           "data": {"source": "table", "path": str(path), "cache_dir": str(tmp_path / "cache"),
                    "schema": {**SCHEMA, "timestamp": "day"}, "split": "time", "min_interactions": 8,
                    "max_interactions": 35, "query_size": 4, "test_fraction": 0.25, **data},
           "train": {"meta_steps": 2, "progress": False}, "deepspeed": "ds_configs/zero1.json"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "c.yaml")


def test_validate_on_a_delta_table_names_the_version_and_mistakes_exit_2(tmp_path, capsys):
    one, _ = day_log(tmp_path)
    table = tmp_path / "delta"
    write_days(one, table, (1, 2, 3))
    assert main(["validate", "--config", cli_config(tmp_path, table, version_as_of=0)]) == 0
    out = capsys.readouterr().out
    assert "(Delta table version 0, committed 20" in out and "config OK" in out
    for data, message in (({"version_as_of": 3}, f"data.version_as_of 3: the Delta table at {table} has versions"),
                          ({"version_as_of": 0, "timestamp_as_of": "2026-11-30"}, "both set")):
        assert main(["validate", "--config", cli_config(tmp_path, table, **data)]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


# ----------------------------------------------------------------- S3 on 127.0.0.1 (moto)
@pytest.fixture(scope="module")
def s3_process():
    """moto's S3 server in a process of its own (see the module docstring)."""
    pytest.importorskip("moto.server", reason="needs moto[server] (the dev extra)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("moto's S3 server did not start within 30 s")
            time.sleep(0.1)
    yield url
    server.terminate()
    server.wait(timeout=10)


def test_a_delta_table_on_s3_reads_like_the_local_one(s3_process, tmp_path, monkeypatch):
    import boto3

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": SECRET,
                       "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": "127.0.0.1",
                       "AWS_CONFIG_FILE": str(tmp_path / "none"),
                       "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    bucket = f"delta-{tmp_path.name.lower().replace('_', '-')}"[:60]
    boto3.client("s3", endpoint_url=s3_process).create_bucket(Bucket=bucket)
    one, _ = day_log(tmp_path)
    write_days(one, f"s3://{bucket}/clicks", (1, 2, 3), storage_options={
        "AWS_ENDPOINT_URL": s3_process, "AWS_ALLOW_HTTP": "true", "AWS_S3_ALLOW_UNSAFE_RENAME": "true"})
    options = {"endpoint_override": s3_process, "access_key": "testing", "secret_key": SECRET,
               "region": "us-east-1"}
    remote = build_tasks(cfg_for(f"s3://{bucket}/clicks", tmp_path, storage_options=options), seed=0)
    assert_same(build_tasks(cfg_for(one, tmp_path), seed=0), remote, SKIP)
    assert remote.stats["snapshot"]["table"] == f"s3://{bucket}/clicks"
    with pytest.raises(DataError) as err:
        build_tasks(cfg_for(f"s3://{bucket}/clicks", tmp_path, format="delta",
                            storage_options={**options, "proxy_options": "http://127.0.0.1:9"}), seed=0)
    assert SECRET not in one_line(err, "data.storage_options: proxy_options cannot be passed on to deltalake")
