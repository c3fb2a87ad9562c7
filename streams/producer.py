"""Event producer with a local disk spool: nothing acknowledged is ever dropped.

:class:`EventProducer` sends trajpipe events to one Kafka topic, keyed by
``episode_id``, with ``acks="all"`` and idempotence where the broker supports
it. When the broker cannot be reached it appends events to an append-only spool
file in ``spool_dir`` and replays the spool, in order, once the broker is back.

What "acknowledged" means
-------------------------
An event is *acknowledged* once :meth:`EventProducer.flush` (or
:meth:`EventProducer.close`) has returned after the event's :meth:`emit`. At
that point every emitted event is in exactly one of two places:

* **acked by Kafka** with ``acks=all`` (written to all in-sync replicas), or
* **fsync'ed in the spool file** (the spool file's data has reached the disk
  with ``os.fsync``), from where it is replayed to Kafka later, also by a new
  producer started on the same ``spool_dir`` after a crash.

``emit`` returning is *not* an acknowledgement: an event that is only in the
client's memory, or in the spool's write buffer, can be lost if the process
dies. A torn record at the end of the spool (a crash in the middle of a write)
was therefore never acknowledged, and is detected by its CRC and dropped when
the spool is opened.

Ordering and duplicates (at-least-once)
---------------------------------------
* While the broker is healthy, events keep their emit order per episode (one
  key → one partition; idempotent producer, <= 5 requests in flight).
* When sends start failing, the producer first waits for every in-flight send
  to complete (each failed one is appended to the spool from its error
  callback, in completion order, which is send order within a partition), and
  only then appends new events to the spool. From then on every event goes to
  the spool until the whole spool has been replayed and acked, so later
  events never overtake spooled ones.
* Exception: if, in one outage, a send fails and a *later* send of the same
  episode still succeeds (e.g. different batches, one expired), the later one
  reaches Kafka first. Consumers order by ``seq``, not offset.
* A replay that fails halfway keeps the whole spool and re-sends it on the next
  try, and a send that timed out may still have been written. Both make
  **duplicates** possible; every event carries a stable ``event_id`` and the
  pipelines dedupe on it.

Spool file format
-----------------
``<spool_dir>/<topic>.spool``: the 8-byte magic ``b"TJSPOOL1"``, then records
framed as ``>II`` (payload length, CRC-32 of the payload) followed by the
payload, a MessagePack array ``[key, value, [[header_name, header_value], ...]]``.
``<topic>.lock`` holds an exclusive ``flock`` so two producers never share a
spool.

Examples:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from streams.config import KafkaConnection
    >>> from schemas.events import EpisodeStarted
    >>> conn = KafkaConnection(bootstrap_servers="127.0.0.1:1", request_timeout_ms=200)
    >>> spool = Path(tempfile.mkdtemp())
    >>> ev = EpisodeStarted(event_id="e0", episode_id="ep1", seq=0, producer_id="w0",
    ...                     domain="math", task_id="t1", task_spec="{}")
    >>> with EventProducer(conn, "trajpipe.events", spool_dir=spool, connect_timeout_ms=200,
    ...                    delivery_timeout_ms=1000) as producer:
    ...     producer.emit(ev)
    ...     _ = producer.flush()
    ...     producer.stats().spooled
    1
    >>> next(spool.glob("*.spool")).stat().st_size > 8
    True
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import re
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Mapping

import msgspec
from kafka import KafkaProducer
from kafka import errors as kafka_errors
from kafka.partitioner import DefaultPartitioner, Partitioner
from kafka.partitioner.default import murmur2

from schemas.codec import DEFAULT_MAX_EVENT_BYTES, encode_event, kafka_headers
from schemas.events import Event
from schemas.storage import fsync_dir
from streams.config import ConfigError, KafkaConnection
from streams.errors import KafkaAuthError, KafkaUnavailable, access_denied, check_kafka, is_access_denied

__all__ = [
    "KeyHashPartitioner",
    "EventProducer",
    "ProducerStats",
    "SpoolError",
    "SpoolFullError",
    "SpoolLockedError",
    "ProducerClosedError",
    "read_spool",
    "SPOOL_MAGIC",
]

log = logging.getLogger(__name__)

#: First bytes of every spool file.
SPOOL_MAGIC = b"TJSPOOL1"
_FRAME = struct.Struct(">II")
_SPOOL_BUFFER = 1 << 20
#: Replay waits for acks every this many records, so memory stays bounded.
_REPLAY_CHUNK = 20_000
# In-flight sends are reaped (acked ones counted, completed ones dropped) once this many are waiting.
_REAP_AT = 512
#: A flush waits this long past the delivery timeout before it calls the client stuck (_ClientStuck).
_FLUSH_MARGIN_S = 30.0
#: One spool record: (key, value, headers).
_RECORD = msgspec.msgpack.Decoder(tuple[bytes | None, bytes, list[tuple[str, bytes]]])

Header = tuple[str, bytes]


class SpoolError(RuntimeError):
    """The spool file or directory cannot be used."""


class SpoolFullError(SpoolError):
    """The spool could not be written (disk full, quota, file-size limit): events since the last flush are not acknowledged.

    The spool is fail-stop: after one failed write nothing more is appended by
    this producer (a record after a torn one could not be read back), so every
    later :meth:`EventProducer.emit` and :meth:`EventProducer.flush` raises this
    too. What was acknowledged before stays in the spool; a new producer on the
    same ``spool_dir`` drops the torn tail and replays the rest.
    """


class SpoolLockedError(SpoolError):
    """Another producer holds the spool of this topic in this ``spool_dir``."""


class _ClientStuck(RuntimeError):
    """What a send fails with when Kafka's client did not complete it within the delivery timeout and a margin.

    kafka-python completes every send (acked, or failed and so spooled) within
    ``delivery_timeout_ms``; a flush still waiting past that and a margin is the
    client stuck, and waiting on would hang the caller for good. The producer
    drops that client, fails its unfinished sends with this error (their
    errbacks spool them: acknowledged once the spool is synced, a duplicate
    downstream, removed by ``event_id``, where one did reach Kafka) and replays
    the spool through a new client.
    """


class KeyHashPartitioner(Partitioner):
    """kafka-python's default partitioner for keyed records, with each key's hash remembered.

    The partition is the Java client's (and kafka-python's :class:`DefaultPartitioner`'s):
    ``sorted(partitions)[(murmur2(key) & 0x7fffffff) % len(partitions)]``, so one episode's
    events land where any Kafka producer would put them. kafka-python computes murmur2 in pure
    Python for every record and sorts the topic's partitions each time; an episode's ~10 events
    share one key, so the hash is kept per key (at most ``max_keys``; the table is cleared when
    full) and the sorted partitions per topic and partition count. Unkeyed records go to
    :class:`DefaultPartitioner` (random among available partitions). Measured in ``make bench``
    ``producer`` (the profile: partitioning was ~1/7 of ``KafkaProducer.send``).

    Examples:
        >>> class Meta:  # the two ClusterMetadata calls a partitioner makes
        ...     def topics(self): return {"t"}
        ...     def partitions_for_topic(self, topic): return {0, 1, 2, 3}
        ...     def available_partitions_for_topic(self, topic): return {0, 1, 2, 3}
        >>> keys = [f"ep-{i}".encode() for i in range(50)]
        >>> ours, theirs = KeyHashPartitioner(), DefaultPartitioner()
        >>> [ours.partition("t", None, k, None, None, Meta()) for k in keys] == \\
        ...     [theirs.partition("t", None, k, None, None, Meta()) for k in keys]
        True
    """

    def __init__(self, max_keys: int = 1 << 16) -> None:
        self._default = DefaultPartitioner()
        self._hashes: dict[bytes, int] = {}
        self._sorted: dict[str, tuple[int, list[int]]] = {}
        self._max_keys = max_keys

    def partition(self, topic: str, key: Any, serialized_key: bytes | None, value: Any, serialized_value: Any,
                  cluster: Any) -> int:
        if serialized_key is None:
            return self._default.partition(topic, key, serialized_key, value, serialized_value, cluster)
        partitions = cluster.partitions_for_topic(topic)
        if partitions is None:
            raise ValueError(f"Topic {topic} not found in ClusterMetadata")
        known = self._sorted.get(topic)
        if known is None or known[0] != len(partitions):
            known = self._sorted[topic] = (len(partitions), sorted(partitions))
        h = self._hashes.get(serialized_key)
        if h is None:
            if len(self._hashes) >= self._max_keys:
                self._hashes.clear()
            h = self._hashes[serialized_key] = murmur2(serialized_key) & 0x7FFFFFFF
        return known[1][h % known[0]]


class ProducerClosedError(RuntimeError):
    """``emit`` or ``flush`` called after ``close``."""


class ProducerStats(msgspec.Struct, frozen=True):
    """Counters of one :class:`EventProducer`.

    Attributes:
        sent: events acked by Kafka on their first send.
        spooled: events appended to the spool (on failure or while spooling).
        replayed: spooled events acked by Kafka during a completed replay.
        pending: events in the spool right now, not yet replayed.
        send_errors: failed send attempts (each also spooled, or kept spooled).
        idempotent: whether the current Kafka producer is idempotent.
    """

    sent: int
    spooled: int
    replayed: int
    pending: int
    send_errors: int
    idempotent: bool


class _Spool:
    """Append-only, CRC-framed record file with torn-tail recovery.

    Records are buffered in memory (``_SPOOL_BUFFER`` bytes) and written with
    plain ``write`` calls; :meth:`sync` writes the rest and fsyncs. A failed
    write makes the spool fail-stop (:class:`SpoolFullError`): the buffer is
    dropped and the file cut back to its last synced size, so no record can
    ever follow a torn one.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_file = open(path.with_suffix(".lock"), "a+b")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise SpoolLockedError(
                f"spool {path} is in use by another producer; give each producer its own `spool_dir`"
            ) from None
        self._write_lock = threading.Lock()
        self._file: Any = None
        self._buffer = bytearray()
        #: file size after the last successful sync (what a failed write is cut back to)
        self._synced_size = 0
        #: the first write error; once set, the spool is fail-stop (see SpoolFullError)
        self.broken: SpoolFullError | None = None
        #: records in the spool file now; ``appended``: records ever appended by this process.
        self.count = 0
        self.appended = 0
        if path.exists():
            self.count, valid_end = _scan_spool(path)
            size = path.stat().st_size
            if size > valid_end:
                log.warning(
                    "spool %s: dropping a torn tail of %d bytes after %d intact records "
                    "(a crash mid-write; those bytes were never acknowledged)",
                    path, size - valid_end, self.count,
                )
                with open(path, "r+b") as f:
                    f.truncate(valid_end)
                    os.fsync(f.fileno())

    def _open(self) -> Any:
        if self._file is None:
            self._file = open(self.path, "ab", buffering=0)
            self._synced_size = self._file.seek(0, os.SEEK_END)
            if self._synced_size == 0:
                self._buffer += SPOOL_MAGIC
        return self._file

    def append(self, key: bytes | None, value: bytes, headers: list[Header]) -> None:
        payload = msgspec.msgpack.encode((key, value, headers))
        with self._write_lock:
            self._check()
            try:
                self._open()
                self._buffer += _FRAME.pack(len(payload), zlib.crc32(payload))
                self._buffer += payload
                if len(self._buffer) >= _SPOOL_BUFFER:
                    self._write_buffer()
            except OSError as err:
                raise self._fail(err) from err
            self.count += 1
            self.appended += 1

    def sync(self) -> None:
        with self._write_lock:
            self._check()
            if self._file is None:
                return
            try:
                self._write_buffer()
                os.fsync(self._file.fileno())
            except OSError as err:
                raise self._fail(err) from err
            self._synced_size = self._file.tell()

    def _write_buffer(self) -> None:
        view = memoryview(self._buffer)
        done = 0
        try:
            while done < len(view):
                done += self._file.write(view[done:])
        finally:
            view.release()
        del self._buffer[:done]

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken

    def _fail(self, err: OSError) -> SpoolFullError:
        """Make the spool fail-stop after a write error: drop the buffer, cut the file back to its last sync."""
        free = ""
        with contextlib.suppress(OSError):
            st = os.statvfs(self.path.parent)
            free = f", {st.f_bavail * st.f_frsize:,} bytes free"
        self.broken = SpoolFullError(
            f"cannot write the spool {self.path} ({err.strerror or err}{free}): events emitted since the last "
            f"flush are not acknowledged; free space in {self.path.parent} (or give --spool-dir a larger disk) "
            "and run again: what was acknowledged is replayed"
        )
        self._buffer.clear()
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._file.fileno(), self._synced_size)
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        log.error("%s", self.broken)
        return self.broken

    def records(self) -> Iterator[tuple[bytes | None, bytes, list[Header]]]:
        self.sync()
        if not self.path.exists():
            return iter(())
        return read_spool(self.path)

    def clear(self) -> None:
        """Delete the spool file (called only once everything in it is acked)."""
        with self._write_lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            self._buffer.clear()
            self.path.unlink(missing_ok=True)
            fsync_dir(self.path.parent)
            self.count = 0

    def close(self) -> None:
        try:
            self.sync()
            with self._write_lock:
                if self._file is not None:
                    self._file.close()
                    self._file = None
            if self.count == 0:
                self.path.unlink(missing_ok=True)
        finally:
            self._lock_file.close()


