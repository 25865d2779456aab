"""Delta Lake tables as logs (``data.format: delta``, or a folder holding ``_delta_log/``
under ``data.format: auto``): local, or behind an ``s3://``, ``gs://`` or ``abfs://`` URL.

The ``deltalake`` package (the ``delta`` extra) reads the table's log and pins a snapshot
(``data.version_as_of``, ``data.timestamp_as_of``, else the latest version); its Arrow dataset
(`deltalake.DeltaTable.to_pyarrow_dataset`) gives the snapshot's Parquet files and each file's
partition values, typed by the table's schema. The build reads those files as it reads a
folder of Hive partitions (`stream_sources.file_source`, then DuckDB): local files directly,
a URL's objects through the same pyarrow filesystem (`remote.connect`), so a Delta table gives
the store the same rows give as plain Parquet, and ``data.filter`` on its partition columns
leaves the other partitions' files unread. Files come in path order, as a folder's do.

A version is immutable: the store's cache key is the table's id and the version read, so a
new commit rebuilds the store and the same version reuses it without reading a data file.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from gmeta_ds.config.data import parse_as_of
from gmeta_ds.data import remote
from gmeta_ds.data.readers import DataError

DELTA_LOG = "_delta_log"
# data.storage_options (pyarrow.fs.S3FileSystem's keywords) -> the object_store keys deltalake
# reads the table's log with; the data files are read with the options as they are
S3_KEYS = {"endpoint_override": "aws_endpoint", "access_key": "aws_access_key_id",
           "secret_key": "aws_secret_access_key", "session_token": "aws_session_token", "region": "aws_region"}


@dataclass
class Snapshot:
    """One version of a Delta table: its Parquet ``files`` (paths in ``filesystem``; None:
    local), each file's ``partitions`` values, and ``info`` (format, table, version, its
    commit time, the table's id) for summary.json and the store's cache key."""

    files: list[str]
    filesystem: pafs.FileSystem | None
    partitions: dict[str, pa.Array]
    info: dict


def holds_table(path: str, options: dict) -> bool:
    """Whether ``data.path`` (a local folder or a URL's prefix) holds a ``_delta_log/`` folder."""
    scheme = remote.url_scheme(path)
    if scheme is None or scheme == "file":
        local = remote.local_path(path) if scheme else path
        return (Path(local).expanduser() / DELTA_LOG).is_dir()
    if any(ch in path for ch in "*?["):
        return False
    fs, root = remote.connect(path, options)
    try:
        return fs.get_file_info(f"{root}/{DELTA_LOG}").type == pafs.FileType.Directory
    except (OSError, ValueError) as exc:
        raise remote.store_error(path, exc, options, "looking for a Delta table's _delta_log/") from None


def snapshot(path: str, options: dict, version: int | None, timestamp: str | None) -> Snapshot:
    """The pinned (or latest) snapshot of the Delta table at ``path``; a `DataError` naming the
    path and the key for a folder that is no Delta table, a version it does not have, a time
    before its first commit, or a table deltalake's Arrow reader cannot read."""
    deltalake = _deltalake(path)
    shown = remote.shown(path)
    scheme = remote.url_scheme(path)
    local = scheme is None or scheme == "file"
    root = str(Path(remote.local_path(path) if scheme else path).expanduser().resolve()) if local else None
    if local and not (Path(root) / DELTA_LOG).is_dir():
        what = "no such folder" if not Path(root).exists() else f"no {DELTA_LOG}/ folder there"
        raise DataError(f"data.path {shown}: not a Delta table ({what}); data.format: delta reads the folder "
                        f"of a Delta Lake table, the one holding {DELTA_LOG}/")
    fs, base = (pafs.LocalFileSystem(), root) if local else remote.connect(path, options)
    try:
        table = deltalake.DeltaTable(root if local else path, storage_options=_log_options(path, options))
        committed = _pin(table, shown, version, timestamp)
        dataset = table.to_pyarrow_dataset(filesystem=pafs.SubTreeFileSystem(base, fs))
    except DataError:
        raise
    except deltalake.exceptions.TableNotFoundError:
        raise DataError(f"data.path {shown}: not a Delta table (no readable {DELTA_LOG}/ there); data.format: "
                        f"delta reads the folder of a Delta Lake table, the one holding {DELTA_LOG}/") from None
    except deltalake.exceptions.DeltaProtocolError as exc:
        raise DataError(f"data.path {shown}: this Delta table cannot be read as plain Parquet files: "
                        f"{' '.join(str(exc).split())}") from None
    except (deltalake.exceptions.DeltaError, OSError, ValueError) as exc:
        raise remote.store_error(path, exc, options, "reading the Delta table's log") from None
    fragments = sorted(dataset.get_fragments(), key=lambda f: f.path)
    if not fragments:
        raise DataError(f"data.path {shown}: version {table.version()} of this Delta table holds no data file")
    files = [f"{base}/{f.path}" for f in fragments]
    return Snapshot(files, None if local else fs, _partition_values(table, dataset, fragments),
                    {"format": "delta", "table": shown, "version": table.version(),
                     "committed_at": _time(committed).isoformat() if committed is not None else None,
                     "table_id": table.metadata().id})


def _deltalake(path: str):
    try:
        import deltalake
    except ImportError:
        raise DataError(f"data.path {remote.shown(path)}: reading a Delta table needs the deltalake package: "
                        "pip install 'gmeta-ds[delta]'") from None
    return deltalake


def _log_options(path: str, options: dict) -> dict:
    """``data.storage_options`` as deltalake's object_store keys (an S3 endpoint over plain
    http, e.g. a local test server, allowed as pyarrow allows it); {} for local tables and
    other stores, whose log is read with the store's standard chain (options for them are
    refused rather than left unused)."""
    scheme = remote.url_scheme(path)
    if scheme != "s3":
        if options and scheme not in (None, "file"):
            raise DataError(f"data.storage_options: passed on to deltalake for an s3:// Delta table only; the log "
                            f"of the one at {remote.shown(path)} is read with the store's standard chain "
                            "(its environment variables): give the credentials there")
        return {}
    unknown = sorted(set(options) - set(S3_KEYS) - {"scheme"})
    if unknown:
        raise DataError(f"data.storage_options: {', '.join(unknown)} cannot be passed on to deltalake, which "
                        f"reads the Delta table's log at {remote.shown(path)}; expected among "
                        f"{', '.join(S3_KEYS)}, scheme")
    out = {S3_KEYS[k]: str(v) for k, v in options.items() if k in S3_KEYS}
    endpoint = out.get("aws_endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        out["aws_endpoint"] = endpoint
    if options.get("scheme") == "http" or str(endpoint or "").startswith("http://"):
        out["aws_allow_http"] = "true"
    return out


def _pin(table, shown: str, version: int | None, timestamp: str | None) -> int | None:
    """Load ``version`` or the last commit at or before ``timestamp`` (neither: stay at the
    latest); a version the table does not have, or a time before its first commit, is an
    error. Returns the loaded version's commit time (ms since the epoch; None if unknown)."""
    if version is None and timestamp is None:
        latest = table.history(1)
        return latest[0].get("timestamp") if latest else None
    commits = {c["version"]: c["timestamp"] for c in table.history()}
    first, latest = min(commits), table.version()
    if version is not None:
        if not first <= version <= latest:
            raise DataError(f"data.version_as_of {version}: the Delta table at {shown} has versions {first} to "
                            f"{latest}")
        table.load_as_version(version)
        return commits.get(version)
    when = parse_as_of(timestamp)
    if when < _time(commits[first]):
        raise DataError(f"data.timestamp_as_of {timestamp!r}: before the first commit of the Delta table at "
                        f"{shown} ({_time(commits[first]).isoformat()}, version {first})")
    table.load_as_version(when)
    return commits.get(table.version())


def _time(ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC)


def _partition_values(table, dataset, fragments) -> dict[str, pa.Array]:
    """Each fragment's value of every partition column, typed as the table's schema types it."""
    import pyarrow.dataset as ds

    keys = [ds.get_partition_keys(f.partition_expression) for f in fragments]
    return {c: pa.array([k.get(c) for k in keys], dataset.schema.field(c).type)
            for c in table.metadata().partition_columns}
