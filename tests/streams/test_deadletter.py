"""Dead letters: record round trip, and routing of undecodable messages through real brokers."""

from __future__ import annotations

import struct
from datetime import timezone

import pytest
from kafka import KafkaProducer

from schemas.codec import SCHEMA_VERSION, EventDecodeError, encode_event
from schemas.deadletter import DeadLetter, DeadLetterDecodeError, decode_dead_letter, encode_dead_letter
from streams.admin import ensure_topics
from streams.config import ConfigError
from streams.deadletter import dead_letter_for, decode_or_dead_letter, send_dead_letter
from streams.producer import EventProducer
from tests.helpers import produce_messages
from tests.streams.conftest import make_events, read_all


def test_dead_letter_round_trip():
    dl = DeadLetter(reason="future_version", message="v9", source_topic="ev", source_partition=3,
                    source_offset=123456789012, key=None, value=b"\x00\xff" * 10, detected_by="test",
                    source_timestamp_ms=1_700_000_000_000, event_type="step", value_size=20)
    back = decode_dead_letter(encode_dead_letter(dl))
    assert back == dl and back.timestamp.tzinfo is not None
    with pytest.raises(DeadLetterDecodeError):
        decode_dead_letter(b"TJ\x01\x02garbage")
    with pytest.raises(ValueError, match="reason"):
        DeadLetter(reason="", message="", source_topic="t", source_partition=0, source_offset=0, key=None,
                   value=None, detected_by="x")


def test_oversize_value_is_cut_but_sized():
    class Rec:
        topic, partition, offset, key, value, timestamp = "ev", 0, 5, b"k", b"x" * 1000, -1

    dl = dead_letter_for(Rec(), EventDecodeError("oversize", "too big"), detected_by="t", max_value_bytes=100)
    assert (len(dl.value), dl.value_size, dl.source_timestamp_ms) == (100, 1000, None)


def _bad_messages() -> dict[str, bytes]:
    good = encode_event(make_events(episodes=1, steps=2)[1])
    future = good[:4] + struct.pack(">H", SCHEMA_VERSION + 1) + good[6:]
    return {"bad_magic": b"not an event at all", "truncated": good[:4], "future_version": future}


@pytest.mark.integration
@pytest.mark.parametrize("via", ["kafka_producer", "event_producer"])
def test_routing_undecodable_messages(conn, topics, tmp_path, via):
    ensure_topics(conn, topics)
    good_events = make_events(episodes=1, steps=3)
    bad = _bad_messages()
    messages = [(b"ep-0", encode_event(good_events[0]))] + [(b"ep-0", v) for v in bad.values()] + [
        (b"ep-0", encode_event(ev)) for ev in good_events[1:]]
    produce_messages(conn.bootstrap_servers, topics.events, messages)

    producer = (KafkaProducer(**conn.client_kwargs(), acks="all") if via == "kafka_producer"
                else EventProducer(conn, topics.dead_letters, spool_dir=tmp_path))
    reasons: list[str] = []
    decoded = []
    sources = read_all(conn, topics.events)
    for rec in sources:
        ev = decode_or_dead_letter(rec, producer=producer, dead_letter_topic=topics.dead_letters,
                                   detected_by="test", on_dead_letter=lambda d: reasons.append(d.reason))
        if ev is not None:
            decoded.append(ev)
    producer.flush()
    producer.close()

    assert [ev.event_id for ev in decoded] == [ev.event_id for ev in good_events]
    assert reasons == list(bad)  # in source order
    letters = [decode_dead_letter(r.value) for r in read_all(conn, topics.dead_letters)]
    assert [d.reason for d in letters] == list(bad)
    by_value = {r.value: r for r in sources}
    for d in letters:
        src = by_value[d.value]
        assert (d.source_topic, d.source_partition, d.source_offset) == (topics.events, src.partition, src.offset)
        assert d.key == b"ep-0" and d.detected_by == "test" and d.timestamp.tzinfo == timezone.utc
        assert d.value == bad[d.reason] and d.value_size == len(bad[d.reason])
    assert letters[2].event_type == "step"  # the header of a future-version frame is still readable


def test_event_producer_for_another_topic_is_refused(tmp_path):
    from streams.config import KafkaConnection
    from tests.helpers import free_port

    dead = KafkaConnection(bootstrap_servers=f"127.0.0.1:{free_port()}", request_timeout_ms=500)
    with EventProducer(dead, "events", spool_dir=tmp_path, connect_timeout_ms=300, delivery_timeout_ms=1000) as p:

        class Rec:
            topic, partition, offset, key, value, timestamp = "events", 0, 1, None, b"x", 0

        with pytest.raises(ConfigError, match="dead-letter topic"):
            send_dead_letter(p, "dead-letters", Rec(), EventDecodeError("bad_magic", "x"))
