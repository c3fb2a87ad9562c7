"""ReadArchiveEpisodes: a bounded source over the committed files of an event archive.

The archive layout and commit protocol are in docs/archive.md: only files
named by a manifest in the archive's commit log (``_commit_log/``) are read (never
``*.tmp`` files of an unfinished commit). One element per file; each file becomes per-episode
fragments ``(episode_id, list[Event])`` through a columnar conversion
(:func:`table_to_fragments`) that slices token arrays straight out of the Arrow
buffers instead of going through Python lists (``schemas.arrow.table_to_events``
does that and is ~10x slower). The archive keeps an episode's events
together, so episodes held whole by one file are assembled right there
(:class:`ReadArchiveEpisodes`); only those spread over files take the shuffle.

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

import enum
import functools
import math
import os
import typing
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import apache_beam as beam
import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.decode import validate_event
from pipelines.frames import FRAMES_TAG  # the frames of split episodes
from pipelines.gcpause import gc_paused
from pipelines.late import LateState
from pipelines.types import DEAD_LETTER_TAG
from schemas import locations as loc
from schemas.arrow import ENVELOPE_FIELDS, archive_schema, payload_fields
from schemas.deadletter import DeadLetter
from schemas.events import EVENT_TYPES, Event, LogProbs, TokenIds

__all__ = [
    "ReadArchiveEpisodes",
    "ArchiveFile",
    "list_archive_files",
    "split_episode_ids",
    "table_to_fragments",
    "read_archive_file",
    "FRAMES_TAG",
]

_ARRAY_VIEWS = {pa.int32(): TokenIds, pa.float32(): LogProbs}
_DETECTED_BY = "pipeline.read_archive"


class ArchiveFile(msgspec.Struct, frozen=True, kw_only=True):
    """One committed archive data file.

    Attributes:
        path: absolute path of the Parquet file (or its ``s3://`` URI).
        commit: the archive commit that wrote it.
        topic: the topic the archive copies (for dead-letter positions).
        created_s: when the archive commit was made (epoch seconds): its events
            were produced before it (the processing time future event times are
            judged against).
    """

    path: str
    commit: int
    topic: str
    created_s: float = 0.0


def list_archive_files(archive_dir: str | Path, *, skip_commits: Sequence[int] = ()) -> list[ArchiveFile]:
    """The data files of every committed archive commit, in commit order.

    Args:
        archive_dir: the archive root: a directory or ``s3://BUCKET/PREFIX`` (:mod:`schemas.locations`).
        skip_commits: commits already consumed (e.g. named by a dataset manifest).

    Raises:
        FileNotFoundError: ``archive_dir`` holds no event archive (no ``_archive.json``, ``_commit_log/``).
    """
    from streams.archive import is_archive, read_commits  # the archive's own manifest reader

    root: str | Path = os.fspath(archive_dir).rstrip("/") if loc.is_remote(archive_dir) else Path(archive_dir)
    if not is_archive(root):
        raise FileNotFoundError(f"`--archive` {root} is not an event archive (no _archive.json, no _commit_log/)")
    skip = set(skip_commits)
    return [
        ArchiveFile(path=loc.join(root, f) if isinstance(root, str) else str(root / f), commit=c.commit,
                    topic=c.topic, created_s=c.created_at.timestamp())
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

    Columns typed as :func:`schemas.arrow.archive_schema` says (files this
    version wrote) build the events directly from column values, per event
    type; anything else (older or foreign types, nulls in a column) goes
    through ``msgspec.convert``, which checks and coerces every value.

    Every row leaves as an event or a dead letter: rows of an unknown (or
    null) ``event_type``, or whose type has no struct column in the file,
    are dead letters too (``unknown_type`` / ``invalid_event``).

    Raises:
        KeyError: the table has no ``event_type`` column (not an archive table).
    """
    n = table.num_rows
    env_cols = {  # 1-d object arrays (np.asarray would make a 2-d array of a column of equal-length lists)
        name: np.fromiter(_times(table.column(name)) if name == "event_time" else table.column(name).to_pylist(),
                          dtype=object, count=n)
        for name in ENVELOPE_FIELDS
        if name in table.column_names
    }
    parts = table.column("kafka_partition").to_pylist() if "kafka_partition" in table.column_names else [None] * n
    offs = table.column("kafka_offset").to_pylist() if "kafka_offset" in table.column_names else [None] * n
    events: list[Event | None] = [None] * n
    dead: list[DeadLetter] = []
    etype_arr = env_cols["event_type"]
    episode_ids = env_cols.get("episode_id", np.full(n, None, dtype=object))

    def dead_letter(i: int, reason: str, message: str, event_type: str | None) -> DeadLetter:
        episode_id = episode_ids[i]
        return DeadLetter(
            reason=reason, message=message, source_topic=topic,
            source_partition=parts[i] if isinstance(parts[i], int) else -1,
            source_offset=offs[i] if isinstance(offs[i], int) else -1,
            key=(episode_id if isinstance(episode_id, str) else "").encode(), value=None,
            detected_by=_DETECTED_BY, event_type=event_type,
        )

    typed = _typed_as_archive(table.schema)
    known = np.zeros(n, dtype=bool)
    for name, cls in EVENT_TYPES.items():
        rows = np.flatnonzero(etype_arr == name)
        known[rows] = True
        if not len(rows):
            continue
        if name not in table.column_names or not pa.types.is_struct(table.column(name).type):
            dead.extend(dead_letter(i, "invalid_event", f"{name} row {i}: the file has no `{name}` struct column "
                                    "with its fields", name) for i in rows.tolist())
            continue
        column = table.column(name)
        struct = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()  # one chunk: no copy
        taken = pa.array(rows)  # Arrow indices: numpy ones are converted on every take
        columns: dict[str, list[Any]] = {k: v[rows].tolist() for k, v in env_cols.items() if k != "event_type"}
        # Columns that may hold a null among these rows (Arrow's null counts: a scan for None costs ~4 % here).
        maybe_null = {k for k in columns if table.column(k).null_count}
        for field in payload_fields(name):
            idx = struct.type.get_field_index(field)
            if idx < 0:
                continue  # older file: the field takes its default
            child = struct.field(idx)
            if pa.types.is_list(child.type) and child.type.value_type in _ARRAY_VIEWS:
                o, vals = _list_column(child, _ARRAY_VIEWS[child.type.value_type])
                starts, ends = o[rows].tolist(), o[rows + 1].tolist()  # Python ints: numpy scalars slice ~5x slower
                columns[field] = [vals[a:b] for a, b in zip(starts, ends)]  # never None: a null list is empty
            else:
                values = child.take(taken)
                columns[field] = values.to_pylist()
                if values.null_count:
                    maybe_null.add(field)
        nullable = _nullable(cls)
        fast = typed and not any(None in columns[k] for k in maybe_null if k not in nullable)
        if fast:
            try:
                converted = {k: [convert(v) for v in columns[k]] for k, convert in _converters(cls).items()
                             if k in columns}
            except (msgspec.ValidationError, ValueError, TypeError):
                fast = False  # a value the schema's type allows but the field does not (e.g. an unknown status)
            else:
                columns.update(converted)
        names = list(columns)
        if fast:  # types guaranteed by the file schema: construct in one C-level pass, validate after
            try:
                built = list(map(_constructor(cls, tuple(names)), *columns.values()))
            except (msgspec.ValidationError, ValueError, TypeError):
                pass  # some row's __post_init__ refused: the loop below makes that row a dead letter
            else:
                for i, ev in zip(rows.tolist(), built):
                    problem = validate_event(ev, key=None)
                    if problem is not None:
                        dead.append(dead_letter(i, problem[0], problem[1], name))
                    else:
                        events[i] = ev
                continue
        for i, values in zip(rows.tolist(), zip(*columns.values())):
            data = dict(zip(names, values))
            try:
                if fast:  # types guaranteed by the file schema: construct directly
                    ev = cls(**data)
                else:
                    ev = msgspec.convert({k: v for k, v in data.items() if v is not None}, cls, dec_hook=_dec_hook,
                                         strict=False)
                problem = validate_event(ev, key=None)
            except (msgspec.ValidationError, ValueError, TypeError) as err:
                problem = ("invalid_event", f"{name} row {i}: {err}")
            if problem is not None:
                dead.append(dead_letter(i, problem[0], problem[1], name))
                continue
            events[i] = ev
    for i in np.flatnonzero(~known).tolist():
        dead.append(dead_letter(i, "unknown_type", f"row {i}: event_type {etype_arr[i]!r} is not one of "
                                f"{', '.join(EVENT_TYPES)}", None))
    by_episode: dict[str, list[Event]] = defaultdict(list)
    for ev in events:
        if ev is not None:
            by_episode[ev.episode_id].append(ev)
    return list(by_episode.items()), dead


_PLAIN_TYPES = (str, int, float, bool, datetime, TokenIds, LogProbs)


@functools.lru_cache(maxsize=None)
def _constructor(cls: type, names: tuple[str, ...]) -> Any:
    """``f(v0, v1, ...) == cls(names[0]=v0, names[1]=v1, ...)``, compiled once per (type, fields).

    A keyword call with the names in the code: no dict per row, as ``cls(**dict(zip(names, values)))``
    would build (the events are ``kw_only`` Structs). Names are the event type's own field names.

    Examples:
        >>> from schemas.events import EpisodeStarted
        >>> _constructor(EpisodeStarted, ("episode_id",)).__code__.co_varnames
        ('v0',)
    """
    fields = {f.name for f in msgspec.structs.fields(cls)}
    if not set(names) <= fields or not all(n.isidentifier() for n in names):
        raise ValueError(f"not fields of {cls.__name__}: {sorted(set(names) - fields)}")
    args = ", ".join(f"v{i}" for i in range(len(names)))
    call = ", ".join(f"{n}=v{i}" for i, n in enumerate(names))
    return eval(f"lambda {args}: cls({call})", {"cls": cls})  # noqa: S307 (names checked above)


@functools.lru_cache(maxsize=None)
def _nullable(cls: type) -> frozenset[str]:
    """Fields whose default is None (a null column value means the same thing)."""
    return frozenset(f.name for f in msgspec.structs.fields(cls) if f.default is None)


@functools.lru_cache(maxsize=None)
def _converters(cls: type) -> dict[str, Any]:
    """Per field that is not a plain type: how to turn a column value into the field's type."""
    out: dict[str, Any] = {}
    for f in msgspec.structs.fields(cls):
        args = [a for a in typing.get_args(f.type) if a is not type(None)] or [f.type]
        if len(args) == 1 and args[0] in _PLAIN_TYPES:
            continue
        if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], enum.Enum):
            out[f.name] = functools.partial(_to_enum, args[0])
        else:
            out[f.name] = functools.partial(_convert, f.type)
    return out


