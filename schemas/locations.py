"""Files at a location -- a local path or an ``s3://bucket/key`` URI -- through one small API over ``pyarrow.fs``.

The dataset commit protocol (:mod:`pipelines.commit`), the job's sinks and its state files use
these functions with *locations* (strings) instead of ``pathlib.Path``, so one code path writes a
local directory or an S3-compatible store: a location is a local path (``/data/datasets/...``)
or ``s3://BUCKET/KEY``; :func:`join` builds them (``pathlib`` would turn ``s3://b`` into ``s3:/b``).

What each operation is on either store:

============  =============================================  =============================================
operation     local directory                                S3-compatible store
============  =============================================  =============================================
write_atomic  tmp + fsync + rename + dir fsync               one PUT (an object appears whole or not at all)
write_new     tmp + fsync + ``link`` (fails if it exists)    PUT with ``If-None-Match: *`` (obstore
                                                             ``mode="create"``): of two writers one wins
move          ``os.replace`` (atomic)                        copy + delete (``pyarrow.fs`` ``move``): not
                                                             atomic; the commit protocol redoes it
delete_dir    ``shutil.rmtree``                              delete every key under the prefix
list_files    recursive ``FileSelector``                     the same (a prefix listing)
============  =============================================  =============================================

S3 settings come from the AWS environment variables (:class:`schemas.storage.S3Settings`); the
filesystem object is made once per process and settings.

Examples:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> write_atomic(join(d, "a/m.json"), b"{}")
    >>> write_new(join(d, "a/m.json"), b"[]")
    Traceback (most recent call last):
    ...
    FileExistsError: ...a/m.json exists (another writer created it first)
    >>> move(join(d, "a/m.json"), join(d, "b/m.json")); read_bytes(join(d, "b/m.json"))
    b'{}'
    >>> [loc[len(d):] for loc in list_files(d, suffix=".json")], exists(join(d, "a/m.json"))
    (['/b/m.json'], False)
    >>> join("s3://bucket/datasets", "steps/x.parquet"), is_remote("s3://bucket/datasets"), is_remote(d)
    ('s3://bucket/datasets/steps/x.parquet', True, False)
"""

from __future__ import annotations

import functools
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from schemas.storage import S3Settings, _split_s3, atomic_write, fsync_dir, resolve, scheme_of

__all__ = [
    "is_remote", "filesystem", "join", "exists", "is_file", "read_bytes", "write_atomic", "write_new",
    "move", "delete_file", "delete_dir", "list_files", "list_dir", "open_output", "open_input", "size_and_mtime_ms",
    "read_feather", "write_feather", "read_parquet", "parquet_rows", "parquet_dataset", "upload_dir", "download_dir",
]


