"""The archiver: drains the events topic into the append-only Parquet event archive.

The archive is the event store of record (layout and commit protocol in
docs/archive.md). Each commit consumes an offset range per partition, writes
the decoded events bucketed by episode and sorted by ``(episode_id, seq)``,
and records the range in a manifest; the manifest's commit to the archive's
commit log is the commit point, so a crash at any moment followed by a rerun
yields exactly the same rows.

Run it::

    trajpipe archive --bootstrap 127.0.0.1:9092 --out data/archive --until-end
    trajpipe archive --bootstrap 127.0.0.1:9092 --out s3://bucket/archive --until-end

The archive is a local directory or ``s3://BUCKET/PREFIX``: every file goes through
:mod:`schemas.locations`, and one protocol serves both (an object store has no rename and
no lock, so the protocol asks for neither):

1. plan commit ``n`` from a snapshot of the commit log ``<archive>/_commit_log/``
   (:class:`schemas.commit_log.CommitLog`, app id :data:`ARCHIVE_LOG_APP`): its records are the
   manifests, whose end offsets are where the commit starts;
2. write the data files under temporary names that carry the writing run's id
   (``bucket=NN/c<n>.parquet.<run>.tmp``);
3. commit the manifest (naming the run, key ``run``) against that snapshot: the commit point;
4. move the files to their names (``bucket=NN/c<n>.parquet``) and add them to the archive's
   Delta table (``<archive>/_delta_log``).

Of two archivers racing for commit ``n`` one commits; the log refuses the other
(:class:`schemas.commit_log.CommitTaken`), which deletes its temporary files and raises
:class:`ArchiveConflict` (nothing is lost: its offsets are in no manifest, so the next run reads
them again). Recovery never touches temporary files of a commit not made yet (a live rival's); those
of a made commit that does not name their run it removes, even while the losing rival still writes
them, which then finds one gone and raises the same conflict.
An archive of the earlier layout (one ``_commits/<n>.json`` file per manifest) is read as it is,
and its first archiver run imports the manifests into the log, byte for byte, then removes them.

Examples:
    >>> bucket_of("synth-0-00000001", 16) == bucket_of("synth-0-00000001", 16)
    True
    >>> 0 <= bucket_of("any-episode", 16) < 16
    True
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec
import pyarrow.parquet as pq
from kafka.errors import KafkaError

from schemas import locations as loc
from schemas.arrow import events_to_table
from schemas.codec import EventDecodeError, decode_event
from schemas.delta import META_PREFIX, add_files, txn_version
from schemas.events import SCHEMA_VERSION, Event
from schemas.commit_log import CommitLog, CommitLogError, CommitTaken, ImportMismatch, Snapshot
from schemas.storage import fsync_dir
from streams import testhooks
from streams.config import KafkaConnection
from streams.consumer import OffsetRange, StreamTimeoutError, end_offsets
from streams.errors import KafkaUnavailable, kafka_access_errors
from streams.fetch import PartitionReader, read_partition

__all__ = [
    "ARCHIVE_FORMAT",
    "ArchiveError",
    "ArchiveConflict",
    "ArchiveCounts",
    "CommitManifest",
    "ARCHIVE_LOG_APP",
    "bucket_of",
    "commit_log",
    "committed_files",
    "is_archive",
    "read_commits",
    "recover_archive",
    "write_commit",
    "ARCHIVE_DELTA_APP",
    "Archiver",
]

log = logging.getLogger(__name__)

ARCHIVE_FORMAT = 1


class ArchiveError(RuntimeError):
    """The archive directory is inconsistent or does not match the settings."""


class ArchiveConflict(ArchiveError):
    """Another archiver made this commit first (the commit log refused this one's).

    This run's temporary files are deleted; nothing it read is lost (its offsets are in no
    manifest: the next run reads them again).
    """


Location = Path | str  # a local path, or an ``s3://BUCKET/PREFIX`` URI (a string)


def _root(root: Location) -> Location:
    """``root`` as the archive functions take it: an ``s3://`` URI stays a string (no trailing ``/``)."""
    return os.fspath(root).rstrip("/") if loc.is_remote(root) else Path(root)


