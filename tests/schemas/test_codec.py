"""Round trips of every event type and every class of bad input."""

import struct

import msgspec
import numpy as np
import pytest

from schemas.codec import (
    HEADER_SIZE,
    TYPE_CODES,
    EventDecodeError,
    EventEncodeError,
    decode_event,
    encode_event,
    from_json,
    kafka_headers,
    peek_header,
    to_json,
)
from schemas.events import EVENT_TYPES, SCHEMA_VERSION, Step


def test_every_type_round_trips_binary_and_json(one_of_each):
    assert {e.event_type for e in one_of_each} == set(EVENT_TYPES)
    for ev in one_of_each:
        buf = encode_event(ev)
        assert peek_header(buf) == (ev.event_type, SCHEMA_VERSION)
        back = decode_event(buf)
        assert type(back) is type(ev) and back == ev
        assert from_json(to_json(ev)) == ev
        assert dict(kafka_headers(ev))["trajpipe-schema"] == ev.event_type.encode()


def test_token_arrays_are_packed_not_float_lists(one_of_each):
    step = one_of_each[1]
    buf = encode_event(step)
    # 300 int32 ids + 300 float32 logprobs + 40 obs ids = 2560 bytes of numbers,
    # plus ~500 bytes of field names and text.
    assert len(buf) < 2560 + 600
    as_lists = msgspec.msgpack.encode(msgspec.to_builtins(step, enc_hook=lambda a: a.tolist()))
    assert len(as_lists) > 1.3 * len(buf)
    back = decode_event(buf)
    assert back.action_token_ids.dtype == np.int32 and back.behaviour_logprobs.dtype == np.float32
    np.testing.assert_array_equal(back.behaviour_logprobs, step.behaviour_logprobs)


def test_the_arrays_fast_path_writes_the_bytes_the_general_one_does(one_of_each):
    """The encoder takes TokenIds / LogProbs by type and dtype identity; any other int32 / float32 array
    (a plain ndarray set on the event after it was built) takes the general path: same frame either way."""
    step = one_of_each[1]
    plain = msgspec.structs.replace(step)
    for name in ("observation_token_ids", "action_token_ids", "behaviour_logprobs"):
        setattr(plain, name, np.array(getattr(step, name)))  # a plain ndarray, not the view type
        assert type(getattr(plain, name)) is np.ndarray
    assert encode_event(plain) == encode_event(step)
    assert decode_event(encode_event(step)) == step
    swapped = msgspec.structs.replace(step)
    swapped.action_token_ids = step.action_token_ids.astype(">i4")  # not int32 as stored
    with pytest.raises(EventEncodeError, match="cannot encode"):
        encode_event(swapped)


@pytest.fixture
def good(one_of_each):
    return encode_event(one_of_each[1])


def _reason(buf) -> str:
    with pytest.raises(EventDecodeError) as info:
        decode_event(buf)
    assert str(info.value).startswith(f"[{info.value.reason}]")
    return info.value.reason


