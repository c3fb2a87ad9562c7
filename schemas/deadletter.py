"""The dead-letter record: a message that could not be used, kept with why and where from.

Any consumer that meets bytes it cannot decode (or an event it must reject)
writes one :class:`DeadLetter` to the dead-letters topic instead of failing or
dropping it, so counts reconcile (in = used + dead letters + duplicates) and
the raw bytes can be inspected or replayed after a fix.

The Kafka value is the MessagePack map of the struct's fields; the key is the
source message's key, so dead letters of one episode stay together.

Examples:
    >>> dl = DeadLetter(reason="bad_magic", message="frame starts with b'XX'",
    ...                 source_topic="trajpipe.events", source_partition=2, source_offset=41,
    ...                 key=b"ep1", value=b"XX garbage", detected_by="archiver")
    >>> decode_dead_letter(encode_dead_letter(dl)) == dl
    True
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from schemas.events import utc_now

__all__ = [
    "DEAD_LETTER_VERSION",
    "DeadLetter",
    "DeadLetterDecodeError",
    "encode_dead_letter",
    "decode_dead_letter",
    "dead_letter_headers",
]

#: Version of the dead-letter record layout this code writes.
DEAD_LETTER_VERSION = 1


class DeadLetter(msgspec.Struct, kw_only=True, frozen=True):
    """One quarantined message.

    Attributes:
        reason: machine-readable reason code; for decode failures one of
            :data:`schemas.codec.DECODE_REASONS` (``truncated``, ``bad_magic``,
            ``future_version``, ...), otherwise a short snake_case code chosen by
            the detector (e.g. ``invalid_event``).
        message: human-readable explanation of what was wrong.
        source_topic: topic the message was read from.
        source_partition: partition the message was read from.
        source_offset: offset of the message in that partition.
        key: the source message's key, raw bytes (None if it had none).
        value: the source message's value, raw bytes exactly as read (None for
            a null value), so it can be re-decoded after a fix. Cut to its first
            bytes only when it is too large to fit on the dead-letters topic
            (then ``value_size > len(value)``).
        timestamp: when the problem was detected, timezone-aware UTC.
        detected_by: the component that routed it (e.g. ``archiver``,
            ``pipeline.decode``).
        source_timestamp_ms: the source record's Kafka timestamp, epoch
            milliseconds, if known.
        event_type: event type named by the frame header, if it could be read.
        value_size: size of the source value in bytes (None for a null value).
        version: dead-letter layout version (:data:`DEAD_LETTER_VERSION`).
    """

    reason: str
    message: str
    source_topic: str
    source_partition: int
    source_offset: int
    key: bytes | None
    value: bytes | None
    detected_by: str
    timestamp: datetime = msgspec.field(default_factory=utc_now)
    source_timestamp_ms: int | None = None
    event_type: str | None = None
    value_size: int | None = None
    version: int = DEAD_LETTER_VERSION

    def __post_init__(self) -> None:
        if not self.reason:
            raise ValueError("`reason` must be a non-empty reason code")
        if self.timestamp.tzinfo is None:
            raise ValueError("`timestamp` must be timezone-aware (UTC)")


class DeadLetterDecodeError(ValueError):
    """Bytes on the dead-letters topic that are not a :class:`DeadLetter`."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DeadLetter)


def encode_dead_letter(dead_letter: DeadLetter) -> bytes:
    """Encode a dead letter to its Kafka value (a MessagePack map).

    Examples:
        >>> dl = DeadLetter(reason="truncated", message="3 bytes", source_topic="t",
        ...                 source_partition=0, source_offset=7, key=None, value=b"TJ\\x01",
        ...                 detected_by="test")
        >>> isinstance(encode_dead_letter(dl), bytes)
        True
    """
    return _encoder.encode(dead_letter)


def decode_dead_letter(buf: bytes | memoryview) -> DeadLetter:
    """Decode a Kafka value written by :func:`encode_dead_letter`.

    Raises:
        DeadLetterDecodeError: the bytes are not a dead-letter record.

    Examples:
        >>> try:
        ...     decode_dead_letter(b"\\x01")
        ... except DeadLetterDecodeError as err:
        ...     print("not a dead letter")
        not a dead letter
    """
    try:
        return _decoder.decode(buf)
    except (msgspec.DecodeError, ValueError) as err:
        raise DeadLetterDecodeError(f"not a dead-letter record: {err}") from None


def dead_letter_headers(dead_letter: DeadLetter) -> list[tuple[str, bytes]]:
    """Kafka record headers for a dead letter (schema id, version and reason).

    Examples:
        >>> dl = DeadLetter(reason="oversize", message="", source_topic="t", source_partition=0,
        ...                 source_offset=0, key=None, value=None, detected_by="test")
        >>> dead_letter_headers(dl)[0]
        ('trajpipe-schema', b'dead_letter')
    """
    return [
        ("trajpipe-schema", b"dead_letter"),
        ("trajpipe-schema-version", str(dead_letter.version).encode()),
        ("trajpipe-dead-letter-reason", dead_letter.reason.encode()),
    ]
