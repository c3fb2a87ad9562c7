"""Batch assembly on raw frames: the events cross the GroupByKey as the bytes they arrived as.

The batch job's one shuffle groups the events of an episode. Decoding them
first and shuffling Python objects costs an encode and a decode per event on
top of the read (and the runner re-encodes whatever crosses a stage boundary);
instead the read side only *keys* each Kafka record by its record key (the
producer keys events by ``episode_id``) and packs the frames of one batch
into one bytes value per *shuffle bucket*, :class:`FrameBlob` (BytesCoder: a
copy, no per-event work). A bucket (:func:`bucket_of`, a hash of the episode
id) holds many episodes, and all of an episode's events: the GroupByKey moves
a few elements per batch instead of one per episode (its per-element cost was
~15 % of the Kafka job), and grouping by episode inside a bucket is exact.
After the GroupByKey, :class:`AssembleFromFrames` decodes every frame once,
validates it (dead letters keep their source position), groups the bucket's
events by episode, drops episodes an earlier commit emitted complete,
resolves late events of those it wrote incomplete (pipelines/late.py), dedupes, and
builds each :class:`~pipelines.types.Episode` — fused with the verify →
rewards → clip transforms that follow, so an event is decoded exactly once on
its way to Parquet.

Whether an episode is complete does not depend on the run's clock, so
complete episodes go straight on; only unfinished or gapped ones (few) wait
for the clock side input to be decided ``pending`` or ``incomplete``.

Examples:
    >>> blob = FrameBlob(topic="t", partitions=[0], offsets=[7], timestamps_ms=[1], keys=[b"ep"], frames=[b"x"],
    ...                  episode_ids=["ep"])
    >>> FrameBlob.decode(blob.encode()) == blob
    True
    >>> bucket_of("ep-1", 64) == bucket_of("ep-1", 64), 0 <= bucket_of("ep-1", 64) < 64
    (True, True)
"""

from __future__ import annotations

import math
import os
import uuid
import zlib
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Tuple

import apache_beam as beam
import msgspec
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from pipelines.counts import COUNTS_TAG, BundleCounts
from pipelines.assemble import (
    EVENT_TIME_METRIC,
    INCOMPLETE_TAG,
    PENDING_TAG,
    _conflict_letter,
    _DecideFn,
    _status,
    assemble_episode,
    dedupe_events,
    resolve_late,
)
from pipelines.decode import record_dead_letter, validate_event
from pipelines.columnar import event_columns, plain_episodes, split_plain
from pipelines.feedback import FEEDBACK_TAG, split_feedback
from pipelines.forked import ChainStage, ForkedChain, ToStage, in_global_window, output_tag
from pipelines.gcpause import gc_paused
from pipelines.late import LATE_TAG, LateEpisode, LateState, LateStateReader
from pipelines.recipes import Recipe
from pipelines.types import DEAD_LETTER_TAG, METRICS_NAMESPACE, Episode, RawRecords
from pipelines.verify import _import_verifiers
from schemas.codec import EventDecodeError, decode_event, encode_event
from schemas.deadletter import DeadLetter
from schemas.events import PURPOSE_EVAL, Event

__all__ = [
    "PlainPlan",
    "PlainPath",
    "FrameBlob",
    "FrameRef",
    "spill_blobs",
    "read_blob",
    "bucket_of",
    "shuffle_buckets",
    "KeyFrames",
    "EventsToFrames",
    "to_frames",
    "AssembleFromFrames",
    "AssembleEpisodesFromFrames",
    "EpisodeAssembler",
    "AssembleInPlace",
    "InPlaceLedger",
    "in_place_collisions",
    "FRAMES_TAG",
    "IN_PLACE_DIR",
    "UNDECIDED_TAG",
    "CLOCK_TAG",
]

#: Output of what waits for the run's decision step (:class:`pipelines.assemble._DecideFn`): unfinished
#: episodes ``(episode_id, events)``, and :class:`~pipelines.late.LateEpisode` outcomes, which it passes on
#: to ``late`` (one collector for the late files, behind the one step that also keeps new incomplete episodes).
UNDECIDED_TAG = "undecided"
CLOCK_TAG = "clock"


class FrameBlob(msgspec.Struct, array_like=True, frozen=True):
    """The raw frames of one shuffle bucket from one batch, with their source positions.

    All lists have one entry per frame. ``partitions``/``offsets`` are -1 where
    unknown (an archive row without its Kafka position). ``episode_ids`` is the
    episode each frame was grouped under: its record key, or (a record without
    one) the id its decoded event names.
    """

    topic: str
    partitions: list[int]
    offsets: list[int]
    timestamps_ms: list[int]
    keys: list[bytes | None]
    frames: list[bytes]
    episode_ids: list[str]

    def encode(self) -> bytes:
        return _ENCODER.encode(self)

    @staticmethod
    def decode(data: bytes) -> "FrameBlob":
        return _DECODER.decode(data)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(FrameBlob)


class FrameRef(msgspec.Struct, array_like=True, frozen=True):
    """Where the encoded :class:`FrameBlob` of a bucket was spilled: ``length`` bytes at ``offset`` of ``path``.

    Crosses the shuffle instead of the blob when :class:`KeyFrames` spills
    (``spill_dir``). Both encode as a MessagePack array: a blob's has 7
    entries, a reference's 3, which is how :func:`read_blob` tells them apart.
    """

    path: str
    offset: int
    length: int


_REF_DECODER = msgspec.msgpack.Decoder(FrameRef)
_REF_HEAD = 0x93  # MessagePack fixarray of 3: a FrameRef (a FrameBlob is a fixarray of 7, 0x97)


