"""Where trajpipe's stores live: one storage layer for local disks and S3-compatible object stores.

Two parts:

* **Locations.** :func:`resolve` turns a location -- a local path, a ``file://`` URI or an
  ``s3://bucket/key`` URI -- into a ``pyarrow.fs.FileSystem`` and the path on it, so Parquet
  readers and writers (pyarrow, DuckDB, polars) work the same on either.
  :func:`delta_storage_options` gives the ``storage_options`` delta-rs (``deltalake``, polars'
  ``scan_delta``) needs for the same location. S3 settings come from the standard AWS
  environment variables (:class:`S3Settings`); the secret is never part of a repr or a log line.
  :func:`local_path` is for the commands whose writers are still local-only: it returns the local
  path or raises :class:`RemoteStorageNotSupported` naming the flag (no silent ``gs:/bucket``
  directory on a worker's disk).
* **Durable local writes.** :func:`atomic_write` and :func:`fsync_dir`: a file becomes visible
  only complete (temporary name, fsync, rename, directory fsync).

Examples:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> atomic_write(d / "m.json", b"{}")
    >>> (d / "m.json").read_bytes(), sorted(p.name for p in d.iterdir())
    (b'{}', ['m.json'])
    >>> fs, path = resolve(f"file://{d}/m.json")
    >>> type(fs).__name__, path == f"{d}/m.json"
    ('LocalFileSystem', True)
    >>> scheme_of("s3://bucket/datasets"), scheme_of("/tmp/x"), scheme_of("file:///tmp/x")
    ('s3', None, 'file')
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow.fs as pafs

__all__ = [
    "fsync_dir", "atomic_write",
    "StorageError", "RemoteStorageNotSupported", "S3Settings",
    "scheme_of", "resolve", "delta_storage_options", "local_path",
]

#: URI schemes :func:`resolve` serves (``None``: a plain local path).
SUPPORTED_SCHEMES = (None, "file", "s3")
# A URI scheme (RFC 3986): a letter, then letters, digits, + - . -- at least two characters, so a
# Windows drive letter (``C:``) is not one. Also matches what pathlib leaves of ``gs://b`` (``gs:/b``).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):")


class StorageError(ValueError):
    """A location that cannot be used: unknown scheme, malformed URI, missing setting; the message says which."""


class RemoteStorageNotSupported(StorageError):
    """An object-store URI given where trajpipe still writes or reads local files only (issue 14)."""


def fsync_dir(path: Path) -> None:
    """fsync a directory, making renames and creations inside it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (tmp + fsync + rename + dir fsync)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@dataclass(frozen=True)
