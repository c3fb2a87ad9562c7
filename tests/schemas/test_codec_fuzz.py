"""Fuzz target ``fuzz_decoder``: the binary/JSON event codec and the pipeline's DecodeAndValidate stage.

Inputs are mostly mutations of valid encoded events (bit flips, truncations, splices of two frames, rewritten
headers and versions, fields replaced by values of other types, length prefixes claiming 4 GiB, inserted and
deleted bytes), so the fuzzer gets past the header into the body decoder and the events' own checks; a few are
random bytes. Property: every input decodes to an event that re-encodes to a frame decoding to the same bytes,
or raises :class:`EventDecodeError` with a known reason (the pipeline turns it into a dead letter); nothing
else, and no allocation beyond a small multiple of the input.
"""

from __future__ import annotations

import struct
from datetime import datetime, timezone

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipelines.decode import _DecodeBatchFn
from pipelines.types import DEAD_LETTER_TAG, RawRecords
from schemas.codec import (
    DECODE_REASONS,
    HEADER_SIZE,
    MAGIC,
    EventDecodeError,
    decode_event,
    encode_event,
    from_json,
    to_json,
)
from schemas.deadletter import DeadLetter
from schemas.events import SCHEMA_VERSION, Event, Feedback, PolicyPublished
from streams.synth import generate_episodes
from tests import fuzzing

pytestmark = pytest.mark.fuzz

_T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
EVENTS: list[Event] = [ev for episode in generate_episodes(4, seed=11, group_size=2) for ev in episode] + [
    Feedback(event_id="f", episode_id="synth-11-00000000", seq=99, producer_id="ui", domain="math", task_id="t",
             source="reviewer", target_step=0, rating=0.5, event_time=_T0),
    PolicyPublished(event_id="p", episode_id="policy-3", seq=0, producer_id="trainer", domain="*", task_id="-",
                    version=3, location="/policies/3", event_time=_T0),
]
FRAMES = [encode_event(ev) for ev in EVENTS]
_MEMORY_LIMIT = 16 << 20  # the largest frame is a few KB; 16 MB is far above any honest decode

#: Length prefixes (MessagePack str32, bin32, array32, map32, ext32) claiming 4 GiB.
HUGE_PREFIXES = [b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                 b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01", b"\xc9\xff\xff\xff\xfc\x02"]

# Values a mutated field may take: every MessagePack kind, extreme numbers, token-array extensions of good and
# bad sizes, time strings with and without a zone.
field_values = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([0, -1, 1, 2**31, -(2**31) - 1, 2**63 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.binary(max_size=40),
    st.sampled_from(["2026-01-01T00:00:00", "2026-01-01T00:00:00Z", "not a time", "success", "tool_call"]),
    st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=33)),
    st.builds(msgspec.msgpack.Ext, st.sampled_from([1, 2]), st.binary(max_size=64)),
    st.lists(st.integers(-(2**40), 2**40), max_size=8), st.lists(st.floats(), max_size=8),
    st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), max_size=3),
)


def _body(frame: bytes) -> dict:
    return msgspec.msgpack.decode(frame[HEADER_SIZE:], ext_hook=lambda code, data: msgspec.msgpack.Ext(code,
                                                                                                        bytes(data)))


def _map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """A MessagePack map of already-encoded keys and values (map16 header)."""
    return b"\xde" + struct.pack(">H", len(pairs)) + b"".join(k + v for k, v in pairs)


@st.composite
def mutated_frames(draw) -> bytes:
    frame = draw(st.sampled_from(FRAMES))
    kind = draw(st.sampled_from(["flip", "truncate", "splice", "header", "field", "drop", "extra", "huge",
                                 "insert", "delete", "random_body", "random"]))
    if kind == "flip":
        return fuzzing.flip_bits(draw, frame, max_flips=8)
    if kind == "truncate":
        return frame[: draw(st.integers(0, len(frame) - 1))]
    if kind == "splice":
        other = draw(st.sampled_from(FRAMES))
        return frame[: draw(st.integers(0, len(frame)))] + other[draw(st.integers(0, len(other))):]
    if kind == "header":
        magic = draw(st.sampled_from([MAGIC, b"TK", b"\x00\x00"]))
        fmt = draw(st.sampled_from([1, 0, 2, 255]))
        code = draw(st.integers(0, 9))
        version = draw(st.sampled_from([0, 1, SCHEMA_VERSION, SCHEMA_VERSION + 1, 65535]))
        return struct.pack(">2sBBH", magic, fmt, code, version) + frame[HEADER_SIZE:]
    body = _body(frame)
    keys = sorted(body)
    if kind == "field":
        body[draw(st.sampled_from(keys))] = draw(field_values)
    elif kind == "drop":
        del body[draw(st.sampled_from(keys))]
    elif kind == "extra":
        body[draw(st.text(min_size=1, max_size=12))] = draw(field_values)
    elif kind == "huge":  # one field's value is a container whose length prefix claims 4 GiB
        key = draw(st.sampled_from(keys))
        pairs = [(msgspec.msgpack.encode(k), msgspec.msgpack.encode(v)) for k, v in body.items() if k != key]
        raw = draw(st.sampled_from(HUGE_PREFIXES)) + draw(st.binary(max_size=16))
        return frame[:HEADER_SIZE] + _map([*pairs, (msgspec.msgpack.encode(key), raw)])
    elif kind == "insert":
        at = draw(st.integers(0, len(frame)))
        return frame[:at] + draw(st.binary(min_size=1, max_size=8)) + frame[at:]
    elif kind == "delete":
        at = draw(st.integers(0, len(frame) - 1))
        return frame[:at] + frame[at + draw(st.integers(1, 8)):]
    elif kind == "random_body":
        return frame[:HEADER_SIZE] + draw(st.binary(max_size=64))
    else:
        return draw(st.binary(max_size=64))
    return frame[:HEADER_SIZE] + msgspec.msgpack.encode(body)