def _to_enum(cls: type, value: Any) -> Any:
    return None if value is None else cls(value)


def _convert(typ: Any, value: Any) -> Any:
    return msgspec.convert(value, typ, dec_hook=_dec_hook, strict=False)


def _typed_as_archive(schema: pa.Schema) -> bool:
    """Whether every column ``schema`` shares with the archive schema has the archive's type."""
    want = archive_schema()
    for field in schema:
        i = want.get_field_index(field.name)
        if i < 0:
            continue
        expected = want.field(i).type
        if pa.types.is_struct(field.type) and pa.types.is_struct(expected):
            for child in field.type:  # older files may lack children (defaults); extra children are ignored
                j = expected.get_field_index(child.name)
                if j >= 0 and expected.field(j).type != child.type:
                    return False
        elif field.type != expected:
            return False
    return True


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _times(col: pa.ChunkedArray) -> list[Any]:
    """UTC datetimes of a timestamp column, made in C by msgspec (~0.1 µs a row).

    The microseconds go into one MessagePack array of timestamp extension values
    (numpy, no per-row Python), which msgspec decodes as ``datetime`` objects with
    ``timezone.utc``: the values ``epoch + timedelta(microseconds=...)`` gives, at
    ~0.6 µs a row, and ``to_pylist`` at ~5x that with a tz. A column of another
    type, or with nulls, gives its plain values: ``msgspec.convert`` checks them per row.
    """
    if not pa.types.is_timestamp(col.type) or col.null_count:
        return col.to_pylist()
    us = col.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64()).to_numpy(zero_copy_only=False)
    stamps = np.empty(len(us), dtype=_TIMESTAMP96)
    stamps["ext"] = _TIMESTAMP96_EXT
    stamps["nanoseconds"] = (us % 1_000_000) * 1000  # numpy's % and // floor: right before 1970 too
    stamps["seconds"] = us // 1_000_000
    try:
        return _DATETIMES.decode(b"\xdd" + len(us).to_bytes(4, "big") + stamps.tobytes())  # array 32 header
    except (msgspec.DecodeError, ValueError, OverflowError):  # outside datetime's years: the same error as before
        return [_EPOCH + timedelta(microseconds=u) for u in us.tolist()]