def _at(root: Location, rel: str) -> Location:
    return loc.join(root, rel) if isinstance(root, str) else root / rel


class ArchiveCounts(msgspec.Struct, kw_only=True):
    """What one archiver run did.

    Attributes:
        events: events written to the archive.
        dead_letters: undecodable messages routed to the dead-letter topic.
        commits: commits made.
        messages: messages consumed (== events + dead_letters).
    """

    events: int = 0
    dead_letters: int = 0
    commits: int = 0
    messages: int = 0


class PartitionRange(msgspec.Struct, frozen=True):
    """Offsets ``[start, end)`` of one partition covered by a commit."""

    start: int
    end: int


class CommitManifest(msgspec.Struct, kw_only=True):
    """One archive commit: the record of commit ``n`` in the archive's commit log (``_commit_log/``).

    Attributes:
        commit: commit number, from 1, gap-free.
        topic: source topic.
        offsets: partition -> consumed range ``[start, end)``.
        files: data files of this commit, relative to the archive root.
        events: rows written.
        dead_letters: messages sent to the dead-letter topic instead.
        schema_version: event-model version of the writer.
        created_at: when the commit was made (UTC).
    """

    commit: int
    topic: str
    offsets: dict[int, PartitionRange]
    files: list[str]
    events: int
    dead_letters: int = 0
    schema_version: int = SCHEMA_VERSION
    created_at: datetime = msgspec.field(default_factory=lambda: datetime.now(timezone.utc))


class _StagedManifest(CommitManifest, kw_only=True):
    """A commit manifest as the log records it: also names the run whose temporary files it commits.

    Readers decode it as :class:`CommitManifest` (the extra key is ignored).
    """

    run: str


#: The Delta application-transaction id of the archive's commits (version = commit number).
ARCHIVE_DELTA_APP = "trajpipe.archive"


def _publish_delta(root: Location, manifest: CommitManifest, rows: Sequence[int] | None = None) -> int | None:
    """Add one archive commit's files to the archive's Delta table (``<root>/_delta_log``); idempotent."""
    if not manifest.files:
        return None
    if rows is None:
        rows = [loc.parquet_rows(_at(root, f)) for f in manifest.files]
    meta = {"commit": str(manifest.commit), "topic": manifest.topic, "events": str(manifest.events),
            "dead_letters": str(manifest.dead_letters), "created_at": manifest.created_at.isoformat(),
            "offsets": json.dumps({str(p): [r.start, r.end] for p, r in sorted(manifest.offsets.items())})}
    return add_files(root, list(zip(manifest.files, rows)), app_id=ARCHIVE_DELTA_APP, version=manifest.commit,
                     metadata={META_PREFIX + k: v for k, v in meta.items()})


def bucket_of(episode_id: str, buckets: int) -> int:
    """Archive bucket of an episode: ``crc32(episode_id) % buckets`` (stable across runs and hosts)."""
    return zlib.crc32(episode_id.encode()) % buckets


def _check_meta(root: Location, meta_path: Location, data: bytes, *, topic: str) -> dict[str, Any]:
    try:
        meta = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ArchiveError(f"{meta_path} is not JSON ({err}); the archive metadata is damaged: restore it "
                           f'(e.g. {{"format": {ARCHIVE_FORMAT}, "buckets": 16, "topic": "{topic}"}})') from err
    if not isinstance(meta, dict):
        raise ArchiveError(f"{meta_path} holds a {type(meta).__name__}, not the archive metadata object")
    buckets_ok = type(meta.get("buckets")) is int and meta["buckets"] >= 1  # noqa: E721 - not a bool
    if meta.get("format") != ARCHIVE_FORMAT:
        raise ArchiveError(f"{root} has archive format {meta.get('format')}; this trajpipe writes {ARCHIVE_FORMAT}")
    if meta.get("topic") != topic:
        raise ArchiveError(
            f"{root} archives topic {meta.get('topic')!r}, not {topic!r}; use another --out directory"
        )
    if not buckets_ok:
        raise ArchiveError(f"{meta_path}: `buckets` must be an integer >= 1 (the bucket count its files were "
                           f"written with), got {meta.get('buckets')!r}")
    return meta


