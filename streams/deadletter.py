"""Route messages that cannot be decoded to the dead-letters topic.

Any consumer decodes with :func:`decode_or_dead_letter`: it returns the event,
or writes a :class:`schemas.deadletter.DeadLetter` (reason code, message,
source position, raw key and value) and returns None, so a bad message is
quarantined and counted, never fatal and never silently dropped.

The dead letter goes through either a plain ``KafkaProducer`` (fire and
forget until its ``flush``) or an :class:`streams.producer.EventProducer`
bound to the dead-letters topic (spooled to disk if Kafka is down).

Examples:
    >>> from collections import namedtuple
    >>> Rec = namedtuple("Rec", "topic partition offset key value timestamp")
    >>> dl = dead_letter_for(Rec("trajpipe.events", 1, 77, b"ep9", b"junk!!", 1700000000000),
    ...                      EventDecodeError("bad_magic", "not a trajpipe event"), detected_by="doc")
    >>> dl.reason, dl.source_partition, dl.source_offset, dl.value
    ('bad_magic', 1, 77, b'junk!!')
"""

from __future__ import annotations

from typing import Any, Protocol

from kafka import KafkaProducer

from schemas.codec import DEFAULT_MAX_EVENT_BYTES, EventDecodeError, decode_event
from schemas.deadletter import DeadLetter, dead_letter_headers, encode_dead_letter
from schemas.events import AnyEvent
from streams.config import ConfigError
from streams.producer import EventProducer

__all__ = ["MAX_DEAD_LETTER_VALUE_BYTES", "SourceRecord", "dead_letter_for", "send_dead_letter", "decode_or_dead_letter"]


class SourceRecord(Protocol):
    """What a dead letter needs from a consumed record (``kafka``'s ``ConsumerRecord`` has it)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int


#: Raw values longer than this are cut in the dead letter (an ``oversize``
#: frame would not fit on the dead-letters topic otherwise).
MAX_DEAD_LETTER_VALUE_BYTES = 512 * 1024


def dead_letter_for(
    record: SourceRecord,
    error: EventDecodeError,
    *,
    detected_by: str,
    max_value_bytes: int = MAX_DEAD_LETTER_VALUE_BYTES,
) -> DeadLetter:
    """Build the dead letter for a record that failed to decode.

    Args:
        record: the consumed record.
        error: the decode error (its ``reason`` becomes the dead letter's reason).
        detected_by: the component routing it.
        max_value_bytes: keep at most this many bytes of the raw value.
    """
    ts = getattr(record, "timestamp", None)
    raw = record.value
    return DeadLetter(
        reason=error.reason,
        message=str(error),
        source_topic=record.topic,
        source_partition=record.partition,
        source_offset=record.offset,
        key=None if record.key is None else bytes(record.key),
        value=None if raw is None else bytes(raw[:max_value_bytes]),
        value_size=None if raw is None else len(raw),
        detected_by=detected_by,
        source_timestamp_ms=ts if isinstance(ts, int) and ts >= 0 else None,
        event_type=error.event_type,
    )


def send_dead_letter(
    producer: EventProducer | KafkaProducer,
    dead_letter_topic: str,
    record: SourceRecord,
    error: EventDecodeError,
    *,
    detected_by: str = "consumer",
) -> DeadLetter:
    """Write the dead letter of ``record`` to ``dead_letter_topic``.

    The message key is the source key (dead letters of one episode stay
    together). Delivery is asynchronous: it is acknowledged when the
    producer's ``flush()`` returns.

    Args:
        producer: a ``KafkaProducer``, or an ``EventProducer`` whose topic is
            ``dead_letter_topic``.
        dead_letter_topic: the dead-letters topic.
        record: the undecodable record.
        error: why it failed.
        detected_by: the component routing it.

    Returns:
        The dead letter that was sent.

    Raises:
        ConfigError: an ``EventProducer`` bound to another topic.
    """
    dead_letter = dead_letter_for(record, error, detected_by=detected_by)
    value = encode_dead_letter(dead_letter)
    headers = dead_letter_headers(dead_letter)
    if isinstance(producer, EventProducer):
        if producer.topic != dead_letter_topic:
            raise ConfigError(
                f"EventProducer writes to {producer.topic!r}, not the dead-letter topic {dead_letter_topic!r}; "
                "give dead letters their own EventProducer"
            )
        producer.emit_raw(dead_letter.key, value, headers)
    else:
        producer.send(dead_letter_topic, value=value, key=dead_letter.key, headers=headers)
    return dead_letter


def decode_or_dead_letter(
    record: SourceRecord,
    *,
    producer: EventProducer | KafkaProducer,
    dead_letter_topic: str,
    detected_by: str = "consumer",
    max_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    on_dead_letter: Any = None,
) -> AnyEvent | None:
    """Decode a record's value, or route it to the dead letters and return None.

    Args:
        record: the consumed record.
        producer: where dead letters go (see :func:`send_dead_letter`).
        dead_letter_topic: the dead-letters topic.
        detected_by: the component routing it.
        max_bytes: frames larger than this are dead letters with reason ``oversize``.
        on_dead_letter: optional ``callable(DeadLetter)``, e.g. to count by reason.

    Returns:
        The event, or None if the record went to the dead letters.
    """
    try:
        return decode_event(record.value, max_bytes=max_bytes)  # type: ignore[arg-type]
    except EventDecodeError as err:
        dead_letter = send_dead_letter(producer, dead_letter_topic, record, err, detected_by=detected_by)
        if on_dead_letter is not None:
            on_dead_letter(dead_letter)
        return None
