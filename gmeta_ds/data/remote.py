"""Logs behind a URL (``data.path: s3://bucket/logs/``): the objects under a prefix, listed
and read through pyarrow's filesystems (S3, GCS, Azure, HDFS), never copied.

Credentials and endpoints come from each store's standard chain (for S3 the ``AWS_*``
variables, ``AWS_ENDPOINT_URL`` included, ``~/.aws`` profiles and instance roles), or from
``data.storage_options``: the keyword arguments of the store's pyarrow filesystem
(``pyarrow.fs.S3FileSystem(endpoint_override=..., region=...)`` and so on).

DuckDB reads the objects through the same filesystem, handed to it as an fsspec filesystem
under the protocol `PROTOCOL`: its own httpfs extension downloads itself at run time (which
fails offline), and its ``read_parquet`` keeps the build one code path for local and remote
logs, row groups fetched with range requests under ``data.memory_limit``, each file's row
numbers as for local files. The task store stays on local disk (``data.cache_dir``).

An object's identity for the store's cache key (`object_stamps`) is its size, modification
time and, where the store gives one, its ETag or version: a rewritten object rebuilds the
store, an unchanged prefix reuses it after one listing, without reading any object.
"""
from __future__ import annotations

import fnmatch
import io
import os
import re
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs

from gmeta_ds.data.readers import DataError

# URL scheme -> the pyarrow filesystem that reads it ("file" is a local path)
SCHEMES = {"s3": "S3FileSystem", "gs": "GcsFileSystem", "gcs": "GcsFileSystem", "abfs": "AzureFileSystem",
           "abfss": "AzureFileSystem", "hdfs": "HadoopFileSystem", "viewfs": "HadoopFileSystem", "file": None}
PROTOCOL = "gmetads"  # the name DuckDB reads a URL's objects under (see the module docstring)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colour codes
# the metadata keys of an object's identity beyond size and time (S3: ETag, VersionId; GCS: generation)
IDENTITY_KEYS = ("ETag", "VersionId", "x-amz-version-id", "generation", "etag")
# environment variables whose values are secrets: never shown in a message
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_CLIENT_SECRET",
              "AZURE_STORAGE_SAS_TOKEN")


def url_scheme(path) -> str | None:
    """The scheme of a URL given as ``data.path`` (lower case), None for a local path."""
    m = _SCHEME.match(path) if isinstance(path, str) else None
    return m.group(1).lower() if m else None


def local_path(url: str) -> str:
    """The local path of a ``file://`` URL (``file:///data/logs`` -> ``/data/logs``)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise DataError(f"data.path {url}: a file:// URL names a local path (file:///data/logs), "
                        f"not host {parts.netloc!r}")
    return unquote(parts.path)


def shown(url: str) -> str:
    """``url`` for messages: credentials written into it (``s3://KEY:SECRET@bucket``) hidden."""
    parts = urlsplit(url)
    if "@" not in parts.netloc or parts.scheme.lower() in ("abfs", "abfss"):  # abfs: container@account
        return url
    return url.replace(parts.netloc, "***@" + parts.netloc.rsplit("@", 1)[1], 1)


def redact(text: str, options: dict) -> str:
    """``text`` with every secret it could hold replaced by ``***``: the values of
    ``data.storage_options`` and of the stores' secret environment variables."""
    secrets = [str(v) for v in options.values() if isinstance(v, str) and len(v) >= 4]
    secrets += [os.environ[k] for k in SECRET_ENV if len(os.environ.get(k, "")) >= 4]
    for s in sorted(secrets, key=len, reverse=True):
        text = text.replace(s, "***")
    return text


def store_error(url: str, exc: BaseException, options: dict, doing: str) -> DataError:
    """One line for a failed store request: the URL, what was being done, the store's error."""
    text = " ".join(_ANSI.sub("", str(exc)).split()) or type(exc).__name__  # deltalake colours its errors
    text = redact(text, options)
    if len(text) > 400:
        text = text[:400] + "..."
    return DataError(f"data.path {shown(url)}: {doing} failed: {text}")


def connect(url: str, options: dict) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path in it) of ``url``: `pyarrow.fs.FileSystem.from_uri` (the store's
    standard credential chain), or the scheme's filesystem built from ``data.storage_options``."""
    scheme = url_scheme(url)
    if scheme not in SCHEMES or scheme == "file":
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise DataError(f"data.path {shown(url)}: URL scheme {scheme!r} is not supported; expected one of {known}")
    try:
        if not options:
            return pafs.FileSystem.from_uri(url)
        cls = getattr(pafs, SCHEMES[scheme])
        parts = urlsplit(url)
        host = parts.netloc.rsplit("@", 1)[-1]
        if scheme in ("abfs", "abfss"):
            return cls(**options), (parts.netloc.split("@")[0] + parts.path).rstrip("/")
        if scheme in ("hdfs", "viewfs"):
            return cls(**{"host": host.split(":")[0], **options}), parts.path.rstrip("/") or "/"
        return cls(**options), (host + parts.path).rstrip("/")
    except TypeError as exc:  # an option the filesystem does not take
        raise DataError(f"data.storage_options: {redact(str(exc), options)}; expected keyword arguments of "
                        f"pyarrow.fs.{SCHEMES[scheme]}") from None
    except (OSError, ValueError) as exc:
        raise store_error(url, exc, options, "connecting to the store") from None


