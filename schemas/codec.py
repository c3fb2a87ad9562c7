"""Binary (Kafka) and JSON (debugging) encodings of the event model.

Binary frame, as written to Kafka and to the producer spool::

    offset  size  field
    0       2     magic  b"TJ"
    2       1     frame format version (1)
    3       1     event type code (1-based index into EVENT_TYPES)
    4       2     schema_version, big-endian uint16
    6       ...   MessagePack map of the event's fields (field names as keys)

Token ids and logprobs are MessagePack extension values holding the packed
little-endian ``int32`` / ``float32`` buffer (ext codes 1 and 2), so a 500-token
step costs 2 KB of raw numbers and decodes with one ``np.frombuffer`` instead of
500 float parses. docs/encoding.md records the measurement behind the choice.

The same header (type name and schema version) also travels as Kafka record
headers, see :func:`kafka_headers`.

Every failure to decode raises :class:`EventDecodeError` with a ``reason`` code
(one of :data:`DECODE_REASONS`) and a message that says what was wrong.

Examples:
    >>> from schemas.events import EpisodeFinished, EpisodeStatus
    >>> ev = EpisodeFinished(event_id="e9", episode_id="ep1", seq=9, producer_id="w0",
    ...                      domain="math", task_id="t1", status=EpisodeStatus.SUCCESS,
    ...                      outcome_reward=1.0)
    >>> decode_event(encode_event(ev)) == ev
    True
    >>> try:
    ...     decode_event(b"TJ\\x01")
    ... except EventDecodeError as err:
    ...     print(err.reason)
    truncated
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np

from schemas.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    AnyEvent,
    Event,
    LogProbs,
    TokenIds,
    as_logprobs,
    as_token_ids,
)

__all__ = [
    "MAGIC",
    "FRAME_VERSION",
    "HEADER_SIZE",
    "DEFAULT_MAX_EVENT_BYTES",
    "DECODE_REASONS",
    "EventDecodeError",
    "EventEncodeError",
    "encode_event",
    "decode_event",
    "peek_header",
    "to_json",
    "from_json",
    "kafka_headers",
    "TYPE_CODES",
]

MAGIC = b"TJ"
FRAME_VERSION = 1
HEADER_SIZE = 6
_HEADER = struct.Struct(">2sBBH")

#: Largest encoded event accepted by default (bytes). Kafka's default
#: ``message.max.bytes`` is ~1 MiB; steps with long tool output stay well below.
DEFAULT_MAX_EVENT_BYTES = 1 << 20

_EXT_INT32 = 1
_EXT_FLOAT32 = 2

#: event_type name -> 1-based type code in the frame header.
TYPE_CODES: dict[str, int] = {name: i + 1 for i, name in enumerate(EVENT_TYPES)}
_CODE_TO_CLASS: dict[int, type[Event]] = {TYPE_CODES[n]: c for n, c in EVENT_TYPES.items()}

DECODE_REASONS = (
    "truncated",
    "bad_magic",
    "unsupported_frame",
    "unknown_type",
    "future_version",
    "missing_field",
    "wrong_type",
    "malformed",
    "oversize",
)


class EventDecodeError(ValueError):
    """Bytes that are not a valid trajpipe event.

    Attributes:
        reason: short machine-readable code, one of :data:`DECODE_REASONS`.
        event_type: the event type from the header, if it could be read.
    """

    def __init__(self, reason: str, message: str, *, event_type: str | None = None) -> None:
        assert reason in DECODE_REASONS, reason
        super().__init__(f"[{reason}] {message}")
        self.reason = reason
        self.event_type = event_type


class EventEncodeError(ValueError):
    """An event that cannot be encoded (too large, or a field of the wrong kind)."""


_INT32_LE = np.dtype("<i4")
_FLOAT32_LE = np.dtype("<f4")


def _enc_hook(obj: Any) -> Any:
    # The events' own arrays first, by identity (type and dtype: what as_token_ids / as_logprobs build): two
    # compares instead of isinstance and two dtype equality tests, three arrays a step. Measured on the
    # producer bench's events: encode 2.9-4.1 -> 2.4-2.5 us an event, the same bytes.
    cls = type(obj)
    if cls is TokenIds and obj.dtype is _INT32_LE:
        return msgspec.msgpack.Ext(_EXT_INT32, obj.tobytes())
    if cls is LogProbs and obj.dtype is _FLOAT32_LE:
        return msgspec.msgpack.Ext(_EXT_FLOAT32, obj.tobytes())
    if isinstance(obj, np.ndarray):
        if obj.dtype == np.int32:
            return msgspec.msgpack.Ext(_EXT_INT32, obj.tobytes())
        if obj.dtype == np.float32:
            return msgspec.msgpack.Ext(_EXT_FLOAT32, obj.tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


class _BadExtension(ValueError):
    """A MessagePack extension value the event model has no use for (msgspec passes hook errors through)."""


def _ext_hook(code: int, data: memoryview) -> Any:
    # The view type built straight over the frame's buffer (what ``np.frombuffer(...).view(...)`` gives, one
    # array object instead of two: three arrays per step).
    if code == _EXT_INT32:
        if len(data) % 4:
            raise _BadExtension(f"int32 array buffer of {len(data)} bytes is not a multiple of 4")
        return TokenIds(len(data) // 4, _INT32_LE, data)
    if code == _EXT_FLOAT32:
        if len(data) % 4:
            raise _BadExtension(f"float32 array buffer of {len(data)} bytes is not a multiple of 4")
        return LogProbs(len(data) // 4, _FLOAT32_LE, data)
    raise _BadExtension(f"unknown MessagePack extension code {code}")


def _dec_hook(typ: type, obj: Any) -> Any:
    # Binary frames give TokenIds/LogProbs views already; JSON gives lists.
    if typ is TokenIds:
        if isinstance(obj, TokenIds):
            return obj
        if isinstance(obj, list):
            return as_token_ids(obj)
    elif typ is LogProbs:
        if isinstance(obj, LogProbs):
            return obj
        if isinstance(obj, list):
            return as_logprobs(obj)
    raise TypeError(f"Expected `{typ.__name__}`, got `{type(obj).__name__}`")


def _json_enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoders = {
    code: msgspec.msgpack.Decoder(cls, ext_hook=_ext_hook, dec_hook=_dec_hook)
    for code, cls in _CODE_TO_CLASS.items()
}
_json_encoder = msgspec.json.Encoder(enc_hook=_json_enc_hook)
_json_decoder = msgspec.json.Decoder(AnyEvent, dec_hook=_dec_hook)


def encode_event(event: Event, *, max_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> bytes:
    """Encode an event to its binary Kafka frame.

    Args:
        event: any event of :data:`schemas.events.EVENT_TYPES`.
        max_bytes: refuse frames larger than this.

    Returns:
        The frame bytes (header + MessagePack body).

    Raises:
        EventEncodeError: the event is larger than ``max_bytes`` or has a field
            of a kind the format cannot carry.

    Examples:
        >>> from schemas.events import Feedback
        >>> buf = encode_event(Feedback(event_id="f1", episode_id="ep1", seq=4, producer_id="ui",
        ...                             domain="code", task_id="t7", source="reviewer", rating=0.5))
        >>> buf[:2], peek_header(buf)
        (b'TJ', ('feedback', 3))
    """
    code = TYPE_CODES.get(type(event).event_type)
    if code is None or _CODE_TO_CLASS[code] is not type(event):
        raise EventEncodeError(f"not a trajpipe event type: {type(event).__name__}")
    try:
        body = _encoder.encode(event)
    except (NotImplementedError, TypeError, OverflowError) as err:
        raise EventEncodeError(f"cannot encode {type(event).__name__}: {err}") from err
    size = HEADER_SIZE + len(body)
    if size > max_bytes:
        raise EventEncodeError(
            f"{type(event).__name__} {event.event_id} encodes to {size} bytes, over the "
            f"{max_bytes}-byte limit; shorten tool output/observations or raise `max_event_bytes`"
        )
    return _HEADER.pack(MAGIC, FRAME_VERSION, code, event.schema_version) + body


def peek_header(buf: bytes | memoryview) -> tuple[str, int]:
    """Read ``(event_type, schema_version)`` from a frame header without decoding the body.

    Raises:
        EventDecodeError: the header is truncated, has the wrong magic, an
            unsupported frame version or an unknown type code.
    """
    if len(buf) < HEADER_SIZE:
        raise EventDecodeError("truncated", f"frame is {len(buf)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, frame_version, code, version = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise EventDecodeError("bad_magic", f"frame starts with {bytes(magic)!r}, not {MAGIC!r}: not a trajpipe event")
    if frame_version != FRAME_VERSION:
        raise EventDecodeError("unsupported_frame", f"frame format version {frame_version}; this reader knows {FRAME_VERSION}")
    cls = _CODE_TO_CLASS.get(code)
    if cls is None:
        raise EventDecodeError("unknown_type", f"unknown event type code {code}; known: {TYPE_CODES}")
    return cls.event_type, version


def decode_event(buf: bytes | memoryview, *, max_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> AnyEvent:
    """Decode one binary frame into its event.

    Args:
        buf: frame bytes as produced by :func:`encode_event`.
        max_bytes: reject larger frames before parsing them.

    Returns:
        The typed event.

    Raises:
        EventDecodeError: for every kind of bad input (see :data:`DECODE_REASONS`).
    """
    if buf is None:
        raise EventDecodeError("truncated", "empty message (null value)")
    if len(buf) > max_bytes:
        raise EventDecodeError("oversize", f"frame is {len(buf)} bytes, over the {max_bytes}-byte limit")
    event_type, version = peek_header(buf)
    if version > SCHEMA_VERSION:
        raise EventDecodeError(
            "future_version",
            f"{event_type} has schema_version {version}, newer than this reader's {SCHEMA_VERSION}; upgrade trajpipe",
            event_type=event_type,
        )
    if version < 1:
        raise EventDecodeError("malformed", f"schema_version {version} is not valid", event_type=event_type)
    body = memoryview(buf)[HEADER_SIZE:]
    try:
        event = _decoders[TYPE_CODES[event_type]].decode(body)
    except msgspec.ValidationError as err:
        raise _classify(err, event_type) from None
    except msgspec.DecodeError as err:
        reason = "truncated" if "truncated" in str(err).lower() else "malformed"
        raise EventDecodeError(reason, f"{event_type} body: {err}", event_type=event_type) from None
    except _BadExtension as err:
        raise EventDecodeError("malformed", f"{event_type} body: {err}", event_type=event_type) from None
    if event.schema_version != version:
        raise EventDecodeError(
            "malformed",
            f"header says schema_version {version} but the body says {event.schema_version}",
            event_type=event_type,
        )
    return event


def _classify(err: msgspec.ValidationError, event_type: str | None) -> EventDecodeError:
    msg = str(err)
    reason = "missing_field" if "missing required field" in msg else "wrong_type"
    return EventDecodeError(reason, f"{event_type or 'event'}: {msg}", event_type=event_type)


def to_json(event: Event) -> bytes:
    """The readable JSON form of an event (token arrays as plain lists).

    Examples:
        >>> from schemas.events import StepVerified
        >>> ev = StepVerified(event_id="v1", episode_id="ep1", seq=2, producer_id="w0", domain="math",
        ...                   task_id="t1", step_index=0, verifier="math.intermediate", passed=True, score=1.0)
        >>> from_json(to_json(ev)) == ev
        True
    """
    return _json_encoder.encode(event)


def from_json(data: bytes | str) -> AnyEvent:
    """Parse the JSON form back into a typed event.

    Raises:
        EventDecodeError: malformed JSON, unknown ``event_type``, future schema
            version, missing or mistyped fields.
    """
    try:
        event = _json_decoder.decode(data)
    except msgspec.ValidationError as err:
        msg = str(err)
        if "Invalid value" in msg and "$.event_type" in msg or "Object missing required field `event_type`" in msg:
            raise EventDecodeError("unknown_type", msg) from None
        raise _classify(err, None) from None
    except msgspec.DecodeError as err:
        reason = "truncated" if "truncated" in str(err).lower() else "malformed"
        raise EventDecodeError(reason, f"JSON: {err}") from None
    if event.schema_version > SCHEMA_VERSION:
        raise EventDecodeError(
            "future_version",
            f"schema_version {event.schema_version} is newer than this reader's {SCHEMA_VERSION}",
            event_type=event.event_type,
        )
    return event


def kafka_headers(event: Event) -> list[tuple[str, bytes]]:
    """Kafka record headers naming the schema id (event type) and version.

    Examples:
        >>> from schemas.events import PolicyPublished
        >>> kafka_headers(PolicyPublished(event_id="p", episode_id="policy-3", seq=0, producer_id="trainer",
        ...                               domain="*", task_id="-", version=3, location="/policies/3"))
        [('trajpipe-schema', b'policy_published'), ('trajpipe-schema-version', b'3')]
    """
    return [
        ("trajpipe-schema", event.event_type.encode()),
        ("trajpipe-schema-version", str(event.schema_version).encode()),
    ]
