"""Logs behind an ``s3://`` URL trained by the CLI on two warm ranks (issue 52): a
Hive-partitioned Parquet prefix on a local S3 server (moto, 127.0.0.1) trains at world 2 the
model the local copy of the same prefix trains in one process, from a task store of the same
bytes; ranks that read different versions of a Delta table fail alike, before training,
saying what each read. Cost: ~1 s for moto's server (once per module), ~4 s for the two runs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import REPO, assert_same_model, gmeta_ranks, summary, tiny_config

pytestmark = [pytest.mark.launcher, pytest.mark.distributed]

SCHEMA = {"task_key": "user", "item_key": "item", "label": "rating", "item_features": ["cat"]}


def click_log() -> pd.DataFrame:
    """A small click log, each user's rows on one of three days (``day``)."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(10, 30, 40)
    user = np.repeat(np.arange(40), lengths)
    item = rng.zipf(1.4, len(user)) % 120
    return pd.DataFrame({"user": [f"u{u}" for u in user], "item": item.astype(np.int64),
                         "rating": rng.integers(1, 6, len(user)).astype(np.float32),
                         "cat": [f"c{i % 6}" for i in item], "day": [f"2026-11-0{1 + u % 3}" for u in user]})


def hive_log(folder: Path) -> Path:
    """`click_log` as ``day=YYYY-MM-DD/part-00000.parquet`` folders under ``folder``."""
    for day, part in click_log().groupby("day", sort=True):
        (folder / f"day={day}").mkdir(parents=True)
        part.drop(columns="day").to_parquet(folder / f"day={day}" / "part-00000.parquet", index=False)
    return folder


@pytest.fixture(scope="module")
def s3_server():
    moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (the dev extra)")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()  # a thread of this process: the ranks read from their own processes
    yield f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    server.stop()


def s3_env(endpoint: str, tmp_path: Path) -> dict:
    """The AWS chain of every rank pointed at the local server (dummy keys, no profile files)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "NO_PROXY": "127.0.0.1", "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}


def upload(endpoint: str, folder: Path, bucket: str, prefix: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    for f in sorted(folder.rglob("*.parquet")):
        client.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(folder)}")


def table_config(root: Path, tag: str, path: str) -> Path:
    return tiny_config(root / tag, data={
        "source": "table", "path": path, "cache_dir": str(root / "cache" / tag), "query_size": 4,
        "min_interactions": 8, "max_interactions": 35, "test_fraction": 0.25, "schema": SCHEMA},
        train={"meta_steps": 3, "log_every": 1, "tensorboard": False})


def store_content(cache: Path) -> dict:
    """The one task store under ``cache``: its fields and every array's dtype, shape and checksum."""
    stores = sorted(cache.glob("tasks-*/manifest.json"))
    assert len(stores) == 1, stores
    manifest = json.loads(stores[0].read_text())
    return {k: manifest[k] for k in ("fields", "splits", "vocab", "label")}


def test_an_s3_prefix_on_two_ranks_trains_the_local_copys_model_from_the_same_store(s3_server, tmp_path):
    local = hive_log(tmp_path / "logs")
    upload(s3_server, local, "clicks-two-ranks", "logs/v1")
    remote = table_config(tmp_path, "s3", "s3://clicks-two-ranks/logs/v1/")
    gmeta_ranks(2, "train", "--config", remote, env=s3_env(s3_server, tmp_path))
    plain = table_config(tmp_path, "local", str(local))
    gmeta_ranks(1, "train", "--config", plain)
    two, one = summary(remote), summary(plain)
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert_same_model(one, two)
    assert store_content(tmp_path / "cache" / "s3") == store_content(tmp_path / "cache" / "local")


PER_RANK = """import os, sys
from gmeta_ds.cli import main
sys.exit(main(["train", "--config", sys.argv[1], "--set", f"data.version_as_of={os.environ['RANK']}"]))
"""


def test_ranks_that_read_different_table_versions_fail_alike_before_training(tmp_path):
    """Rank r pins version r of a Delta table, as if a commit had landed between the ranks'
    reads of its latest version: every rank exits 2 naming the path and each rank's version."""
    deltalake = pytest.importorskip("deltalake", reason="needs deltalake (the delta and dev extras)")
    log, table = click_log(), tmp_path / "clicks"
    deltalake.write_deltalake(str(table), log[log.day < "2026-11-03"], partition_by=["day"])
    deltalake.write_deltalake(str(table), log[log.day == "2026-11-03"], partition_by=["day"], mode="append")
    config = table_config(tmp_path, "delta", str(table))
    script = tmp_path / "per_rank.py"
    script.write_text(PER_RANK)
    from pool import pool

    result = pool().run({"kind": "script", "script": str(script), "args": [str(config)]}, 2, cwd=REPO, timeout=240)
    assert result.codes == [2, 2], result.stderr
    expected = (f"gmeta-ds train: data.path {table}: the ranks read different versions of the table (rank 0: "
                "Delta table version 0; rank 1: Delta table version 1); a commit landed while they started: "
                "pin data.version_as_of")
    for err in result.rank_stderr:
        assert expected in err and "Traceback" not in err, err
    assert not (tmp_path / "delta" / "run" / "metrics.jsonl").exists()
