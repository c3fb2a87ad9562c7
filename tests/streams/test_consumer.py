"""end_offsets / read_range / group helpers against real Kafka and Tansu brokers."""

from __future__ import annotations

import time

import pytest

from schemas.codec import decode_event
from streams.admin import ensure_topics
from streams.consumer import (
    OffsetRange,
    ReadStalledError,
    UnknownTopicError,
    commit_offsets,
    committed_offsets,
    end_offsets,
    group_consumer,
    next_offsets,
    ranges_from,
    read_range,
)
from streams.producer import EventProducer
from tests.streams.conftest import make_events

pytestmark = pytest.mark.integration


def _produce(conn, topic, events, spool_dir):
    # linger + batching => multi-record batches (the case Tansu's ListOffsets gets wrong)
    with EventProducer(conn, topic, spool_dir=spool_dir, linger_ms=20) as producer:
        for ev in events:
            producer.emit(ev)
        assert producer.flush().sent == len(events)


def _read(conn, ranges, **kw):
    return [r for batch in read_range(conn, ranges, stall_timeout_s=10, **kw) for r in batch]


def test_read_range_stops_exactly_at_end_offsets(conn, topics, tmp_path):
    ensure_topics(conn, topics)
    first = make_events(episodes=12, steps=20)  # 240 events
    _produce(conn, topics.events, first, tmp_path / "a")
    end = end_offsets(conn, topics.events)
    assert sorted(end) == [0, 1, 2] and sum(end.values()) == 240
    ranges = ranges_from(topic=topics.events, start={}, end=end)

    second = make_events(episodes=12, steps=5, first_seq=20)  # 60 more, after the end offsets were taken
    _produce(conn, topics.events, second, tmp_path / "b")
    records = _read(conn, ranges, max_records=7)  # small batches: many polls, cut-offs mid-fetch
    assert len(records) == 240
    assert all(r.offset < end[r.partition] for r in records)
    assert {decode_event(r.value).event_id for r in records} == {ev.event_id for ev in first}

    end2 = end_offsets(conn, topics.events)
    assert sum(end2.values()) == 300
    rest = _read(conn, ranges_from(topic=topics.events, start=end, end=end2))
    assert {decode_event(r.value).event_id for r in rest} == {ev.event_id for ev in second}


def test_read_range_middle_slice(conn, topics, tmp_path):
    ensure_topics(conn, topics)
    _produce(conn, topics.events, make_events(episodes=3, steps=30), tmp_path)
    end = end_offsets(conn, topics.events)
    p = max(end, key=end.get)
    r = OffsetRange(topic=topics.events, partition=p, start=5, end=end[p] - 3)
    assert [rec.offset for rec in _read(conn, [r])] == list(range(5, end[p] - 3))
    assert _read(conn, [OffsetRange(topic=topics.events, partition=p, start=4, end=4)]) == []


def test_read_range_past_the_end_raises_instead_of_hanging(tansu_broker, topics, tmp_path):
    from streams.config import KafkaConnection

    conn = KafkaConnection(bootstrap_servers=tansu_broker.bootstrap, request_timeout_ms=2_000)
    ensure_topics(conn, topics)
    _produce(conn, topics.events, make_events(episodes=1, steps=3), tmp_path)
    end = end_offsets(conn, topics.events)
    p = max(end, key=end.get)
    with pytest.raises(ReadStalledError) as info:
        _ = [b for b in read_range(conn, [OffsetRange(topic=topics.events, partition=p, start=0, end=end[p] + 5)],
                                   stall_timeout_s=1.0)]
    assert info.value.remaining[0].end == end[p] + 5


def test_end_offsets_of_empty_and_unknown_topics(conn, topics):
    ensure_topics(conn, topics)
    assert end_offsets(conn, topics.events) == {0: 0, 1: 0, 2: 0}
    with pytest.raises(UnknownTopicError):
        end_offsets(conn, "no.such.topic.anywhere", timeout_s=1.0)


def test_group_commit_after_processing(kafka_broker, topics, tmp_path):
    from streams.config import KafkaConnection

    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=5_000)
    ensure_topics(conn, topics)
    _produce(conn, topics.events, make_events(episodes=4, steps=5), tmp_path)
    group = f"{topics.events}.g"
    assert committed_offsets(conn, group, topics.events) == {0: 0, 1: 0, 2: 0}
    consumer = group_consumer(conn, group, [topics.events])
    try:
        seen = []
        deadline = time.monotonic() + 90  # a group join can take many seconds on a loaded 2-core machine
        while len(seen) < 20 and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                seen.extend(batch)
        assert len(seen) == 20
        commit_offsets(consumer, next_offsets(seen))
    finally:
        consumer.close()
    assert committed_offsets(conn, group, topics.events) == end_offsets(conn, topics.events)
