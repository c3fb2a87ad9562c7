"""Late events: events of an episode that an earlier commit wrote as incomplete.

An unfinished episode goes out as ``incomplete`` once it has been idle for
``--incomplete-after`` seconds of event time. Its events can still come (a
producer's spooled tail flushed late, a partition read far behind the others);
they are never dropped silently:

* **late state** — a commit that writes an episode as incomplete also keeps its
  events (``_state/<V>/late-<n>.arrow``, archive event schema, Arrow IPC; the
  manifest's ``late_state`` names the live files with their newest event time)
  for ``--late-retention`` seconds of event time after the episode's last event;
* an event of such an episode that comes again is resolved against the kept
  events (:func:`pipelines.assemble.resolve_late`): a copy of a kept event is a **duplicate**, a
  different event at a kept ``seq`` a ``seq_conflict`` dead letter, and every
  other one is **late** (``late_events``; a row of
  ``late_events/recipe=<V>/c<n>.parquet`` with its ``late_reason``);
* the kept events plus the late ones are assembled again. ``completed``: the
  episode is complete now and written as a complete episode with
  ``completed_late=True`` (``episodes_completed_late``); ``stored``: still
  incomplete, all its events are kept in this commit's late state; ``expired``:
  nothing was kept (past the retention, or written incomplete before late state
  existed), so the late events are only recorded in the late table — and a copy
  of an old event can no longer be told from a new one.

Each event read is counted once: ``events_in + events_pending_in ==
events_used + events_incomplete + events_pending_out + dead_letters +
duplicates + late_events``. Events read back from the late state are state, not
input, and are in no term (a late-completed episode's events were counted as
``events_incomplete`` by the earlier commit and as ``late_events`` now).

Examples:
    >>> late_table_path(version="outcome-1a2b3c4d", commit=7)
    'late_events/recipe=outcome-1a2b3c4d/c00000007.parquet'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.arrow import events_to_table
from schemas.events import Event
from schemas.locations import join, read_feather, write_feather

__all__ = [
    "LATE_TAG",
    "LATE_REASONS",
    "LATE_STATE_FILE",
    "DEFAULT_LATE_RETENTION_S",
    "LateEpisode",
    "LateState",
    "LateStateReader",
    "StoredEpisode",
    "late_table_path",
    "late_state_index",
    "write_late_files",
    "late_state_newest_s",
]

#: Output tag of the assemblers' :class:`LateEpisode` elements.
LATE_TAG = "late"
#: ``late_reason`` of a late-table row (see the module docstring).
LATE_REASONS = ("completed", "stored", "expired")
#: Staged late-state file (under ``state/``), committed as ``_state/<V>/late-<n>.arrow``.
LATE_STATE_FILE = "late.arrow"
#: Event-time seconds an incomplete episode's events are kept after its last event (``--late-retention``).
DEFAULT_LATE_RETENTION_S = 7 * 24 * 3600.0


class LateEpisode(msgspec.Struct, kw_only=True, gc=False):
    """What one commit records about an episode written as incomplete (the assemblers' ``late`` output).

    Attributes:
        episode_id: the episode.
        reason: why ``late`` came late — ``completed``, ``stored`` or ``expired``
            (:data:`LATE_REASONS`); None for an episode this commit writes as
            incomplete (nothing late yet; ``store`` holds its events).
        late: the late events (rows of the late table).
        store: the episode's events to keep in the late state after this commit
            (empty: keep none).
    """

    episode_id: str
    reason: str | None
    late: list[Event] = []
    store: list[Event] = []


class StoredEpisode(msgspec.Struct, frozen=True, array_like=True):
    """Where an episode's kept events are: rows ``[start, start + rows)`` of late-state file ``file``.

    Attributes:
        file: index into :attr:`LateState.files`.
        start: first row (a file's rows are sorted by episode and seq).
        rows: its rows.
        last_s: its latest event time, epoch seconds (the retention counts from it).
    """

    file: int
    start: int
    rows: int
    last_s: float


class LateState(msgspec.Struct, frozen=True, kw_only=True):
    """The late state as the last commit left it, for the assemblers (shipped with the DoFn).

    Attributes:
        incomplete: episodes committed as incomplete and never as complete:
            their new events are late.
        stored: of those, the ones whose events are kept and within the retention.
        files: absolute paths of the late-state files ``stored`` points into.
    """

    incomplete: frozenset[str] = frozenset()
    stored: dict[str, StoredEpisode] = {}
    files: tuple[str, ...] = ()


class LateStateReader:
    """Reads kept events of one episode at a time (files memory-mapped once per reader)."""

    def __init__(self, state: LateState) -> None:
        self._state = state
        self._tables: dict[int, pa.Table] = {}

    def events(self, episode_id: str) -> list[Event]:
        """The kept events of ``episode_id``, sorted by seq (empty: none kept, or past the retention)."""
        from pipelines.archive_source import table_to_fragments

        ref = self._state.stored.get(episode_id)
        if ref is None:
            return []
        table = self._tables.get(ref.file)
        if table is None:
            table = self._tables[ref.file] = read_feather(self._state.files[ref.file], memory_map=True)
        frags, _ = table_to_fragments(table.slice(ref.start, ref.rows))  # written by us from valid events
        return sorted((e for _, evs in frags for e in evs), key=lambda e: e.seq)


def late_state_index(paths: Sequence[str], *, skip: Iterable[str] = ()) -> dict[str, StoredEpisode]:
    """``episode_id -> StoredEpisode`` over late-state files in commit order (a later copy wins).

    Reads only the ``episode_id`` and ``event_time`` columns. Episodes in ``skip`` are left out.
    """
    skip = set(skip)
    out: dict[str, StoredEpisode] = {}
    for i, path in enumerate(paths):
        t = read_feather(path, columns=["episode_id", "event_time"], memory_map=True)
        if not t.num_rows:
            continue
        us = pc.cast(pc.cast(t["event_time"], pa.timestamp("us", tz="UTC")), pa.int64())
        agg = pa.table({"e": t["episode_id"], "i": np.arange(t.num_rows), "t": us}).group_by("e").aggregate(
            [("i", "min"), ("i", "count"), ("t", "max")])
        for e, start, rows, last in zip(*(agg[c].to_pylist() for c in ("e", "i_min", "i_count", "t_max"))):
            if e not in skip:
                out[e] = StoredEpisode(file=i, start=start, rows=rows, last_s=last / 1e6)
    return out


def late_state_newest_s(path: str | Path) -> float:
    """Newest event time (epoch seconds) in a late-state file (0.0 when empty)."""
    t = read_feather(str(path), columns=["event_time"], memory_map=True)
    if not t.num_rows:
        return 0.0
    return pc.max(pc.cast(pc.cast(t["event_time"], pa.timestamp("us", tz="UTC")), pa.int64())).as_py() / 1e6


def late_table_path(*, version: str, commit: int) -> str:
    """Path (relative to ``<out>``) of a commit's late-events table."""
    return f"late_events/recipe={version}/c{commit:08d}.parquet"


def _late_table(items: Sequence[LateEpisode]) -> pa.Table:
    rows = sorted(((i.episode_id, e.seq, i.reason, e) for i in items for e in i.late), key=lambda r: r[:2])
    table = events_to_table([r[3] for r in rows])
    return table.append_column("late_reason", pa.array([r[2] for r in rows], pa.string()))


def write_late_files(items: Sequence[LateEpisode], staging: str | Path, *, version: str, commit: int,
                     suffix: str) -> list[str]:
    """Stage one commit's late table and late-state file; returns their final relative paths.

    The late table (archive event schema plus ``late_reason``; rows sorted by
    episode and seq) is ``late_events/recipe=<V>/c<n>.parquet``; the late state
    (``store`` events, Arrow IPC, sorted) is ``state/late.arrow``, which the
    commit renames to ``_state/<V>/late-<n>.arrow``.

    Args:
        items: the commit's :class:`LateEpisode` elements.
        staging: the commit's staging directory.
        version: dataset version.
        commit: commit number.
        suffix: the staged-file suffix (:data:`pipelines.sinks.STAGED_SUFFIX`).
    """
    from pipelines.sinks import write_parquet

    out: list[str] = []
    if any(i.late for i in items):
        rel = late_table_path(version=version, commit=commit)
        write_parquet(_late_table(items), join(str(staging), rel + suffix))
        out.append(rel)
    stored = sorted((i for i in items if i.store), key=lambda i: i.episode_id)
    if stored:
        events = [e for i in stored for e in sorted(i.store, key=lambda e: e.seq)]
        write_feather(events_to_table(events), join(str(staging), "state", LATE_STATE_FILE + suffix))
        out.append("state/" + LATE_STATE_FILE)
    return out