def _check_frame(frame: bytes) -> Event | None:
    """The codec's contract for one input; the event, or None when it was rejected."""
    try:
        event = decode_event(frame)
    except EventDecodeError as err:
        assert err.reason in DECODE_REASONS
        return None
    assert isinstance(event, Event)
    again = encode_event(event)
    assert encode_event(decode_event(again)) == again
    return event


@given(frame=mutated_frames())
def test_decode_event_accepts_or_raises_event_decode_error(frame):
    fuzzing.tried("fuzz_decoder")
    with fuzzing.python_memory_bound(_MEMORY_LIMIT):
        _check_frame(frame)


@given(data=st.data())
def test_from_json_accepts_or_raises_event_decode_error(data):
    fuzzing.tried("fuzz_decoder")
    text = bytearray(to_json(data.draw(st.sampled_from(EVENTS))))
    kind = data.draw(st.sampled_from(["flip", "truncate", "replace", "version"]))
    if kind == "flip":
        pos = data.draw(st.integers(0, len(text) * 8 - 1))
        text[pos // 8] ^= 1 << (pos % 8)
    elif kind == "truncate":
        del text[data.draw(st.integers(0, len(text) - 1)):]
    elif kind == "replace":  # one field's value replaced by another JSON value
        doc = msgspec.json.decode(bytes(text))
        doc[data.draw(st.sampled_from(sorted(doc)))] = data.draw(st.one_of(
            st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
            st.text(max_size=20), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)))
        text = bytearray(msgspec.json.encode(doc))
    else:
        doc = msgspec.json.decode(bytes(text))
        doc["schema_version"] = data.draw(st.sampled_from([0, -1, SCHEMA_VERSION + 1, 2**64 - 1]))
        text = bytearray(msgspec.json.encode(doc))
    with fuzzing.python_memory_bound(_MEMORY_LIMIT):
        try:
            event = from_json(bytes(text))
        except EventDecodeError as err:
            assert err.reason in DECODE_REASONS
        else:
            assert isinstance(event, Event)


@given(values=st.lists(st.one_of(mutated_frames(), st.sampled_from(FRAMES), st.none()), min_size=1, max_size=6),
       keys=st.lists(st.one_of(st.none(), st.binary(max_size=20), st.sampled_from(
           [ev.episode_id.encode() for ev in EVENTS])), min_size=6, max_size=6),
       timestamps=st.lists(st.integers(-(2**62), 2**62), min_size=6, max_size=6))
def test_decode_stage_routes_every_record_to_a_fragment_or_a_dead_letter(values, keys, timestamps):
    fuzzing.tried("fuzz_decoder")
    n = len(values)
    batch = RawRecords(topic="trajpipe.events", partition=3, offsets=list(range(100, 100 + n)), keys=keys[:n],
                       values=values, timestamps_ms=timestamps[:n])
    fn = _DecodeBatchFn(max_event_bytes=1 << 20, max_future_s=300.0)
    events = dead = 0
    with fuzzing.python_memory_bound(_MEMORY_LIMIT):
        outputs = list(fn.process(batch))
    for out in outputs:
        if getattr(out, "tag", None) == DEAD_LETTER_TAG:
            letter = out.value
            assert isinstance(letter, DeadLetter) and letter.source_partition == 3
            assert 100 <= letter.source_offset < 100 + n and letter.value == values[letter.source_offset - 100]
            dead += 1
        else:
            episode_id, fragment = out
            assert all(isinstance(ev, Event) and ev.episode_id == episode_id for ev in fragment)
            events += len(fragment)
    assert events + dead == n  # every record accounted for: nothing dropped, nothing invented


def test_length_prefixes_claiming_4_gib_are_truncated_not_allocated():
    header = next(f for f, ev in zip(FRAMES, EVENTS) if ev.event_type == "step")[:HEADER_SIZE]
    # (field, prefix of the field's own kind): msgspec checks the claimed length against the bytes left
    for field, prefix in [("action_text", HUGE_PREFIXES[0]), ("tool_args", HUGE_PREFIXES[0]),
                          ("action_token_ids", HUGE_PREFIXES[4]), ("behaviour_logprobs", HUGE_PREFIXES[5])]:
        with fuzzing.python_memory_bound(1 << 20), pytest.raises(EventDecodeError) as err:
            decode_event(header + _map([(msgspec.msgpack.encode(field), prefix + b"abc")]))
        assert err.value.reason == "truncated", err.value
    for prefix in HUGE_PREFIXES:  # a container where the body map should be
        with fuzzing.python_memory_bound(1 << 20), pytest.raises(EventDecodeError):
            decode_event(header + prefix + b"abc")