def spill_blobs(spill_dir: str, blobs: list[bytes]) -> list[bytes]:
    """Write encoded blobs one after the other to a new file in ``spill_dir``; their encoded :class:`FrameRef`.

    Examples:
        >>> import tempfile
        >>> blob = FrameBlob(topic="t", partitions=[0], offsets=[7], timestamps_ms=[1], keys=[b"ep"],
        ...                  frames=[b"x"], episode_ids=["ep"]).encode()
        >>> refs = spill_blobs(tempfile.mkdtemp(), [blob, blob])
        >>> [read_blob(r) for r in refs] == [read_blob(blob)] * 2
        True
    """
    os.makedirs(spill_dir, exist_ok=True)
    path = os.path.join(spill_dir, f"{uuid.uuid4().hex}.frames")  # a retried bundle writes a new file
    refs, offset = [], 0
    with open(path, "wb") as f:
        for blob in blobs:
            f.write(blob)
            refs.append(_ENCODER.encode(FrameRef(path=path, offset=offset, length=len(blob))))
            offset += len(blob)
    return refs


def read_blob(raw: bytes) -> FrameBlob:
    """The :class:`FrameBlob` of a shuffled value: the encoded blob itself, or a :class:`FrameRef` to it."""
    if raw[0] != _REF_HEAD:
        return FrameBlob.decode(raw)
    ref = _REF_DECODER.decode(raw)
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        return FrameBlob.decode(f.read(ref.length))


def bucket_of(episode_id: str, buckets: int) -> int:
    """The shuffle bucket of an episode: ``crc32(episode_id) % buckets`` (stable across processes)."""
    return zlib.crc32(episode_id.encode()) % buckets


