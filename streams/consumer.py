"""Consumer helpers: exact end offsets, bounded range reads, group commits.

Batch jobs read a fixed slice of the log, ``[start, end)`` per partition, and
record those offsets in their commit, so a rerun reads exactly the same
records. :func:`end_offsets` takes ``end`` from the *high watermark of a Fetch
response*, not from ListOffsets: the Tansu broker answers ListOffsets(latest)
too low after multi-record batches, which would silently cut the slice short.

:func:`read_range` assigns partitions by hand (no group, no auto-commit),
seeks to each ``start``, polls in large batches and stops exactly at each
``end``. Offsets that hold no record (compaction, transaction markers) are
skipped by the consumer's position, so the read cannot wait for a record that
will never come; if a partition stops advancing anyway, a deadline raises
:class:`ReadStalledError` instead of hanging.

Streaming consumers use :func:`group_consumer` (auto-commit off) and
:func:`commit_offsets` once their output is durable.

Examples:
    >>> r = OffsetRange(topic="trajpipe.events", partition=0, start=10, end=25)
    >>> r.size
    15
    >>> ranges_from(topic="t", start={0: 5, 1: 0}, end={0: 9, 1: 0})
    [OffsetRange(topic='t', partition=0, start=5, end=9)]
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec
from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.structs import OffsetAndMetadata

from streams.admin import raise_if_unauthorized
from streams.config import KafkaConnection
from streams.errors import check_kafka

__all__ = [
    "OffsetRange",
    "StreamTimeoutError",
    "ReadStalledError",
    "UnknownTopicError",
    "partitions_for",
    "end_offsets",
    "committed_offsets",
    "ranges_from",
    "read_range",
    "group_consumer",
    "commit_offsets",
    "next_offsets",
    "ConsumerRecord",
]

log = logging.getLogger(__name__)


class StreamTimeoutError(TimeoutError):
    """A broker did not answer a streams helper within its deadline."""


class ReadStalledError(StreamTimeoutError):
    """:func:`read_range` made no progress before its deadline.

    Attributes:
        positions: ``(topic, partition) -> next offset`` reached so far.
        remaining: the ranges not finished, with ``start`` moved to where
            reading stopped (pass them to :func:`read_range` to resume).
    """

    def __init__(self, message: str, positions: dict[tuple[str, int], int], remaining: list[OffsetRange]) -> None:
        super().__init__(message)
        self.positions = positions
        self.remaining = remaining


class UnknownTopicError(LookupError):
    """The topic does not exist on the broker."""


class OffsetRange(msgspec.Struct, frozen=True, kw_only=True):
    """A half-open slice ``[start, end)`` of one partition.

    Attributes:
        topic: topic name.
        partition: partition number.
        start: first offset to read.
        end: first offset *not* to read (a high watermark from :func:`end_offsets`).
    """

    topic: str
    partition: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"offset range needs 0 <= start <= end, got start={self.start} end={self.end}")

    @property
    def size(self) -> int:
        """Number of offsets covered (records, if no offset is a gap)."""
        return self.end - self.start


#: Cluster-metadata retry backoff of our clients (kafka-python 3.0 leaves its cluster metadata at 100 ms
#: whatever the client's ``retry_backoff_ms``; broker-down backoff, KIP-580, is separate).
METADATA_RETRY_BACKOFF_MS = 10


def _consumer(conn: KafkaConnection, **overrides: Any) -> KafkaConsumer:
    check_kafka(conn)  # one clear error for a broker that is down or refuses us, not a bootstrap timeout
    kw: dict[str, Any] = {
        **conn.client_kwargs(),
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "group_id": None,
    }
    kw.update(overrides)
    consumer = KafkaConsumer(**kw)
    # As in streams/fetch.py's PartitionReader: kafka-python 3.0's cluster metadata ignores the client's
    # `retry_backoff_ms`, so the first metadata request after bootstrap's waits out the rest of 100 ms.
    consumer._cluster.config["retry_backoff_ms"] = METADATA_RETRY_BACKOFF_MS
    return consumer


def partitions_for(conn: KafkaConnection, topic: str, *, timeout_s: float = 10.0) -> list[int]:
    """The partition numbers of a topic, sorted.

    Raises:
        UnknownTopicError: the topic does not exist.
        kafka.errors.TopicAuthorizationFailedError: an ACL hides the topic from this client.
    """
    consumer = _consumer(conn)
    try:
        return _partitions_of(consumer, conn, topic, timeout_s=timeout_s)
    finally:
        consumer.close()


def _partitions_of(consumer: KafkaConsumer, conn: KafkaConnection, topic: str, *, timeout_s: float) -> list[int]:
    """:func:`partitions_for`, asked through an open consumer."""
    checked_acl = False
    deadline = time.monotonic() + timeout_s
    while True:
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return sorted(parts)
        if not checked_acl:  # a topic an ACL hides looks missing too: ask, once, which it is
            checked_acl = True
            raise_if_unauthorized(conn, topic)
        if time.monotonic() >= deadline:
            raise UnknownTopicError(f"topic {topic!r} not found on {conn.bootstrap_servers}")
        time.sleep(0.1)


def end_offsets(
    conn: KafkaConnection,
    topic: str,
    *,
    partitions: Iterable[int] | None = None,
    timeout_s: float = 10.0,
) -> dict[int, int]:
    """High watermark of every partition, read from Fetch responses.

    Fetches (at most one batch) from each partition's beginning and takes the
    ``high_watermark`` the broker returns with it: the offset after the last
    committed record, exact on Kafka and Tansu alike.

    Args:
        conn: the cluster.
        topic: the topic.
        partitions: only these partitions (default: all).
        timeout_s: deadline for all answers.

    Returns:
        ``partition -> end offset`` (the next offset that would be written).

    Raises:
        UnknownTopicError: the topic does not exist.
        StreamTimeoutError: some partition gave no high watermark in time.
    """
    # Tiny fetches: the broker still returns one whole batch, plus the watermark.
    consumer = _consumer(conn, max_partition_fetch_bytes=1, fetch_max_bytes=1, fetch_max_wait_ms=50)
    try:
        parts = (sorted(partitions) if partitions is not None
                 else _partitions_of(consumer, conn, topic, timeout_s=timeout_s))  # one consumer for both
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        found: dict[int, int] = {}
        deadline = time.monotonic() + timeout_s
        while len(found) < len(tps):
            if time.monotonic() >= deadline:
                missing = sorted(set(parts) - set(found))
                raise StreamTimeoutError(
                    f"no high watermark for {topic} partitions {missing} within {timeout_s}s"
                )
            consumer.poll(timeout_ms=100, max_records=1)
            for tp in tps:
                if tp.partition not in found:
                    hw = consumer.highwater(tp)
                    if hw is not None:
                        found[tp.partition] = hw
                        consumer.pause(tp)
        return found
    finally:
        consumer.close()


def committed_offsets(
    conn: KafkaConnection,
    group_id: str,
    topic: str,
    *,
    partitions: Iterable[int] | None = None,
    default: int = 0,
) -> dict[int, int]:
    """Offsets a consumer group has committed, ``default`` where it has none.

    Args:
        conn: the cluster.
        group_id: consumer group.
        topic: the topic.
        partitions: only these partitions (default: all).
        default: offset for partitions without a commit (0 = read from the start).

    Returns:
        ``partition -> next offset to read``.
    """
    parts = sorted(partitions) if partitions is not None else partitions_for(conn, topic)
    consumer = _consumer(conn, group_id=group_id)
    try:
        out: dict[int, int] = {}
        for p in parts:
            committed = consumer.committed(TopicPartition(topic, p))
            out[p] = default if committed is None else committed
        return out
    finally:
        consumer.close()


def ranges_from(*, topic: str, start: Mapping[int, int], end: Mapping[int, int]) -> list[OffsetRange]:
    """Build the non-empty ranges ``[start[p], end[p])`` (missing start = 0).

    Examples:
        >>> ranges_from(topic="t", start={}, end={1: 3, 0: 2})
        [OffsetRange(topic='t', partition=0, start=0, end=2), OffsetRange(topic='t', partition=1, start=0, end=3)]
    """
    out = []
    for p in sorted(end):
        s = start.get(p, 0)
        if end[p] > s:
            out.append(OffsetRange(topic=topic, partition=p, start=s, end=end[p]))
    return out


def read_range(
    conn: KafkaConnection,
    ranges: Sequence[OffsetRange],
    *,
    max_records: int = 50_000,
    fetch_max_bytes: int = 64 << 20,
    max_partition_fetch_bytes: int = 16 << 20,
    stall_timeout_s: float = 30.0,
    poll_timeout_ms: int = 200,
) -> Iterator[list[ConsumerRecord]]:
    """Read exactly the records in ``ranges``, in large batches.

    Each partition is read from ``start`` and stops at ``end``; records at or
    past ``end`` that arrive in the same fetch are cut off. Within a partition
    records come in offset order; partitions interleave.

    Args:
        conn: the cluster.
        ranges: at most one range per ``(topic, partition)``.
        max_records: most records per yielded batch (``poll(max_records=...)``).
        fetch_max_bytes: most bytes per Fetch response.
        max_partition_fetch_bytes: most bytes per partition per Fetch.
        stall_timeout_s: raise :class:`ReadStalledError` if no partition
            advances for this long (a range past the log's end, a deleted
            topic, a broker gone).
        poll_timeout_ms: longest wait of one poll.

    Yields:
        Lists of ``ConsumerRecord`` (never empty).

    Raises:
        ValueError: two ranges for the same partition.
        ReadStalledError: no progress within ``stall_timeout_s``.
    """
    todo = {TopicPartition(r.topic, r.partition): r for r in ranges if r.size > 0}
    if len(todo) != len({(r.topic, r.partition) for r in ranges if r.size > 0}):
        raise ValueError("`ranges` has two ranges for the same partition; merge them")
    if not todo:
        return
    consumer = _consumer(
        conn,
        fetch_max_bytes=fetch_max_bytes,
        max_partition_fetch_bytes=max_partition_fetch_bytes,
        max_poll_records=max_records,
        fetch_max_wait_ms=100,
    )
    try:
        consumer.assign(list(todo))
        for tp, r in todo.items():
            consumer.seek(tp, r.start)
        positions = {tp: r.start for tp, r in todo.items()}
        last_progress = time.monotonic()
        while todo:
            batch_by_tp = consumer.poll(timeout_ms=poll_timeout_ms, max_records=max_records)
            out: list[ConsumerRecord] = []
            for tp, records in batch_by_tp.items():
                r = todo.get(tp)
                if r is None or not records:
                    continue
                if records[0].offset < r.start or records[-1].offset >= r.end:
                    offsets = [rec.offset for rec in records]
                    records = records[bisect.bisect_left(offsets, r.start):bisect.bisect_left(offsets, r.end)]
                out.extend(records)
            progressed = False
            for tp in list(todo):
                pos = consumer.position(tp)
                if pos is not None and pos != positions[tp]:
                    positions[tp] = pos
                    progressed = True
                if pos is not None and pos >= todo[tp].end:
                    consumer.pause(tp)
                    del todo[tp]
            if out:
                yield out
            now = time.monotonic()
            if progressed or out:
                last_progress = now
            elif now - last_progress > stall_timeout_s:
                remaining = [
                    OffsetRange(topic=tp.topic, partition=tp.partition, start=max(positions[tp], r.start), end=r.end)
                    for tp, r in todo.items()
                ]
                raise ReadStalledError(
                    f"read_range made no progress for {stall_timeout_s}s; unfinished: "
                    + ", ".join(f"{r.topic}[{r.partition}] at {r.start} of {r.end}" for r in remaining),
                    {(tp.topic, tp.partition): p for tp, p in positions.items()},
                    remaining,
                )
    finally:
        consumer.close()


def group_consumer(
    conn: KafkaConnection,
    group_id: str,
    topics: Sequence[str],
    *,
    max_poll_records: int = 10_000,
    fetch_max_bytes: int = 64 << 20,
    max_partition_fetch_bytes: int = 16 << 20,
    auto_offset_reset: str = "earliest",
    **overrides: Any,
) -> KafkaConsumer:
    """A subscribed consumer-group member that never auto-commits.

    Commit with :func:`commit_offsets` only after the output is durable, and
    ``close()`` it in ``finally``.

    Args:
        conn: the cluster.
        group_id: consumer group id.
        topics: topics to subscribe to.
        max_poll_records: most records per ``poll``.
        fetch_max_bytes: most bytes per Fetch response.
        max_partition_fetch_bytes: most bytes per partition per Fetch.
        auto_offset_reset: where to start without a committed offset.
        **overrides: further ``KafkaConsumer`` settings.
    """
    consumer = _consumer(
        conn,
        group_id=group_id,
        max_poll_records=max_poll_records,
        fetch_max_bytes=fetch_max_bytes,
        max_partition_fetch_bytes=max_partition_fetch_bytes,
        auto_offset_reset=auto_offset_reset,
        **overrides,
    )
    consumer.subscribe(list(topics))
    return consumer


def next_offsets(records: Iterable[ConsumerRecord]) -> dict[TopicPartition, int]:
    """``offset + 1`` of the last record per partition: what to commit after processing them.

    Examples:
        >>> from collections import namedtuple
        >>> R = namedtuple("R", "topic partition offset")
        >>> next_offsets([R("t", 0, 4), R("t", 0, 5), R("t", 1, 9)])
        {TopicPartition(topic='t', partition=0): 6, TopicPartition(topic='t', partition=1): 10}
    """
    out: dict[TopicPartition, int] = {}
    for rec in records:
        tp = TopicPartition(rec.topic, rec.partition)
        if rec.offset + 1 > out.get(tp, -1):
            out[tp] = rec.offset + 1
    return out


def commit_offsets(consumer: KafkaConsumer, offsets: Mapping[TopicPartition, int]) -> None:
    """Synchronously commit ``next offset to read`` per partition for the consumer's group.

    Call it only after the output covering those records is durable.

    Args:
        consumer: a consumer with a ``group_id`` (e.g. from :func:`group_consumer`).
        offsets: ``TopicPartition -> next offset`` (see :func:`next_offsets`).

    Raises:
        kafka.errors.CommitFailedError: the group rebalanced; the records will
            be delivered again (at-least-once), nothing is lost.
    """
    if not offsets:
        return
    consumer.commit({tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()})
