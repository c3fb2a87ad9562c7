"""Bounded partition reads at C speed: kafka-python's connection and Fetch protocol, aiokafka's record parser.

kafka-python's consumer parses every record of a fetched batch in Python
(varints, a ``ConsumerRecord`` per record): ~15-25 µs a record on this
project's machines, which is all of a raw consumer's time once the CRC check
is in C. Batch jobs that only need ``(offset, key, value, timestamp)`` of a
known offset range do not need the consumer's machinery (groups, positions,
interceptors), so :class:`PartitionReader` sends Fetch requests itself over
kafka-python's connection manager (same bootstrap, security settings,
metadata and protocol code as every other client of the project) and hands
the returned record bytes to aiokafka's compiled ``MemoryRecords`` parser,
which reads every message format (v0-v2), decompresses gzip/snappy/lz4/zstd
and checks CRCs in C. ``make bench`` records the difference
(``fast_fetch_events_per_s`` beside ``raw_consume_events_per_s``).

The reader's connections receive up to 1 MiB a ``recv`` call (:func:`_recv_large`):
kafka-python 3.0 reads a socket 4 KiB at a time, a Python call and a ``bytes`` each, then joins
them; for 100k events (~200 MB) that was a third of the reader's CPU time (0.67 → 0.42 CPU-s).

Semantics match :func:`streams.consumer.read_range`: read-uncommitted
isolation (what the project's consumers use), control batches skipped,
offsets left by compaction or transaction markers stepped over by the
batches' ``next_offset``, records before the requested offset (a batch
starts before it) dropped. Retriable broker answers (leader moved, broker
restarting) refresh the metadata and come back as empty chunks, so a caller
with a deadline (:func:`read_partition`, the pipeline's bounded Kafka
source) waits for the cluster instead of failing; errors no retry can fix
raise :class:`FetchError` subclasses.

Examples:
    >>> chunk = PartitionChunk(topic="t", partition=0, offsets=[4, 5], keys=[b"a", b"b"], values=[b"x", b"y"],
    ...                        timestamps_ms=[1, 2], next_offset=6, high_watermark=9)
    >>> len(chunk), chunk.next_offset
    (2, 6)
    >>> chunk.below(5).offsets
    [4]
    >>> chunk.record(1)
    FetchedRecord(topic='t', partition=0, offset=5, key=b'b', value=b'y', timestamp=2)
"""

from __future__ import annotations

import bisect
import functools
import logging
import ssl
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import kafka.errors as Errors
import msgspec
from aiokafka.record.memory_records import MemoryRecords
from kafka import TopicPartition
from kafka.net.compat import KafkaNetClient
from kafka.net.transport import KafkaTCPTransport
from kafka.protocol.consumer import FetchRequest

from streams.config import KafkaConnection
from streams.errors import access_denied, check_kafka
from streams.consumer import METADATA_RETRY_BACKOFF_MS, OffsetRange, ReadStalledError

__all__ = [
    "PartitionChunk",
    "FetchedRecord",
    "PartitionReader",
    "FetchError",
    "OffsetOutOfRangeError",
    "CorruptBatchError",
    "read_partition",
]

log = logging.getLogger(__name__)

_FetchTopic = FetchRequest.FetchTopic
_FetchPartition = _FetchTopic.FetchPartition
_READ_UNCOMMITTED = 0
# Fetch v12 is the newest kafka-python's protocol code builds without topic ids (v13+ need them).
_MAX_FETCH_VERSION = 12
# Most bytes of one response frame beyond the fetch limits (headers of many partitions).
_FRAME_SLACK = 1 << 20
# Most bytes one recv() of the reader's connections takes (kafka-python's own: 4 KiB).
_RECV_BYTES = 1 << 20


class FetchError(RuntimeError):
    """A partition could not be read, and retrying will not help (the message says why and what to do)."""


class OffsetOutOfRangeError(FetchError):
    """The requested offset is not in the partition's log (deleted by retention, or past its end)."""


class CorruptBatchError(FetchError):
    """A fetched record batch failed its CRC check."""