def shuffle_buckets(events: int, *, per_bucket: int = 2000, most: int = 4096) -> int:
    """Buckets for a run of about ``events`` events: ~``per_bucket`` events each (one DoFn call holds a bucket).

    Examples:
        >>> shuffle_buckets(100_000), shuffle_buckets(10), shuffle_buckets(10**9)
        (50, 1, 4096)
    """
    return max(1, min(most, events // per_bucket))


class _KeyFramesFn(beam.DoFn):
    """RawRecords → ``(bucket, FrameBlob bytes)`` per shuffle bucket; unkeyed records are decoded for their id."""

    def __init__(self, max_event_bytes: int, buckets: int, spill_dir: str | None = None) -> None:
        self._max = max_event_bytes
        self._buckets = buckets
        self._spill_dir = spill_dir
        self._c = BundleCounts(("events_in", "dead_letters", "batches_in"))

    def process(self, batch: RawRecords) -> Iterator[Any]:
        groups: dict[int, tuple[list, list, list, list, list]] = defaultdict(lambda: ([], [], [], [], []))
        bucket_by_id: dict[str, int] = {}
        for offset, key, value, ts in zip(batch.offsets, batch.keys, batch.values, batch.timestamps_ms):
            if key is not None and value is not None:
                episode_id = key.decode("utf-8", "replace")
            else:  # no key (or no value): decode now to find the episode, or quarantine
                try:
                    episode_id = _unkeyed_episode(value, self._max)
                except EventDecodeError as err:
                    self._c.inc("dead_letters")
                    yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, record_dead_letter(
                        batch.topic, batch.partition, offset, ts, key, value, err.reason, str(err), err.event_type))
                    continue
            bucket = bucket_by_id.get(episode_id)
            if bucket is None:
                bucket = bucket_by_id[episode_id] = bucket_of(episode_id, self._buckets)
            offs, tss, keys, frames, ids = groups[bucket]
            offs.append(offset)
            tss.append(ts)
            keys.append(key)
            frames.append(value)
            ids.append(episode_id)
        self._c.inc("batches_in")
        self._c.inc("events_in", len(batch))
        p = batch.partition
        blobs = [FrameBlob(topic=batch.topic, partitions=[p] * len(offs), offsets=offs, timestamps_ms=tss,
                           keys=keys, frames=frames, episode_ids=ids).encode()
                 for offs, tss, keys, frames, ids in groups.values()]
        if self._spill_dir is not None and blobs:
            blobs = spill_blobs(self._spill_dir, blobs)
        yield from zip(groups, blobs)

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._c.output()


class KeyFrames(beam.PTransform):
    """Kafka :class:`~pipelines.types.RawRecords` → ``(bucket, FrameBlob bytes)``, one per shuffle bucket per batch.

    No decoding (records are keyed by ``episode_id``); a record without a key
    is decoded to find its episode, and one that does not decode goes to
    ``dead_letters``. Counters ``pipeline/events_in``, ``pipeline/batches_in`` (also as data on ``counts``:
    :mod:`pipelines.counts`).

    Args:
        max_event_bytes: frames larger than this are dead letters (``oversize``).
        buckets: shuffle buckets (:func:`shuffle_buckets`); every producer of
            frames for one :class:`AssembleEpisodesFromFrames` must use the same.
        spill_dir: a local directory every worker shares: each batch's blobs are written to one file
            there and only a :class:`FrameRef` per bucket crosses the shuffle (None: the blobs cross it).
            The in-process FnApiRunner copies every shuffled byte several times (encode, group,
            re-encode, decode); a page-cache write and read cost less. The files are the caller's to delete.

    Returns:
        A ``DoOutputsTuple`` with ``frames``, ``dead_letters`` and ``counts``.
    """

    def __init__(self, *, max_event_bytes: int = 1 << 20, buckets: int = 1, spill_dir: str | None = None) -> None:
        super().__init__()
        if buckets < 1:
            raise ValueError(f"`buckets` must be >= 1, got {buckets}")
        self._max = max_event_bytes
        self._buckets = buckets
        self._spill_dir = spill_dir

    def stage(self, name: str = "keyframes") -> ChainStage:
        """This transform as a stage of a :class:`pipelines.forked.ForkedChain` (main output: ``frames``)."""
        return ChainStage(name, _KeyFramesFn(self._max, self._buckets, self._spill_dir), (DEAD_LETTER_TAG, COUNTS_TAG))

    def expand(self, batches):
        return batches | "KeyFrames" >> beam.ParDo(self.stage().fn).with_output_types(Tuple[int, bytes]).with_outputs(
            DEAD_LETTER_TAG, COUNTS_TAG, main="frames")


def to_frames(fragment: tuple[str, list[Event]], topic: str, buckets: int = 1) -> tuple[int, bytes]:
    """``(episode_id, events)`` → ``(bucket, FrameBlob bytes)`` (positions unknown: -1)."""
    episode_id, events = fragment
    n = len(events)
    return bucket_of(episode_id, buckets), FrameBlob(
        topic=topic, partitions=[-1] * n, offsets=[-1] * n, timestamps_ms=[0] * n, keys=[None] * n,
        frames=[encode_event(e, max_bytes=1 << 30) for e in events], episode_ids=[episode_id] * n).encode()


class EventsToFrames(beam.PTransform):
    """Decoded fragments ``(episode_id, list[Event])`` (archive files, pending state) → frame blobs."""

    def __init__(self, topic: str = "", *, buckets: int = 1) -> None:
        super().__init__()
        self._topic, self._buckets = topic, buckets

    def expand(self, fragments):
        return fragments | "Encode" >> beam.Map(to_frames, self._topic, self._buckets).with_output_types(
            Tuple[int, bytes])


class EpisodeAssembler:
    """The per-episode end of batch assembly, shared by the shuffle and the local (archive) paths.

    Called with one episode's valid events (any order, maybe repeated) — all
    of them that the run read: every caller hands over an episode whole — it
    yields nothing more if an earlier commit emitted the episode complete (or
    holds it: all its events are duplicates); for an episode an earlier commit
    wrote as incomplete, the outcome of its late events
    (:func:`pipelines.assemble.resolve_late` against the kept events of
    ``late``): a :class:`~pipelines.late.LateEpisode` on ``undecided``, and the
    episode, complete with ``completed_late=True``, when they complete it.
    Otherwise ``seq_conflict`` dead letters; then the complete
    :class:`~pipelines.types.Episode` (main output) or ``(episode_id, unique
    events)`` on ``undecided``. Keeps the job's counters, and the latest
    event time it has seen, which the DoFn emits once per bundle on ``clock``
    (:meth:`clock_output`, from ``finish_bundle``). Event times after
    ``future_after_s`` are *future* (counted ``future_events``, kept in their
    episode) and never reach the clock.

    With ``committed`` (a :class:`pipelines.committed.CommittedView`), the
    emitted episodes and the late state are read from the dataset by
    :meth:`setup` on the worker (the host DoFn's ``setup``), not shipped in the
    job graph. The counts go out as data too (:meth:`clock_output`, ``counts``;
    :mod:`pipelines.counts`); ``counts`` is the host's to add its own to.
    """

    def __init__(self, already_emitted: frozenset[str] = frozenset(), *, late: LateState | None = None,
                 future_after_s: float = math.inf, committed: Any = None,
                 counts: tuple[str, ...] = ()) -> None:
        self._already = already_emitted
        self._late = late or LateState()
        self._committed = committed
        self._reader: LateStateReader | None = None
        self._future_after = future_after_s
        self._c = self.counts = BundleCounts(
            ("dead_letters", "duplicates", "events_used", "episodes_complete", "late_events",
             "episodes_completed_late", "future_events", *counts))
        self._event_time = Metrics.distribution(METRICS_NAMESPACE, EVENT_TIME_METRIC)
        self._latest: float | None = None

    def setup(self) -> None:
        """Read the committed state this run builds on (with ``committed``; once per worker process)."""
        if self._committed is not None:
            state = self._committed.load()
            self._already, self._late, self._reader = state.emitted, state.late, None

    def clock_output(self) -> Iterator[beam.pvalue.TaggedOutput]:
        """The bundle's latest event time on ``clock`` and its counts on ``counts`` (for ``finish_bundle``)."""
        if self._latest is not None:
            window = GlobalWindow()
            yield beam.pvalue.TaggedOutput(CLOCK_TAG, WindowedValue(self._latest, window.max_timestamp(), [window]))
            self._event_time.update(int(self._latest * 1000))
        self._latest = None
        yield from self._c.output()

    def _clock_time(self, events: list[Event]) -> float | None:
        """Latest event time of ``events`` that is not in the future (None: all are); counts the future ones."""
        latest = max(e.event_time for e in events).timestamp()
        if latest <= self._future_after:
            return latest
        times = [e.event_time.timestamp() for e in events]  # rare: a producer's clock runs fast
        present = [t for t in times if t <= self._future_after]
        self._c["future_events"].inc(len(times) - len(present))
        return max(present, default=None)

    def settled(self, episode_id: str) -> bool:
        """An earlier commit emitted the episode or wrote it incomplete: its events are for :meth:`__call__`."""
        return episode_id in self._already or episode_id in self._late.incomplete

    def count_plain(self, events: list[Event]) -> None:
        """Count a plain episode (:mod:`pipelines.columnar`) as :meth:`__call__` would: complete, nothing to
        resolve (the clock, ``future_events``, ``events_used``, ``episodes_complete``); its rows are made elsewhere."""
        latest = self._clock_time(events)
        if latest is not None and (self._latest is None or latest > self._latest):
            self._latest = latest
        self._c["events_used"].inc(len(events))
        self._c["episodes_complete"].inc()

    def __call__(self, episode_id: str, events: list[Event]) -> Iterator[Any]:
        if not events:
            return
        latest = self._clock_time(events)
        if latest is not None and (self._latest is None or latest > self._latest):
            self._latest = latest
        # Feedback is outside the episode's seq (pipelines/feedback.py): out first, attached to the episode only
        # if it is assembled complete here, and always on the feedback output.
        events, feedback, dups = split_feedback(events)
        if dups:
            self._c["duplicates"].inc(dups)
        attached = False
        for out in self._episode(episode_id, events) if events else ():
            if feedback and isinstance(out, Episode):
                out, attached = msgspec.structs.replace(out, feedback=feedback), True
            yield out
        for fb in feedback:
            yield beam.pvalue.TaggedOutput(FEEDBACK_TAG, (fb, attached))

    def _episode(self, episode_id: str, events: list[Event]) -> Iterator[Any]:
        if episode_id in self._already:  # re-delivered events of an episode an earlier commit emitted
            self._c["duplicates"].inc(len(events))
            return
        if episode_id in self._late.incomplete:
            yield from self._late_events(episode_id, events)
            return
        unique, dups, conflicts = dedupe_events(events)
        if dups:
            self._c["duplicates"].inc(dups)
        yield from self._conflicts(conflicts)
        complete, _ = _status(unique)
        if complete:
            self._c["events_used"].inc(len(unique))
            self._c["episodes_complete"].inc()
            yield assemble_episode(episode_id, unique, complete=True, reason=None)
        else:
            yield beam.pvalue.TaggedOutput(UNDECIDED_TAG, (episode_id, unique))

    def _conflicts(self, conflicts: list[Event]) -> Iterator[Any]:
        if conflicts:
            self._c["dead_letters"].inc(len(conflicts))
            for ev in conflicts:
                yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, _conflict_letter(ev))

    def _late_events(self, episode_id: str, events: list[Event]) -> Iterator[Any]:
        if self._reader is None:
            self._reader = LateStateReader(self._late)
        kept = self._reader.events(episode_id)
        res = resolve_late(events, kept)
        if res.duplicates:
            self._c["duplicates"].inc(res.duplicates)
        yield from self._conflicts(res.conflicts)
        if not res.late:
            return
        self._c["late_events"].inc(len(res.late))
        if not kept:
            yield beam.pvalue.TaggedOutput(UNDECIDED_TAG, LateEpisode(episode_id=episode_id, reason="expired",
                                                                 late=res.late))
        elif res.complete:
            self._c["episodes_completed_late"].inc()
            yield beam.pvalue.TaggedOutput(UNDECIDED_TAG, LateEpisode(episode_id=episode_id, reason="completed",
                                                                 late=res.late))
            yield assemble_episode(episode_id, res.events, complete=True, reason=None, completed_late=True)
        else:
            yield beam.pvalue.TaggedOutput(UNDECIDED_TAG, LateEpisode(episode_id=episode_id, reason="stored", late=res.late,
                                                                 store=res.events))