#: MessagePack's timestamp 96 (spec: "Timestamp extension type"): ext 8 header (0xc7, 12 bytes, type -1),
#: then uint32 nanoseconds and int64 seconds since the epoch, big-endian.
_TIMESTAMP96 = np.dtype([("ext", "u1", 3), ("nanoseconds", ">u4"), ("seconds", ">i8")])
_TIMESTAMP96_EXT = (0xC7, 12, 0xFF)
_DATETIMES = msgspec.msgpack.Decoder(list[datetime])


def _dec_hook(typ: type, obj: Any) -> Any:
    if (typ is TokenIds or typ is LogProbs) and isinstance(obj, typ):
        return obj
    if typ is TokenIds or typ is LogProbs:
        from schemas.events import as_logprobs, as_token_ids

        return as_token_ids(obj) if typ is TokenIds else as_logprobs(obj)
    raise TypeError(f"Expected `{typ.__name__}`, got `{type(obj).__name__}`")


def read_archive_file(path: str | Path, *,
                      topic: str = "") -> tuple[list[tuple[str, list[Event]]], list[DeadLetter], int]:
    """Read one archive Parquet file: (fragments, dead letters, rows read).

    Raises:
        streams.archive.ArchiveError: the file cannot be read as Parquet (damaged, cut short) or is not an
            archive data file (no ``event_type`` column); its rows cannot be dead letters one by one.
    """
    table = _read_table(path)
    if "event_type" not in table.column_names or not pa.types.is_string(table.schema.field("event_type").type):
        from streams.archive import ArchiveError

        raise ArchiveError(f"archive file {path} has no string `event_type` column, so it is not an event archive "
                           "data file; remove it from the commit manifest that names it")
    with gc_paused():
        frags, dead = table_to_fragments(table, topic=topic)
    return frags, dead, table.num_rows


