"""Logs behind a URL and in Hive ``key=value`` folders (data/remote.py, stream_sources): the
same task store, array for array, as the plain local file; an S3 prefix on a local S3 server
(moto, 127.0.0.1) streamed through pyarrow's filesystem, its store reused while the objects
are unchanged and rebuilt when one is rewritten; store mistakes are one line naming the URL.
Cost: ~1 s for moto's server (once per module), well under a second per build."""
from __future__ import annotations

import datetime
import http.server
import logging
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_stream import SCHEMA, assert_same, frame, table_cfg

import gmeta_ds as gm
from gmeta_ds.config import SchemaConfig, config_from_dict, config_to_dict
from gmeta_ds.data.builder import build_tasks, store_path
from gmeta_ds.data.partitions import hive_partitions
from gmeta_ds.data.readers import DataError

SKIP = ("cache", "build_s", "build_phases_s", "source")  # "source" names the path
BY_DAY = SchemaConfig(**{**SCHEMA, "timestamp": "day"})  # the partition folder's date as the time
SECRET = "s3cr3t-never-printed"


def day_log(tmp_path):
    """(one Parquet file with a ``day`` date column, the same rows in ``day=YYYY-MM-DD``
    folders without it); rows sorted by day, so row numbers run alike in both."""
    df = frame(seed=1)
    df["day"] = [datetime.date(2026, 11, 1 + u % 3) for u in range(len(df))]
    df = df.sort_values("day", kind="stable").reset_index(drop=True)
    one = tmp_path / "one.parquet"
    df.to_parquet(one)
    hive = tmp_path / "hive"
    for day, part in df.groupby("day", sort=True):
        folder = hive / f"day={day}"
        folder.mkdir(parents=True)
        pq.write_table(pa.Table.from_pandas(part.drop(columns="day"), preserve_index=False),
                       folder / "part-00000.parquet")
    (hive / "_SUCCESS").write_text("")
    return one, hive


def cfg_for(path, tmp_path, **kw):
    return table_cfg(path, tmp_path, schema=BY_DAY, split="time", **kw)


def test_hive_folders_file_urls_and_globs_build_the_plain_files_store(tmp_path):
    one, hive = day_log(tmp_path)
    plain = build_tasks(cfg_for(one, tmp_path), seed=0)
    for path in (hive, f"file://{hive}", f"file://{hive}/day=*/*.parquet"):
        assert_same(plain, build_tasks(cfg_for(path, tmp_path), seed=0), SKIP)


def test_hive_partition_values_are_typed_and_unescaped():
    files = [f"/d/date=2026-11-0{k}/n={k}/city=S%C3%A3o Paulo/part.parquet" for k in (1, 2)]
    files.append("/d/date=2026-11-03/n=__HIVE_DEFAULT_PARTITION__/city=x/part.parquet")
    parts = hive_partitions(files, "/d")
    assert parts["date"].type == pa.date32() and parts["date"][2].as_py() == datetime.date(2026, 11, 3)
    assert parts["n"].to_pylist() == [1, 2, None] and parts["n"].type == pa.int64()
    assert parts["city"].to_pylist() == ["São Paulo", "São Paulo", "x"]
    assert hive_partitions(["/d/a=1/x.parquet", "/d/y.parquet"], "/d") == {}  # only keys every file has


