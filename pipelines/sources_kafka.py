"""Kafka sources for Beam that need no Java SDK harness: bounded and unbounded splittable DoFns.

Beam's ``ReadFromKafka`` is a cross-language transform: it needs a Java
expansion service and a Java SDK harness (Docker on most runners). These
sources read with kafka-python inside Python splittable DoFns instead, so they
run on every portable runner (FnApiRunner, Prism, Flink, Dataflow, Spark)
with nothing but the Python SDK.

* :class:`ReadKafkaRange` — bounded: exactly the records in ``[start, end)``
  of each partition, ``end`` by default the fetch high watermark at job start
  (:func:`streams.consumer.end_offsets`; never ListOffsets, which the Tansu
  broker answers too low after multi-record batches).
* :class:`ReadKafkaStream` — unbounded: one restriction
  ``OffsetRange(start, sys.maxsize)`` per partition, a watermark that follows
  the Kafka record timestamps and keeps moving on idle partitions, and optional
  stop conditions (end offsets, a deadline) for tests and catch-up jobs.

Both emit :class:`pipelines.types.RawRecords`, batches of up to ``batch_size``
consecutive records of one partition, fetched by :class:`streams.fetch.PartitionReader`
(kafka-python's connection and Fetch protocol, aiokafka's compiled record parser:
~3x the rate of a kafka-python consumer, which parses every record in Python).
The restriction is an :class:`~apache_beam.io.restriction_trackers.OffsetRange`
over Kafka offsets; a batch is emitted only after its last offset was claimed,
and a failed claim (the runner split or checkpointed the restriction meanwhile)
emits just the records below the new end, so splits and checkpoints never lose
or duplicate a record. Offsets that hold no record (compaction, transaction
markers) are skipped by following each fetch's ``next_offset``; a partition
that stops advancing before its end raises
:class:`streams.consumer.ReadStalledError` rather than hanging.

Neither source commits consumer-group offsets: jobs record the offsets they
covered in their own commit (docs/pipelines.md).

Examples:
    >>> from streams.config import KafkaConnection
    >>> read = ReadKafkaRange(KafkaConnection(bootstrap_servers="127.0.0.1:9092"), "trajpipe.events",
    ...                       [(0, 0, 100), (1, 50, 50)])
    >>> read.label, [s[:4] for s in read.slices]
    ('ReadKafkaRange', [('trajpipe.events', 0, 0, 100)])
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Union

import apache_beam as beam
from apache_beam.io.restriction_trackers import OffsetRange, OffsetRestrictionTracker
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.metrics import Metrics
from apache_beam.transforms.core import RestrictionProvider, WatermarkEstimatorProvider
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import MAX_TIMESTAMP, MIN_TIMESTAMP, Duration, Timestamp

import pipelines.coders  # noqa: F401  (registers the element coders)
from pipelines.types import METRICS_NAMESPACE, RawRecords
from streams.config import KafkaConnection
from streams.consumer import OffsetRange as KafkaOffsetRange
from streams.consumer import end_offsets, partitions_for
from streams.fetch import PartitionChunk, PartitionReader, read_partition

__all__ = [
    "ReadKafkaRange",
    "ReadKafkaStream",
    "RangeSpec",
    "DEFAULT_BATCH_SIZE",
]

_LOG = logging.getLogger(__name__)

#: Most records per emitted :class:`RawRecords` batch.
DEFAULT_BATCH_SIZE = 5000

#: A range to read: ``(partition, start, end)`` or a :class:`streams.consumer.OffsetRange`.
RangeSpec = Union[tuple[int, int, int], KafkaOffsetRange]

# One element per partition: (topic, partition, start, end, split_records); end = sys.maxsize for
# streams, split_records = 0 for no initial splits. Plain tuples keep the coder portable.
_Slice = tuple[str, int, int, int, int]


def _records(chunk: PartitionChunk, i: int, j: int) -> RawRecords:
    return RawRecords(topic=chunk.topic, partition=chunk.partition, offsets=chunk.offsets[i:j],
                      keys=chunk.keys[i:j], values=chunk.values[i:j], timestamps_ms=chunk.timestamps_ms[i:j])


def _claimed_batches(tracker, chunk: PartitionChunk, batch_size: int) -> Iterator[tuple[RawRecords, bool]]:
    """Claim ``chunk`` (records below the restriction's stop) batch by batch: ``(batch we own, go on)``.

    Each batch's last offset is claimed once. If that fails the runner shrank
    the restriction meanwhile (split or checkpoint); its new end is then at or
    below that offset and above every earlier claim, so exactly the records
    below the new end are ours (possibly none), and nothing more may be claimed.
    """
    for i in range(0, len(chunk), batch_size):
        batch = _records(chunk, i, i + batch_size)
        if tracker.try_claim(batch.offsets[-1]):
            yield batch, True
            continue
        new_stop = tracker.current_restriction().stop
        # Yielded even when empty: the caller must stop here, since a later claim (or the final
        # claim of the stop) would be below this failed attempt, which the tracker refuses.
        yield _records(chunk, i, i + bisect.bisect_left(batch.offsets, new_stop)), False
        return


class _StreamTracker(OffsetRestrictionTracker):
    """The tracker of ``[pos, sys.maxsize)``: checkpoints, never a split of the remainder.

    A runner splitting the rest of a followed partition at a fraction would
    hand ``[~2**62, sys.maxsize)`` to another reader: offsets no log will reach
    (Prism does split so, and the broker answers ``OFFSET_OUT_OF_RANGE``). One
    reader per partition is the unit of parallelism; only ``fraction 0``
    (checkpoint: stop here, resume later) is granted.
    """

    def try_split(self, fraction_of_remainder):
        if fraction_of_remainder > 0:
            return None
        return super().try_split(fraction_of_remainder)


class _OffsetRangeProvider(RestrictionProvider):
    """Restrictions over the offsets of one partition slice (see ``_Slice``)."""

    def __init__(self, *, unbounded: bool) -> None:
        self._unbounded = unbounded

    def initial_restriction(self, element: _Slice) -> OffsetRange:
        return OffsetRange(element[2], element[3])

    def create_tracker(self, restriction: OffsetRange) -> OffsetRestrictionTracker:
        return _StreamTracker(restriction) if self._unbounded else OffsetRestrictionTracker(restriction)

    def split(self, element: _Slice, restriction: OffsetRange) -> Iterator[OffsetRange]:
        # Initial splits let a cluster runner read one big partition range on many workers.
        split_records = element[4]
        if self._unbounded or not split_records or restriction.size() <= split_records:
            yield restriction
        else:
            yield from restriction.split(split_records, max(1, split_records // 4))

    def restriction_size(self, element: _Slice, restriction: OffsetRange) -> float:
        if self._unbounded:
            return 1.0  # backlog unknown without asking the broker
        return float(restriction.size())

    def truncate(self, element: _Slice, restriction: OffsetRange) -> OffsetRange | None:
        # On drain a stream stops reading; a bounded range is read to its end.
        return None if self._unbounded else restriction


class _FetchDoFnBase(beam.DoFn):
    """Owns one :class:`streams.fetch.PartitionReader` per DoFn instance (``setup``/``teardown``)."""

    def __init__(self, conn: KafkaConnection, *, batch_size: int, max_wait_ms: int,
                 max_partition_fetch_bytes: int) -> None:
        self._conn = conn
        self._batch_size = batch_size
        self._reader_kw = dict(max_partition_fetch_bytes=max_partition_fetch_bytes, max_wait_ms=max_wait_ms)
        self._reader: PartitionReader | None = None
        self._records = Metrics.counter(METRICS_NAMESPACE, "kafka_records_read")
        self._batches = Metrics.counter(METRICS_NAMESPACE, "kafka_batches_read")

    def setup(self) -> None:
        self._reader = PartitionReader(self._conn, **self._reader_kw)

    def teardown(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _count(self, batch: RawRecords) -> None:
        self._records.inc(len(batch))
        self._batches.inc()


class _ReadRangeFn(_FetchDoFnBase):
    """Bounded: read ``[start, end)`` of one partition in batches."""

    def __init__(self, conn: KafkaConnection, *, stall_timeout_s: float, **kw: Any) -> None:
        super().__init__(conn, **kw)
        self._stall_timeout_s = stall_timeout_s

    def process(
        self,
        element: _Slice,
        tracker=beam.DoFn.RestrictionParam(_OffsetRangeProvider(unbounded=False)),
    ) -> Iterator[RawRecords]:
        topic, partition = element[0], element[1]
        restriction = tracker.current_restriction()
        whole = KafkaOffsetRange(topic=topic, partition=partition, start=restriction.start, end=restriction.stop)
        for chunk in read_partition(self._reader, whole, stall_timeout_s=self._stall_timeout_s):
            stop = tracker.current_restriction().stop  # the runner may have split the restriction meanwhile
            for batch, go_on in _claimed_batches(tracker, chunk.below(stop), self._batch_size):
                if len(batch):
                    self._count(batch)
                    yield batch
                if not go_on:
                    return
            if chunk.next_offset >= stop:
                break
        tracker.try_claim(tracker.current_restriction().stop)  # only gaps (or nothing) left: finish


#: Readers of the forked whole-range reads, kept by the process and thread that made them, by connection and
#: reader settings (:func:`_kept_reader`).
_KEPT_READERS: dict[tuple[Any, ...], PartitionReader] = {}


def _kept_reader(conn: KafkaConnection, kw: Mapping[str, Any]) -> tuple[PartitionReader, tuple[Any, ...] | None]:
    """A :class:`PartitionReader` of this process and thread for ``conn``, kept for its next ranges: ``(reader, key)``.

    A kept worker of :class:`pipelines.forked.ForkedChain` reads a range in every task, in every run; a new
    reader's bootstrap, version check and metadata took 20-60 ms before its first records. The key holds the
    process id, so a reader a forked child inherits is never used (nor closed) there: a connection is never
    shared by two processes. ``key`` is None for a connection that cannot be a key (the reader is not kept).
    """
    try:
        key = (os.getpid(), threading.get_ident(), conn, tuple(sorted(kw.items())))
        reader = _KEPT_READERS.get(key)
    except TypeError:  # an unhashable setting
        return PartitionReader(conn, **kw), None
    if reader is None:
        reader = _KEPT_READERS[key] = PartitionReader(conn, **kw)
    return reader, key


def _drop_kept_reader(key: tuple[Any, ...] | None, reader: PartitionReader) -> None:
    """Close ``reader`` and forget it (a read through it failed: the next one starts afresh)."""
    if key is not None and _KEPT_READERS.get(key) is reader:
        del _KEPT_READERS[key]
    reader.close()


class _ReadWholeRangeFn(_FetchDoFnBase):
    """Bounded, not splittable: all of ``[start, end)`` of a partition slice, in batches (forked workers' read).

    The reader is made by the process that reads, on its first element, not in ``setup``: a
    :class:`pipelines.forked.ForkedChain` sets its DoFns up in the driver and forks, and a
    connection must not be shared by two processes. The process keeps it for its next ranges
    (:func:`_kept_reader`); a read that fails closes it.
    """

    def __init__(self, conn: KafkaConnection, *, stall_timeout_s: float, **kw: Any) -> None:
        super().__init__(conn, **kw)
        self._stall_timeout_s = stall_timeout_s

    def setup(self) -> None:
        pass

    def process(self, element: _Slice) -> Iterator[RawRecords]:
        reader, key = _kept_reader(self._conn, self._reader_kw)
        whole = KafkaOffsetRange(topic=element[0], partition=element[1], start=element[2], end=element[3])
        try:
            for chunk in read_partition(reader, whole, stall_timeout_s=self._stall_timeout_s):
                for i in range(0, len(chunk), self._batch_size):
                    batch = _records(chunk, i, i + self._batch_size)
                    self._count(batch)
                    yield batch
        except BaseException:
            _drop_kept_reader(key, reader)
            raise
        if key is None:
            reader.close()


class _StreamWatermarks:
    """Watermark policy of one partition (see :class:`ReadKafkaStream`)."""

    def __init__(self, *, idle_watermark_lag_s: float, max_future_s: float = math.inf) -> None:
        self.idle_watermark_lag_s = idle_watermark_lag_s
        self.max_future_s = max_future_s

    @staticmethod
    def current(estimator: ManualWatermarkEstimator) -> Timestamp:
        wm = estimator.current_watermark()
        return wm if wm is not None else MIN_TIMESTAMP

    def batch_timestamp(self, estimator: ManualWatermarkEstimator, batch: RawRecords) -> Timestamp:
        # Running max of the record timestamps: never behind the watermark, so never late. A record
        # stamped further ahead of the wall clock than max_future_s (a producer's clock running fast)
        # counts as that much ahead only: it must not pull every idle timer of the job forward.
        ts = Timestamp(micros=max(batch.timestamps_ms) * 1000)
        if math.isfinite(self.max_future_s):
            ts = min(ts, Timestamp.now() + Duration(seconds=self.max_future_s))
        return max(ts, self.current(estimator))

    def advance_idle(self, estimator: ManualWatermarkEstimator) -> None:
        # Caught up with the partition: nothing older than the clock minus the lag is expected.
        idle_wm = Timestamp.now() - Duration(seconds=self.idle_watermark_lag_s)
        if idle_wm > self.current(estimator):
            estimator.set_watermark(idle_wm)


class _HoldFromStartProvider(WatermarkEstimatorProvider):
    """Manual watermark estimators that start at ``MIN_TIMESTAMP``, not unset.

    A residual deferred before its first record must still hold the watermark;
    with no watermark set, Prism lets it advance past records not read yet.
    """

    def initial_estimator_state(self, element: _Slice, restriction: OffsetRange) -> Timestamp:
        return MIN_TIMESTAMP

    def create_watermark_estimator(self, estimator_state: Timestamp) -> ManualWatermarkEstimator:
        return ManualWatermarkEstimator(estimator_state)


class _ReadStreamFn(_FetchDoFnBase):
    """Unbounded: follow one partition from ``start``, deferring when it is idle."""

    def __init__(
        self,
        conn: KafkaConnection,
        *,
        max_read_s: float,
        defer_s: float,
        watermarks: _StreamWatermarks,
        stop_offsets: Mapping[int, int] | None,
        stop_at: float | None,
        stop_file: str | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(conn, **kw)
        self._max_read_s = max_read_s
        self._defer_s = defer_s
        self._watermarks = watermarks
        self._stop_offsets = dict(stop_offsets) if stop_offsets is not None else None
        self._stop_at = stop_at
        self._stop_file = stop_file

    def _finished(self, partition: int, pos: int) -> bool:
        if self._stop_at is not None and time.time() >= self._stop_at:
            return True
        if self._stop_file is not None and os.path.exists(self._stop_file):
            return True
        return self._stop_offsets is not None and pos >= self._stop_offsets.get(partition, 0)

    @beam.DoFn.unbounded_per_element()
    def process(
        self,
        element: _Slice,
        tracker=beam.DoFn.RestrictionParam(_OffsetRangeProvider(unbounded=True)),
        estimator=beam.DoFn.WatermarkEstimatorParam(_HoldFromStartProvider()),
    ) -> Iterator[TimestampedValue]:
        topic, partition = element[0], element[1]
        pos = tracker.current_restriction().start
        started = time.monotonic()
        while True:
            if self._finished(partition, pos):
                estimator.set_watermark(MAX_TIMESTAMP)
                tracker.try_claim(tracker.current_restriction().stop)  # attempt past the end: done
                return
            stop = tracker.current_restriction().stop
            if self._stop_offsets is not None:
                stop = min(stop, self._stop_offsets.get(partition, 0))
            # Each fetch answers with the partition's high watermark, so "caught up" is known after every
            # empty fetch (a consumer re-assigned on each resume often could not tell, and the watermark stalled).
            chunk = self._reader.fetch(topic, partition, pos).below(stop)
            for batch, go_on in _claimed_batches(tracker, chunk, self._batch_size):
                if len(batch):
                    ts = self._watermarks.batch_timestamp(estimator, batch)
                    self._count(batch)
                    yield TimestampedValue(batch, ts)
                    estimator.set_watermark(ts)
                if not go_on:
                    return
            pos = max(pos, chunk.next_offset)  # also steps over control batches and compacted offsets
            if not chunk.offsets and 0 <= chunk.high_watermark <= pos:
                self._watermarks.advance_idle(estimator)
            if not chunk.offsets or time.monotonic() - started >= self._max_read_s:
                # Give the bundle back so its output is committed; the runner resumes us later.
                tracker.defer_remainder(Duration(seconds=self._defer_s))
                return


def _normalize_ranges(topic: str, ranges: Iterable[RangeSpec], split_records: int) -> list[_Slice]:
    slices: list[_Slice] = []
    seen: set[int] = set()
    for r in ranges:
        if isinstance(r, KafkaOffsetRange):
            if r.topic != topic:
                raise ValueError(f"`ranges` holds a range of topic {r.topic!r}, but `topic` is {topic!r}")
            partition, start, end = r.partition, r.start, r.end
        else:
            partition, start, end = (int(x) for x in r)
        if start < 0 or end < start:
            raise ValueError(f"`ranges` entry for partition {partition} needs 0 <= start <= end, got [{start}, {end})")
        if partition in seen:
            raise ValueError(f"`ranges` has two ranges for partition {partition}; merge them")
        seen.add(partition)
        if end > start:
            slices.append((topic, partition, start, end, split_records))
    return sorted(slices)


def _check_batching(batch_size: int, poll_timeout_ms: int) -> None:
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    if poll_timeout_ms < 1:
        raise ValueError(f"`poll_timeout_ms` must be >= 1, got {poll_timeout_ms}")


class ReadKafkaRange(beam.PTransform):
    """Read exactly the records in ``[start, end)`` of each partition, as :class:`RawRecords` batches.

    Args:
        conn: the cluster.
        topic: the topic.
        ranges: ``(partition, start, end)`` tuples or :class:`streams.consumer.OffsetRange`
            objects, at most one per partition; empty ranges are dropped. ``None``:
            every partition from offset 0 to its end offset, taken from the fetch
            high watermark when the transform is built (job start).
        batch_size: most records per emitted batch.
        poll_timeout_ms: longest the broker holds a Fetch that finds no records yet.
        stall_timeout_s: raise :class:`streams.consumer.ReadStalledError` when a
            partition has not advanced for this long before reaching its end.
        split_records: initial split size in offsets, so a cluster runner can read
            a long range on many workers (``None``: no initial splits).
        fetch_max_bytes: most bytes per Fetch response (each Fetch asks for one partition).
        max_partition_fetch_bytes: most bytes per partition per Fetch.
        downstream: :class:`pipelines.forked.ChainStage` s to run on the batches: then the ranges are read
            (whole, not split) in ``workers`` forked processes, those stages after the read, and the result
            is the :class:`pipelines.forked.ForkedChain`'s outputs (the read stage is named ``read``).
        workers: processes of that chain.

    Records are fetched by :class:`streams.fetch.PartitionReader` (kafka-python's
    connection, aiokafka's compiled record parser): ~3x the rate of a
    kafka-python consumer, which parses each record in Python.

    Raises:
        ValueError: a malformed or duplicated range, or a bad batching setting.
        streams.consumer.UnknownTopicError: ``ranges`` is None and the topic does not exist.
    """

    def __init__(
        self,
        conn: KafkaConnection,
        topic: str,
        ranges: Sequence[RangeSpec] | None = None,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        poll_timeout_ms: int = 500,
        stall_timeout_s: float = 60.0,
        split_records: int | None = 250_000,
        fetch_max_bytes: int = 64 << 20,
        max_partition_fetch_bytes: int = 16 << 20,
        downstream: Sequence[Any] = (),
        workers: int = 1,
    ) -> None:
        super().__init__()
        self._downstream, self._workers = list(downstream), workers
        _check_batching(batch_size, poll_timeout_ms)
        if split_records is not None and split_records < 1:
            raise ValueError(f"`split_records` must be >= 1 or None, got {split_records}")
        if ranges is None:
            ranges = [(p, 0, end) for p, end in sorted(end_offsets(conn, topic).items())]
        self.conn = conn
        self.topic = topic
        self.slices = _normalize_ranges(topic, ranges, split_records or 0)
        self._fn_kwargs = dict(
            batch_size=batch_size, max_wait_ms=poll_timeout_ms, stall_timeout_s=stall_timeout_s,
            max_partition_fetch_bytes=min(fetch_max_bytes, max_partition_fetch_bytes),
        )

    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection[RawRecords]:
        if self._downstream:
            from pipelines.forked import ChainStage, ForkedChain

            read = _ReadWholeRangeFn(self.conn, **self._fn_kwargs)
            return (pbegin
                    | "PartitionRanges" >> beam.Create(self.slices, reshuffle=False)
                    | "ReadInWorkers" >> ForkedChain([ChainStage("read", read), *self._downstream],
                                                     workers=self._workers, prestart=self.slices))
        return (
            pbegin
            | "PartitionRanges" >> beam.Create(self.slices, reshuffle=False)
            # Declared, so the batches get the job's coder (pipelines/coders.py): with none, Beam's metrics
            # sampled their size by pickling whole batches (~10 MB each).
            | "ReadRecords" >> beam.ParDo(_ReadRangeFn(self.conn, **self._fn_kwargs)).with_output_types(RawRecords)
        )


class ReadKafkaStream(beam.PTransform):
    """Follow a topic as an unbounded stream of :class:`RawRecords` batches, with event-time watermarks.

    Each partition is one restriction ``OffsetRange(start, sys.maxsize)``. A
    ``process`` call reads for at most ``max_read_s`` (or until a poll comes back
    empty) and then defers the rest, so every bundle ends and its output is
    committed downstream.

    Timestamps and watermark, per partition: a batch is timestamped with the
    running maximum of its partition's Kafka record timestamps (each record's
    own timestamp stays in ``timestamps_ms``), and the watermark follows that
    maximum, so no batch is ever late. A partition that is caught up (a poll
    returns nothing and the position has reached the fetch high watermark) moves its watermark to processing time minus
    ``idle_watermark_lag_s`` (never backwards), so event-time timers and windows
    downstream still fire when traffic stops; records that arrive later with
    older timestamps are stamped at that watermark (their own timestamps stay
    in ``timestamps_ms``).

    Args:
        conn: the cluster.
        topic: the topic.
        start_offsets: ``partition -> first offset``; partitions not named start at 0
            (the log's beginning). ``None``: every partition from the beginning.
        batch_size: most records per emitted batch.
        poll_timeout_ms: longest the broker holds a Fetch that finds no records yet.
        max_read_s: longest a ``process`` call reads before deferring the rest.
        defer_s: resume delay asked of the runner after an idle poll.
        idle_watermark_lag_s: how far behind processing time a caught-up partition's
            watermark stays; allow for producer clock skew and records in flight.
        max_future_s: a record timestamp more than this ahead of the wall clock
            stamps its batch at wall clock + ``max_future_s`` (its own timestamp
            stays in ``timestamps_ms``): one producer's fast clock cannot move the
            watermark hours ahead.
        stop_offsets: stop each partition once it reaches this offset (exclusive);
            partitions not named stop at once. For tests and catch-up jobs.
        stop_after_s: stop every partition this many seconds after the transform is
            built (wall clock). For demos.
        stop_file: stop every partition once this path exists (a condition an
            operator or a test decides on, e.g. "the commits hold what was sent").
        partitions: read only these partitions (default: all, looked up at build time;
            partitions added later are not picked up).
        fetch_max_bytes: most bytes per Fetch response.
        max_partition_fetch_bytes: most bytes per partition per Fetch.

    Raises:
        ValueError: a bad setting (names the parameter).
        streams.consumer.UnknownTopicError: the topic does not exist.
    """

    def __init__(
        self,
        conn: KafkaConnection,
        topic: str,
        start_offsets: Mapping[int, int] | None = None,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        poll_timeout_ms: int = 200,
        max_read_s: float = 1.0,
        defer_s: float = 0.1,
        idle_watermark_lag_s: float = 10.0,
        stop_offsets: Mapping[int, int] | None = None,
        stop_after_s: float | None = None,
        stop_file: str | None = None,
        partitions: Sequence[int] | None = None,
        fetch_max_bytes: int = 64 << 20,
        max_partition_fetch_bytes: int = 16 << 20,
        max_future_s: float = math.inf,
    ) -> None:
        super().__init__()
        _check_batching(batch_size, poll_timeout_ms)
        if max_future_s < 0:
            raise ValueError(f"`max_future_s` must be >= 0, got {max_future_s}")
        if max_read_s <= 0:
            raise ValueError(f"`max_read_s` must be > 0, got {max_read_s}")
        for name, value in (("defer_s", defer_s), ("idle_watermark_lag_s", idle_watermark_lag_s)):
            if value < 0:
                raise ValueError(f"`{name}` must be >= 0, got {value}")
        if stop_after_s is not None and stop_after_s <= 0:
            raise ValueError(f"`stop_after_s` must be > 0 or None, got {stop_after_s}")
        parts = sorted(partitions) if partitions is not None else partitions_for(conn, topic)
        start_offsets = dict(start_offsets or {})
        unknown = sorted(set(start_offsets) - set(parts))
        if unknown:
            raise ValueError(f"`start_offsets` names partitions {unknown} that are not read; known: {parts}")
        if any(v < 0 for v in start_offsets.values()):
            raise ValueError(f"`start_offsets` must be >= 0, got {start_offsets}")
        self.conn = conn
        self.topic = topic
        self.slices: list[_Slice] = [(topic, p, start_offsets.get(p, 0), sys.maxsize, 0) for p in parts]
        self._fn_kwargs = dict(
            batch_size=batch_size, max_wait_ms=poll_timeout_ms, max_read_s=max_read_s, defer_s=defer_s,
            watermarks=_StreamWatermarks(idle_watermark_lag_s=idle_watermark_lag_s, max_future_s=max_future_s),
            stop_offsets=stop_offsets, stop_at=time.time() + stop_after_s if stop_after_s else None,
            stop_file=stop_file,
            max_partition_fetch_bytes=min(fetch_max_bytes, max_partition_fetch_bytes),
        )

    def expand(self, pbegin: beam.pvalue.PBegin) -> beam.PCollection[RawRecords]:
        return (
            pbegin
            | "Partitions" >> beam.Create(self.slices, reshuffle=False)
            | "ReadRecords" >> beam.ParDo(_ReadStreamFn(self.conn, **self._fn_kwargs))
        )

