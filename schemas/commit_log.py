"""A commit log kept as a Delta table: the commit point of the dataset and archive commits.

A writer's commits are numbered ``1, 2, ...`` with no gap. Commit ``n`` is one Delta transaction on
the log table that adds **no data file**: it carries the commit's record (the manifest's JSON) in its
commit metadata (``commitInfo``, key :data:`RECORD_KEY`) and the **application transaction**
``app_id`` = ``n`` (Delta's ``txn`` action). The log table's version ``n`` is therefore commit ``n``
(version 0 creates the table).

Why a Delta table and not a manifest file per commit: the Delta log arbitrates two writers racing
for commit ``n`` by itself, the same way on a local disk and on an object store, with no ``flock``
and no conditional PUT of our own. A writer plans commit ``n`` from a :class:`Snapshot` (head
``n - 1``) and commits against it; delta-rs' conflict checker refuses the transaction when a
commit carrying the same application id landed after that snapshot (``CommitFailedError``,
"Concurrent transaction failed"), which :meth:`Snapshot.commit` turns into :class:`CommitTaken`.
The loser made no commit: it drops what it staged and plans again, or stops with one line.
Measured on SeaweedFS and locally (deltalake 1.6.6): ``tests/storage/test_commit_log.py``.

No data files means nothing a glob reader (``read_parquet('<dir>/**/*.parquet')``) could pick up,
so the log can live inside a directory that is globbed (the archive's). No checkpoints either
(``commitInfo`` is not kept in a checkpoint): a snapshot reads one small JSON file per commit, as
listing a directory of manifests did.

References: the Delta transaction protocol, ``txn`` (application transaction identifiers) and
``commitInfo`` actions, https://github.com/delta-io/delta/blob/master/PROTOCOL.md; delta-rs'
conflict checker (``crates/core/src/operations/transaction/conflict_checker.rs``,
``ConcurrentTransaction``).

Examples:
    >>> import tempfile
    >>> log = CommitLog(tempfile.mkdtemp() + "/_commit_log/v1", app_id="trajpipe.v1")
    >>> mine, rival = log.snapshot(), log.snapshot()
    >>> mine.head, mine.records()
    (0, [])
    >>> mine.commit(b'{"commit": 1}'), mine.commit(b'{"commit": 2}')
    (1, 2)
    >>> log.snapshot().records(), log.snapshot(as_of=1).records()
    ([b'{"commit": 1}', b'{"commit": 2}'], [b'{"commit": 1}'])
    >>> rival.commit(b'{"commit": 1, "rival": true}')
    Traceback (most recent call last):
    ...
    schemas.commit_log.CommitTaken: commit 1 of ... was made by another writer first
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Schema, Transaction
from deltalake.exceptions import DeltaError, TableNotFoundError
from deltalake.transaction import create_table_with_add_actions

from schemas import locations as loc
from schemas.storage import delta_storage_options

_logger = logging.getLogger(__name__)

__all__ = ["CommitLog", "CommitLogError", "CommitTaken", "ImportMismatch", "Snapshot", "RECORD_KEY"]

#: Commit-metadata key holding a commit's record (its manifest, JSON text).
RECORD_KEY = "trajpipe.record"
#: Commit-metadata key holding the commit number (also the ``txn`` version).
COMMIT_KEY = "trajpipe.commit"

_ATTEMPTS = 3  # tries of one commit whose refusal was not a rival's commit
_COMMIT_FILE = re.compile(r"(\d{20})\.json")
_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)
# The log's schema: Delta needs one; no row is ever written.
_SCHEMA = Schema.from_arrow(pa.schema([pa.field("commit", pa.int64())]))


class CommitLogError(RuntimeError):
    """The commit log is unreadable, has a gap, or refused a commit for a reason other than a rival writer."""


class CommitTaken(CommitLogError):
    """Another writer made this commit first; this one made no commit."""

    def __init__(self, commit: int, where: str) -> None:
        super().__init__(f"commit {commit} of {where} was made by another writer first")
        self.commit, self.where = commit, where


class ImportMismatch(CommitLogError):
    """The log already holds a commit of the records being imported, with another record."""

    def __init__(self, commit: int, where: str) -> None:
        super().__init__(f"commit {commit} of {where} differs from the record being imported")
        self.commit = commit


class CommitLog:
    """The commit log at ``root`` (a local directory or ``s3://`` URI; created by the first commit).

    Args:
        root: where the log table is (e.g. ``<out>/_commit_log/<version>``).
        app_id: the application transaction id of this log's commits.
    """

    def __init__(self, root: str | os.PathLike[str], *, app_id: str) -> None:
        text = os.fspath(root)
        self.root = text if loc.is_remote(text) else str(Path(text))
        self.app_id = app_id
        self._options = delta_storage_options(self.root) or None

    def __repr__(self) -> str:
        return f"CommitLog({self.root!r}, app_id={self.app_id!r})"

    def exists(self) -> bool:
        """Whether the log table has been created."""
        if loc.is_remote(self.root):
            return bool(loc.list_files(loc.join(self.root, "_delta_log"), suffix=".json"))
        return (Path(self.root) / "_delta_log").is_dir()

    def _open(self, version: int | None = None) -> DeltaTable | None:
        if not self.exists():
            return None
        try:
            dt = DeltaTable(self.root, storage_options=self._options)
            if version is not None:
                dt.load_as_version(version)
            return dt
        except TableNotFoundError:
            return None
        except DeltaError as err:
            raise CommitLogError(f"the commit log {self.root} is unreadable: {err}") from err

    def _create(self) -> DeltaTable:
        # No retry: delta-rs retries a create that lost the race for version 0 as version 1 (a second
        # CREATE TABLE over the first, seen with four writers at once), which shifted every commit by one.
        try:
            create_table_with_add_actions(self.root, _SCHEMA, [], mode="error", partition_by=[],
                                          storage_options=self._options,
                                          commit_properties=CommitProperties(
                                              custom_metadata={"trajpipe.log": self.app_id}, max_commit_retries=0),
                                          post_commithook_properties=_HOOKS)
        except DeltaError:  # another writer created it first
            pass
        dt = self._open()
        if dt is None:
            raise CommitLogError(f"cannot create the commit log {self.root}")
        return dt

    def snapshot(self, *, as_of: int | None = None) -> Snapshot:
        """The log as it is now (or as of commit ``as_of``): its head and records, and the base of the next commit.

        Raises:
            CommitLogError: the log is unreadable, or ``as_of`` is beyond its head.
        """
        dt = self._open()
        if dt is not None and as_of is not None:
            head = _head(dt, self.app_id)
            if not 0 <= as_of <= head:
                raise CommitLogError(f"the commit log {self.root} has commits 1..{head}, not {as_of}")
            dt = self._open(version=_table_version_of(dt, self.app_id, as_of))
        return Snapshot(self, dt)

    def head(self) -> int:
        """The last commit made (0: none)."""
        return self.snapshot().head

    def import_records(self, records: Sequence[bytes], *, sources: Sequence[str]) -> int:
        """Make commits ``1 .. len(records)`` with these records where the log does not have them yet.

        For moving commit records kept elsewhere (manifest files of an earlier layout) into the log. A rival
        importing the same records at the same time is no error: the commits it makes first are checked, not made
        again. ``sources[i]`` names where record ``i + 1`` came from (commit metadata ``trajpipe.imported_from``).

        Returns:
            How many commits this call made.

        Raises:
            ImportMismatch: the log holds one of those commits with another record.
            CommitLogError: as :meth:`Snapshot.commit`.
        """
        made = 0
        snap = self.snapshot()
        while snap.head < len(records):
            try:
                snap.commit(records[snap.head], metadata={"trajpipe.imported_from": sources[snap.head]})
                made += 1
            except CommitTaken:
                snap = self.snapshot()  # a rival imports too: read again, check what it made
        held = self.snapshot().records()[:len(records)]
        differ = [n for n, (a, b) in enumerate(zip(records, held), start=1) if a != b]
        if differ:
            raise ImportMismatch(differ[0], self.root)
        return made

    def read_records(self, *, after: int = 0, as_of: int | None = None) -> list[bytes]:
        """The records of commits ``after + 1 ..`` through ``as_of`` (None: the last), read from the log's files.

        A reader's path: it reads the commit files (``_delta_log/<v>.json``, table version ``v`` =
        commit ``v``, or a later version in a log created twice at once before 2026-12-06) through
        :mod:`schemas.locations`, not through deltalake, so it works in a process forked after deltalake
        was used (the trainer's DataLoader workers: delta-rs' runtime does not survive a fork), and reads
        only the files of commits after ``after``. What it
        returns is what :meth:`Snapshot.records` of a snapshot taken at the same moment returns.

        Raises:
            CommitLogError: a commit file is unreadable or lacks its record, the numbers have a gap,
                or ``as_of`` is beyond the last commit.
        """
        log_dir = loc.join(self.root, "_delta_log")
        versions = sorted(int(m.group(1)) for p in loc.list_files(log_dir, suffix=".json")
                          if (m := _COMMIT_FILE.fullmatch(p.rsplit("/", 1)[-1])))
        if versions != list(range(len(versions))):
            raise CommitLogError(f"the commit log {self.root} has a gap in its commit files ({versions[:5]}...)")
        # Commit n is table version n, or a later one where the log holds a second CREATE TABLE (two
        # writers created it at once before _create's fix): read on from version after + 1.
        got: dict[int, bytes] = {}
        for v in versions[after + 1:]:
            path = loc.join(log_dir, f"{v:020d}.json")
            try:
                actions = [json.loads(line) for line in loc.read_bytes(path).splitlines() if line.strip()]
            except (OSError, ValueError) as err:
                raise CommitLogError(f"the commit log {self.root}: commit file {path} is unreadable: {err}") from err
            info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
            if COMMIT_KEY not in info and info.get("operation") == "CREATE TABLE":
                continue
            txn = next((a["txn"] for a in actions if a.get("txn", {}).get("appId") == self.app_id), {})
            n = int(info[COMMIT_KEY]) if str(info.get(COMMIT_KEY, "")).isdigit() else None
            if n is None or RECORD_KEY not in info or txn.get("version") != n or n in got:
                raise CommitLogError(f"the commit log {self.root} lacks the record of a commit (in {path})")
            got[n] = info[RECORD_KEY].encode()
        head = max(got, default=after)
        if as_of is not None:
            if not 0 <= as_of <= head:
                raise CommitLogError(f"the commit log {self.root} has commits 1..{head}, not {as_of}")
            head = as_of
        missing = [n for n in range(after + 1, head + 1) if n not in got]
        if missing:
            raise CommitLogError(f"the commit log {self.root} lacks the record of commit {missing[0]}")
        out = [got[n] for n in range(after + 1, head + 1)]
        return out


class Snapshot:
    """One read of a :class:`CommitLog`: ``head`` (the last commit in it) and :meth:`records`.

    :meth:`commit` makes commit ``head + 1`` against this read: it is refused (:class:`CommitTaken`)
    if any commit of the log was made since. After a commit the snapshot is at that commit, so a
    writer can go on committing from it.
    """

    def __init__(self, log: CommitLog, table: DeltaTable | None) -> None:
        self.log, self._table = log, table
        self.head = _head(table, log.app_id) if table is not None else 0
        self._stale = False  # another writer committed after this snapshot's own last commit
        self._records: list[bytes] | None = None

    def records(self, *, after: int = 0) -> list[bytes]:
        """The records of commits ``after + 1 .. head``, in commit order.

        Raises:
            CommitLogError: a commit lacks its record, or the numbers have a gap.
        """
        if self._table is None or self.head <= after:
            return []
        if self._records is not None:
            return self._records[after:]
        # history() lists newest first; the table may hold commits past `head` (see commit())
        newest = _head(self._table, self.log.app_id)
        entries = self._table.history(limit=None if after == 0 else newest - after + 1)
        got: dict[int, bytes] = {}
        for e in entries:
            if COMMIT_KEY in e and RECORD_KEY in e:
                n = int(e[COMMIT_KEY])
                if n in got:
                    raise CommitLogError(f"the commit log {self.log.root} has commit {n} twice (log versions "
                                         f"of both: see its history); it cannot be trusted")
                got[n] = e[RECORD_KEY].encode()
        want = range(after + 1, self.head + 1)
        missing = [n for n in want if n not in got]
        if missing:
            raise CommitLogError(f"the commit log {self.log.root} lacks the record of commit {missing[0]} "
                                 f"(head {self.head})")
        records = [got[n] for n in want]
        if after == 0:
            self._records = records
        return list(records)

    def commit(self, record: bytes, *, metadata: Mapping[str, str] | None = None) -> int:
        """Make commit ``head + 1`` with ``record`` (and extra commit metadata); returns its number.

        Raises:
            CommitTaken: another writer made a commit of this log since this snapshot was read.
            CommitLogError: the commit failed for another reason (message says which).
        """
        n = self.head + 1
        if self._stale:
            raise CommitTaken(n, self.log.root)
        table = self._table if self._table is not None else self.log._create()
        if _head(table, self.log.app_id) >= n:
            raise CommitTaken(n, self.log.root)  # the log was created and committed to by another writer
        props = CommitProperties(
            custom_metadata={**(metadata or {}), COMMIT_KEY: str(n), RECORD_KEY: record.decode()},
            app_transactions=[Transaction(app_id=self.log.app_id, version=n)])
        for attempt in range(_ATTEMPTS):
            try:
                table.create_write_transaction([], mode="append", schema=_SCHEMA, partition_by=[],
                                               commit_properties=props, post_commithook_properties=_HOOKS)
                break
            except DeltaError as err:
                # Refused: mostly a rival's commit n (CommitFailedError, "Concurrent transaction failed"), but
                # delta-rs also reports a lost race as other conflicts (seen: "Metadata changed since last
                # commit"). The log itself says what happened: commit n is ours, a rival's, or not made.
                now = self.log.snapshot()
                if now.head >= n:
                    if now.records(after=n - 1)[0] == record:
                        break  # made after all (the error came after the log entry was written)
                    raise CommitTaken(n, self.log.root) from None
                if now.head != n - 1 or now._table is None or attempt == _ATTEMPTS - 1:
                    raise CommitLogError(f"cannot make commit {n} of {self.log.root}: {err}") from err
                table = now._table  # nothing was committed since this snapshot: the plan holds, try again
                _logger.debug("commit %d of %s refused with no rival commit (%s): trying again", n, self.log.root, err)
        latest = self.log._open()
        self.head, self._table = n, latest
        self._stale = latest is None or _head(latest, self.log.app_id) != n
        if self._records is not None or n == 1:  # else records() reads them when asked (the table is at n or later)
            self._records = (self._records or []) + [record]
        return n


def _head(table: DeltaTable, app_id: str) -> int:
    return table.transaction_version(app_id) or 0


def _table_version_of(table: DeltaTable, app_id: str, commit: int) -> int:
    """The log table's version that made ``commit`` (0 for commit 0: the empty log)."""
    if commit == 0:
        return 0
    for e in table.history():
        if e.get(COMMIT_KEY) == str(commit):
            return int(e["version"])
    raise CommitLogError(f"the commit log {table.table_uri} has no commit {commit}")