def _init_archive(root: Location, *, topic: str, buckets: int) -> dict[str, Any]:
    root = _root(root)
    meta_path = _at(root, "_archive.json")
    meta = {"format": ARCHIVE_FORMAT, "buckets": buckets, "topic": topic}
    try:  # create-only, so two first archivers agree on one bucket count
        loc.write_new(meta_path, json.dumps(meta).encode())
        return meta
    except FileExistsError:
        return _check_meta(root, meta_path, loc.read_bytes(meta_path), topic=topic)


#: The application transaction id of the archive's commit log (``<archive>/_commit_log/``).
ARCHIVE_LOG_APP = "trajpipe.archive.commits"


def commit_log(root: Location) -> CommitLog:
    """The archive's commit log, ``<root>/_commit_log/``: commit ``n``'s record is manifest ``n`` (JSON)."""
    return CommitLog(loc.join(_root(root), "_commit_log"), app_id=ARCHIVE_LOG_APP)


def is_archive(root: Location) -> bool:
    """Whether ``root`` holds an event archive (its metadata, its commit log, or manifests of the earlier layout).

    Raises:
        OSError: an object store could not be read.

    Examples:
        >>> is_archive(Path("/nonexistent"))
        False
    """
    root = _root(root)
    return any(loc.exists(_at(root, p)) for p in ("_archive.json", "_commit_log/_delta_log", "_commits"))


def _legacy_manifests(root: Location) -> list[tuple[str, bytes]]:
    """``(path, bytes)`` of each manifest file of the earlier layout (``_commits/<n>.json``), in name order.

    The read-only fallback of an archive no archiver of this version has run on yet (the next one imports them).
    """
    return [(str(p), loc.read_bytes(p)) for p in loc.list_files(_at(root, "_commits"), suffix=".json")
            if not PurePosixPath(str(p)).name.startswith(".")]


def _records(root: Location, snapshot: Snapshot | None = None) -> list[tuple[str, bytes]]:
    """``(where, bytes)`` of every manifest: the commit log's records (of ``snapshot``, or a fresh one), or
    the legacy manifest files where the archive has no log yet."""
    clog = snapshot.log if snapshot is not None else commit_log(root)
    try:
        if snapshot is None:
            if not clog.exists():
                return _legacy_manifests(root)
            snapshot = clog.snapshot()
        return [(f"{clog.root} commit {n}", r) for n, r in enumerate(snapshot.records(), start=1)]
    except CommitLogError as err:
        raise ArchiveError(f"archive {root}: {err}") from err


def _decode(where: str, data: bytes) -> CommitManifest:
    try:
        manifest = msgspec.json.decode(data, type=CommitManifest)
    except msgspec.DecodeError as err:
        raise ArchiveError(f"commit manifest {where} is unreadable: {err}") from err
    for f in manifest.files:  # data files live in the archive: never read (or rename) anything else
        rel = PurePosixPath(f)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or "\\" in f or "\x00" in f:
            raise ArchiveError(f"commit manifest {where} names file {f!r}, outside the archive; a manifest "
                               "lists paths relative to the archive root (bucket=NN/cNNNNNNNN.parquet)")
    return manifest


def _decode_all(root: Location, records: Sequence[tuple[str, bytes]]) -> list[CommitManifest]:
    commits = [_decode(where, data) for where, data in records]
    for i, c in enumerate(commits, start=1):
        if c.commit != i:
            raise ArchiveError(f"archive {root}: commit {i} is missing (found {c.commit})")
    return commits


def read_commits(root: Location, *, snapshot: Snapshot | None = None) -> list[CommitManifest]:
    """All commit manifests of an archive (a local directory or an ``s3://`` URI), in commit order.

    They are the records of its commit log (as of ``snapshot``, default now); an archive of the earlier
    layout (``_commits/<n>.json``, no log yet) is read from those files.

    Raises:
        ArchiveError: a manifest is unreadable, names a file outside the archive, or commit numbers have a gap.

    Examples:
        >>> read_commits(Path("/nonexistent"))
        []
    """
    root = _root(root)
    return _decode_all(root, _records(root, snapshot))