def _scan_spool(path: Path) -> tuple[int, int]:
    """Count intact records; return ``(count, byte offset where they end)``."""
    count = 0
    with open(path, "rb") as f:
        magic = f.read(len(SPOOL_MAGIC))
        if magic != SPOOL_MAGIC:
            if len(magic) < len(SPOOL_MAGIC) and SPOOL_MAGIC.startswith(magic):
                return 0, 0  # torn while writing the magic itself
            raise SpoolError(f"{path} is not a trajpipe spool file (magic {magic!r}); move it away")
        end = f.tell()
        for _ in _iter_frames(f):
            count += 1
            end = f.tell()
    return count, end


def _iter_frames(f: Any) -> Iterator[bytes]:
    size = os.fstat(f.fileno()).st_size
    while True:
        head = f.read(_FRAME.size)
        if len(head) < _FRAME.size:
            return
        length, crc = _FRAME.unpack(head)
        if length > size - f.tell():  # torn, or a damaged length: never allocate what the file does not hold
            return
        payload = f.read(length)
        if len(payload) < length or zlib.crc32(payload) != crc:
            return
        yield payload


def read_spool(path: Path) -> Iterator[tuple[bytes | None, bytes, list[Header]]]:
    """Iterate the intact records of a spool file, oldest first.

    A torn or corrupt record ends the iteration (it and anything after it was
    never acknowledged).

    Args:
        path: a ``*.spool`` file written by :class:`EventProducer`.

    Yields:
        ``(key, value, headers)`` of each record.

    Raises:
        SpoolError: the file is not a spool file, or a record that passes its
            CRC is not a ``(key, value, headers)`` record.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> p = Path(tempfile.mkdtemp()) / "x.spool"
        >>> _ = p.write_bytes(SPOOL_MAGIC + b"\\x00\\x00")  # torn frame header
        >>> list(read_spool(p))
        []
    """
    with open(path, "rb") as f:
        magic = f.read(len(SPOOL_MAGIC))
        if magic != SPOOL_MAGIC:
            if len(magic) < len(SPOOL_MAGIC) and SPOOL_MAGIC.startswith(magic):
                return
            raise SpoolError(f"{path} is not a trajpipe spool file (magic {magic!r})")
        for n, payload in enumerate(_iter_frames(f)):
            try:
                key, value, headers = _RECORD.decode(payload)
            except msgspec.DecodeError as err:  # the CRC matched: written so, not torn
                raise SpoolError(f"{path}: record {n} (ends at byte {f.tell()}) passes its CRC but is not a spool "
                                 f"record ({err}); move the file away, the records before it were read") from None
            yield key, value, [(name, hval) for name, hval in headers]


