"""EventProducer against real brokers: round trip, spool when unreachable, replay, torn tails."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import pytest

from schemas.codec import EventEncodeError, decode_event
from schemas.events import Step
from streams.admin import ensure_topics
from streams.broker import start_broker, stop_broker
from streams.config import ConfigError, KafkaConnection, Topics
from streams.producer import EventProducer, ProducerClosedError, SpoolLockedError, read_spool
from tests.helpers import free_port
from tests.streams.conftest import assert_episode_order, make_events, read_all

pytestmark = pytest.mark.integration

# Short timeouts so outages are noticed in seconds, not minutes.
FAST = dict(delivery_timeout_ms=3_000, connect_timeout_ms=1_000, max_block_ms=1_000, replay_backoff_s=0.2,
            replay_backoff_max_s=1.0)


def _dead_conn() -> KafkaConnection:
    """A bootstrap address nobody listens on."""
    return KafkaConnection(bootstrap_servers=f"127.0.0.1:{free_port()}", request_timeout_ms=1_000)


def test_round_trip_exact_counts_and_episode_order(conn, topics, tmp_path):
    ensure_topics(conn, topics)
    events = make_events(episodes=20, steps=10)
    with EventProducer(conn, topics.events, spool_dir=tmp_path) as producer:
        for ev in events:
            producer.emit(ev)
        stats = producer.flush()
    assert (stats.sent, stats.spooled, stats.pending) == (200, 0, 0)
    records = read_all(conn, topics.events)
    assert len(records) == 200
    seqs = assert_episode_order(records)
    assert seqs == {f"ep-{e}": list(range(10)) for e in range(20)}
    assert dict(records[0].headers)["trajpipe-schema"] in (b"episode_started", b"step")
    assert {decode_event(r.value).event_id for r in records} == {ev.event_id for ev in events}
    assert not producer.spool_path.exists()
    # each episode on the partition any Kafka producer's default partitioner picks (murmur2 of the key)
    from kafka.partitioner.default import murmur2

    n = len({r.partition for r in records})
    assert n == topics.partitions and all(r.partition == (murmur2(r.key) & 0x7FFFFFFF) % n for r in records)


def test_spool_when_unreachable_from_start_then_replay(tansu_broker, topics, tmp_path):
    events = make_events(episodes=5, steps=10)
    down = EventProducer(_dead_conn(), topics.events, spool_dir=tmp_path, **FAST)
    assert down.spooling
    for ev in events[:30]:
        down.emit(ev)
    stats = down.flush()
    assert (stats.sent, stats.spooled, stats.pending) == (0, 30, 30)
    assert len(list(read_spool(down.spool_path))) == 30  # fsync'ed: readable by anyone now
    assert down.close() == 30

    live = KafkaConnection(bootstrap_servers=tansu_broker.bootstrap, request_timeout_ms=2_000)
    ensure_topics(live, topics)
    with EventProducer(live, topics.events, spool_dir=tmp_path, **FAST) as up:
        assert up.stats().replayed == 30 and not up.spooling  # replayed at construction
        for ev in events[30:]:
            up.emit(ev)
        stats = up.flush()
    assert (stats.sent, stats.replayed, stats.pending) == (20, 30, 0)
    assert not up.spool_path.exists()
    records = read_all(live, topics.events)
    assert len(records) == 50
    assert assert_episode_order(records) == {f"ep-{e}": list(range(10)) for e in range(5)}


@pytest.mark.slow
def test_spool_and_replay_across_kafka_restart(tmp_path):
    """Stop a real Kafka broker mid-stream, keep emitting, restart it: every event arrives once."""
    port = free_port(restartable=True)
    data_dir = tmp_path / "broker"
    info = start_broker(engine="kafka", port=port, data_dir=data_dir)
    try:
        conn = KafkaConnection(bootstrap_servers=info.bootstrap, request_timeout_ms=1_500)
        topics = Topics(events="restart.events", dead_letters="restart.dl", control="restart.ctl", partitions=3)
        ensure_topics(conn, topics)
        events = make_events(episodes=10, steps=30)  # 300 events, seq 0..29 per episode
        stopped = threading.Event()
        producer = EventProducer(conn, topics.events, spool_dir=tmp_path / "spool", **FAST)
        for i, ev in enumerate(events):
            producer.emit(ev)
            if i == 100:
                producer.flush()
                assert producer.stats().sent == 101
                stop_broker(data_dir)
                stopped.set()
            if i == 150:  # a worker keeps producing through the outage until a send has failed (delivery timeout)
                deadline = time.monotonic() + 120  # a failure bound only
                while producer.stats().send_errors == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
        assert producer.spooling  # the outage was noticed while emitting
        stats = producer.flush()  # broker still down: everything unsent is fsync'ed in the spool
        assert stats.pending > 0 and stats.sent + stats.pending == 300

        start_broker(engine="kafka", port=port, data_dir=data_dir)
        stats = producer.flush()
        assert stats.pending == 0 and not producer.spooling
        assert stats.sent + stats.replayed == 300
        assert producer.close() == 0

        records = read_all(conn, topics.events)
        ids = [decode_event(r.value).event_id for r in records]
        assert len(set(ids)) == 300 and set(ids) == {ev.event_id for ev in events}
        assert len(records) == 300, "duplicates arrived"
        assert assert_episode_order(records) == {f"ep-{e}": list(range(30)) for e in range(10)}
    finally:
        stop_broker(data_dir)


def test_torn_spool_tail_is_ignored(tansu_broker, topics, tmp_path):
    events = make_events(episodes=1, steps=5)
    with EventProducer(_dead_conn(), topics.events, spool_dir=tmp_path, **FAST) as down:
        for ev in events:
            down.emit(ev)
    spool = down.spool_path
    intact = spool.stat().st_size
    with open(spool, "ab") as f:  # a crash mid-write: frame says 500 bytes, only 7 made it
        f.write(struct.pack(">II", 500, 12345) + b"partial")
    assert len(list(read_spool(spool))) == 5

    down = EventProducer(_dead_conn(), topics.events, spool_dir=tmp_path, **FAST)
    assert down.stats().pending == 5 and spool.stat().st_size == intact  # tail cut on open
    down.emit(make_events(episodes=1, steps=6)[5])  # appends after the intact records
    down.close()
    with open(spool, "ab") as f:  # a corrupt last record: right length, wrong CRC
        f.write(struct.pack(">II", 3, 0) + b"abc")
    assert len(list(read_spool(spool))) == 6

    live = KafkaConnection(bootstrap_servers=tansu_broker.bootstrap, request_timeout_ms=2_000)
    ensure_topics(live, topics)
    with EventProducer(live, topics.events, spool_dir=tmp_path, **FAST) as up:
        assert up.stats().replayed == 6
    records = read_all(live, topics.events)
    assert [decode_event(r.value).seq for r in records] == [0, 1, 2, 3, 4, 5]


def test_oversize_event_is_refused_not_spooled(tmp_path):
    big = Step(event_id="e", episode_id="ep", seq=1, producer_id="w", domain="math", task_id="t",
               step_index=0, tool_result="x" * 5000)
    with EventProducer(_dead_conn(), "t", spool_dir=tmp_path, max_event_bytes=1000, **FAST) as producer:
        with pytest.raises(EventEncodeError, match="max_event_bytes"):
            producer.emit(big)
        assert producer.flush().spooled == 0


def test_one_producer_per_spool(tmp_path):
    with EventProducer(_dead_conn(), "t", spool_dir=tmp_path, **FAST):
        with pytest.raises(SpoolLockedError):
            EventProducer(_dead_conn(), "t", spool_dir=tmp_path, **FAST)


def test_checks_timeouts_up_front(tmp_path):
    with pytest.raises(ConfigError, match="delivery_timeout_ms"):
        EventProducer(KafkaConnection(request_timeout_ms=30_000), "t", spool_dir=tmp_path, delivery_timeout_ms=1000)


def test_use_after_close(tmp_path):
    producer = EventProducer(_dead_conn(), "t", spool_dir=tmp_path, **FAST)
    assert producer.close() == 0 and producer.close() == 0
    with pytest.raises(ProducerClosedError):
        producer.emit(make_events(1, 1)[0])
    with pytest.raises(ProducerClosedError):
        producer.flush()
    assert not Path(producer.spool_path).exists()


def test_a_frame_length_claiming_4_gib_is_a_torn_tail_not_a_4_gib_read(tmp_path):
    # Found by the fuzzer (tests/streams/test_spool_fuzz.py): `f.read(length)` allocates the claimed length
    # before reading, so one damaged frame header made every read of the spool allocate up to 4 GiB.
    import tracemalloc
    import zlib

    import msgspec

    from streams.producer import SPOOL_MAGIC, _scan_spool

    record = msgspec.msgpack.encode((b"ep", b"value", [("h", b"1")]))
    good = struct.pack(">II", len(record), zlib.crc32(record)) + record
    path = tmp_path / "x.spool"
    path.write_bytes(SPOOL_MAGIC + good + struct.pack(">II", 0xFFFFFFFF, 0) + b"rest of a torn record")
    tracemalloc.start()
    try:
        assert list(read_spool(path)) == [(b"ep", b"value", [("h", b"1")])]
        assert _scan_spool(path) == (1, len(SPOOL_MAGIC) + len(good))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_crc_valid_frame_that_is_not_a_record_is_a_spool_error(tmp_path):
    # Found by the fuzzer: such a frame raised ValueError/TypeError/msgspec.DecodeError out of the replay.
    import zlib

    import msgspec

    from streams.producer import SPOOL_MAGIC, SpoolError

    path = tmp_path / "x.spool"
    for payload in (b"", msgspec.msgpack.encode(7), msgspec.msgpack.encode([b"k", 3, []])):
        path.write_bytes(SPOOL_MAGIC + struct.pack(">II", len(payload), zlib.crc32(payload)) + payload)
        with pytest.raises(SpoolError, match="passes its CRC but is not a spool record"):
            list(read_spool(path))


_FULL_SPOOL_SCRIPT = r"""
import resource, signal, sys
from pathlib import Path
from streams.config import KafkaConnection
from streams.producer import EventProducer, SpoolFullError
from tests.streams.conftest import make_events