# ----------------------------------------------------------------- S3 on 127.0.0.1 (moto)
@pytest.fixture(scope="module")
def s3_server():
    moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (the dev extra)")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """A boto3 client on the local server, the AWS chain pointed at it (dummy keys), and a
    bucket holding the Hive-partitioned log under ``clicks/``; yields (client, local copy)."""
    import boto3

    for key, value in {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
                       "NO_PROXY": "127.0.0.1", "AWS_CONFIG_FILE": str(tmp_path / "none"),
                       "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3")
    bucket = f"logs-{tmp_path.name.lower().replace('_', '-')}"[:60]
    client.create_bucket(Bucket=bucket)
    one, hive = day_log(tmp_path)
    for f in sorted(hive.rglob("*.parquet")):
        client.upload_file(str(f), bucket, f"clicks/{f.relative_to(hive)}")
    return client, bucket, one


def test_an_s3_prefix_builds_the_local_copys_store_through_the_cli_config_and_the_api(s3, tmp_path):
    _, bucket, one = s3
    plain = build_tasks(cfg_for(one, tmp_path), seed=0)
    remote = build_tasks(cfg_for(f"s3://{bucket}/clicks/", tmp_path), seed=0)
    assert "cache" not in remote.stats  # built, not reused
    assert_same(plain, remote, SKIP)
    api = gm.build_tasks(f"s3://{bucket}/clicks", seed=0, cache_dir=str(tmp_path / "api"), split="time",
                         **{**SCHEMA, "timestamp": "day"}, min_interactions=8, max_interactions=35,
                         query_size=4, test_fraction=0.25)
    assert_same(plain, api, SKIP)


def test_storage_options_reach_a_store_the_chain_does_not_name(s3, tmp_path, monkeypatch, s3_server):
    _, bucket, one = s3
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    options = {"endpoint_override": s3_server, "access_key": "testing", "secret_key": SECRET,
               "region": "us-east-1"}
    plain = build_tasks(cfg_for(one, tmp_path), seed=0)
    assert_same(plain, build_tasks(cfg_for(f"s3://{bucket}/clicks", tmp_path, storage_options=options), seed=0),
                SKIP)
    with pytest.raises(DataError, match=r"data.storage_options: .*pyarrow.fs.S3FileSystem") as err:
        build_tasks(cfg_for(f"s3://{bucket}/clicks", tmp_path, storage_options={**options, "endpoint": "x"}),
                    seed=0)
    assert SECRET not in str(err.value)


def test_an_unchanged_prefix_reuses_its_store_unread_and_a_rewritten_object_rebuilds(s3, tmp_path, monkeypatch):
    client, bucket, _ = s3
    cfg = cfg_for(f"s3://{bucket}/clicks/", tmp_path)
    first = build_tasks(cfg, seed=0)
    key = "clicks/day=2026-11-02/part-00000.parquet"
    with monkeypatch.context() as m:  # the reuse lists and reads metadata, never an object's bytes
        for name in ("ParquetFile", "read_schema", "read_table"):
            m.setattr(pq, name, lambda *a, **k: pytest.fail("an object was read to reuse the store"))
        again = build_tasks(cfg, seed=0)
    assert again.stats.get("cache")
    assert_same(first, again)
    before = store_path(cfg, 0)
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    table = pq.read_table(pa.BufferReader(body))
    rating = table.column("rating").to_numpy()
    table = table.set_column(table.schema.get_field_index("rating"), "rating", pa.array(6 - rating))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    client.put_object(Bucket=bucket, Key=key, Body=sink.getvalue().to_pybytes())
    rebuilt = build_tasks(cfg, seed=0)
    assert store_path(cfg, 0) != before and "cache" not in rebuilt.stats
    assert not np.array_equal(np.asarray(rebuilt.train.labels), np.asarray(first.train.labels))


def answering(status: int):
    """A server on 127.0.0.1 answering every request with ``status`` and an HTML page: a wrong
    endpoint (some other web service: 404) or a store denying the request (403)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html><body>no</body></html>")

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_store_mistakes_are_one_line_naming_the_url_and_no_secret(s3, tmp_path, monkeypatch):
    _, bucket, _ = s3
    cases = {f"s3://no-such-bucket-{bucket[-8:]}/clicks/": "bucket .* does not exist at endpoint http://127",
             f"s3://{bucket}/no/such/prefix/": "no object or prefix",
             "http://example.invalid/logs": "URL scheme 'http' is not supported"}
    for url, message in cases.items():
        with pytest.raises(DataError, match=message) as err:
            build_tasks(cfg_for(url, tmp_path), seed=0)
        assert str(err.value).startswith(f"data.path {url}") and "\n" not in str(err.value)
    for status, message in ((404, "does not exist at endpoint http://127.0.0.1"), (403, "failed: .*(403|DENIED)")):
        web = answering(status)
        try:
            monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{web.server_address[1]}")
            with pytest.raises(DataError, match=message) as err:
                build_tasks(cfg_for(f"s3://KEYID:{SECRET}@{bucket}/clicks/", tmp_path), seed=0)
        finally:
            web.shutdown()
        text = str(err.value)
        assert text.startswith(f"data.path s3://***@{bucket}/clicks/: ") and "\n" not in text
        assert SECRET not in text and "Traceback" not in text