def _decode_frame(topic: str, partition: int, offset: int, ts: int, key: bytes | None, frame: bytes,
                  episode_id: str, max_bytes: int) -> Event | DeadLetter:
    """A frame grouped under ``episode_id``, decoded and validated; or the dead letter that says why it is not an event."""
    try:
        ev = decode_event(frame, max_bytes=max_bytes)
    except EventDecodeError as err:
        return record_dead_letter(topic, partition, offset, ts, key, frame, err.reason, str(err), err.event_type)
    problem = validate_event(ev, key=key if key is not None else episode_id.encode())
    if problem is not None:
        return record_dead_letter(topic, partition, offset, ts, key, frame, problem[0], problem[1], ev.event_type)
    return ev


def _unkeyed_episode(value: bytes | None, max_bytes: int) -> str:
    """The episode a record without a key (or without a value) belongs to, from its decoded event.

    Raises:
        EventDecodeError: no value (a tombstone: ``truncated``), or one that does not decode.
    """
    return decode_event(value, max_bytes=max_bytes).episode_id


class _AssembleFromFramesFn(beam.DoFn):
    def __init__(self, already_emitted: frozenset[str], max_event_bytes: int, *, late: LateState | None,
                 future_after_s: float, committed: Any = None) -> None:
        self._assemble = EpisodeAssembler(already_emitted, late=late, future_after_s=future_after_s,
                                          committed=committed)
        self._max = max_event_bytes
        self._dead = self._assemble.counts["dead_letters"]

    def setup(self) -> None:
        self._assemble.setup()

    def process(self, element: tuple[int, Iterable[bytes]]) -> Iterator[Any]:
        _, blobs = element
        by_episode: dict[str, list[Event]] = defaultdict(list)
        dead = 0
        with gc_paused():  # decoding allocates an object per field; nothing here makes a cycle
            for raw in blobs:
                blob = read_blob(raw)
                for p, off, ts, key, frame, episode_id in zip(blob.partitions, blob.offsets, blob.timestamps_ms,
                                                              blob.keys, blob.frames, blob.episode_ids):
                    ev = _decode_frame(blob.topic, p, off, ts, key, frame, episode_id, self._max)
                    if isinstance(ev, DeadLetter):
                        dead += 1
                        yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, ev)
                    else:
                        by_episode[episode_id].append(ev)
        if dead:
            self._dead.inc(dead)
        for episode_id in sorted(by_episode):
            yield from self._assemble(episode_id, by_episode[episode_id])

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._assemble.clock_output()


