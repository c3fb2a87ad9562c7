"""PartitionReader / read_partition against real Kafka and Tansu brokers: the same records a consumer reads."""

from __future__ import annotations

import pytest
from kafka import KafkaProducer

from streams.admin import ensure_topics
from streams.broker import start_broker, stop_broker
from streams.config import KafkaConnection, Topics
from streams.consumer import OffsetRange, ReadStalledError, end_offsets, ranges_from, read_range
from streams.fetch import OffsetOutOfRangeError, PartitionReader, read_partition
from tests.helpers import free_port

pytestmark = pytest.mark.integration


def _produce_raw(conn: KafkaConnection, topic: str, n: int, **producer_kw) -> None:
    producer = KafkaProducer(**conn.client_kwargs(), linger_ms=20, **producer_kw)
    for i in range(n):
        key = None if i % 7 == 3 else f"ep-{i % 5}".encode()  # some records without a key
        value = None if i % 11 == 5 and key is not None else (b"v%05d" % i) * (1 + i % 40)  # tombstones, varied sizes
        producer.send(topic, key=key, value=value, timestamp_ms=1_700_000_000_000 + i)
    producer.flush()
    producer.close()


def _consumer_view(conn, ranges):
    return sorted((r.partition, r.offset, r.key, r.value, r.timestamp) for b in read_range(conn, ranges) for r in b)


def _reader_view(conn, ranges, **kw):
    with PartitionReader(conn, **kw) as reader:
        return sorted((c.partition, o, k, v, t) for r in ranges for c in read_partition(reader, r, stall_timeout_s=10)
                      for o, k, v, t in zip(c.offsets, c.keys, c.values, c.timestamps_ms))


@pytest.mark.parametrize("compression", [None, "gzip", "snappy", "lz4", "zstd"])
def test_reader_returns_what_a_consumer_reads(conn, topics, compression):
    ensure_topics(conn, topics)
    _produce_raw(conn, topics.events, 400, compression_type=compression)
    ranges = ranges_from(topic=topics.events, start={}, end=end_offsets(conn, topics.events))
    expected = _consumer_view(conn, ranges)
    assert len(expected) == 400
    # Small fetches: many round trips, batches cut at the fetch limit.
    assert _reader_view(conn, ranges, max_partition_fetch_bytes=2_000) == expected
    assert _reader_view(conn, ranges) == expected


def test_reader_receives_large_fetches_in_few_calls(conn, topics, monkeypatch):
    """The reader's connections take up to 1 MiB a recv (kafka-python's own take 4 KiB: ~10^4 Python calls for
    the ~40 MB here); the records are the consumer's, byte for byte."""
    import os

    import streams.fetch as fetch

    calls, received = [], []

    def counting(transport):
        data, err = recv(transport)
        calls.append(len(data)), received.append(err)
        return data, err

    recv = fetch._recv_large
    monkeypatch.setattr(fetch, "_recv_large", counting)
    ensure_topics(conn, topics)
    producer = KafkaProducer(**conn.client_kwargs(), linger_ms=20, batch_size=1 << 20, max_request_size=8 << 20)
    for i in range(400):
        producer.send(topics.events, key=b"one-key", value=os.urandom(100_000))  # one partition, incompressible
    producer.flush()
    producer.close()
    ranges = ranges_from(topic=topics.events, start={}, end=end_offsets(conn, topics.events))
    expected = _consumer_view(conn, ranges)
    assert len(expected) == 400
    assert _reader_view(conn, ranges) == expected
    assert sum(calls) >= 40_000_000 and len(calls) < 40_000_000 / 65_536, (len(calls), sum(calls))
    assert received.count(None) == len(received)  # no error on the way


def test_reader_slices_start_and_end_inside_batches(conn, topics):
    ensure_topics(conn, topics)
    _produce_raw(conn, topics.events, 300, compression_type="lz4")  # multi-record batches
    end = end_offsets(conn, topics.events)
    p = max(end, key=end.get)
    r = OffsetRange(topic=topics.events, partition=p, start=3, end=end[p] - 4)
    got = _reader_view(conn, [r])
    assert [o for _, o, *_ in got] == list(range(3, end[p] - 4))
    assert got == _consumer_view(conn, [r])


def test_reader_steps_over_transaction_markers(kafka_broker, topics):
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=5_000)
    ensure_topics(conn, Topics(events=topics.events, dead_letters=topics.dead_letters, control=topics.control,
                               partitions=1))
    producer = KafkaProducer(**conn.client_kwargs(), transactional_id=f"{topics.events}-tx")
    producer.init_transactions()
    for txn in range(3):
        producer.begin_transaction()
        for i in range(10):
            producer.send(topics.events, key=b"ep", value=b"t%d-%d" % (txn, i))
        producer.commit_transaction()
    producer.close()
    end = end_offsets(conn, topics.events)
    assert end[0] == 33  # 30 records + 3 commit markers
    ranges = ranges_from(topic=topics.events, start={}, end=end)
    got = _reader_view(conn, ranges)
    assert [v for *_, v, _ in got] == [b"t%d-%d" % (t, i) for t in range(3) for i in range(10)]
    assert got == _consumer_view(conn, ranges)


def test_offset_outside_the_log_is_a_typed_error(kafka_broker, topics):
    # Kafka answers OFFSET_OUT_OF_RANGE; Tansu answers such a fetch with no records (the stall path below).
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=5_000)
    ensure_topics(conn, topics)
    _produce_raw(conn, topics.events, 30)
    end = end_offsets(conn, topics.events)
    p = max(end, key=end.get)
    with PartitionReader(conn) as reader, pytest.raises(OffsetOutOfRangeError, match="archive"):
        reader.fetch(topics.events, p, end[p] + 1000)


def test_range_past_the_end_stalls_with_the_resume_point(conn, topics):
    ensure_topics(conn, topics)
    _produce_raw(conn, topics.events, 30)
    end = end_offsets(conn, topics.events)
    p = max(end, key=end.get)
    r = OffsetRange(topic=topics.events, partition=p, start=0, end=end[p] + 5)
    seen = []
    with PartitionReader(conn, max_wait_ms=50) as reader, pytest.raises(ReadStalledError) as info:
        for chunk in read_partition(reader, r, stall_timeout_s=1.5):
            seen += chunk.offsets
    assert seen == list(range(end[p]))
    assert info.value.remaining == [OffsetRange(topic=topics.events, partition=p, start=end[p], end=end[p] + 5)]


def test_broker_gone_mid_read_stalls_instead_of_hanging(tmp_path, topic_name):
    data_dir = tmp_path / "tansu"
    info = start_broker(engine="tansu", port=free_port(), data_dir=data_dir)
    conn = KafkaConnection(bootstrap_servers=info.bootstrap, request_timeout_ms=1_000)
    try:
        ensure_topics(conn, Topics(events=topic_name, dead_letters=topic_name + ".dl", control=topic_name + ".ctl",
                                   partitions=1))
        _produce_raw(conn, topic_name, 20)
        end = end_offsets(conn, topic_name)
        with PartitionReader(conn, max_wait_ms=50) as reader:
            assert len(reader.fetch(topic_name, 0, 0)) == 20
            stop_broker(data_dir)
            assert len(reader.fetch(topic_name, 0, 20)) == 0  # connection refused: an empty chunk, no exception
            with pytest.raises(ReadStalledError):
                list(read_partition(reader, OffsetRange(topic=topic_name, partition=0, start=20, end=end[0] + 1),
                                    stall_timeout_s=2))
    finally:
        stop_broker(data_dir)