def _spool_name(topic: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", topic) + ".spool"


class EventProducer:
    """Send events to one topic; spool to disk when Kafka is unreachable.

    See the module docstring for what "acknowledged" means, the ordering
    guarantee and the spool format. One producer per ``(spool_dir, topic)``.
    ``emit`` is safe to call from several threads; the healthy path takes no
    lock and makes no system call of its own.

    Args:
        conn: how to reach Kafka (``request_timeout_ms`` is used for requests).
        topic: the topic every event goes to.
        spool_dir: directory of the spool file (created if missing).
        compression_type: Kafka batch compression (``lz4``, ``zstd``, ``gzip``,
            ``snappy`` or None).
        linger_ms: how long a batch waits for more records.
        batch_size: target batch size per partition, bytes.
        max_event_bytes: largest encoded event accepted by :meth:`emit`.
        delivery_timeout_ms: upper bound on the time Kafka's client retries a
            send (kafka-python's own retries with ``retry_backoff_ms``) before
            the event is spooled; must be >= ``linger_ms + conn.request_timeout_ms``.
        retry_backoff_ms: pause between kafka-python's send retries.
        max_block_ms: how long ``emit`` may block on topic metadata before
            spooling instead.
        connect_timeout_ms: how long connecting (bootstrap) may take, at
            construction and before each replay.
        replay_backoff_s: first wait before retrying a failed replay; doubles
            per failure up to ``replay_backoff_max_s``.
        replay_backoff_max_s: longest wait between replay attempts.
        producer_config: extra ``KafkaProducer`` settings (override the above).

    Raises:
        ConfigError: incompatible timeouts or sizes.
        SpoolLockedError: another producer uses this spool.
    """

    def __init__(
        self,
        conn: KafkaConnection,
        topic: str,
        *,
        spool_dir: Path | str,
        compression_type: str | None = "lz4",
        linger_ms: int = 10,
        batch_size: int = 256 * 1024,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        delivery_timeout_ms: int = 60_000,
        retry_backoff_ms: int = 100,
        max_block_ms: int = 5_000,
        connect_timeout_ms: int = 5_000,
        replay_backoff_s: float = 1.0,
        replay_backoff_max_s: float = 30.0,
        producer_config: Mapping[str, Any] | None = None,
    ) -> None:
        if delivery_timeout_ms < linger_ms + conn.request_timeout_ms:
            raise ConfigError(
                f"`delivery_timeout_ms` ({delivery_timeout_ms}) must be >= `linger_ms` ({linger_ms}) + "
                f"`conn.request_timeout_ms` ({conn.request_timeout_ms}); raise it or lower the request timeout"
            )
        if max_event_bytes < 1:
            raise ConfigError(f"`max_event_bytes` must be >= 1, got {max_event_bytes}")
        if replay_backoff_s <= 0 or replay_backoff_max_s < replay_backoff_s:
            raise ConfigError("`replay_backoff_s` must be > 0 and <= `replay_backoff_max_s`")
        self.topic = topic
        self._conn = conn
        self._max_event_bytes = max_event_bytes
        self._connect_timeout_ms = connect_timeout_ms
        self._delivery_timeout_s = delivery_timeout_ms / 1000
        self._backoff_initial = replay_backoff_s
        self._backoff_max = replay_backoff_max_s
        self._backoff = replay_backoff_s
        self._next_replay = 0.0
        self._config: dict[str, Any] = {
            **conn.client_kwargs(),
            "acks": "all",
            "compression_type": compression_type,
            "linger_ms": linger_ms,
            "batch_size": batch_size,
            "max_request_size": max(1 << 20, max_event_bytes + (64 << 10)),
            "delivery_timeout_ms": delivery_timeout_ms,
            "retry_backoff_ms": retry_backoff_ms,
            "max_block_ms": max_block_ms,
            "bootstrap_timeout_ms": connect_timeout_ms,
            "max_in_flight_requests_per_connection": 5,
            "partitioner": KeyHashPartitioner(),
            **(producer_config or {}),
        }
        spool_path = Path(spool_dir)
        spool_path.mkdir(parents=True, exist_ok=True)
        self._spool = _Spool(spool_path / _spool_name(topic))
        self._lock = threading.RLock()
        # Sends not yet seen complete, in emit order: (future, key, value, headers). See `_send`.
        self._inflight: collections.deque[Any] = collections.deque()
        self._reap_lock = threading.Lock()
        self._headers: dict[tuple[str, int], list[Header]] = {}
        self._sent = 0
        self._replayed = 0
        self._send_errors = 0
        self._replay_failures: list[BaseException] = []
        self._denied: BaseException | None = None  # an ACL refused a send: flush() raises, events stay spooled
        self._closed = False
        self.idempotent = False
        # `_degraded` is the one flag the hot path checks: True while spooling,
        # or once a send failed and the switch to spooling is due.
        self._spooling = self._spool.count > 0
        self._degraded = self._spooling
        self._producer: KafkaProducer | None = None
        if self._spooling:
            log.info("spool %s holds %d events from an earlier run; replaying", self._spool.path, self._spool.count)
        try:
            self._producer = self._connect()
        except KafkaAuthError:
            self._spool.close()
            raise
        if self._producer is None:
            self._enter_spooling("broker unreachable at start")
        elif self._spooling:
            self._replay()

    # -- public API ---------------------------------------------------------

    def emit(self, event: Event) -> None:
        """Send one event (asynchronously); spool it if Kafka is unreachable.

        Returning from ``emit`` does not acknowledge the event; :meth:`flush` does.

        Args:
            event: the event; its ``episode_id`` is the message key.

        Raises:
            schemas.codec.EventEncodeError: the event cannot be encoded or is
                larger than ``max_event_bytes`` (nothing was sent or spooled).
            ProducerClosedError: the producer is closed.
        """
        value = encode_event(event, max_bytes=self._max_event_bytes)
        hkey = (event.event_type, event.schema_version)
        headers = self._headers.get(hkey)
        if headers is None:
            headers = self._headers[hkey] = kafka_headers(event)
        self._send(event.episode_id.encode(), value, headers)

    def emit_raw(self, key: bytes | None, value: bytes, headers: list[Header] | None = None) -> None:
        """Send pre-encoded bytes with the same spool guarantees as :meth:`emit`.

        For records that are not events (e.g. dead letters on their own topic).

        Args:
            key: message key (None lets Kafka pick the partition).
            value: message value.
            headers: Kafka record headers, ``(name, bytes)`` pairs.

        Raises:
            ConfigError: ``value`` is larger than ``max_event_bytes``.
            ProducerClosedError: the producer is closed.
        """
        if len(value) > self._max_event_bytes:
            raise ConfigError(f"value is {len(value)} bytes, over `max_event_bytes` ({self._max_event_bytes})")
        self._send(key, value, headers or [])

    def flush(self) -> ProducerStats:
        """Make every event emitted so far acknowledged (acked by Kafka or fsync'ed in the spool).

        Waits for in-flight sends (at most about ``delivery_timeout_ms``; sends
        that fail are spooled). If the spool holds events, this also tries once
        to replay them, ignoring the replay backoff timer: ``flush`` is the
        caller's sync point.

        Returns:
            The counters after the flush.

        Raises:
            ProducerClosedError: the producer is closed.
            streams.errors.KafkaAccessDenied: the broker refused a send for want of an
                ACL (the refused events are in the spool, and replay once it is granted).
        """
        with self._lock:
            if self._closed:
                raise ProducerClosedError("flush() after close()")
            self._flush_locked()
            if self._denied is not None:
                raise access_denied(self._conn, what=f"write to topic {self.topic!r}", err=self._denied)
        return self.stats()

    def close(self) -> int:
        """Flush (including one replay try), then release the Kafka client and the spool.

        Returns:
            How many events remain spooled on disk (0 when everything reached
            Kafka); a new producer on the same ``spool_dir`` replays them.
        """
        with self._lock:
            if self._closed:
                return self._spool.count
            try:
                self._flush_locked()
            finally:
                self._closed = True
                self._close_kafka()
                self._spool.close()
        pending = self._spool.count
        if pending:
            log.warning("closed with %d events spooled in %s; they replay when a producer reopens it",
                        pending, self._spool.path)
        return pending

    def stats(self) -> ProducerStats:
        """The producer's counters (see :class:`ProducerStats`)."""
        return ProducerStats(
            sent=self._sent,
            spooled=self._spool.appended,
            replayed=self._replayed,
            pending=self._spool.count,
            send_errors=self._send_errors,
            idempotent=self.idempotent,
        )

    @property
    def spool_path(self) -> Path:
        """The spool file (it may not exist while nothing is spooled)."""
        return self._spool.path

    @property
    def spooling(self) -> bool:
        """Whether new events currently go to the spool."""
        return self._spooling

    def __enter__(self) -> EventProducer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- hot path ------------------------------------------------------------

    def _send(self, key: bytes | None, value: bytes, headers: list[Header]) -> None:
        """Hand one record to kafka-python; a failure spools it from its errback.

        Acks are not counted with a per-record callback: that is a Python call per record on
        kafka-python's sender thread, competing with ``emit`` for the GIL. The record's future
        goes on ``_inflight`` instead and :meth:`_reap` counts the completed ones from the left
        (here once ``_REAP_AT`` are waiting, in :meth:`flush` all of them). Failures keep their
        errback: it fires on the sender thread as soon as the send fails, so the switch to the
        spool does not wait for the next reap or flush.
        """
        producer = self._producer
        if self._degraded or producer is None:
            self._emit_degraded(key, value, headers)
            return
        try:
            future = producer.send(self.topic, value=value, key=key, headers=headers)
        except kafka_errors.KafkaTimeoutError as err:  # no topic metadata within max_block_ms
            self._send_errors += 1
            self._degraded = True
            log.warning("no metadata for %s (%s); spooling", self.topic, err)
            self._emit_degraded(key, value, headers)
            return
        except kafka_errors.IllegalStateError:  # closed by another thread switching to the spool
            self._emit_degraded(key, value, headers)
            return
        future.add_errback(self._on_error, key, value, headers)
        inflight = self._inflight
        inflight.append(future)
        if len(inflight) >= _REAP_AT and self._reap_lock.acquire(blocking=False):
            try:
                self._reap()
            finally:
                self._reap_lock.release()

    def _reap(self) -> None:
        """Drop completed sends from the left of ``_inflight``, counting the acked ones (``sent``).

        Stops at the first send not yet done. Failed ones were spooled by their errback.
        Callers hold ``_reap_lock``.
        """
        inflight = self._inflight
        while inflight:
            future = inflight[0]
            if not future.is_done:
                return
            if future.exception is None:
                self._sent += 1
            inflight.popleft()

    def _reap_all(self) -> None:
        """After kafka-python's flush or close: count every completed send; forget the rest.

        A send still not done after the client closed never completes through this producer;
        its errback, if kafka-python fails it later, spools it.
        """
        with self._reap_lock:
            self._reap()
            self._inflight.clear()

    # -- callbacks (kafka-python's sender thread) --------------------------------------------------------------

    def _on_error(self, key: bytes | None, value: bytes, headers: list[Header], err: BaseException) -> None:
        if self._closed:  # after close() every send is done (a stuck client's were failed): cannot happen
            log.warning("a send to %s failed after the producer closed (%s); not spooled", self.topic, err)
            return
        self._send_errors += 1
        self._degraded = True
        if is_access_denied(err):
            self._denied = err
        self._spool.append(key, value, headers)
        if self._send_errors == 1 or self._send_errors % 1000 == 0:
            log.warning("send to %s failed (%s: %s); spooling to %s", self.topic, type(err).__name__, err,
                        self._spool.path)

    def _on_replay_error(self, err: BaseException) -> None:
        if is_access_denied(err):
            self._denied = err
        self._replay_failures.append(err)

    # -- slow paths ----------------------------------------------------------

    def _emit_degraded(self, key: bytes | None, value: bytes, headers: list[Header]) -> None:
        with self._lock:
            if self._closed:
                raise ProducerClosedError("emit() after close()")
            if not self._spooling:
                self._drain_and_spool("send failed")
            self._spool.append(key, value, headers)
            if time.monotonic() >= self._next_replay:
                self._try_replay()

    def _flush_locked(self) -> None:
        if self._producer is not None and not self._spooling:
            self._flush_kafka()
            self._reap_all()
            if self._degraded:
                self._drain_and_spool("send failed")
        if self._spooling:
            self._try_replay()
        self._spool.sync()

    def _flush_kafka(self) -> None:
        """kafka-python's flush, bounded: a client stuck past the bound is dropped, its unfinished sends spooled.

        See :class:`_ClientStuck`. Without the bound a client that never completed a send (a
        sender thread that died, a bug of the client's) held ``flush`` and so its caller forever.
        """
        assert self._producer is not None
        bound = self._delivery_timeout_s + _FLUSH_MARGIN_S
        try:
            self._producer.flush(timeout=bound)
            return
        except kafka_errors.KafkaTimeoutError:
            pass
        self._degraded = True  # emits from now on take the lock (held here) and then the spool
        err = _ClientStuck(f"Kafka's client did not complete the send within {bound:g} s (the delivery timeout "
                           f"and {_FLUSH_MARGIN_S:g} s)")
        stuck = [f for f in tuple(self._inflight) if not f.is_done]
        log.warning("Kafka's client did not complete %d sends to %s within %g s (the delivery timeout and %g s): "
                    "it is dropped, they are spooled and replay through a new client", len(stuck), self.topic, bound,
                    _FLUSH_MARGIN_S)
        for future in stuck:
            future.failure(err)  # its errback spools the record
        self._close_kafka()
        for future in tuple(self._inflight):  # sent by an emit that raced the switch
            if not future.is_done:
                future.failure(err)

    def _drain_and_spool(self, why: str) -> None:
        """Wait for in-flight sends (failures spool themselves), then spool everything new."""
        if self._producer is not None:
            self._flush_kafka()
            self._close_kafka()
        self._reap_all()
        self._enter_spooling(why)

    def _close_kafka(self) -> None:
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.close(timeout=0)
        except kafka_errors.KafkaTimeoutError:
            # Sends not done: kafka-python's close() flushes first and raises, and its __del__ would flush and
            # raise again at exit. Marked closed (a racing emit's send then raises IllegalStateError and
            # spools), it is left to its (daemon) sender thread: its unfinished sends were failed into the
            # spool (_flush_kafka, a stuck client) or are replays of a spool that is kept whole (_replay).
            producer._closed = True
        except kafka_errors.KafkaError as err:
            log.debug("closing the Kafka producer: %s", err)

    def _enter_spooling(self, why: str) -> None:
        self._spooling = True
        self._degraded = True
        self._next_replay = time.monotonic() + self._backoff
        log.warning("%s: spooling events for %s to %s", why, self.topic, self._spool.path)

    def _try_replay(self) -> None:
        if not self._reachable():
            self._schedule_retry()
            return
        if self._producer is None:
            try:
                self._producer = self._connect()
            except KafkaAuthError as err:  # e.g. a password changed mid-run: keep spooling, say why
                log.error("replay of %s: %s", self._spool.path, err)
                self._producer = None
            if self._producer is None:
                self._schedule_retry()
                return
        self._replay()

    def _schedule_retry(self) -> None:
        self._next_replay = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self._backoff_max)

    def _replay(self) -> None:
        """Send the spool in order; delete it only when every record is acked."""
        assert self._producer is not None
        producer = self._producer
        self._replay_failures = []
        n = 0
        try:
            for key, value, headers in self._spool.records():
                producer.send(self.topic, value=value, key=key, headers=headers).add_errback(self._on_replay_error)
                n += 1
                if n % _REPLAY_CHUNK == 0:
                    producer.flush(timeout=self._delivery_timeout_s + 5)
                    if self._replay_failures:
                        break
            producer.flush(timeout=self._delivery_timeout_s + 5)
        except kafka_errors.KafkaError as err:
            self._on_replay_error(err)
        if self._replay_failures:
            log.warning("replay of %s failed after %d records (%s); the whole spool stays and is retried "
                        "(duplicates are removed downstream by event_id)",
                        self._spool.path, n, self._replay_failures[0])
            self._close_kafka()
            self._schedule_retry()
            return
        self._replayed += n
        self._spool.clear()
        self._spooling = False
        self._degraded = False
        self._backoff = self._backoff_initial
        log.info("replayed %d spooled events to %s", n, self.topic)

    def _reachable(self) -> bool:
        """Cheap TCP probe of the bootstrap servers, so a down broker costs ms, not a timeout."""
        timeout = min(self._connect_timeout_ms / 1000, 2.0)
        for server in self._conn.servers:
            host, _, port = server.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
                return True
            except OSError:
                continue
        return False

    def _connect(self) -> KafkaProducer | None:
        """Build a Kafka producer, idempotent if the broker allows; None if unreachable.

        Raises:
            streams.errors.KafkaAuthError: the broker refused this client (TLS, SASL): spooling
                would not help, and would hide the cause.
        """
        try:
            check_kafka(msgspec.structs.replace(self._conn, connect_timeout_s=self._connect_timeout_ms / 1000))
        except KafkaUnavailable as err:
            log.warning("%s", err)
            return None
        try:
            try:
                producer = KafkaProducer(enable_idempotence=True, **self._config)
                self.idempotent = True
            except (kafka_errors.KafkaConfigurationError, kafka_errors.UnsupportedVersionError) as err:
                log.warning("broker does not support idempotent producers (%s); using acks=all without", err)
                producer = KafkaProducer(enable_idempotence=False, **self._config)
                self.idempotent = False
        except (kafka_errors.KafkaTimeoutError, kafka_errors.KafkaConnectionError) as err:
            log.warning("cannot reach Kafka at %s: %s", self._conn.bootstrap_servers, err)
            return None
        return producer