def test_truncated(good):
    assert _reason(good[:3]) == "truncated"
    assert _reason(good[: len(good) // 2]) == "truncated"
    assert _reason(b"") == "truncated"
    assert _reason(None) == "truncated"


def test_garbage_and_bad_magic(good):
    assert _reason(b"hello world, not an event") == "bad_magic"
    assert _reason(b'{"event_type": "step"}') == "bad_magic"


def test_unknown_type_and_frame(good):
    assert _reason(good[:3] + bytes([99]) + good[4:]) == "unknown_type"
    assert _reason(good[:2] + bytes([7]) + good[3:]) == "unsupported_frame"


def test_future_version(good):
    future = good[:4] + struct.pack(">H", SCHEMA_VERSION + 1) + good[HEADER_SIZE:]
    assert _reason(future) == "future_version"


def _frame(event_type: str, body: dict) -> bytes:
    return b"TJ" + bytes([1, TYPE_CODES[event_type]]) + struct.pack(">H", SCHEMA_VERSION) + msgspec.msgpack.encode(body)


def test_missing_required_field():
    body = {"event_type": "step_verified", "event_id": "x", "episode_id": "e", "seq": 1, "producer_id": "p",
            "domain": "d", "task_id": "t", "step_index": 0, "passed": True}  # no `verifier`
    assert _reason(_frame("step_verified", body)) == "missing_field"


def test_wrong_types():
    body = {"event_type": "step_verified", "event_id": "x", "episode_id": "e", "seq": "one", "producer_id": "p",
            "domain": "d", "task_id": "t", "step_index": 0, "verifier": "v", "passed": True}
    assert _reason(_frame("step_verified", body)) == "wrong_type"
    # token ids sent as a float list instead of the packed int32 extension
    body = {"event_type": "step", "event_id": "x", "episode_id": "e", "seq": 1, "producer_id": "p",
            "domain": "d", "task_id": "t", "step_index": 0, "action_token_ids": [1.5, 2.5]}
    assert _reason(_frame("step", body)) == "wrong_type"
    # header type and body tag disagree
    body["event_type"] = "feedback"
    assert _reason(_frame("step", body)) == "wrong_type"


def test_bad_token_array_extensions_are_malformed_not_a_crash():
    # Found by the fuzzer (tests/schemas/test_codec_fuzz.py): a flipped bit turned the int32 extension code 1
    # into -24, and the codec's ext hook raised a bare ValueError, which msgspec passes through: the pipeline's
    # decode stage crashed instead of writing a dead letter.
    env = {"event_type": "step", "event_id": "x", "episode_id": "e", "seq": 1, "producer_id": "p", "domain": "d",
           "task_id": "t", "step_index": 0}
    for ext, says in [(msgspec.msgpack.Ext(-24, b"\x01\x00\x00\x00"), "unknown MessagePack extension code -24"),
                      (msgspec.msgpack.Ext(1, b"\x01\x00\x00"), "int32 array buffer of 3 bytes"),
                      (msgspec.msgpack.Ext(2, b"\x00" * 5), "float32 array buffer of 5 bytes")]:
        with pytest.raises(EventDecodeError, match=says) as err:
            decode_event(_frame("step", {**env, "action_token_ids": ext}))
        assert err.value.reason == "malformed" and err.value.event_type == "step"


def test_invalid_values_are_wrong_type():
    body = {"event_type": "step_verified", "event_id": "x", "episode_id": "e", "seq": -4, "producer_id": "p",
            "domain": "d", "task_id": "t", "step_index": 0, "verifier": "v", "passed": True}
    assert _reason(_frame("step_verified", body)) == "wrong_type"


def test_oversize(one_of_each):
    step = one_of_each[1]
    with pytest.raises(EventDecodeError) as info:
        decode_event(encode_event(step), max_bytes=100)
    assert info.value.reason == "oversize"
    huge = msgspec.structs.replace(step, tool_result="x" * (2 << 20))
    with pytest.raises(EventEncodeError, match="over the"):
        encode_event(huge)


def test_json_bad_input():
    with pytest.raises(EventDecodeError) as info:
        from_json(b'{"event_type": "nope", "event_id": "x"}')
    assert info.value.reason == "unknown_type"
    with pytest.raises(EventDecodeError) as info:
        from_json(b'{"event_type": "step", "event_id": ')
    assert info.value.reason in ("truncated", "malformed")


def test_constructor_validates():
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        Step(event_id="a", episode_id="e", seq=1, producer_id="p", domain="d", task_id="t", step_index=0,
             action_token_ids=[1, 2, 3], behaviour_logprobs=[-0.1])
    with pytest.raises(TypeError, match="int32"):
        Step(event_id="a", episode_id="e", seq=1, producer_id="p", domain="d", task_id="t", step_index=0,
             action_token_ids=[2**40])
