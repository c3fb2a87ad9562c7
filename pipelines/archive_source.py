"""ReadArchive: a bounded source over the committed files of an event archive.

The archive layout and commit protocol are in docs/archive.md: only files
named by a ``_commits/<n>.json`` manifest are read (never ``*.tmp`` files of an
unfinished commit). One element per file; each file becomes per-episode
fragments ``(episode_id, list[Event])`` through a columnar conversion
(:func:`table_to_fragments`) that slices token arrays straight out of the Arrow
buffers instead of going through Python lists (``schemas.arrow.table_to_events``
does that and is ~10x slower).

Examples:
    >>> from streams.synth import generate_episodes
    >>> from schemas.arrow import events_to_table
    >>> evs = next(generate_episodes(1, seed=3))
    >>> frags, dead = table_to_fragments(events_to_table(evs), topic="t")
    >>> [(ep, len(e)) for ep, e in frags] == [(evs[0].episode_id, len(evs))], dead
    (True, [])
    >>> frags[0][1] == evs
    True
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, List, Tuple

import apache_beam as beam
import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.metrics import Metrics

from pipelines.decode import validate_event
from pipelines.types import DEAD_LETTER_TAG, METRICS_NAMESPACE
from schemas.arrow import ENVELOPE_FIELDS, payload_fields
from schemas.deadletter import DeadLetter
from schemas.events import EVENT_TYPES, Event, LogProbs, TokenIds

__all__ = ["ReadArchive", "ArchiveFile", "list_archive_files", "table_to_fragments", "read_archive_file"]

_ARRAY_VIEWS = {pa.int32(): TokenIds, pa.float32(): LogProbs}
_DETECTED_BY = "pipeline.read_archive"


class ArchiveFile(msgspec.Struct, frozen=True, kw_only=True):
    """One committed archive data file.

    Attributes:
        path: absolute path of the Parquet file.
        commit: the archive commit that wrote it.
        topic: the topic the archive copies (for dead-letter positions).
    """

    path: str
    commit: int
    topic: str


def list_archive_files(archive_dir: str | Path, *, skip_commits: Sequence[int] = ()) -> list[ArchiveFile]:
    """The data files of every committed archive commit, in commit order.

    Args:
        archive_dir: the archive root.
        skip_commits: commits already consumed (e.g. named by a dataset manifest).

    Raises:
        FileNotFoundError: ``archive_dir`` has no ``_commits/`` directory.
    """
    from streams.archive import read_commits  # the archive's own manifest reader

    root = Path(archive_dir)
    if not (root / "_commits").is_dir():
        raise FileNotFoundError(f"`--archive` {root} is not an event archive (no _commits/ directory)")
    skip = set(skip_commits)
    return [
        ArchiveFile(path=str(root / f), commit=c.commit, topic=c.topic)
        for c in read_commits(root)
        if c.commit not in skip
        for f in c.files
    ]


def _list_column(arr: pa.ListArray, view: type) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list column; ``values[offsets[i]:offsets[i+1]]`` is row i."""
    values = arr.values.to_numpy(zero_copy_only=False)
    return arr.offsets.to_numpy(), np.ascontiguousarray(values).view(view)


