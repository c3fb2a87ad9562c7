"""Dataset commit manifests, kept in each version's commit log (``<out>/_commit_log/<version>/``).

The trajectory job makes one commit per micro-batch or window pane; commit ``n``
of a version is commit ``n`` of that version's :class:`~schemas.commit_log.CommitLog`
(a Delta table with no data files), whose record is the commit's
:class:`DatasetManifest` as JSON (:mod:`pipelines.commit` holds the protocol:
staging, the commit, the renames). Readers (the trainer, the catalog, reports)
read it through :func:`read_dataset_manifests` and decode the same type instead
of re-parsing the JSON. A commit names each of its files as a
:class:`CommittedFile`: the final path, the staged path and its rows.

Layout (docs/pipelines.md, docs/storage.md)::

    <out>/_commit_log/<version>/_delta_log/<v>.json   log table version v = commit v (from 1, gap-free)
    <out>/_manifests/<version>/<n>.json                before the commit log (legacy): one file per commit

A dataset written before the commit log has only ``_manifests/``: readers read
those files (:func:`read_dataset_records`) until the next writer of the version
imports them into the log, in order and byte for byte, and deletes them
(:func:`pipelines.commit.recover`).

Examples:
    >>> m = DatasetManifest(commit=1, version="outcome-0a1b2c3d", recipe_hash="0a1b", source="archive",
    ...                     files=[CommittedFile(path="steps/recipe=outcome-0a1b2c3d/domain=math/c00000001-s000.parquet",
    ...                                          staged="_staging/outcome-0a1b2c3d/00000001/x", rows=3)])
    >>> decode_manifest(msgspec.json.encode(m)).files[0].rows
    3
    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> commit_log_of(out, "outcome-0a1b2c3d").snapshot().commit(msgspec.json.encode(m))
    1
    >>> [d.commit for d in read_dataset_manifests(out, "outcome-0a1b2c3d")], list_dataset_versions(out)
    ([1], ['outcome-0a1b2c3d'])
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec

from schemas import locations as loc
from schemas.commit_log import CommitLog, CommitLogError
from schemas.datasets import DATASET_SCHEMA_VERSION
from schemas.events import SCHEMA_VERSION

__all__ = [
    "COMMIT_LOG_DIR",
    "MANIFEST_DIR",
    "CommittedFile",
    "DatasetManifest",
    "ManifestError",
    "commit_log_of",
    "decode_manifest",
    "decode_manifests",
    "list_dataset_versions",
    "manifest_path",
    "read_dataset_manifests",
    "read_dataset_records",
    "read_legacy_records",
]

#: Directory of the versions' commit logs under the dataset root.
COMMIT_LOG_DIR = "_commit_log"
#: Directory of the commit manifest files of datasets written before the commit log (legacy, read-only).
MANIFEST_DIR = "_manifests"


class ManifestError(CommitLogError):
    """A dataset's commit record is not a manifest, or the manifests' commit numbers have a gap."""


class CommittedFile(msgspec.Struct, frozen=True, kw_only=True):
    """One file of a commit.

    Attributes:
        path: final path, relative to ``<out>``.
        staged: staged path, relative to ``<out>``.
        rows: rows in the file (0 for state files).
    """

    path: str
    staged: str
    rows: int = 0


class DatasetManifest(msgspec.Struct, kw_only=True):
    """One dataset commit (the record of commit ``n`` in ``_commit_log/<version>/``).

    Attributes:
        commit: commit number, from 1, gap-free per version.
        version: dataset version ``<recipe name>-<hash8>``.
        recipe_hash: full sha256 of the recipe's canonical JSON.
        recipe: the recipe's fields (as in its YAML form).
        source: ``archive``, ``kafka`` or ``raw`` (records given in memory: tests, benchmarks).
        mode: ``batch`` (one commit per micro-batch) or ``stream`` (one commit
            per event-time window pane of the streaming job).
        window: ``[start, end)`` of the pane's event-time window, epoch seconds
            (stream; None for the end-of-stream pending commit).
        pane: ``ON_TIME``, ``LATE``, ... and the pane index, e.g. ``LATE/2`` (stream).
        archive_dir: the archive read (archive source).
        archive_commits: archive commits this commit covers.
        offsets: ``topic -> partition -> [start, end)`` covered (Kafka source); in
            stream mode the offsets of the records whose batches fell into the pane.
        files: every file of the commit (data and state).
        pending_file: the pending-state file after this commit (None: nothing pending).
        groups_file: the held-group state after this commit (None: the commit decided
            no groups, e.g. a stream's pending-state commit; the last one that did stands).
        held_parts: base paths (relative to ``<out>``) of the held groups' rows
            (``<base>.trajectories.arrow``, ``<base>.steps.arrow``), with ``groups_file``.
        late_state: the late-state files after this commit (pipelines/late.py):
            ``path -> newest event time in it`` (epoch seconds), in commit order;
            a file is dropped once that is older than the retention.
        norm_file: the persisted statistics file.
        clock_s: event-time clock (epoch seconds) after this commit.
        counts: the run's counts (events_in, episodes, steps, dead_letters, ...).
        schema_version: dataset row layout version.
        event_schema_version: event-model version of this reader.
        created_at: when the commit was made (UTC).
    """

    commit: int
    version: str
    recipe_hash: str
    source: str
    mode: str = "batch"
    window: list[float] | None = None
    pane: str | None = None
    recipe: dict[str, Any] = {}
    archive_dir: str | None = None
    archive_commits: list[int] = []
    offsets: dict[str, dict[int, list[int]]] = {}
    files: list[CommittedFile] = []
    pending_file: str | None = None
    groups_file: str | None = None
    held_parts: list[str] = []
    late_state: dict[str, float] = {}
    norm_file: str | None = None
    clock_s: float = 0.0
    counts: dict[str, int] = {}
    schema_version: int = DATASET_SCHEMA_VERSION
    event_schema_version: int = SCHEMA_VERSION
    created_at: datetime = msgspec.field(default_factory=lambda: datetime.now(timezone.utc))


_DECODER = msgspec.json.Decoder(DatasetManifest)


def decode_manifest(data: bytes) -> DatasetManifest:
    """Decode a manifest's JSON bytes.

    Raises:
        msgspec.DecodeError: not JSON.
        msgspec.ValidationError: JSON, but not a manifest (the message names the field).

    Examples:
        >>> decode_manifest(b'{"commit": 2, "version": "v-1", "recipe_hash": "h", "source": "kafka"}').commit
        2
    """
    return _DECODER.decode(data)


def manifest_path(version: str, commit: int) -> str:
    """The legacy manifest file of commit ``commit`` of ``version``, relative to the dataset root.

    Datasets written before the commit log have these (:func:`read_legacy_records`); nothing writes them now.

    Examples:
        >>> manifest_path("grpo-0123abcd", 12)
        '_manifests/grpo-0123abcd/00000012.json'
    """
    return f"{MANIFEST_DIR}/{version}/{commit:08d}.json"


def commit_log_of(out: str | os.PathLike[str], version: str) -> CommitLog:
    """The commit log of dataset version ``version`` under the dataset root ``out`` (local or ``s3://``).

    Examples:
        >>> commit_log_of("s3://bucket/data", "grpo-0123abcd")
        CommitLog('s3://bucket/data/_commit_log/grpo-0123abcd', app_id='trajpipe.commits.grpo-0123abcd')
    """
    return CommitLog(loc.join(_root(out), COMMIT_LOG_DIR, version), app_id=f"trajpipe.commits.{version}")


def list_dataset_versions(out: str | os.PathLike[str]) -> list[str]:
    """The dataset versions under ``out`` that have a commit log or legacy manifests, sorted.

    Examples:
        >>> import tempfile
        >>> list_dataset_versions(tempfile.mkdtemp())
        []
    """
    root = _root(out)
    names: set[str] = set()
    for d in (COMMIT_LOG_DIR, MANIFEST_DIR):
        where = loc.join(root, d)
        if loc.is_remote(root):  # an object store has no empty directories: every name is a version's prefix
            names.update(loc.list_dir(where))
        elif os.path.isdir(where):
            names.update(p.name for p in Path(where).iterdir() if p.is_dir() and not p.name.startswith("."))
    return sorted(names)


def read_legacy_records(out: str | os.PathLike[str], version: str) -> list[bytes]:
    """The bytes of the legacy manifest files ``_manifests/<version>/<n>.json``, in commit order (none: ``[]``).

    A file being written (``.<name>.tmp``) is skipped.
    """
    root = _root(out)
    paths = [p for p in loc.list_files(loc.join(root, MANIFEST_DIR, version), suffix=".json")
             if p.rsplit("/", 1)[-1][: -len(".json")].isdigit()]
    return [loc.read_bytes(p) for p in sorted(paths, key=lambda p: int(p.rsplit("/", 1)[-1][: -len(".json")]))]


def read_dataset_records(out: str | os.PathLike[str], version: str, *, as_of: int | None = None,
                         after: int = 0) -> list[bytes]:
    """The records (manifest JSON) of commits ``after + 1 ..`` of ``version``, through ``as_of`` (None: the head).

    From the version's commit log; a version that has no log yet is read from its legacy manifest files.

    Raises:
        CommitLogError: the log is unreadable, has a gap, or ``as_of`` is beyond its head.
    """
    log = commit_log_of(out, version)
    if log.exists():  # read from the log's files: safe in a forked process (CommitLog.read_records)
        return log.read_records(after=after, as_of=as_of)
    records = read_legacy_records(out, version)
    if as_of is not None:
        if not 0 <= as_of <= len(records):
            raise CommitLogError(f"{loc.join(_root(out), MANIFEST_DIR, version)} has commits 1..{len(records)}, "
                                 f"not {as_of}")
        records = records[:as_of]
    return records[after:]


def read_dataset_manifests(out: str | os.PathLike[str], version: str, *, as_of: int | None = None,
                           after: int = 0) -> list[DatasetManifest]:
    """The manifests of commits ``after + 1 ..`` of ``version`` (through ``as_of``), in commit order.

    Raises:
        ManifestError: a record is not a manifest, or its commit number is not its place in the log.
        CommitLogError: the log is unreadable (:func:`read_dataset_records`).
    """
    records = read_dataset_records(out, version, as_of=as_of, after=after)
    return decode_manifests(records, first=after + 1, where=f"{version} at {_root(out)}")


def decode_manifests(records: list[bytes], *, first: int = 1, where: str = "the log") -> list[DatasetManifest]:
    """Decode the records of commits ``first, first + 1, ..`` (``where`` names them in errors).

    Raises:
        ManifestError: a record is not a manifest, or its commit number is not its place in the log.

    Examples:
        >>> decode_manifests([b'{"commit": 1, "version": "v", "recipe_hash": "h", "source": "raw"}'])[0].source
        'raw'
        >>> decode_manifests([b'{"commit": 3, "version": "v", "recipe_hash": "h", "source": "raw"}'])
        Traceback (most recent call last):
        ...
        schemas.manifests.ManifestError: commit 1 of the log holds the manifest of commit 3 (gap)
    """
    out = []
    for n, record in enumerate(records, start=first):
        try:
            m = decode_manifest(record)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise ManifestError(f"commit {n} of {where} is unreadable or has no `files` list: {err}") from err
        if m.commit != n:
            raise ManifestError(f"commit {n} of {where} holds the manifest of commit {m.commit} (gap)")
        out.append(m)
    return out


def _root(out: str | os.PathLike[str]) -> str:
    text = os.fspath(out)
    return text if loc.is_remote(text) else str(Path(text))