def list_objects(url: str, options: dict) -> tuple[pafs.FileSystem, str, list[pafs.FileInfo]]:
    """(filesystem, base path, the objects) behind ``url``: one object, every object under a
    prefix (recursively), or those matching a glob in the URL (``s3://b/logs/date=*/*.parquet``);
    sorted by path. The base path is the prefix Hive partitions are read below."""
    fs, path = connect(url, options)
    glob = any(ch in path for ch in "*?[")
    base = path
    if glob:
        base = "/".join(p for p in path.split("/")[:_first_glob(path)])
    try:
        top = fs.get_file_info(base)
        if top.type == pafs.FileType.File and not glob:
            return fs, base.rsplit("/", 1)[0], [top]
        if top.type == pafs.FileType.NotFound:
            bucket = base.split("/")[0]
            if url_scheme(url) in ("s3", "gs", "gcs") and fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                at = _endpoint(url, options)
                raise DataError(f"data.path {shown(url)}: the bucket {bucket!r} does not exist{at} (or these "
                                "credentials cannot see it); check the bucket's name and the endpoint")
            raise DataError(f"data.path {shown(url)}: no object or prefix {base!r} in the store")
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    except DataError:
        raise
    except (OSError, ValueError) as exc:
        raise store_error(url, exc, options, "listing the objects") from None
    files = [i for i in infos if i.type == pafs.FileType.File and (not glob or fnmatch.fnmatchcase(i.path, path))]
    return fs, base, sorted(files, key=lambda i: i.path)


def _endpoint(url: str, options: dict) -> str:
    """" at endpoint E" for an S3 URL whose endpoint is set (options, then AWS_ENDPOINT_URL_S3,
    AWS_ENDPOINT_URL), else ""."""
    if url_scheme(url) != "s3":
        return ""
    e = options.get("endpoint_override") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f" at endpoint {redact(str(e), options)}" if e else ""


def _first_glob(path: str) -> int:
    """The index of the first component of ``path`` holding a glob character."""
    return next(k for k, part in enumerate(path.split("/")) if any(ch in part for ch in "*?["))


def object_stamps(url: str, fs: pafs.FileSystem, base: str, infos: list[pafs.FileInfo],
                  options: dict) -> list[list]:
    """Each object's identity: [path below the base, size, modification time (ns), ETag /
    version where the store's metadata has one]. Reads metadata only (one HEAD per object on S3)."""
    stamps = []
    for info in infos:
        tags = []
        try:
            with fs.open_input_file(info.path) as f:
                meta = f.metadata() or {}
            tags = [f"{k}={_text(meta[k])}" for k in IDENTITY_KEYS if k in meta]
        except NotImplementedError:  # a store without object metadata: size and time only
            pass
        except (OSError, ValueError) as exc:
            raise store_error(url, exc, options, f"reading the metadata of {info.path!r}") from None
        stamps.append([info.path[len(base):].lstrip("/"), info.size, info.mtime_ns, *tags])
    return stamps


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def duckdb_filesystem(fs: pafs.FileSystem):
    """``fs`` as an fsspec filesystem under `PROTOCOL`, for ``duckdb.register_filesystem``: a
    file ``p`` of ``fs`` is ``gmetads://p`` in DuckDB's queries. Each object's metadata is
    asked once and each object opened once: DuckDB asks a file's size and opens it for every
    scan and thread (each a HEAD request on S3, 211 in a 37k-row build before this cache)."""
    from fsspec.implementations.arrow import ArrowFSWrapper

    class StoreFS(ArrowFSWrapper):
        protocol = PROTOCOL

        def __init__(self, fs, **kwargs):
            super().__init__(fs, **kwargs)
            self.known: dict[str, pafs.FileInfo] = {}
            self.opened: dict[str, object] = {}

        @classmethod
        def _strip_protocol(cls, path):
            path = path[len(PROTOCOL) + 3:] if path.startswith(PROTOCOL + "://") else path
            return path.rstrip("/") or "/"

        def file_info(self, path: str) -> pafs.FileInfo:
            path = self._strip_protocol(path)
            if path not in self.known:
                self.known[path] = self.fs.get_file_info(path)
            return self.known[path]

        def info(self, path, **kwargs):
            return self._make_entry(self.file_info(path))

        def modified(self, path):
            return self.file_info(path).mtime

        def glob(self, path, **kwargs):  # DuckDB globs each listed file on every scan
            if any(ch in path for ch in "*?["):
                return super().glob(path, **kwargs)
            info = self.file_info(path)
            return [info.path] if info.type == pafs.FileType.File else []

        def _open(self, path, mode="rb", block_size=None, seekable=True, **kwargs):
            if mode != "rb" or not seekable:
                return super()._open(path, mode, block_size, seekable, **kwargs)
            path = self._strip_protocol(path)
            if path not in self.opened:  # opening is a request (S3: a HEAD); reading at offsets is not
                self.opened[path] = self.fs.open_input_file(path)
            return RangeReader(self.opened[path], self.file_info(path).size)


    return StoreFS(fs, skip_instance_cache=True)


class RangeReader(io.RawIOBase):
    """A read-only file over an opened object of ``size`` bytes, with a position of its own:
    its reads are ``read_at`` calls (range requests, safe from several threads), so every scan
    shares one opened object."""

    def __init__(self, native, size: int) -> None:
        super().__init__()
        self.native, self.size, self.pos = native, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, start + offset)
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        if n <= 0:
            return b""
        data = self.native.read_at(n, self.pos)
        data = data.to_pybytes() if hasattr(data, "to_pybytes") else bytes(data)
        self.pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)