class FetchedRecord(NamedTuple):
    """One record of a :class:`PartitionChunk` (the fields a dead letter needs, as on ``ConsumerRecord``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int


class PartitionChunk(msgspec.Struct, kw_only=True):
    """The records one Fetch returned for one partition, as parallel lists in offset order.

    Attributes:
        topic: topic name.
        partition: partition number.
        offsets: offset of each record (all ``>=`` the offset asked for).
        keys: each record's key (None for no key).
        values: each record's value (None for a tombstone).
        timestamps_ms: each record's timestamp, epoch milliseconds.
        next_offset: where the next fetch starts: after the last batch returned,
            including control batches and compacted-away offsets; the offset
            asked for when nothing came back.
        high_watermark: the partition's high watermark in this response (-1 if unknown).
    """

    topic: str
    partition: int
    offsets: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]
    timestamps_ms: list[int]
    next_offset: int
    high_watermark: int = -1

    def __len__(self) -> int:
        return len(self.offsets)

    def record(self, i: int) -> FetchedRecord:
        """The ``i``-th record as a :class:`FetchedRecord`."""
        return FetchedRecord(self.topic, self.partition, self.offsets[i], self.keys[i], self.values[i],
                             self.timestamps_ms[i])

    def below(self, stop: int) -> "PartitionChunk":
        """The records with offset ``< stop`` (``next_offset`` capped at ``stop``)."""
        if (not self.offsets or self.offsets[-1] < stop) and self.next_offset <= stop:
            return self
        i = bisect.bisect_left(self.offsets, stop)
        return PartitionChunk(topic=self.topic, partition=self.partition, offsets=self.offsets[:i],
                              keys=self.keys[:i], values=self.values[:i], timestamps_ms=self.timestamps_ms[:i],
                              next_offset=min(self.next_offset, stop), high_watermark=self.high_watermark)


def _empty(topic: str, partition: int, offset: int, hw: int = -1) -> PartitionChunk:
    return PartitionChunk(topic=topic, partition=partition, offsets=[], keys=[], values=[], timestamps_ms=[],
                          next_offset=offset, high_watermark=hw)


class PartitionReader:
    """Fetch records of single partitions, parsed by aiokafka's compiled record code.

    One reader holds one kafka-python connection manager; use it from one
    thread, and :meth:`close` it (or use it as a context manager).

    Args:
        conn: the cluster (bootstrap servers and security settings).
        max_partition_fetch_bytes: most record bytes per Fetch (the broker still
            returns a whole first batch when one is larger).
        max_wait_ms: longest the broker holds a Fetch when no records are there yet.
        check_crcs: verify each batch's CRC-32C (raise :class:`CorruptBatchError`).
    """

    def __init__(self, conn: KafkaConnection, *, max_partition_fetch_bytes: int = 16 << 20,
                 max_wait_ms: int = 100, check_crcs: bool = True) -> None:
        if max_partition_fetch_bytes < 1 or max_wait_ms < 0:
            raise ValueError("`max_partition_fetch_bytes` must be >= 1 and `max_wait_ms` >= 0, got "
                             f"{max_partition_fetch_bytes} and {max_wait_ms}")
        self._max_bytes = max_partition_fetch_bytes
        self._max_wait_ms = max_wait_ms
        self._check_crcs = check_crcs
        self._timeout_ms = conn.request_timeout_ms
        self._conn = conn
        check_kafka(conn)  # kafka-python reports a refused password as a bootstrap timeout; say what it is
        kw = conn.client_kwargs()
        self._client = kw.pop("kafka_client")(**kw, receive_message_max_bytes=max_partition_fetch_bytes + _FRAME_SLACK)
        # kafka-python 3.0 builds the cluster metadata without the client's `retry_backoff_ms`, so a refresh
        # within 100 ms of the last one (the first fetch's, right after bootstrap's) waits out the rest of
        # the 100 ms: ~0.1 s per reader for nothing. Broker-down backoff is separate (KIP-580, unchanged).
        self._client.cluster.config["retry_backoff_ms"] = METADATA_RETRY_BACKOFF_MS
        _receive_large(self._client)
        self._topics: set[str] = set()

    def __enter__(self) -> "PartitionReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections."""
        self._client.close()

    def _leader(self, tp: TopicPartition) -> int | None:
        cluster = self._client.cluster
        if tp.topic not in self._topics:
            self._client.check_version(timeout_ms=self._timeout_ms)  # bootstraps on first use
            self._topics.add(tp.topic)
            cluster.set_topics(sorted(self._topics))
            self._refresh()
        leader = cluster.leader_for_partition(tp)
        if leader is None or leader == -1:
            self._refresh()
            leader = cluster.leader_for_partition(tp)
        return None if leader is None or leader == -1 else leader

    def _refresh(self) -> None:
        future = self._client.cluster.request_update()
        self._client.poll(timeout_ms=self._timeout_ms, future=future)

    def fetch(self, topic: str, partition: int, offset: int) -> PartitionChunk:
        """One Fetch of ``partition`` from ``offset``: the records the broker returned (maybe none).

        Returns an empty chunk (``next_offset == offset``) when the broker had
        nothing new within ``max_wait_ms``, and when the cluster is not ready
        (no leader yet, leader moved, connection lost: the metadata is
        refreshed for the next call).

        Raises:
            OffsetOutOfRangeError: ``offset`` is not in the log.
            CorruptBatchError: a batch failed its CRC check.
            FetchError: any other error a retry cannot fix (authorization, unknown
                topic after refresh, unsupported broker).
        """
        tp = TopicPartition(topic, partition)
        try:
            leader = self._leader(tp)
            if leader is None:
                return _empty(topic, partition, offset)
            request = FetchRequest(
                max_wait_ms=self._max_wait_ms, min_bytes=1, max_bytes=self._max_bytes,
                isolation_level=_READ_UNCOMMITTED, session_id=0, session_epoch=-1,
                topics=[_FetchTopic(topic=topic, partitions=[_FetchPartition(
                    partition=partition, current_leader_epoch=-1, fetch_offset=offset, last_fetched_epoch=-1,
                    log_start_offset=-1, partition_max_bytes=self._max_bytes)])],
                forgotten_topics_data=[], rack_id="", max_version=_MAX_FETCH_VERSION,
            )
            response = self._client.send_and_receive(leader, request, timeout_ms=self._timeout_ms)
        except (Errors.KafkaConnectionError, Errors.KafkaTimeoutError, Errors.NodeNotReadyError,
                Errors.RequestTimedOutError) as err:
            log.info("fetch %s[%d]@%d: %s; will retry", topic, partition, offset, err)
            self._client.cluster.request_update()
            return _empty(topic, partition, offset)
        for topic_data in response.responses:
            for data in topic_data.partitions:
                if data.partition_index == partition:
                    return self._parse(topic, partition, offset, data)
        return _empty(topic, partition, offset)

    def _parse(self, topic: str, partition: int, offset: int, data: Any) -> PartitionChunk:
        error = Errors.for_code(data.error_code)
        if error is Errors.OffsetOutOfRangeError:
            raise OffsetOutOfRangeError(
                f"{topic}[{partition}] has no offset {offset} (log is [{data.log_start_offset}, "
                f"{data.high_watermark})): the records were deleted by retention, or the range is past the end; "
                "re-derive from the event archive (--source archive)")
        if error is not Errors.NoError:
            if getattr(error, "retriable", False) or getattr(error, "invalid_metadata", False):
                log.info("fetch %s[%d]@%d: %s; refreshing metadata", topic, partition, offset, error.__name__)
                self._client.cluster.request_update()
                return _empty(topic, partition, offset)  # no high watermark: an error is not "caught up"
            if issubclass(error, Errors.AuthorizationError):
                raise access_denied(self._conn, what=f"read topic {topic!r}", err=error())
            raise FetchError(f"{topic}[{partition}]: the broker answered {error.__name__} ({error.description})")
        offsets: list[int] = []
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        stamps: list[int] = []
        next_offset = offset
        floor = offset  # offsets only go up: records before it (a batch starting earlier, a batch sent twice) are skipped
        records = MemoryRecords(data.records) if data.records else None
        while records is not None:
            batch = records.next_batch()
            if batch is None:
                break
            if self._check_crcs and not batch.validate_crc():
                raise CorruptBatchError(f"{topic}[{partition}]: the batch at offset {batch.base_offset} failed its "
                                        "CRC check (a broken disk or network path); nothing after it was read")
            next_offset = max(next_offset, batch.next_offset)
            if batch.is_control_batch:
                continue
            for record in batch:
                o = record.offset
                if o < floor:
                    continue
                floor = o + 1
                offsets.append(o)
                keys.append(record.key)
                values.append(record.value)
                stamps.append(record.timestamp)
        next_offset = max(next_offset, floor)  # never behind what was read, whatever the batch headers say
        return PartitionChunk(topic=topic, partition=partition, offsets=offsets, keys=keys, values=values,
                              timestamps_ms=stamps, next_offset=next_offset, high_watermark=data.high_watermark)