def committed_files(root: Location) -> list[Location]:
    """Data files of every commit, in commit order (what readers should read): paths, or ``s3://`` URIs.

    Examples:
        >>> committed_files(Path("/nonexistent"))
        []
    """
    root = _root(root)
    return [_at(root, f) for c in read_commits(root) for f in c.files]


def _import_legacy(root: Location) -> int:
    """Import the manifest files of the earlier layout into the commit log (same bytes, in order), then remove
    them; how many were imported. Another archiver importing at the same time is no error (same records)."""
    legacy = _legacy_manifests(root)
    if not legacy:
        return 0
    _decode_all(root, legacy)  # a damaged one is refused before anything is imported
    try:
        imported = commit_log(root).import_records([data for _, data in legacy],
                                                   sources=[name for name, _ in legacy])
    except ImportMismatch:
        raise ArchiveError(f"archive {root}: the commit log _commit_log/ and the manifests in _commits/ "
                           "disagree; remove the one that is wrong") from None
    except CommitLogError as err:
        raise ArchiveError(f"archive {root}: {err}") from err
    loc.delete_dir(_at(root, "_commits"))
    if imported:
        log.info("imported %s manifests of %s (_commits/) into its commit log", imported, root)
    return imported


def _snapshot(root: Location, *, import_legacy: bool = True) -> Snapshot:
    """The commit log as it is now, the earlier layout's manifests imported first (writers only)."""
    if import_legacy:
        _import_legacy(root)
    try:
        return commit_log(root).snapshot()
    except CommitLogError as err:
        raise ArchiveError(f"archive {root}: {err}") from err


def _tmp_name(rel: str, run: str) -> str:
    """``bucket=NN/c<n>.parquet`` -> its temporary name while run ``run`` writes it: ``...parquet.<run>.tmp``."""
    return f"{rel}.{run}.tmp"


class _Run(msgspec.Struct):
    run: str = ""


def recover_archive(root: Location) -> int:
    """Finish or undo interrupted commits; returns the number of files fixed.

    Manifests of the earlier layout are imported into the commit log first. A temporary data file
    (``bucket=NN/c<n>.parquet.<run>.tmp``) of a commit that is made is moved into place if the
    commit's manifest names its run, and removed otherwise; one of a commit not made yet is left
    alone (another archiver may be writing it; once the commit is made, the next recovery decides).
    Commits the Delta table lacks are then added to it, in order. Safe beside a live archiver.
    """
    root = _root(root)
    if not is_archive(root):
        return 0
    snap = _snapshot(root)
    records = _records(root, snap)
    commits = _decode_all(root, records)
    runs = {c.commit: msgspec.json.decode(data, type=_Run).run for c, (_, data) in zip(commits, records)}
    wanted = {f for c in commits for f in c.files}
    fixed = 0
    prefix = len(os.fspath(root).rstrip("/")) + 1
    for tmp in loc.list_files(root, suffix=".tmp"):
        bucket, _, name = tmp[prefix:].partition("/")
        parts = name.split(".")  # c<n>, parquet, <run>, tmp (c<n>, parquet, tmp: a local one of the earlier layout)
        if not bucket.startswith("bucket=") or "/" in name or len(parts) not in (3, 4) or parts[1] != "parquet" \
                or not parts[0][1:].isdigit():
            continue
        n, rel = int(parts[0][1:]), f"{bucket}/{parts[0]}.parquet"
        if len(parts) == 4 and n > snap.head:
            log.info("leaving %s: commit %s is not made yet (another archiver's, or a crashed one's until it is)",
                     tmp[prefix:], n)
            continue
        ours = len(parts) == 3 or parts[2] == runs.get(n)
        final = _at(root, rel)
        if ours and rel in wanted and not loc.exists(final):
            _move_into_place(tmp, final)
            log.info("rolled commit file forward: %s", rel)
        else:
            loc.delete_file(tmp)
            log.info("removed uncommitted file: %s", tmp[prefix:])
        fixed += 1
    return fixed + _catch_up_delta(root, commits)


