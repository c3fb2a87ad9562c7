"""Beam coders for the job's element types (pickle costs ~50 µs per event; these ~5 µs).

:class:`TrajCoder` writes MessagePack with three extension types: events as
their binary Kafka frame (:func:`schemas.codec.encode_event`), 1-D numpy
arrays as raw buffers (int32 come back as ``TokenIds``, float32 as
``LogProbs``), and the pipeline's msgspec Structs as ``[type id, fields]``.
:func:`register_coders` registers it for every element type; the transforms
declare their output types so Beam picks it.

Examples:
    >>> import numpy as np
    >>> from schemas.datasets import Verification
    >>> c = TrajCoder()
    >>> v = ["ep", [Verification(verifier="x", passed=True, score=1.0)], np.array([1.5, 2.0])]
    >>> back = c.decode(c.encode(v)); back[1][0].verifier, back[2].tolist()
    ('x', [1.5, 2.0])
"""

from __future__ import annotations

from typing import Any

import apache_beam as beam
import msgspec
import numpy as np

from pipelines.late import LateEpisode
from pipelines.types import Episode, RawRecords
from schemas.codec import decode_event, encode_event
from schemas.datasets import StepRow, TrajectoryRow, Verification
from schemas.deadletter import DeadLetter
from schemas.events import Event, LogProbs, TokenIds

__all__ = ["TrajCoder", "register_coders"]

_EXT_EVENT, _EXT_ARRAY, _EXT_STRUCT = 10, 11, 12
_STRUCTS: tuple[type, ...] = (Episode, Verification, StepRow, TrajectoryRow, DeadLetter, RawRecords, LateEpisode)
_STRUCT_ID = {cls: i for i, cls in enumerate(_STRUCTS)}
_FIELDS = {cls: cls.__struct_fields__ for cls in _STRUCTS}
_VIEWS = {"<i4": TokenIds, "<f4": LogProbs}


def _pack(obj: Any) -> Any:
    """Replace events and Structs by extension values (msgspec encodes Structs natively otherwise)."""
    cls = type(obj)
    if cls in _STRUCT_ID:
        fields = [v if type(v) in _PLAIN else _pack(v) for v in msgspec.structs.astuple(obj)]
        return msgspec.msgpack.Ext(_EXT_STRUCT, _encoder.encode([_STRUCT_ID[cls], fields]))
    if cls is list or cls is tuple:
        return [v if type(v) in _PLAIN else _pack(v) for v in obj]
    if isinstance(obj, Event):
        return msgspec.msgpack.Ext(_EXT_EVENT, encode_event(obj, max_bytes=1 << 30))
    if isinstance(obj, msgspec.Struct):
        raise NotImplementedError(f"TrajCoder cannot encode {cls.__name__}")
    return obj


_PLAIN = frozenset({str, int, float, bool, type(None), bytes, np.ndarray, TokenIds, LogProbs})


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        dt = obj.dtype.str.encode()
        return msgspec.msgpack.Ext(_EXT_ARRAY, bytes([len(dt)]) + dt + np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"TrajCoder cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_EVENT:
        return decode_event(bytes(data), max_bytes=1 << 30)
    if code == _EXT_ARRAY:
        n = data[0]
        dt = bytes(data[1:1 + n]).decode()
        arr = np.frombuffer(bytes(data[1 + n:]), dtype=dt)
        view = _VIEWS.get(dt)
        return arr.view(view) if view is not None else arr
    if code == _EXT_STRUCT:
        type_id, values = _decoder.decode(data)
        cls = _STRUCTS[type_id]
        return cls(**dict(zip(_FIELDS[cls], values)))
    raise ValueError(f"unknown extension code {code}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def _rough_size(obj: Any, nested: bool = False) -> int:
    """Approximate encoded size in bytes without encoding: arrays and strings, one level deep."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes + 8
    if isinstance(obj, (str, bytes)):
        return len(obj) + 2
    if nested:
        return 256 if isinstance(obj, (msgspec.Struct, list, tuple)) else 8
    if isinstance(obj, (list, tuple)):
        return 4 + sum(_rough_size(v, True) for v in obj)
    return 256


class TrajCoder(beam.coders.Coder):
    """MessagePack coder for events, episodes and dataset rows (tuples/lists get Beam's own coders)."""

    def encode(self, value: Any) -> bytes:
        return _encoder.encode(_pack(value))

    def decode(self, encoded: bytes) -> Any:
        return _decoder.decode(encoded)

    def is_deterministic(self) -> bool:
        return False

    def estimate_size(self, value: Any, nested: bool = False) -> int:
        # Beam samples element sizes for its metrics; the default encodes the value, which
        # for a GroupByKey result (every row of a shard) is a whole second encoding pass.
        return _rough_size(value)

    def to_type_hint(self):
        return Any


def register_coders() -> None:
    """Use :class:`TrajCoder` for every element type of the job (idempotent)."""
    for cls in (Event, Episode, StepRow, TrajectoryRow, DeadLetter, RawRecords, LateEpisode):
        beam.coders.registry.register_coder(cls, TrajCoder)


register_coders()