def _receive_large(client: KafkaNetClient) -> None:
    """Make ``client``'s connections, plain TCP or TLS, receive with :func:`_recv_large`.

    kafka-python 3.0.12 builds each connection's transport in ``KafkaConnectionManager._build_transport``;
    the instance's coroutine is wrapped so that every transport it builds (reconnects too) gets the method.
    A kafka-python without that hook keeps its own receive (slower, same bytes).
    """
    manager = getattr(client, "_manager", None)
    build = getattr(manager, "_build_transport", None)
    if build is None:
        log.debug("kafka-python has no _build_transport hook: the reader receives 4 KiB a call")
        return

    async def _build_transport(*args: Any, **kwargs: Any) -> Any:
        transport = await build(*args, **kwargs)
        if isinstance(transport, KafkaTCPTransport):  # KafkaSSLTransport is one too
            transport._sock_recv = functools.partial(_recv_large, transport)
        return transport

    manager._build_transport = _build_transport


def _recv_large(transport: KafkaTCPTransport) -> tuple[bytes, Exception | None]:
    """kafka-python's ``_sock_recv`` (``KafkaTCPTransport``'s and ``KafkaSSLTransport``'s) with ``recv(_RECV_BYTES)``.

    A TLS socket returns at most one TLS record (16 KiB) a call, still 4x fewer calls than 4 KiB.

    Reads until the non-blocking socket has nothing more; returns ``(data, error)`` as the original does
    (an error: the peer closed, or the socket failed; kafka-python then aborts the connection).
    """
    received = []
    err = None
    while True:
        try:
            data = transport._sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            break  # nothing more now (TLS: no whole record yet, or a renegotiation wants to write)
        except Exception as e:  # noqa: BLE001 - reported to kafka-python as its own code does
            log.debug("%s: error receiving network data: %s", transport, e)
            err = Errors.KafkaConnectionError(e)
            break
        if not data:
            err = Errors.KafkaConnectionError("socket disconnected")
            break
        received.append(data)
    return (received[0] if len(received) == 1 else b"".join(received)), err