#: Output of :class:`AssembleInPlace` and :class:`pipelines.archive_source.ReadArchiveEpisodes` with the frame
#: blobs of the episodes they leave to the shuffle.
FRAMES_TAG = "frames"
#: Directory (under a commit's staging directory) of :class:`AssembleInPlace`'s ledgers.
IN_PLACE_DIR = "_in_place"


class InPlaceLedger(msgspec.Struct, array_like=True, frozen=True):
    """The episodes one :class:`AssembleInPlace` bundle assembled itself (``in_place``) and shuffled."""

    in_place: list[str]
    shuffled: list[str]


def in_place_collisions(ledger_dir: str) -> list[str]:
    """Episodes that one bundle of :class:`AssembleInPlace` assembled and another bundle also read (sorted).

    Empty when every episode assembled in place had all its events of the run in that bundle: the
    run's rows are then those of the shuffle. Not empty (events of one episode in two partitions: a
    producer that keyed or partitioned them otherwise, partitions added to the topic), the run must
    be made again through the shuffle.
    """
    if not os.path.isdir(ledger_dir):
        return []
    seen: dict[str, int] = {}
    shuffled: set[str] = set()
    collisions: set[str] = set()
    for i, name in enumerate(sorted(os.listdir(ledger_dir))):
        with open(os.path.join(ledger_dir, name), "rb") as f:
            ledger = _LEDGER_DECODER.decode(f.read())
        for episode_id in ledger.in_place:
            if seen.setdefault(episode_id, i) != i:
                collisions.add(episode_id)
        shuffled.update(ledger.shuffled)
    collisions.update(shuffled.intersection(seen))
    return sorted(collisions)


_LEDGER_DECODER = msgspec.msgpack.Decoder(InPlaceLedger)


class _AssembleInPlaceFn(beam.DoFn):
    """A bundle's Kafka batches → its episodes assembled here; pending ones → frame blobs (:class:`AssembleInPlace`).

    What :class:`KeyFrames` and :class:`AssembleFromFrames` do on either side of the shuffle, in one
    step: records are grouped by key as they come (references to their frames, no copy), and each
    episode's frames are decoded only when it is assembled, at the bundle's end, so one part's
    episodes at a time are objects (they go on into the next stages at once).
    """

    def __init__(self, split: frozenset[str], max_event_bytes: int, buckets: int, ledger_dir: str, *,
                 late: LateState | None, future_after_s: float, committed: Any = None,
                 spill_dir: str | None = None, plain: PlainPlan | None = None) -> None:
        self._split, self._max, self._buckets = split, max_event_bytes, buckets
        self._ledger_dir, self._spill_dir = ledger_dir, spill_dir
        self._assemble = EpisodeAssembler(frozenset(), late=late, future_after_s=future_after_s,
                                          committed=committed,
                                          counts=("events_in", "batches_in", *PlainPath.counts_of(plain)))
        c = self._assemble.counts
        self._events_in, self._batches_in, self._dead = c["events_in"], c["batches_in"], c["dead_letters"]
        self._plain = PlainPath(plain, self._assemble) if plain is not None else None

    def setup(self) -> None:
        self._assemble.setup()
        if self._plain is not None:
            self._plain.setup()

    def start_bundle(self) -> None:
        self._raw: dict[str, list[tuple]] = defaultdict(list)
        self._topic = ""

    def process(self, batch: RawRecords) -> Iterator[Any]:
        self._batches_in.inc()
        self._events_in.inc(len(batch))
        self._topic = batch.topic
        p, raw = batch.partition, self._raw
        for off, key, frame, ts in zip(batch.offsets, batch.keys, batch.values, batch.timestamps_ms):
            if key is not None and frame is not None:
                raw[key.decode("utf-8", "replace")].append((p, off, ts, key, frame))
                continue
            try:  # no key (or no value): decoded now to find the episode, or quarantined (as KeyFrames does)
                raw[_unkeyed_episode(frame, self._max)].append((p, off, ts, key, frame))
            except EventDecodeError as err:
                self._dead.inc()
                yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, record_dead_letter(
                    batch.topic, p, off, ts, key, frame, err.reason, str(err), err.event_type))

    def _decode(self, episode_id: str, records: list[tuple]) -> tuple[list[Event], list[Any]]:
        """An episode's valid events and the dead letters of its other frames (as AssembleFromFrames decides)."""
        events, dead = [], []
        for record in records:
            ev = _decode_frame(self._topic, *record, episode_id, self._max)
            (dead if isinstance(ev, DeadLetter) else events).append(ev)
        if dead:
            self._dead.inc(len(dead))
        return events, dead

    def finish_bundle(self) -> Iterator[Any]:
        in_place: list[str] = []
        shuffled: list[str] = []
        groups: dict[int, list[tuple]] = defaultdict(list)  # bucket → (partition, offset, ts, key, frame, episode)
        raw, self._raw = self._raw, defaultdict(list)
        for episode_id in sorted(raw):
            records = raw.pop(episode_id)
            if episode_id in self._split:  # joins its pending fragment after the shuffle
                shuffled.append(episode_id)
                groups[bucket_of(episode_id, self._buckets)].extend((*r, episode_id) for r in records)
                continue
            in_place.append(episode_id)
            with gc_paused():  # decoding allocates an object per field; nothing here makes a cycle
                events, dead = self._decode(episode_id, records)
            for letter in dead:
                yield in_global_window(beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, letter))
            yield from map(in_global_window, self._assemble(episode_id, events) if self._plain is None
                           else self._plain.push(episode_id, events))
        if self._plain is not None:
            yield from map(in_global_window, self._plain.flush())
        blobs = [FrameBlob(self._topic, *map(list, zip(*g))).encode() for g in groups.values()]
        if self._spill_dir is not None and blobs:
            blobs = spill_blobs(self._spill_dir, blobs)
        for bucket, blob in zip(groups, blobs):
            yield in_global_window(beam.pvalue.TaggedOutput(FRAMES_TAG, (bucket, blob)))
        os.makedirs(self._ledger_dir, exist_ok=True)
        with open(os.path.join(self._ledger_dir, f"{uuid.uuid4().hex}.ledger"), "wb") as f:
            f.write(_ENCODER.encode(InPlaceLedger(in_place=in_place, shuffled=shuffled)))
        yield from self._assemble.clock_output()