def is_remote(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is on an object store (not a local path or ``file://``)."""
    return scheme_of(location) not in (None, "file")


@functools.lru_cache(maxsize=8)
def _s3(settings: S3Settings) -> pafs.S3FileSystem:
    return settings.filesystem()


def filesystem(location: str | os.PathLike[str]) -> tuple[pafs.FileSystem, str]:
    """``(filesystem, path on it)`` of ``location`` (:func:`schemas.storage.resolve`; one S3 client per process).

    Raises:
        schemas.storage.StorageError: a scheme other than local, ``file://`` or ``s3://``.
    """
    text = os.fspath(location)
    if scheme_of(text) == "s3":
        bucket, key = _split_s3(text)
        return _s3(S3Settings.from_env()), f"{bucket}/{key}".rstrip("/")
    return resolve(text)


def join(location: str | os.PathLike[str], *parts: str) -> str:
    """``location`` with relative ``parts`` appended, ``/``-separated (a URI stays a URI)."""
    text = os.fspath(location).rstrip("/") or "/"
    for part in parts:
        part = part.strip("/")
        if part:
            text = f"{text.rstrip('/')}/{part}"
    return text


def _location(path: str, like: str) -> str:
    """The location of ``path`` (a path on ``like``'s filesystem) in the form of ``like`` (a URI for remote ones)."""
    return f"s3://{path}" if is_remote(like) else path


def exists(location: str | os.PathLike[str]) -> bool:
    """Whether a file or directory (on S3: a key, or keys under the prefix) is at ``location``."""
    fs, path = filesystem(location)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_file(location: str | os.PathLike[str]) -> bool:
    """Whether a file (an object) is at ``location``."""
    fs, path = filesystem(location)
    return fs.get_file_info(path).type == pafs.FileType.File


def read_bytes(location: str | os.PathLike[str]) -> bytes:
    """The contents of the file at ``location``.

    Raises:
        FileNotFoundError: there is none.
    """
    fs, path = filesystem(location)
    if not is_remote(location):
        return Path(path).read_bytes()
    if fs.get_file_info(path).type != pafs.FileType.File:
        raise FileNotFoundError(f"{location} does not exist")
    with fs.open_input_stream(path) as f:
        return f.read()


def write_atomic(location: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``location`` so that it appears complete or not at all (replacing a file there)."""
    fs, path = filesystem(location)
    if not is_remote(location):
        atomic_write(Path(path), data)
        return
    with fs.open_output_stream(path) as f:  # one PUT on close: S3 objects appear whole
        f.write(data)


def write_new(location: str | os.PathLike[str], data: bytes) -> None:
    """Create the file ``location`` with ``data``, only if nothing is there (atomic, durable).

    Of two writers racing for one location exactly one succeeds. Locally: a temporary file,
    fsync, then ``os.link`` to the name (fails if it exists). On S3: a PUT with
    ``If-None-Match: *`` (obstore ``mode="create"``; ``pyarrow.fs`` has no conditional PUT);
    the server must honour it (AWS S3 and SeaweedFS do: ``tests/storage/test_pipeline_s3.py``).

    Raises:
        FileExistsError: a file is already there; nothing was written.
    """
    text = os.fspath(location)
    if is_remote(text):
        _put_create(text, data)
        return
    _, path = filesystem(text)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise FileExistsError(f"{text} exists (another writer created it first)") from None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)


@functools.lru_cache(maxsize=8)
def _obstore(settings: S3Settings, bucket: str):
    from obstore.store import S3Store

    config = {"region": settings.region, "conditional_put": "etag"}
    if settings.endpoint:
        config["endpoint"] = settings.endpoint
    if settings.access_key:
        config["access_key_id"] = settings.access_key
    if settings.secret_key:
        config["secret_access_key"] = settings.secret_key
    if settings.session_token:
        config["session_token"] = settings.session_token
    return S3Store(bucket, config=config, client_options={"allow_http": settings.allow_http})


def _put_create(uri: str, data: bytes) -> None:
    import obstore
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    bucket, key = _split_s3(uri)
    try:
        obstore.put(_obstore(S3Settings.from_env(), bucket), key, data, mode="create")
    except (AlreadyExistsError, PreconditionError):
        raise FileExistsError(f"{uri} exists (another writer created it first)") from None


def move(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Move the file ``src`` to ``dst`` (replacing a file there); parents are made as needed.

    Locally ``os.replace`` (atomic). On S3 a copy then a delete: a crash between them leaves
    both, and a move redone after a crash (or by a second process) finds ``src`` gone and
    ``dst`` in place: that is no error.

    Raises:
        FileNotFoundError: neither ``src`` nor ``dst`` exists.
    """
    fs, src_path = filesystem(src)
    _, dst_path = filesystem(dst)
    if not is_remote(src):
        Path(dst_path).parent.mkdir(parents=True, exist_ok=True)
        os.replace(src_path, dst_path)
        return
    try:
        fs.move(src_path, dst_path)
    except OSError:  # FileNotFoundError included
        if fs.get_file_info(src_path).type == pafs.FileType.NotFound and \
                fs.get_file_info(dst_path).type == pafs.FileType.File:
            return  # moved by another process in the meantime
        raise


def delete_file(location: str | os.PathLike[str]) -> None:
    """Delete the file at ``location`` (nothing there: no error)."""
    fs, path = filesystem(location)
    if not is_remote(location):
        Path(path).unlink(missing_ok=True)
        return
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass


def delete_dir(location: str | os.PathLike[str]) -> None:
    """Delete the directory (on S3: every key under the prefix) at ``location`` (nothing there: no error)."""
    fs, path = filesystem(location)
    if not is_remote(location):
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        fs.delete_dir(path)
    except FileNotFoundError:
        pass


def list_files(location: str | os.PathLike[str], *, suffix: str = "") -> list[str]:
    """Locations of the files under ``location`` (recursive) whose names end in ``suffix``, sorted.

    Nothing there: an empty list.
    """
    text = os.fspath(location)
    fs, path = filesystem(text)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    if is_remote(text):
        return sorted(_location(i.path, text) for i in infos
                      if i.type == pafs.FileType.File and i.base_name.endswith(suffix))
    # Locally the filesystem answers absolute paths; give them in the caller's form (a relative ``location``
    # gives relative paths under it), since callers cut their own prefix off the results.
    given = text.rstrip("/") or "/"
    return sorted(given + i.path[len(path.rstrip("/")):] for i in infos
                  if i.type == pafs.FileType.File and i.base_name.endswith(suffix))


def list_dir(location: str | os.PathLike[str]) -> list[str]:
    """Names of the entries (files and directories) directly under ``location``, sorted; none there: ``[]``."""
    fs, path = filesystem(location)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False, allow_not_found=True))
    return sorted(i.base_name for i in infos)


def open_output(location: str | os.PathLike[str]) -> pa.NativeFile:
    """A stream writing a new file at ``location`` (replacing one there); local parents are made.

    On S3 the object appears when the stream is closed.
    """
    fs, path = filesystem(location)
    if not is_remote(location):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    return fs.open_output_stream(path)


def open_input(location: str | os.PathLike[str]) -> pa.NativeFile:
    """A random-access file reading ``location`` (memory-mapped when local).

    Raises:
        FileNotFoundError: there is none.
    """
    fs, path = filesystem(location)
    if not is_remote(location):
        return pa.memory_map(path)
    return fs.open_input_file(path)


def size_and_mtime_ms(location: str | os.PathLike[str]) -> tuple[int, int]:
    """``(size in bytes, modification time in epoch milliseconds)`` of the file at ``location``."""
    fs, path = filesystem(location)
    if not is_remote(location):
        st = os.stat(path)
        return st.st_size, int(st.st_mtime * 1000)
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.File:
        raise FileNotFoundError(f"{location} does not exist")
    return info.size, info.mtime_ns // 1_000_000


def upload_dir(local_dir: str | os.PathLike[str], location: str | os.PathLike[str]) -> None:
    """Copy every file under the local directory ``local_dir`` to ``location`` (``pyarrow.fs.copy_files``).

    Files already at ``location`` with other names stay; those with the same names are replaced. Not
    atomic on an object store (one PUT per file): callers mark a directory complete by writing a last
    file once this returns.
    """
    fs, path = filesystem(location)
    if not is_remote(location):
        Path(path).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(os.fspath(Path(local_dir).resolve()), path, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)


def download_dir(location: str | os.PathLike[str], local_dir: str | os.PathLike[str]) -> None:
    """Copy every file under ``location`` into the local directory ``local_dir`` (made as needed).

    Raises:
        FileNotFoundError: nothing is at ``location``.
    """
    fs, path = filesystem(location)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{os.fspath(location)} does not exist")
    Path(local_dir).mkdir(parents=True, exist_ok=True)
    pafs.copy_files(path, os.fspath(Path(local_dir).resolve()), source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())


# --- Arrow files at a location -------------------------------------------------------------------------------


def read_feather(location: str | os.PathLike[str], *, columns: list[str] | None = None,
                 memory_map: bool = False) -> pa.Table:
    """An Arrow IPC (Feather v2) file at ``location`` (``memory_map``: local files only)."""
    import pyarrow.feather as feather

    fs, path = filesystem(location)
    if not is_remote(location):
        return feather.read_table(path, columns=columns, memory_map=memory_map)
    with fs.open_input_file(path) as f:
        return feather.read_table(f, columns=columns)


def write_feather(table: pa.Table, location: str | os.PathLike[str]) -> None:
    """Write ``table`` as an uncompressed Arrow IPC file at ``location`` (the same bytes on either store)."""
    import pyarrow.feather as feather

    with open_output(location) as f:
        feather.write_feather(table, f, compression="uncompressed")


def read_parquet(location: str | os.PathLike[str], *, columns: list[str] | None = None) -> pa.Table:
    """The Parquet file at ``location``."""
    import pyarrow.parquet as pq

    fs, path = filesystem(location)
    return pq.read_table(path, columns=columns, filesystem=fs)


def parquet_rows(location: str | os.PathLike[str]) -> int:
    """Rows in the Parquet file at ``location`` (its footer)."""
    import pyarrow.parquet as pq

    with open_input(location) as f:
        return pq.ParquetFile(f).metadata.num_rows


def parquet_dataset(files: Sequence[str | os.PathLike[str]]) -> pads.FileSystemDataset:
    """Parquet files (locations on one filesystem) as one ``pyarrow.dataset``, hive keys parsed as strings.

    For DuckDB without ``httpfs``: register the dataset on a connection and query it by name, as
    ``read_parquet([...], hive_partitioning=true)`` reads local files.
    """
    fs, _ = filesystem(files[0])
    paths = [filesystem(f)[1] for f in files]
    keys = sorted({seg.split("=", 1)[0] for p in paths for seg in p.split("/")[:-1] if "=" in seg})
    return pads.dataset(paths, filesystem=fs, format="parquet",
                        partitioning=pads.partitioning(pa.schema([(k, pa.string()) for k in keys]), flavor="hive"))