def _move_into_place(tmp: Location, final: Location) -> None:
    """Move a committed file to its name; done already (by a recovery beside this writer) is no error."""
    try:
        loc.move(tmp, final)
    except FileNotFoundError:
        if not loc.exists(final):
            raise


def _catch_up_delta(root: Location, commits: Sequence[CommitManifest]) -> int:
    """Add, in order, the commits the Delta table does not hold yet; how many were added."""
    have, added = txn_version(root, ARCHIVE_DELTA_APP), 0
    for c in commits:
        if c.commit > have and _publish_delta(root, c) is not None:
            log.warning("added archive commit %s to the Delta table (rolled forward)", c.commit)
            added += 1
    return added


def write_commit(
    root: Location,
    *,
    commit: int,
    topic: str,
    buckets: int,
    events: Sequence[Event],
    positions: Sequence[tuple[int, int]],
    offsets: dict[int, PartitionRange],
    dead_letters: int = 0,
    run: str | None = None,
    snapshot: Snapshot | None = None,
) -> CommitManifest:
    """Write one commit: data files (temporary names) → manifest into the commit log (commit point) → moves →
    Delta transaction.

    Args:
        root: archive directory, or ``s3://BUCKET/PREFIX``.
        commit: the commit number (last + 1).
        topic: source topic.
        buckets: bucket count of this archive.
        events: decoded events of the range.
        positions: ``(partition, offset)`` of each event.
        offsets: the consumed range per partition.
        dead_letters: how many messages of the range went to dead letters.
        run: this writer's id in the temporary file names and the manifest; default: a new one.
        snapshot: the commit log snapshot the commit was planned from (its head is ``commit - 1``); the
            commit is refused if any commit was made since. Default: the log as it is now.

    Raises:
        ArchiveConflict: another archiver made commit ``commit`` first; this commit's temporary files are
            deleted.
        ArchiveError: ``commit`` does not follow the log's head, or the log refused the commit for another
            reason (the temporary files are left to recovery).
    """
    root = _root(root)
    run = run or uuid.uuid4().hex[:12]
    snapshot = snapshot if snapshot is not None else _snapshot(root)
    if snapshot.head >= commit:
        raise _conflict(root, commit, len(events))
    if snapshot.head != commit - 1:
        raise ArchiveError(f"archive {root}: commit {commit} does not follow its last commit {snapshot.head}")
    by_bucket: dict[int, list[int]] = defaultdict(list)
    for i, ev in enumerate(events):
        by_bucket[bucket_of(ev.episode_id, buckets)].append(i)
    files, rows, tmps = [], [], []
    for b in sorted(by_bucket):
        idx = sorted(by_bucket[b], key=lambda i: (events[i].episode_id, events[i].seq, positions[i]))
        table = events_to_table([events[i] for i in idx], [positions[i] for i in idx])
        rel = f"bucket={b:02d}/c{commit:08d}.parquet"
        tmp = _at(root, _tmp_name(rel, run))
        fs, path = loc.filesystem(tmp)
        try:
            if isinstance(root, Path):
                tmp.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, path, filesystem=fs, compression="zstd")  # on S3 one object, whole or absent
            if isinstance(root, Path):
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
        except FileNotFoundError:
            # A rival that made this commit meanwhile ran its recovery, which removes the temporary files
            # of a made commit that does not name their run: ours. That is the conflict, found early.
            if _snapshot(root).head < commit:
                raise
            raise _lost(root, commit, len(events), [*tmps, tmp]) from None
        files.append(rel)
        rows.append(table.num_rows)
        tmps.append(tmp)
    if testhooks.crashes_before_manifest(commit):  # tests only (streams/testhooks.py)
        raise ArchiveError(f"simulated crash before manifest of commit {commit}")
    manifest = CommitManifest(
        commit=commit, topic=topic, offsets=offsets, files=files, events=len(events), dead_letters=dead_letters
    )
    staged = _StagedManifest(**msgspec.structs.asdict(manifest), run=run)
    try:
        snapshot.commit(msgspec.json.encode(staged))
    except CommitTaken:
        raise _lost(root, commit, len(events), tmps) from None
    except CommitLogError as err:  # made or not: recovery moves or removes the files by the log
        raise ArchiveError(f"archive {root}: {err}") from err
    for tmp, rel in zip(tmps, files):
        _move_into_place(tmp, _at(root, rel))
    if isinstance(root, Path):
        for d in {(root / rel).parent for rel in files}:
            fsync_dir(d)
    if txn_version(root, ARCHIVE_DELTA_APP) < commit - 1:  # an earlier commit is missing from the table
        _catch_up_delta(root, read_commits(root, snapshot=snapshot)[: commit - 1])
    _publish_delta(root, manifest, rows)
    return manifest