def _read_table(path: str | Path, *, columns: list[str] | None = None) -> pa.Table:
    from streams.archive import ArchiveError

    try:
        if loc.is_remote(path):
            return loc.read_parquet(path, columns=columns)
        with pq.ParquetFile(path) as f:  # not pq.read_table: its dataset set-up costs ~0.7 ms a file
            missing = [c for c in columns or () if c not in f.schema_arrow.names]  # f.read would skip them
            if missing:
                raise ArchiveError(f"archive file {path} has no `{'`, `'.join(missing)}` column, so it is not an event "
                                   "archive data file; remove it from the commit manifest that names it")
            return f.read(columns=columns, use_threads=False)
    except (pa.ArrowException, OSError) as err:  # Arrow's IO and format errors are OSError/ValueError subclasses
        raise ArchiveError(f"archive file {path} is damaged ({err}); restore it from a copy, or rebuild the archive "
                           "from the topic (`trajpipe archive --out NEW_DIR`)") from err


def split_episode_ids(files: Sequence[ArchiveFile], *, also: Iterable[str] = ()) -> frozenset[str]:
    """Episodes whose events are spread over more than one of ``files`` (plus ``also``).

    Reads only the ``episode_id`` column of each file. Every other episode is
    wholly inside one file, so it can be assembled where the file is read,
    without a shuffle (:class:`ReadArchiveEpisodes`).

    Raises:
        streams.archive.ArchiveError: a file is damaged or has no string ``episode_id`` column.
    """
    if not files:
        return frozenset(also)
    uniques = []
    for f in files:
        column = _read_table(f.path, columns=["episode_id"]).column(0)
        if not pa.types.is_string(column.type):
            from streams.archive import ArchiveError

            raise ArchiveError(f"archive file {f.path}: `episode_id` is {column.type}, not string; it was not written "
                               "by the archiver")
        uniques.append(pc.unique(column))
    counts = pc.value_counts(pa.chunked_array(uniques, type=pa.string()).combine_chunks())
    spread = counts.filter(pc.greater(counts.field("counts"), 1)).field("values").to_pylist()
    return frozenset(spread) | frozenset(also)