class PlainPath:
    """The plain episodes of decoded ones processed by the columnar path, the others handed to an assembler.

    For a DoFn that holds episodes whole and assembles them with an :class:`EpisodeAssembler`, in a
    :class:`pipelines.forked.ForkedChain` whose last stage stages rows (:class:`AssembleInPlace`,
    :class:`pipelines.archive_source.ReadArchiveEpisodes`). Called with a chunk of decoded episodes
    (``(episode_id, events)``; or one at a time through :meth:`push` and :meth:`flush`, which cut
    chunks of :data:`PLAIN_CHUNK_EVENTS`), it yields the assembler's outputs for the episodes that are not plain
    (or are evaluation episodes), counts the plain ones as the assembler would
    (:meth:`EpisodeAssembler.count_plain`), and yields their rows
    (:func:`pipelines.columnar.plain_episodes`) as :class:`pipelines.forked.ToStage` values for the
    row-staging stage; the verify, rewards and clip stages' counts go where those stages put them (the
    rewards stage's on the assembler's ``counts``, which must have :meth:`counts_of` among its names; the
    others as Beam counters under their names). Outputs are bare: a ``finish_bundle`` wraps them.
    """

    #: The rewards stage's counts (``counts`` output), kept by the assembler's :class:`BundleCounts`.
    STAGE_COUNTS = ("steps_rewarded", "episodes_excluded")

    @classmethod
    def counts_of(cls, plan: PlainPlan | None) -> tuple[str, ...]:
        """The names an assembler's counts need beside its own when ``plan`` is used."""
        return cls.STAGE_COUNTS if plan is not None else ()

    def __init__(self, plan: PlainPlan, assembler: EpisodeAssembler) -> None:
        self._plan, self._assemble = plan, assembler
        self._verify_step, self._not_found = None, LookupError
        self._chunk: list[tuple[str, list[Event]]] = []
        self._chunk_events = 0

    def push(self, episode_id: str, events: list[Event]) -> Iterator[Any]:
        """Take one decoded episode; a chunk's outputs once it holds :data:`PLAIN_CHUNK_EVENTS` events."""
        self._chunk.append((episode_id, events))
        self._chunk_events += len(events)
        if self._chunk_events >= PLAIN_CHUNK_EVENTS:
            yield from self.flush()

    def flush(self) -> Iterator[Any]:
        """The outputs of the episodes taken since the last chunk."""
        chunk, self._chunk, self._chunk_events = self._chunk, [], 0
        if chunk:
            yield from self(chunk)

    def setup(self) -> None:
        """Import the domain verifiers (on the worker, once)."""
        if self._plan.use_domain_verifiers:
            self._verify_step, self._not_found = _import_verifiers()

    def __call__(self, chunk: list[tuple[str, list[Event]]]) -> Iterator[Any]:
        plan = self._plan
        with gc_paused():
            cols = event_columns(chunk)
            settled = {episode_id for episode_id, _ in chunk if self._assemble.settled(episode_id)}
            split = split_plain(cols, exclude=settled)
            picks = split.plain.copy()
            for e in np.flatnonzero(picks).tolist():  # evaluation episodes leave for their table first
                if cols.events[split.order[split.offsets[e]]].purpose == PURPOSE_EVAL:
                    picks[e] = False
        for (episode_id, events), pick in zip(chunk, picks.tolist()):
            if pick:
                self._assemble.count_plain(events)
            else:
                yield from self._assemble(episode_id, events)
        with gc_paused():
            plain, counts = plain_episodes(cols, split, picks, plan.recipe, verify_step=self._verify_step,
                                           not_found=self._not_found)
        c = self._assemble.counts
        for name in self.STAGE_COUNTS:
            c[name].inc(counts.pop(name))
        for name, n in counts.items():  # the verify and clip stages' Beam counters, under their names
            if n:
                Metrics.counter(METRICS_NAMESPACE, name).inc(n)
        for episode in plain:
            yield ToStage(plan.stage, episode)


class PlainPlan(NamedTuple):
    """What :class:`AssembleInPlace` needs to process plain episodes itself (:mod:`pipelines.columnar`).

    Attributes:
        recipe: the run's recipe (not a ``prm`` one).
        use_domain_verifiers: as :class:`pipelines.verify.VerifySteps`'.
        stage: the name of the chain's row-staging stage, which gets their rows.
    """

    recipe: Recipe
    use_domain_verifiers: bool
    stage: str