def _lost(root: Location, commit: int, events: int, tmps: Sequence[Location]) -> ArchiveConflict:
    """A run that lost commit ``commit`` to a rival: its temporary files deleted, the conflict to raise."""
    for tmp in tmps:
        loc.delete_file(tmp)
    return _conflict(root, commit, events)


def _conflict(root: Location, commit: int, events: int) -> ArchiveConflict:
    return ArchiveConflict(
        f"another archiver made commit {commit} of {root} first; this run's {events} events were not "
        "archived and nothing of them is lost (their offsets are in no manifest): rerun to continue from "
        "that commit")


def _next_offsets(commits: Sequence[CommitManifest]) -> dict[int, int]:
    """Next offset to read per partition after ``commits``."""
    offsets: dict[int, int] = {}
    for c in commits:
        for p, r in c.offsets.items():
            offsets[int(p)] = max(offsets.get(int(p), 0), r.end)
    return offsets


class Archiver:
    """Drains a topic into an archive directory, commit by commit.

    Args:
        out: archive directory (created on first use), or ``s3://BUCKET/PREFIX``.
        conn: Kafka connection.
        topic: events topic.
        dead_letter: called with ``(record, EventDecodeError)`` for each
            undecodable message; it must make the dead letter durable (e.g. a
            producer send followed by ``flush``) before :meth:`run` commits.
        flush_dead_letters: called once before each commit so dead letters are
            durable before the offsets that produced them are committed.
        buckets: bucket count for a new archive (an existing one keeps its own).
        commit_every: commit after this many messages.
        progress: called with the running counts after each commit.
    """

    def __init__(
        self,
        out: Location,
        *,
        conn: KafkaConnection,
        topic: str,
        dead_letter: Callable[[Any, EventDecodeError], None],
        flush_dead_letters: Callable[[], None] = lambda: None,
        buckets: int = 16,
        commit_every: int = 50_000,
        progress: Callable[[ArchiveCounts], None] | None = None,
    ) -> None:
        if commit_every < 1:
            raise ValueError("`commit_every` must be >= 1")
        self.out = _root(out)
        self._run = uuid.uuid4().hex[:12]  # names this run's temporary files and its manifests
        self.conn = conn
        self.topic = topic
        self._dead_letter = dead_letter
        self._flush_dead_letters = flush_dead_letters
        self._meta = _init_archive(self.out, topic=topic, buckets=buckets)
        self.buckets = int(self._meta["buckets"])
        self.commit_every = commit_every
        self._progress = progress

    def committed_offsets(self) -> dict[int, int]:
        """Next offset to read per partition, from the manifests."""
        return _next_offsets(read_commits(self.out))

    def run(self, *, until_end: bool = True, stop: threading.Event | None = None, poll_interval_s: float = 1.0,
            retry_s: float = 2.0) -> ArchiveCounts:
        """Archive until the end offsets seen at start (``until_end``) or until ``stop`` is set.

        Following the topic (``until_end=False``), a broker that goes away is waited for: the
        uncommitted part of the drain is dropped and read again from the last commit's end offsets
        every ``retry_s`` seconds until the broker answers (a broker restart must not end the
        archiver). With ``until_end`` the error is raised.
        """
        recover_archive(self.out)
        counts = ArchiveCounts()
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                self._follow(counts, stop, until_end=until_end, poll_interval_s=poll_interval_s)
                recover_archive(self.out)  # temporary files of commits made meanwhile by another (crashed) run
                return counts
            except ArchiveConflict as err:
                if not counts.commits:
                    raise
                # The commits this run made before the one it lost stay archived: say so, or the one
                # error line reads as if the run had archived nothing.
                raise ArchiveConflict(f"{err}; before it this run made {counts.commits} commit(s) of "
                                      f"{counts.events} events, which stay archived") from err
            except (KafkaError, KafkaUnavailable, StreamTimeoutError) as err:
                if until_end:
                    raise
                log.warning("Kafka unreachable (%s: %s); reading again from the last commit in %.1f s",
                            type(err).__name__, err, retry_s)
                stop.wait(retry_s)
        return counts

    def _follow(self, counts: ArchiveCounts, stop: threading.Event, *, until_end: bool,
                poll_interval_s: float) -> None:
        with kafka_access_errors(self.conn, what=f"read topic {self.topic!r}"), PartitionReader(self.conn) as reader:
            while not stop.is_set():
                # imported by run()'s recovery; the plan: commit head + 1, from the manifests' end offsets
                snapshot = _snapshot(self.out, import_legacy=False)
                start = _next_offsets(read_commits(self.out, snapshot=snapshot))
                end = end_offsets(self.conn, self.topic)
                ranges = [
                    OffsetRange(topic=self.topic, partition=p, start=start.get(p, 0), end=e)
                    for p, e in sorted(end.items())
                    if e > start.get(p, 0)
                ]
                if ranges:
                    self._drain(ranges, reader, counts, stop, snapshot=snapshot)
                if until_end:
                    return
                stop.wait(poll_interval_s)

    def _drain(self, ranges: list[OffsetRange], reader: PartitionReader, counts: ArchiveCounts,
               stop: threading.Event, *, snapshot: Snapshot) -> None:
        events: list[Event] = []
        positions: list[tuple[int, int]] = []
        covered: dict[int, list[int]] = {}
        dead = 0
        pending = 0

        def commit() -> None:
            # Committed against the snapshot the start offsets came from (it moves on with each commit of
            # ours): an archiver that raced another finds the number taken (ArchiveConflict).
            nonlocal events, positions, covered, dead, pending
            if not covered:
                return
            self._flush_dead_letters()
            write_commit(
                self.out, commit=snapshot.head + 1, topic=self.topic, buckets=self.buckets, events=events,
                positions=positions, offsets={p: PartitionRange(s, e) for p, (s, e) in covered.items()},
                dead_letters=dead, run=self._run, snapshot=snapshot,
            )
            counts.events += len(events)
            counts.dead_letters += dead
            counts.messages += pending
            counts.commits += 1
            if self._progress:
                self._progress(counts)
            events, positions, covered, dead, pending = [], [], {}, 0, 0

        starts = {r.partition: r.start for r in ranges}
        for r in ranges:  # one partition after another: each chunk is one Fetch of one partition
            for chunk in read_partition(reader, r):
                p = chunk.partition
                for i, value in enumerate(chunk.values):
                    try:
                        ev = decode_event(value)
                    except EventDecodeError as err:
                        self._dead_letter(chunk.record(i), err)
                        dead += 1
                    else:
                        events.append(ev)
                        positions.append((p, chunk.offsets[i]))
                    span = covered.setdefault(p, [starts[p], chunk.offsets[i] + 1])
                    span[1] = chunk.offsets[i] + 1
                    pending += 1
                    if pending >= self.commit_every:
                        # The next range of each partition starts where this commit ends.
                        for q, (_, e) in covered.items():
                            starts[q] = e
                        commit()
                if stop.is_set():
                    break
            if stop.is_set():
                break
        # Offsets consumed without records (compaction / transaction markers) still count as covered.
        if not stop.is_set():
            for r in ranges:
                if starts[r.partition] < r.end:
                    span = covered.setdefault(r.partition, [starts[r.partition], r.end])
                    span[1] = r.end
        commit()