def read_partition(reader: PartitionReader, r: OffsetRange, *, stall_timeout_s: float = 30.0) -> Iterator[PartitionChunk]:
    """Every record of ``[r.start, r.end)``, as non-empty chunks in offset order.

    Args:
        reader: the reader to fetch with.
        r: the range.
        stall_timeout_s: raise :class:`~streams.consumer.ReadStalledError` when
            no fetch advances for this long (the range is past the log's end,
            the broker is gone).

    Raises:
        ReadStalledError: no progress within ``stall_timeout_s``; ``remaining`` says where to resume.
        FetchError: see :meth:`PartitionReader.fetch`.
    """
    pos = r.start
    last_progress = time.monotonic()
    while pos < r.end:
        chunk = reader.fetch(r.topic, r.partition, pos).below(r.end)
        if chunk.next_offset > pos:
            pos = chunk.next_offset
            last_progress = time.monotonic()
            if chunk.offsets:
                yield chunk
        elif time.monotonic() - last_progress > stall_timeout_s:
            raise ReadStalledError(
                f"{r.topic}[{r.partition}] made no progress for {stall_timeout_s}s at offset {pos} of "
                f"[{r.start}, {r.end}): the range is past the log's end, the topic was deleted, or the broker is gone",
                {(r.topic, r.partition): pos},
                [OffsetRange(topic=r.topic, partition=r.partition, start=pos, end=r.end)],
            )