class _ReadFileLocalFn(beam.DoFn):
    def __init__(self, split: frozenset[str], already_emitted: frozenset[str], buckets: int, *,
                 late: LateState | None, future_after_s: float, committed: Any = None, plain: Any = None) -> None:
        from pipelines.frames import EpisodeAssembler, PlainPath

        self._split = split
        self._buckets = buckets
        self._assemble = EpisodeAssembler(already_emitted, late=late, future_after_s=future_after_s,
                                          committed=committed,
                                          counts=("events_in", "archive_files_read", "episodes_assembled_locally",
                                                  *PlainPath.counts_of(plain)))
        c = self._assemble.counts  # one dict per bundle on `counts` (pipelines/counts.py)
        self._events_in, self._dead = c["events_in"], c["dead_letters"]
        self._files, self._local = c["archive_files_read"], c["episodes_assembled_locally"]
        self._plain = PlainPath(plain, self._assemble) if plain is not None else None

    def setup(self) -> None:
        self._assemble.setup()
        if self._plain is not None:
            self._plain.setup()

    def process(self, f: ArchiveFile) -> Iterator[Any]:
        from pipelines.frames import to_frames

        frags, dead, rows = read_archive_file(f.path, topic=f.topic)
        self._files.inc()
        self._events_in.inc(rows)
        if dead:
            self._dead.inc(len(dead))
        for d in dead:
            yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, d)
        local = 0
        for episode_id, events in frags:
            if episode_id in self._split:
                yield beam.pvalue.TaggedOutput(FRAMES_TAG, to_frames((episode_id, events), f.topic, self._buckets))
                continue
            local += 1
            yield from (self._assemble(episode_id, events) if self._plain is None
                        else self._plain.push(episode_id, events))
        if self._plain is not None:
            yield from self._plain.flush()
        self._local.inc(local)

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._assemble.clock_output()


