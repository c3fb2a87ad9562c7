"""``EpisodeStarted.purpose``: old events read as training, unknown purposes are refused, old readers refuse eval."""

from __future__ import annotations

import msgspec
import pytest

from schemas.codec import HEADER_SIZE, EventDecodeError, decode_event, encode_event, from_json, to_json
from schemas.events import SCHEMA_VERSION, EpisodeStarted


def _started(**kw) -> EpisodeStarted:
    return EpisodeStarted(event_id="e0", episode_id="ep", seq=0, producer_id="w", domain="math", task_id="t",
                          task_spec="{}", **kw)


def _frame_without_purpose(ev: EpisodeStarted, version: int) -> bytes:
    """The frame an older producer (schema ``version``, no ``purpose`` field) writes for ``ev``."""
    body = msgspec.msgpack.decode(encode_event(ev)[HEADER_SIZE:])
    del body["purpose"]
    body["schema_version"] = version
    header = bytearray(encode_event(ev)[:HEADER_SIZE])
    header[4:6] = version.to_bytes(2, "big")
    return bytes(header) + msgspec.msgpack.encode(body)


def test_default_and_round_trip():
    assert _started().purpose == "train"
    ev = _started(purpose="eval")
    assert decode_event(encode_event(ev)) == ev and from_json(to_json(ev)).purpose == "eval"


def test_events_of_schema_2_read_as_training():
    old = decode_event(_frame_without_purpose(_started(purpose="eval"), 2))
    assert (old.schema_version, old.purpose) == (2, "train")


def test_an_unknown_purpose_is_refused():
    with pytest.raises(ValueError, match="purpose"):
        _started(purpose="benchmark")
    body = msgspec.msgpack.decode(encode_event(_started())[HEADER_SIZE:])
    body["purpose"] = "benchmark"
    with pytest.raises(EventDecodeError):
        decode_event(encode_event(_started())[:HEADER_SIZE] + msgspec.msgpack.encode(body))


def test_a_schema_2_reader_refuses_schema_3_events(monkeypatch):
    # A reader of schema 2 (the same version check, older constant) dead-letters the event as from the future
    # rather than reading an eval episode as training data (docs/encoding.md).
    import schemas.codec as codec

    frame = encode_event(_started(purpose="eval"))
    assert int.from_bytes(frame[4:6], "big") == SCHEMA_VERSION == 3
    monkeypatch.setattr(codec, "SCHEMA_VERSION", 2)
    with pytest.raises(EventDecodeError) as err:
        codec.decode_event(frame)
    assert err.value.reason == "future_version"