#: Events of decoded episodes the columnar path takes at once (bounds what a task holds decoded).
PLAIN_CHUNK_EVENTS = 20_000


class AssembleInPlace:
    """Kafka batches of one partition range → their episodes assembled in the bundle that read them.

    A producer keys each event by its ``episode_id``, so Kafka's partitioner puts every event of
    an episode in one partition: a bundle that reads a partition's whole range of the run (the
    forked read of :class:`pipelines.sources_kafka.ReadKafkaRange` does) holds each of its
    episodes whole, and needs no shuffle, as an archive file does
    (:class:`pipelines.archive_source.ReadArchiveEpisodes`). Frames are decoded and validated
    here (bad ones → ``dead_letters`` with their position), each episode goes through
    :class:`EpisodeAssembler` (complete ones on the main output, the others ``undecided``),
    except those in ``split`` (the pending state's: their earlier events join them after the
    shuffle), which leave as frame blobs on ``frames``.

    The partitioner is the producers', not ours to see: each bundle writes a ledger
    (:class:`InPlaceLedger`) under ``ledger_dir``, and a run in which an episode assembled in one
    bundle was also read by another (:func:`in_place_collisions`) must not commit -- the batch job
    makes it again through the shuffle.

    With ``plain`` (a :class:`PlainPlan`), the plain episodes (:func:`pipelines.columnar.split_plain`,
    training episodes only) skip the assembler and the chain's per-episode stages: the columnar path
    verifies, rewards and clips them many at once (:func:`pipelines.columnar.plain_episodes`) and sends
    their rows straight to the chain's row-staging stage (:class:`pipelines.forked.ToStage`), counted
    as those stages count (the rewards stage's counts on this step's ``counts``, the verify and clip
    counters under their names). The rest go through the assembler and the stages as before.
    """

    #: Its tagged outputs (the main output is ``episodes``).
    TAGS = (DEAD_LETTER_TAG, UNDECIDED_TAG, CLOCK_TAG, FRAMES_TAG, FEEDBACK_TAG, COUNTS_TAG)

    def __init__(self, *, split: Iterable[str] = (), max_event_bytes: int = 1 << 20, buckets: int = 1,
                 ledger_dir: str, late: LateState | None = None, future_after_s: float = math.inf,
                 committed: Any = None, spill_dir: str | None = None, plain: PlainPlan | None = None) -> None:
        self._fn = _AssembleInPlaceFn(frozenset(split), max_event_bytes, buckets, ledger_dir, late=late,
                                      future_after_s=future_after_s, committed=committed, spill_dir=spill_dir,
                                      plain=plain)

    def stage(self, name: str = "assemble_in_place") -> ChainStage:
        """This step as a stage of a :class:`pipelines.forked.ForkedChain` (after the read)."""
        return ChainStage(name, self._fn, self.TAGS)


class AssembleFromFrames(beam.PTransform):
    """Grouped frame blobs ``(bucket, Iterable[bytes])`` → complete Episodes, undecided, late, clock, dead letters.

    Decodes and validates each frame (decode errors and semantic problems →
    ``dead_letters`` with the record's topic/partition/offset), drops whole
    episodes in ``already_emitted`` as duplicates, resolves the events of
    episodes in ``late.incomplete`` against their kept events (a
    :class:`~pipelines.late.LateEpisode` on ``undecided``, and the episodes
    they complete), dedupes by ``event_id`` (``seq_conflict`` →
    ``dead_letters``), and emits complete episodes as
    :class:`~pipelines.types.Episode` on the main output; unfinished or gapped
    ones go to ``undecided`` as ``(episode_id, events)``. ``clock`` carries
    each bundle's latest event time (epoch seconds) that is not after
    ``future_after_s`` (:class:`EpisodeAssembler`); ``counts`` its count dicts
    (:mod:`pipelines.counts`). With ``committed``
    (:class:`pipelines.committed.CommittedView`), ``already_emitted`` and ``late``
    are read from the dataset on the workers instead.
    """

    def __init__(self, *, already_emitted: Iterable[str] = (), max_event_bytes: int = 1 << 20,
                 late: LateState | None = None, future_after_s: float = math.inf, committed: Any = None) -> None:
        super().__init__()
        self._already = frozenset(already_emitted)
        self._max = max_event_bytes
        self._late, self._future_after, self._committed = late, future_after_s, committed

    #: Its tagged outputs (the main output is ``episodes``).
    TAGS = (DEAD_LETTER_TAG, UNDECIDED_TAG, CLOCK_TAG, FEEDBACK_TAG, COUNTS_TAG)

    def stage(self, name: str = "assemble") -> ChainStage:
        """This transform as the first stage of a :class:`pipelines.forked.ForkedChain` (``grouped=True``)."""
        return ChainStage(name, _AssembleFromFramesFn(self._already, self._max, late=self._late,
                                                      future_after_s=self._future_after, committed=self._committed),
                          self.TAGS)

    def expand(self, grouped):
        return grouped | "DecodeAssemble" >> beam.ParDo(self.stage().fn).with_output_types(Episode).with_outputs(
            *self.TAGS, main="episodes")