class ReadArchiveEpisodes(beam.PTransform):
    """Read committed archive files and assemble, where they are read, the episodes each file holds whole.

    The archive keeps each episode's events together (bucket files sorted by
    ``(episode_id, seq)``), so most episodes need no shuffle: those not in
    ``split`` (:func:`split_episode_ids`: spread over several input files, or
    in the pending state) are deduplicated and assembled by the reading DoFn
    itself (:class:`pipelines.frames.EpisodeAssembler`), the rest leave as frame
    blobs for :class:`pipelines.frames.AssembleEpisodesFromFrames`.

    Args:
        archive_dir: the archive root.
        files: the files to read (default: every committed file).
        split: episode ids that must go through the shuffle.
        already_emitted: episode ids earlier commits emitted complete or hold (their events are duplicates).
        committed: a :class:`pipelines.committed.CommittedView`: ``already_emitted`` and ``late`` are read
            from the dataset by the workers instead (the job graph does not grow with the history).
        buckets: shuffle buckets of the ``frames`` output (:func:`pipelines.frames.shuffle_buckets`).
        late: the late state of the last commit (episodes it wrote incomplete; pipelines/late.py).
        future_after_s: event times after this (epoch seconds) are future (kept, not on the clock).

        downstream: :class:`pipelines.forked.ChainStage` s to run on the locally assembled episodes, in
            ``workers`` forked processes (a :class:`pipelines.forked.ForkedChain` whose first stage, ``read``,
            reads and assembles): then ``episodes`` is None and their outputs are on ``chain``.
        workers: processes of that chain.
        plain: a :class:`pipelines.frames.PlainPlan` (with ``downstream``): the plain training episodes are
            processed by the columnar path and their rows go to ``downstream``'s row-staging stage
            (:class:`pipelines.frames.PlainPath`); the others are assembled and go through ``downstream``.

    Returns:
        A ``DoOutputsTuple`` (a dict with ``downstream``): ``episodes`` (complete :class:`~pipelines.types.Episode` s),
        ``undecided`` (with the outcomes of late events), ``clock``, ``frames``, ``dead_letters`` and
        ``feedback`` (``(Feedback, attached)``, pipelines/feedback.py), ``counts`` (pipelines/counts.py). Counters as
        ``pipeline/events_in``, ``pipeline/dead_letters``, ``pipeline/archive_files_read``,
        ``pipeline/episodes_assembled_locally``.
    """

    def __init__(self, archive_dir: str | Path, *, files: Sequence[ArchiveFile] | None = None,
                 split: Iterable[str] = (), already_emitted: Iterable[str] = (), buckets: int = 1,
                 late: LateState | None = None, future_after_s: float = math.inf, committed: Any = None,
                 downstream: Sequence[Any] = (), workers: int = 1, plain: Any = None) -> None:
        super().__init__()
        if plain is not None and not downstream:
            raise ValueError("plain episodes go to the row-staging stage of `downstream`; give one")
        self._committed, self._plain = committed, plain
        self._downstream, self._workers = list(downstream), workers
        self._files = list(files) if files is not None else list_archive_files(archive_dir)
        self._split, self._already = frozenset(split), frozenset(already_emitted)
        self._buckets = buckets
        self._late, self._future_after = late, future_after_s

    def expand(self, pbegin):
        from pipelines.counts import COUNTS_TAG
        from pipelines.feedback import FEEDBACK_TAG
        from pipelines.frames import CLOCK_TAG, UNDECIDED_TAG
        from pipelines.types import Episode

        from pipelines.forked import ChainStage, ForkedChain, output_tag, per_task

        tags = (DEAD_LETTER_TAG, UNDECIDED_TAG, CLOCK_TAG, FRAMES_TAG, FEEDBACK_TAG, COUNTS_TAG)
        read = _ReadFileLocalFn(self._split, self._already, self._buckets, late=self._late,
                                future_after_s=self._future_after, committed=self._committed, plain=self._plain)
        files = (pbegin
                 | "ListFiles" >> beam.Create(self._files, reshuffle=False)
                 | "Distribute" >> beam.Reshuffle())
        if not self._downstream:
            return files | "ReadAndAssemble" >> beam.ParDo(read).with_output_types(Episode).with_outputs(
                *tags, main="episodes")
        chain = files | "ReadAssembleInWorkers" >> ForkedChain(
            [ChainStage("read", read, tags), *self._downstream], workers=self._workers,
            per_task=per_task(len(self._files), self._workers))
        return {"episodes": None, "chain": chain, **{tag: chain[output_tag("read", tag)] for tag in tags}}