def test_secret_storage_options_never_reach_the_summary_or_the_printed_config():
    cfg = config_from_dict({"data": {"source": "table", "path": "s3://b/logs", "storage_options": {
        "endpoint_override": "http://127.0.0.1:9000", "access_key": "AKIA1234", "secret_key": SECRET,
        "session_token": "tok-1234"}}}, "test")
    shown = config_to_dict(cfg)["data"]["storage_options"]
    assert shown == {"endpoint_override": "http://127.0.0.1:9000", "access_key": "***", "secret_key": "***",
                     "session_token": "***"}
    assert cfg.data.storage_options["secret_key"] == SECRET  # the build still gets it


def test_a_csv_object_is_staged_from_the_store_as_a_local_csv_is(s3, tmp_path):
    client, bucket, _ = s3
    local = tmp_path / "log.csv"
    frame(seed=2).to_csv(local, index=False)
    client.upload_file(str(local), bucket, "csv/log.csv")
    plain = build_tasks(table_cfg(local, tmp_path), seed=0)
    assert_same(plain, build_tasks(table_cfg(f"s3://{bucket}/csv/log.csv", tmp_path), seed=0), SKIP)



def later_days(one, tmp_path):
    """The plain file's rows of 2026-11-02 and 2026-11-03 (in order), as their own file."""
    table = pq.read_table(one)
    later = table.filter(pa.compute.greater_equal(table.column("day"), pa.scalar(datetime.date(2026, 11, 2))))
    path = tmp_path / "later.parquet"
    pq.write_table(later, path)
    return path


def test_a_partition_filter_reads_only_the_partitions_it_keeps(tmp_path):
    one, hive = day_log(tmp_path)
    (hive / "day=2026-11-01" / "part-00000.parquet").write_bytes(b"not parquet: never read")
    expected = build_tasks(cfg_for(later_days(one, tmp_path), tmp_path), seed=0)
    for where in ("day >= '2026-11-02'", "day IN ('2026-11-02', '2026-11-03')"):
        assert_same(expected, build_tasks(cfg_for(hive, tmp_path, filter=where), seed=0), SKIP)
    bad = {"ts > 3": "data.filter 'ts > 3': .*partition column\\(s\\) day",
           "day > '2027-01-01'": "keeps none of the 3 file",
           "day >=": "data.filter 'day >=': .*expected a SQL condition"}
    for where, message in bad.items():
        with pytest.raises(DataError, match=message):
            build_tasks(cfg_for(hive, tmp_path, filter=where), seed=0)
    with pytest.raises(DataError, match="has no Hive partition folders"):
        build_tasks(cfg_for(one, tmp_path, filter="day > '2026-11-01'"), seed=0)


def test_a_partition_filter_on_s3_sends_no_request_for_the_other_partitions(s3, tmp_path):
    client, bucket, one = s3
    excluded = "clicks/day=2026-11-01/part-00000.parquet"
    client.put_object(Bucket=bucket, Key=excluded, Body=b"not parquet: never read")
    requests = []

    class Seen(logging.Handler):
        def emit(self, record):
            requests.append(record.getMessage())

    seen = Seen()
    logging.getLogger("werkzeug").addHandler(seen)
    try:
        built = build_tasks(cfg_for(f"s3://{bucket}/clicks/", tmp_path, filter="day >= '2026-11-02'"), seed=0)
    finally:
        logging.getLogger("werkzeug").removeHandler(seen)
    assert_same(build_tasks(cfg_for(later_days(one, tmp_path), tmp_path), seed=0), built, SKIP)
    assert any("day=2026-11-02" in r for r in requests)  # the handler sees the server's requests
    assert not [r for r in requests if "day=2026-11-01" in r]  # one listing, then none of that day