spool, port = Path(sys.argv[1]), sys.argv[2]
conn = KafkaConnection(bootstrap_servers=f"127.0.0.1:{port}", request_timeout_ms=1_000)
events = make_events(episodes=40, steps=10)
producer = EventProducer(conn, "t", spool_dir=spool, delivery_timeout_ms=3_000, connect_timeout_ms=200)
for ev in events[:30]:
    producer.emit(ev)
producer.flush()  # 30 events acknowledged (fsync'ed in the spool)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit as a full disk: writes fail with EFBIG
size = next(spool.glob("*.spool")).stat().st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 3000, resource.RLIM_INFINITY))
errors = []
for ev in events[30:]:
    try:
        producer.emit(ev)
    except SpoolFullError as err:
        errors.append(err)
try:
    producer.flush()
except SpoolFullError as err:
    errors.append(err)
# The disk has room again: a record written now would follow a torn one and be lost on read, so the spool
# stays fail-stop (nothing more is appended, flush keeps failing: nothing more is acknowledged).
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
for ev in events[:5]:
    try:
        producer.emit(ev)
    except SpoolFullError as err:
        errors.append(err)
try:
    producer.close()
except SpoolFullError as err:
    errors.append(err)
print(len(errors), str(errors[0]))
"""


def test_full_spool_disk_fails_clearly_and_keeps_what_was_acknowledged(tmp_path):
    """A full spool disk (here a file-size limit) raises SpoolFullError at once, on every later emit and flush,
    and leaves the spool readable: the events acknowledged before are all there, nothing after a torn record."""
    import subprocess
    import sys

    spool = tmp_path / "spool"
    proc = subprocess.run([sys.executable, "-c", _FULL_SPOOL_SCRIPT, str(spool), str(free_port())],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    n_errors, message = proc.stdout.strip().split(" ", 1)
    assert int(n_errors) >= 7 and "not acknowledged" in message and "free space" in message, proc.stdout
    records = list(read_spool(next(spool.glob("*.spool"))))
    first = make_events(episodes=40, steps=10)[:30]
    assert [decode_event(v).event_id for _, v, _ in records[:30]] == [ev.event_id for ev in first]
    # A new producer drops nothing acknowledged and replays only intact records.
    with EventProducer(_dead_conn(), "t", spool_dir=spool, **FAST) as producer:
        assert producer.stats().pending == len(records) >= 30


def test_a_client_that_never_completes_its_sends_is_dropped_and_its_sends_spooled_not_waited_on_forever(
        tansu_broker, topics, tmp_path, monkeypatch):
    """kafka-python promises every send done (acked or failed) within the delivery timeout; were a send never
    done, the unbounded flush waited forever. Here the client's batches are never completed (their ``done`` is a
    no-op, the broker real): past the delivery timeout and a margin the flush drops the client and spools the
    unfinished sends, acknowledged there; they reach Kafka through a new client once one completes its sends."""
    import streams.producer as producer_mod
    from kafka.producer.producer_batch import ProducerBatch

    live = KafkaConnection(bootstrap_servers=tansu_broker.bootstrap, request_timeout_ms=1_000)
    ensure_topics(live, topics)
    events = make_events(episodes=2, steps=5)
    producer = EventProducer(live, topics.events, spool_dir=tmp_path, **{**FAST, "delivery_timeout_ms": 1_500})
    producer.emit(events[0])
    assert producer.flush().sent == 1
    with monkeypatch.context() as stuck:
        stuck.setattr(producer_mod, "_FLUSH_MARGIN_S", 0.5)
        stuck.setattr(ProducerBatch, "done", lambda self, *a, **kw: False)  # no client completes a send
        for ev in events[1:5]:
            producer.emit(ev)
        t0 = time.monotonic()
        stats = producer.flush()  # gives up on the client, spools; the replay's new client is stuck too
        assert time.monotonic() - t0 < 30
        assert (stats.sent, stats.spooled, stats.pending) == (1, 4, 4) and producer.spooling
        spooled = [decode_event(value).event_id for _, value, _ in read_spool(producer.spool_path)]
        assert spooled == [ev.event_id for ev in events[1:5]]  # acknowledged: fsync'ed in the spool, in order
    for ev in events[5:]:
        producer.emit(ev)
    stats = producer.flush()  # a working client now: the spool replays, then what came since
    assert (stats.pending, stats.replayed) == (0, 9)
    assert producer.close() == 0
    got = [decode_event(r.value).event_id for r in read_all(live, topics.events)]
    assert set(got) == {ev.event_id for ev in events}  # each at least once (the stuck ones may come twice)