class AssembleEpisodesFromFrames(beam.PTransform):
    """Frame blobs → episodes: the batch counterpart of :class:`pipelines.assemble.AssembleEpisodesStreaming`.

    ``GroupByKey`` by shuffle bucket → :class:`AssembleFromFrames`; undecided
    episodes are decided against the run's event-time clock
    ``max(clock_floor_s, latest event time)`` (a side input; event times after
    ``future_after_s`` left out) with :func:`pipelines.assemble.decide`:
    ``pending`` while younger than ``incomplete_after_s``, then ``incomplete``
    (and, with ``keep_incomplete``, their events on ``late`` for the late state).
    ``late`` also carries the outcomes of late events (:class:`EpisodeAssembler`).

    Input: the frames PCollection, or a dict with ``frames`` plus the outputs
    of a local assembly that skipped the shuffle
    (:class:`pipelines.archive_source.ReadArchiveEpisodes`): its
    ``undecided`` and ``clock`` join the decision and the clock.

    Args:
        incomplete_after_s: idle event time before an unfinished episode is incomplete.
        clock_floor_s: the clock of the last commit (the clock never goes back).
        already_emitted: episodes emitted complete (or held) by earlier commits.
        late: the late state of the last commit (:func:`pipelines.commit.load_late_state`).
        future_after_s: event times after this (epoch seconds) are future.
        keep_incomplete: put the events of episodes decided incomplete on ``late``.
        committed: a :class:`pipelines.committed.CommittedView`: ``already_emitted`` and ``late`` are read
            from the dataset by the workers (the job graph does not grow with the history).

        downstream: stages to run on the assembled episodes (a :class:`pipelines.forked.ForkedChain` in
            ``workers`` forked processes, the assembly its first stage, named ``assemble``); their outputs
            are on ``chain``, and ``episodes`` is None.
        workers: processes of that chain.
        per_task: shuffle buckets per task of a worker (:func:`pipelines.forked.per_task`).

    Returns:
        ``{"episodes", "chain", "pending", "incomplete", "late", "dead_letters", "clock", "feedback", "counts"}``;
        ``clock`` is the run's event-time clock, one float (epoch seconds); ``feedback`` the
        ``(Feedback, attached)`` pairs of the shuffled and (input ``feedback``) the local assembly
        (pipelines/feedback.py); ``counts`` the assembly's and the decision's count dicts
        (:mod:`pipelines.counts`).
    """

    def __init__(self, *, incomplete_after_s: float = 3600.0, clock_floor_s: float = 0.0,
                 already_emitted: Iterable[str] = (), late: LateState | None = None,
                 future_after_s: float = math.inf, keep_incomplete: bool = False, committed: Any = None,
                 downstream: Sequence[ChainStage] = (), workers: int = 1, per_task: int = 1) -> None:
        super().__init__()
        self._downstream, self._workers, self._per_task = list(downstream), workers, per_task
        if incomplete_after_s < 0:
            raise ValueError(f"`incomplete_after_s` must be >= 0, got {incomplete_after_s}")
        self._after, self._floor = incomplete_after_s, clock_floor_s
        self._already = frozenset(already_emitted)
        self._late, self._future_after, self._keep = late, future_after_s, keep_incomplete
        self._committed = committed

    def expand(self, pcolls):
        inputs = pcolls if isinstance(pcolls, dict) else {"frames": pcolls}
        floor = self._floor
        grouped = inputs["frames"] | "GroupByBucket" >> beam.GroupByKey()
        assemble = AssembleFromFrames(already_emitted=self._already, late=self._late,
                                      future_after_s=self._future_after, committed=self._committed)
        chain = None
        if self._downstream:  # assembly and what follows it, in forked workers (pipelines/forked.py)
            chain = grouped | "AssembleInWorkers" >> ForkedChain([assemble.stage(), *self._downstream],
                                                                 workers=self._workers, grouped=True,
                                                                 per_task=self._per_task)
            assembled = {tag: chain[output_tag("assemble", tag)] for tag in AssembleFromFrames.TAGS}
            assembled["episodes"] = None
        else:
            assembled = grouped | "AssembleFromFrames" >> assemble
        clocks, undecided = [assembled[CLOCK_TAG]], [assembled[UNDECIDED_TAG]]
        feedback = assembled[FEEDBACK_TAG]
        if "clock" in inputs:
            clocks.append(inputs["clock"])
            undecided.append(inputs["undecided"])
            clocks = tuple(clocks) | "AllClocks" >> beam.Flatten()
            undecided = tuple(undecided) | "AllUndecided" >> beam.Flatten()
            if "feedback" in inputs:
                feedback = (feedback, inputs["feedback"]) | "AllFeedback" >> beam.Flatten()
        else:
            clocks, undecided = clocks[0], undecided[0]
        clock = clocks | "Clock" >> beam.CombineGlobally(lambda ts: max([floor, *ts]))
        decided = undecided | "Decide" >> beam.ParDo(
            _DecideFn(self._after, future_after_s=self._future_after, keep_events=self._keep),
            clock_s=beam.pvalue.AsSingleton(clock)
        ).with_output_types(Episode).with_outputs(PENDING_TAG, INCOMPLETE_TAG, LATE_TAG, COUNTS_TAG,
                                                  main="episodes")
        counts = (assembled[COUNTS_TAG], decided[COUNTS_TAG]) | "AssemblyCounts" >> beam.Flatten()
        # Undecided episodes never turn out complete (completeness ignores the clock).
        return {
            "episodes": assembled["episodes"],
            "chain": chain,
            PENDING_TAG: decided[PENDING_TAG],
            INCOMPLETE_TAG: decided[INCOMPLETE_TAG],
            LATE_TAG: decided[LATE_TAG],
            DEAD_LETTER_TAG: assembled[DEAD_LETTER_TAG],
            CLOCK_TAG: clock,
            FEEDBACK_TAG: feedback,
            COUNTS_TAG: counts,
        }