def table_to_fragments(table: pa.Table, *, topic: str = "") -> tuple[list[tuple[str, list[Event]]], list[DeadLetter]]:
    """Archive rows → per-episode fragments (episode order of first appearance) and dead letters.

    Rows that do not make a valid event (``__post_init__`` or
    :func:`pipelines.decode.validate_event` rejects them) become dead letters
    with reason ``invalid_event``/``invalid_seq``/... and their Kafka position.
    Columns missing from older files take the field defaults.
    """
    n = table.num_rows
    env_cols = {
        name: _times(table.column(name)) if name == "event_time" else table.column(name).to_pylist()
        for name in ENVELOPE_FIELDS
        if name in table.column_names
    }
    etypes = env_cols["event_type"]
    parts = table.column("kafka_partition").to_pylist() if "kafka_partition" in table.column_names else [None] * n
    offs = table.column("kafka_offset").to_pylist() if "kafka_offset" in table.column_names else [None] * n
    events: list[Event | None] = [None] * n
    dead: list[DeadLetter] = []
    etype_arr = np.asarray(etypes, dtype=object)
    for name, cls in EVENT_TYPES.items():
        rows = np.flatnonzero(etype_arr == name)
        if not len(rows) or name not in table.column_names:
            continue
        struct = table.column(name).combine_chunks()
        scalars: dict[str, list[Any]] = {}
        arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for field in payload_fields(name):
            idx = struct.type.get_field_index(field)
            if idx < 0:
                continue  # older file: the field takes its default
            child = struct.field(idx)
            if pa.types.is_list(child.type) and child.type.value_type in _ARRAY_VIEWS:
                arrays[field] = _list_column(child, _ARRAY_VIEWS[child.type.value_type])
            else:
                scalars[field] = child.to_pylist()
        for i in rows:
            data = {k: v[i] for k, v in env_cols.items() if k != "event_type"}
            for k, v in scalars.items():
                if v[i] is not None:
                    data[k] = v[i]
            for k, (o, vals) in arrays.items():
                data[k] = vals[o[i]:o[i + 1]]
            try:
                ev = msgspec.convert(data, cls, dec_hook=_dec_hook, strict=False)
                problem = validate_event(ev, key=None)
            except (msgspec.ValidationError, ValueError, TypeError) as err:
                problem = ("invalid_event", f"{name} row {i}: {err}")
            if problem is not None:
                dead.append(DeadLetter(
                    reason=problem[0], message=problem[1], source_topic=topic,
                    source_partition=parts[i] if parts[i] is not None else -1,
                    source_offset=offs[i] if offs[i] is not None else -1,
                    key=(data.get("episode_id") or "").encode(), value=None,
                    detected_by=_DETECTED_BY, event_type=name,
                ))
                continue
            events[i] = ev
    by_episode: dict[str, list[Event]] = defaultdict(list)
    for ev in events:
        if ev is not None:
            by_episode[ev.episode_id].append(ev)
    return list(by_episode.items()), dead


def _times(col: pa.ChunkedArray) -> list[datetime]:
    """UTC datetimes of a timestamp column (numpy path; ``to_pylist`` is ~5x slower with a tz)."""
    naive = col.cast(pa.timestamp("us")).to_numpy().astype("datetime64[us]").astype(object)
    return [t.replace(tzinfo=timezone.utc) for t in naive]


def _dec_hook(typ: type, obj: Any) -> Any:
    if (typ is TokenIds or typ is LogProbs) and isinstance(obj, typ):
        return obj
    if typ is TokenIds or typ is LogProbs:
        from schemas.events import as_logprobs, as_token_ids

        return as_token_ids(obj) if typ is TokenIds else as_logprobs(obj)
    raise TypeError(f"Expected `{typ.__name__}`, got `{type(obj).__name__}`")


def read_archive_file(path: str | Path, *, topic: str = "") -> tuple[list[tuple[str, list[Event]]], list[DeadLetter], int]:
    """Read one archive Parquet file: (fragments, dead letters, rows read)."""
    table = pq.read_table(path)
    frags, dead = table_to_fragments(table, topic=topic)
    return frags, dead, table.num_rows


class _ReadFileFn(beam.DoFn):
    def __init__(self) -> None:
        self._events_in = Metrics.counter(METRICS_NAMESPACE, "events_in")
        self._dead = Metrics.counter(METRICS_NAMESPACE, "dead_letters")
        self._files = Metrics.counter(METRICS_NAMESPACE, "archive_files_read")

    def process(self, f: ArchiveFile) -> Iterator[Any]:
        frags, dead, rows = read_archive_file(f.path, topic=f.topic)
        self._files.inc()
        self._events_in.inc(rows)
        if dead:
            self._dead.inc(len(dead))
        for d in dead:
            yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, d)
        yield from frags


class ReadArchive(beam.PTransform):
    """Read committed archive files as per-episode fragments (plus dead letters).

    Args:
        archive_dir: the archive root (docs/archive.md).
        files: the files to read; default: every committed file
            (:func:`list_archive_files`). The job passes only the commits no
            dataset manifest covers yet.

    Returns:
        A ``DoOutputsTuple`` with ``fragments`` and ``dead_letters``.
        Counters ``pipeline/events_in``, ``pipeline/dead_letters``,
        ``pipeline/archive_files_read``.
    """

    def __init__(self, archive_dir: str | Path, *, files: Sequence[ArchiveFile] | None = None) -> None:
        super().__init__()
        self._files = list(files) if files is not None else list_archive_files(archive_dir)

    def expand(self, pbegin):
        return (
            pbegin
            | "ListFiles" >> beam.Create(self._files, reshuffle=False)
            | "Distribute" >> beam.Reshuffle()
            | "ReadFiles" >> beam.ParDo(_ReadFileFn()).with_output_types(Tuple[str, List[Event]]).with_outputs(DEAD_LETTER_TAG, main="fragments")
        )