class S3Settings:
    """How to reach an S3-compatible store, read from the standard AWS environment variables.

    Attributes:
        endpoint: ``AWS_ENDPOINT_URL_S3`` or else ``AWS_ENDPOINT_URL``, e.g. ``http://127.0.0.1:8333``
            (SeaweedFS, another S3-compatible server); ``None``: AWS S3 itself.
        region: ``AWS_REGION`` or else ``AWS_DEFAULT_REGION``; ``us-east-1`` when neither is set.
        access_key: ``AWS_ACCESS_KEY_ID``; ``None``: the SDKs' default chain (profile, instance role).
        secret_key: ``AWS_SECRET_ACCESS_KEY``; never shown by ``repr``.
        session_token: ``AWS_SESSION_TOKEN`` (temporary credentials); never shown by ``repr``.

    Examples:
        >>> s = S3Settings.from_env({"AWS_ENDPOINT_URL": "http://127.0.0.1:8333",
        ...                          "AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "hush"})
        >>> s.allow_http, s.region, "hush" in repr(s)
        (True, 'us-east-1', False)
    """

    endpoint: str | None = None
    region: str = "us-east-1"
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> S3Settings:
        """The settings the AWS environment variables in ``environ`` (default ``os.environ``) give."""
        env = os.environ if environ is None else environ

        def get(*names: str) -> str | None:
            return next((env[n] for n in names if env.get(n)), None)

        endpoint = get("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        if endpoint is not None and urlsplit(endpoint).scheme not in ("http", "https"):
            raise StorageError(f"AWS_ENDPOINT_URL {endpoint!r} must start with http:// or https://")
        return cls(endpoint=endpoint, region=get("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1",
                   access_key=get("AWS_ACCESS_KEY_ID"), secret_key=get("AWS_SECRET_ACCESS_KEY"),
                   session_token=get("AWS_SESSION_TOKEN"))

    @property
    def allow_http(self) -> bool:
        """Whether the endpoint is plain HTTP (a local test server); clients refuse it unless told."""
        return self.endpoint is not None and self.endpoint.startswith("http://")

    def filesystem(self) -> pafs.S3FileSystem:
        """A pyarrow ``S3FileSystem`` for these settings.

        Passed explicitly because ``pyarrow.fs.S3FileSystem()`` takes the keys and region from the
        environment but not ``AWS_ENDPOINT_URL`` (only ``FileSystem.from_uri`` reads that, and it
        asks the server for the bucket's region first).
        """
        return pafs.S3FileSystem(access_key=self.access_key, secret_key=self.secret_key,
                                 session_token=self.session_token, region=self.region,
                                 endpoint_override=self.endpoint or None)


def scheme_of(location: str | os.PathLike[str]) -> str | None:
    """The URI scheme of ``location`` in lower case, or ``None`` for a plain path."""
    match = _SCHEME.match(os.fspath(location))
    return match.group(1).lower() if match else None


def _split_s3(uri: str) -> tuple[str, str]:
    parts = urlsplit(uri)
    if not parts.netloc:
        raise StorageError(f"{uri!r} names no bucket; write s3://BUCKET/PATH")
    return parts.netloc, parts.path.strip("/")


def _file_path(uri: str) -> str:
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise StorageError(f"{uri!r} names host {parts.netloc!r}; a file:// URI must be local (file:///PATH)")
    return parts.path


def resolve(location: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None,
            ) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path on it of ``location``.

    Args:
        location: a local path, ``file:///PATH`` or ``s3://BUCKET/KEY``.
        environ: where the AWS variables are read for ``s3://`` (default ``os.environ``; see
            :class:`S3Settings`).

    Returns:
        ``(filesystem, path)``: a ``LocalFileSystem`` and an absolute path, or an ``S3FileSystem``
        and ``BUCKET/KEY``.

    Raises:
        StorageError: another scheme (``gs://``, ``az://``, ...), or an ``s3://`` URI without a bucket.

    Examples:
        >>> fs, path = resolve("s3://bucket/datasets/steps", environ={"AWS_ENDPOINT_URL": "http://127.0.0.1:1"})
        >>> type(fs).__name__, path
        ('S3FileSystem', 'bucket/datasets/steps')
        >>> resolve("gs://bucket/x")
        Traceback (most recent call last):
        ...
        schemas.storage.StorageError: 'gs://bucket/x': scheme gs:// is not supported; use a local path, file:// or s3://
    """
    text = os.fspath(location)
    scheme = scheme_of(text)
    if scheme is None:
        return pafs.LocalFileSystem(), str(Path(text).expanduser().absolute())
    if scheme == "file":
        return pafs.LocalFileSystem(), _file_path(text)
    if scheme == "s3":
        bucket, key = _split_s3(text)
        return S3Settings.from_env(environ).filesystem(), f"{bucket}/{key}".rstrip("/")
    raise StorageError(f"{text!r}: scheme {scheme}:// is not supported; use a local path, file:// or s3://")


def delta_storage_options(location: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None,
                          ) -> dict[str, str]:
    """The ``storage_options`` delta-rs needs for the table at ``location`` (``{}`` for local tables).

    For ``s3://``: the endpoint, the region, plain HTTP when the endpoint is ``http://``, and
    ``conditional_put: etag``: a commit writes ``_delta_log/<version>.json`` with
    ``If-None-Match: *``, so of two writers racing for one version the server lets one win and the
    other retries on the next version -- concurrent writers are safe without a lock service,
    provided the server honours conditional writes (AWS S3 since 2024, SeaweedFS: see
    ``tests/storage/test_delta_s3.py``). ``AWS_S3_ALLOW_UNSAFE_RENAME`` is never set (it lets
    concurrent commits overwrite each other). Credentials are not in the result: delta-rs reads
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN`` from the environment
    itself, so the options can be logged.

    Args:
        location: the table's location (see :func:`resolve`).
        environ: where the AWS variables are read (default ``os.environ``).

    Raises:
        StorageError: as :func:`resolve`.

    Examples:
        >>> delta_storage_options("s3://b/t", environ={"AWS_ENDPOINT_URL": "http://127.0.0.1:8333",
        ...                                            "AWS_SECRET_ACCESS_KEY": "hush"})
        {'AWS_REGION': 'us-east-1', 'conditional_put': 'etag', 'AWS_ENDPOINT_URL': 'http://127.0.0.1:8333', 'AWS_ALLOW_HTTP': 'true'}
        >>> delta_storage_options("/tmp/table")
        {}
    """
    text = os.fspath(location)
    scheme = scheme_of(text)
    if scheme in (None, "file"):
        resolve(text)  # validates a file:// URI
        return {}
    if scheme != "s3":
        resolve(text)  # raises StorageError naming the scheme
    _split_s3(text)
    s3 = S3Settings.from_env(environ)
    options = {"AWS_REGION": s3.region, "conditional_put": "etag"}
    if s3.endpoint:
        options["AWS_ENDPOINT_URL"] = s3.endpoint
    if s3.allow_http:
        options["AWS_ALLOW_HTTP"] = "true"
    return options


def local_path(location: str | os.PathLike[str], *, flag: str | None) -> Path:
    """``location`` as a local path, for a flag whose readers and writers are local-only for now.

    Args:
        location: what was given for ``flag``: a local path or ``file:///PATH``.
        flag: the flag or setting that gave it, named in the error (``None``: the caller names it,
            as click does for a flag's parser).

    Raises:
        RemoteStorageNotSupported: any other scheme (``s3://``, ``gs://``, ...). Without this a
            ``gs://bucket/x`` became the local directory ``gs:/bucket/x``: on a remote worker the
            files stayed there while the commit claimed the offsets (silent loss).

    Examples:
        >>> local_path("file:///data/run", flag="--out")
        PosixPath('/data/run')
        >>> local_path("gs://bucket/datasets", flag="--out")
        Traceback (most recent call last):
        ...
        schemas.storage.RemoteStorageNotSupported: `--out` gs://bucket/datasets: remote storage is not yet supported for `--out` (read and written as local files until issue 14); give a local directory or a file:// URI
    """
    text = os.fspath(location)
    scheme = scheme_of(text)
    if scheme is None:
        return Path(text)
    if scheme == "file":
        return Path(_file_path(text))
    if not text.startswith(f"{text[:len(scheme)]}://"):  # what pathlib left of scheme://host/path
        text = f"{text[:len(scheme)]}://{text[len(scheme) + 1:].lstrip('/')}"
    named, what = (f"`{flag}` ", f"`{flag}`") if flag else ("", "this flag")
    raise RemoteStorageNotSupported(
        f"{named}{text}: remote storage is not yet supported for {what} (read and written as local files until "
        "issue 14); give a local directory or a file:// URI")
